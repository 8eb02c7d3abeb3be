"""Per-sample gradients of table lookups: ``F.embedding``, ``F.embedding_bag``, and
a parameter indexed by an id tensor (``table[index]``, ``index_select(table, 0, ids)``:
Swin's relative position bias).

Index conventions: ``n`` sample, ``v`` cotangent, ``t`` position (all id dims,
flattened), ``r`` row of the table, ``d`` the rest of a row (flattened).

Lookup: ``grad_W[n, v, r] = sum_{t: ids[n, t] = r} g[n, v, t]``: a scatter-add of
the backprops into a zeroed ``(n, v, r, d)`` destination. Ids shared by all
samples (position ids from ``arange``, T5's ``(T, T)`` bucket matrix) are the same
scatter with the ids broadcast. The row ``padding_idx`` gets no gradient;
``scale_grad_by_freq`` divides each row by its count among the sample's own ids.

EmbeddingBag: each bag is a sample (a row of a 2-d input, or the positions
between two offsets of a 1-d input), ``g[n, v, d]`` its backprops:

- ``sum``: ``grad_W[n(t), v, ids[t]] += w[t] * g[n(t), v]`` (``w`` the
  ``per_sample_weights``, or 1);
- ``mean``: the same with ``w[t] = 1 / size(n(t))``, the size counting the
  positions that are not ``padding_idx``;
- ``max``: ``grad_W[n, v, argmax[n, d], d] = g[n, v, d]`` for every non-empty bag.

Norm rule for EmbeddingBag (never the ``(n, r, d)`` gradients): with ``a[n, r]``
the summed weights of row ``r`` in bag ``n``, ``|grad_W[n]|^2 = |g[n]|^2 sum_r
a[n, r]^2``; in max mode ``|grad_W[n]|^2 = |g[n]|^2`` for a non-empty bag.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from .calls import OpCall
from .ghost import Factors, inner
from .spec import Decline, OpSpec, register


def scatter_rows(ids: Tensor, g: Tensor, dst: Tensor, padding_idx: int | None = None,
                 by_freq: bool = False, add: bool = False) -> None:
    """``dst (n, v, r, *d) = sum_t onehot(ids[n, t]) g[n, v, t]``; ``ids (n, t)`` or
    shared ``(t,)``, ``g (n, v, t, *d)``; with ``add``, ``+=`` (not with ``by_freq``)."""
    n, v, t = g.shape[:3]
    ids = ids.reshape(1, 1, t).expand(n, 1, t) if ids.dim() == 1 else ids.reshape(n, 1, t)
    rows = torch.arange(n, device=ids.device).view(n, 1, 1)  # (n, 1, 1)
    cots = torch.arange(v, device=ids.device).view(1, v, 1)  # (1, v, 1)
    if add and by_freq:
        raise ValueError("scale_grad_by_freq divides the whole destination: nothing to add to")
    if add:  # the padding row keeps what the other contributions gave it
        if padding_idx is not None:  # (where: a NaN at a padded position adds nothing)
            g = torch.where((ids != padding_idx).view(n, 1, t, *[1] * (g.dim() - 3)), g, 0)
        dst.index_put_((rows, cots, ids), g, accumulate=True)
        return
    dst.zero_()
    dst.index_put_((rows, cots, ids), g, accumulate=True)
    if by_freq:  # each row divided by how often the sample used it
        counts = torch.zeros(n, dst.shape[2], dtype=g.dtype, device=g.device)
        counts.scatter_add_(1, ids[:, 0], torch.ones_like(ids[:, 0], dtype=g.dtype))
        dst.div_(counts.clamp(min=1).view(n, 1, -1, *[1] * (dst.dim() - 3)))
    if padding_idx is not None:
        dst[:, :, padding_idx].zero_()


def _ids(call: OpCall, ids: Tensor) -> Tensor:
    """``(n, t)`` per-sample ids, or ``(t,)`` when shared."""
    front = call.front(ids)
    return front.reshape(-1) if call.shared(ids) else front.reshape(front.shape[0], -1)


def embedding(call: OpCall, g: Tensor, out: dict) -> None:
    """``F.embedding(ids, W, padding_idx, max_norm, norm_type, scale_grad_by_freq)``;
    ``max_norm`` renormalises ``W`` in place before the lookup and does not change the
    gradient's form."""
    ids, w = call.arg(0, "input"), call.arg(1, "weight")
    call.only(out, w)
    if w not in out:
        return
    if not call.shared(w):
        raise Decline("a table paired with the samples")
    padding_idx = call.arg(2, "padding_idx")
    if padding_idx is not None and padding_idx < 0:
        padding_idx += w.shape[0]
    by_freq = bool(call.arg(5, "scale_grad_by_freq", False))
    if by_freq and w in call.adding:
        raise Decline("scale_grad_by_freq with another contribution to add to")
    i = _ids(call, ids)
    n, v = g.shape[:2]
    scatter_rows(i, g.reshape(n, v, i.shape[-1], *w.shape[1:]), out[w], padding_idx,
                 by_freq, add=w in call.adding)


