"""The exact paths for what no rule covers: per-sample vector-Jacobian products with
``torch.func``, of one op or of one module call.

The method of PyTorch's per-sample-gradients tutorial (``vmap`` over samples of
``vjp``), applied to the smallest piece that needs it:

- :func:`op_vjp` ("op vjp"): one op reading a parameter in a form no rule knows (a
  class token joined with ``cat`` in a custom way, a parameter through an op
  without a rule), or a derived parameter's producing op. Each sample's inputs
  are its own views (``front``, a batch of one in the op's own layout), shared
  inputs are passed whole;
- :func:`module_vjp` (the per-module fallback): a module call whose inside the
  capture could not follow (a custom ``autograd.Function``, a tensor of unknown
  layout inside), run per sample with ``torch.func.functional_call``.

Where the batch is in each input and output comes from the capture's data flow
(:mod:`persample.batch`), never from sizes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call, vjp, vmap
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

from ..batch import Batched, front
from ..batch.flow import IN_PLACE_OPERATORS
from ..batch.forms import forms
from ..draws import Draw, DrawNotReplayable, Replay, at
from ..errors import UnsupportedModuleError
from ..patches import solves_broadcast
from ..precision import replaying
from ..rules.spec import EXPANSIONS


def per_sample_vjp(fn: Callable[..., tuple[Tensor, ...]], values: list, pairings: list,
                   wrt: list[int], cots: list[Tensor], out_pairings: list, n: int,
                   draws: list[Draw] | None = None, recurrent: bool = False) -> list[Tensor]:
    """Per-sample VJPs of ``fn(*values)`` with respect to ``values[k]`` for ``k`` in ``wrt``.

    ``pairings[k]``: how value ``k`` pairs with the samples (a layout; each sample gets
    its own view ``front(value)[i]``), or ``None`` (shared). ``cots``: per output of
    ``fn``, ``(n, v, *per_sample_out)``. An output that ``fn`` returns whole (all its
    inputs shared) is cut to sample ``i`` by ``out_pairings``. Returns per ``k`` in
    ``wrt``: ``(n, v, *shape)``, ``shape`` the value's own shape if shared, else its
    per-sample shape. ``draws``: the random ops ``fn`` runs, recorded by the capture:
    each sample replays its part of them (:class:`persample.draws.Replay`). ``recurrent``:
    ``fn`` runs a recurrent layer (:func:`_unfused`).
    """
    replay = Replay(draws, n, EXPANSIONS) if draws else None
    mapped = [k for k, a in enumerate(pairings) if a is not None]
    fronted = [front(values[k].detach(), pairings[k], n) for k in mapped]
    shared = [v.detach() if isinstance(v, Tensor) else v for v in values]
    shapes = [tuple(c.shape[2:]) for c in cots]

    def one(rows: list[Tensor], index: Tensor, cots_i: list[Tensor]) -> tuple[Tensor, ...]:
        vals = list(shared)
        for k, row in zip(mapped, rows):
            vals[k] = row

        def f(*theta: Tensor) -> tuple[Tensor, ...]:
            for k, t in zip(wrt, theta):
                vals[k] = t
            outs = fn(*vals)
            return tuple(_sample(o, s, a, index, n) for o, s, a in zip(outs, shapes, out_pairings))

        if replay is None:
            _, pull = vjp(f, *[vals[k] for k in wrt])
        else:
            with replay.of(index):
                _, pull = vjp(f, *[vals[k] for k in wrt])
        return vmap(pull)(tuple(cots_i))  # over the v cotangents

    index = torch.arange(n, device=cots[0].device)
    with _unfused(recurrent), solves_broadcast():
        return list(vmap(one)(fronted, index, cots))


_RECURRENT = frozenset(("lstm", "gru", "rnn_tanh", "rnn_relu"))  # (the fused kernels' ops)


@contextmanager
def _unfused(recurrent: bool) -> Iterator[None]:
    """Where ``recurrent``: oneDNN's and cuDNN's recurrent kernels off (their backward
    has no batching rule for ``vmap``: an LSTM in float32 on the CPU fails in it), so that
    the layers run as PyTorch's own cell ops, which ``vmap`` batches. The same function;
    the flags are put back after."""
    if not recurrent:
        yield
        return
    backends = torch.backends
    was = backends.mkldnn.enabled, backends.cudnn.enabled
    backends.mkldnn.enabled = backends.cudnn.enabled = False
    try:
        yield
    finally:
        backends.mkldnn.enabled, backends.cudnn.enabled = was


def _sample(out: Tensor, shape: tuple, pairing: Any, index: Tensor, n: int) -> Tensor:
    """One sample's output: as it is, or sample ``index`` of a whole output."""
    if tuple(out.shape) == shape:
        return out
    if isinstance(pairing, Batched):
        return front(out, pairing, n).index_select(0, index.reshape(1)).squeeze(0)
    raise ValueError(f"a per-sample output of shape {tuple(out.shape)}, expected {shape}")


