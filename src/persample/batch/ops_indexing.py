"""Indexing, gathers, scatters, ``nonzero`` and sorts: positions named by values.

An index tensor names positions by its values, and where those positions carry
samples, the data read or written there tells each result position its sample:
``logits[arange(B), last]`` keeps the samples in order; ``h[rows]`` with ``rows``
from ``nonzero`` over a ``(B*T, E)`` routing mask gives each row the sample of the
token it reads; ``zeros(N, F).index_add_(0, dst, messages)`` gives each node the
sample of the messages added into it; ``argsort`` of a ``(B*T,)`` tensor permutes
the tokens, each keeping its sample. An index tensor computed from a sample's data
is that sample's too (its own layout): its entries must agree with the data they
read, or the op mixes samples. Every such layout is built from the sample of each
position (:func:`located`): the plain or merged layout where the samples form one
(``Batched(0, inner=T)``), else an index layout.

A position holding only data shared by all samples has no sample of its own (a row
no scatter has written yet; a self-loop edge appended to a graph's edges, its node
ids from ``arange``). A tensor with such positions has the layout :class:`Partly`,
an :class:`~persample.batch.layouts.Unknown` to every other rule; the rules here,
the views and the elementwise ops carry it, and complete it where its shared
positions meet one sample's data (the scatters that fill them, a residual added,
an index that reads batched rows). Nothing is decided from a size: a position's
sample comes from data flow, or the position stays shared.

Registered with :func:`persample.batch.flow.register`; see that module.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from .flow import (
    FLOAT_BLIND,
    VALUE_READERS,
    Ctx,
    Flow,
    aliases,
    arg,
    broadcast_shapes,
    dim_of,
    every,
    mixed,
    name_of,
    own_layout,
    own_piece,
    propagate,
    register,
)
from .layouts import (
    SHARED,
    Batched,
    Layout,
    Mixed,
    Piece,
    Unknown,
    indexed,
    nonnegative,
    once_each,
    sample_of_positions,
)

NO_SAMPLE = -1  # a position holding only data shared by all samples


@dataclass(frozen=True, eq=False)
class Partly(Unknown):
    """Positions along ``dim`` each hold one sample's data (``rows[p]``, the sample) or
    only shared data (``rows[p] == -1``); see the module docstring. It describes the
    tensor ``ref`` refers to only: a rule that passes a layout on unchanged to another
    tensor passes an :class:`Unknown`."""

    dim: int = 0
    rows: Tensor | None = None  # (size of dim,) int64
    ref: Any = None  # weakref.ref of the tensor described

    def __repr__(self) -> str:
        rows = self.rows.tolist() if self.rows is not None else None
        return f"Partly(dim={self.dim}, rows={rows})"


@dataclass(frozen=True, eq=False)
class Sorted(Batched):
    """A batch dim whose positions are in the order of a sort key (``argsort`` of the
    tokens' experts), ``keys`` the key at each position: a layout like any other to the
    other rules (it equals the same layout without keys); ``split`` may cut it where
    every piece holds one key, the piece's own number (``split(bincount(keys))``), so
    which piece a position goes to depends on its own key alone."""

    keys: Tensor | None = None


def partly(ctx: Ctx, t: Any) -> Partly | None:
    """``t``'s layout if it is a :class:`Partly` made for ``t`` itself."""
    return own_layout(ctx, t, Partly)


def pieces_of(lay: Batched, x: Tensor, n: int, outs: Any, why: str) -> tuple:
    """A :class:`Piece` for each of ``outs``, the positions of ``x``'s batch dim in
    order (``unbind``); a position of no sample (an index layout's ``-1``) is Unknown."""
    rows = sample_of_positions(lay, x.shape[lay.dim], n, x.device).tolist()
    return tuple(Piece(why, int(s), weakref.ref(o)) if s >= 0 else Unknown(why)
                 for s, o in zip(rows, outs))


def followed(ctx: Ctx, t: Any) -> Layout:
    """``t``'s layout, a :class:`Partly` or :class:`Piece` made for another tensor as a
    plain Unknown."""
    lay = ctx.layout(t)
    if isinstance(lay, Partly) and partly(ctx, t) is None:
        return Unknown(lay.why)
    if isinstance(lay, Piece) and own_piece(ctx, t) is None:
        return Unknown(lay.why)
    return lay


def trouble(layouts: list[Layout]) -> Layout | None:
    """Mixed over Unknown (a :class:`Partly` counts as located); ``None`` if neither."""
    found = None
    for lay in layouts:
        if isinstance(lay, Mixed):
            return lay
        if isinstance(lay, Unknown) and not isinstance(lay, Partly) and found is None:
            found = lay
    return found


def samples_along(ctx: Ctx, t: Tensor, lay: Layout) -> tuple[int, Tensor] | None:
    """``(dim, samples (size,))`` of a batched or :class:`Partly` tensor; ``None`` else."""
    if isinstance(lay, Partly):
        return lay.dim, lay.rows
    if isinstance(lay, Batched):
        rows = sample_of_positions(lay, t.shape[lay.dim], ctx.n, t.device)
        return lay.dim, rows.long()
    return None


def element_samples(ctx: Ctx, t: Tensor, lay: Layout) -> Tensor:
    """The sample of every entry of ``t`` (``NO_SAMPLE`` where shared), broadcastable to
    ``t.shape``."""
    found = samples_along(ctx, t, lay)
    if found is None:
        return torch.full((), NO_SAMPLE, dtype=torch.long, device=t.device)
    d, rows = found
    shape = [1] * t.dim()
    shape[d] = rows.shape[0]
    return rows.view(shape)


def merge(a: Tensor, b: Tensor) -> Tensor | None:
    """Samples of the same positions from two sources (broadcast): one where only one
    names a sample, ``None`` where they name different ones."""
    b = b.to(a.device)  # an index tensor may live on the CPU beside CUDA data
    if a.shape == b.shape and torch.equal(a, b):
        return a.clone()
    high, low = torch.maximum(a, b), torch.minimum(a, b)  # (NO_SAMPLE is below every
    if not torch.equal(torch.where(low < 0, high, low), high):  # sample: the max is the
        return None  # one named; two named ones differ where the min is a sample below it)
    return high


def gathered(rows: Tensor, values: Tensor) -> Tensor:
    """``rows[values]`` for 1-d ``rows`` (the sample of each position) and integer
    ``values`` of any shape, by ``index_select`` (a few microseconds less per call than
    advanced indexing)."""
    return rows.index_select(0, values.reshape(-1)).view(values.shape)


def located(dim: int, rows: Tensor, n: int, out: Tensor, why: str) -> Layout:
    """The layout of ``out`` whose positions along ``dim`` hold the samples ``rows``:
    shared (no position holds a sample's data), :class:`Partly` (some do not), the plain
    or merged layout the samples form, else an index layout."""
    rows = rows.long()
    low, high = (t.item() for t in rows.aminmax()) if rows.numel() else (0, 0)
    if high < 0:
        return SHARED
    if low < 0:
        return Partly(f"{why}: some positions hold no sample's data", dim, rows,
                      weakref.ref(out))
    return regular(dim, rows, n)


def regular(dim: int, rows: Tensor, n: int) -> Batched:
    """``Batched(dim, outer, inner)`` if ``rows`` is that layout's sample of each
    position (``(o * n + i) * inner + k`` holds sample ``i``), else the index layout."""
    size = rows.numel()
    if size == n and torch.equal(rows, torch.arange(n, device=rows.device)):
        return Batched(dim)  # (one position per sample, in order: the common case)
    if size and size % n == 0:
        k = size // n
        inner = k if n == 1 else int((rows != 0).to(torch.int8).argmax())  # (n > 1: the
        # only candidate is the first position of sample 1, the run of sample 0 before it)
        if inner > 0 and k % inner == 0 and torch.equal(
                rows, torch.arange(size, device=rows.device) // inner % n):
            return Batched(dim, k // inner, inner) if n > 1 else Batched(dim, k, 1)
    return indexed(dim, rows, n)


def agree(a: Batched, b: Batched, size: int, n: int) -> Batched | None:
    """``a`` and ``b`` (of a dim of ``size`` positions) hold the same sample at every
    position: the one to keep (a plain or merged layout over an index layout that is
    the same: graphs of equal sizes come as index layouts); ``None`` if they differ."""
    if a == b:
        return a
    if a.dim != b.dim or (a.index is None and b.index is None):
        return None
    same = torch.equal(sample_of_positions(a, size, n, torch.device("cpu")).long().cpu(),
                       sample_of_positions(b, size, n, torch.device("cpu")).long().cpu())
    return (b if a.index is not None else a) if same else None


def along_one_dim(samples: Tensor) -> tuple[int, Tensor] | None:
    """``(k, rows)`` if ``samples`` depends on its dim ``k`` alone (the first such dim
    where it depends on none); ``None`` if on several."""
    if samples.dim() == 0:
        return None
    if samples.numel() == 0:  # no entry: no sample anywhere
        return 0, samples.new_full((samples.shape[0],), NO_SAMPLE)
    if samples.dim() == 1:
        return 0, samples
    for k in range(samples.dim()):
        first = samples.movedim(k, 0).reshape(samples.shape[k], -1)
        if first.shape[1] == 0:
            return k, samples.new_full((samples.shape[k],), NO_SAMPLE)
        rows = first[:, 0]
        if torch.equal(first, rows[:, None].expand_as(first)):
            return k, rows
    return None


def as_located(ctx: Ctx, out: Tensor, lay: Layout, moved_to: int | None = None) -> Layout:
    """``lay`` (of a view's input) for ``out``: a :class:`Partly` is made again for
    ``out`` (at ``moved_to``), anything else is returned as it is (moved)."""
    if isinstance(lay, Partly):
        return Partly(lay.why, lay.dim if moved_to is None else moved_to, lay.rows,
                      weakref.ref(out))
    if isinstance(lay, Batched) and moved_to is not None:
        return lay.moved(moved_to)
    return lay


def follows_partly(handler):
    """A view or unary rule that also carries :class:`Partly`: run on the positions as an
    index layout, the result made :class:`Partly` again for the op's output."""

    def run(ctx: Ctx, func, args, kwargs, out) -> Any:
        x = args[0] if args else kwargs.get("input")
        found = partly(ctx, x)
        if found is None:
            return handler(ctx, func, args, kwargs, out)
        stand_in = Batched(found.dim, index=found.rows)
        inner = Ctx(ctx.n, lambda t: stand_in if t is x else ctx.layout(t), ctx.read)
        got = handler(inner, func, args, kwargs, out)

        def back(lay: Any, o: Any) -> Any:
            if isinstance(lay, Batched) and lay.index is stand_in.index and isinstance(
                    o, Tensor):
                return Partly(found.why, lay.dim, found.rows, weakref.ref(o))
            if isinstance(lay, Unknown) and not isinstance(lay, Partly):
                return Unknown(f"{lay.why} ({found.why})")
            return Unknown(found.why) if isinstance(lay, Batched) else lay

        if isinstance(got, tuple) and isinstance(out, (tuple, list)):
            return tuple(back(lay, o) for lay, o in zip(got, out))
        return back(got.outputs if hasattr(got, "outputs") else got, out)

    run.__doc__ = handler.__doc__
    run.__name__ = getattr(handler, "__name__", "run")
    return run


# ---------------------------------------------------------------------------
# x[index]


@dataclass
class _Adv:
    """One advanced index of ``x[...]``: its positions (int64, broadcastable to the
    block) and their own samples (``None``: shared), for input dim ``dim``."""

    dim: int
    values: Tensor
    own: Tensor | None


def _getitem(ctx, func, args, kwargs, out) -> Any:
    """``x[...]``: basic indices move the batch dim; index tensors and masks name
    positions by their values (see the module docstring)."""
    x, index = args[0], args[1]
    if not isinstance(out, Tensor):
        return followed(ctx, x)
    items = list(index) if isinstance(index, tuple) else [index]
    found = indexed_layout(ctx, x, items, out, name_of(func)) or Unknown(
        f"indexing {tuple(x.shape)} with {_describe(items)} moves the samples irregularly")
    return _keys_of_index(ctx, items, found)


def _keys_of_index(ctx: Ctx, items: list, found: Layout) -> Layout:
    """Rows picked by an index sorted by a key (``x[perm // k]``, ``perm`` from
    ``sort(experts)``): the picked rows are in the index's order, so they keep its keys."""
    if (len(items) != 1 or not isinstance(items[0], Tensor) or items[0].dim() != 1
            or not isinstance(found, Batched) or found.dim != 0):
        return found
    lay = ctx.layout(items[0])
    keys = keys_of(lay)
    if keys is None or lay.dim != 0:
        return found
    return with_keys(found, keys)


def _describe(items: list) -> str:
    return "[" + ", ".join(f"tensor{tuple(i.shape)}" if isinstance(i, Tensor) else repr(i)
                           for i in items) + "]"


def _is_tensor_like(item: Any) -> bool:
    return isinstance(item, Tensor) or (isinstance(item, (list, tuple)) and not any(
        isinstance(i, (Tensor, slice, type(Ellipsis), type(None))) for i in _flat(item)))


def _flat(item: Any) -> list:
    if isinstance(item, (list, tuple)):
        return [y for i in item for y in _flat(i)]
    return [item]


def _width(item: Any) -> int:
    """Input dims an index item consumes."""
    if item is None or item is Ellipsis:
        return 0
    if isinstance(item, Tensor) and item.dtype in (torch.bool, torch.uint8):
        return max(item.dim(), 1) if item.dim() else 0
    return 1


def indexed_layout(ctx: Ctx, x: Tensor, items: list, out: Tensor, what: str
                   ) -> Layout | None:
    """The layout of ``x[items]`` (``None`` where the form is not followed). An index
    tensor that mixes samples mixes the result: which rows it picks depends on several
    samples (a sort's indices are not mixed: each entry is its position's sample's)."""
    lay = followed(ctx, x)
    if any(isinstance(i, (list, tuple)) and not _is_tensor_like(i) for i in items):
        return None
    literal = {k: torch.as_tensor(i) for k, i in enumerate(items) if isinstance(i, (list, tuple))}
    if literal:  # lists of ints or bools: shared by all samples
        items = [literal.get(k, i) for k, i in enumerate(items)]
        known, outer = {id(t) for t in literal.values()}, ctx
        ctx = Ctx(ctx.n, lambda t: SHARED if id(t) in known else outer.layout(t), ctx.read)
    tensors = [i for i in items if isinstance(i, Tensor)]
    chosen = [t for t in tensors if _chosen_by_the_batch(ctx, t)]
    if chosen:  # (a number of the batch's data choosing what to index: a constant)
        ctx.read(f"{what} at a position chosen by the batch's data")
        known, outer = {id(t) for t in chosen}, ctx
        ctx = Ctx(ctx.n, lambda t: SHARED if id(t) in known else outer.layout(t), ctx.read)
    lays = [followed(ctx, t) for t in tensors]
    bad = trouble([lay] + lays)
    if bad is not None:
        return bad
    if chosen and lay is SHARED and all(t is SHARED for t in lays):
        return SHARED
    consumed = sum(_width(i) for i in items)
    if consumed > x.dim():
        return None
    if any(i is Ellipsis for i in items):
        k = items.index(Ellipsis)
        items = items[:k] + [slice(None)] * (x.dim() - consumed) + items[k + 1:]
    else:
        items = items + [slice(None)] * (x.dim() - consumed)
    if not tensors:
        return _basic(ctx, lay, x, items, out)
    return _advanced(ctx, lay, x, items, out, what, tensors)


def _chosen_by_the_batch(ctx: Ctx, t: Tensor) -> bool:
    """A 0-d integer index whose value mixes samples (an expert some token of the batch
    chose, from a loop over ``nonzero()`` of counts summed over the batch): taken as the
    constant it is in this forward, as a number read into Python is, where the capture
    notes such reads (``ctx.read``: the certificate of the call's first run compares a
    sample alone, which catches a choice that steers each sample by the others)."""
    return (ctx.read is not None and t.dim() == 0 and not t.is_floating_point()
            and not t.is_complex() and t.dtype is not torch.bool
            and type(ctx.layout(t)) is Mixed)


def _basic(ctx: Ctx, lay: Layout, x: Tensor, items: list, out: Tensor) -> Layout | None:
    """Ints, slices and ``None``: the batch dim moves, or a plain one is sliced."""
    if not isinstance(lay, (Batched, Partly)):
        return lay
    pos, in_dim = 0, 0
    for item in items:
        if item is None:
            pos += 1
            continue
        if in_dim == lay.dim:
            if not isinstance(item, slice):  # one position of the batch dim: one sample's
                return one_position(ctx, lay, x, item, out)
            if item != slice(None) and out.shape[pos] != x.shape[lay.dim]:
                if isinstance(lay, Batched) and lay.plain:
                    start, stop, step = item.indices(x.shape[lay.dim])
                    return indexed(pos, torch.arange(start, stop, step, device=x.device),
                                   ctx.n)
                return None
            return as_located(ctx, out, lay, pos)
        if isinstance(item, slice):
            pos += 1
        in_dim += 1
    return None


def one_position(ctx: Ctx, lay: Layout, x: Tensor, item: Any, out: Tensor) -> Layout | None:
    """``x[..., i, ...]`` at an int ``i`` of the batch dim: that position's sample's
    :class:`Piece` (``None`` for a position of no sample, or an index that is no int)."""
    if not isinstance(lay, Batched) or not isinstance(item, int) or isinstance(item, bool):
        return None
    size = x.shape[lay.dim]
    i = item + size if item < 0 else item
    if not 0 <= i < size:
        return None
    sample = int(sample_of_positions(lay, size, ctx.n, x.device)[i])
    return Piece("one position of the batch dim", sample, weakref.ref(out)) if sample >= 0 \
        else None


def _advanced(ctx: Ctx, lay: Layout, x: Tensor, items: list, out: Tensor, what: str,
              tensors: list) -> Layout | None:
    """Index tensors (masks as their nonzero positions): ints select first, the block of
    broadcast index dims lands where the first one is if they are adjacent, else in
    front (torch's rules); the predicted shape is checked against ``out``."""
    advs, post, in_dim = [], [], 0  # post: the result's dims, in order
    for item in items:
        if item is None:
            post.append(("new", None, None))
        elif isinstance(item, slice):
            post.append(("dim", in_dim, item))
            in_dim += 1
        elif isinstance(item, Tensor) and item.dtype in (torch.bool, torch.uint8):
            if item.dim() == 0:
                return None
            own, mask = _own(ctx, item), item.bool()
            where = mask.nonzero()  # (K, item.dim())
            sel = None if own is None else (
                own.expand(item.shape).index_select(0, where[:, 0]) if item.dim() == 1
                else own.expand(item.shape)[mask])  # (a 1-d mask: gathered, 6x cheaper)
            for j in range(item.dim()):
                advs.append(_Adv(in_dim + j, where[:, j], sel))
                post.append(("adv", len(advs) - 1, None))
            in_dim += item.dim()
        elif isinstance(item, Tensor):
            if item.is_floating_point() or item.is_complex():
                return None
            values = item.long()
            if values.numel() and values.min().item() < 0:
                values = torch.where(values < 0, values + x.shape[in_dim], values)
            advs.append(_Adv(in_dim, values, _own(ctx, item)))
            post.append(("adv", len(advs) - 1, None))
            in_dim += 1
        else:  # an int: selects
            in_dim += 1
    try:
        block = broadcast_shapes(*[a.values.shape for a in advs])
    except RuntimeError:
        return None
    places = [k for k, p in enumerate(post) if p[0] == "adv"]
    start = places[0] if places == list(range(places[0], places[-1] + 1)) else 0
    basics = [p for p in post if p[0] != "adv"]
    shape = [1 if p[0] == "new" else len(range(*p[2].indices(x.shape[p[1]]))) for p in basics]
    if tuple(shape[:start]) + block + tuple(shape[start:]) != tuple(out.shape):
        return None
    if lay is SHARED and any(a.own is not None and by_own_ids(x, a.dim, a.values, a.own)
                             for a in advs):
        return Mixed(f"{what} reads a shared table at the rows its entries' own samples "
                     "name (a row per sample in the batch: each sample alone would read "
                     "the first)")
    samples = None  # (no index tensor with samples of its own yet: none anywhere)
    for a in advs:
        if a.own is not None:
            own = a.own.expand(a.values.shape).expand(block)
            samples = own.to(x.device) if samples is None else merge(samples, own)
            if samples is None:
                return Mixed(f"{what} reads with one sample's index tensor another "
                             "sample's positions")
    shared = samples is None  # (no index tensor with samples of its own)
    if shared:
        samples = torch.full(block, NO_SAMPLE, dtype=torch.long, device=x.device)
    found = samples_along(ctx, x, lay)
    if found is not None:
        d, rows = found
        on_batch = [a for a in advs if a.dim == d]
        if not on_batch:  # the batch dim is a basic dim: index tensors must be shared
            if samples.numel() and samples.max().item() >= 0:
                return Mixed(f"{what} indexes one sample's rows with another sample's "
                             "index tensor")
            here = next((p for p in basics if p[0] == "dim" and p[1] == d), None)
            if here is None:
                return None  # an int picks one position of the batch dim
            k = basics.index(here)
            pos = k if k < start else k + len(block)
            if here[2] != slice(None) and out.shape[pos] != x.shape[d]:
                if isinstance(lay, Batched) and lay.plain:
                    begin, stop, step = here[2].indices(x.shape[d])
                    return indexed(pos, torch.arange(begin, stop, step, device=x.device),
                                   ctx.n)
                return None
            return as_located(ctx, out, lay, pos)
        values = on_batch[0].values.expand(block)
        if isinstance(lay, Batched) and lay.index is not None and not _read_by_value(
                samples, values, x.shape[d]):
            return None
        picked = gathered(rows, values)  # (the sample of the row each entry reads)
        samples = picked if shared else merge(samples, picked)
        if samples is None:
            return Mixed(f"{what} reads one sample's rows at positions another sample's "
                         "index gives")
    got = along_one_dim(samples)
    if got is None:
        return Unknown(f"{what} spreads the samples over several dims")
    k, rows = got
    keys = [lay.keys for lay in (followed(ctx, t) for t in tensors) if isinstance(lay, Sorted)]
    return with_keys(located(start + k, rows, ctx.n, out, what),
                      keys[0] if len(block) == 1 and len(keys) == 1 else None)


def by_own_ids(x: Tensor, dim: int, values: Tensor, own: Tensor) -> bool:
    """Does an index read shared ``x`` along ``dim`` at the positions its entries' own
    samples name (``table[batch]``, a graph batch's graph of each node), from rows that
    differ or from a parameter's? In the batch sample ``i`` reads row ``i``; alone it is
    sample 0 and reads row 0, which is the same only where the rows are equal and no
    parameter's (a state made from zeros for each graph, ``Set2Set``'s; an embedding of
    zeros, a virtual node's). ``own`` broadcasts to ``values``."""
    own = own.expand(values.shape)
    if not own.numel() or not nonnegative(own) or not torch.equal(values.long(), own.long()):
        return False
    base = x if x._base is None else x._base
    if isinstance(base, torch.nn.Parameter):
        return True
    return not torch.equal(x, x.narrow(dim, 0, 1).expand_as(x))


def _own(ctx: Ctx, t: Tensor) -> Tensor | None:
    """The own samples of an index tensor's entries (broadcastable), or ``None`` if it
    is shared."""
    lay = followed(ctx, t)
    if lay is SHARED:
        return None
    return element_samples(ctx, t, lay)


def _read_by_value(samples: Tensor, values: Tensor, size: int) -> bool:
    """Positions of an irregular batch dim (an index layout: packed rows, rows gathered
    or sorted by value) are read by index entries that carry samples; shared entries must
    visit every position once (a permutation undone, a self loop per node): other shared
    positions would pick rows by where other samples' rows happen to lie."""
    if not samples.numel() or samples.min().item() >= 0:
        return True
    unpaired = samples < 0
    picked = (values.index_select(0, unpaired.nonzero().squeeze(1)) if values.dim() == 1
              else values[unpaired])  # (1-d: gathered, cheaper than a boolean index)
    return picked.numel() == size and once_each(picked, size)


register(_getitem, torch.Tensor.__getitem__)
VALUE_READERS.add(torch.Tensor.__getitem__)


def _index_select(ctx, func, args, kwargs, out) -> Any:
    """``index_select(x, dim, idx)``: ``x[:, ..., idx]``; a 0-dim ``idx`` (``nonzero()
    .squeeze()`` of one row: ``nn.AdaptiveLogSoftmaxWithLoss``'s cluster of one sample)
    keeps the dim, as the ``(1,)`` index of the same layout does."""
    x = args[0]
    d = dim_of(arg(args, kwargs, 1, "dim"), x.dim())
    idx = arg(args, kwargs, 2, "index")
    if isinstance(idx, Tensor) and idx.dim() == 0:
        one, own, outer = idx.reshape(1), ctx.layout(idx), ctx
        ctx = Ctx(ctx.n, lambda t: own if t is one else outer.layout(t), ctx.read)
        idx = one
    items = [slice(None)] * d + [idx]
    return indexed_layout(ctx, x, items, out, name_of(func)) or Unknown(
        f"{name_of(func)} of dim {d} moves the samples irregularly")


register(_index_select, *aliases("index_select"))
VALUE_READERS.update(aliases("index_select"))


def _gather(ctx, func, args, kwargs, out) -> Any:
    """``gather(x, dim, index)``: the output has ``index``'s shape; along ``dim`` it reads
    ``x`` at ``index``'s values, along the other dims it pairs positions with ``x``."""
    x = args[0]
    d = arg(args, kwargs, 1, "dim")
    idx = arg(args, kwargs, 2, "index") if func not in _TAKE else arg(args, kwargs, 1,
                                                                        "indices")
    if func in _TAKE:
        d = arg(args, kwargs, 2, "dim")
        if d is None or idx.dim() != x.dim():
            return Unknown(f"{name_of(func)} without a dim, or broadcasting")
    d = dim_of(d, x.dim())
    lx, li = followed(ctx, x), followed(ctx, idx)
    bad = trouble([lx, li])
    if bad is not None:
        return bad
    found = [(t, lay) for t, lay in ((x, lx), (idx, li)) if lay is not SHARED]
    dims = {samples_along(ctx, t, lay)[0] for t, lay in found}
    if len(dims) > 1:
        return mixed(func, "pairs samples from different dims")
    b = dims.pop()
    if b != d:  # positions paired along the batch dim
        if idx.shape[b] != x.shape[b]:
            return Unknown(f"{name_of(func)} with an index not covering the batch")
        rows = merge(*[element_samples(ctx, t, lay).reshape(-1) if lay is not SHARED else
                       torch.full((idx.shape[b],), NO_SAMPLE, dtype=torch.long,
                                  device=idx.device)
                       for t, lay in ((x, lx), (idx, li))])
        if rows is None:
            return mixed(func, "pairs rows of different samples")
        return located(b, rows, ctx.n, out, name_of(func))
    samples = element_samples(ctx, idx, li).expand(idx.shape)
    if lx is not SHARED:
        values = torch.where(idx < 0, idx + x.shape[d], idx).long()
        if isinstance(lx, Batched) and lx.index is not None and not _read_by_value(
                samples, values, x.shape[d]):
            return Unknown(f"{name_of(func)} picks shared positions of an irregular batch dim")
        samples = merge(samples, samples_along(ctx, x, lx)[1][values])
        if samples is None:
            return mixed(func, "reads one sample's rows at another sample's positions")
    got = along_one_dim(samples)
    if got is None:
        return Unknown(f"{name_of(func)} spreads the samples over several dims")
    return located(got[0], got[1], ctx.n, out, name_of(func))


_TAKE = set(aliases("take_along_dim"))
register(_gather, *aliases("gather", "take_along_dim"))
VALUE_READERS.update(aliases("gather", "take_along_dim"))


# ---------------------------------------------------------------------------
# scatters: index_add, index_copy, index_fill, index_reduce, scatter, scatter_add,
# scatter_reduce (and their in-place forms)


def _scatter(ctx, func, args, kwargs, out) -> Any:
    """``x.index_add_(dim, index, source)`` and kin: every position of the result holds
    its old data and what lands there. Along the scatter dim, each row's sample is
    that of the rows landing in it (the source's, and the index entries' own; several
    samples mix), else the row's own (a shared row stays shared). An index whose values
    are its entries' own samples (``zeros(B, F).index_add_(0, sample_index, h)``)
    makes row ``g`` sample ``g``, rows nothing landed in included. Along another dim
    the op is per sample, positions paired as they are."""
    x = args[0]
    d = dim_of(arg(args, kwargs, 1, "dim"), x.dim())
    idx = arg(args, kwargs, 2, "index")
    src = arg(args, kwargs, 3, _SOURCE_NAME.get(func, "src"))
    if not isinstance(src, Tensor):
        src = kwargs.get("value") if isinstance(kwargs.get("value"), Tensor) else None
    named = [(t, followed(ctx, t)) for t in (x, idx, src) if isinstance(t, Tensor)]
    bad = trouble([lay for _, lay in named])
    if bad is not None:
        return bad
    if func in _INDEX_OPS and idx.dim() != 1:
        return Unknown(f"{name_of(func)} with an index that is not one-dimensional")
    dims = {d if t is idx and func in _INDEX_OPS else samples_along(ctx, t, lay)[0]
            for t, lay in named if lay is not SHARED and t.dim()}
    if not dims:
        return SHARED
    if len(dims) > 1:
        return mixed(func, "pairs samples from different dims")
    b = dims.pop()
    if b != d:
        return _per_sample(ctx, func, named, x, b, out)
    return _along_scatter_dim(ctx, func, x, d, idx, src, out)


def _per_sample(ctx: Ctx, func, named: list, x: Tensor, b: int, out: Tensor) -> Any:
    """The batch along a dim other than the scatter dim: each row of the result is the
    row of the same position of every input."""
    size = x.shape[b]
    rows = torch.full((size,), NO_SAMPLE, dtype=torch.long, device=x.device)
    for t, lay in named:
        if lay is SHARED or not t.dim() or (t is named[1][0] and func in _INDEX_OPS):
            continue
        own = samples_along(ctx, t, lay)[1]
        if own.shape[0] > size:
            return Unknown(f"{name_of(func)} of more rows than its result has")
        part = merge(rows[: own.shape[0]], own)
        if part is None:
            return mixed(func, "pairs rows of different samples")
        rows[: own.shape[0]] = part
    return located(b, rows, ctx.n, out, name_of(func))


def _along_scatter_dim(ctx: Ctx, func, x: Tensor, d: int, idx: Tensor, src: Tensor | None,
                       out: Tensor) -> Any:
    li = followed(ctx, idx)
    own = element_samples(ctx, idx, li)  # (broadcastable: the dims it is constant in 1)
    if func in _INDEX_OPS:  # index (J,): slice j of the source lands in row idx[j]
        own = own.expand(idx.shape)
        if src is not None and src.dim():
            ls = followed(ctx, src)
            along = element_samples(ctx, src, ls)
            along = _by_rows(along.expand(src.shape), d)
            if not torch.equal(along, along[:, :1].expand_as(along)):
                return mixed(func, "adds a source whose rows mix samples")
            own = merge(own, along[:, 0]) if along.shape[1] else own
    else:  # index as src: entry c lands in row index[c] of dim d
        ls = followed(ctx, src) if src is not None else SHARED
        if src is not None and src.dim() and ls is not SHARED:  # (a shared source's
            # entries name no sample: the index's own stand)
            along = element_samples(ctx, src, ls)
            along = along.reshape((1,) * (src.dim() - along.dim()) + tuple(along.shape))
            own = merge(own, along[tuple(slice(0, s if a > 1 else 1)
                                         for s, a in zip(idx.shape, along.shape))])
    if own is None:
        return mixed(func, "pairs an index with a source of other samples")
    got = _landed(ctx, name_of(func), x, d, idx, li, own, out, wraps=func in _FILLS)
    return _source_paired(ctx, func, (x, idx, src), src, d, own, idx, got)


def _by_rows(t: Tensor, d: int) -> Tensor:
    """``(t.shape[d], rest)``: ``t``'s entries by their index along ``d`` (``rest`` may be
    0: an empty tensor has rows and no entries in them)."""
    rest = math.prod(size for k, size in enumerate(t.shape) if k != d)
    return t.movedim(d, 0).reshape(t.shape[d], rest)


def _source_paired(ctx: Ctx, func, named: tuple, src: Tensor | None, d: int, own: Tensor,
                   idx: Tensor, got: Layout) -> Any:
    """A scatter's layout, with the pairing of a source whose rows along the scatter dim
    hold no sample's data (:class:`Partly`) where each row lands in a row of one sample:
    the sample ``own`` (each index entry's, merged with its source's) names there. Its
    other inputs pair by their own layouts."""
    lay = partly(ctx, src)
    if lay is None or lay.dim != d or not isinstance(got, Batched) or any(
            src is t for t in named[:2]):
        return got
    if func in _INDEX_OPS:  # (own: (J,), one per slice of the source along d)
        rows = own.reshape(-1)
    else:  # (own: per index entry; every entry of a source row must name one sample)
        if idx.shape[d] != src.shape[d]:
            return got
        rows = _by_rows(own.expand(idx.shape), d)
        if not torch.equal(rows, rows[:, :1].expand_as(rows)):
            return got
        rows = rows[:, 0]
    if rows.shape[0] != src.shape[d] or not nonnegative(rows):
        return got
    pairing = tuple(Batched(d, index=rows) if t is src else (
        ctx.layout(t) if isinstance(ctx.layout(t), Batched) else None)
        for t in named if isinstance(t, Tensor))
    return Flow(got, pairing)


def _names_samples(ctx: Ctx, idx: Tensor) -> bool:
    """Are an index tensor's values its entries' own samples (``nonzero`` of a mask over
    the batch: the batch index of each)?"""
    li = followed(ctx, idx)
    if trouble([li]) is not None or li is SHARED:
        return False
    named = element_samples(ctx, idx, li).expand(idx.shape)
    return nonnegative(named) and torch.equal(idx.long(), named)


def _landed(ctx: Ctx, what: str, x: Tensor, d: int, idx: Tensor, li: Layout, own: Tensor,
            out: Tensor, wraps: bool = True) -> Layout:
    """The layout of ``x`` after entries with samples ``own`` landed in its rows ``idx``
    along ``d`` (same shape): each row's sample is that of what landed there and its own;
    an index whose values are its entries' own samples names the rows of a result of one
    row per sample by sample (into rows of anything else, graph nodes, such values are a
    coincidence).
    ``wraps``: a negative index counts from the end (``x[idx] = v``, ``index_fill``;
    the other scatters refuse one)."""
    size = x.shape[d]
    idx = _distinct_entries(idx, own, d)
    landing = idx.long().reshape(-1)
    if wraps and landing.numel() and bool(landing.min() < 0):
        landing = torch.where(landing < 0, landing + size, landing)
    own = own.expand(idx.shape).reshape(-1)
    rows = landed_rows(landing, own, size)
    if rows is None:
        return Mixed(f"{what} puts several samples' data into one position")
    named = element_samples(ctx, idx, li).expand(idx.shape).reshape(-1)
    if li is not SHARED and landing.numel() and size == ctx.n and torch.equal(
            landing, named) and nonnegative(named):  # (an empty index names nothing)
        rows = merge(rows, torch.arange(size, device=x.device))  # (values are samples)
        if rows is None:
            return Mixed(f"{what} puts a sample's rows in another sample's place")
    lx = followed(ctx, x)
    if lx is not SHARED:
        rows = merge(rows, samples_along(ctx, x, lx)[1])
        if rows is None:
            return Mixed(f"{what} puts one sample's data into another sample's rows")
    return located(d, rows, ctx.n, out, what)


def landed_rows(landing: Tensor, own: Tensor, size: int) -> Tensor | None:
    """``(size,)``: the sample of what lands in each row, entry ``e`` (of sample
    ``own[e]``, ``NO_SAMPLE`` for shared data) landing in row ``landing[e]``;
    ``NO_SAMPLE`` where none of a sample lands; ``None`` where two samples land in one."""
    rows = torch.full((size + 1,), NO_SAMPLE, dtype=torch.long, device=landing.device)
    shared = own.numel() and own.min().item() < 0  # (entries of no sample: a row past
    target = torch.where(own >= 0, landing, size) if shared else landing  # the end)
    rows.scatter_(0, target, own)  # (one of the samples landing in each row: it is
    if not torch.equal(gathered(rows, target), own):  # every entry's only where no other
        return None  # lands there too)
    return rows[:size]


def _distinct_entries(idx: Tensor, own: Tensor, d: int) -> Tensor:
    """``idx`` without the dims it only repeats (stride 0: torch_geometric's node ids
    expanded over the features) where the samples ``own`` (broadcastable) repeat too:
    the same (row, sample) pairs, each once per row of those dims."""
    own = own.reshape((1,) * (idx.dim() - own.dim()) + tuple(own.shape))
    for k in range(idx.dim()):
        if k != d and idx.shape[k] > 1 and idx.stride(k) == 0 and own.shape[k] == 1:
            idx = idx.narrow(k, 0, 1)
    return idx


def written_layout(ctx: Ctx, x: Tensor, index: Any, value: Any) -> Layout:
    """``x``'s layout after ``x[index] = value``: an index tensor on the batch dim as
    :func:`setitem_layout`; else ``x`` keeps its layout if the value's samples land where
    ``x``'s are (or the value is shared), and becomes Unknown otherwise."""
    found = setitem_layout(ctx, x, index, value)
    if found is not None:
        return found
    items = index if isinstance(index, tuple) else (index,)
    mixing = trouble([ctx.layout(i) for i in items if isinstance(i, Tensor)])
    if isinstance(mixing, Mixed):  # (where the data lands depends on several samples)
        return mixing
    lx = ctx.layout(x)
    lv = ctx.layout(value) if isinstance(value, Tensor) else SHARED
    if lv.shared or not lx.known:
        return lx
    if not lv.known:
        return lv
    if isinstance(lx, Batched):
        if _lands(ctx, x, lx, index, value, lv):
            return lx
    elif lx.shared and isinstance(lv, Batched) and lv.index is None:
        # a shared tensor (``h.new_zeros(shape)``) taking per-sample data along a dim it
        # covers whole (``z[:, :2] = h[:, :2]``): batched there, its other entries shared
        whole = [d for d, item in enumerate(_items(index, x.dim())) if item == slice(None)]
        for d in whole:
            if _lands(ctx, x, lv.moved(d), index, value, lv):
                return lv.moved(d)
    return Unknown("a tensor written in place with per-sample data at other positions")


def _items(index: Any, dims: int) -> list:
    """A basic index's items, one per dim of the tensor (``None`` where it holds more
    than slices and ints: no dim is then said to be covered whole)."""
    items = list(index) if isinstance(index, tuple) else [index]
    if any(i is Ellipsis for i in items):
        k = items.index(Ellipsis)
        items = items[:k] + [slice(None)] * (dims - len(items) + 1) + items[k + 1:]
    if not all(isinstance(i, (slice, int)) for i in items) or len(items) > dims:
        return []
    return items + [slice(None)] * (dims - len(items))


def _lands(ctx: Ctx, x: Tensor, lx: Batched, index: Any, value: Tensor, lv: Batched) -> bool:
    """With ``x`` laid out as ``lx``, does ``x[index]`` hold the samples where ``value``
    holds them (each sample's data written at that sample's own positions)?"""
    with torch._C.DisableTorchFunction():
        view = x[index]
    if value.dim() > view.dim() or any(
            a != b for a, b in zip(reversed(value.shape), reversed(view.shape))):
        return False  # (value broadcast along the samples' dim: not one per sample)
    hypothetical = Ctx(ctx.n, lambda t: lx if t is x else ctx.layout(t), ctx.read)
    got = propagate(hypothetical, torch.Tensor.__getitem__, (x, index), {}, view).outputs
    return isinstance(got, Batched) and got == lv.moved(lv.dim + view.dim() - value.dim())


def setitem_layout(ctx: Ctx, x: Tensor, index: Any, value: Any) -> Layout | None:
    """``x[index] = value`` with one index tensor (or a 1-d mask) picking positions of
    ``x``'s dim ``d``, slices elsewhere, where ``x`` is shared or batched in ``d``
    (``out = empty_like(y); out[order] = y`` undoing a sort): ``index_copy_`` along
    ``d``. ``None`` for any other form (the capture's own rule)."""
    items = list(index) if isinstance(index, tuple) else [index]
    items = [torch.as_tensor(i) if isinstance(i, (list, tuple)) and _is_tensor_like(i) else i
             for i in items]
    if any(i is Ellipsis for i in items):
        k = items.index(Ellipsis)
        items = items[:k] + [slice(None)] * (x.dim() - len(items) + 1) + items[k + 1:]
    items += [slice(None)] * (x.dim() - len(items))
    picks = [k for k, i in enumerate(items) if isinstance(i, Tensor)]
    if len(items) != x.dim() or not 1 <= len(picks) <= 2 or any(
            i != slice(None) for k, i in enumerate(items) if k not in picks):
        return None
    if any(items[k].dim() != 1 or items[k].is_floating_point() for k in picks):
        return None
    if len(picks) == 1:
        return _set_rows(ctx, x, items, picks, picks[0], value)
    # x[a, b] = value (Longformer's global keys): one index picks the rows of the dim
    # that comes to hold the samples, the other a position within each row
    if picks[1] != picks[0] + 1 or items[picks[0]].shape != items[picks[1]].shape or any(
            items[k].dtype == torch.bool for k in picks):
        return None
    for d in sorted(picks, key=lambda k: not _names_samples(ctx, items[k])):
        found = _set_rows(ctx, x, items, picks, d, value)
        if isinstance(found, Batched):
            return found
    return None


def _set_rows(ctx: Ctx, x: Tensor, items: list, picks: list[int], d: int, value: Any
              ) -> Layout | None:
    """:func:`setitem_layout` with the rows of ``x``'s dim ``d`` picked by ``items[d]``
    (and, of two index tensors, a position within each row by the other)."""
    lx = followed(ctx, x)
    within = items[picks[0] + picks[1] - d] if len(picks) == 2 else None
    idx = items[d]
    li = followed(ctx, idx)
    if trouble([li, lx]) is not None or (lx is not SHARED and samples_along(ctx, x, lx)[0] != d):
        return None
    own = element_samples(ctx, idx, li).expand(idx.shape)
    if within is not None:  # the position in each row, from its own sample (or shared)
        lw = followed(ctx, within)
        if trouble([lw]) is not None:
            return None
        own = merge(own, element_samples(ctx, within, lw).expand(within.shape))
        if own is None:
            return Mixed("x[rows, cols] = value pairs rows and columns of other samples")
    if idx.dtype in (torch.bool, torch.uint8):  # (the positions a mask picks: their
        # samples are the mask's entries', their values no sample ids)
        own, idx, li = own[idx.bool()], idx.bool().nonzero()[:, 0], SHARED
    if not idx.shape[0]:  # (no position picked: nothing written)
        return ctx.layout(x)
    if isinstance(value, Tensor) and value.dim():
        lv = followed(ctx, value)
        if trouble([lv]) is not None:
            return None
        first = picks[0]  # where the indexed entries are in the value
        shape = [size for k, size in enumerate(x.shape) if k not in picks]
        shape.insert(first, idx.shape[0])
        along = element_samples(ctx, value, lv).expand(value.shape).expand(shape)
        along = _by_rows(along, first)
        if along.shape[1] and not torch.equal(along, along[:, :1].expand_as(along)):
            return None
        own = merge(own, along[:, 0]) if along.shape[1] else own
        if own is None:
            return Mixed("x[index] = value pairs an index with a value of other samples")
    if not own.numel() or own.max().item() < 0:
        return None
    return _landed(ctx, "x[index] = value", x, d, idx, li, own, x)


def _index_put(ctx, func, args, kwargs, out) -> Any:
    """``x.index_put_((index,), values, accumulate)``: ``x[index] = values`` (or ``+=``)."""
    x = args[0]
    indices, values = arg(args, kwargs, 1, "indices"), arg(args, kwargs, 2, "values")
    found = setitem_layout(ctx, x, tuple(indices), values)
    if found is not None:
        return found
    lays = [followed(ctx, t) for t in (x, values, *indices) if isinstance(t, Tensor)]
    bad = trouble(lays)
    if bad is not None:
        return bad
    return Unknown(f"{name_of(func)} writes per-sample data in a form not followed")


_INDEX_OPS = set(aliases("index_add", "index_add_", "index_copy", "index_copy_",
                         "index_fill", "index_fill_", "index_reduce", "index_reduce_"))
_SOURCE_NAME = {f: "source" for f in _INDEX_OPS}
_FILLS = set(aliases("index_fill", "index_fill_"))
_SCATTERS = list(_INDEX_OPS) + aliases("scatter", "scatter_", "scatter_add", "scatter_add_",
                                       "scatter_reduce", "scatter_reduce_")
register(_scatter, *_SCATTERS)
FLOAT_BLIND.update((_getitem, _index_select, _gather, _scatter))  # (they read the index
# tensors' values and masks, never the data's)
VALUE_READERS.update(_SCATTERS)
register(_index_put, *aliases("index_put", "index_put_"))
VALUE_READERS.update(aliases("index_put", "index_put_"))


# ---------------------------------------------------------------------------
# nonzero, where(cond), argwhere, masked_select: positions of a sample's entries


def _nonzero(ctx, func, args, kwargs, out) -> Any:
    """The positions of the nonzero entries: each is the sample's whose entry it is."""
    x = args[0] if args else kwargs.get("input", kwargs.get("condition"))
    lay = followed(ctx, x)
    bad = trouble([lay])
    if bad is not None or lay is SHARED:
        return every(out, bad or SHARED)
    found = samples_along(ctx, x, lay)
    if x.dim() == 0 or found is None:
        return every(out, Unknown(f"{name_of(func)} of a scalar"))
    d, rows = found
    coords = out[d] if isinstance(out, (tuple, list)) else out[:, d]
    samples = rows[coords.long()]
    if isinstance(out, (tuple, list)):
        return tuple(located(0, samples, ctx.n, o, name_of(func)) for o in out)
    return located(0, samples, ctx.n, out, name_of(func))


def _masked_select(ctx, func, args, kwargs, out) -> Any:
    """``masked_select(x, mask)``: the kept entries in row-major order of the broadcast."""
    x, mask = args[0], arg(args, kwargs, 1, "mask")
    lays = [followed(ctx, x), followed(ctx, mask)]
    bad = trouble(lays)
    if bad is not None:
        return bad
    shape = torch.broadcast_shapes(x.shape, mask.shape)
    samples = merge(element_samples(ctx, x, lays[0]).expand(x.shape).expand(shape),
                    element_samples(ctx, mask, lays[1]).expand(mask.shape).expand(shape))
    if samples is None:
        return mixed(func, "combines samples from different dims")
    return located(0, samples[mask.expand(shape).bool()], ctx.n, out, name_of(func))


def _masked_scatter(ctx, func, args, kwargs, out) -> Any:
    """``x.masked_scatter(mask, source)``: where the broadcast mask is set, the source's
    entries in row-major order (a vision-language model's image features into the rows
    of its image tokens). Taken by blocks of the trailing dims the mask is constant along
    (a row's features): the ``k``-th set block takes the source's ``k``-th block, whose
    sample must be the block's own, or the op puts one sample's data in another's rows
    (how many rows the samples before it set decides where each sample's data lands).
    A shared source under a mask of the samples' own is not followed (which entries a
    sample's rows take depends on the other samples' masks)."""
    x, mask, src = args[0], arg(args, kwargs, 1, "mask"), arg(args, kwargs, 2, "source")
    lays = [followed(ctx, t) for t in (x, mask, src)]
    bad = trouble(lays)
    if bad is not None:
        return bad
    rank, shape = out.dim(), tuple(out.shape)
    if not out.numel():
        return Unknown(f"{name_of(func)} of no entries")
    aligned = mask.reshape((1,) * (rank - mask.dim()) + tuple(mask.shape))
    j = rank  # blocks: the dims before j; the mask is constant along the ones after
    while j > 0 and (aligned.shape[j - 1] == 1 or aligned.stride(j - 1) == 0):
        j -= 1
    tail = math.prod(shape[j:])
    blocks = torch.full(shape[:j], NO_SAMPLE, dtype=torch.long, device=out.device)
    for t, lay in ((x, lays[0]), (mask, lays[1])):
        if lay is SHARED:
            continue
        own = element_samples(ctx, t, lay)
        own = own.reshape((1,) * (rank - own.dim()) + tuple(own.shape))
        if any(size != 1 for size in own.shape[j:]):
            return Unknown(f"{name_of(func)} with samples along the dims its mask is "
                           "constant along")
        merged = merge(blocks, own.reshape(own.shape[:j]).expand(shape[:j]))
        if merged is None:
            return mixed(func, "combines samples from different dims")
        blocks = merged
    taken = aligned
    for _ in range(rank - j):
        taken = taken.select(-1, 0)
    taken = taken.expand(shape[:j]).reshape(-1).nonzero().squeeze(1)  # (k,) set blocks
    landed = _source_blocks(ctx, src, lays[2], taken.numel(), tail)
    if landed is None:
        return Unknown(f"{name_of(func)} of a source whose samples change within a block "
                       "of the mask")
    if lays[1] is not SHARED and landed.numel() and not nonnegative(landed):
        return Unknown(f"{name_of(func)} takes a shared source's entries in the order of "
                       "every sample's masked positions")
    flat = blocks.reshape(-1)
    got = merge(flat.index_select(0, taken), landed)
    if got is None:
        return mixed(func, "puts one sample's source entries in another sample's positions")
    flat = flat.index_copy(0, taken, got)
    found = along_one_dim(flat.view(shape[:j]))
    if found is None:
        return Unknown(f"{name_of(func)} spreads the samples over several dims")
    return located(found[0], found[1], ctx.n, out, name_of(func))


def _source_blocks(ctx: Ctx, src: Tensor, lay: Layout, k: int, tail: int) -> Tensor | None:
    """``(k,)``: the sample of each of the first ``k`` blocks of ``tail`` entries of
    ``src`` in row-major order (``NO_SAMPLE`` for shared ones); ``None`` where a block
    spans positions of the source's batch dim."""
    if lay is SHARED:
        return torch.full((k,), NO_SAMPLE, dtype=torch.long, device=src.device)
    d, rows = samples_along(ctx, src, lay)
    inner = math.prod(src.shape[d + 1:])
    if inner % tail:
        return None
    position = torch.arange(k, device=src.device) * tail // inner % src.shape[d]
    return rows.long().index_select(0, position)


register(_masked_scatter, *aliases("masked_scatter", "masked_scatter_"))
VALUE_READERS.update(aliases("masked_scatter", "masked_scatter_"))
FLOAT_BLIND.add(_masked_scatter)


def where_positions(ctx, func, args, kwargs, out) -> Any:
    """``torch.where(condition)``: ``nonzero(condition, as_tuple=True)``."""
    return _nonzero(ctx, func, args, kwargs, out)


_NONZERO = aliases("nonzero", "argwhere")
register(_nonzero, *_NONZERO)
register(_masked_select, *aliases("masked_select"))
VALUE_READERS.update(_NONZERO + aliases("masked_select"))


# ---------------------------------------------------------------------------
# sorts along the batch dim: a permutation (or a selection) of the positions


def _sort(ctx, func, args, kwargs, out) -> Any:
    """``sort``/``argsort``/``topk`` along a dim: along another dim than the batch's the
    layout stays; along the batch dim each result position is the sample's whose entry
    it holds, read from the indices (the same for every other coordinate, or the samples
    are spread over several dims)."""
    x = args[0] if args else kwargs["input"]
    lay = followed(ctx, x)
    bad = trouble([lay])
    if bad is not None:
        return every(out, bad)
    default = -1
    pos = 2 if func in _TOPK else 1
    d = dim_of(arg(args, kwargs, pos, "dim", default), max(x.dim(), 1))
    found = samples_along(ctx, x, lay)
    if found is None:
        return every(out, lay)
    if found[0] != d:
        if isinstance(out, (tuple, list)):
            return tuple(as_located(ctx, o, lay) if isinstance(o, Tensor) else lay
                         for o in out)
        return as_located(ctx, out, lay)
    indices = out if isinstance(out, Tensor) else out[1]
    if indices.shape[d] != x.shape[d]:  # a selection across the samples, not a permutation
        return every(out, mixed(func, "selects positions of several samples by value"))
    samples = found[1][indices.long()]
    got = along_one_dim(samples.movedim(d, 0)) if samples.dim() else None
    if got is None or got[0] != 0:
        return every(out, Unknown(f"{name_of(func)} along the batch dim permutes each "
                                  "column differently"))
    keys = None
    if x.numel() == x.shape[d]:  # one key per position
        keys = x.reshape(-1)[indices.reshape(-1).long()]  # the sorted values
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    found = [with_keys(located(d, got[1], ctx.n, o, name_of(func)), keys) for o in outs]
    return tuple(found) if isinstance(out, (tuple, list)) else found[0]


def with_keys(lay: Layout, keys: Tensor | None) -> Layout:
    """``lay`` with ``keys`` the sort key of each position of its batch dim
    (:class:`Sorted`), kept by its index tensor too; ``lay`` itself without keys or
    samples."""
    if keys is None or not isinstance(lay, Batched):
        return lay
    if lay.index is not None:
        _KEYS[lay.index] = keys
    return Sorted(lay.dim, lay.outer, lay.inner, lay.index, keys)


# the sort keys of positions laid out by an index tensor, by that tensor's identity: an op
# that keeps the positions keeps the index tensor itself (``Batched.moved``), so the keys
# of ``perm // k`` or of a slice ``gate_up[..., ::2]`` are found without each op carrying
# them
_KEYS = WeakIdKeyDictionary()


def keys_of(lay: Layout) -> Tensor | None:
    """The sort key of each position along a batch dim sorted by one (``sort`` of the
    tokens' experts, and the ops that keep those positions), else ``None``."""
    if not isinstance(lay, Batched):
        return None
    if isinstance(lay, Sorted) and lay.keys is not None:
        return lay.keys
    return None if lay.index is None else _KEYS.get(lay.index)


_TOPK = set(aliases("topk"))
_SORTS = aliases("sort", "argsort", "topk")
register(_sort, *_SORTS)
VALUE_READERS.update(_SORTS)
