"""Trimming a mixed step down to a graph bucket (the scheduler's prefill budget policy).

Where a step's size is paid in padded graph buckets (`fill_sizes`: the runner's compute-bound
CUDA-graph token buckets), a mixed step whose tokens end just above a bucket is trimmed down to
it when that defers fewer prompt tokens than padding up would waste and than the step keeps;
the deferred tokens lead the next step, whose decode rows run anyway (that step may then be a
mixed step instead of a decode step, and the prompt's first token comes a step later):

    fill sizes 256, 320; 40 decode rows + 240 prompt tokens = 280
    padded:   [40 rows | 240 prompt | 40 padding]         -> the 320 graph
    trimmed:  [40 rows | 216 prompt]                      -> the 256 graph, 24 deferred

Steps without decode rows are never trimmed (an idle engine's prompt runs in one step), nor
steps below the smallest or above the largest bucket (no graph to pad to).
"""

from __future__ import annotations

from bisect import bisect_left


def trimmed_prefill_budget(num_rows: int, budget: int, fill_sizes: tuple[int, ...], waiting_tokens: int) -> int:
    """Prompt tokens a step with `num_rows` decode rows may take out of `budget`, given the
    `waiting_tokens` its waiting sequences could fill: `budget`, or the tokens that land the
    step exactly on the bucket below when the rule above trims it. fill_sizes is increasing."""
    if not num_rows or not fill_sizes:
        return budget
    total = num_rows + min(budget, waiting_tokens)
    i = bisect_left(fill_sizes, total)  # fill_sizes[i] >= total: the size padded up to
    if i == 0 or i == len(fill_sizes):
        return budget  # below the smallest size, or above the largest (no graph)
    lower, upper = fill_sizes[i - 1], fill_sizes[i]
    kept, deferred = lower - num_rows, total - lower
    # trimmed only if that defers less than it pads away (nothing at an exact size) and than it
    # keeps (no prompt crawls a few tokens a step behind a large decode batch)
    if deferred >= upper - total or deferred >= kept:
        return budget
    return kept