def _out_of_place(func: Any, kwargs: dict) -> tuple[Any, dict]:
    """The out-of-place form of an in-place op, to replay it without writing into the
    captured tensors (``add_`` -> ``add``, ``__iadd__`` -> ``__add__``, ``inplace=True``)."""
    name = getattr(func, "__name__", "")
    kwargs = {k: v for k, v in kwargs.items() if k != "out"}
    if func in _WRITES:
        return _WRITES[func], kwargs
    if kwargs.get("inplace"):
        kwargs["inplace"] = False
    if name in IN_PLACE_OPERATORS:
        return getattr(torch.Tensor, "__" + name[3:]), kwargs
    if name.endswith("_") and not name.endswith("__"):
        found = getattr(torch.Tensor, name[:-1], None) or getattr(torch, name[:-1], None)
        if found is not None:
            return found, kwargs
    return func, kwargs


def _setitem(x: Tensor, index: Any, value: Any) -> Tensor:
    """``x[index] = value`` out of place: a copy of ``x`` with ``value`` written."""
    y = x.clone()
    y[index] = value
    return y


def _copied(x: Tensor, src: Tensor, non_blocking: bool = False) -> Tensor:
    """``x.copy_(src)`` out of place: ``src`` broadcast to ``x`` in ``x``'s dtype (no
    gradient to ``x``, whose values it replaces)."""
    return torch.where(torch.ones_like(x, dtype=torch.bool), src.to(x.dtype), x)


_WRITES = {torch.Tensor.__setitem__: _setitem, torch.Tensor.copy_: _copied}


def op_vjp(op: Any, cots: list[Tensor | None], out_pairings: list, pairings: list, wrt: list[int],
           n: int) -> list[Tensor]:
    """Per-sample VJPs of one recorded op (:class:`persample.capture.Op`) with respect to
    its leaves ``wrt``; ``cots`` per output tensor (``None``: no cotangent)."""
    func, kwargs = _out_of_place(op.func, op.kwargs)
    flat, spec = tree_flatten((op.args, kwargs))
    position = {id(t): k for k, t in enumerate(op.leaves)}
    slots = [position.get(id(x)) if isinstance(x, Tensor) else None for x in flat]
    used = [k for k, c in enumerate(cots) if c is not None]

    def fn(*values: Tensor) -> tuple[Tensor, ...]:
        leaves = [values[s] if s is not None else x for x, s in zip(flat, slots)]
        args, kw = tree_unflatten(leaves, spec)
        out = func(*args, **kw)
        outs = [out] if isinstance(out, Tensor) else [o for o in out if isinstance(o, Tensor)]
        return tuple(outs[k] for k in used)

    op.ready()
    values = [op.value(k) for k in range(len(op.leaves))]
    with replaying(op.autocast):
        return per_sample_vjp(fn, values, pairings, wrt, [cots[k] for k in used],
                              [out_pairings[k] for k in used], n,
                              None if op.draw is None else [op.draw],
                              getattr(op.func, "__name__", "") in _RECURRENT)


