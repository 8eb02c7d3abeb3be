"""Validation of user input, with errors that say what is wrong and how to fix it."""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_leaves

from . import walk
from .inputs import Batch, as_batch
from .methods import METHODS, user_stacklevel
from .rng import buffers_at_start
from .sharded import Sharding, fsdp_units, reshard_all
from .walk import named_modules, named_parameters


def check_targets(targets: Any, n: int) -> None:
    """Every tensor in ``targets`` (a tensor or any nest of them) needs the batch in dim 0."""
    for t in tree_leaves(targets):
        if isinstance(t, Tensor) and (t.dim() == 0 or t.shape[0] != n):
            raise ValueError(
                f"targets has shape {tuple(t.shape)} but the batch size is {n}: "
                "pass one target per sample, with the batch in dim 0"
            )


def check_options(method: str, chunk_size: int | None) -> None:
    if method not in METHODS:
        raise ValueError(f"method={method!r} is not one of {METHODS}")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(
            chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")


def check_loss_fn(loss_fn: Any, targets: Any) -> None:
    """A loss class instead of an instance, ``targets`` and ``loss_fn`` swapped, or a
    ``loss_fn`` that cannot be called: one line naming the argument and the fix."""
    if isinstance(loss_fn, Tensor) and callable(targets) and not isinstance(targets, Tensor):
        raise TypeError(
            "targets and loss_fn are swapped: loss_fn got a tensor and targets got "
            f"{_name(targets)}. The order is (model, inputs, targets, loss_fn).")
    if isinstance(loss_fn, type):
        raise TypeError(
            f"loss_fn is the class {loss_fn.__name__}, not a loss: pass an instance, "
            f"loss_fn={loss_fn.__name__}() (with its options).")
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable as loss_fn(output, targets), got "
                        f"{_name(loss_fn)}")
    if isinstance(targets, (nn.Module, type)) or (callable(targets) and not isinstance(
            targets, Tensor) and getattr(targets, "__module__", "").startswith("torch.nn")):
        raise TypeError(
            f"targets is {_name(targets)}, a loss, not targets: the order is (model, inputs, "
            "targets, loss_fn).")


def _name(x: Any) -> str:
    if isinstance(x, type):
        return f"the class {x.__name__}"
    return f"a {type(x).__name__}" if not callable(x) else getattr(
        x, "__qualname__", type(x).__name__)


def mixing_reason(module: nn.Module) -> str | None:
    """Why ``module`` mixes samples (so per-sample gradients are undefined), or ``None``."""
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and (
        module.training or not module.track_running_stats
    ):
        fix = ("Call model.eval() first (BatchNorm then uses its running statistics)"
               if module.track_running_stats else
               "It keeps no running statistics (track_running_stats=False), so it does so "
               "in eval mode too: make it with track_running_stats=True and call "
               "model.eval()")
        return (
            "normalises with the statistics of the whole batch, so samples are mixed and "
            f"per-sample gradients are not defined. {fix}, or replace it with nn.GroupNorm "
            "/ nn.LayerNorm."
        )
    return None


def mixing_reason_of(model: nn.Module) -> str | None:
    """The first module of ``model`` that mixes samples, and why; ``None`` if none does."""
    for name, m in named_modules(model):
        reason = mixing_reason(m)
        if reason:
            return f"module '{name}' ({type(m).__name__}) {reason}"
    return None


