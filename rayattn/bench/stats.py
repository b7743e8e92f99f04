"""The one percentile rule of the benchmarks, the simulator and their reports."""

from __future__ import annotations

from collections.abc import Sequence


def percentile(sorted_xs: Sequence[float], p: float, empty: float = float("nan")) -> float:
    """The value at rank ⌊p·n⌋ of an ascending sequence (p50 of [1, 2, 3, 4] is 3);
    `empty` when there is none."""
    if not sorted_xs:
        return empty
    return sorted_xs[min(len(sorted_xs) - 1, int(p * len(sorted_xs)))]