def gather_rows(call: OpCall, g: Tensor, out: dict) -> None:
    """``table[ids]`` and ``index_select(table, 0, ids)`` with one integer id tensor on dim
    0 of a parameter: the lookup rule; ``table[basic]`` of slices and integers, a view:
    the cotangent in its place."""
    table = call.args[0]
    if table not in out or not call.shared(table):
        raise Decline("not a parameter table indexed by ids")
    call.only(out, table)
    if call.func.__name__ == "__getitem__":
        basic = _basic(call.args[1])
        if basic is not None:  # (a view: BEiT's ``table[:k]``, its rows' cotangents in
            dst = out[table]  # place, zeros elsewhere)
            if table not in call.adding:
                dst.zero_()
            dst[(slice(None), slice(None), *basic)] += g
            return
        ids = call.args[1]
        if not isinstance(ids, Tensor) or ids.dtype in (torch.bool, torch.uint8):
            raise Decline("not one integer id tensor")
    else:
        if call.arg(1, "dim") not in (0, -table.dim()):
            raise Decline("index_select along another dim than 0")
        ids = call.arg(2, "index")
    i = _ids(call, ids)
    n, v = g.shape[:2]
    scatter_rows(i % table.shape[0], g.reshape(n, v, i.shape[-1], *table.shape[1:]),
                 out[table], add=table in call.adding)


def _basic(index: Any) -> tuple | None:
    """``index`` of ``t[index]`` as a tuple where it is basic indexing (slices, integers,
    ``None``, ``...``: a view of ``t``), else ``None``."""
    parts = index if isinstance(index, tuple) else (index,)
    basic = all(type(p) in (slice, int, type(None), type(Ellipsis)) for p in parts)
    return parts if basic else None


def embedding_norm(call: OpCall, g: Tensor, wanted: set[Tensor]) -> dict:
    """``|grad_W[n]|^2 = sum_{t,s: ids_t = ids_s} g_t . g_s`` (cost ``n T^2 d``); declines
    (materialise, ``n r d``) when the table is smaller than ``T^2``."""
    w = call.arg(1, "weight")
    if w not in wanted:
        return {}
    i, gt, _ = _lookup(call, g)
    if i.shape[1] ** 2 >= w.shape[0]:
        raise Decline("materialising is cheaper")
    one = Factors(i, gt)
    return {w: inner(one, one)}