def check_per_sample_model(model: nn.Module) -> None:
    """Raise if a module mixes samples, so per-sample gradients are undefined."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    for name, m in named_modules(model):
        reason = mixing_reason(m)
        if reason:
            raise ValueError(f"module '{name}' ({type(m).__name__}) {reason}")


def trainable_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    params = {n: p for n, p in named_parameters(model) if p.requires_grad}
    if not params:
        raise ValueError(
            f"{type(model).__name__} has no parameters with requires_grad=True: "
            "there is nothing to differentiate"
        )
    return params


def real_parameters(params: dict[str, Tensor], what: str) -> None:
    """Raise ``TypeError`` naming the first complex parameter of ``params``: ``what``
    (inner products, projections, a DP step) is defined for real parameters only."""
    name = next((name for name, p in params.items() if p.is_complex()), None)
    if name is not None:
        raise TypeError(
            f"{what} takes real parameters, and parameter {name!r} is "
            f"{str(params[name].dtype).replace('torch.', '')}: hold it as a real tensor of "
            "(real, imaginary) pairs and view it as complex in forward "
            "(torch.view_as_complex), or use per_sample_grads, whose rows of a complex "
            "parameter are complex")


def selected_parameters(model: nn.Module, params: dict[str, nn.Parameter], selected: Any
                        ) -> dict[str, nn.Parameter]:
    """The trainable parameters ``params`` that ``selected`` names (``None``: all), in
    ``named_parameters()`` order: parameter names (``"0.weight"``), the parameters
    themselves, or a mix. Raises ``ValueError`` naming an unknown or frozen one, or an
    empty selection; ``TypeError`` for anything else."""
    if selected is None:
        return params
    if isinstance(selected, (str, Tensor)):
        selected = [selected]
    names_of = {id(p): name for name, p in model.named_parameters(remove_duplicate=False)}
    wanted = set()
    for item in selected:
        if isinstance(item, Tensor):
            name = names_of.get(id(item))
            if name is None:
                raise ValueError(f"params: a tensor of shape {tuple(item.shape)} is not a "
                                 f"parameter of the {type(model).__name__}")
        elif isinstance(item, str):
            name = item
        else:
            raise TypeError(f"params: names or parameters, got {type(item).__name__}")
        if name not in params:
            frozen = any(n == name for n, _ in model.named_parameters())
            raise ValueError(
                f"params: {name!r} is " + ("frozen (requires_grad=False): unfreeze it or "
                                           "leave it out" if frozen else
                                           f"not a parameter of the {type(model).__name__}"))
        wanted.add(name)
    if not wanted:
        raise ValueError("params is empty: name at least one parameter (or pass None: all)")
    return {name: p for name, p in params.items() if name in wanted}


def check_out(out: Tensor, shape: tuple, dtype: torch.dtype, device: torch.device) -> None:
    """``out`` must be a ``(batch, [outputs,] num_params)`` buffer like the parameters."""
    if not isinstance(out, Tensor):
        raise TypeError(f"out must be a tensor, got {type(out).__name__}")
    if tuple(out.shape) != tuple(shape):
        raise ValueError(
            f"out has shape {tuple(out.shape)}; it must be {tuple(shape)}: "
            "(batch, [outputs,] number of trainable parameters)"
        )
    if out.dtype != dtype or out.device != device:
        raise ValueError(
            f"out is {out.dtype} on {out.device}; it must match the parameters: "
            f"{dtype} on {device}"
        )
    if out.stride(-1) != 1:
        raise ValueError("out must be contiguous along its last dim (out.stride(-1) == 1)")


def common_dtype_device(params: dict[str, nn.Parameter]) -> tuple[torch.dtype, torch.device]:
    kinds = {(p.dtype, p.device) for p in params.values()}
    if len(kinds) > 1:
        raise ValueError(
            f"flat=True needs all trainable parameters in one dtype and device, found {kinds}; "
            "use flat=False"
        )
    return next(iter(kinds))


def validate_call(
    model: nn.Module, inputs: Any, targets: Any, loss_fn: Any, method: str,
    chunk_size: int | None, selected: Any = None,
) -> tuple[Batch, int, dict[str, nn.Parameter]]:
    """Validate the arguments every per-sample function shares: ``(batch, size, params)``.
    ``loss_fn=None``: a function without a loss (the parameter Jacobian); ``selected``:
    the ``params=`` argument (:func:`selected_parameters`)."""
    check_options(method, chunk_size)
    check_per_sample_model(model)
    if loss_fn is not None or targets is not None:
        check_loss_fn(loss_fn, targets)
    batch = as_batch(inputs)
    check_targets(targets, batch.n)
    params = trainable_parameters(model)
    units = fsdp_units(model)
    if units:  # FSDP2: the engine follows the unsharded parameters the forward reads
        params = Sharding(model, units).working
    params = selected_parameters(model, params, selected)
    check_inputs(batch, params)
    return batch, batch.n, params


def check_inputs(batch: Batch, params: dict[str, nn.Parameter]) -> None:
    """Floating-point inputs on another device than the parameters (all on one device),
    and inputs made under ``torch.inference_mode()``, which autograd cannot save for a
    backward (a plain training step fails on them in most models) and which keep no
    version counter."""
    devices = {p.device for p in params.values()}
    device = next(iter(devices)) if len(devices) == 1 else None
    for name, t in batch.named_tensors():
        if t.is_inference():
            raise ValueError(
                f"{name} was made under torch.inference_mode(): autograd cannot save such a "
                f"tensor for a backward, and it keeps no version counter, which persample "
                f"reads. Make it under torch.no_grad() instead, or pass {name}.clone() (a "
                f"clone outside inference mode is a normal tensor).")
        if device is not None and t.is_floating_point() and t.dim() > 0 and (
                t.device != device):
            raise ValueError(
                f"{name} is on {t.device} but the model's parameters are on {device}: move it "
                f"with .to({str(device)!r}) (or the model with model.to({str(t.device)!r})).")


def dtype_note(batch: Batch, params: dict[str, nn.Parameter]) -> str | None:
    """A note for an error of the model's forward: a floating-point input whose dtype is
    not the parameters' (the usual cause of 'expected scalar type' errors)."""
    dtypes = {p.dtype for p in params.values() if p.is_floating_point()}
    if len(dtypes) != 1:
        return None
    (dtype,) = dtypes
    for name, t in batch.named_tensors():
        if t.is_floating_point() and t.dtype != dtype:
            return (f"({name} is {t.dtype} but the model's parameters are {dtype}: convert it "
                    f"with .to({dtype}), or the model with model.to({t.dtype}).)")
    return None


