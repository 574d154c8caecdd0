"""Files dropped before documents are made: copies of benchmark problems (decontaminate.py), then duplicates
(dedup.py), both on single files, before any grouping into repository documents.

Each file's stateless work (the benchmark search, the MinHash signature) is ``FileFilter.inspect``, which can run
in worker processes (a FileFilter pickles into them); the decisions (``filtered``) are taken here in corpus order,
so any number of workers drops the same files. A contaminated file is dropped before deduplication sees it, so
every copy of a benchmark problem is named in the decontamination report.
"""

from __future__ import annotations

import collections
import dataclasses
import importlib.util
from collections.abc import Callable, Iterable, Iterator

from codegeex_train.preprocessing.decontaminate import DEFAULT_MIN_CHARS, BenchmarkString, Decontaminator
from codegeex_train.preprocessing.dedup import DEDUP_METHODS, DEFAULT_NUM_PERM, DEFAULT_THRESHOLD, Deduplicator, check_lsh
from codegeex_train.preprocessing.source_files import SourceFile
from codegeex_train.preprocessing.worker_pool import BATCH_CHARS, batches


@dataclasses.dataclass(frozen=True)
class FilterSpec:
    """Which files are dropped: duplicates (--dedup), benchmark copies (--decontaminate)."""

    dedup: str | None = None
    """--dedup: None, "exact" or "near"."""
    threshold: float = DEFAULT_THRESHOLD
    """--dedup-threshold: the Jaccard similarity at which a file is a near duplicate."""
    num_perm: int = DEFAULT_NUM_PERM
    """--dedup-num-perm: MinHash permutations."""
    benchmarks: tuple[BenchmarkString, ...] = ()
    """The strings --decontaminate searches for (tools/preprocess_data.py loads them)."""
    min_chars: int = DEFAULT_MIN_CHARS
    """Benchmark strings shorter than this (normalized) are not searched for."""

    def validate(self) -> None:
        if self.dedup is not None and self.dedup not in DEDUP_METHODS:
            raise ValueError(f"--dedup {self.dedup!r}: expected one of {', '.join(DEDUP_METHODS)}")
        if not 0.0 < self.threshold <= 1.0:
            raise ValueError(f"--dedup-threshold {self.threshold}: must be in (0, 1] (StarCoder's: 0.7)")
        if not 16 <= self.num_perm <= 1024:
            raise ValueError(f"--dedup-num-perm {self.num_perm}: must be in 16..1024 (StarCoder's: 256)")
        if self.dedup == "near" and importlib.util.find_spec("datasketch") is None:
            raise ValueError("--dedup near needs the datasketch package (pip install datasketch, or pip install -e .)")
        if self.dedup == "near":
            check_lsh(self.threshold, self.num_perm)

    @property
    def active(self) -> bool:
        return self.dedup is not None or bool(self.benchmarks)


# One file's facts from ``inspect``: (its dedup fingerprint or None, the benchmark string it holds or None).
Facts = tuple


class FileFilter:
    """The deduplicator and decontaminator a FilterSpec asks for, and what they dropped."""

    def __init__(self, spec: FilterSpec):
        spec.validate()
        self.dedup = Deduplicator(spec.dedup, spec.threshold, spec.num_perm) if spec.dedup else None
        self.decontaminator = Decontaminator(spec.benchmarks, spec.min_chars) if spec.benchmarks else None

    def inspect(self, texts: list[str]) -> list[Facts]:
        """Each text's facts; pure, so it may run in a worker on a copy of this filter."""
        dedup, decontaminator = self.dedup, self.decontaminator
        return [(dedup.fingerprint(text) if dedup else None, decontaminator.match(text) if decontaminator else None)
                for text in texts]

    def filtered(self, files: Iterable[SourceFile], inspect: Callable[[Iterator[list[str]]], Iterator[list[Facts]]],
                 docs_per_batch: int) -> Iterator[SourceFile]:
        """``files`` without the contaminated ones and the duplicates, in order. ``inspect`` maps batches of texts
        to their facts in order (``lambda texts: map(self.inspect, texts)``, or a worker pool's imap)."""
        pending: collections.deque[list[SourceFile]] = collections.deque()

        def texts() -> Iterator[list[str]]:
            for batch in batches(files, docs_per_batch, BATCH_CHARS, lambda f: len(f.content)):
                pending.append(batch)
                yield [f.content for f in batch]

        for facts in inspect(texts()):
            for file, (fingerprint, benchmark) in zip(pending.popleft(), facts):
                if benchmark is not None:
                    self.decontaminator.drop(file.origin, file.repo, file.path, benchmark)
                elif self.dedup is None or self.dedup.check(file.origin, fingerprint) is None:
                    yield file

    @property
    def duplicates(self) -> int:
        return len(self.dedup.removed) if self.dedup else 0

    @property
    def contaminated(self) -> int:
        return len(self.decontaminator.dropped) if self.decontaminator else 0

    def reports(self) -> dict[str, dict]:
        """{"dedup": ..., "decontamination": ...}: the reports of the filters that ran."""
        out = {}
        if self.dedup:
            out["dedup"] = self.dedup.report()
        if self.decontaminator:
            out["decontamination"] = self.decontaminator.report()
        return out