def shared_vjp(op: Any, cots: list[Tensor | None], wrt: list[int]) -> list[Tensor]:
    """VJPs of an op all of whose inputs are shared by the samples (a derived parameter's
    op: ``W.t()``, ``pos.to(dtype)``, an embedding of ``arange`` ids), for ``(n, v, *out)``
    cotangents: one batched backward (``is_grads_batched``), no replay per sample."""
    values, outs = _replay(op, wrt)
    used = [k for k, c in enumerate(cots) if c is not None]
    n, v = cots[used[0]].shape[:2]
    grads = torch.autograd.grad([outs[k] for k in used], [values[k] for k in wrt],
                                [cots[k].flatten(0, 1) for k in used], is_grads_batched=True,
                                allow_unused=True)
    # a leaf the replay did not read (the same tensor twice, ``A * A``: read as its last
    # position) gets zeros with the (n, v) dims, which materialize_grads would not give
    return [values[k].new_zeros((n, v, *values[k].shape)) if g is None else
            g.unflatten(0, (n, v)) for k, g in zip(wrt, grads)]


_UNBINDS = frozenset(forms(torch.unbind))
PIECES = frozenset(f for name in ("split", "chunk", "tensor_split", "split_with_sizes",
                                  "unsafe_split", "unsafe_chunk", "unbind")
                   for f in forms(getattr(torch, name)))


def pieces_vjp(op: Any, cots: list[Tensor | None], pairing: Any, n: int) -> Tensor:
    """The per-sample cotangent ``(n, v, *shape)`` of the one input of a ``split``,
    ``chunk``, ``tensor_split`` or ``unbind`` (a derived tensor cut into gates, GRU's
    ``W_hh h_0``): its pieces' cotangents ``(n, v, *per_sample_piece)`` joined along the
    cut dim, zeros for pieces without one. ``pairing``: the input's (``None``: shared);
    a cut of the dim that holds the samples is not handled (``ValueError``)."""
    x, unbind = op.leaves[0], op.func in _UNBINDS
    pos = 1 if unbind else 2
    d = op.kwargs.get("dim", op.args[pos] if len(op.args) > pos else 0)
    d = d + x.dim() if d < 0 else d
    if pairing is not None and d == pairing.dim:
        raise ValueError("a cut of the samples' dim")
    given = next(c for c in cots if c is not None)
    whole = list(x.shape if pairing is None else pairing.per_sample_shape(x, n))
    parts = []
    for out, c in zip(op.outputs, cots):
        if c is None:  # (the input's per-sample shape, this piece's part of the cut dim)
            shape = whole[:d] + whole[d + 1:] if unbind else (
                whole[:d] + [out.shape[d]] + whole[d + 1:])
            c = given.new_zeros((*given.shape[:2], *shape))
        parts.append(c.unsqueeze(d + 2) if unbind else c)
    return torch.cat(parts, d + 2)


def paired_vjp(op: Any, cots: list[Tensor | None], out_pairings: list, pairings: list,
               wrt: list[int], n: int) -> list[Tensor] | None:
    """Per-sample VJPs of a derived op whose output and inputs ``wrt`` are paired with the
    samples (learned latents expanded to the batch, then normalised: each position along
    the paired dim computed from the same position of its inputs), in one backward: every
    sample's cotangent placed at its own positions, the gradient read back at them. The
    data flow that paired them says no position reads another sample's, so the blocks do
    not overlap (an LSTM's learned initial states: each sequence's own column). ``None``
    where it does not apply (an input broadcast over the samples, a pairing by index, a
    random op): the caller takes :func:`op_vjp`."""
    used = [k for k, c in enumerate(cots) if c is not None]
    if (not used or op.draw is not None
            or any(not _by_arithmetic(out_pairings[k]) for k in used)
            or any(not _by_arithmetic(pairings[k]) for k in wrt)):
        return None
    v = cots[used[0]].shape[1]
    gs = [_unfront(cots[k], out_pairings[k], n) for k in used]  # (v, *out) each
    values, outs = _replay(op, wrt)
    if any(tuple(outs[k].shape) != tuple(g.shape[1:]) for k, g in zip(used, gs)):
        return None
    grads = torch.autograd.grad([outs[k] for k in used], [values[k] for k in wrt],
                                gs if v > 1 else [g[0] for g in gs], is_grads_batched=v > 1,
                                allow_unused=True, materialize_grads=True)
    return [pairings[k].front_cotangents(gk if v > 1 else gk.unsqueeze(0), n)
            for k, gk in zip(wrt, grads)]


