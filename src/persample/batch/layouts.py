"""Where the samples are in a tensor: its *layout*, and how to bring them to the front.

The layout of every tensor of a captured forward is decided once, by data flow
(:mod:`persample.batch.flow`), never by a size that happens to equal the batch size:

- :data:`SHARED`: no sample's data flows into it (parameters, buffers, position ids
  built with ``arange``, masks built from sizes); shared by all samples.
- :class:`Batched`: dim ``dim`` carries the samples. That dim may also hold other
  positions merged with them: its size is ``outer * n * inner`` and position
  ``(o * n + i) * inner + k`` belongs to sample ``i`` (``(B*T, E)`` after a reshape
  is ``inner = T``; Swin's windows ``(B*nW, N, C)`` likewise; a ``(T*B, E)``
  reshape of a sequence-first tensor is ``outer = T``). ``index`` instead gives
  the sample of every position along ``dim`` (a permutation, or irregular: the rows of
  a packed sequence); :func:`indexed` builds it, and gives the plain layout where the
  index is ``arange(n)``, so that no rule meets the identity as an index.
- :class:`Mixed`: entries depend on several samples (a sum over the batch, a
  batch-wide mean loss computed inside the model, BatchNorm's batch statistics).
- :class:`Unknown`: sample data flows in, but where it is cannot be established (a
  tensor from code the capture cannot see); a :class:`Piece` is one sample's alone.

``front(x)`` gives ``(n, *per_sample)``, where ``per_sample`` is the tensor a
sample would have if the op ran on it alone: the same rank, the batch dim of size
1 (or ``outer * inner`` when merged). Rules are written against these views.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary


class _Questions:
    """What the engine asks of a layout, answered by each kind (no caller tests kinds)."""

    shared = False  # no sample's data flows in
    known = False  # where the samples are is known: shared or batched

    def one_position_each(self) -> bool:
        """Each sample's positions are one position (in any order), or none: a module
        rule can take the tensor with the samples in dim 0."""
        return False

    def located(self) -> bool:
        """Each sample's positions follow from the sizes alone (no index): a module
        call can be replayed on one sample's slices."""
        return False


class Shared(_Questions):
    """No sample data flows into the tensor: shared by every sample."""

    shared = True
    known = True

    def __repr__(self) -> str:
        return "SHARED"

    def one_position_each(self) -> bool:
        return True

    def located(self) -> bool:
        return True


SHARED = Shared()


@dataclass(frozen=True)
class Mixed(_Questions):
    """Entries depend on several samples (``why`` names the op)."""

    why: str


@dataclass(frozen=True)
class Unknown(_Questions):
    """Sample data flows in, but where it is is not known (``why`` names the op)."""

    why: str


@dataclass(frozen=True, eq=False)
class Piece(Unknown):
    """Every entry is sample ``sample``'s data, along no batch dim: one position of a
    batch dim cut off (``x.unbind(0)``'s pieces, ``x[i]``; a vision-language model's
    image features listed per image, then joined again by ``cat``), and what any op
    makes of one sample's pieces and shared tensors alone. ``cat`` and ``stack`` join
    pieces into a batch dim again; to every other rule it is an :class:`Unknown`. It
    describes the tensor ``ref`` refers to only (a rule passing a layout on to another
    tensor passes an Unknown): see :func:`persample.batch.flow.own_piece`."""

    sample: int = 0
    ref: Any = None  # weakref.ref of the tensor described


