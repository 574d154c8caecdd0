"""File-level deduplication: exact (a hash of the content) and near (MinHash LSH, datasketch).

``--dedup exact`` drops a file whose content is byte-identical to an earlier one. ``--dedup near`` does that and
also drops a file whose estimated Jaccard similarity to an earlier kept file reaches the threshold, on the sets
of 5-gram shingles of its words (runs of ``[A-Za-z0-9_]``: whitespace, punctuation and layout do not count).
The settings are StarCoder's (BigCode's near_deduplication: 5-grams of such words, 256 permutations, Jaccard
0.7; The Stack v1 used 0.85, which keeps more near copies). LSH (b bands of r rows, datasketch's choice for the
threshold) proposes candidates; each is confirmed with the two signatures' estimated Jaccard (1/sqrt(num_perm)
standard error: 0.03 at 256), so a pair well below the threshold that shares one band is not dropped. LSH needs
at least two bands, so the threshold's range follows from the permutation count (``check_lsh``: up to 0.989 at 256,
0.863 at 16).

A file is dropped when it duplicates any earlier file, kept or dropped itself: near duplicates chain (cp866.py and
cp1125.py of the stdlib's codecs are 0.8 alike, and a copy of the second is dropped though the second was), close
to BigCode's clusters of LSH pairs, of which one file is kept. The first file of a group is the one kept, so the
result depends on the input order, as any sequential deduplication's does. A file with fewer than 5 words is one
shingle of all its words; a file with no word at all is deduplicated exactly only. Memory: per distinct file a
16-byte digest and, for near, its signature (4 bytes a permutation) plus datasketch's band tables: about 2 KB a
file at 256 permutations.

``fingerprint`` is pure (it runs in the tokenizer workers); ``Deduplicator.check`` decides, in corpus order.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import re

import numpy as np

DEDUP_METHODS = ("exact", "near")
DEFAULT_THRESHOLD = 0.7
DEFAULT_NUM_PERM = 256
NGRAM = 5
_WORD = re.compile(r"[A-Za-z0-9_]+")
_MINHASH_SEED = 1  # every process draws the same permutations


def shingles(text: str, n: int = NGRAM) -> set[bytes]:
    """The n-grams of ``text``'s words, each joined by single spaces (all its words when it has fewer than n)."""
    words = _WORD.findall(text)
    if len(words) < n:
        return {" ".join(words).encode()} if words else set()
    return {" ".join(words[i:i + n]).encode() for i in range(len(words) - n + 1)}


@functools.lru_cache(maxsize=64)
def _lsh_fits(threshold: float, num_perm: int) -> bool:
    """Whether datasketch's MinHashLSH takes ``threshold`` at ``num_perm``: it picks the bands and rows that
    minimise false positives plus negatives, and refuses a choice of one band (ever more rows are needed to tell
    similarities close to 1 apart)."""
    from datasketch import MinHashLSH

    try:
        MinHashLSH(threshold=threshold, num_perm=num_perm)
    except ValueError:  # "The number of bands are too small (b < 2)"
        return False
    return True


def max_threshold(num_perm: int) -> float:
    """The largest --dedup-threshold, in steps of 0.001, that ``num_perm`` permutations allow (the range is one
    interval: the bands datasketch picks only shrink as the threshold grows)."""
    lo, hi = 1, 1000
    if _lsh_fits(1.0, num_perm):
        return 1.0
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if _lsh_fits(mid / 1000, num_perm) else (lo, mid)
    return lo / 1000


def check_lsh(threshold: float, num_perm: int) -> None:
    """ValueError naming both flags and the largest threshold that works when near deduplication cannot take
    ``threshold`` at ``num_perm`` permutations."""
    if not _lsh_fits(threshold, num_perm):
        top = max_threshold(num_perm)
        more = next((n for n in (64, 128, 256, 512, 1024) if n > num_perm and _lsh_fits(threshold, n)), None)
        raise ValueError(f"--dedup-threshold {threshold} is too high for --dedup-num-perm {num_perm}: MinHash LSH "
                         f"needs at least 2 bands, which {num_perm} permutations give up to a threshold of {top}; "
                         f"lower --dedup-threshold to {top} or less"
                         + (f", or raise --dedup-num-perm to {more}" if more else ""))


def jaccard(a: set, b: set) -> float:
    """The exact Jaccard similarity of two sets (1.0 for two empty sets)."""
    return len(a & b) / len(a | b) if a or b else 1.0


@dataclasses.dataclass(frozen=True)
class Fingerprint:
    digest: bytes
    """A hash of the exact content."""
    signature: np.ndarray | None
    """The MinHash signature (near only; None for a file without words)."""


