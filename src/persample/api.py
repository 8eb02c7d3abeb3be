"""The public functions of persample."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor, nn

from . import checks
from .certificate import (
    Checker,
    certify_grads,
    certify_jacobian,
    check_option,
    signature,
    summed_rows,
)
from .engine import rules_grads, rules_param_jacobian
from .inputs import Batch, samples_of
from .memory import result_empty
from .methods import Taken, answer
from .rng import restore, snapshot
from .whole import loop_grads, loop_jacobian, vmap_grads, vmap_jacobian


@checks.keeps_buffers
def per_sample_grads(
    model: nn.Module,
    inputs: Any,
    targets: Any,
    loss_fn: Callable[[Any, Any], Tensor],
    *,
    method: str = "auto",
    flat: bool = False,
    chunk_size: int | None = None,
    out: Tensor | None = None,
    params: Iterable[str | Tensor] | None = None,
    check: str | int | None = None,
) -> dict[str, Tensor] | Tensor:
    """Per-sample gradients of a loss w.r.t. every trainable parameter.

    Row ``i`` is the gradient of sample ``i``'s own loss
    ``loss_fn(model(x_i), y_i)``: exactly what a loop of ``torch.autograd.grad``
    over samples returns (``method="loop"``), whatever the loss's reduction.

    Args:
        model: an ``nn.Module``; samples must not interact (BatchNorm in training
            mode is refused). Its state is left exactly as it was: no hooks, no
            attributes, ``p.grad`` and ``training`` untouched. Sharded with FSDP2
            (``fully_shard``): each rank gets its own samples' gradients as full
            (unsharded) plain tensors, in FSDP's compute dtype (every rank calls it
            alike; FSDP1 is refused).
        inputs: a tensor ``(B, *in_shape)`` (``model(inputs)``), a tuple
            (``model(*inputs)``), a dict such as a tokenizer's ``BatchEncoding``
            (``model(**inputs)``), or a pair ``(args, kwargs)``; tuples, lists, dicts
            and dataclasses inside are opened. ``B`` is dim 0 of the first tensor;
            tensors with ``B`` in dim 0 are per-sample inputs, the others are shared by
            all samples. Samples packed in other forms: a ``PackedSequence`` (``B`` its
            sequences), :class:`persample.PackedRows` (rows of several samples with the
            sample of each row), a torch_geometric graph batch (``B`` its graphs). Any
            other object holding tensors is refused. Any dtype the model accepts.
        targets: tensor ``(B, ...)``, a nest of them, or ``None``; passed to
            ``loss_fn`` as the second argument.
        loss_fn: ``loss_fn(output, targets)`` with the model's output as it is (a
            tensor, a tuple, a dict, a ``ModelOutput``), returning per-sample losses
            ``(B,)`` or a scalar reduced over the batch in any way: where the loss's
            entries are not each one sample's own (a scalar, or a ``(B,)`` loss that
            reads other samples), it is evaluated again on each sample's slice of the
            output, as the loop does (``torch.func.vmap``, else one call per sample).
        method: ``"rules"`` (capture by data flow + op rules, exact per-sample VJPs
            where no rule applies; Goodfellow 2015, "Efficient per-example gradient
            computations"), ``"vmap"`` (``torch.func`` over the whole model), ``"loop"``
            (the reference), or ``"auto"``: ``"rules"``; where the rules cannot split
            some parameter's gradient by sample, or persample's own code fails on the
            model (a bug, reported as such), a warning naming the op or module, then
            ``"vmap"``, then ``"loop"``. Errors of the model's own ``forward`` and of
            ``loss_fn`` propagate unchanged.
        flat: return one ``(B, P)`` tensor, columns in ``named_parameters()`` order,
            each parameter flattened row-major.
        chunk_size: process at most this many samples at a time, to bound the
            memory of activations and backprops (the result is still whole).
        out: a caller-owned ``(B, P)`` buffer, the parameters' dtype and device, to
            write the flat result into (implies ``flat=True``).
        params: the parameters to differentiate, as names (``"0.weight"``) or the
            parameters themselves (default: every trainable one). The rest of the model
            is left untouched (not frozen) and costs no per-sample work; the result has
            the selected ones only, in ``named_parameters()`` order.
        check: when the result is certified by an identity persample does not compute
            itself (for Gaussian ``u``, ``sum_i u_i g_i`` is the gradient of ``sum_i u_i
            L_i``: one more forward and backward of the batch, replaying its random
            numbers; :mod:`persample.certificate`): ``"first"`` (the first call of each
            model, input shapes and method), ``"always"``, ``"never"``, or ``N`` (the
            first and every ``N``-th call). A mismatch under ``"auto"`` warns, naming the
            parameters, and takes the next method; an explicit method raises.

    Returns:
        ``{name: (B, *param.shape)}`` over the trainable parameters in
        ``model.named_parameters()`` order, in each parameter's dtype and device;
        or with ``flat=True`` / ``out=`` a ``(B, P)`` tensor. Units: loss units per
        parameter unit. A batch of 0 samples gives empty results of these shapes
        without running the model.

    Warns:
        UserWarning: an empty batch (0 samples).
        RuntimeWarning: a sample whose loss holds a NaN or an Inf, naming it (its
            results are not finite either).

    Raises:
        TypeError: ``loss_fn`` a loss class rather than an instance, not callable, or
            swapped with ``targets``; an input or target that holds tensors in an
            object persample does not open (named).
        ValueError: targets whose dim 0 is not the batch size; a module that mixes
            samples (BatchNorm in training mode); no trainable parameters; a
            floating-point input on another device than the parameters, or made under
            ``torch.inference_mode()``; a loss that is
            neither ``(B,)`` nor a scalar; ``out`` of the wrong shape, dtype or device;
            a parameter read in ``loss_fn``.
        LossNotPerSampleError: ``loss_fn`` reads an output the model computed over
            the whole batch (``out.loss`` with ``labels`` in the inputs); the message
            shows a per-sample loss. ``method="auto"`` warns and runs the loop.
        NeedsWholeModel, UnsupportedModuleError: ``method="rules"`` and a parameter
            whose gradient the rules cannot split by sample (an op mixing samples, a
            custom ``autograd.Function``): the message names it; ``"auto"`` falls back.
        InternalError: ``method="rules"`` and persample's own code failed on the model
            (a bug; the original error is its ``__cause__``); ``"auto"`` falls back.
        CertificateError: the certificate rejects the result of an explicit ``method``,
            or under ``"auto"`` even the loop's (a forward that does not reproduce under
            torch's generators: numpy's or Python's random numbers).

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> import persample
        >>> net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
        >>> x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
        >>> g = persample.per_sample_grads(net, x, y, nn.CrossEntropyLoss())
        >>> g["0.weight"].shape
        torch.Size([16, 8, 4])
        >>> persample.per_sample_grads(net, x, y, nn.CrossEntropyLoss(), flat=True).shape
        torch.Size([16, 67])
    """
    result, taken = grads_taken(model, inputs, targets, loss_fn, method=method, flat=flat,
                                chunk_size=chunk_size, out=out, params=params, check=check)
    checks.warn_empty("per_sample_grads", len(taken.losses))
    checks.warn_non_finite("per_sample_grads", taken.losses, "loss")
    return result


def grads_taken(model: nn.Module, inputs: Any, targets: Any, loss_fn: Callable, *,
                method: str = "auto", flat: bool = False, chunk_size: int | None = None,
                out: Tensor | None = None,
                params: Iterable[str | Tensor] | None = None, check: str | int | None = None
                ) -> tuple[dict[str, Tensor] | Tensor, Taken]:
    """:func:`per_sample_grads` without its warnings, and the method that answered
    (:class:`Taken`, with the certificates run and each sample's loss)."""
    check_option(check)
    batch, n, params = checks.validate_call(model, inputs, targets, loss_fn, method,
                                           chunk_size, params)
    result, dest = _allocate(params, n, (), flat or out is not None, out)
    watched = {id(p): p for p in params.values()}
    step, taken = chunk_size or max(n, 1), Taken()
    every = taken.losses = torch.empty(  # each sample's loss, from each method (for its
        n, dtype=torch.float64, device=next(iter(params.values())).device)  # certificate)
    for start in range(0, n, step):
        a, t = batch.samples(start, start + step), samples_of(targets, start, start + step)
        d = dest if step >= n else {key: part[start : start + step]
                                    for key, part in dest.items()}
        losses = every[start : start + step]
        answer(
            method,
            rules=lambda a=a, t=t, d=d, losses=losses: _noted(
                taken, rules_grads(model, a, t, loss_fn, d, watched), losses),
            vmap=lambda a=a, t=t, d=d, losses=losses: _copy(
                vmap_grads(model, a, t, loss_fn, params, losses), params, d),
            loop=lambda a=a, t=t, d=d, losses=losses: _copy(
                loop_grads(model, a.as_inputs(), t, loss_fn, losses), params, d),
            taken=taken, hint=lambda: checks.dtype_note(batch, params),
            certify=_grads_checker(model, a, t, loss_fn, params, d, check, losses, taken))
    return result, taken


def _grads_checker(model: nn.Module, batch: Batch, targets: Any, loss_fn: Callable,
                   params: dict[str, nn.Parameter], dest: dict[int, Tensor], check: Any,
                   losses: Tensor, taken: Taken) -> Callable:
    """``certify(how, draws)`` of the rows ``dest`` of one batch (see :func:`answer`;
    ``losses``: the method's per-sample losses; ``taken.values_read``: the rules' forward
    read sample data into Python)."""
    checker = Checker(check, model, signature("grads", model, batch, targets,
                                              params.values()))

    def certify(how: str, draws: Any) -> Any:
        return checker(how, lambda: certify_grads(
            model, batch, targets, loss_fn, params,
            summed_rows(lambda name: dest[id(params[name])], params), draws, how,
            losses=losses, read=taken.values_read if how == "rules" else None))
    certify.rejected = checker.rejected
    return certify


def _noted(taken: Taken, captured: Any, losses: Tensor) -> Any:
    """``captured``, its plan's note kept in ``taken``, its per-sample losses in
    ``losses``."""
    taken.plan = captured.plan_note()
    losses.copy_(captured.losses)
    taken.values_read = captured.values_read()
    return captured


@checks.keeps_buffers
def param_jacobian(
    model: nn.Module,
    inputs: Any,
    *,
    method: str = "auto",
    flat: bool = False,
    chunk_size: int | None = None,
    out: Tensor | None = None,
    params: Iterable[str | Tensor] | None = None,
    check: str | int | None = None,
) -> dict[str, Tensor] | Tensor:
    """Per-sample Jacobian of the model's outputs w.r.t. its parameters.

    The ``(B, Y, P)`` Jacobian of the question ``calculate_gradients(model, X)``: entry
    ``[i, k, p]`` is ``d model(X)[i].flatten()[k] / d theta_p``. Samples must not interact.

    Args:
        model: an ``nn.Module`` mapping a batch ``(B, *in_shape)`` to one tensor
            ``(B, *out_shape)``; ``Y = prod(out_shape)``. Left exactly as it was.
        inputs: as for :func:`per_sample_grads` (a tensor, a tuple, a dict, or
            ``(args, kwargs)``).
        method: ``"rules"``: one forward with capture, then all ``Y`` one-hot output
            cotangents in one batched backward and the layer rules with a leading
            cotangent dim; ``"vmap"``: ``vmap(jacrev(functional_call))``; ``"loop"``: one
            ``autograd.grad`` per sample and output; ``"auto"``: ``"rules"``, and with a
            warning ``"vmap"``, then ``"loop"``, where the rules cannot split a
            parameter's gradient by sample or persample's own code fails on the model
            (as for :func:`per_sample_grads`).
        flat: return one ``(B, Y, P)`` tensor, columns in ``named_parameters()`` order.
        chunk_size: at most this many (sample, output) pairs go through one batched
            backward, to bound memory (activations' backprops take ``chunk_size``
            times the memory of one sample's). The result is still whole.
        out: a caller-owned ``(B, Y, P)`` buffer (the parameters' dtype and device)
            to write into; implies ``flat=True``.
        params: the parameters to differentiate, as names (``"0.weight"``) or the
            parameters themselves (default: every trainable one). The rest of the model
            is left untouched (not frozen) and costs no per-sample work; the result (and ``P``)
            has the selected ones only, in ``named_parameters()`` order.
        check: when the result is certified (for Gaussian ``w`` ``(B, Y)``, ``sum_i
            w_i^T J_i`` is the gradient of ``<w, f(x)>``: one more forward and backward;
            :mod:`persample.certificate`): ``"first"``, ``"always"``, ``"never"`` or
            ``N``, as for :func:`per_sample_grads`.

    Returns:
        ``{name: (B, *out_shape, *param.shape)}`` over the trainable parameters, or
        ``(B, Y, P)`` with ``flat=True``. Its size is ``B * Y * P * itemsize`` bytes
        (an MLP 784->20->10 at B=256 in float32: 163 MB).

    Warns:
        RuntimeWarning: a sample whose rows of the result hold a NaN or an Inf, naming
            it.

    Raises:
        ValueError: a model whose output is not one tensor with the batch in dim 0,
            BatchNorm in training mode, no trainable parameters, ``out`` of the
            wrong shape, dtype or device, a bad ``method`` or ``chunk_size``.
        UnsupportedModuleError: ``method="rules"`` and a module neither a rule nor
            ``torch.func`` can differentiate.
        CertificateError: the certificate rejects an explicit ``method``'s result (or
            under ``"auto"`` even the loop's).

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> import persample
        >>> net = nn.Sequential(nn.Linear(784, 20), nn.ReLU(), nn.Linear(20, 10))
        >>> persample.param_jacobian(net, torch.randn(8, 784), flat=True).shape
        torch.Size([8, 10, 15910])
    """
    check_option(check)
    batch, n, params = checks.validate_call(model, inputs, None, None, method, chunk_size,
                                           params)
    watched = {id(p): p for p in params.values()}
    out_shape = _output_shape(model, batch)  # (refuses an empty batch)
    num_out = out_shape.numel()
    result, dest = _allocate(params, n, (num_out,), flat or out is not None, out)
    # vmap and loop compute all outputs at once: chunking them would repeat the work
    step_out = num_out if method in ("vmap", "loop") else min(num_out, chunk_size or num_out)
    step = max(1, (chunk_size or num_out * max(n, 1)) // step_out)
    taken = Taken()
    for start in range(0, n, step):
        a = batch.samples(start, start + step)
        for first in range(0, num_out, step_out):
            o = range(first, min(first + step_out, num_out))
            d = {k: t[start : start + step, o.start : o.stop] for k, t in dest.items()}
            answer(
                method,
                rules=lambda a=a, o=o, d=d: rules_param_jacobian(model, a, o, d, watched),
                vmap=lambda a=a, o=o, d=d: _copy(
                    _select(vmap_jacobian(model, a, params), o, params), params, d),
                loop=lambda a=a, o=o, d=d: _copy(
                    _select(loop_jacobian(model, a.as_inputs()), o, params), params, d),
                taken=taken, hint=lambda: checks.dtype_note(batch, params),
                certify=_jacobian_checker(model, a, params, d, check, o, num_out))
    checks.warn_non_finite("param_jacobian", _row_sums(dest.values(), n), "result")
    if isinstance(result, dict):
        return {name: t.view(n, *out_shape, *t.shape[2:]) for name, t in result.items()}
    return result


def _row_sums(parts: Any, n: int) -> Tensor:
    """``(n,)`` float64: 0 for a sample whose entries are finite in every part ``(n, ...)``,
    NaN for one with a NaN or an Inf (what :func:`persample.checks.warn_non_finite` reads).
    One summing read of the result in its own dtype, no copy of it (the parts may be
    strided views; a float64 sum of float32 entries takes 20 times as long); a row whose
    sum is not finite has its entries read again, so that a sum that overflowed the dtype
    is not taken for an Inf. Nothing is read while a CUDA graph is captured."""
    total = torch.zeros(n, dtype=torch.float64)
    parts = list(parts)
    if checks.capturing() or not parts:
        return total
    odd = ~torch.isfinite(torch.stack(  # (n, parts): each part's rows summed in its dtype
        [t.sum(dim=tuple(range(1, t.dim()))).double() for t in parts], 1))
    if not bool(odd.any()):  # (one read: no NaN nor Inf, nor a sum that overflowed)
        return total
    for t, flagged in zip(parts, odd.unbind(1)):
        at = flagged.nonzero().flatten()
        bad = at[~torch.isfinite(t[at].flatten(1)).all(1)]  # (its entries read again)
        total[bad.cpu()] = float("nan")
    return total


def _jacobian_checker(model: nn.Module, batch: Batch, params: dict[str, nn.Parameter],
                      dest: dict[int, Tensor], check: Any, outputs: range, num_out: int
                      ) -> Callable | None:
    """``certify(how, draws)`` of the Jacobian rows ``dest`` ``(n, v, *shape)`` of one
    batch; ``None`` for a part of the outputs (the identity needs them all)."""
    if len(outputs) != num_out:
        return None
    checker = Checker(check, model, signature("jacobian", model, batch, None,
                                              params.values()))

    def certify(how: str, draws: Any) -> Any:
        rows = {name: dest[id(p)].reshape(batch.n, num_out, *p.shape)
                for name, p in params.items()}
        return checker(how, lambda: certify_jacobian(model, batch, params, rows, draws, how))
    certify.rejected = checker.rejected
    return certify


def _output_shape(model: nn.Module, batch: Batch) -> torch.Size:
    """``out_shape`` of one sample, from a forward of the first sample (its draws and
    buffer updates undone: the call draws what one forward draws; with autograd on, as a
    forward that calls ``torch.autograd.grad`` itself needs)."""
    if batch.n == 0:
        raise ValueError("param_jacobian needs at least one sample to know the output shape")
    states = snapshot()
    try:
        with torch.enable_grad(), checks.kept_buffers(model):
            output = batch.samples(0, 1).call(model)
    finally:
        restore(states)
    if not isinstance(output, Tensor) or output.dim() == 0 or output.shape[0] != 1:
        raise ValueError(
            "the model must return one tensor with the batch in dim 0; for a sample of one "
            f"it returned {tuple(output.shape) if isinstance(output, Tensor) else type(output)}"
        )
    return output.shape[1:]


def _select(jac: dict[str, Tensor], outputs: range, params: dict) -> dict[str, Tensor]:
    """``{name: (n, *out_shape, *shape)}`` -> rows ``outputs`` of the flattened outputs."""
    return {  # (the loop gives every trainable parameter's: the selected ones are kept)
        name: jac[name].reshape(jac[name].shape[0], -1, *p.shape)[:, outputs.start : outputs.stop]
        for name, p in params.items()
    }


def _allocate(
    params: dict[str, nn.Parameter],
    n: int,
    out_shape: tuple | torch.Size,
    flat: bool,
    out: Tensor | None,
) -> tuple[dict[str, Tensor] | Tensor, dict[int, Tensor]]:
    """The result and its destinations ``(n, *out_shape, *param.shape)`` by parameter identity.

    With ``flat`` the destinations are views into one ``(n, *out_shape, P)`` buffer.
    """
    rows = n * math.prod(out_shape)
    if not flat:  # one block per dtype and device, each parameter's result contiguous in it
        result = {}
        for kind in dict.fromkeys((p.dtype, p.device) for p in params.values()):
            group = {name: p for name, p in params.items() if (p.dtype, p.device) == kind}
            step = max(1, 64 // group[next(iter(group))].element_size())  # 64-byte starts
            sizes = [-(-rows * p.numel() // step) * step for p in group.values()]
            block, offset = result_empty(sum(sizes), *kind), 0
            for (name, p), size in zip(group.items(), sizes):
                shape = (n, *out_shape, *p.shape)  # (contiguous, at ``offset``)
                result[name] = block.as_strided(shape, _contiguous_strides(shape), offset)
                offset += size
        result = {name: result[name] for name in params}
        return result, {id(params[name]): t for name, t in result.items()}
    dtype, device = checks.common_dtype_device(params)
    total = sum(p.numel() for p in params.values())
    if out is None:
        out = result_empty(rows * total, dtype, device).view(n, *out_shape, total)
    else:
        checks.check_out(out, (n, *out_shape, total), dtype, device)
    dest, offset = {}, 0
    for p in params.values():
        dest[id(p)] = out[..., offset : offset + p.numel()].view(n, *out_shape, *p.shape)
        offset += p.numel()
    return out, dest


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def aligned_empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """An empty tensor whose rows (along the last dim) start on 64-byte boundaries.

    Its row stride is ``shape[-1]`` rounded up to 64 bytes, so it is a view that
    may not be contiguous. The layer rules write aligned rows at the speed of
    ``fill_`` and misaligned ones up to 1.5x slower, so use it for ``out=``.

    Args:
        shape: the wanted shape; the last dim is the one padded in memory.
        dtype, device: as for ``torch.empty``.

    Returns:
        An uninitialised tensor of ``shape`` (a view of a padded allocation).

    Raises:
        RuntimeError: out of memory (from ``torch.empty``).

    Examples:
        >>> buf = aligned_empty((4, 10), torch.float32, torch.device("cpu"))
        >>> buf.shape, buf.stride()
        (torch.Size([4, 10]), (16, 1))
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    step = max(1, 64 // itemsize)
    padded = -(-shape[-1] // step) * step
    return torch.empty((*shape[:-1], padded), dtype=dtype, device=device)[..., : shape[-1]]


def _copy(got: dict[str, Tensor], params: dict, dest: dict[int, Tensor]) -> None:
    with torch.no_grad():  # torch.func results stay attached to inputs requiring grad
        for name, p in params.items():
            dest[id(p)].copy_(got[name].reshape(dest[id(p)].shape))
