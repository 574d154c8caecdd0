"""Building and running HumanEval-X programs: the compilers and runtimes each language needs, found once on
the host, and the sandbox job (``CommandJob``) that builds and runs one program in its scratch directory.

Under CodeGeeX's scoring a sample passes when its job exits 0 within the limits: C++ compiled with ``g++
-std=c++11`` (``-lcrypto -lssl`` when it includes OpenSSL) and run; Java ``javac Main.java`` then ``java Main``;
Go ``go test main_test.go`` (GOPATH mode, testify from Debian's golang-github-stretchr-testify-dev); JavaScript
``node test.js`` with nothing written to stdout or stderr (a failed ``console.assert`` only prints), as
CodeGeeX's harness decides. Under strict scoring (the default, ``languages.py``) the program also prints a
one-time token as its last act, and the job passes only if that is the last line of its output. A missing
compiler or library is one ``ToolchainError`` line that says what to install, before anything runs (``make
humaneval-x-deps`` installs all of it).

Go compiles testify and its dependencies on every cold ``go test`` (about 6 s). ``Toolchain("go")`` compiles
them on the host, from a fixed program of ours, into a build cache kept in the checkout (``.cache/go-build``,
beside ``.cache/node_modules``; a temporary one where that cannot be written): the first toolchain pays the 6 s,
later ones about 1 s. Every job copies that cache (read-only in the sandbox) into its scratch directory, which
brings a sample down to about 1 s.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from codegeex_train.evaluation.languages import GO_PACKAGES, get_language
from codegeex_train.evaluation.sandbox import CommandJob

__all__ = ["INSTALL_HINT", "Toolchain", "ToolchainError", "find_tools"]

INSTALL_HINT = "run `make humaneval-x-deps` in the codegeex_train checkout"
GOPATH = "/usr/share/gocode"  # where Debian's golang-*-dev packages put their sources
NODE_MODULES = Path(__file__).resolve().parents[2] / ".cache" / "node_modules"  # `make humaneval-x-deps`
GO_BUILD_CACHE = NODE_MODULES.with_name("go-build")  # testify compiled once per checkout (Go keys it by version)
# The JVM reserves its heap (a quarter of RAM), class space and code cache up front: bounded, it fits in 1 GB of
# address space; C1 only and the serial GC start it about twice as fast; no perf data file in /tmp.
JVM_FLAGS = ("-Xmx1g", "-Xss16m", "-XX:CompressedClassSpaceSize=64m", "-XX:ReservedCodeCacheSize=64m",
             "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1", "-XX:-UsePerfData")
GO_ENV = {"GO111MODULE": "off", "GOPATH": GOPATH, "GOPROXY": "off", "GOTOOLCHAIN": "local",
          "GOTELEMETRY": "off", "GOFLAGS": ""}
_GO_WARM_UP = ("package main\n\nimport (\n    \"testing\"\n    \"github.com/stretchr/testify/assert\"\n"
               + "".join(f"    _ \"{p}\"\n" for p in GO_PACKAGES)
               + ")\n\nfunc TestWarmUp(t *testing.T) {\n    assert.New(t).Equal(1, 1)\n}\n")


class ToolchainError(RuntimeError):
    """A compiler, runtime or library a language's problems need is missing (one line: what to install)."""


@dataclass(frozen=True)
class _Need:
    what: str
    install: str  # the Debian package (or command) that provides it
    marker: str = ""  # only problems whose text contains this need it ("": every problem)


_NEEDS = {
    "cpp": (_Need("g++", "g++"), _Need("boost/any.hpp", "libboost-dev", "boost/"),
            _Need("openssl/md5.h", "libssl-dev", "openssl/")),
    "java": (_Need("javac", "openjdk-17-jdk-headless"), _Need("java", "openjdk-17-jdk-headless")),
    "js": (_Need("node", "nodejs"), _Need("js-md5", "npm install --prefix .cache js-md5", "js-md5")),
    "go": (_Need("go", "golang-go"), _Need("testify", "golang-github-stretchr-testify-dev")),
}


def _binary(name: str) -> str | None:
    """The real file, not a link through /etc/alternatives: where it lives decides what the sandbox binds."""
    path = shutil.which(name)
    return os.path.realpath(path) if path else None


def _install_root(binary: str) -> list[str]:
    """A toolchain outside /usr (the sandbox always has /usr) is bound whole: the directory above its bin/."""
    return [] if binary.startswith("/usr/") else [str(Path(binary).parent.parent)]


