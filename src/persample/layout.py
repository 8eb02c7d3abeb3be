"""Where the batch is in each captured tensor, and how to bring it to dim 0.

Rules and the fallback work on batch-first tensors: activations ``(n, ...)``
and backprops ``(n, v, ...)``. Most layers see their batch in dim 0, but the
stock sequence modules do not:

- ``nn.RNN``/``nn.LSTM``/``nn.GRU``: ``input`` and ``output`` are ``(T, n, ...)``
  unless ``batch_first``; ``h_0``/``h_n``/``c_n`` are always ``(L * D, n, H)``; a
  ``PackedSequence`` has no batch dim at all (rows of all samples, time-major).
- ``nn.MultiheadAttention`` and the Transformer layers: sequences are
  ``(T, n, E)`` unless ``batch_first``; a 3-d ``attn_mask`` is ``(n * heads, T, S)``;
  a ``key_padding_mask`` is ``(n, S)``; a 2-d mask is shared by all samples.
- Any module called inside a sequence-first Transformer layer (its Linear and
  LayerNorm children) sees ``(T, n, E)``.

A :class:`Layout` converts one tensor to batch-first and back. Everything else
keeps the default: batch in dim 0 when its size is the batch size, else shared.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence
from torch.utils._pytree import tree_leaves

from .capture import Call, flat_outputs

_ATTENTION = (nn.MultiheadAttention, nn.TransformerEncoderLayer, nn.TransformerDecoderLayer,
              nn.TransformerEncoder, nn.TransformerDecoder, nn.Transformer)


@dataclass(frozen=True)
class Dim:
    """The batch is dim ``d``."""

    d: int

    def front(self, x: Tensor) -> Tensor:
        """``x`` with its batch moved to dim 0."""
        return x.movedim(self.d, 0)

    def front_cotangents(self, g: Tensor) -> Tensor:
        """``(v, *shape)`` cotangents -> ``(n, v, ...)``."""
        return g.movedim(self.d + 1, 0)

    def back(self, g: Tensor) -> Tensor:
        """Inverse of :meth:`front`: ``(n, ...)`` -> the tensor's own layout."""
        return g.movedim(0, self.d)

    def insert(self, x_i: Tensor) -> Tensor:
        """One sample without its batch dim -> a batch of one in the own layout."""
        return x_i.unsqueeze(self.d)


@dataclass(frozen=True)
class Heads:
    """A 3-d attention mask ``(n * heads, T, S)``: the batch is the outer part of dim 0."""

    n: int

    def front(self, x: Tensor) -> Tensor:
        return x.unflatten(0, (self.n, -1))  # (n, heads, T, S)

    def insert(self, x_i: Tensor) -> Tensor:
        return x_i  # (heads, T, S) is the mask of a batch of one


@dataclass(frozen=True)
class Packed:
    """The ``data`` of a ``PackedSequence``: rows of all samples, time-major."""

    seq: PackedSequence

    def front_cotangents(self, g: Tensor) -> Tensor:
        """``(v, rows, *f)`` -> zero-padded ``(n, v, T, *f)``."""
        sample, step = packed_positions(self.seq)
        n, steps = len(sample.unique()), len(self.seq.batch_sizes)
        padded = g.new_zeros((n, steps, g.shape[0], *g.shape[2:]))
        padded[sample, step] = g.movedim(0, 1)  # (rows, v, *f)
        return padded.movedim(2, 1)


Layout = Dim | Heads | Packed


def packed_positions(seq: PackedSequence) -> tuple[Tensor, Tensor]:
    """For each row of ``seq.data``: its sample index and its time step, ``(rows,)`` each."""
    sizes = seq.batch_sizes  # (T,) on the CPU
    step = torch.repeat_interleave(torch.arange(len(sizes)), sizes)
    starts = torch.cumsum(sizes, 0) - sizes
    slot = torch.arange(int(sizes.sum())) - starts[step]  # position in the sorted batch
    sample = slot if seq.sorted_indices is None else seq.sorted_indices.cpu()[slot]
    return sample.to(seq.data.device), step.to(seq.data.device)


