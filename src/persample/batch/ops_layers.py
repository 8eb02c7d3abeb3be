"""Layers (convolutions, pooling, norms, embeddings, attention, losses) and the
recurrent kernels: the op's own batch dim holds the samples.

Registered with :func:`persample.batch.flow.register`; see that module.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from .flow import (
    BROADCASTING,
    UNBROADCASTS,
    VALUE_READERS,
    Flow,
    aliases,
    arg,
    dim_of,
    every,
    mixed,
    name_of,
    op_leaves,
    register,
)
from .layouts import (
    SHARED,
    Batched,
    Mixed,
    Unknown,
    indexed,
    one_per_sample,
    sample_of_positions,
)
from .ops_elementwise import broadcast
from .ops_indexing import by_own_ids, element_samples

# ---------------------------------------------------------------------------
# layers: the op's own batch dim (0) holds the samples


def _leading(ctx, func, args, kwargs, out, spatial: int | None = None) -> Any:
    """Ops on ``(N, C, *s)`` (convolutions, pooling, GroupNorm, ...): the samples must
    be in (or merged into) dim 0, the op's batch; an unbatched input ``(C, *s)`` has
    its samples in the channels, mixing them."""
    x = arg(args, kwargs, 0, "input")
    lay = ctx.layout(x)
    if not isinstance(lay, Batched):
        return every(out, lay)
    if lay.dim != 0:
        return every(out, mixed(func, f"has the samples in dim {lay.dim}, which it mixes "
                                      "(an unbatched input?)"))
    if spatial is not None and x.dim() != spatial + 2:
        return every(out, mixed(func, "got an unbatched input, whose samples are its "
                                      "channels"))
    if isinstance(out, (tuple, list)):
        return tuple(lay if isinstance(o, Tensor) and o.dim() and o.shape[0] == x.shape[0]
                     else Unknown("an output without the batch dim") for o in out)
    if out.shape[0] != x.shape[0]:
        return Unknown(f"{name_of(func)} changed the op's batch dim")
    return lay


for _k, _names in {1: ["conv1d", "conv_transpose1d", "max_pool1d", "avg_pool1d",
                       "adaptive_avg_pool1d", "adaptive_max_pool1d", "lp_pool1d",
                       "max_pool1d_with_indices", "adaptive_max_pool1d_with_indices"],
                   2: ["conv2d", "conv_transpose2d", "max_pool2d", "avg_pool2d",
                       "adaptive_avg_pool2d", "adaptive_max_pool2d", "lp_pool2d",
                       "max_pool2d_with_indices", "adaptive_max_pool2d_with_indices",
                       "fractional_max_pool2d", "pixel_shuffle", "pixel_unshuffle",
                       "channel_shuffle"],
                   3: ["conv3d", "conv_transpose3d", "max_pool3d", "avg_pool3d",
                       "adaptive_avg_pool3d", "adaptive_max_pool3d", "lp_pool3d",
                       "max_pool3d_with_indices", "adaptive_max_pool3d_with_indices",
                       "fractional_max_pool3d"]}.items():
    register(lambda c, f, a, k, o, s=_k: _leading(c, f, a, k, o, s), *aliases(*_names))


def _grid_sample(ctx, func, args, kwargs, out) -> Any:
    """``grid_sample(x (N, C, *s), grid (N, *s', d))``: output ``n`` samples ``x[n]`` at
    ``grid[n]``. The samples stay in dim 0 (in the channels too, for a shared grid); a
    shared operand as long as the batch (a learned affine grid expanded to it) is paired
    with the samples there."""
    x, grid = arg(args, kwargs, 0, "input"), arg(args, kwargs, 1, "grid")
    lx, lg = ctx.layout(x), ctx.layout(grid)
    if lg is SHARED and isinstance(lx, Batched) and lx.dim == 1 and x.dim() > 3:
        return lx  # (the samples in the channels: each sampled at the same points)
    found = [lay for lay in (lx, lg) if lay is not SHARED]
    if any(not isinstance(lay, Batched) or lay.dim != 0 for lay in found):
        return next((lay for lay in found if not lay.known),
                    mixed(func, "has the samples in another dim than the op's batch"))
    if len(found) == 2 and found[0] != found[1]:
        return mixed(func, "pairs an input and a grid of different samples")
    lay = found[0]
    pairing = tuple(lay if own is SHARED and t.shape[0] == out.shape[0] else None
                    for t, own in ((x, lx), (grid, lg)))
    return Flow(lay, pairing if any(a is not None for a in pairing) else None)


register(_grid_sample, *aliases("grid_sample", "grid_sampler"))


def _affine_grid(ctx, func, args, kwargs, out) -> Any:
    """``affine_grid(theta (N, d, d + 1), size)``: grid ``n`` from ``theta[n]``."""
    lay = ctx.layout(arg(args, kwargs, 0, "theta"))
    if isinstance(lay, Batched) and lay.dim != 0:
        return mixed(func, "has the samples in a matrix's entries")
    return lay


register(_affine_grid, *aliases("affine_grid", "affine_grid_generator"))
register(_leading, *aliases("group_norm", "local_response_norm", "convolution",
                              "_convolution"), F.unfold, F.fold)


def _resampled(ctx, func, args, kwargs, out) -> Any:
    """``interpolate``/``upsample`` of ``(N, C, *s)``: each ``(n, c)`` plane is resampled
    alone, so samples in the channels stay there too (a batch of masks as one image's
    channels, ``mask[None]``: DETR's pixel mask); else as :func:`_leading`."""
    x = arg(args, kwargs, 0, "input")
    lay = ctx.layout(x)
    if (isinstance(lay, Batched) and lay.dim == 1 and x.dim() >= 3
            and isinstance(out, Tensor) and out.shape[:2] == x.shape[:2]):
        return lay
    return _leading(ctx, func, args, kwargs, out)


register(_resampled, *aliases("interpolate", "upsample", "upsample_nearest",
                              "upsample_bilinear"))


def _prelu(ctx, func, args, kwargs, out) -> Any:
    """``prelu(x, w)``: one slope per channel (dim 1) or one shared slope."""
    x, w = args[0], args[1]
    lay = ctx.layout(x)
    if isinstance(lay, Batched) and lay.dim == 1 and w.numel() > 1:
        return mixed(func, "has per-channel slopes on the batch dim")
    return lay


register(_prelu, *aliases("prelu", "_prelu_kernel"))


def _trailing(ctx, func, args, kwargs, out) -> Any:
    """``layer_norm``/``rms_norm(x, shape, ...)``: the trailing ``shape`` dims are
    normalised together, so the batch must be before them."""
    x = arg(args, kwargs, 0, "input")
    shape = arg(args, kwargs, 1, "normalized_shape")
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    lay = ctx.layout(x)
    if any(ctx.layout(t) is not SHARED for t in op_leaves(args[2:], {})):
        return Unknown(f"{name_of(func)} with a per-sample weight")
    if isinstance(lay, Batched) and lay.dim >= x.dim() - len(shape):
        return mixed(func, "normalises over the batch dim")
    return lay


register(_trailing, *aliases("layer_norm", "rms_norm"))


def _weight_norm(ctx, func, args, kwargs, out) -> Any:
    """``torch._weight_norm(v, g, dim)``: ``g v / ||v||``, the norm over every dim but
    ``dim`` (over all with ``dim=-1``). Samples along ``dim`` in both stay apart; along
    another dim the norm mixes them. One of them shared while the other holds samples
    along ``dim`` (a scale with a row per sample position) is left to the module: the
    fused kernel takes ``g`` of exactly the norm's shape, so one sample's op needs its
    own rows of both."""
    v, g = arg(args, kwargs, 0, "v"), arg(args, kwargs, 1, "g")
    dim = arg(args, kwargs, 2, "dim", 0)
    kept = None if dim == -1 else dim % v.dim()
    lays = [ctx.layout(v), ctx.layout(g)]
    batched = [lay for lay in lays if lay is not SHARED]
    if not batched:
        return SHARED
    if any(not isinstance(lay, Batched) or lay.dim != kept for lay in batched):
        return mixed(func, "normalises over the batch dim")
    if len(batched) == 1 or batched[0] != batched[1]:
        return Unknown(f"{name_of(func)} of a tensor holding samples with one that does "
                       "not")
    return batched[0]


register(_weight_norm, torch._weight_norm)


def _stats(func, args, kwargs) -> tuple:
    """``(x, weight, bias, running_mean, running_var, batch_stats)`` of ``F.batch_norm``,
    ``F.instance_norm`` or their ``torch.`` forms; ``batch_stats``: the op normalises
    with the input's own statistics (``training``, ``use_input_stats``)."""
    if func in _TORCH_FORMS:  # (input, weight, bias, running_mean, running_var, flag, ...)
        names = ("input", "weight", "bias", "running_mean", "running_var")
        x, w, b, mean, var = (arg(args, kwargs, i, k) for i, k in enumerate(names))
        flag = arg(args, kwargs, 5, "use_input_stats" if func is torch.instance_norm
                   else "training", False)
    else:  # (input, running_mean, running_var, weight, bias, flag, ...)
        names = ("input", "running_mean", "running_var", "weight", "bias")
        x, mean, var, w, b = (arg(args, kwargs, i, k) for i, k in enumerate(names))
        flag = arg(args, kwargs, 5, "training", False) if func is F.batch_norm else arg(
            args, kwargs, 5, "use_input_stats", True)
    return x, w, b, mean, var, bool(flag)


_TORCH_FORMS = {torch.batch_norm, torch.instance_norm}


def _norm_with_stats(ctx, func, args, kwargs, out) -> Any:
    """``batch_norm``/``instance_norm(x, running_mean, running_var, w, b, flag)``. With the
    input's own statistics (BatchNorm in training mode: over the batch, which mixes
    samples; InstanceNorm: each row's own) the running statistics are only written,
    not read: their layout does not reach the output, and afterwards they hold means
    over the batch (mixed). Otherwise (eval mode) they are read, and must be shared
    like the affine parameters."""
    x, w, b, mean, var, batch_stats = _stats(func, args, kwargs)
    read = [w, b] if batch_stats else [w, b, mean, var]
    for t in read:
        lay = ctx.layout(t)
        if isinstance(lay, (Mixed, Unknown)):
            return lay
        if lay is not SHARED:
            return mixed(func, "has per-sample statistics or affine parameters (one per "
                               "channel)")
    lay = ctx.layout(x)
    if func in (F.instance_norm, torch.instance_norm):
        found = _leading(ctx, func, args, kwargs, out)
    elif isinstance(lay, Batched) and lay.dim == 1 and x.dim() > 1:
        found = mixed(func, "has the batch in the channel dim")
    elif batch_stats and isinstance(lay, Batched):
        found = mixed(func, "normalises with the batch's statistics (training mode)")
    else:
        found = lay
    written = [t for t in (mean, var) if isinstance(t, Tensor)] if batch_stats else []
    if not written or lay is SHARED:
        return found
    means = mixed(func, "updated its running statistics with the batch's statistics")
    return Flow(found, writes=tuple((t, means) for t in written))


register(_norm_with_stats, F.batch_norm, torch.batch_norm, F.instance_norm, torch.instance_norm)
VALUE_READERS.update({F.batch_norm, torch.batch_norm, F.instance_norm, torch.instance_norm})


def _embedding(ctx, func, args, kwargs, out) -> Any:
    """``F.embedding(ids, W)`` (``torch.embedding(W, ids)``): the ids' samples, one
    trailing embedding dim more."""
    ids = arg(args, kwargs, 0, "input") if func is F.embedding else args[1]
    weight = arg(args, kwargs, 1, "weight") if func is F.embedding else args[0]
    if ctx.layout(weight) is not SHARED:
        return Unknown("embedding with a per-sample table")
    lay = ctx.layout(ids)
    if isinstance(lay, Batched) and by_own_ids(
            weight, 0, ids, element_samples(ctx, ids, lay)):
        return mixed(func, "looks up the rows its ids' own samples name (a row per sample "
                     "in the batch: each sample alone would read the first)")
    return lay


register(_embedding, F.embedding, torch.embedding)


def _one_hot(ctx, func, args, kwargs, out) -> Any:
    return ctx.layout(args[0])


register(_one_hot, *aliases("one_hot"))


def _embedding_bag(ctx, func, args, kwargs, out) -> Any:
    """``F.embedding_bag(ids, W, offsets, ...)``: 2-d ids are one bag per row; 1-d ids
    with offsets: every position of bag ``k`` must belong to sample ``k`` (read from the
    ids' layout and the offsets' values, whatever computed them: ``lengths.cumsum(0)``
    mixes samples but only places them). An empty bag holds no sample's data; its
    row stays at its place."""
    ids = arg(args, kwargs, 0, "input")
    offsets = arg(args, kwargs, 2, "offsets", None)
    weights = arg(args, kwargs, 8, "per_sample_weights", None)
    lay = ctx.layout(ids)
    outs = out if isinstance(out, (tuple, list)) else (out,)
    if ctx.layout(arg(args, kwargs, 1, "weight")) is not SHARED:
        return every(out, Unknown("embedding_bag with a per-sample table"))
    if weights is not None and isinstance(ctx.layout(weights), (Mixed, Unknown)):
        return every(out, ctx.layout(weights))
    if (lay is SHARED and ids.dim() == 1 and offsets is not None
            and isinstance(ctx.layout(offsets), Batched)):
        return every(out, mixed(func, (
            "ends each sample's bag where the next sample's offset begins: 1-d ids of "
            "several samples are one shared tensor (their dim 0 is not the batch's), so a "
            "sample's bag is made of the others' offsets; pass the ids as "
            "persample.PackedRows (offsets from its sample_index), or 2-d (a bag per "
            "row, padded with padding_idx)")))
    if not isinstance(lay, Batched):
        return every(out, lay)
    if ids.dim() == 2:
        if lay.dim != 0:
            return every(out, mixed(func, "bags the batch dim"))
        return tuple(lay for _ in outs) if isinstance(out, (tuple, list)) else lay
    include_last = arg(args, kwargs, 9, "include_last_offset", False)
    bags = 0 if offsets is None else offsets.shape[0] - (1 if include_last else 0)
    if bags != ctx.n:
        return every(out, Unknown("embedding_bag whose bags are not one per sample"))
    positions = ids.shape[0]
    sample = sample_of_positions(lay, positions, ctx.n, ids.device)
    t = torch.arange(positions, dtype=offsets.dtype, device=offsets.device)
    bag = (torch.searchsorted(offsets[:bags].contiguous(), t, right=True) - 1).clamp(0, bags - 1)
    if not bool((sample.to(bag.device) == bag).all()):
        return every(out, mixed(func, "puts several samples' positions in one bag"))
    found = Batched(0)
    return tuple(found for _ in outs) if isinstance(out, (tuple, list)) else found


register(_embedding_bag, F.embedding_bag, torch.embedding_bag)
VALUE_READERS.update({F.embedding_bag, torch.embedding_bag})


def _sdpa(ctx, func, args, kwargs, out) -> Any:
    """``scaled_dot_product_attention(q, k, v, attn_mask)``: samples in the leading
    dims of ``q``, ``k``, ``v`` (the same dim); keys and values of other samples must
    not be attended to."""
    q = arg(args, kwargs, 0, "query")
    k = arg(args, kwargs, 1, "key", None)
    v = arg(args, kwargs, 2, "value", None)
    mask = arg(args, kwargs, 3, "attn_mask", None)
    rank = out.dim()
    found = None
    for role, t in (("query", q), ("key", k), ("value", v), ("mask", mask)):
        lay = ctx.layout(t) if isinstance(t, Tensor) else SHARED
        if not isinstance(lay, Batched):
            continue
        d = lay.dim + rank - t.dim()
        if role != "query" and d >= rank - 2:  # (by role: q, k and v may be one tensor)
            return mixed(func, "attends across samples")
        if role == "query" and d == rank - 1:
            return mixed(func, "contracts the batch dim")
        here = lay.moved(d)
        if found is not None and found != here:
            return mixed(func, "pairs samples of its operands")
        found = here
    if found is None or found.dim >= rank - 2:
        return found
    # a shared operand as long as the batch dim (a shift mask repeated for every sample's
    # windows, Swin's; a learned query expanded to the batch, attention pooling's):
    # broadcasting pairs its rows with the samples' one to one
    pairing = []
    for t in op_leaves(args, kwargs):
        own = ctx.layout(t)
        d = found.dim - (rank - t.dim())
        pairing.append(own if isinstance(own, Batched) else found.moved(d) if (
            own.shared and 0 <= d < t.dim() - 2 and t.shape[d] == out.shape[found.dim] > 1)
            else None)
    return Flow(found, tuple(pairing)) if any(
        p is not None and not isinstance(ctx.layout(t), Batched)
        for p, t in zip(pairing, op_leaves(args, kwargs))) else found


register(_sdpa, *aliases("scaled_dot_product_attention"))
BROADCASTING.add(_sdpa)


def _sdpa_unbroadcast(func, args: tuple, kwargs: dict, narrow) -> tuple | None:
    """The attention mask is broadcast against the attention weights: one ``narrow``
    gives a smaller stand-in for (a bias ``expand``-ed to the batch) is read as it."""
    if len(args) > 3:
        mask = args[3]
        found = narrow(mask) if isinstance(mask, Tensor) else None
        return None if found is None else ((*args[:3], found, *args[4:]), kwargs)
    mask = kwargs.get("attn_mask")
    found = narrow(mask) if isinstance(mask, Tensor) else None
    return None if found is None else (args, {**kwargs, "attn_mask": found})


for _f in aliases("scaled_dot_product_attention"):
    UNBROADCASTS[_f] = _sdpa_unbroadcast


def _losses(ctx, func, args, kwargs, out) -> Any:
    """Loss functions: per element (``reduction="none"``) the batch stays (the class
    dim 1 of ``cross_entropy``/``nll_loss`` is dropped); reduced, samples mix."""
    reduction = kwargs.get("reduction", "mean")
    leaves = op_leaves(args, kwargs)
    found = [(t, ctx.layout(t)) for t in leaves if isinstance(ctx.layout(t), Batched)]
    if reduction != "none":
        return mixed(func, f"reduces over the batch (reduction={reduction!r})")
    x, lay = found[0]
    if func in _CLASS_LOSSES and x is args[0] and x.dim() > 1:
        if lay.dim == 1:
            return mixed(func, "has the batch in the class dim")
        return lay.moved(lay.dim - (1 if lay.dim > 1 else 0))
    return lay.moved(lay.dim + out.dim() - x.dim())


_CLASS_LOSSES = set(aliases("cross_entropy", "nll_loss", "multi_margin_loss"))
register(_losses, *aliases(
    "cross_entropy", "nll_loss", "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss",
    "binary_cross_entropy", "binary_cross_entropy_with_logits", "kl_div", "soft_margin_loss",
    "poisson_nll_loss", "gaussian_nll_loss", "hinge_embedding_loss", "multi_margin_loss"))


def _cosine(ctx, func, args, kwargs, out) -> Any:
    """``cosine_similarity(a, b, dim)``/``pairwise_distance``: reduce one dim."""
    return _broadcast_reduce(ctx, func, args, kwargs, out, kwargs.get(
        "dim", args[2] if len(args) > 2 and isinstance(args[2], int) else -1 if func in
        _PAIRWISE else 1))


_PAIRWISE = set(aliases("pairwise_distance"))


def _broadcast_reduce(ctx, func, args, kwargs, out, dim) -> Any:
    flow = broadcast(ctx, func, args[:2], {}, torch.empty(torch.broadcast_shapes(
        args[0].shape, args[1].shape), device="meta"))
    lay = flow.outputs
    if not isinstance(lay, Batched):
        return lay
    d = dim_of(dim, max(args[0].dim(), args[1].dim()))
    if lay.dim == d:
        return mixed(func, "reduces over the batch dim")
    return lay.moved(lay.dim - (1 if d < lay.dim and out.dim() < len(
        torch.broadcast_shapes(args[0].shape, args[1].shape)) else 0))


register(_cosine, *aliases("cosine_similarity", "pairwise_distance"))


# ---------------------------------------------------------------------------
# recurrent kernels and packed sequences


def _rnn(ctx, func, args, kwargs, out) -> Any:
    """``_VF.lstm/gru/rnn_tanh/rnn_relu``: padded input ``(T, B, I)`` (or batch first) or a
    packed ``(data, batch_sizes)``; output like the input, states ``(L*D, B, H)``.

    The kernel pairs sequence ``j`` (the batch dim's position ``j``; a packed sequence's
    column ``j``) with column ``j`` of the initial and final states. A shared input or
    state (zeros made for the batch, a learned state expanded to it) is paired by that
    position; a batched one must hold the samples that pairing gives it. ``pairing``
    says how each input pairs with the samples (the recurrent rule reads its inputs
    by it)."""
    packed = isinstance(args[1], Tensor) and args[1].dim() == 1 and not args[1].is_floating_point()
    x = args[0]
    hx, weights = (args[2], args[3]) if packed else (args[1], args[2])
    states = [t for t in (hx if isinstance(hx, (tuple, list)) else (hx,)) if isinstance(t, Tensor)]
    if any(ctx.layout(w) is not SHARED for w in weights):
        return every(out, Unknown(f"{name_of(func)} with per-sample weights"))
    found = (_packed_pairing(ctx, func, x, args[1], states) if packed
             else _padded_pairing(ctx, func, x, bool(args[-1])))
    if not isinstance(found, tuple):
        return every(out, found)
    seq, state = found
    if ctx.layout(x) not in (SHARED, seq):
        return every(out, mixed(func, "runs its recurrence over the samples' dim"))
    if any(ctx.layout(t) not in (SHARED, state) for t in states):
        return every(out, mixed(func, "pairs initial states with other samples' sequences"))
    pairing = tuple(seq if t is x else state if any(t is s for s in states) else None
                  for t in op_leaves(args, kwargs))
    return Flow((seq, *[state] * (len(out) - 1)), pairing)


def _padded_pairing(ctx, func, x: Tensor, batch_first: bool) -> tuple | Mixed:
    """The layouts a padded kernel input and the states pair with the samples."""
    lay = ctx.layout(x)
    d = 0 if batch_first else 1
    if isinstance(lay, Batched) and (x.dim() != 3 or lay.dim != d):
        return mixed(func, "runs its recurrence over the samples' dim")
    if isinstance(lay, Batched) and not lay.plain:  # (several sequences per sample, the
        return lay, lay.moved(1)  # samples merged with rows: Sequencer's image rows)
    return Batched(d), Batched(1)


def _packed_pairing(ctx, func, data: Tensor, sizes: Tensor, states: list[Tensor]
                    ) -> tuple | Unknown:
    """The layouts packed rows and the states pair with the samples: each sample one
    sequence; its column ``j`` of the first step names the sample of column ``j`` of
    every later step, and of the states. Rows of a batched ``data`` are read from its
    layout, those of a shared one from a batched state's."""
    lay = ctx.layout(data)
    if isinstance(lay, Batched):
        if lay.dim != 0 or lay.outer != 1 or lay.inner != 1:
            return Unknown(f"{name_of(func)} on packed rows of an unlike layout")
        rows = sample_of_positions(lay, data.shape[0], ctx.n, data.device)
        first = rows[: int(sizes[0])]
    else:
        lays = [ctx.layout(t) for t in states if isinstance(ctx.layout(t), Batched)]
        if not lays or lays[0].dim != 1 or lays[0].outer != 1 or lays[0].inner != 1:
            return Unknown(f"{name_of(func)}: a shared packed sequence with unlike states")
        first = sample_of_positions(lays[0], int(sizes[0]), ctx.n, data.device)
        rows = packed_rows(first, sizes)
    if not one_per_sample(first, ctx.n) or not torch.equal(rows, packed_rows(first, sizes)):
        return Unknown(f"{name_of(func)} on a packed sequence that is not one sequence per "
                       "sample")
    return indexed(0, rows, ctx.n), indexed(1, first, ctx.n)


def packed_rows(first: Tensor, sizes: Tensor) -> Tensor:
    """The sample of every row of a packed sequence whose first step's columns hold the
    samples ``first``: step ``t`` has the first ``sizes[t]`` of them, time-major."""
    return torch.cat([first[: int(k)] for k in sizes])


register(_rnn, *aliases("lstm", "gru", "rnn_tanh", "rnn_relu",
                          where=(torch._VF, torch._C._VariableFunctions)))


def _pack(ctx, func, args, kwargs, out) -> Any:
    """``_pack_padded_sequence(input, lengths, batch_first)``: rows time-major, the
    sample of each row from the input's layout and the lengths."""
    x, _lengths, batch_first = args[0], args[1], args[2]
    lay = ctx.layout(x)
    want = 0 if batch_first else 1
    if not isinstance(lay, Batched) or lay.dim != want or lay.outer != 1 or lay.inner != 1:
        return (Unknown("pack_padded_sequence of an unlike layout"), SHARED)
    order = sample_of_positions(lay, x.shape[want], ctx.n, x.device)
    return (indexed(0, packed_rows(order, out[1]), ctx.n), SHARED)


register(_pack, *aliases("_pack_padded_sequence", where=(torch._VF,
                                                          torch._C._VariableFunctions)))
VALUE_READERS.update(aliases("_pack_padded_sequence", where=(torch._VF,
                                                             torch._C._VariableFunctions)))


def _unpack(ctx, func, args, kwargs, out) -> Any:
    """``_pad_packed_sequence(data, batch_sizes, batch_first, ...)``: position ``j`` of the
    padded batch dim is column ``j`` of the packed rows' first step."""
    data, sizes, batch_first = args[0], args[1], args[2]
    lay = ctx.layout(data)
    if not isinstance(lay, Batched) or lay.dim != 0 or lay.outer != 1 or lay.inner != 1:
        return (Unknown("pad_packed_sequence of an unlike layout"), SHARED)
    rows = sample_of_positions(lay, data.shape[0], ctx.n, data.device)
    first = rows[: int(sizes[0])]
    if not torch.equal(rows, packed_rows(first, sizes)):
        return (Unknown("pad_packed_sequence of rows whose samples change column"), SHARED)
    return (indexed(0 if batch_first else 1, first, ctx.n), SHARED)


register(_unpack, *aliases("_pad_packed_sequence", where=(torch._VF,
                                                             torch._C._VariableFunctions)))


def _mha(ctx, func, args, kwargs, out) -> Any:
    """``F.multi_head_attention_forward`` left whole (sequence-first ``(T, B, E)``)."""
    q = args[0] if args else kwargs["query"]
    lay = ctx.layout(q)
    if isinstance(lay, Batched) and q.dim() == 3 and lay.dim == 1 and lay.plain:
        return (lay, Batched(0) if isinstance(out[1], Tensor) else SHARED)
    return every(out, Unknown("multi_head_attention_forward on an unlike layout"))


register(_mha, F.multi_head_attention_forward)


# the FFT family: (function name, default dims) with ``None``: every dim; an ``s``/``n``
# argument changes the sizes of the transformed dims only
_FFTS = {**{name: (-1,) for name in ("fft", "ifft", "rfft", "irfft", "hfft", "ihfft")},
         **{name: (-2, -1) for name in ("fft2", "ifft2", "rfft2", "irfft2", "hfft2",
                                         "ihfft2")},
         **{name: None for name in ("fftn", "ifftn", "rfftn", "irfftn", "hfftn", "ihfftn",
                                    "fftshift", "ifftshift")}}


def _fft(ctx, func, args, kwargs, out) -> Any:
    """``torch.fft.*``: the samples stay where they are unless the transform runs along
    their dim (FNet's token mixing along the sequence, GFNet's filter over patches)."""
    x = args[0] if args else kwargs["input"]
    lay = ctx.layout(x)
    if not isinstance(lay, Batched) or not lay.plain:
        return every(out, Unknown(f"{name_of(func)} of an unlike layout"))
    name = func.__name__.removeprefix("fft_")  # (torch.fft.fft2.__name__ is "fft_fft2")
    shift = name in ("fftshift", "ifftshift")
    dims = arg(args, kwargs, 1 if shift else 2, "dim", _FFTS[name])
    size = None if shift or name in _ONE_D else arg(args, kwargs, 1, "s", None)
    if dims is None:
        dims = range(x.dim() - len(size), x.dim()) if size is not None else range(x.dim())
    dims = [dims] if isinstance(dims, int) else dims
    if lay.dim in {dim_of(d, x.dim()) for d in dims}:
        return mixed(func, "transforms along the batch")
    return lay


_ONE_D = {"fft", "ifft", "rfft", "irfft", "hfft", "ihfft"}
register(_fft, *(getattr(torch.fft, name) for name in _FFTS))


def _complex_view(ctx, func, args, kwargs, out) -> Any:
    """``view_as_complex`` drops the last dim (the pairs), ``view_as_real`` adds it."""
    x = args[0] if args else kwargs["input"]
    lay = ctx.layout(x)
    if not isinstance(lay, Batched) or not lay.plain or lay.dim >= out.dim():
        return Unknown(f"{name_of(func)} of an unlike layout")
    return lay


register(_complex_view, *aliases("view_as_complex", "view_as_real"))


def _cdist(ctx, func, args, kwargs, out) -> Any:
    """``cdist(x1 (..., P, M), x2 (..., R, M)) -> (..., P, R)``: the samples of a leading
    dim stay there (broadcast), those of ``x1``'s rows go to the rows, ``x2``'s to the
    columns; both operands' rows, or the coordinates, pair samples."""
    x1, x2 = args[0], args[1]
    found = []
    for x, rows_to in ((x1, out.dim() - 2), (x2, out.dim() - 1)):
        lay = ctx.layout(x)
        if lay.shared:
            continue
        if not isinstance(lay, Batched) or not lay.plain:
            return Unknown(f"{name_of(func)} of an unlike layout")
        if lay.dim == x.dim() - 1:
            return mixed(func, "sums over the batch")
        found.append(rows_to if lay.dim == x.dim() - 2 else lay.dim + out.dim() - x.dim())
    if len(set(found)) > 1:
        return mixed(func, "pairs samples of its operands")
    return Batched(found[0]) if found else SHARED


register(_cdist, *aliases("cdist"))
