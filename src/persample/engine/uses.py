"""The uses of each parameter in one captured batch: how many ops or module calls
contribute to its per-sample gradient, and, where every use is an op with a factor rule,
each use's factors ``G_n = sum_t L[n, t] outer R[n, t]`` (``rules.ghost``), from which
the norms (:mod:`persample.engine.norms`), the inner products and projections
(:mod:`persample.engine.factored_batch`), K-FAC (:mod:`persample.curvature`) and a
parameter several ops read (:mod:`persample.engine.pullback`) are formed.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..capture import Op
from ..precision import accumulate_dtype, cast
from ..rules import Decline, OpCall, rules_of
from .captured import Captured


def norm_dtype(op: Op) -> torch.dtype:
    """The dtype an op's norms accumulate in (that of :func:`backprops_of`)."""
    return accumulate_dtype(*(op.leaves[k].dtype for k in op.sources))


def backprops_of(captured: Captured, op: Op) -> tuple[Tensor | None, OpCall]:
    """The op's backprops ``(n, 1, *out)`` and its :class:`OpCall`, both in the dtype its
    norms accumulate in."""
    dtype = norm_dtype(op)
    (g,) = captured.backprops(op.edges, op.out_layouts)
    return cast(g, dtype), OpCall(op, captured.n, dtype)


def use_factors(captured: Captured, wanted: set[int], sites: dict[int, int] | None = None,
                column: int | None = None, curvature: bool = False, every: bool = True
                ) -> dict[int, tuple[list[Op], list]]:
    """``{id(p): (ops, [Factors of each op's use])}`` for the parameters ``wanted`` (ids)
    every one of whose uses is an op with a factor rule (an ``OpSpec`` ``factors`` rule): read
    directly (not through a derived tensor), by ops not changed in place since, with one
    output each. The factors are in the dtype the norms accumulate in; ``column``: of
    that cotangent of a backward with several (``captured.v``), else of the one;
    ``curvature``: with the curvature-only factor rules too (``curvature_factors``).
    ``every=False``: the uses that are such ops, where there are at least two, whatever
    else contributes (a derived tensor read, a use with no factor rule)."""
    if every and sites is None:  # (every=False counts no sites)
        sites = sites_of(captured)
    readers: dict[int, list[Op]] = {}
    for op in captured.plan.uses:
        for k, pids in op.sources.items():
            pid = id(op.leaves[k])
            if pid in wanted and pids == {pid}:
                readers.setdefault(pid, []).append(op)
    found: dict[int, tuple[list[Op], list]] = {}
    for pid, ops in readers.items():
        if len(set(ops)) != len(ops):  # (an op reading it twice)
            continue
        if every and (len(ops) != sites.get(pid) or any(
                op.changed() or len(op.edges) != 1 for op in ops)):
            continue
        kept, uses = [], []
        for op in ops:
            got = None if op.changed() or len(op.edges) != 1 else _factors(
                captured, op, captured.param(pid), column, curvature)
            if got is None and every:
                break
            if got is not None:
                kept.append(op)
                uses.append(got)
        else:
            if every or len(kept) > 1:
                found[pid] = (kept, uses)
    return found


def _factors(captured: Captured, op: Op, p: Tensor, column: int | None = None,
             curvature: bool = False) -> Any:
    """The factors of ``op``'s use of ``p`` (its factor rule; ``column``: of that
    cotangent; ``curvature``: its curvature-only rule first), or ``None``."""
    spec = rules_of(op)
    rule = None if spec is None else (
        spec.curvature_factors or spec.factors if curvature else spec.factors)
    if rule is None:
        return None
    g, call = backprops_of(captured, op)
    if g is None:
        return None
    if column is not None:
        g = g[:, column:column + 1]  # (n, 1, *out)
    try:
        return rule(call, g, {p}).get(p)
    except Decline:
        return None


def sites_of(captured: Captured) -> dict[int, int]:
    """How many ops or module calls contribute to each parameter."""
    count: dict[int, int] = {}
    plan = captured.plan
    for _call, params in plan.module_jobs + plan.fallback_jobs:
        for p in params.values():
            count[id(p)] = count.get(id(p), 0) + 1
    derived = captured.derived
    for op in plan.uses:
        for k, pids in op.sources.items():
            through = 2 if id(op.leaves[k]) in derived else 1  # a derived tensor: materialise
            for pid in pids - plan.by_fallback - plan.ruled.get(id(op), set()):
                count[pid] = count.get(pid, 0) + through
    return count
