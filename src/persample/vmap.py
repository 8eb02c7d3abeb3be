"""``method="vmap"``: ``torch.func.vmap(grad(...))`` over the whole model.

Seed 001's tutorial: ``vmap(grad(compute_loss), in_dims=(None, None, 0, 0))``
with ``functional_call``; each sample is run as a batch of one. Per-sample inputs
(:class:`persample.inputs.Batch`) are mapped over dim 0, shared ones passed whole.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor, nn
from torch.func import functional_call, grad, jacrev, vmap

from .capture import plain_checkpoints
from .errors import UnsupportedModuleError
from .inputs import Batch, mapped_targets


def refuse_recurrent(model: nn.Module) -> None:
    """Raise if ``model`` holds an RNN, LSTM or GRU: ``torch.func`` cannot batch them."""
    for name, module in model.named_modules():
        if isinstance(module, nn.RNNBase):
            raise UnsupportedModuleError(
                f"method='vmap': torch.func has no batching rule for the fused recurrent "
                f"kernel of module '{name or '<root>'}' ({type(module).__name__}). Use "
                "method='rules' or 'auto' (persample's own recurrent rule), or 'loop'."
            )


def _mapped(batch: Batch) -> tuple[list, list, Callable]:
    """The flat inputs (tensors, dataclasses opened), their in_dims, and
    ``call(th, flat_i)``. A packed form (its samples are not slices of dim 0) cannot be
    mapped: ``torch.func`` then refuses, and ``method="auto"`` takes the loop."""
    flat = batch.leaves()
    if any(not isinstance(t, Tensor) for t in flat):
        raise UnsupportedModuleError(
            "method='vmap': torch.func maps over dim 0 of tensors, and these inputs hold a "
            "packed form (PackedSequence, PackedRows, a graph batch) whose samples are not "
            "slices of dim 0. Use method='rules', 'auto' or 'loop'.")
    dims = [0 if k in batch.sample_leaves else None for k in range(len(flat))]

    def call(model: nn.Module, th: dict, flat_i: list) -> Any:
        leaves = [t.unsqueeze(0) if d is not None else t for t, d in zip(flat_i, dims)]
        args, kwargs = batch.rebuilt(leaves)
        return functional_call(model, th, tuple(args), kwargs)

    return flat, dims, call


def vmap_per_sample_grads(model: nn.Module, batch: Batch, targets: Any, loss_fn: Callable,
                          params: dict[str, nn.Parameter]) -> dict[str, Tensor]:
    """Per-sample gradients ``{name: (B, *param.shape)}`` via ``torch.func``."""
    refuse_recurrent(model)
    theta = {name: p.detach() for name, p in params.items()}
    flat, dims, call = _mapped(batch)
    mapped = mapped_targets(targets)
    if mapped is None:
        raise UnsupportedModuleError(
            "method='vmap': the targets hold a packed form whose samples are not slices of "
            "dim 0. Use method='rules', 'auto' or 'loop'.")
    rows, target_dims, one_target = mapped

    def sample_loss(th: dict[str, Tensor], flat_i: list, rows_i: list) -> Tensor:
        return loss_fn(call(model, th, flat_i), one_target(rows_i)).sum()

    with plain_checkpoints():
        return vmap(grad(sample_loss), in_dims=(None, dims, target_dims))(theta, flat, rows)


def vmap_param_jacobian(model: nn.Module, batch: Batch, params: dict[str, nn.Parameter]
                        ) -> dict[str, Tensor]:
    """Per-sample parameter Jacobian ``{name: (B, *out_shape, *param.shape)}``.

    Seed 000's answer: ``vmap(jacrev(functional_call))`` over the samples.
    """
    refuse_recurrent(model)
    for name, module in model.named_modules():
        if isinstance(module, nn.PReLU):  # torch 2.13: shape errors or wrong rows
            raise UnsupportedModuleError(
                f"method='vmap': torch.func's vmap(jacrev(...)) gets the Jacobian of "
                f"module '{name or '<root>'}' (PReLU) wrong in this torch version (a shape "
                "error, or silently wrong rows for the layers before it). Use "
                "method='rules' or 'auto', or 'loop'."
            )
    theta = {name: p.detach() for name, p in params.items()}
    flat, dims, call = _mapped(batch)

    def sample_output(th: dict[str, Tensor], flat_i: list) -> Tensor:
        return call(model, th, flat_i)[0]  # (*out_shape)

    with plain_checkpoints():
        return vmap(jacrev(sample_output), in_dims=(None, dims))(theta, flat)
