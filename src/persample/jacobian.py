"""Input Jacobians of per-sample maps: the diagonal blocks, and the diagonal.

Index conventions: ``b`` a sample of the batch (``B``), ``y`` the flattened
output of one sample (``Y = prod(out_shape)``), ``d`` the flattened input of one
sample (``D = prod(in_shape)``), ``c`` a chunk of one-hot directions (over ``y``
in reverse mode, over ``d`` in forward mode).

Samples are independent (the forward's data flow is checked): ``output[b]`` depends
on ``input[b]`` only. The
full Jacobian ``(B, Y, B, D)`` is then block diagonal, and its ``B`` diagonal
blocks ``(B, Y, D)`` are all there is. A cotangent one-hot over ``y`` and the same
for every sample gives row ``y`` of every block at once, because the sum over
samples separates (the accepted answer to the Stack Overflow question on only the
diagonals of a Jacobian: "sample with appropriate vectors"; the question "How to
compute derivative of matrix output with respect to matrix input most
efficiently?"). All ``Y`` of them go through one batched backward, or all ``D``
one-hot tangents through one batched ``torch.func.jvp``.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterator

import torch
from torch import Tensor, nn
from torch.func import functional_call, jvp, vmap

from .batch import Batched, Mixed
from .certificate import Checker, Draws, certify_input_jacobian, check_option
from .checks import kept_buffers, warn_empty, warn_non_finite
from .engine import open_capture
from .engine.backward import one_hot
from .errors import CertificateError, InternalError
from .memory import result_empty
from .methods import Taken, leave_rules, user_stacklevel
from .patches import solves_broadcast

MODES = ("auto", "reverse", "forward")
_CHUNK_NUMBERS = 2**22  # jacobian_diagonal's default: tangents of a chunk, in numbers


def input_jacobian(
    model: Callable[[Tensor], Tensor],
    inputs: Tensor,
    *,
    mode: str = "auto",
    chunk_size: int | None = None,
    check_independence: bool = False,
    check: str | int | None = None,
) -> Tensor:
    """Per-sample Jacobian of the outputs w.r.t. the inputs, for a whole batch.

    Entry ``[i, *k, *j]`` is ``d model(x)[i, *k] / d x[i, *j]``: the diagonal blocks
    of the full ``(B, *out_shape, B, *in_shape)`` Jacobian. This is all of it when
    samples do not interact. The forward's data flow is followed (as
    :func:`persample.per_sample_grads` does): a model that mixes samples (BatchNorm in
    training mode, a mean or attention over the batch) is refused with the op and module
    named; where the output's samples cannot be followed (code the capture cannot see,
    as TorchScript), each sample's diagonal block is computed on its own, exactly,
    about ``B`` times slower, with a warning.

    Method (vector-Jacobian products with one-hot vectors that "sample" the wanted
    entries, the accepted answer to the Stack Overflow question "Is there a way to
    calculate only the diagonals of the Jacobian?"; the question "How to compute
    derivative of matrix output with respect to matrix input most efficiently?"):
    ``mode="reverse"`` runs one
    forward, then all ``Y`` vector-Jacobian products in one batched backward
    (``is_grads_batched=True``), each cotangent one-hot over the output index and
    the same for every sample. ``mode="forward"`` computes the ``D`` Jacobian-vector
    products of tangents one-hot over the input index, all in one batched
    backward, as VJPs of the VJP ``u -> J^T u`` (exact, and faster on the CPU than
    forward-mode AD); where an op has no double backward it pushes the tangents
    through ``torch.func.jvp`` batched with ``vmap``. ``mode="auto"`` takes forward
    mode when ``D < Y`` (and reverse mode if neither forward way works), reverse
    mode otherwise.

    Args:
        model: a callable or ``nn.Module`` mapping a batch ``(B, *in_shape)`` to
            ``(B, *out_shape)``. Left exactly as it was: no hooks, ``p.grad`` and
            ``training`` untouched, buffers (running statistics) restored.
        inputs: floating tensor ``(B, *in_shape)``, batch in dim 0. Not modified;
            its ``requires_grad`` is unchanged.
        mode: ``"auto"``, ``"reverse"`` or ``"forward"``, as above.
        chunk_size: at most this many of the ``Y`` (reverse) or ``D`` (forward)
            one-hot vectors at once, to bound the memory of intermediates;
            ``None`` takes all at once.
        check_independence: also check numerically on samples 0 and 1 that each
            one's output does not depend on the other one's input (one extra forward
            and two backwards of 2 samples; a batch of one is not checked).
        check: when the result is certified (:mod:`persample.certificate`: for Gaussian
            ``w`` ``(B, Y)``, ``w_i^T J_i`` is row ``i`` of the gradient of ``<w, f(x)>``
            w.r.t. ``x``, one more forward and backward): ``"first"`` (the first call of
            each model, mode and shapes), ``"always"``, ``"never"`` or ``N``. A mismatch
            with ``mode="auto"`` warns and answers each sample's block on its own; with
            another mode it raises ``CertificateError``.

    Returns:
        ``(B, *out_shape, *in_shape)`` in the model output's dtype and device. It is
        computed one-hot index first, so it may be a non-contiguous view (a copy
        would cost as much as a large part of the work; ``.contiguous()`` makes
        one). ``B = 0`` gives an empty tensor of that shape.

    Warns:
        UserWarning: an empty batch (0 samples).
        RuntimeWarning: a sample whose output holds a NaN or an Inf, naming it (its
            results are not finite either).

    Raises:
        TypeError: ``inputs`` is not a floating tensor; the model does not return
            a tensor.
        ValueError: ``inputs`` has no batch dim; the output's dim 0 is not ``B``;
            an unknown ``mode``; ``chunk_size`` not a positive int; a model that mixes
            samples.
        NotImplementedError, RuntimeError: from ``torch.func`` with
            ``mode="forward"``, for a model it cannot run (an op without a
            forward-mode formula, ``.item()``, data-dependent control flow): use
            ``mode="reverse"`` or ``"auto"``.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> from persample.jacobian import input_jacobian
        >>> net = nn.Sequential(nn.Linear(3, 16), nn.Tanh(), nn.Linear(16, 5))
        >>> x = torch.randn(8, 3)
        >>> jac = input_jacobian(net, x)  # D=3 < Y=5: forward mode
        >>> jac.shape
        torch.Size([8, 5, 3])
        >>> full = torch.autograd.functional.jacobian(net, x)  # (8, 5, 8, 3)
        >>> torch.allclose(jac[2], full[2, :, 2], atol=1e-6)
        True
    """
    x = _as_batch(inputs)
    _check_options(mode, chunk_size)
    check_option(check)
    warn_empty("input_jacobian", x.shape[0])
    draws = Draws.now()
    jac = _input_jacobian(model, x, mode, chunk_size, check_independence)
    checker = Checker(check, model, ("input jacobian", mode, tuple(x.shape[1:]), x.dtype,
                                     getattr(model, "training", None)))
    cert = checker("rules", lambda: certify_input_jacobian(model, x, jac, draws, mode))
    if cert is None or cert.ok:
        return jac
    if mode != "auto":
        raise CertificateError(f"persample's certificate rejects the result: "
                               f"{cert.describe()}. Use mode='auto', which answers each "
                               "sample's block on its own.")
    warnings.warn(f"persample's certificate caught a wrong result and discarded it: "
                  f"{cert.describe()}. Each sample's block is computed on its own (exact, "
                  "about B times slower); please report this model.",
                  stacklevel=user_stacklevel())
    draws.restore()
    with kept_buffers(model):
        xg = x.detach().requires_grad_()
        with torch.enable_grad():
            out = model(xg)
        return _blockwise_jacobian(out, xg, chunk_size)


def _input_jacobian(model: Callable, x: Tensor, mode: str, chunk_size: int | None,
                    check_independence: bool) -> Tensor:
    """:func:`input_jacobian`'s result, uncertified."""
    with kept_buffers(model):
        if check_independence:
            _check_independence(model, x)
        xg = x.detach().requires_grad_()
        out, why = _followed_forward(model, xg)  # (B, *out_shape)
        warn_non_finite("input_jacobian", out, "output")
        if why is not None:  # samples not one per row: the diagonal blocks one by one
            _warn_blockwise(why)
            return _blockwise_jacobian(out, xg, chunk_size)
        forward = mode == "forward" or (
            mode == "auto" and math.prod(x.shape[1:]) < math.prod(out.shape[1:]))
        if forward:
            try:
                return _double_backward_jacobian(out, xg, chunk_size)
            except (RuntimeError, NotImplementedError):  # an op without a double backward
                try:
                    return _forward_jacobian(model, x, chunk_size, out.dtype)
                except (RuntimeError, NotImplementedError):  # nor a forward-mode formula
                    if mode == "forward":
                        raise
        return _reverse_jacobian(out, xg, chunk_size)


def jacobian_diagonal(
    fn: Callable[[Tensor], Tensor], inputs: Tensor, *, chunk_size: int | None = None
) -> Tensor:
    """Diagonal of the square per-sample Jacobian of a map that keeps the input's shape.

    Entry ``[i, *j]`` is ``d fn(x)[i, *j] / d x[i, *j]``, exact, without holding the
    ``(B, D, D)`` Jacobian: the ``D`` tangents one-hot over ``j`` (the same for every
    sample) go through ``torch.func.jvp`` in chunks, and of each chunk's products
    only the diagonal entries are kept.
    Samples are independent or refused, as in :func:`input_jacobian`.

    Args:
        fn: a callable or ``nn.Module`` mapping ``(B, *in_shape)`` to a tensor of
            the same shape. Left as it was (as in :func:`input_jacobian`).
        inputs: floating tensor ``(B, *in_shape)``, batch in dim 0; not modified.
        chunk_size: at most this many of the ``D`` directions at once. ``None``:
            as many as keep a chunk's tangents under 4M numbers, at least 4.

    Returns:
        ``(B, *in_shape)`` in ``fn``'s output dtype and device.

    Warns:
        UserWarning: an empty batch (0 samples).
        RuntimeWarning: a sample whose output holds a NaN or an Inf, naming it (its
            results are not finite either).

    Raises:
        TypeError: ``inputs`` is not a floating tensor; ``fn`` does not return a tensor.
        ValueError: ``inputs`` has no batch dim; ``fn``'s output shape differs from
            the input's; ``chunk_size`` not a positive int; ``fn`` mixes samples (as
            for :func:`input_jacobian`, whose data-flow check it shares).

    Examples:
        >>> import torch
        >>> from persample.jacobian import jacobian_diagonal
        >>> lin = torch.nn.Linear(4, 4)
        >>> x = torch.randn(5, 4)
        >>> diag = jacobian_diagonal(lambda v: torch.tanh(lin(v)), x)
        >>> diag.shape
        torch.Size([5, 4])
        >>> expect = (1 - torch.tanh(lin(x)) ** 2) * lin.weight.diagonal()
        >>> torch.allclose(diag, expect, atol=1e-6)
        True
    """
    x = _as_batch(inputs)
    _check_options("auto", chunk_size)
    n, d = x.shape[0], math.prod(x.shape[1:])
    warn_empty("jacobian_diagonal", n)
    with kept_buffers(fn):
        if n == 0 or d == 0:
            with torch.no_grad():
                out = _check_square(_checked_output(fn(x), n).unsqueeze(0), x)[0]
            return out.new_zeros(x.shape)
        xg = x.detach().requires_grad_()
        out, why = _followed_forward(fn, xg)
        _check_square(out.unsqueeze(0), x)
        warn_non_finite("jacobian_diagonal", out, "output")
        if why is not None:  # samples not one per row: each entry's own derivative
            _warn_blockwise(why)
            return _blockwise_jacobian(out, xg, chunk_size, diagonal=True)
        dtype = out.dtype  # the result's (under autocast the tangents may be wider)
        del out, xg
        step = chunk_size or min(d, max(4, _CHUNK_NUMBERS // (n * d)))
        diag = None
        for start, stop in _chunks(d, step):
            jv = _check_square(_push(fn, x, one_hot(start, stop, x)), x)  # (c, B, *in_shape)
            if diag is None:
                diag = jv.new_empty((n, d), dtype=dtype)
            diag[:, start:stop] = jv.reshape(stop - start, n, d).diagonal(start, 0, 2)  # (B, c)
    return diag.view(x.shape)


# ---------------------------------------------------------------------------
# the two modes


def _double_backward_jacobian(out: Tensor, xg: Tensor, chunk_size: int | None) -> Tensor:
    """``(B, *out_shape, *in_shape)`` by JVPs computed as VJPs of a VJP.

    ``g(u) = J^T u`` is linear in a dummy cotangent ``u``, so the VJP of ``g`` with
    tangent ``t`` is ``J t``: two backwards of the graph already built, no
    forward-mode AD (several times faster than ``torch.func.jvp`` on the CPU
    for small models such as a 1-20-20-400 MLP).
    """
    n, d = xg.shape[0], math.prod(xg.shape[1:])
    if n == 0 or d == 0 or not out.requires_grad:
        return out.new_zeros((*out.shape, *xg.shape[1:]))
    u = torch.zeros_like(out, requires_grad=True)  # (B, *out_shape)
    with torch.enable_grad():
        g = torch.autograd.grad(out, xg, u, create_graph=True, allow_unused=True)[0]
    if g is None:  # the output does not depend on the input
        return out.new_zeros((*out.shape, *xg.shape[1:]))
    if not g.requires_grad:  # e.g. a once_differentiable autograd.Function
        raise RuntimeError("the model's backward is not differentiable")
    step = chunk_size or d
    # strict: a backward that is not itself differentiable (a once_differentiable
    # autograd.Function) cuts u off from g; that must fall back, not give zeros
    parts = (_pull(g, u, one_hot(s, e, xg), e < d, strict=True) for s, e in _chunks(d, step))
    jac = _stack(parts, d, step).to(out.dtype)  # (D, B, *out_shape)
    return _result(jac.movedim(0, -1), (*out.shape, *xg.shape[1:]))


def _reverse_jacobian(out: Tensor, xg: Tensor, chunk_size: int | None) -> Tensor:
    """``(B, *out_shape, *in_shape)`` from ``out = model(xg)`` by batched VJPs."""
    n, y = out.shape[0], math.prod(out.shape[1:])
    if n == 0 or y == 0 or not out.requires_grad:
        return out.new_zeros((*out.shape, *xg.shape[1:]))
    step = chunk_size or y
    parts = (_pull(out, xg, one_hot(s, e, out), e < y) for s, e in _chunks(y, step))
    jac = _stack(parts, y, step).to(out.dtype)  # (Y, B, *in_shape)
    return _result(jac.movedim(0, 1), (*out.shape, *xg.shape[1:]))


def _forward_jacobian(model: Callable, x: Tensor, chunk_size: int | None,
                      dtype: torch.dtype) -> Tensor:
    """``(B, *out_shape, *in_shape)`` by batched JVPs, in ``dtype`` (the output's)."""
    d = math.prod(x.shape[1:])
    if x.shape[0] == 0 or d == 0:
        return _empty_jacobian(model, x)
    step = chunk_size or d
    parts = (_push(model, x, one_hot(s, e, x)) for s, e in _chunks(d, step))
    jac = _stack(parts, d, step).to(dtype)  # (D, B, *out_shape)
    return _result(jac.movedim(0, -1), (*jac.shape[1:], *x.shape[1:]))


def _followed_forward(model: Callable, xg: Tensor, name: bool = False
                      ) -> tuple[Tensor, str | None]:
    """``model(xg)`` ``(B, *out_shape)`` with its data flow followed, and ``None`` if each
    output row holds its own sample alone (or no sample at all), else why not. The
    capture keeps no module calls (cheaper) unless ``name``: a model found mixing runs
    once more to name the module in the error.

    Raises:
        ValueError: the model mixes samples (the op and module are named): the diagonal
            blocks are not the whole Jacobian, and no per-sample answer exists.
    """
    n = xg.shape[0]
    if n < 2:  # nothing to mix
        with torch.enable_grad():
            return _checked_output(model(xg), n), None
    module = model if isinstance(model, nn.Module) and name else None
    watched = {id(p): p for p in module.parameters()} if module is not None else {}
    try:
        with torch.enable_grad(), open_capture(module, watched, n, [xg], module_rules=False,
                                               constant=_no_path_to_inputs) as cap:
            out = model(xg)
    except InternalError as err:  # persample's bug: the exact way that assumes nothing
        leave_rules(Taken(), err)
        with torch.enable_grad():
            return _checked_output(model(xg), n), str(err)
    out = _checked_output(out, n)
    lay = cap.layout(out)
    if lay.shared or lay == Batched(0):
        return out, None
    if isinstance(lay, Mixed):
        if not name and isinstance(model, nn.Module):
            return _followed_forward(model, xg, name=True)
        raise ValueError(
            f"the model mixes samples ({lay.why}), so the output of one sample depends on "
            "the inputs of others and the diagonal blocks are not the whole Jacobian. Call "
            "model.eval() or remove the mixing, or use torch.autograd.functional.jacobian "
            "for the full one.")
    return out, getattr(lay, "why", None) or f"the output's samples are not one per row ({lay})"


def _no_path_to_inputs(t: Tensor) -> bool:
    """A tensor the capture never saw made, with no autograd path to the inputs (which
    require grad): a constant for the Jacobian (a parameter, a tensor made before)."""
    return not t.requires_grad or t.grad_fn is None


def _warn_blockwise(why: str) -> None:
    warnings.warn(
        f"the samples of the output cannot be followed ({why}); each sample's diagonal "
        "block is computed on its own (exact, about B times slower).",
        stacklevel=user_stacklevel())


def _blockwise_jacobian(out: Tensor, xg: Tensor, chunk_size: int | None,
                        diagonal: bool = False) -> Tensor:
    """The diagonal blocks ``(B, *out_shape, *in_shape)`` without assuming that samples
    are independent: one cotangent per (sample, output entry), each read at its own
    sample only. With ``diagonal``: entry ``[i, j]`` is ``d out[i, j] / d x[i, j]``."""
    n, y = out.shape[0], math.prod(out.shape[1:])
    d = math.prod(xg.shape[1:])
    result = out.new_zeros((n, y) if diagonal else (n, y, d))
    if not out.requires_grad or n * y == 0:
        return result.view(xg.shape if diagonal else (*out.shape, *xg.shape[1:]))
    pairs = torch.arange(n * y, device=out.device)  # flat (sample, entry)
    step = chunk_size or max(1, min(n * y, _CHUNK_NUMBERS // max(1, n * y)))
    for start, stop in _chunks(n * y, step):
        k = pairs[start:stop]
        cot = out.new_zeros((stop - start, n * y))
        cot[torch.arange(stop - start), k] = 1
        g = _pull(out, xg, cot.view(stop - start, *out.shape), stop < n * y)  # (c, B, *in)
        rows = g.reshape(stop - start, n, d)[torch.arange(stop - start), k // y]  # (c, D)
        if diagonal:
            result.view(-1)[k] = rows[torch.arange(stop - start), k % y].to(result.dtype)
        else:
            result.view(n * y, d)[k] = rows.to(result.dtype)
    return result.view(xg.shape if diagonal else (*out.shape, *xg.shape[1:]))


def _pull(out: Tensor, xg: Tensor, cotangents: Tensor, retain: bool, strict: bool = False
          ) -> Tensor:
    """VJPs ``(c, B, *in_shape)`` of cotangents ``(c, B, *out_shape)``, one backward.

    ``strict``: raise if ``xg`` is not reached from ``out`` (instead of zeros).
    """
    kw = {"retain_graph": retain, "allow_unused": not strict}
    if cotangents.shape[0] == 1:
        g = torch.autograd.grad(out, xg, cotangents[0], **kw)[0]
        g = None if g is None else g.unsqueeze(0)
    else:
        g = torch.autograd.grad(out, xg, cotangents, is_grads_batched=True, **kw)[0]
    return xg.new_zeros((cotangents.shape[0], *xg.shape)) if g is None else g


def _push(model: Callable, x: Tensor, tangents: Tensor) -> Tensor:
    """JVPs ``(c, B, *out_shape)`` of tangents ``(c, B, *in_shape)``.

    A module's floating parameters go in as primals with dense zero tangents: left
    out, forward AD gives them lazy zero tangents, whose adds take a slow path
    (several times the whole jvp of a small MLP, torch 2.13 CPU). Not the buffers:
    ``batch_norm`` refuses tangents on its running statistics.
    """
    state = _float_state(model)
    zeros = {name: torch.zeros_like(t) for name, t in state.items()}

    def call(x_: Tensor, state_: dict[str, Tensor]) -> Tensor:
        return functional_call(model, state_, (x_,)) if state_ else model(x_)

    def one(t: Tensor) -> Tensor:  # (B, *in_shape) -> (B, *out_shape)
        return jvp(call, (x, state), (t, zeros))[1]

    if tangents.shape[0] == 1:
        jv = one(tangents[0]).unsqueeze(0)
    else:
        with solves_broadcast():
            jv = vmap(one)(tangents)
    _checked_output(jv[0] if isinstance(jv, Tensor) else jv, x.shape[0])
    return jv


# ---------------------------------------------------------------------------
# helpers


def _result(jac: Tensor, shape: tuple) -> Tensor:
    """``jac`` (a permuted view) as a contiguous ``shape`` tensor, copied into result memory
    that is already touched (:mod:`persample.memory`) rather than fresh pages."""
    if jac.is_contiguous():
        return jac.view(shape)
    buf = result_empty(jac.numel(), jac.dtype, jac.device)
    return buf.view(jac.shape).copy_(jac).view(shape)


def _chunks(total: int, step: int) -> Iterator[tuple[int, int]]:
    for start in range(0, total, step):
        yield start, min(start + step, total)


def _stack(parts: Iterator[Tensor], total: int, step: int) -> Tensor:
    """Chunks ``(c, ...)`` into one ``(total, ...)`` tensor, allocated once."""
    if step >= total:
        return next(parts)
    buf, start = None, 0
    for part in parts:
        if buf is None:
            buf = part.new_empty((total, *part.shape[1:]))
        buf[start : start + part.shape[0]] = part
        start += part.shape[0]
    return buf


def _empty_jacobian(model: Callable, x: Tensor) -> Tensor:
    """The (empty) result when ``B = 0`` or ``D = 0``: one forward for the output's shape."""
    with torch.no_grad():
        out = _checked_output(model(x), x.shape[0])
    return out.new_zeros((*out.shape, *x.shape[1:]))


def _float_state(model: Callable) -> dict[str, Tensor]:
    if not isinstance(model, nn.Module):
        return {}
    return {name: p.detach() for name, p in model.named_parameters() if p.is_floating_point()}


def _check_independence(model: Callable, x: Tensor) -> None:
    """Raise if output[i] depends on input[j], i != j, for samples 0 and 1."""
    if x.shape[0] < 2:
        return
    x2 = x[:2].detach().requires_grad_()  # (2, *in_shape)
    with torch.enable_grad():
        out = _checked_output(model(x2), 2)  # (2, *out_shape)
    if not out.requires_grad:
        return
    gen = torch.Generator().manual_seed(0)
    r = torch.randn(out.shape[1:], generator=gen, dtype=torch.float64).to(out)
    for i, j in ((0, 1), (1, 0)):
        v = torch.zeros_like(out)
        v[i] = r
        (g,) = torch.autograd.grad(out, x2, v, retain_graph=True, allow_unused=True)
        if g is not None and bool(g[j].ne(0).any()):
            raise ValueError(
                f"output of sample {i} depends on the input of sample {j}: the model mixes "
                "samples (BatchNorm in training mode? attention across the batch?) so the "
                "diagonal blocks are not the whole Jacobian. Call model.eval() or remove "
                "the mixing, or use torch.autograd.functional.jacobian for the full one."
            )


def _as_batch(inputs: object) -> Tensor:
    if not isinstance(inputs, Tensor):
        raise TypeError(
            f"inputs must be a tensor (B, *in_shape) with the batch in dim 0, "
            f"got {type(inputs).__name__}"
        )
    if inputs.dim() == 0:
        raise ValueError("inputs is a 0-dim tensor: it needs the batch in dim 0, (B, *in_shape)")
    if not inputs.is_floating_point():
        raise TypeError(
            f"inputs has dtype {inputs.dtype}: only floating point inputs can be "
            "differentiated (for token ids, differentiate w.r.t. their embeddings)"
        )
    return inputs.detach()


def _check_options(mode: str, chunk_size: int | None) -> None:
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is not one of {MODES}")
    if chunk_size is not None and (
        isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1
    ):
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")


def _checked_output(out: object, n: int) -> Tensor:
    if not isinstance(out, Tensor):
        raise TypeError(
            f"the model returned {type(out).__name__}: it must return one tensor "
            "(B, *out_shape)"
        )
    if out.dim() == 0 or out.shape[0] != n:
        raise ValueError(
            f"the model maps a batch of {n} samples to an output of shape "
            f"{tuple(out.shape)}: it must return (B, *out_shape), one output per sample "
            "in dim 0 (reduce over the batch after taking the Jacobian, not inside the model)"
        )
    return out


def _check_square(jv: Tensor, x: Tensor) -> Tensor:
    """Return ``jv`` ``(c, B, *out_shape)``; raise unless ``out_shape`` is ``in_shape``."""
    if tuple(jv.shape[1:]) != tuple(x.shape):
        raise ValueError(
            f"fn maps inputs of shape {tuple(x.shape)} to outputs of shape "
            f"{tuple(jv.shape[1:])}: jacobian_diagonal needs a square per-sample Jacobian, "
            "so the output must have the input's shape; use input_jacobian for the whole "
            "(B, *out_shape, *in_shape) blocks"
        )
    return jv