@contextmanager
def kept_buffers(model: Any) -> Iterator[None]:
    """Restore a module's buffers (running statistics updated by a forward) on exit, and
    shared the unsharded parameters of an FSDP2 model that the call gathered again.
    The values at the outermost call on the model are what
    :func:`persample.rng.rewind_buffers` puts back."""
    units = fsdp_units(model) if isinstance(model, nn.Module) else []  # (refuses FSDP1)
    saved = [(b, b.clone()) for b in walk.buffers(model)] if isinstance(model, nn.Module) else []
    try:
        with buffers_at_start(model, saved):
            yield
    finally:
        with torch.no_grad():
            for b, value in saved:
                b.copy_(value)
        if units:
            reshard_all(model)


def keeps_buffers(fn: Callable) -> Callable:
    """Decorator: ``fn(model, ...)`` leaves ``model``'s buffers as they were (an
    ``nn.InstanceNorm`` with ``track_running_stats`` updates them in training mode)."""

    @functools.wraps(fn)
    def wrapper(model: Any, *args: Any, **kwargs: Any) -> Any:
        with kept_buffers(model):
            return fn(model, *args, **kwargs)

    return wrapper


def warn_empty(function: str, n: int) -> None:
    """Warn that ``function`` got a batch of ``n == 0`` samples (its result is then empty:
    usually a data loader or a slice that went wrong).

    Examples:
        >>> import warnings
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     warn_empty("per_sample_grads", 0)
        >>> str(caught[0].message).split(":")[0]
        'per_sample_grads got an empty batch (0 samples)'
    """
    if n == 0:
        warnings.warn(
            f"{function} got an empty batch (0 samples): its result is empty. Check the "
            "data loader or the slice that made the batch.", UserWarning,
            stacklevel=user_stacklevel())


def capturing() -> bool:
    """Is a CUDA graph being captured on the current stream (``torch.cuda.graph``)? Then
    no value may be read on the host (a read would end the capture), and a replay runs
    none of the Python that captured it.

    Examples:
        >>> capturing()  # (no capture here)
        False
    """
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def non_finite_samples(values: Tensor) -> list[int]:
    """The samples whose rows of ``values`` ``(n, ...)`` hold a NaN or an Inf.

    Examples:
        >>> non_finite_samples(torch.tensor([[0.0, 1.0], [float("nan"), 2.0]]))
        [1]
    """
    if values.numel() == 0 or not values.is_floating_point():
        return []
    if math.isfinite(values.detach().sum().item()):  # (the common case: one reduction,
        return []  # one read; a sum that is not finite, an overflow too: entry by entry)
    finite = torch.isfinite(values.detach())
    if finite.all():  # (a sum that overflowed)
        return []
    rows = finite.reshape(values.shape[0], -1).all(1)  # (n,)
    return (~rows).nonzero().flatten().tolist()


def warn_non_finite(function: str, values: Tensor, what: str) -> None:
    """Warn, naming the samples (the first ten), where ``values`` ``(n, ...)`` (each
    sample's ``what``: its loss, its output, or ``"result"``) hold a NaN or an Inf.
    Nothing is checked while a CUDA graph is captured (:func:`capturing`): reading the
    values would end the capture, and its replays run no Python.

    Examples:
        >>> import warnings
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     warn_non_finite("per_sample_grads", torch.tensor([1.0, float("inf")]), "loss")
        >>> str(caught[0].message).split(",")[0]
        'per_sample_grads: the loss of samples [1] is not finite (NaN or Inf)'
    """
    bad = [] if capturing() else non_finite_samples(values)
    if bad:
        warnings.warn(
            f"{function}: the {what} of samples {bad[:10]}{'...' if len(bad) > 10 else ''} "
            f"is not finite (NaN or Inf){'' if what == 'result' else ', nor are their results'}"
            ". Check those samples' inputs, or leave them out.", RuntimeWarning,
            stacklevel=user_stacklevel())
