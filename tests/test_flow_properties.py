"""Properties of the data flow: a layout a handler gives is the truth about the op.

Every fast path trusts the layouts :mod:`persample.batch` decides: where an output is
batched, each position's sample must be the only sample that position depends on. That is
checked here against the ops themselves, not against a second copy of the rules: an input
of random shape whose samples lie along a random dim (the other sizes drawn from the same
small range as the batch, so that they often coincide with it), a few ops of a family the
handlers cover run under the capture (which asks the handlers, op by op), and the
derivative of every output entry with respect to every input entry, at the forward that
ran (what per-sample gradients are made of; a sort's order, say, is that forward's):

- a **batched** output (its samples along a dim, merged with another, or named by an
  index) depends at each position on that position's sample only;
- a **shared** output depends on no sample;
- a **mixed** or **unknown** output claims nothing (the engine then takes an exact slower
  path), but the ops that plainly keep the samples apart (:data:`KEEPS`) must not be
  answered that way for two samples or more: a handler that always said "unknown" would
  pass the first two.

Nothing is inferred from a size equal to the batch size: sizes coincide on purpose.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import Tensor

from persample.batch import SHARED, Batched
from persample.batch.layouts import sample_of_positions
from persample.capture import Capture

SIZES = st.integers(1, 4)  # the batch size and every other dim: they coincide often


def _dim(data: st.DataObject, rank: int, but: int | None = None) -> int:
    dims = [k for k in range(rank) if k != but]
    return data.draw(st.sampled_from(dims)) if dims else but


def const(*shape: int, seed: int = 0) -> Tensor:
    """A tensor shared by every sample, the same at every call (made inside the op, so
    the capture sees it made from no sample)."""
    return torch.rand(shape, generator=torch.Generator().manual_seed(seed),
                      dtype=torch.float64) + 0.5


# Each case draws an op (or a few) on ``x``, whose samples lie along dim ``d``, and returns
# it as a function of the input: ``build(data, x, d) -> fn``; ``fn(x)`` is run once under
# the capture and once per perturbed sample.

def _reshape(data, x, d):
    """Merge two neighbouring dims (the batch dim with another: ``(B, T, E) -> (B*T, E)``),
    or add a leading one."""
    if x.dim() >= 2 and data.draw(st.booleans()):
        k = data.draw(st.integers(0, x.dim() - 2))
        shape = list(x.shape[:k]) + [x.shape[k] * x.shape[k + 1]] + list(x.shape[k + 2:])
    else:
        shape = [1, *x.shape]
    return lambda t: t.reshape(shape)


def _views(data, x, d):
    a, b = _dim(data, x.dim()), _dim(data, x.dim())
    perm = data.draw(st.permutations(range(x.dim())))
    k = data.draw(st.integers(-x.dim() - 1, x.dim()))
    start = data.draw(st.integers(0, x.dim() - 1))
    end = data.draw(st.integers(start, x.dim() - 1))
    kind = data.draw(st.sampled_from(["transpose", "permute", "unsqueeze", "flatten", "movedim"]))
    return {"transpose": lambda t: t.transpose(a, b), "permute": lambda t: t.permute(*perm),
            "unsqueeze": lambda t: t.unsqueeze(k), "flatten": lambda t: t.flatten(start, end),
            "movedim": lambda t: torch.movedim(t, a, b)}[kind]


def _reduce_other(data, x, d):
    k, keep = _dim(data, x.dim(), but=d), data.draw(st.booleans())
    kind = data.draw(st.sampled_from(["sum", "mean", "amax", "norm"]))
    if kind == "norm":
        return lambda t: torch.linalg.vector_norm(t, dim=k, keepdim=keep)
    return lambda t: getattr(torch, kind)(t, k, keepdim=keep)


def _reduce_any(data, x, d):
    k = _dim(data, x.dim())
    kind = data.draw(st.sampled_from(["sum", "mean", "amax", "all"]))
    return (lambda t: t.sum()) if kind == "all" else (lambda t: getattr(t, kind)(k))


def _along(data, x, d, other: bool = True):
    """Ops along one dim (``other``: not the batch dim, so a sample's values stay its own)."""
    k = _dim(data, x.dim(), but=d if other else None)
    kind = data.draw(st.sampled_from(["softmax", "cumsum", "flip", "roll", "sort"]))
    return {"softmax": lambda t: F.softmax(t, dim=k), "cumsum": lambda t: t.cumsum(k),
            "flip": lambda t: t.flip(k), "roll": lambda t: t.roll(1, k),
            "sort": lambda t: t.sort(k).values}[kind]


def _along_any(data, x, d):
    return _along(data, x, d, other=False)


def _slices(data, x, d):
    """``narrow``, ``select`` and basic indexing (integers, slices, ``None``) on any dim."""
    k = _dim(data, x.dim())
    start = data.draw(st.integers(0, x.shape[k] - 1))
    length = data.draw(st.integers(1, x.shape[k] - start))
    index = []
    for size in x.shape:
        kind = data.draw(st.sampled_from(["all", "int", "slice"]))
        index.append(data.draw(st.integers(-size, size - 1)) if kind == "int" else slice(
            data.draw(st.integers(0, size - 1)), None, data.draw(st.integers(1, 2)))
            if kind == "slice" else slice(None))
    if data.draw(st.booleans()):
        index.insert(data.draw(st.integers(0, len(index))), None)
    kind = data.draw(st.sampled_from(["narrow", "select", "getitem"]))
    return {"narrow": lambda t: t.narrow(k, start, length), "select": lambda t: t.select(k, start),
            "getitem": lambda t: t[tuple(index)]}[kind]


def _picked(data, x, d):
    """Positions picked by a shared index tensor (made in the op), on any dim."""
    k = _dim(data, x.dim())
    picks = data.draw(st.lists(st.integers(0, x.shape[k] - 1), min_size=1, max_size=5))
    kind = data.draw(st.sampled_from(["index_select", "getitem", "gather"]))
    if kind == "index_select":
        return lambda t: t.index_select(k, torch.tensor(picks))
    if kind == "getitem":
        return lambda t: t[(slice(None),) * k + (torch.tensor(picks),)]
    shape = list(x.shape)
    shape[k] = len(picks)
    ids = torch.tensor(picks).view([-1 if j == k else 1 for j in range(x.dim())])
    return lambda t: t.gather(k, ids.expand(shape).clone())


def _joins(data, x, d, other: bool = False):
    """``cat``/``stack`` with a shared tensor or a tensor computed from the input, and the
    pieces of ``split``/``chunk``/``unbind`` (``other``: along another dim than the batch's)."""
    k = _dim(data, x.dim(), but=d) if other else data.draw(st.integers(0, x.dim() - 1))
    s = data.draw(st.integers(0, x.dim()))
    pieces = data.draw(st.integers(1, x.shape[k]))
    kind = data.draw(st.sampled_from(["cat-self", "cat-shared", "stack", "split", "chunk",
                                      "unbind"]))
    return {"cat-self": lambda t: torch.cat([t, t * 2], k),
            "cat-shared": lambda t: torch.cat([t, const(*t.shape)], k),
            "stack": lambda t: torch.stack([t, t.exp()], s),
            "split": lambda t: torch.split(t, pieces, k),
            "chunk": lambda t: torch.chunk(t, pieces, k),
            "unbind": lambda t: torch.unbind(t, k)}[kind]


def _joins_other_dim(data, x, d):
    return _joins(data, x, d, other=True)


def _broadcast_shared(data, x, d):
    """``x op w`` with a shared ``w`` broadcast against it (a scale, a shift, a mask)."""
    keep = [data.draw(st.booleans()) for _ in x.shape]
    shape = [s if k else 1 for s, k in zip(x.shape, keep)][data.draw(st.integers(0, x.dim())):]
    kind = data.draw(st.sampled_from(["mul", "add", "div", "rsub", "where", "addcmul"]))
    return {"mul": lambda t: t * const(*shape), "add": lambda t: const(*shape) + t,
            "div": lambda t: t / const(*shape), "rsub": lambda t: 1 - t,
            "where": lambda t: torch.where(const(*shape) > 1, t, const(*shape, seed=1)),
            "addcmul": lambda t: torch.addcmul(const(*shape), t, const(*shape, seed=2))}[kind]


def _products(data, x, d):
    """``x @ W`` and ``W @ x`` with a shared matrix, ``x @ x^T``, ``einsum`` of the input
    with itself over its last dim."""
    m = data.draw(SIZES)
    kind = data.draw(st.sampled_from(["right", "left", "self", "einsum", "linear"]))
    if kind == "left" and x.dim() >= 2:
        return lambda t: const(m, t.shape[-2]) @ t
    if kind == "self" and x.dim() >= 2:
        return lambda t: t @ t.transpose(-1, -2)
    if kind == "einsum":
        return lambda t: torch.einsum("...i,...i->...", t, t)
    if kind == "linear":
        return lambda t: F.linear(t, const(m, t.shape[-1]), const(m))
    return lambda t: t @ const(t.shape[-1], m)


def _solves(data, x, d):
    """``linalg.solve`` of a shared, well-conditioned matrix: against the input's columns,
    from the right (``left=False``), or against the input as a batch of vectors (the
    matrix expanded over its leading dims); against the columns by ``solve_ex``,
    ``cholesky_solve`` (the matrix's lower triangle the factor) and ``lu_solve``."""
    kind = data.draw(st.sampled_from(["left", "right", "vectors", "ex", "cholesky", "lu"]))

    def matrix(m: int) -> Tensor:
        return const(m, m) + m * torch.eye(m, dtype=torch.float64)

    if kind == "left" and x.dim() >= 2:
        return lambda t: torch.linalg.solve(matrix(t.shape[-2]), t)
    if kind == "right" and x.dim() >= 2:
        return lambda t: torch.linalg.solve(matrix(t.shape[-1]), t, left=False)
    if kind == "ex" and x.dim() >= 2:
        return lambda t: torch.linalg.solve_ex(matrix(t.shape[-2]), t)[0]
    if kind == "cholesky" and x.dim() >= 2:
        return lambda t: torch.cholesky_solve(t, torch.tril(matrix(t.shape[-2])))
    if kind == "lu" and x.dim() >= 2:
        return lambda t: torch.linalg.lu_solve(*torch.linalg.lu_factor(matrix(t.shape[-2])), t)
    return lambda t: torch.linalg.solve(matrix(t.shape[-1]).expand(*t.shape, t.shape[-1]), t)


def _buckets(data, x, d):
    """``bucketize`` of the input by shared boundaries, or ``searchsorted`` of it in a
    shared sorted sequence, scaling the input (a bucket alone has no derivative)."""
    k = data.draw(SIZES)

    def edges() -> Tensor:  # (made inside the op, as const)
        return torch.sort(const(k, seed=1) * 2 - 2).values

    if data.draw(st.booleans()):
        return lambda t: torch.bucketize(t, edges()).to(t.dtype) * t
    return lambda t: torch.searchsorted(edges(), t, right=True).to(t.dtype) * t


def _rows(data, x, d):
    """Layers over the features of one dim: each row on its own where that dim is not the
    batch dim (the last one, or the batch dim moved after it)."""
    kind = data.draw(st.sampled_from(["layer_norm", "gelu", "rms_norm", "normalize"]))
    layer = {"layer_norm": lambda t: F.layer_norm(t, t.shape[-1:]), "gelu": F.gelu,
             "rms_norm": lambda t: F.rms_norm(t, t.shape[-1:]),
             "normalize": lambda t: F.normalize(t, dim=-1)}[kind]
    if d == x.dim() - 1 and x.dim() > 1:
        return lambda t: layer(t.transpose(-1, -2))
    return layer


def _cross(data, x, d):
    """``cross`` along a dim of 3 positions: a new one (``stack`` of three), or a dim of
    the input of that size, the batch dim included (then it mixes the samples)."""
    threes = [k for k, size in enumerate(x.shape) if size == 3]
    if threes and data.draw(st.booleans()):
        k = data.draw(st.sampled_from(threes))
        return lambda t: torch.linalg.cross(t, const(*t.shape), dim=k)
    s = data.draw(st.integers(0, x.dim()))

    def run(t: Tensor) -> Tensor:
        three = torch.stack([t, t * 2, t.exp()], s)
        return torch.cross(three, const(*three.shape), dim=s)
    return run


def _widen(data, x, d):
    """``repeat``, ``tile`` and ``expand`` of a size-1 dim."""
    reps = [data.draw(st.integers(1, 2)) for _ in range(x.dim() + data.draw(st.integers(0, 1)))]
    k = data.draw(st.integers(0, x.dim()))
    m = data.draw(SIZES)
    kind = data.draw(st.sampled_from(["repeat", "tile", "expand"]))
    expand_shape = [-1] * (x.dim() + 1)
    expand_shape[k] = m
    return {"repeat": lambda t: t.repeat(*reps), "tile": lambda t: t.tile(reps),
            "expand": lambda t: t.unsqueeze(k).expand(*expand_shape)}[kind]


def _chains(data, x, d):
    """Two or three of the ops above, one after the other (the layouts compose)."""
    steps = data.draw(st.lists(st.sampled_from([_reshape, _views, _reduce_other, _along,
                                                _broadcast_shared, _rows]), min_size=2,
                               max_size=3))
    fns, y = [], x
    for step in steps:  # (after the first, "another dim than the batch's" is a guess: the
        fn = step(data, y, d)  # property holds whatever the ops do)
        out = fn(y)
        if not isinstance(out, Tensor) or out.dim() == 0:
            break
        fns.append(fn)
        y = out

    def run(t: Tensor) -> Tensor:
        for fn in fns:
            t = fn(t)
        return t
    return run


OPS: list[tuple[str, Callable, bool]] = [
    ("reshape", _reshape, True), ("views", _views, True),
    ("reduce-other-dim", _reduce_other, True), ("reduce-any-dim", _reduce_any, False),
    ("along-other-dim", _along, True), ("along-any-dim", _along_any, False),
    ("slices", _slices, False), ("picked", _picked, False), ("joins", _joins, False),
    ("joins-other-dim", _joins_other_dim, True),
    ("broadcast-shared", _broadcast_shared, True), ("products", _products, False),
    ("solves", _solves, False), ("buckets", _buckets, True),
    ("rows", _rows, True), ("widen", _widen, False), ("cross", _cross, False),
    ("chains", _chains, False),
]
KEEPS = {name for name, _, keeps in OPS if keeps}


def _tensors(out: Any) -> list[Tensor]:
    if isinstance(out, Tensor):
        return [out]
    return [o for o in out if isinstance(o, Tensor)]


def _sample_of_each_position(out: Tensor, lay: Batched, n: int) -> Tensor:
    """``out.shape``: the sample each position of ``out`` belongs to, by its layout."""
    owner = sample_of_positions(lay, out.shape[lay.dim], n, out.device)  # (size of dim,)
    shape = [1] * out.dim()
    shape[lay.dim] = -1
    return owner.view(shape).expand(out.shape)


def _jacobian(fn: Callable, x: Tensor) -> list[Tensor]:
    """``d out_k / d x`` for each floating output ``out_k``: ``(*out_k.shape, *x.shape)``."""
    got = torch.autograd.functional.jacobian(lambda t: tuple(_tensors(fn(t))), x)
    return list(got)


@pytest.mark.parametrize("name, build, keeps", OPS, ids=[name for name, _, _ in OPS])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_a_batched_layout_is_what_the_op_does(name, build, keeps, data):
    """Each output position depends on its own sample's input only (at the forward that
    ran: the derivative is what per-sample gradients are made of), a shared output on no
    sample's; the ops that keep the samples apart are followed."""
    n = data.draw(SIZES, label="batch size")
    shape = data.draw(st.lists(SIZES, min_size=1, max_size=3), label="other dims")
    d = data.draw(st.integers(0, len(shape)), label="batch dim")
    shape.insert(d, n)
    x = torch.randn(shape, dtype=torch.float64)
    try:
        fn = build(data, x, d)
        fn(x)
    except (RuntimeError, IndexError, ValueError):  # a draw the op itself refuses
        return
    with Capture(None, {}, n, [(x, Batched(d))]) as cap:
        outs = _tensors(fn(x))
    layouts = [cap.layout(o) for o in outs]
    if keeps and n > 1:  # ops that keep the samples apart are answered batched (or shared;
        # a batch of one is never captured: its gradient is the per-sample gradient)
        assert all(isinstance(lay, Batched) or lay is SHARED for lay in layouts), (name, layouts)
    x_sample = torch.arange(n).view([-1 if k == d else 1 for k in range(x.dim())]).expand(shape)
    for out, lay, jac in zip(outs, layouts, _jacobian(fn, x)):
        reads = jac.reshape(out.numel(), x.numel()) != 0  # (out positions, x entries)
        if lay is SHARED:
            assert not reads.any(), (name, "a shared output depends on the samples")
        elif isinstance(lay, Batched):
            own = _sample_of_each_position(out, lay, n).reshape(-1, 1)  # (out positions, 1)
            other = own != x_sample.reshape(1, -1)  # entries of another sample than its own
            assert not (reads & other).any(), (name, lay)


@settings(max_examples=300, deadline=None)
@given(n=st.integers(1, 5), outer=st.integers(1, 4), inner=st.integers(1, 4),
       change=st.one_of(st.none(), st.integers(0, 10**6)), data=st.data())
def test_a_regular_run_of_samples_is_named_by_its_layout(n, outer, inner, change, data):
    """``regular``: the sample of each position, as ``Batched(dim, outer, inner)`` where
    positions ``(o * n + i) * inner + k`` hold sample ``i``, else an index layout; every
    answer names the samples it was given (and a rows pattern broken at one position is
    not taken for a regular one)."""
    from persample.batch.ops_indexing import regular

    size = outer * n * inner
    rows = torch.arange(size) // inner % n
    if change is not None:
        rows[change % size] = data.draw(st.integers(0, n - 1))
    lay = regular(0, rows, n)
    assert torch.equal(sample_of_positions(lay, size, n, torch.device("cpu")).long(), rows)
    if change is None and n > 1:
        assert lay.index is None and (lay.outer, lay.inner) == (outer, inner), lay


@settings(max_examples=300, deadline=None)
@given(shapes=st.lists(st.lists(st.sampled_from([0, 1, 1, 2, 3]), max_size=4),
                       min_size=1, max_size=3))
def test_shapes_broadcast_as_torch_broadcasts_them(shapes):
    from persample.batch.flow import broadcast_shapes

    def answer(fn):
        try:
            return tuple(fn(*[torch.Size(s) for s in shapes]))
        except RuntimeError:
            return "does not broadcast"

    assert answer(broadcast_shapes) == answer(torch.broadcast_shapes)


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 4), each=st.integers(1, 3), equal=st.booleans(), d=st.integers(0, 2),
       seed=st.integers(0, 10**6))
def test_positions_grouped_by_sample_in_order_and_padded(n, each, equal, d, seed):
    """An index layout's positions moved to ``(n, ..., L, ...)``: sample ``s``'s
    positions in their order, zeros after them (as many each, or not)."""
    from persample.batch.layouts import _front_indexed

    g = torch.Generator().manual_seed(seed)
    index = (torch.arange(n).repeat_interleave(each)[torch.randperm(n * each, generator=g)]
             if equal else torch.randint(0, n, (n * each + 1,), generator=g))
    shape = [2, 3, 2]
    shape[d] = index.numel()
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    got = _front_indexed(x, index, n, d).movedim(d + 1, 1)  # (n, L, ...)
    length = int(torch.bincount(index, minlength=n).max())
    want = torch.zeros((n, length, *x.movedim(d, 0).shape[1:]), dtype=torch.float64)
    for s in range(n):
        rows = x.movedim(d, 0)[index == s]
        want[s, :rows.shape[0]] = rows
    assert torch.equal(got, want)