def _lookup(call: OpCall, g: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """A plain lookup's ids ``(n, t)``, backprops ``(n, t, d)`` zeroed where the id is
    ``padding_idx``, and its table; declines for shared ids or ``scale_grad_by_freq``."""
    ids, w = call.arg(0, "input"), call.arg(1, "weight")
    if call.shared(ids) or not call.shared(w) or call.arg(5, "scale_grad_by_freq", False):
        raise Decline("shared ids, a paired table, or scale_grad_by_freq")
    i = _ids(call, ids)  # (n, t)
    gt = g.reshape(i.shape[0], i.shape[1], w.shape[1:].numel())  # (n, t, d)
    padding_idx = call.arg(2, "padding_idx")
    if padding_idx is not None:  # (where: a NaN at a padded position counts nothing)
        gt = torch.where((i != padding_idx % w.shape[0]).unsqueeze(2), gt, 0)
    return i, gt, w


def embedding_factors(call: OpCall, g: Tensor, wanted: set[Tensor]) -> dict:
    """``W (r, d)``: ``L`` the one-hot rows of the ids, ``R`` the backprops."""
    i, gt, w = _lookup(call, g)
    return {w: Factors(i, gt, "right")} if w in wanted else {}


def embedding_sum(call: OpCall, g: Tensor, c: Tensor, into: dict[Tensor, Tensor]) -> None:
    """Adds ``sum_n c_n grad_n`` for backprops ``g (n, 1, *out)`` and factors ``c (n,)``:
    the rows of ``c g`` added at their ids (``padding_idx`` none)."""
    i, gt, w = _lookup(call, g)
    if w in into:
        rows = (gt * c.view(-1, 1, 1)).reshape(-1, gt.shape[2])  # (n*t, d)
        table = into[w].view(w.shape[0], -1)
        table.index_add_(0, i.reshape(-1), rows.to(table.dtype))


_MAX_MODE = 2  # torch.embedding_bag's code for mode="max"


def _bag_args(call: OpCall) -> dict:
    """``F.embedding_bag``'s arguments by name."""
    names = ["input", "weight", "offsets", "max_norm", "norm_type", "scale_grad_by_freq",
             "mode", "sparse", "per_sample_weights", "include_last_offset", "padding_idx"]
    defaults = [None, None, None, None, 2, False, "mean", False, None, False, None]
    return {name: call.arg(k, name, d) for k, (name, d) in enumerate(zip(names, defaults))}


def flat_bags(ids: Tensor, offsets: Tensor | None, weights: Tensor | None, last: bool
              ) -> tuple[Tensor, Tensor, Tensor | None, bool]:
    """The bags as ``F.embedding_bag`` sees them: ``ids (T,)``, ``offsets``, ``weights``
    ``(T,)`` or ``None``, ``include_last_offset``; a 2-d input ``(n, L)`` is ``n`` bags."""
    if ids.dim() == 2:
        n, length = ids.shape
        offsets = torch.arange(0, n * length, length, dtype=ids.dtype, device=ids.device)
        return ids.reshape(-1), offsets, None if weights is None else weights.reshape(-1), False
    return ids, offsets, weights, last


def bag_of_positions(offsets: Tensor, positions: int, bags: int) -> Tensor:
    """``(T,)``: the bag of each position, ``offsets`` holding the bags' starts."""
    t = torch.arange(positions, dtype=offsets.dtype, device=offsets.device)
    bag = torch.searchsorted(offsets[:bags].contiguous(), t, right=True) - 1
    return bag.clamp_(0, bags - 1)


def _bag_weights(a: dict, n: int, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The kept positions ``(bag, ids, coef)`` ``(T',)`` each and each bag's size ``(n,)``:
    ``grad_W[bag_t, ids_t] += coef_t * g[bag_t]`` (sum and mean modes)."""
    ids, offsets, weights, _ = flat_bags(a["input"], a["offsets"], a["per_sample_weights"],
                                         a["include_last_offset"])
    bag = bag_of_positions(offsets, ids.numel(), n)  # (T,)
    pad = a["padding_idx"]
    keep = torch.ones_like(ids, dtype=torch.bool) if pad is None else ids != pad
    size = torch.zeros(n, dtype=dtype, device=ids.device).index_add_(0, bag, keep.to(dtype))
    if a["mode"] == "mean":
        coef = size.reciprocal()[bag]
    else:
        coef = torch.ones_like(bag, dtype=dtype) if weights is None else weights.to(dtype)
    return bag[keep], ids[keep], coef[keep], size


def _check_bags(call: OpCall, a: dict) -> None:
    if a["scale_grad_by_freq"]:
        raise Decline("scale_grad_by_freq=True")
    if call.shared(a["input"]) or not call.shared(a["weight"]):
        raise Decline("bags shared by all samples, or a paired table")


def embedding_bag(call: OpCall, g: Tensor, out: dict) -> None:
    """``g (n, v, d)`` for the ``n`` bags (one per sample); ``out[W] (n, v, r, d)``."""
    a = _bag_args(call)
    w = a["weight"]
    call.only(out, w)
    if w not in out:
        return
    _check_bags(call, a)
    n, v = g.shape[:2]
    g = g.reshape(n, v, -1)
    dst = out[w]
    dst.zero_()
    if a["input"].numel() == 0:
        return
    bag, ids, coef, size = _bag_weights(a, n, g.dtype)
    if a["mode"] == "max":
        ids_, offsets, _, last = flat_bags(a["input"], a["offsets"], None,
                                           a["include_last_offset"])
        argmax = torch.embedding_bag(w.detach(), ids_, offsets, False, _MAX_MODE, False, None,
                                     last, a["padding_idx"])[3]  # (n, d) rows
        gm = torch.where((size > 0).view(n, 1, 1), g, 0)  # an empty bag's argmax is
        # meaningless (where: its NaN backprops add nothing)
        dst.scatter_add_(2, argmax.view(n, 1, 1, -1).expand(n, v, 1, -1), gm.unsqueeze(2))
        return
    cots = torch.arange(v, device=ids.device).view(1, v)
    values = g[bag] * coef.view(-1, 1, 1)  # (T', v, d)
    dst.index_put_((bag.view(-1, 1), cots, ids.view(-1, 1)), values, accumulate=True)


def embedding_bag_norm(call: OpCall, g: Tensor, wanted: set[Tensor]) -> dict:
    """``|grad_W[n]|^2 = |g[n]|^2 sum_r a[n, r]^2`` (max mode: ``|g[n]|^2``), in
    ``O(T log T)`` for ``T`` positions instead of ``O(n r d)``."""
    a = _bag_args(call)
    w = a["weight"]
    if w not in wanted:
        return {}
    _check_bags(call, a)
    n = g.shape[0]
    g2 = g.reshape(n, -1).square().sum(1)  # (n,)
    if a["input"].numel() == 0:
        return {w: torch.zeros_like(g2)}
    bag, ids, coef, size = _bag_weights(a, n, g.dtype)
    if a["mode"] == "max":
        return {w: g2 * (size > 0)}
    rows = w.shape[0]
    pairs, which = torch.unique(bag * rows + ids, return_inverse=True)
    weights = torch.zeros(len(pairs), dtype=coef.dtype, device=coef.device).index_add_(
        0, which, coef)
    a2 = torch.zeros_like(g2).index_add_(0, pairs // rows, weights.square())
    return {w: g2 * a2}


EMBEDDING = register(OpSpec((F.embedding,), grad=embedding, norm=embedding_norm,
                            sum=embedding_sum, factors=embedding_factors, adds=True))
ROWS = register(OpSpec((torch.Tensor.__getitem__, torch.index_select), grad=gather_rows,
                       adds=True))
EMBEDDING_BAG = register(OpSpec((F.embedding_bag,), grad=embedding_bag, norm=embedding_bag_norm))