@dataclasses.dataclass(frozen=True)
class Duplicate:
    kind: str
    """"exact" or "near"."""
    of: str
    """The origin of the kept file it duplicates."""
    similarity: float
    """1.0 for exact; the estimated Jaccard for near."""


class Deduplicator:
    """Which files of a stream are duplicates of an earlier one (``check``, in stream order)."""

    def __init__(self, method: str = "near", threshold: float = DEFAULT_THRESHOLD,
                 num_perm: int = DEFAULT_NUM_PERM):
        if method not in DEDUP_METHODS:
            raise ValueError(f"--dedup {method!r}: expected one of {', '.join(DEDUP_METHODS)}")
        if not 0.0 < threshold <= 1.0:
            raise ValueError(f"--dedup-threshold {threshold}: must be in (0, 1]")
        if method == "near":
            check_lsh(threshold, num_perm)
        self.method, self.threshold, self.num_perm = method, threshold, num_perm
        self._exact: dict[bytes, str] = {}
        self._signatures: dict[int, tuple[np.ndarray, str]] = {}
        self.removed: list[dict] = []
        self.files = 0
        if method == "near":
            from datasketch import MinHash, MinHashLSH  # imported only when near deduplication is asked for

            self._template = MinHash(num_perm=num_perm, seed=_MINHASH_SEED)
            self._lsh = MinHashLSH(threshold=threshold, num_perm=num_perm)

    def __getstate__(self) -> dict:
        """What a worker needs for ``fingerprint``: the settings (the permutations are redrawn from the seed)."""
        return {"method": self.method, "threshold": self.threshold, "num_perm": self.num_perm}

    def __setstate__(self, state: dict) -> None:
        self.__init__(**state)

    def fingerprint(self, content: str) -> Fingerprint:
        digest = hashlib.blake2b(content.encode("utf-8", "surrogatepass"), digest_size=16).digest()
        if self.method != "near":
            return Fingerprint(digest, None)
        grams = shingles(content)
        if not grams:
            return Fingerprint(digest, None)
        from datasketch import MinHash

        minhash = MinHash(num_perm=self.num_perm, permutations=self._template.permutations,
                          scheme=self._template.scheme)
        minhash.update_batch(grams)
        return Fingerprint(digest, minhash.hashvalues)

    def check(self, origin: str, fingerprint: Fingerprint) -> Duplicate | None:
        """The earlier file ``origin``'s content duplicates (then drop it), or None (keep it). Either way a
        content not seen before is remembered, so that its own near copies are found."""
        self.files += 1
        found = self._find(fingerprint)
        if found is not None:
            self.removed.append({"file": origin, "kind": found.kind, "duplicate_of": found.of,
                                 "similarity": round(found.similarity, 4)})
            if found.kind == "exact":
                return found
        self._exact[fingerprint.digest] = origin
        if fingerprint.signature is not None:
            key = len(self._signatures)
            self._signatures[key] = (fingerprint.signature, origin)
            self._lsh.insert(key, self._minhash(fingerprint.signature), check_duplication=False)
        return found

    def _find(self, fingerprint: Fingerprint) -> Duplicate | None:
        if fingerprint.digest in self._exact:
            return Duplicate("exact", self._exact[fingerprint.digest], 1.0)
        if fingerprint.signature is None:
            return None
        best: tuple[float, str] | None = None
        for key in self._lsh.query(self._minhash(fingerprint.signature)):
            other, origin = self._signatures[key]
            similarity = float(np.mean(other == fingerprint.signature))
            if similarity >= self.threshold and (best is None or similarity > best[0]):
                best = (similarity, origin)
        return Duplicate("near", best[1], best[0]) if best else None

    def _minhash(self, signature: np.ndarray):
        from datasketch import LeanMinHash

        return LeanMinHash(seed=_MINHASH_SEED, hashvalues=signature, scheme=self._template.scheme)

    def report(self) -> dict:
        """What PREFIX_dedup.json holds: the settings, the counts and every removed file with the one it copies."""
        counts = {kind: sum(r["kind"] == kind for r in self.removed) for kind in DEDUP_METHODS}
        settings = {"method": self.method}
        if self.method == "near":
            settings.update(threshold=self.threshold, num_perm=self.num_perm, shingles=f"{NGRAM}-grams of words "
                            f"({_WORD.pattern})", lsh_bands=self._lsh.b, lsh_rows=self._lsh.r)
        return {**settings, "files": self.files, "kept": self.files - len(self.removed),
                "removed": len(self.removed), "removed_exact": counts["exact"], "removed_near": counts["near"],
                "removed_files": self.removed}
