"""The unbiased pass@k estimator (Chen et al. 2021, "Evaluating Large Language Models Trained on Code").

With n samples of a task of which c pass, the probability that at least one of k samples drawn without
replacement passes is ``1 - C(n-c, k) / C(n, k)``. The binomials overflow floats for n in the hundreds, so it
is computed as the product ``1 - prod_{i=n-c+1}^{n} (1 - k / i)``, which is the same ratio written term by
term. pass@k of a benchmark is the mean over its tasks.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

__all__ = ["estimate_pass_at_k", "pass_at_k", "parse_ks"]


def estimate_pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one task with ``n`` samples, ``c`` of them correct (needs 1 <= k <= n)."""
    if not 0 <= c <= n:
        raise ValueError(f"correct samples c={c} must be in [0, n={n}]")
    if not 1 <= k <= n:
        raise ValueError(f"k={k} must be in [1, n={n}]")
    if n - c < k:  # every draw of k samples contains a correct one
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def pass_at_k(counts: Iterable[tuple[int, int]], ks: Sequence[int]) -> dict[int, float]:
    """Mean pass@k over tasks given (n, c) per task, for each k that every task's n allows (k <= min n)."""
    counts = list(counts)
    if not counts:
        raise ValueError("no tasks")
    smallest = min(n for n, _ in counts)
    return {k: sum(estimate_pass_at_k(n, c, k) for n, c in counts) / len(counts)
            for k in sorted(set(ks)) if k <= smallest}


def parse_ks(text: str) -> list[int]:
    """"1,10,100" -> [1, 10, 100]."""
    try:
        ks = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"{text!r}: expected comma-separated integers such as 1,10,100") from None
    if not ks or min(ks) < 1:
        raise ValueError(f"{text!r}: every k must be >= 1")
    return sorted(set(ks))
