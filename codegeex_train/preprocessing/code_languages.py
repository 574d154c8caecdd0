"""Programming languages of source files: names, from an extension or a dataset's language field, and CodeGeeX's
language tag, the first line CodeGeeX's training data and prompts give a file: the language's line comment, then
``language: Name`` (``# language: Python``, ``// language: C++``; codegeex/benchmark/utils.py LANGUAGE_TAG).
"""

from __future__ import annotations

from pathlib import Path

# extension -> (language name, line-comment prefix) for CodeGeeX's language tag.
LANGUAGES: dict[str, tuple[str, str]] = {
    ".py": ("Python", "#"),
    ".c": ("C", "//"),
    ".h": ("C", "//"),
    ".cc": ("C++", "//"),
    ".cpp": ("C++", "//"),
    ".cxx": ("C++", "//"),
    ".hpp": ("C++", "//"),
    ".cu": ("Cuda", "//"),
    ".cs": ("C#", "//"),
    ".java": ("Java", "//"),
    ".js": ("JavaScript", "//"),
    ".ts": ("TypeScript", "//"),
    ".go": ("Go", "//"),
    ".rs": ("Rust", "//"),
    ".kt": ("Kotlin", "//"),
    ".scala": ("Scala", "//"),
    ".swift": ("Swift", "//"),
    ".dart": ("Dart", "//"),
    ".php": ("PHP", "//"),
    ".sh": ("Shell", "#"),
    ".rb": ("Ruby", "#"),
    ".pl": ("Perl", "#"),
    ".r": ("R", "#"),
    ".jl": ("Julia", "#"),
    ".sql": ("SQL", "--"),
    ".lua": ("Lua", "--"),
    ".hs": ("Haskell", "--"),
}

# lower-case name (as The Stack's `lang` and other datasets spell it) -> (our name, line-comment prefix)
_BY_NAME: dict[str, tuple[str, str]] = {
    **{name.lower(): (name, comment) for name, comment in LANGUAGES.values()},
    "c-sharp": ("C#", "//"), "csharp": ("C#", "//"), "cpp": ("C++", "//"), "js": ("JavaScript", "//"),
    "bash": ("Shell", "#"),
}


def language_of(path: str | Path | None = None, name: str | None = None) -> tuple[str, str] | None:
    """(name, line-comment prefix) from a dataset's language ``name`` when we know it, else from ``path``'s
    extension; None when neither is known."""
    if name:
        known = _BY_NAME.get(name.strip().lower())
        if known:
            return known
    return LANGUAGES.get(Path(path).suffix.lower()) if path else None


def language_header(path: str | Path | None = None, name: str | None = None) -> str:
    """CodeGeeX's first line for a source file, e.g. `# language: Python\\n`; '' if the language is unknown."""
    entry = language_of(path, name)
    return f"{entry[1]} language: {entry[0]}\n" if entry else ""