@dataclass(frozen=True, eq=False)
class Batched(_Questions):
    """Dim ``dim`` holds the samples (see the module docstring)."""

    known = True  # (a class attribute: not a field)

    dim: int
    outer: int = 1
    inner: int = 1
    index: Tensor | None = field(default=None, compare=False)  # (size of dim,) sample ids

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Batched):
            return False
        if (self.dim, self.outer, self.inner) != (other.dim, other.outer, other.inner):
            return False
        if self.index is None or other.index is None:
            return self.index is None and other.index is None
        return self.index is other.index or (
            self.index.shape == other.index.shape and bool(torch.equal(self.index, other.index)))

    def __hash__(self) -> int:
        return hash((self.dim, self.outer, self.inner, self.index is None))

    def __repr__(self) -> str:
        extra = "".join(f", {k}={v}" for k, v in (("outer", self.outer), ("inner", self.inner))
                        if v != 1)
        if self.index is not None:
            extra += f", index={self.index.tolist()}"
        return f"Batched(dim={self.dim}{extra})"

    @property
    def plain(self) -> bool:
        """One position per sample, in sample order."""
        return self.outer == 1 and self.inner == 1 and self.index is None

    def one_position_each(self) -> bool:
        return self.outer == 1 and self.inner == 1

    def located(self) -> bool:
        return self.index is None

    def sliceable(self, n: int) -> bool:
        """Each sample cut out as it is, without padding: positions by arithmetic, or a
        permutation of the samples."""
        return self.index is None or (self.index.numel() == n
                                      and len(set(self.index.tolist())) == n)

    def moved(self, dim: int) -> Batched:
        if dim == self.dim and type(self) is Batched:  # (a subclass's extras are dropped)
            return self
        return Batched(dim, self.outer, self.inner, self.index)

    # -- bringing the samples to the front ------------------------------------

    def front(self, x: Tensor, n: int) -> Tensor:
        """``x`` -> ``(n, *per_sample)``; a view unless the layout is irregular."""
        return _front(x, self, n, 0)

    def size(self, n: int) -> int:
        """The size of the batch dim: ``outer * n * inner``, or one position per entry of
        ``index``."""
        return self.outer * n * self.inner if self.index is None else self.index.numel()

    def per_sample_shape(self, x: Tensor, n: int) -> torch.Size:
        """The shape of one sample's part of ``x`` (``front(x)[i]``), no data read."""
        return self.front(x.new_empty(()).expand(x.shape), n).shape[1:]

    def front_cotangents(self, g: Tensor, n: int) -> Tensor:
        """Cotangents ``(v, *shape)`` -> ``(n, v, *per_sample)``."""
        return _front(g, self, n, 1)

    def scale(self, c: Tensor, x: Tensor) -> Tensor:
        """Per-sample factors ``c (n,)`` as a tensor broadcastable against ``x``
        (own layout): each position gets its sample's factor."""
        d, n = self.dim, c.shape[0]
        if self.index is not None:
            per_position = c[self.index]
        else:
            per_position = c.view(1, n, 1).expand(self.outer, n, self.inner).reshape(-1)
        shape = [1] * x.dim()
        shape[d] = per_position.shape[0]
        return per_position.view(shape)


def _front(x: Tensor, lay: Batched, n: int, lead: int) -> Tensor:
    """Move the samples of ``x`` (batch dim ``lay.dim + lead``) to dim 0, keeping the rank."""
    d = lay.dim + lead
    if lay.index is not None:
        return _front_indexed(x, lay.index, n, d)
    if lay.outer == 1 and lay.inner == 1:
        return (x if d == 0 else x.movedim(d, 0)).unsqueeze(d + 1)  # (n, ..., 1, ...)
    y = x.unflatten(d, (lay.outer, n, lay.inner)).movedim(d + 1, 0)  # (n, ..., a, b, ...)
    return y.flatten(d + 1, d + 2)  # (n, ..., a*b, ...)


def _front_indexed(x: Tensor, index: Tensor, n: int, d: int) -> Tensor:
    """Positions along ``d`` grouped by sample: ``(n, ..., L, ...)``, ``L`` the most
    positions of one sample, zero-padded (zeros add nothing to the sums rules take)."""
    order, length, places = grouping(index, n)
    moved = x.movedim(d, 0)  # (positions, ...)
    if order is not None:  # (index_select: advanced indexing costs several times more)
        moved = moved.index_select(0, order)  # (positions sorted by sample, ...)
    if places is None:  # (as many positions each, a permutation or a mixture's rows
        # sorted by expert: sample s's are order[s * L:(s + 1) * L], no padding)
        return moved.unflatten(0, (n, length)).movedim(1, d + 1)
    out = x.new_zeros((n * length, *moved.shape[1:]))
    out.index_copy_(0, places, moved)  # (row s * L + k: sample s's k-th position)
    return out.unflatten(0, (n, length)).movedim(1, d + 1)  # (n, ..., L, ...)


_GROUPINGS = WeakIdKeyDictionary()  # index -> (n, its version, grouping's answer)


