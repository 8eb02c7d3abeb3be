"""The model's inputs as users pass them: a tensor, a tuple, a dict, or both.

``inputs`` may be a tensor (``model(x)``), a tuple or list (``model(*inputs)``), a
mapping such as a tokenizer's ``BatchEncoding`` (``model(**inputs)``), or a pair
``(args, kwargs)`` of a tuple and a mapping (``model(*args, **kwargs)``). The
batch size ``B`` is dim 0 of the first tensor; every tensor with ``B`` in dim 0
is a per-sample input (sliced by sample), every other tensor is shared by all
samples (a ``(1, T)`` position tensor, a lookup table).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_unflatten


@dataclass
class Batch:
    """The positional and keyword inputs of one call of the model, the batch size, and
    which of their leaves (``tree_flatten((args, kwargs))`` positions) are per-sample:
    decided once, kept when the batch is cut into chunks."""

    args: tuple
    kwargs: dict
    n: int
    sample_leaves: frozenset[int]

    def _leaves(self) -> list:
        return tree_flatten((self.args, self.kwargs))[0]

    @property
    def batched(self) -> list[Tensor]:
        return [t for k, t in enumerate(self._leaves()) if k in self.sample_leaves]

    @property
    def shared(self) -> list[Tensor]:
        return [t for k, t in enumerate(self._leaves())
                if isinstance(t, Tensor) and k not in self.sample_leaves]

    def call(self, model: nn.Module) -> Any:
        return model(*self.args, **self.kwargs)

    def rows(self, start: int, stop: int) -> Batch:
        """Samples ``start:stop``; shared tensors stay whole."""
        leaves, spec = tree_flatten((self.args, self.kwargs))
        cut = [t[start:stop] if k in self.sample_leaves else t for k, t in enumerate(leaves)]
        args, kwargs = tree_unflatten(cut, spec)
        return Batch(args, kwargs, max(0, min(stop, self.n) - start), self.sample_leaves)


def as_batch(inputs: Any) -> Batch:
    """``inputs`` (see the module docstring) as a :class:`Batch`.

    Raises:
        TypeError: no tensor with a batch dim among the inputs.
    """
    if isinstance(inputs, Mapping):
        args, kwargs = (), dict(inputs)
    elif (isinstance(inputs, (tuple, list)) and len(inputs) == 2
          and isinstance(inputs[0], (tuple, list)) and isinstance(inputs[1], Mapping)):
        args, kwargs = tuple(inputs[0]), dict(inputs[1])
    elif isinstance(inputs, (tuple, list)):
        args, kwargs = tuple(inputs), {}
    else:
        args, kwargs = (inputs,), {}
    leaves = tree_flatten((args, kwargs))[0]
    first = next((t for t in leaves if isinstance(t, Tensor)), None)
    if first is None or first.dim() == 0:
        raise TypeError(
            "inputs must hold a tensor with the batch in dim 0: a tensor, a tuple (passed "
            "as model(*inputs)), a dict (model(**inputs)) or a pair (args, kwargs); got "
            f"{type(inputs).__name__}"
            + ("" if first is None else " whose first tensor is a scalar"))
    n = first.shape[0]
    sample = frozenset(k for k, t in enumerate(leaves)
                       if isinstance(t, Tensor) and t.dim() > 0 and t.shape[0] == n)
    return Batch(args, kwargs, n, sample)