def _found(need: _Need, node_modules: Path) -> str | None:
    if need.what in ("g++", "javac", "java", "node", "go"):
        return _binary(need.what)
    if need.what == "testify":
        path = Path(GOPATH, "src/github.com/stretchr/testify/assert")
    elif need.what == "js-md5":
        path = node_modules / "js-md5"
    else:
        path = Path("/usr/include", need.what)
    return str(path) if path.exists() else None


def _problem_text(problem: Mapping[str, str]) -> str:
    return "".join(str(problem.get(k, "")) for k in ("prompt", "declaration", "canonical_solution", "test"))


def find_tools(language: str, problems: Iterable[Mapping[str, str]] = (),
               node_modules: str | os.PathLike | None = None) -> dict[str, str]:
    """What ``language``'s ``problems`` need -> where it is here; one ``ToolchainError`` line naming all that is
    missing and how to install it."""
    lang = get_language(language)
    if lang.name == "python":
        return {}
    node_modules = Path(node_modules) if node_modules else NODE_MODULES
    texts = [_problem_text(p) for p in problems]
    needs = [n for n in _NEEDS[lang.name] if not n.marker or any(n.marker in t for t in texts)]
    found = {n.what: _found(n, node_modules) for n in needs}
    missing = [n for n in needs if found[n.what] is None]
    if missing:
        apt = " ".join(dict.fromkeys(n.install for n in missing if not n.install.startswith("npm")))
        npm = [n.install for n in missing if n.install.startswith("npm")]
        hints = ([f"apt-get install {apt}"] if apt else []) + npm
        raise ToolchainError(f"HumanEval-X {lang.name} needs {', '.join(n.what for n in missing)}, not found here: "
                             f"{INSTALL_HINT} (or {'; '.join(hints)})")
    return found


def _java_conf(javac: str) -> list[str]:
    """Debian's JDK keeps its conf/ files as links into /etc/java-N-openjdk: bind that directory too."""
    home = Path(javac).parent.parent
    targets = {os.path.realpath(p) for p in (home / "conf").rglob("*") if p.is_symlink()}
    outside = [t for t in targets if not t.startswith(str(home))]
    return [os.path.commonpath(outside)] if outside else []


