"""Percentiles of measured times, shared by bench.py's run statistics and the device probes, and
sums of per-step values by row-count bucket."""

from __future__ import annotations

from collections.abc import Sequence


def percentile(values: Sequence[float], q: float) -> float:
    """q-th percentile (0-100) with linear interpolation between the closest ranks (numpy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    ordered = sorted(values)
    pos = q / 100 * (len(ordered) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def bucket_edges(max_rows: int, first: int = 8, ratio: int = 4) -> list[int]:
    """Upper row bounds of the buckets first, first * ratio, ... up to the first >= max_rows:
    8, 32, 128, 512 for max_rows 256."""
    edges = [first]
    while edges[-1] < max_rows:
        edges.append(edges[-1] * ratio)
    return edges


def sum_by_rows(rows: Sequence[int], values: Sequence[float], edges: Sequence[int]) -> list[tuple[int, float]]:
    """(count, sum of values) of the steps whose rows fall in each bucket (prev edge, edge]."""
    out = [[0, 0.0] for _ in edges]
    for r, v in zip(rows, values, strict=True):
        i = next((i for i, e in enumerate(edges) if r <= e), len(edges) - 1)
        out[i][0] += 1
        out[i][1] += v
    return [(n, v) for n, v in out]
