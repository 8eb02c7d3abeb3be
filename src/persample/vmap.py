"""``method="vmap"``: ``torch.func.vmap(grad(...))`` over the whole model.

PyTorch's per-sample-gradients tutorial (torch.func):
``vmap(grad(compute_loss), in_dims=(None, None, 0, 0))`` with ``functional_call``; each
sample is run as a batch of one. Per-sample inputs (:class:`persample.inputs.Batch`) are
mapped over dim 0, shared ones passed whole.

Under ``torch.autocast`` the model runs as autocast runs it. Two kernels need help:
``torch.func`` cannot batch ``batch_norm`` (hence ``instance_norm`` and the BatchNorm
layers in eval mode) nor the backward of ``layer_norm`` to its input when they read a
bfloat16 or float16 input with float32 parameters, the mixed form autocast gives them
after a convolution or a linear layer ("expected scalar type BFloat16 but found
Float"); :func:`_unmixed_norms` runs those calls as the mixed kernels compute them:
the input in the parameters' dtype, the output cast back to the input's.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad, jacrev, vmap
from torch.overrides import TorchFunctionMode

from .engine.backward import hooked_parameter, hooks_text
from .errors import UnsupportedModuleError, named_loss
from .inputs import Batch, mapped_targets
from .patches import plain_checkpoints, solves_broadcast
from .precision import autocast_state
from .sharded import refuse_sharded

Around = Callable[[Tensor], AbstractContextManager]


def _plain(index: Tensor) -> AbstractContextManager:
    return nullcontext()


def refuse_hooks(model: nn.Module, params: dict[str, nn.Parameter]) -> None:
    """Raise if a parameter of ``params`` has a gradient hook: ``torch.func``
    differentiates stand-ins for the parameters, which do not run it."""
    name = hooked_parameter(model, params.values())
    if name is not None:
        raise UnsupportedModuleError("method='vmap': " + hooks_text(
            name, "torch.func (which differentiates stand-ins for the parameters)"))


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
                          params: dict[str, nn.Parameter], around: Around = _plain,
                          losses: Tensor | None = None) -> dict[str, Tensor]:
    """Per-sample gradients ``{name: (B, *param.shape)}`` via ``torch.func``; each
    sample's forward and loss run in ``around(index)`` (``index`` the sample's index, a
    batched 0-dim tensor); ``losses``: a ``(B,)`` tensor each sample's loss is written
    into, or ``None``."""
    refuse_sharded(model, 'vmap')
    refuse_recurrent(model)
    refuse_hooks(model, params)
    theta = {name: p.detach() for name, p in params.items()}
    flat, dims, call = _mapped(batch)
    mapped = mapped_targets(targets)
    if mapped is None:
        raise UnsupportedModuleError(
            "method='vmap': the targets hold a packed form whose samples are not slices of "
            "dim 0. Use method='rules', 'auto' or 'loop'.")
    rows, target_dims, one_target = mapped

    direct = _DirectReads(params)

    def sample_loss(th: dict[str, Tensor], flat_i: list, rows_i: list, index: Tensor
                    ) -> tuple[Tensor, Tensor]:
        with around(index):
            output, targets_i = call(model, th, flat_i), one_target(rows_i)
            with named_loss(loss_fn, output, targets_i), direct:
                loss = loss_fn(output, targets_i).sum()
        return loss, loss.detach()

    index = torch.arange(batch.n, device=_device(flat))
    with plain_checkpoints(), solves_broadcast(), _unmixed_norms(), _input_derivatives():
        grads, each = vmap(grad(sample_loss, has_aux=True), in_dims=(None, dims, target_dims,
                                                                     0))(theta, flat, rows, index)
    if losses is not None:
        losses.copy_(each)
    return grads


def vmap_param_jacobian(model: nn.Module, batch: Batch, params: dict[str, nn.Parameter],
                        around: Around = _plain) -> dict[str, Tensor]:
    """Per-sample parameter Jacobian ``{name: (B, *out_shape, *param.shape)}``
    (``around`` as for :func:`vmap_per_sample_grads`).

    The usual answer to computing ``(B, Y, P)`` Jacobians: ``vmap(jacrev(functional_call))``
    over the samples.
    """
    refuse_sharded(model, 'vmap')
    refuse_recurrent(model)
    refuse_hooks(model, params)
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

    def sample_output(th: dict[str, Tensor], flat_i: list, index: Tensor) -> Tensor:
        with around(index):
            return call(model, th, flat_i)[0]  # (*out_shape)

    index = torch.arange(batch.n, device=_device(flat))
    with plain_checkpoints(), solves_broadcast(), _unmixed_norms(), _input_derivatives():
        return vmap(jacrev(sample_output), in_dims=(None, dims, 0))(theta, flat, index)


_GRAD = torch.autograd.grad.__code__
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))


@contextmanager
def _input_derivatives() -> Iterator[None]:
    """A ``torch.autograd.grad`` of the forward or the loss (called from outside torch:
    ``torch.func`` calls it too) that fails under the transforms (by an input that
    requires grad: a PINN's ``u_x``, a gradient penalty; ``torch.func`` tracks only the
    tensors it maps and differentiates) raised as a refusal naming it, which
    ``method="auto"`` answers with the loop."""
    try:
        yield
    except RuntimeError as err:
        tb = err.__traceback__
        while tb is not None and not (
                tb.tb_frame.f_code is _GRAD and tb.tb_frame.f_back is not None
                and not os.path.abspath(tb.tb_frame.f_back.f_code.co_filename).startswith(
                    _TORCH)):
            tb = tb.tb_next
        if tb is None:
            raise
        raise UnsupportedModuleError(
            "method='vmap': torch.autograd.grad inside the model or loss_fn failed under "
            f"torch.func ({err}): a derivative by an input that requires grad (input "
            "derivatives, a gradient penalty) has no form there, as torch.func tracks only "
            "the tensors it maps and differentiates. Use method='loop' or 'auto'.") from err


def _device(flat: list) -> torch.device:
    return next((t.device for t in flat if isinstance(t, Tensor)), torch.device("cpu"))


class _DirectReads(TorchFunctionMode):
    """While the loss runs: a trainable parameter read there itself (an L2 penalty on
    ``model.weight``), not through the model's output, is refused.
    ``grad`` differentiates the copies ``functional_call`` gives the forward (a
    distribution's parameters the forward stored in its output are those copies), so
    such a read would get no gradient: silently wrong."""

    def __init__(self, params: dict[str, nn.Parameter]):
        super().__init__()
        self.names = {id(p): (name, p) for name, p in params.items()}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for a in (*args, *kwargs.values()):
            for t in (a if isinstance(a, (list, tuple)) else (a,)):
                found = self.names.get(id(t)) if isinstance(t, Tensor) else None
                if found is not None and found[1] is t:
                    raise UnsupportedModuleError(
                        f"method='vmap': loss_fn reads parameter '{found[0]}' itself, not "
                        "through the model's output; torch.func differentiates the copies "
                        "functional_call gives the forward, so that read would get no "
                        "gradient. Use method='rules', 'auto' or 'loop'.")
        return func(*args, **kwargs)


# the input first, then the shape, running statistics, weight and bias
_NORMS = (F.batch_norm, torch.batch_norm, F.instance_norm, torch.instance_norm,
          F.layer_norm, torch.layer_norm)


class _UnmixedNorms(TorchFunctionMode):
    """``batch_norm``/``instance_norm``/``layer_norm`` on a low-precision input with
    parameters (or running statistics) in a wider dtype, as
    ``norm(x.to(wide)).to(x.dtype)``."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _NORMS and args and isinstance(args[0], Tensor):
            x = args[0]
            wide = [t.dtype for t in (*args[1:], *kwargs.values())
                    if isinstance(t, Tensor) and t.is_floating_point() and t.dtype != x.dtype]
            if x.is_floating_point() and wide:
                return func(x.to(wide[0]), *args[1:], **kwargs).to(x.dtype)
        return func(*args, **kwargs)


@contextmanager
def _unmixed_norms() -> Iterator[None]:
    """Under autocast, :class:`_UnmixedNorms` for the block; else nothing."""
    if not any(enabled for _, enabled, _ in autocast_state()):
        yield
        return
    with _UnmixedNorms():
        yield
