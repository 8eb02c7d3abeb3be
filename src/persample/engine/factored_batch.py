"""One batch captured for the functions built on per-sample gradients without forming
them all: inner products (:mod:`persample.dots`) and random projections
(:mod:`persample.projection`).

A :class:`FactoredBatch` (the factors of one captured batch) runs the model's forward
and one backward of the per-sample losses once, and keeps

- the factors of every parameter whose ops have a factor rule (a linear map at ``T``
  positions, a table lookup: ``G_i = sum_t L[i, t] outer R[i, t]``, ``rules.ghost``),
  which the callers combine without forming ``G_i`` (Goodfellow 2015; TracIn, Pruthi et
  al. 2020; LoGra, Choe et al. 2024);
- what the rules need to form the per-sample gradients of the other parameters on
  demand, a few at a time (:func:`parameter_groups`: at most :data:`GROUP_BYTES` of
  them at once).

:func:`matrix_shape` is the ``(rows, cols)`` view of a parameter the factors are in.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from ..errors import internal
from ..inputs import Batch
from ..precision import accumulate_dtype, cast, without_autocast
from ..rules.ghost import Factors
from .backward import loss_backprops
from .captured import Captured
from .pullback import write_per_sample
from .uses import use_factors

GROUP_BYTES = 1 << 28
"""At most this many bytes of materialised per-sample gradients per batch at once."""


class FactoredBatch:
    """One batch's capture: the factors of the parameters that have them, and the
    per-sample gradients of the others on demand.

    Args:
        model: the ``nn.Module`` the batch runs through (left unchanged).
        batch: the validated inputs of ``n`` samples (``checks.validate_call``'s batch).
        targets, loss_fn: as for :func:`persample.per_sample_grads` (each sample's own
            loss is differentiated, whatever ``loss_fn``'s reduction).
        params: ``{name: parameter}``, the parameters watched.

    Attributes:
        n: the number of samples.
        captured: the engine's capture (activations, backprops ``(n, 1, *out)``).
        factors: ``{id(p): [Factors of each use]}`` for the watched parameters every one of
            whose uses has a factor rule (``left (n, t, rows)`` or ``(n, t)`` int64 row ids,
            ``right (n, t, cols)``; :func:`matrix_shape` gives ``(rows, cols)``), in the
            dtype the rules accumulate in.

    Raises:
        as :func:`persample.per_sample_grads` for the forward, the loss and the backward;
        InternalError: a factor rule failed.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> from persample.inputs import as_batch
        >>> net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Unflatten(1, (1, 8)),
        ...                     nn.Conv1d(1, 2, 3))
        >>> x, y = torch.randn(5, 4), torch.randn(5, 2, 6)
        >>> side = FactoredBatch(net, as_batch(x), y, nn.MSELoss(), dict(net.named_parameters()))
        >>> side.n, [id(p) in side.factors for p in net.parameters()]
        (5, [True, True, False, False])
        >>> side.grads([net[3].weight])[id(net[3].weight)].shape  # (n, 2 * 1 * 3)
        torch.Size([5, 6])

    Source: Goodfellow 2015 (per-sample gradients of linear layers from activations and
    backprops); Li et al. 2022 (their inner products without forming them).
    """

    def __init__(self, model: nn.Module, batch: Batch, targets: Any, loss_fn: Callable,
                 params: dict[str, nn.Parameter]) -> None:
        watched = {id(p): p for p in params.values()}
        self.captured: Captured = loss_backprops(model, batch, targets, loss_fn, watched)
        self.n = self.captured.n
        with torch.no_grad(), without_autocast(), internal("the factor rules"):
            self.factors: dict[int, list[Factors]] = {
                pid: uses for pid, (_, uses) in use_factors(self.captured, set(watched)).items()}

    def grads(self, group: list[nn.Parameter]) -> dict[int, Tensor]:
        """The per-sample gradients of the parameters ``group`` (of those watched).

        Args:
            group: the parameters formed together (:func:`parameter_groups`).

        Returns:
            ``{id(p): (n, p.numel())}`` in ``p``'s dtype, at least float32.

        Raises:
            InternalError: a rule failed.
        """
        dest = {id(p): p.new_zeros((self.n, 1, *p.shape)) for p in group}  # (n, 1, *shape)
        with internal("the rules"):
            write_per_sample(self.captured, dest)
        return {pid: cast(g.flatten(1), accumulate_dtype(g.dtype)) for pid, g in dest.items()}


def parameter_groups(params: list[nn.Parameter], samples: int) -> list[list[nn.Parameter]]:
    """Consecutive parameters whose per-sample gradients for ``samples`` rows fit in
    :data:`GROUP_BYTES` together (a larger one alone), counted at least float32.

    Args:
        params: the parameters to form, in order.
        samples: the rows formed per parameter (both batches' samples for two batches).

    Returns:
        ``params`` cut into consecutive groups, in order.

    Examples:
        >>> from torch import nn
        >>> big, small = nn.Parameter(torch.zeros(1 << 20)), nn.Parameter(torch.zeros(8))
        >>> [len(g) for g in parameter_groups([small, small, big, small], 64)]
        [2, 1, 1]
    """
    groups: list[list[nn.Parameter]] = []
    size = 0
    for p in params:
        bytes_ = samples * p.numel() * max(p.element_size(), 4)
        if groups and size + bytes_ <= GROUP_BYTES:
            groups[-1].append(p)
            size += bytes_
        else:
            groups.append([p])
            size = bytes_
    return groups


def matrix_shape(p: Tensor) -> tuple[int, int]:
    """A parameter as a matrix: its first dim by the rest (a 1-d one as a column, a
    0-d one as ``(1, 1)``), the ``(rows, cols)`` of its :class:`Factors`.

    Examples:
        >>> matrix_shape(torch.zeros(16, 3, 5, 5)), matrix_shape(torch.zeros(7))
        ((16, 75), (7, 1))
    """
    rows = p.shape[0] if p.dim() else 1
    return rows, p.numel() // max(rows, 1)
