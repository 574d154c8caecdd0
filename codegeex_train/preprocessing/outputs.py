"""What a preprocessing run leaves: its summary line, and the files beside the datasets (the JSON reports of
deduplication and decontamination, the tokenizer with the sentinels appended, each dataset's tokenizer record
``PREFIX.meta.json``), which appear with the datasets or not at all."""

from __future__ import annotations

import dataclasses
import os

from codegeex_train.tokenization.tokenizer import Tokenizer


@dataclasses.dataclass
class PreprocessSummary:
    documents: int
    tokens: int
    seconds: float
    output_prefixes: list[str]
    skipped_bad: int = 0
    """Bad records skipped with ``skip_bad_lines`` (summed over JSON keys)."""
    skipped_oversized: int = 0
    """Documents longer than ``max_document_chars``, skipped (summed over JSON keys)."""
    max_document_chars: int = 0
    skipped_links: int = 0
    """Symbolic links in input directories, not followed (input_tree.py)."""
    skipped_special: int = 0
    """FIFOs, sockets and device nodes in input directories, not read."""
    follow_symlinks: bool = False
    files: int = 0
    """Source files kept (repository documents: in all the documents)."""
    duplicates: int = 0
    contaminated: int = 0
    reports: list[str] = dataclasses.field(default_factory=list)
    """The JSON reports written beside the outputs."""
    tokenizer_file: str | None = None
    """The tokenizer with the sentinels appended, when they were."""

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)

    @property
    def documents_per_second(self) -> float:
        return self.documents / max(self.seconds, 1e-9)

    def __str__(self) -> str:
        notes = ""
        if self.skipped_bad:
            notes += f"; skipped {self.skipped_bad} bad records (--skip-bad-lines)"
        if self.skipped_oversized:
            notes += (f"; skipped {self.skipped_oversized} documents over --max-document-chars "
                      f"{self.max_document_chars}")
        if self.skipped_links:
            notes += (f"; skipped {self.skipped_links} symbolic links in input directories "
                      + ("(leading out of them, to a directory or nowhere)" if self.follow_symlinks else
                         "(not followed: --follow-symlinks follows those to files inside)"))
        if self.skipped_special:
            notes += f"; skipped {self.skipped_special} FIFOs, sockets or devices in input directories"
        if self.files != self.documents:
            notes += f"; {self.files} files in the documents"
        if self.reports:
            notes += (f"; removed {self.duplicates} duplicate and {self.contaminated} contaminated files "
                      f"({', '.join(self.reports)})")
        if self.tokenizer_file:
            notes += (f"; the sentinels were appended to the tokenizer: train with --tokenizer-type HFTokenizer "
                      f"--tokenizer-model {self.tokenizer_file}")
        return (
            f"{self.documents} documents, {self.tokens} tokens in {self.seconds:.1f} s "
            f"({self.documents_per_second:,.0f} docs/s, {self.tokens_per_second:,.0f} tokens/s) "
            f"-> {', '.join(p + '.bin/.idx' for p in self.output_prefixes)}{notes}"
        )


class Reports:
    """Files beside the outputs (JSON reports, the tokenizer): written as .tmp at once, renamed when the stack
    holding this closes cleanly (after the datasets are), removed otherwise."""

    def __init__(self) -> None:
        self.paths: list[str] = []

    def add(self, path: str, text: str) -> None:
        self.paths.append(path)
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            f.write(text)

    def __enter__(self) -> Reports:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        for path in self.paths:
            if exc_type is None:
                os.replace(path + ".tmp", path)
            elif os.path.exists(path + ".tmp"):
                os.remove(path + ".tmp")


def tokenizer_json(tokenizer: Tokenizer) -> str | None:
    """The tokenizer.json text of a Hugging Face tokenizer (whitespace encoding's inner one); None otherwise."""
    hf = getattr(getattr(tokenizer, "inner", tokenizer), "_tokenizer", None)
    return hf.to_str(pretty=True) if hf is not None and hasattr(hf, "to_str") else None