def _by_arithmetic(lay: Any) -> bool:
    return isinstance(lay, Batched) and lay.index is None


def _unfront(c: Tensor, lay: Batched, n: int) -> Tensor:
    """``(n, v, *per_sample)`` -> ``(v, *shape)``: the inverse of ``front_cotangents``."""
    d = lay.dim + 1  # (v leads once the samples' dim is back in place)
    if lay.outer == 1 and lay.inner == 1:
        return c.squeeze(d + 1).movedim(0, d)
    return c.unflatten(d + 1, (lay.outer, lay.inner)).movedim(0, d + 1).flatten(d, d + 2)


def summed_vjp(op: Any, g: Tensor, wrt: list[int]) -> list[Tensor]:
    """The VJP of a recorded single-output op for one cotangent ``g`` (the output's own
    shape, e.g. backprops already scaled per sample), with respect to its leaves ``wrt``:
    the op replayed on the values it read, then one backward. Nothing of the model's
    autograd graph is needed (DP book-keeping: the clipped sum of an op without a
    weighted-sum rule, after the graph was freed). Returns one tensor per ``wrt``, its
    leaf's shape."""
    values, outs = _replay(op, wrt)
    return list(torch.autograd.grad(outs[0], [values[k] for k in wrt], g,
                                    allow_unused=True, materialize_grads=True))


def _replay(op: Any, wrt: list[int]) -> tuple[list[Tensor], list[Tensor]]:
    """Run a recorded op again, out of place, on the values it read (detached; the
    leaves ``wrt`` requiring grad). Returns the values and the output tensors."""
    func, kwargs = _out_of_place(op.func, op.kwargs)
    flat, spec = tree_flatten((op.args, kwargs))
    position = {id(t): k for k, t in enumerate(op.leaves)}
    op.ready()
    values = [op.value(k).detach() for k in range(len(op.leaves))]
    for k in wrt:
        values[k] = values[k].requires_grad_()
    leaves = [values[position[id(x)]] if isinstance(x, Tensor) and id(x) in position else x
              for x in flat]
    args, kw = tree_unflatten(leaves, spec)
    with torch.enable_grad(), replaying(op.autocast), at(op.draw):  # the numbers it drew
        out = func(*args, **kw)
    return values, [out] if isinstance(out, Tensor) else [o for o in out if isinstance(o, Tensor)]