def grouping(index: Tensor, n: int) -> tuple[Tensor | None, int, Tensor | None]:
    """``(order, L, places)``: the positions sorted by sample (stable; ``None`` where they
    are in sample order already: a graph batch's nodes), the most positions of one
    sample, and the row of ``(n * L)`` each sorted position goes to (``None`` where every
    sample has ``L``). Kept per index tensor: a rule groups its activations and its
    backprops by the same one."""
    found = _GROUPINGS.get(index)
    if found is not None and found[0] == n and found[1] == index._version:
        return found[2]
    counts = torch.bincount(index, minlength=n)  # (n,)
    fewest, length = (int(counts.min()), int(counts.max())) if counts.numel() else (0, 0)
    order, sample = None, index
    if index.numel() > 1 and index.diff().min().item() < 0:  # (not in sample order)
        order = torch.argsort(index, stable=True)  # positions sorted by sample
        sample = index.index_select(0, order)
    places = None
    if fewest != length:
        starts = torch.cumsum(counts, 0) - counts  # (n,)
        places = sample * length + (torch.arange(index.numel(), device=index.device)
                                    - starts.index_select(0, sample))
    _GROUPINGS[index] = (n, index._version, (order, length, places))
    return order, length, places


def once_each(values: Tensor, size: int) -> bool:
    """Does ``values`` (integers in ``[0, size)``) hold every one of them exactly once?
    (A count's min and max, read together: cheaper than comparing every count.)"""
    if not size:
        return not values.numel()
    low, high = torch.bincount(values.reshape(-1), minlength=size).aminmax()
    return low.item() == 1 and high.item() == 1


def nonnegative(values: Tensor) -> bool:
    """No entry of ``values`` below zero (``NO_SAMPLE``): every one names a sample."""
    return not values.numel() or values.min().item() >= 0


def indexed(dim: int, index: Tensor, n: int) -> Batched:
    """Batched in ``dim`` with ``index`` the sample of each position; the plain
    ``Batched(dim)`` where ``index`` is ``arange(n)`` (one position per sample, in
    order: a permutation undone, the final states of a packed sequence in sample
    order), so that such a tensor meets every rule as the plain layout it is. Every
    data-flow rule that names the samples by position builds its layout here."""
    if index.numel() == n and torch.equal(index, torch.arange(n, device=index.device)):
        return Batched(dim)
    return Batched(dim, index=index)


def one_per_sample(index: Tensor, n: int) -> bool:
    """``index`` (the sample of each position) is a permutation of ``arange(n)``."""
    if index.numel() != n:
        return False
    return once_each(index, n)


def in_sample_order(x: Tensor, index: Tensor, d: int) -> Tensor:
    """A dim ``d`` holding each sample once (``index`` a permutation) -> ``(n, ...)``,
    sample ``i`` first: the dim moved to the front in sample order."""
    return x.index_select(d, torch.argsort(index)).movedim(d, 0)


def sample_of_positions(lay: Batched, size: int, n: int, device: torch.device) -> Tensor:
    """``(size,)``: the sample of each position along ``lay``'s batch dim."""
    if lay.index is not None:
        return lay.index.to(device)
    return torch.arange(size, device=device) // lay.inner % n


Layout = Shared | Batched | Mixed | Unknown


def is_batched(layout: Layout) -> bool:
    """The samples' positions are known."""
    return isinstance(layout, Batched)


def front(x: Tensor, layout: Layout, n: int) -> Tensor:
    """``(n, *per_sample)`` for a batched tensor; a shared one is returned as it is."""
    if isinstance(layout, Batched):
        return layout.front(x, n)
    return x


def front_cotangents(g: Tensor, layout: Layout, n: int) -> Tensor:
    """``(v, *shape)`` cotangents of a batched tensor -> ``(n, v, *per_sample)``."""
    if isinstance(layout, Batched):
        return layout.front_cotangents(g, n)
    raise ValueError(f"cotangents of a tensor with layout {layout} cannot be split by sample")


def new_trouble(outputs: Any, inputs: list[Layout]) -> bool:
    """Does an op's output mix samples or lose them (``outputs``: a layout or a tuple of
    them) where none of its inputs did already?"""
    outs = outputs if isinstance(outputs, tuple) else (outputs,)
    if all(isinstance(o, tuple) or o.known for o in outs):  # (a nested output: left alone)
        return False
    return all(lay.known for lay in inputs)


def placed(outputs: Any, where: str) -> Any:
    """The layouts, with ``where`` (the module the trouble started in) in their reason."""
    if isinstance(outputs, tuple):
        return tuple(placed(o, where) for o in outputs)
    if isinstance(outputs, (Mixed, Unknown)):  # (replace keeps a subclass's fields)
        return dataclasses.replace(outputs, why=f"{outputs.why}, in module {where}")
    return outputs