class Toolchain:
    """What the sandbox needs to build and run one language's programs; ``job`` makes a sample's CommandJob.

    ``problems``: the problems to be run; a library only some of them need (boost, OpenSSL, js-md5) is
    required only when one of them does. ``close`` when done: Go's keeps a build cache."""

    def __init__(self, language: str, problems: Iterable[Mapping[str, str]] = (), *, timeout: float | None = None,
                 memory_mb: int | None = None, node_modules: str | os.PathLike | None = None) -> None:
        self.language = get_language(language)
        if self.language.name == "python":
            raise ValueError("python programs run through Sandbox.run, not a toolchain")
        self.timeout = timeout or self.language.timeout
        self.memory_mb = memory_mb or self.language.memory_mb
        self.node_modules = Path(node_modules) if node_modules else NODE_MODULES
        found = find_tools(language, problems, self.node_modules)
        self.bin = {what: path for what, path in found.items() if what in ("g++", "javac", "java", "node", "go")}
        if "javac" in self.bin and os.path.exists(Path(self.bin["javac"]).with_name("java")):
            self.bin["java"] = str(Path(self.bin["javac"]).with_name("java"))  # the same JDK's
        self.shell = _binary("sh") or "/bin/sh"
        self.env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
        self.ro_paths = [root for binary in self.bin.values() for root in _install_root(binary)]
        self.go_cache: str | None = None
        self._cache_dir: tempfile.TemporaryDirectory | None = None
        if "javac" in self.bin:
            self.ro_paths += _java_conf(self.bin["javac"])
        if self.language.name == "js" and self.node_modules.is_dir():
            self.env["NODE_PATH"] = str(self.node_modules)
            self.ro_paths.append(str(self.node_modules))
        if self.language.name == "go":
            self.env.update(GO_ENV)
            self._warm_go_cache(self.bin["go"])

    def _warm_go_cache(self, go: str) -> None:
        """Compile testify and the helper packages into the cache the jobs copy (see the module docstring)."""
        self._cache_dir = tempfile.TemporaryDirectory(prefix="codegeex-go-warm-")  # the program, its HOME
        warm = Path(self._cache_dir.name)
        cache = GO_BUILD_CACHE
        try:
            cache.mkdir(parents=True, exist_ok=True)
        except OSError:
            cache = warm / "cache"
        (warm / "main_test.go").write_text(_GO_WARM_UP)
        env = {**self.env, "GOCACHE": str(cache), "HOME": str(warm)}
        try:
            result = subprocess.run([go, "test", "main_test.go"], cwd=warm, env=env, capture_output=True,
                                    text=True, timeout=600, check=False)
        except subprocess.TimeoutExpired:
            raise ToolchainError("HumanEval-X go: compiling testify took over 10 minutes") from None
        if result.returncode != 0:
            last = (result.stdout + result.stderr).strip().splitlines()[-1:] or ["no output"]
            raise ToolchainError(f"HumanEval-X go: `go test` of a testify program fails here ({last[0]}): "
                                 f"{INSTALL_HINT} (or apt-get install golang-go golang-github-stretchr-testify-dev)")
        for path in [cache, *cache.rglob("*")]:  # samples run as another uid (nobody) and only read it
            try:
                path.chmod(0o755 if path.is_dir() else 0o644)
            except OSError:  # another toolchain's go trimmed it meanwhile, or it is not ours: go rebuilds what
                pass  #         it cannot read
        self.go_cache = str(cache)
        self.ro_paths.append(self.go_cache)

    def command(self, program: str, strict: bool = False) -> tuple[list[str], dict[str, str]]:
        """(argv, files) that build and run ``program``; stdout goes to stderr, whose end explains a failure.
        ``strict``: the program reports a token (``languages.build_program``) and runs as it must for that: the
        source removed once built (the token is in it), Java through ``CodegeexVerdict_``, Go's test binary run
        directly (``go test`` would print its "ok" line after the token)."""
        b = {name: shlex.quote(path) for name, path in self.bin.items()}
        failed_build = "{ echo compilation error >&2; exit 1; }"
        name = self.language.name
        if name == "cpp":
            libs = " -lcrypto -lssl" if "openssl/" in program else ""
            files = {"main.cpp": program}
            build = f"{b['g++']} -std=c++11 main.cpp -o main{libs} >&2 || {failed_build}"
            script = f"{build}; rm -f main.cpp; exec ./main >&2" if strict else f"{build}; exec ./main >&2"
        elif name == "java":
            files = {"Main.java": program}
            build = f"{b['javac']} {' '.join('-J' + f for f in JVM_FLAGS)} Main.java >&2 || {failed_build}"
            run = f"exec {b['java']} {' '.join(JVM_FLAGS)} -cp ."
            script = (f"{build}; rm -f Main.java; {run} CodegeexVerdict_ >&2" if strict else
                      f"{build}; {run} Main >&2")
        elif name == "js" and strict:
            files = {"test.js": program}
            script = f"exec {b['node']} test.js >&2"  # the harness checks the token is all it printed
        elif name == "js":
            files = {"test.js": program}
            # CodeGeeX's rule: any output is a failure (a failed console.assert prints and exits 0).
            script = (f"{b['node']} test.js > output.txt 2>&1; status=$?; "
                      f"if [ $status -ne 0 ] || [ -s output.txt ]; then tail -c 4000 output.txt >&2; exit 1; fi")
        else:
            files = {"main_test.go": program}
            cache = f'cp -R {shlex.quote(self.go_cache)} .gocache && GOCACHE="$PWD/.gocache"'
            # -test.paniconexit0: what go test passes (os.Exit(0) inside a test is a failure)
            script = (f"{cache} {b['go']} test -c -o main.test main_test.go >&2 || {failed_build}; "
                      f"rm -f main_test.go; exec ./main.test -test.paniconexit0 >&2" if strict else
                      f"{cache} exec {b['go']} test main_test.go >&2")
        return [self.shell, "-c", script], files

    def job(self, program: str, token: str | None = None) -> CommandJob:
        """The sandbox job for one program; with ``token`` (strict scoring: the program reports it), the job
        passes only if the token is the last line of its output (JavaScript: all of it)."""
        argv, files = self.command(program, strict=token is not None)
        return CommandJob(argv=argv, files=files, env=dict(self.env), ro_paths=tuple(self.ro_paths),
                          timeout=self.timeout, memory_mb=self.memory_mb, max_processes=self.language.max_processes,
                          token=token, only_token=token is not None and self.language.name == "js")

    def close(self) -> None:
        if self._cache_dir is not None:
            self._cache_dir.cleanup()
            self._cache_dir = None
