"""Per-sample gradient norms without materialising the gradients, from one captured
batch, and the weighted sums of the same per-sample gradients.

Each call's squared per-sample gradient norms come from its layer's norm rule ("ghost
norm": Goodfellow 2015; Lee & Kifer 2021; Li et al. 2022), or, where no norm rule
applies or materialising is cheaper (convolutions, norm layers, the fallback), from
its per-sample gradients, which are then kept for the clipped sum of
``persample.dp``. The norm of a parameter several ops read directly (tied weights, a
module called twice) is not the sum of its uses' norms: it comes from the uses'
factors and their cross terms (``rules.ghost``) where every use has them and that is
cheaper, else from its materialised per-sample gradient.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_leaves

from ..capture import Op
from ..precision import accumulate_dtype, cast, without_autocast
from ..rules import Decline, module_front, module_inputs, rules_of
from ..rules.ghost import Factors, ghost_cost, materialise_cost, squared_norm
from . import replay
from .captured import Captured
from .pullback import write_per_sample
from .uses import backprops_of, norm_dtype, sites_of, use_factors
from .weighted import book_keeping


def squared_norms(
    captured: Captured, params: dict[str, nn.Parameter]
) -> tuple[dict[int, Tensor], dict[int, Tensor], dict[Op, set[int]], list[tuple]]:
    """Squared per-sample gradient norms ``{id(param): (n,)}`` of one captured batch,
    accumulated in at least float32 (:func:`persample.precision.accumulate_dtype`).

    Also returns the per-sample gradients ``{id(param): (n, 1, *shape)}`` of the
    parameters that had to be materialised, the ops whose parameters got ghost norms
    (``{op: ids of those parameters}``; a parameter several ops read is in each), and
    the module calls whose parameters got norms from a module norm rule (``(call,
    output edge, its layout, {name: param})``).
    """
    n = captured.n
    with torch.no_grad(), without_autocast():
        sites = sites_of(captured)
        sq, ghosted = _ghost_norms(captured, sites)
        _shared_norms(captured, sites, sq, ghosted)
        by_module = _module_norms(captured, sq, sites)
        rest = [p for p in params.values() if id(p) not in sq]
        mats = {id(p): p.new_empty((n, 1, *p.shape)) for p in rest}
        if mats:
            write_per_sample(captured, mats)
        for pid, m in mats.items():
            sq[pid] = sum_of_squares(m.flatten(1))
    for p in params.values():
        if id(p) not in sq:
            sq[id(p)] = p.new_zeros(n, dtype=accumulate_dtype(p.dtype))
    return sq, mats, ghosted, by_module


def group_squared_norms(
    captured: Captured, params: dict[str, nn.Parameter], groups: Tensor, count: int
) -> tuple[dict[int, Tensor], dict[int, Tensor], dict[Op, set[int]]]:
    """Squared norms of the gradients of groups of samples (a user's records): group
    ``u``'s gradient is ``sum_{i: groups[i] = u} g_i``, its squared norm per parameter
    ``{id(param): (count,)}`` accumulated in at least float32.

    A parameter every one of whose uses has factors (``rules.ghost``: a linear map at
    ``T`` positions, a lookup) gets it from the factors of each group's samples laid end
    to end (``sum_{i, j in u} <g_i, g_j>``, the within-group inner products, without
    forming any gradient) where that costs less than forming the per-sample gradients;
    the others from their per-sample gradients ``(n, 1, *shape)``, summed by group.

    Args:
        captured: one batch of ``n`` samples, captured.
        params: ``{name: parameter}`` whose norms are wanted.
        groups: ``(n,)`` int64, each sample's group in ``[0, count)``.
        count: the number of groups.

    Returns:
        ``(squared, materialised, ghosted)``: the squared norms ``{id(p): (count,)}``; the
        per-sample gradients formed ``{id(p): (n, 1, *shape)}``; the ops whose
        parameters got their norms from factors ``{op: ids}``.
    """
    n = captured.n
    sq: dict[int, Tensor] = {}
    ghosted: dict[Op, set[int]] = {}
    slot = _slots(groups, count)  # (n,) each sample's place in its group
    width = int(slot.max()) + 1 if n else 1
    with torch.no_grad(), without_autocast():
        found = use_factors(captured, {id(p) for p in params.values()})
        for pid, (ops, uses) in found.items():
            rows = _rows(captured.param(pid))
            grouped = [_grouped(u, groups, slot, count, width) for u in uses]
            if count * ghost_cost(grouped) < n * materialise_cost(uses, rows):
                sq[pid] = squared_norm(grouped)
                for op in ops:
                    ghosted.setdefault(op, set()).add(pid)
        rest = [p for p in params.values() if id(p) not in sq]
        mats = {id(p): p.new_empty((n, 1, *p.shape)) for p in rest}
        if mats:
            write_per_sample(captured, mats)
        for pid, m in mats.items():
            flat = m.flatten(1)
            summed = flat.new_zeros(count, flat.shape[1]).index_add_(0, groups, flat)
            sq[pid] = sum_of_squares(summed)
    for p in params.values():
        if id(p) not in sq:
            sq[id(p)] = p.new_zeros(count, dtype=accumulate_dtype(p.dtype))
    return sq, mats, ghosted


def _rows(p: Tensor) -> int:
    """The rows of a parameter seen as a matrix (its first dim; 1 for a 0-dim one), for
    the cost of forming its gradient."""
    return p.shape[0] if p.dim() else 1


def _slots(groups: Tensor, count: int) -> Tensor:
    """``(n,)``: how many samples before each one are in its group."""
    one_hot = torch.nn.functional.one_hot(groups, count)  # (n, count)
    before = one_hot.cumsum(0) - one_hot
    return before.gather(1, groups.unsqueeze(1)).squeeze(1)


def _grouped(f: Factors, groups: Tensor, slot: Tensor, count: int, width: int) -> Factors:
    """One use's factors per group: each group's samples' positions end to end, ``(count,
    width * t, ...)``, zeros (id 0 with a zero right factor) where a group has fewer
    samples than ``width``."""
    t = f.right.shape[1]
    left = f.left.new_zeros((count, width, *f.left.shape[1:]))
    right = f.right.new_zeros((count, width, *f.right.shape[1:]))
    left[groups, slot] = f.left
    right[groups, slot] = f.right
    return Factors(left.reshape(count, width * t, *f.left.shape[2:]),
                   right.reshape(count, width * t, f.right.shape[2]), f.backprops)


def sum_of_squares(rows: Tensor) -> Tensor:
    """``(n,)`` sums of squares of ``(n, m)`` rows, accumulated in at least float32,
    with no ``(n, m)`` temporary."""
    dtype = accumulate_dtype(rows.dtype)
    if rows.is_complex():  # (|z|^2: the real and imaginary parts' squares)
        rows = torch.view_as_real(rows).flatten(1)
    return torch.linalg.vector_norm(rows, dim=1, dtype=dtype).square()


def _ghost_norms(captured: Captured, sites: dict[int, int]
                 ) -> tuple[dict[int, Tensor], dict[Op, set[int]]]:
    """``({id(param): (n,)}, {op: ids})``: the squared norms each op's norm rule gives
    the parameters it alone reads directly ("ghost norms"), and which op gave which.
    On a cached call the rules' ATen ops are replayed (:mod:`persample.engine.replay`,
    :data:`~persample.engine.replay.NORMS`), unless an op's input was modified in place
    since it ran (then the rules run, and materialise that op's parameters)."""
    uses = captured.plan.uses
    eligible = []  # (index in uses, op, its spec, positions of the parameters it reads)
    for i, op in enumerate(uses):
        direct = [k for k, pids in op.sources.items() if id(op.leaves[k]) in pids]
        pids = {id(op.leaves[k]) for k in direct}
        if not pids or len(direct) != len(op.sources) or any(
                sites.get(pid) != 1 for pid in pids):
            continue  # materialised
        spec = rules_of(op)
        if spec is not None and spec.norm is not None and len(op.edges) == 1:
            eligible.append((i, op, spec, direct))
    dest: dict[int, Tensor] = {}  # id(param) -> (n,): where a rule's norms are written
    for _, op, _, direct in eligible:
        dtype = norm_dtype(op)
        for k in direct:
            dest.setdefault(id(op.leaves[k]), op.leaves[k].new_empty(captured.n, dtype=dtype))

    def run() -> tuple[bool, list[tuple[int, tuple[int, ...]]]]:
        plain, taken = True, []  # (each op's index in uses, and its normed leaves)
        for i, op, spec, direct in eligible:
            if op.changed():
                continue  # materialised (an input changed in place: the rules say so)
            g, call = backprops_of(captured, op)
            if g is None:
                continue
            try:
                found = spec.norm(call, g, {op.leaves[k] for k in direct})  # {param: (n,)}
            except Decline:
                continue  # materialised
            ks = tuple(k for k in direct if op.leaves[k] in found)
            for k in ks:
                v, into = found[op.leaves[k]], dest[id(op.leaves[k])]
                if v.shape == into.shape and v.dtype == into.dtype:
                    into.copy_(v)
                else:  # (not in the form expected: taken as it is, not recorded)
                    dest[id(op.leaves[k])], plain = v, False
            taken.append((i, ks))
        return plain, taken

    if any(op.changed() for _, op, _, _ in eligible):
        taken = run()[1]  # (the in-place check decides which ops: not replayed)
    else:
        taken = replay.replayed(captured, replay.NORMS, dest, (), run, lambda taken: [
            id(uses[i].leaves[k]) for i, ks in taken for k in ks])
    sq: dict[int, Tensor] = {}
    ghosted: dict[Op, set[int]] = {}
    for i, ks in taken:
        op = uses[i]
        ghosted[op] = {id(op.leaves[k]) for k in ks}
        sq.update({pid: dest[pid] for pid in ghosted[op]})
    return sq, ghosted


def _shared_norms(captured: Captured, sites: dict[int, int], sq: dict[int, Tensor],
                  ghosted: dict[Op, set[int]]) -> None:
    """Parameters several ops read directly (tied embedding and output layer, a layer
    called twice, weights shared across depth): ``|sum_k G_k|^2`` from each use's
    factors and their cross terms (``rules.ghost``), where every use has factors and
    that is cheaper than materialising the sum."""
    shared = {pid for pid, count in sites.items() if count > 1 and pid not in sq}
    for pid, (ops, uses) in use_factors(captured, shared, sites).items():
        rows = _rows(captured.param(pid))
        if ghost_cost(uses) < materialise_cost(uses, rows):
            sq[pid] = squared_norm(uses)
            for op in ops:
                ghosted.setdefault(op, set()).add(pid)


def _module_norms(captured: Captured, sq: dict[int, Tensor], sites: dict[int, int]) -> list[tuple]:
    """Norm rules of module rules (``register_norm_rule``); the calls they normed."""
    normed = []
    for call, params in captured.plan.module_jobs:
        norm = call.rule.spec.norm
        outs = [t for t in tree_leaves(call.output) if isinstance(t, Tensor) and t.requires_grad]
        if norm is None or len(outs) != 1 or any(sites.get(id(p)) != 1
                                                  for p in params.values()):
            continue
        e = next(e for t, e in zip([t for t in tree_leaves(call.output)
                                    if isinstance(t, Tensor)], call.edges) if t is outs[0])
        g = captured.grad(e)
        if g is None:
            continue
        dtype = accumulate_dtype(*(p.dtype for p in params.values()))
        backprops = cast(module_front(g, captured.layout(outs[0]), captured.n, 1), dtype)
        inputs = tuple(cast(x, dtype) for x in module_inputs(captured.capture, call))
        try:
            found = norm(call.module, inputs, backprops, set(params))
        except Decline:
            continue  # materialised
        sq.update({id(params[name]): v for name, v in found.items()})
        normed.append((call, e, captured.layout(outs[0]), {name: params[name] for name in found}))
    return normed


def weighted_sums(captured: Captured, params: dict[str, nn.Parameter],
                  materialised: dict[int, Tensor], ghosted: dict[Op, set[int]], w: Tensor,
                  sum_rules: bool = True) -> dict[str, Tensor]:
    """``{name: sum_i w_i g_i}`` for weights ``w`` ``(n,)`` from what the norms used: the
    per-sample gradients materialised, and each op whose parameters got ghost norms by
    its backprops scaled (the DP step's book-keeping: the op's weighted-sum rule, else
    one backward of that op alone, the only way with ``sum_rules=False``; never forming
    the others);
    the parameters of neither (module norm rules) from their rows, a few at a time."""
    names = {id(p): name for name, p in params.items()}
    sums: dict[str, Tensor] = {}
    with torch.no_grad():
        for pid, m in materialised.items():
            if pid in names:
                sums[names[pid]] = torch.tensordot(w.to(m.device, m.dtype), m[:, 0], dims=1)
    ghosts = {op: {pid for pid in pids if pid in names and pid not in materialised}
              for op, pids in ghosted.items()}
    ghosts = {op: pids for op, pids in ghosts.items() if pids}
    into = {pid: torch.zeros_like(p, dtype=accumulate_dtype(p.dtype))
            for pid, p in ((pid, captured.param(pid)) for pids in ghosts.values()
                           for pid in pids)}
    factors = {pid: w.to(t.device, t.dtype) for pid, t in into.items()}
    book_keeping(captured, ghosts, factors, into, set(), {}, sum_rules)
    for pid, got in into.items():
        name = names[pid]
        sums[name] = got if name not in sums else sums[name] + got
    rows = per_sample_rows(captured, params, materialised)
    for name in [name for name in params if name not in sums]:
        r = rows(name)  # (n, *shape)
        sums[name] = torch.tensordot(w.to(r.device, r.dtype), r, dims=1)
    return sums


def per_sample_rows(captured: Captured, params: dict[str, nn.Parameter],
                    materialised: dict[int, Tensor], budget: int = 1 << 28
                    ) -> Callable[[str], Tensor]:
    """``rows(name)``: that parameter's per-sample gradients ``(n, *shape)`` from the
    captured batch, by the gradient rules: those materialised already, the others a few
    parameters at a time (at most ``budget`` bytes at once), for a certificate."""
    n, made = captured.n, {}
    order = list(params)

    def rows(name: str) -> Tensor:
        p = params[name]
        if id(p) in materialised:
            return materialised[id(p)][:, 0]
        if name not in made:
            made.clear()
            group, size = {}, 0
            for other in order[order.index(name):]:
                q = params[other]
                if id(q) in materialised or (group and size + n * q.numel() * q.element_size()
                                             > budget):
                    continue
                group[other] = q.new_empty((n, 1, *q.shape))
                size += n * q.numel() * q.element_size()
            write_per_sample(captured, {id(params[k]): t for k, t in group.items()})
            made.update({k: t[:, 0] for k, t in group.items()})
        return made[name]
    return rows
