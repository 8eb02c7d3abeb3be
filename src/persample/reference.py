"""The obviously correct reference: one forward and one ``autograd.grad`` per sample.

This is ``compute_sample_grads`` of PyTorch's "Per-sample-gradients" tutorial.
Every fast path is tested against
it; it is also ``method="loop"``.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import Tensor, nn

from .checks import keeps_buffers, trainable_parameters
from .errors import named_loss
from .inputs import as_batch, samples_of
from .patches import plain_checkpoints
from .sharded import refuse_sharded

Around = Callable[[int], AbstractContextManager]


def _plain(i: int) -> AbstractContextManager:
    return nullcontext()


@keeps_buffers
def loop_per_sample_grads(
    model: nn.Module, inputs: Tensor | tuple, targets: Any, loss_fn: Callable,
    around: Around = _plain, losses: Tensor | None = None,
) -> dict[str, Tensor]:
    """Per-sample gradients by a Python loop over samples (the reference).

    Args:
        model: any ``nn.Module``.
        inputs: as for :func:`persample.per_sample_grads`: a tensor ``(B, *in_shape)``,
            a tuple, a dict of keyword inputs or a pair ``(args, kwargs)``; tensors with
            ``B`` in dim 0 are cut per sample, the others shared.
        targets: tensor ``(B, ...)``, tuple of them, or ``None``.
        loss_fn: ``loss_fn(output, targets)`` for a batch of one sample; a returned
            ``(1,)`` tensor is summed, a scalar used as it is.
        around: ``around(i)``, a context manager sample ``i``'s forward and loss run in
            (``method="loop"`` replays there sample ``i``'s part of the random numbers
            the batch's forward drew: :mod:`persample.draws`); by default nothing.
        losses: a ``(B,)`` tensor each sample's loss is written into (detached), or
            ``None``.

    Returns:
        ``{name: (B, *param.shape)}`` for each trainable parameter; row ``i`` is
        ``d loss_fn(model(x_i), y_i) / d param``. Parameters the loss does not
        depend on get zeros.

    Raises:
        TypeError, ValueError: inputs without a batch dim, or no trainable parameters.

    Examples:
        >>> import torch
        >>> net = torch.nn.Linear(3, 2)
        >>> g = loop_per_sample_grads(net, torch.randn(4, 3), torch.randn(4, 2),
        ...                           torch.nn.MSELoss())
        >>> g["weight"].shape
        torch.Size([4, 2, 3])
    """
    refuse_sharded(model, 'loop')
    batch = as_batch(inputs)
    params = trainable_parameters(model)
    n = batch.n
    result = {name: p.new_zeros((n, *p.shape)) for name, p in params.items()}
    for i in range(n):
        with torch.enable_grad(), plain_checkpoints():
            with around(i):
                output, targets_i = batch.samples(i, i + 1).call(model), samples_of(
                    targets, i, i + 1)
                with named_loss(loss_fn, output, targets_i):
                    loss = loss_fn(output, targets_i).sum()
            if losses is not None:
                losses[i] = loss.detach()
            grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
        for (name, _), g in zip(params.items(), grads):
            if g is not None:
                result[name][i] = g.to_dense() if g.is_sparse else g  # nn.Embedding(sparse=True)
    return result


@keeps_buffers
def loop_param_jacobian(model: nn.Module, inputs: Tensor | tuple, around: Around = _plain
                        ) -> dict[str, Tensor]:
    """Per-sample parameter Jacobian by a loop over samples and outputs (the reference).

    The plain answer to the question of computing ``(B, Y, P)`` Jacobians
    (``calculate_gradients(model, X)``): one ``autograd.grad`` per sample and output.

    Args:
        model: maps a batch ``(B, *in_shape)`` to ``(B, *out_shape)``.
        inputs: as for :func:`loop_per_sample_grads`.
        around: as for :func:`loop_per_sample_grads`.

    Returns:
        ``{name: (B, *out_shape, *param.shape)}``: entry ``[i, k..., p...]`` is
        ``d model(x_i)[k...] / d param[p...]``.

    Raises:
        ValueError: a batch of 0 samples (the output shape is unknown), inputs
            without a batch dim, or no trainable parameters.

    Examples:
        >>> import torch
        >>> net = torch.nn.Linear(3, 2)
        >>> loop_param_jacobian(net, torch.randn(4, 3))["weight"].shape
        torch.Size([4, 2, 2, 3])
    """
    refuse_sharded(model, 'loop')
    batch = as_batch(inputs)
    params = trainable_parameters(model)
    if batch.n == 0:
        raise ValueError("the loop reference needs at least one sample to know the output shape")
    per_sample = []
    for i in range(batch.n):
        with torch.enable_grad(), plain_checkpoints():
            with around(i):
                out = batch.samples(i, i + 1).call(model)[0]  # (*out_shape)
            per_output = [
                torch.autograd.grad(k, list(params.values()), retain_graph=True,
                                    allow_unused=True)
                for k in out.reshape(-1)
            ]
        per_sample.append({
            name: torch.stack([p.new_zeros(p.shape) if g[j] is None else g[j].to_dense()
                               for g in per_output]).view(*out.shape, *p.shape)
            for j, (name, p) in enumerate(params.items())
        })
    return {name: torch.stack([s[name] for s in per_sample]) for name in params}


@keeps_buffers
def forward_per_sample_grads(
    model: nn.Module, inputs: Tensor | tuple, targets: Any, loss_fn: Callable
) -> dict[str, Tensor]:
    """Per-sample gradients in the forward that ran: one forward of the batch, each
    sample's loss on its rows of the output, one ``autograd.grad`` per sample (the
    reference for a model that draws random numbers: dropout, stochastic depth).

    Args:
        model: any ``nn.Module`` whose output holds one row per sample in dim 0 (every
            tensor of it).
        inputs, targets, loss_fn: as for :func:`loop_per_sample_grads`; ``loss_fn`` is
            called on sample ``i``'s rows ``(1, ...)`` of the batch's output.

    Returns:
        ``{name: (B, *param.shape)}``; row ``i`` is ``d loss_fn(out[i:i+1], y_i) / d
        param`` with ``out`` the one batch forward's output, so the rows sum to that
        forward's batch gradient of the summed losses. Run it under the seed of the call
        it checks (``torch.manual_seed``) to draw the same numbers.

    Raises:
        TypeError, ValueError: inputs without a batch dim, or no trainable parameters.

    Examples:
        >>> import torch
        >>> net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Dropout(0.5))
        >>> _ = torch.manual_seed(0)
        >>> g = forward_per_sample_grads(net, torch.randn(4, 3), torch.randn(4, 4),
        ...                              torch.nn.MSELoss())
        >>> g["0.weight"].shape
        torch.Size([4, 4, 3])

    Source: the definition of the per-sample gradient of a forward that draws random
    numbers (dropout: Srivastava et al. 2014), as a loop of ``autograd.grad`` over the
    per-sample losses of one batch forward.
    """
    refuse_sharded(model, 'loop')
    batch = as_batch(inputs)
    params = trainable_parameters(model)
    n = batch.n
    result = {name: p.new_zeros((n, *p.shape)) for name, p in params.items()}
    with torch.enable_grad(), plain_checkpoints():
        output = batch.call(model)
        for i in range(n):
            output_i, targets_i = samples_of(output, i, i + 1), samples_of(targets, i, i + 1)
            with named_loss(loss_fn, output_i, targets_i):
                loss = loss_fn(output_i, targets_i).sum()
            grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True,
                                        retain_graph=i < n - 1)
            for (name, _), g in zip(params.items(), grads):
                if g is not None:
                    result[name][i] = g.to_dense() if g.is_sparse else g
    return result