def expand_vjp(op: Any, wrt: list[int], g: Tensor, out_layout: Batched, n: int,
               paired: list | None = None) -> list[Tensor]:
    """Per-sample VJPs of shared inputs that an op broadcasts over the samples (a
    position bias in ``where(mask, bias, -inf)``, an attention mask of
    ``scaled_dot_product_attention``, ``x * gamma`` in any form), from the op's own
    backward: each such input is expanded along the samples' dim to a per-sample copy,
    the op runs once on the batch, and the gradient of the copy holds every sample's
    row. ``g``: the backprops ``(v, *out)`` in the output's own layout. ``paired``: per
    input of ``wrt``, how the op pairs it with the samples where it is already as long
    as the batch (Swin's mask, repeated for every sample's windows; ``None`` else): its
    copy is not expanded, and its rows are cut by that pairing. Returns ``(n, v,
    *input.shape)`` per input of ``wrt`` (``(n, v, *per_sample_shape)`` for a paired
    one).
    """
    from ..rules.calls import reduce_to

    func, kwargs = _out_of_place(op.func, op.kwargs)
    flat, spec = tree_flatten((op.args, kwargs))
    position = {id(t): k for k, t in enumerate(op.leaves)}
    op.ready()
    values = [op.value(k).detach() for k in range(len(op.leaves))]
    out = op.outputs[0]
    size, copies = out.shape[out_layout.dim], []
    paired = paired or [None] * len(wrt)
    for k, pairing in zip(wrt, paired):
        t = values[k]
        if pairing is not None:  # already one row per sample's positions
            copy = t.clone().requires_grad_()
            values[k] = copy
            copies.append((copy, pairing))
            continue
        lead = out_layout.dim - (out.dim() - t.dim())  # broadcasting aligns the right ends
        if lead < 0:
            t, lead = t.reshape((1,) * -lead + tuple(t.shape)), 0
        if t.shape[lead] != 1:
            raise ValueError("an input not broadcast along the samples' dim")
        copy = t.expand(*t.shape[:lead], size, *t.shape[lead + 1:]).clone().requires_grad_()
        values[k] = copy
        copies.append((copy, lead))
    leaves = [values[position[id(x)]] if isinstance(x, Tensor) and id(x) in position else x
              for x in flat]
    args, kw = tree_unflatten(leaves, spec)
    with torch.enable_grad(), replaying(op.autocast), at(op.draw):  # the numbers it drew
        result = func(*args, **kw)
    result = result if isinstance(result, Tensor) else result[0]
    v = g.shape[0]
    grads = torch.autograd.grad(result, [c for c, _ in copies], g if v > 1 else g[0],
                                is_grads_batched=v > 1, allow_unused=True,
                                materialize_grads=True)
    found = []
    for k, (_, lead), gc in zip(wrt, copies, grads):
        gc = gc if v > 1 else gc.unsqueeze(0)  # (v, *copy.shape)
        if isinstance(lead, Batched):  # a paired input: its own rows per sample
            found.append(lead.front_cotangents(gc, n))
            continue
        per_sample = out_layout.moved(lead).front_cotangents(gc, n)  # (n, v, *per_sample)
        found.append(reduce_to(per_sample, tuple(op.leaves[k].shape)))
    return found


def module_vjp(call: Any, params: dict[str, nn.Parameter], in_pairings: list, cots: list,
               out_pairings: list, n: int, draws: list[Draw] | None = None
               ) -> dict[str, Tensor]:
    """Per-sample VJPs ``{name: (n, v, *param.shape)}`` of one module call with respect to
    ``params`` (names relative to ``call.module``); ``in_pairings`` per tensor leaf of
    ``(call.args, call.kwargs)``; ``cots`` per output tensor (``None``: none); ``draws``:
    the random ops the call ran, replayed per sample."""
    flat, spec = tree_flatten((call.args, call.kwargs))
    tensor_slots = [k for k, x in enumerate(flat) if isinstance(x, Tensor)]
    names = list(params)
    used = [k for k, c in enumerate(cots) if c is not None]

    def fn(*values: Tensor) -> tuple[Tensor, ...]:
        theta = dict(zip(names, values[:len(names)]))
        leaves = list(flat)
        for slot, value in zip(tensor_slots, values[len(names):]):
            leaves[slot] = value
        args, kwargs = tree_unflatten(leaves, spec)
        outs = [t for t in tree_leaves(functional_call(call.module, theta, tuple(args), kwargs))
                if isinstance(t, Tensor)]
        return tuple(outs[k] for k in used)

    values = [params[m] for m in names] + [flat[k] for k in tensor_slots]
    pairings = [None] * len(names) + list(in_pairings)
    try:
        with replaying(call.autocast):
            got = per_sample_vjp(fn, values, pairings, list(range(len(names))),
                                 [cots[k] for k in used], [out_pairings[k] for k in used], n,
                                 draws, any(isinstance(m, nn.RNNBase)
                                            for m in call.module.modules()))
    except DrawNotReplayable:
        raise
    except Exception as err:  # torch.func raises many kinds of errors
        raise UnsupportedModuleError(
            f"module {call.describe()} could not be followed op by op and torch.func could "
            f"not differentiate it per sample: {err}. Register a rule for it "
            "(persample.register_rule), freeze or replace it, or use method='loop'."
        ) from err
    return dict(zip(names, got))