def batch_first(module: nn.Module) -> bool | None:
    """The ``batch_first`` of a stock sequence module; ``None`` for other modules."""
    if isinstance(module, (nn.RNNBase, nn.MultiheadAttention, nn.Transformer)):
        return module.batch_first
    if isinstance(module, (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)):
        return module.self_attn.batch_first
    if isinstance(module, (nn.TransformerEncoder, nn.TransformerDecoder)):
        return module.layers[0].self_attn.batch_first if len(module.layers) else True
    return None


def _in_sequence_first(call: Call) -> bool:
    """Is the call inside (not itself) a sequence-first Transformer module's call?"""
    parent = call.parent
    while parent is not None:
        if isinstance(parent.module, _ATTENTION) and batch_first(parent.module) is False:
            return True
        parent = parent.parent
    return False


def _default(call: Call, x: Tensor, n: int) -> Layout | None:
    if x.dim() == 3 and _in_sequence_first(call):
        return Dim(1)
    return Dim(0) if x.shape[0] == n else None


def input_layout(call: Call, name: str | None, x: Any, n: int) -> Layout | None:
    """How to make input ``name`` of ``call`` batch-first; ``None``: shared by all samples."""
    if not isinstance(x, Tensor) or x.dim() == 0:
        return None
    module = call.module
    if isinstance(module, nn.RNNBase):
        if name == "hx":
            return Dim(1)
        return Dim(0 if module.batch_first else 1)
    if isinstance(module, _ATTENTION) and name is not None:
        if name.endswith("key_padding_mask"):
            return Dim(0)
        if name.endswith("mask"):
            return Heads(n) if x.dim() == 3 else None
        if x.dim() == 3:
            return Dim(0 if batch_first(module) else 1)
    return _default(call, x, n)


def output_layouts(call: Call, n: int) -> list[Layout]:
    """One layout per tensor of ``output_tensors(call)`` (those requiring grad)."""
    module, output = call.module, call.output
    if isinstance(module, nn.RNNBase):
        seq, state = output
        first = [Packed(seq)] if isinstance(seq, PackedSequence) else [
            Dim(0 if module.batch_first else 1)]
        layouts = first + [Dim(1)] * len(flat_outputs(state))
        tensors = [seq.data if isinstance(seq, PackedSequence) else seq, *flat_outputs(state)]
    elif isinstance(module, _ATTENTION):
        tensors = flat_outputs(output)
        layouts = [Dim(0 if batch_first(module) else 1)] + [Dim(0)] * (len(tensors) - 1)
    else:
        tensors = flat_outputs(output)
        layouts = [_default(call, t, n) or Dim(0) for t in tensors]
    return [lay for t, lay in zip(tensors, layouts) if t.requires_grad]


@functools.cache
def forward_signature(forward: Any) -> inspect.Signature | None:
    """The signature of an unbound ``forward`` (``type(module).forward``), cached:
    it is read for every captured call. ``None`` if Python cannot tell it."""
    try:
        return inspect.signature(forward)
    except (TypeError, ValueError):
        return None


def _positional_names(module: nn.Module, count: int) -> list[str | None]:
    """The ``forward`` parameter name of each of ``count`` positional inputs."""
    signature = forward_signature(type(module).forward)
    params = list(signature.parameters.values())[1:] if signature else []  # without self
    names = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return [names[i] if i < len(names) else None for i in range(count)]


def input_layouts(call: Call, n: int) -> list[Layout | None]:
    """One layout per leaf of ``tree_flatten((call.args, call.kwargs))``."""
    named = list(zip(_positional_names(call.module, len(call.args)), call.args))
    named += list(call.kwargs.items())
    return [input_layout(call, name, leaf, n)
            for name, value in named for leaf in tree_leaves(value)]


def front_activations(call: Call, args: tuple, n: int) -> tuple:
    """The positional inputs ``args`` of ``call`` (keywords already bound), batch-first."""
    names = _positional_names(call.module, len(args))
    return tuple(_front_nested(call, name, a, n) for name, a in zip(names, args))


def _front_nested(call: Call, name: str | None, x: Any, n: int) -> Any:
    if isinstance(x, (tuple, list)) and not isinstance(x, PackedSequence):
        return type(x)(_front_nested(call, name, xi, n) for xi in x)
    layout = input_layout(call, name, x, n)
    return layout.front(x) if isinstance(layout, Dim) else x
