"""Weighted sums ``sum_i w_i g_i`` of per-sample gradients from a captured batch, without
forming the gradients ("book-keeping", Bu et al. 2023): the backprops of an op's output
scaled by each sample's weight, pulled back through that op alone (or, for a module
call, through the model's graph from that output). A DP step's clipped sum is one (the
weights its clip factors); a certificate's random combination is another.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ..batch import Batched
from ..errors import InternalError
from ..precision import LOW, cast, without_autocast
from ..rules import Decline, OpCall, rules_of
from . import replay
from .captured import Captured
from .vjp import summed_vjp


def scaled(g: Tensor, lay: Any, w: Tensor) -> Tensor:
    """Backprops ``g`` (an output's own shape, layout ``lay``) times each sample's weight
    ``w (n,)``; a shared output (no samples) as it is."""
    return g * lay.scale(w, g) if isinstance(lay, Batched) else g


def op_weighted_sum(captured: Captured, op: Any, group: list, w: Tensor) -> dict[int, Tensor]:
    """``d/dW <w * G, out>`` for ``group``'s parameters (``{id(p): (*shape)}``): the op
    replayed on the values it read (unchanged since it ran) and one backward of it
    alone (the model's graph is not needed)."""
    (edge,), (lay,) = op.edges, op.out_layouts
    g = scaled(captured.grad(edge)[0], lay, w)  # (*out)
    wanted = {id(p) for p in group}
    wrt = [k for k, t in enumerate(op.leaves) if id(t) in wanted]
    found: dict[int, Tensor] = {}
    for k, got in zip(wrt, summed_vjp(op, g, wrt)):
        pid = id(op.leaves[k])
        found[pid] = got if pid not in found else found[pid] + got
    return found


def edge_weighted_sum(captured: Captured, edge: Any, lay: Any, group: list, w: Tensor
                      ) -> dict[int, Tensor]:
    """``d/dW <w * G, out>`` for the output at ``edge`` (layout ``lay``) of a module call:
    the gradient of ``group``'s parameters for that output's backprops scaled per
    sample, through the model's graph (which must have been kept)."""
    g = scaled(captured.grad(edge)[0], lay, w)
    grads = torch.autograd.grad([edge.edge], group, [edge.place(g)], retain_graph=True)
    return {id(p): got for p, got in zip(group, grads)}


def op_sum_rule(op: Any) -> Callable[[int, torch.dtype, Tensor, Tensor, dict], bool] | None:
    """The weighted-sum rule of ``op`` (``OpSpec.sum``), called as ``rule(n, dtype, g, c,
    into)``: backprops ``g (n, 1, *out)`` and factors ``c (n,)`` in ``dtype``, ``into``
    ``{param: tensor}`` added to; it returns ``False`` where the rule declines (having
    added nothing). ``None``: the op has none."""
    spec = rules_of(op)
    if spec is None or spec.sum is None:
        return None

    def rule(n: int, dtype: torch.dtype, g: Tensor, c: Tensor, into: dict) -> bool:
        try:
            spec.sum(OpCall(op, n, dtype), g, c, into)
        except Decline:
            return False
        return True

    return rule


def book_keeping(captured: Captured, ghosted: dict, factors: dict[int, Tensor],
                  into: dict[int, Tensor], done: set[int], left: dict[int, list],
                  sum_rules: bool = True) -> None:
    """Add the clipped sums of the ghost-normed parameters into ``into``, op by op
    (``ghosted``: op -> the parameters it sums; ``done``: parameters whose sums are
    complete, those summed from materialised gradients already in it; ``left``: filled
    here with each parameter's ops not yet added, for :func:`complete_sums` after a failure).

    ``sum_i c_i g_i`` is the op's ordinary weight gradient for backprops scaled by
    the clip factors: the op's weighted-sum rule where it has one (one GEMM for a
    linear map), else one local backward from the op's own autograd node. A
    parameter several ops read gets each one's sum.
    """
    for op, pids in ghosted.items():
        for pid in pids - done:
            left.setdefault(pid, []).append(op)
    jobs = [(op, [pid for pid in pids if pid in left]) for op, pids in ghosted.items()]
    rules = [op_sum_rule(op) if sum_rules else None for op, _ in jobs]
    with without_autocast():
        if sum_rules and all(rules):
            _replayed_sums(captured, jobs, rules, factors, into, done, left)
            return
        for (op, pending), rule in zip(jobs, rules):
            _add_op_sums(captured, op, pending, factors, into, rule, done, left)


class PartialSums(InternalError):
    """A kept replay of the clipped sums raised part-way (out of memory, say): the sums
    are partly added, so no fallback may add them again; the micro-batch fails."""


def _replayed_sums(captured: Captured, jobs: list, rules: list, factors: dict[int, Tensor],
                   into: dict[int, Tensor], done: set[int], left: dict[int, list]) -> None:
    """Every op's weighted-sum rule, replayed on a cached call as the ATen ops they ran
    (:mod:`persample.engine.replay`, :data:`~persample.engine.replay.SUMS`: the factors
    read, the sums written). A call where a rule declines runs the rules."""
    dest = {pid: into[pid] for _, pending in jobs for pid in pending}
    extra = tuple(factors[pid] for pid in dest)

    ran: list[bool] = []  # (whether the rules ran: else the replay added every sum)

    def run() -> tuple[bool, None]:
        ran.append(True)
        plain = True
        for (op, pending), rule in zip(jobs, rules):
            plain &= _add_op_sums(captured, op, pending, factors, into, rule, done, left)
        return plain, None

    try:
        replay.replayed(captured, replay.SUMS, dest, extra, run)
    except Exception as err:
        if ran or isinstance(err, InternalError):
            raise  # (the rules' own failure: ``left`` says what they added)
        raise PartialSums(f"persample failed in the replayed clipped sums: "
                          f"{type(err).__name__}: {err}") from err
    if not ran:
        for op, pending in jobs:
            for pid in pending:
                left[pid].remove(op)
                if not left[pid]:
                    done.add(pid)


def _add_op_sums(captured: Captured, op, pending: list[int], factors: dict[int, Tensor],
                 into: dict[int, Tensor], rule: Callable | None, done: set[int],
                 left: dict[int, list]) -> bool:
    """One op's share of the clipped sums of its parameters ``pending``: by one call of
    its rule where they share their factors, else one at a time (a failure adds
    nothing), each marked added in ``left`` and ``done``. Whether the rule did all."""
    g = (captured.backprops(op.edges, op.out_layouts)[0]  # (n, 1, *out)
         if rule else None)
    if len(pending) > 1 and g is not None and _all_at_once(
            captured, op, pending, factors, into, rule, g):
        summed = pending
    else:
        summed = []
    plain = True
    for pid in pending:  # one at a time: a failure adds nothing
        if pid not in summed:
            plain &= _add_op_sum(captured, op, pid, factors[pid], into[pid], rule, g)
        left[pid].remove(op)
        if not left[pid]:
            done.add(pid)
    return plain


def complete_sums(captured: Captured, ghosted: dict, left: dict[int, list],
              factors: dict[int, Tensor], into: dict[int, Tensor], done: set[int]) -> None:
    """After a failure: a parameter some of whose uses were added gets the other uses'
    sums from each op's own backward (exact, and apart from the rules)."""
    for pid, ops in left.items():
        uses = sum(pid in pids for pids in ghosted.values())
        if pid in done or not ops or len(ops) == uses:
            continue  # complete, or nothing added: summed from per-sample gradients
        with without_autocast():
            for op in ops:
                p = next(t for t in op.leaves if id(t) == pid)
                into[pid].add_(op_weighted_sum(captured, op, [p], factors[pid])[pid])
        done.add(pid)


def _add_op_sum(captured: Captured, op, pid: int, c: Tensor, into: Tensor,
                rule: Callable | None, g: Tensor | None) -> bool:
    """Add one op's share of ``sum_i c_i g_i`` of the parameter ``pid`` (clip factors
    ``c (n,)``) into ``into``: its weighted-sum ``rule`` (:func:`op_sum_rule`) with the
    op's backprops ``g (n, 1, *out)`` (``None``: it has none), else (it has none, or it
    declines, having added nothing) one local backward. Whether the rule added it."""
    p = next(t for t in op.leaves if id(t) == pid)
    if rule is not None and g is not None:
        dtype = _sum_dtype(g.dtype, into.dtype)
        with torch.no_grad():
            if rule(captured.n, dtype, cast(g, dtype), c.to(dtype), {p: into}):
                return True
    into.add_(op_weighted_sum(captured, op, [p], c)[pid])
    return False


def _all_at_once(captured: Captured, op, pids: list[int], factors: dict[int, Tensor],
                 into: dict[int, Tensor], rule: Callable, g: Tensor) -> bool:
    """Add one op's share of the clipped sums of all of ``pids`` by one call of its
    weighted-sum ``rule`` (a linear map's weight and bias: its input and backprops
    reshaped once), where they share one tensor of factors and one dtype of sums.
    ``False`` (nothing added: a sum rule declines before it adds) where they do not or
    the rule declines; then each is added alone."""
    c = factors[pids[0]]
    dtype = into[pids[0]].dtype
    if any(factors[pid] is not c or into[pid].dtype != dtype for pid in pids):
        return False
    leaves = {id(t): t for t in op.leaves}
    dtype = _sum_dtype(g.dtype, dtype)
    with torch.no_grad():
        return rule(captured.n, dtype, cast(g, dtype), c.to(dtype),
                    {leaves[pid]: into[pid] for pid in pids})


def _sum_dtype(op_dtype: torch.dtype, into_dtype: torch.dtype) -> torch.dtype:
    """The dtype an op's clipped sum is computed in: the op's own under autocast (its
    backprops are bfloat16: the GEMM runs there, as autograd's weight gradient would,
    and is added to the float32 sums), else the sums'."""
    return op_dtype if op_dtype in LOW and into_dtype not in LOW else into_dtype


def add_materialised(materialised: dict[int, Tensor], factors: dict[int, Tensor],
                     into: dict[int, Tensor], group: set[int]) -> set[int]:
    """Add ``sum_i c_i g_i`` of the parameters of ``group`` whose per-sample gradients
    ``(n, 1, *shape)`` were materialised (``tensordot(c, g)``, ``c = factors[id] (n,)``)
    into ``into``. Returns their ids."""
    done = {pid for pid in materialised if pid in group}
    for pid in done:
        m = materialised[pid]
        into[pid].add_(torch.tensordot(factors[pid].to(m.dtype), m[:, 0], dims=1))
    return done


def add_module_normed(captured: Captured | None, module_normed: list[tuple],
                      factors: dict[int, Tensor], into: dict[int, Tensor], group: set[int],
                      done: set[int]) -> None:
    """Add ``sum_i c_i g_i`` of the parameters of ``group`` a module norm rule normed
    (``module_normed``: ``(call, output edge, its layout, {name: param})``): their
    module call's backward for the backprops scaled per sample (the graph kept,
    :func:`keeps_graph`). Adds their ids to ``done``."""
    for _call, edge, layout, normed in module_normed:
        for p in normed.values():
            if id(p) in group:
                into[id(p)].add_(edge_weighted_sum(captured, edge, layout, [p],
                                                   factors[id(p)])[id(p)])
                done.add(id(p))


def keeps_graph(plan: Any) -> bool:
    """Whether the model's autograd graph must outlive the backward of ``plan``
    (:class:`persample.engine.paths.Plan`): only for the module calls a module norm rule
    may norm (their weighted sums come from a backward through the graph). Everything
    else is summed from the captured values, so the graph's saved activations are freed
    as the backward goes, as in a plain step."""
    return any(call.rule.spec.norm is not None for call, _ in plan.module_jobs)
