"""Inner products of per-sample gradients, without the ``(B, P)`` tensors.

``<g_i, g'_j>`` for every sample ``i`` of one batch and ``j`` of another (or of the
same batch: the Gram matrix) is what training-data attribution scores are made of
(TracIn, Pruthi et al. 2020: a training sample's influence on a test sample is the
inner product of their loss gradients, summed over checkpoints; the Gram matrix of
a batch for data selection and In-run Data Shapley, Wang et al. 2024). Per parameter
it is a sum over the ops that read it:

- an op with factors (a linear map at ``T`` positions, a table lookup: ``G_i = sum_t
  L[i, t] outer R[i, t]``, ``rules.ghost``): ``sum_{t, s} (L[i, t] . L'[j, s])
  (R[i, t] . R'[j, s])``, i.e. ``(a_i . a'_j)(g_i . g'_j)`` for ``T = 1``, ids compared
  for lookups, with the cross terms of a parameter read by several ops (tied weights);
  chosen where it costs fewer multiply-adds than forming the gradients;
- every other parameter (convolutions, normalisation layers, scales, what the rules
  answer by module or by ``torch.func``) from its per-sample gradients, a few
  parameters at a time (:func:`persample.engine.factored_batch.parameter_groups`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor, nn

from . import checks
from .certificate import Checker, certify_dots, check_option, signature
from .engine import Factors, cross_inner, forming_cost
from .engine.factored_batch import FactoredBatch, matrix_shape, parameter_groups
from .errors import internal
from .methods import Taken, answer
from .precision import accumulate_dtype, cast
from .whole import loop_grads, vmap_grads


@checks.keeps_buffers
def per_sample_grad_dots(
    model: nn.Module,
    inputs: Any,
    targets: Any,
    loss_fn: Callable[[Any, Any], Tensor],
    *,
    other: tuple[Any, Any] | None = None,
    params: Iterable[str | Tensor] | None = None,
    method: str = "auto",
    check: str | int | None = None,
) -> Tensor:
    """Inner products ``<g_i, g'_j>`` of the per-sample gradients of one batch with those
    of another (``other``), or with each other (the Gram matrix), without forming them
    where a rule has a cheaper form.

    ``g_i`` is sample ``i``'s gradient of its own loss (as :func:`per_sample_grads`
    gives it) over the parameters ``params``; the result equals
    ``per_sample_grads(..., flat=True) @ per_sample_grads(other..., flat=True).T``.

    Args:
        model, inputs, targets, loss_fn: as for
            :func:`persample.per_sample_grads` (``B`` samples).
        other: ``(inputs', targets')`` of a second batch of ``B'`` samples for the same
            model and ``loss_fn``; default ``None``, the batch with itself.
        params: the parameters whose gradients are multiplied, as names or the
            parameters themselves (default: every trainable one).
        method: ``"rules"``, ``"vmap"``, ``"loop"`` or ``"auto"`` (the rules, and where
            they cannot split the model, with a warning, ``torch.func``, then the loop),
            as for :func:`persample.per_sample_grads`.
        check: when the result ``D`` is certified (:mod:`persample.certificate`: for
            Gaussian ``u``, ``v``, ``u^T D v`` is the inner product of the gradients of
            ``sum_i u_i L_i`` and ``sum_j v_j L'_j``, one more forward of each batch and
            two backwards): ``"first"``, ``"always"``, ``"never"`` or ``N``, as for
            :func:`persample.per_sample_grads`.

    Returns:
        ``(B, B')`` (``(B, B)`` without ``other``): loss units squared per parameter
        unit squared, in the parameters' dtype, at least float32 (accumulated there).

    Warns:
        UserWarning: an empty batch on either side (the result is then empty).
        RuntimeWarning: a sample whose gradient is not finite (NaN or Inf), naming it.

    Raises:
        TypeError, ValueError, NeedsWholeModel, UnsupportedModuleError: as
            :func:`persample.per_sample_grads`, for either batch; ``ValueError`` for an
            ``other`` that is not an ``(inputs, targets)`` pair; ``TypeError`` for a
            complex parameter among those chosen (named).
        InternalError, CertificateError: as :func:`persample.per_sample_grads`.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> import persample
        >>> net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
        >>> x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
        >>> x2, y2 = torch.randn(5, 4), torch.randint(0, 3, (5,))
        >>> dots = persample.per_sample_grad_dots(net, x, y, nn.CrossEntropyLoss(),
        ...                                       other=(x2, y2))
        >>> g = persample.per_sample_grads(net, x, y, nn.CrossEntropyLoss(), flat=True)
        >>> g2 = persample.per_sample_grads(net, x2, y2, nn.CrossEntropyLoss(), flat=True)
        >>> dots.shape, torch.allclose(dots, g @ g2.T, rtol=1e-4, atol=1e-6)
        (torch.Size([16, 5]), True)

    Source: Pruthi et al. 2020 (TracIn); Goodfellow 2015 and Li et al. 2022 (per-sample
    gradients of linear layers from activations and backprops, whose inner products
    need neither gradient); Wang et al. 2024 (In-run Data Shapley's "ghost" dot
    products).
    """
    batch, n, chosen = checks.validate_call(model, inputs, targets, loss_fn, method,
                                           None, params)
    checks.real_parameters(chosen, "per_sample_grad_dots")
    if other is not None:
        if not (isinstance(other, tuple) and len(other) == 2):
            raise ValueError("other must be a pair (inputs, targets) of a second batch, got "
                             f"{type(other).__name__}")
        batch2, _, _ = checks.validate_call(model, other[0], other[1], loss_fn, method,
                                           None, params)
        targets2 = other[1]
    else:
        batch2, targets2 = None, None
    check_option(check)
    m = n if batch2 is None else batch2.n
    checks.warn_empty("per_sample_grad_dots", n * m)
    if n * m == 0:  # (an empty batch on either side: nothing to multiply)
        return torch.zeros(n, m, dtype=accumulate_dtype(*(p.dtype for p in chosen.values())),
                           device=next(iter(chosen.values())).device)
    side = (batch, targets)
    second = None if batch2 is None else (batch2, targets2)
    checker = Checker(check, model, signature("dots", model, batch, targets, chosen.values(),
                                              None if batch2 is None else signature(
                                                  "", model, batch2, targets2, ())))
    kept: list[Tensor] = []

    def certify(how: str, draws: Any) -> Any:
        dots = kept.pop()
        return checker(how, lambda: certify_dots(model, side, second, loss_fn, chosen, dots,
                                                 draws, how))
    certify.rejected = checker.rejected

    def keep(dots: Tensor) -> Tensor:
        kept.append(dots)
        return dots

    dots = answer(
        method,
        rules=lambda: keep(_rules_dots(model, side, second, loss_fn, chosen)),
        vmap=lambda: keep(_materialised_dots(
            lambda b, t: vmap_grads(model, b, t, loss_fn, chosen), side, second)),
        loop=lambda: keep(_materialised_dots(
            lambda b, t: {k: g for k, g in loop_grads(model, b, t, loss_fn).items()
                          if k in chosen}, side, second)),
        taken=Taken(), hint=lambda: checks.dtype_note(batch, chosen), certify=certify)
    _warn_non_finite(dots, other is None)
    return dots


def _warn_non_finite(dots: Tensor, itself: bool) -> None:
    """Name the samples whose gradient is not finite: on the diagonal of a batch with
    itself (``||g_i||^2``), else a row (a sample of the batch) or a column (of
    ``other``) not finite anywhere."""
    if itself:
        checks.warn_non_finite("per_sample_grad_dots", dots.diagonal(), "result")
        return
    nan = torch.tensor(float("nan"), dtype=dots.dtype, device=dots.device)
    for values, side in ((dots, ""), (dots.T, " (other)")):
        whole = torch.where(values.isfinite().any(1), torch.zeros_like(nan), nan)
        checks.warn_non_finite(f"per_sample_grad_dots{side}", whole, "result")


def _materialised_dots(grads_of: Callable[[Any, Any], dict[str, Tensor]],
                       side: tuple, second: tuple | None) -> Tensor:
    """``G @ G'^T``, ``(B, B')``, from the per-sample gradients of a whole-model method
    (``grads_of(inputs, targets)``: ``{name: (B, *shape)}``), summed over parameters."""
    a = grads_of(*side)
    b = a if second is None else grads_of(*second)
    total = None
    for name, g in a.items():
        dtype = accumulate_dtype(g.dtype)
        term = (cast(g.unsqueeze(-1).flatten(1), dtype)  # (B, numel): a 0-dim one's (B, 1)
                @ cast(b[name].unsqueeze(-1).flatten(1), dtype).T)  # (B, B')
        total = term if total is None else total + term
    return total


def _rules_dots(model: nn.Module, side: tuple, second: tuple | None, loss_fn: Callable,
                params: dict[str, nn.Parameter]) -> Tensor:
    """``(B, B')`` by the rules: each batch captured once; a parameter from the cross
    products of its factors where :func:`_factors_cheaper`, else from its per-sample
    gradients formed a few parameters at a time."""
    a = FactoredBatch(model, *side, loss_fn, params)
    b = a if second is None else FactoredBatch(model, *second, loss_fn, params)
    dtype = accumulate_dtype(*(p.dtype for p in params.values()))
    total = torch.zeros(a.n, b.n, dtype=dtype, device=next(iter(params.values())).device)
    rest = []
    with torch.no_grad(), internal("the factor rules"):
        for p in params.values():
            fa, fb = a.factors.get(id(p)), b.factors.get(id(p))
            if fa and fb and _factors_cheaper(fa, fb, a.n, b.n, p):
                for u in fa:  # every use against every use: tied weights' cross terms
                    for v in fb:
                        total += cross_inner(u, v).to(dtype)  # (B, B')
            else:
                rest.append(p)
    for group in parameter_groups(rest, a.n + (0 if b is a else b.n)):
        ga = a.grads(group)  # {id(p): (B, numel)}
        gb = ga if b is a else b.grads(group)  # {id(p): (B', numel)}
        for pid, g in ga.items():
            total += (g @ gb[pid].T).to(dtype)
    return total


def _factors_cheaper(fa: list[Factors], fb: list[Factors], n: int, m: int,
                     p: nn.Parameter) -> bool:
    """Whether the factors' cross products (:func:`cross_inner`, every use of ``fa``
    against every use of ``fb``) take fewer multiply-adds than forming both sides'
    ``n`` and ``m`` gradients and multiplying them."""
    rows, cols = matrix_shape(p)
    by_factors = n * m * sum(u.cost(v) for u in fa for v in fb)  # cross_inner's
    by_forming = n * forming_cost(fa, rows) + m * forming_cost(fb, rows) + n * m * rows * cols
    return by_factors < by_forming
