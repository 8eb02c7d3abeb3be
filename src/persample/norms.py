"""Per-sample gradient norms without materialising the gradients
(:func:`per_sample_grad_norms`): the engine's norm rules
(:mod:`persample.engine.norms`) on one captured forward and backward, else the
whole-model methods, each answer certified.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor, nn

from . import checks
from .certificate import (
    Checker,
    certify_grads,
    check_option,
    norms_disagree,
    signature,
    summed_rows,
)
from .engine import loss_backprops
from .engine.norms import per_sample_rows, squared_norms, sum_of_squares, weighted_sums
from .errors import InternalError, internal, internal_errors_raised
from .inputs import samples_of
from .methods import Taken, answer, leave_rules
from .precision import accumulate_dtype
from .whole import loop_grads, vmap_grads


def _rules_norms(model, batch, targets, loss_fn, params, kept: dict) -> dict[str, Tensor]:
    """``{name: (n,)}`` by the rules; ``kept`` gets what their certificate reads (the
    capture, the squared norms, the per-sample gradients materialised)."""
    captured = loss_backprops(model, batch, targets, loss_fn, {id(p): p for p in params.values()})
    with internal("the norm rules"):
        sq, mats, ghosted, by_module = squared_norms(captured, params)
    kept.update(captured=captured, squared=sq, materialised=mats, ghosted=ghosted,
                by_module=by_module, losses=captured.losses)
    return {name: sq[id(p)].sqrt() for name, p in params.items()}


def _norms_of(grads: dict[str, Tensor]) -> dict[str, Tensor]:
    """``{name: (B,)}`` the norms of per-sample gradients ``{name: (B, *shape)}`` (a 0-dim
    parameter's ``(B,)`` too)."""
    return {name: sum_of_squares(g.unsqueeze(-1).flatten(1)).sqrt() for name, g in grads.items()}


@checks.keeps_buffers
def per_sample_grad_norms(
    model: nn.Module,
    inputs: Any,
    targets: Any,
    loss_fn: Callable[[Any, Any], Tensor],
    *,
    method: str = "auto",
    per_layer: bool = False,
    chunk_size: int | None = None,
    params: Iterable[str | Tensor] | None = None,
    check: str | int | None = None,
) -> Tensor | tuple[Tensor, dict[str, Tensor]]:
    """L2 norm of each sample's gradient over all trainable parameters.

    Equal to ``per_sample_grads(..., flat=True).norm(dim=1)`` but, with the rules,
    without the ``(B, P)`` tensor: Linear layers (and Embedding with short
    sequences) use the "ghost norm" of their activations and backprops; other
    layers materialise their per-sample gradients one layer at a time.

    Args:
        model, inputs, targets, loss_fn: as for
            :func:`persample.per_sample_grads`.
        method: ``"rules"`` (one forward, one backward, norm rules); ``"vmap"`` or
            ``"loop"``: the norms of those methods' per-sample gradients; ``"auto"``:
            the rules, and where they cannot split the model by sample (or persample's
            own code fails on it), with a warning, ``"vmap"``, then ``"loop"``.
        per_layer: also return the norm of each parameter's per-sample gradient.
        chunk_size: process at most this many samples at a time.
        params: the parameters whose gradient the norms are of, as names or the
            parameters themselves (default: every trainable one); the rest of the model
            is left untouched and costs no per-sample work.
        check: when the norms are certified (:mod:`persample.certificate`): the per-sample
            gradients behind them, formed a few parameters at a time, against the
            gradient of ``sum_i u_i L_i`` (Gaussian ``u``), and the norms against those
            gradients' norms; ``"first"``, ``"always"``, ``"never"`` or ``N``, as for
            :func:`persample.per_sample_grads`.

    Returns:
        ``(B,)`` norms (loss units per parameter unit) in the parameters' dtype, at
        least float32 (accumulated there for bfloat16 and float16 parameters); with
        ``per_layer=True`` a tuple ``((B,), {name: (B,)})``.

    Warns:
        UserWarning: an empty batch (0 samples).
        RuntimeWarning: a sample whose gradient norm holds a NaN or an Inf, naming it (its
            results are not finite either).

    Raises:
        TypeError, ValueError, NeedsWholeModel, UnsupportedModuleError: as
            :func:`persample.per_sample_grads`.
        InternalError, CertificateError: as :func:`persample.per_sample_grads`.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> import persample
        >>> net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
        >>> x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
        >>> norms = persample.per_sample_grad_norms(net, x, y, nn.CrossEntropyLoss())
        >>> g = persample.per_sample_grads(net, x, y, nn.CrossEntropyLoss(), flat=True)
        >>> torch.allclose(norms, g.norm(dim=1), atol=1e-6)
        True
    """
    check_option(check)
    batch, n, params = checks.validate_call(model, inputs, targets, loss_fn, method,
                                           chunk_size, params)
    checks.warn_empty("per_sample_grad_norms", n)
    layers = {name: p.new_zeros(n, dtype=accumulate_dtype(p.dtype)) for name, p in params.items()}
    step, taken = chunk_size or max(n, 1), Taken()
    device = next(iter(params.values())).device
    for start in range(0, n, step):
        a, t = batch.samples(start, start + step), samples_of(targets, start, start + step)
        kept: dict = {}
        chunk = answer(
            method,
            rules=lambda a=a, t=t, kept=kept: _rules_norms(model, a, t, loss_fn, params, kept),
            vmap=lambda a=a, t=t, kept=kept: _norms_of(kept.setdefault(
                "grads", vmap_grads(model, a, t, loss_fn, params,
                                    _losses_in(kept, a.n, device)))),
            loop=lambda a=a, t=t, kept=kept: _norms_of(kept.setdefault("grads", {
                name: g for name, g in loop_grads(model, a, t, loss_fn, _losses_in(
                    kept, a.n, device)).items() if name in params})),
            taken=taken, hint=lambda: checks.dtype_note(batch, params),
            certify=_norms_checker(model, a, t, loss_fn, params, kept, check))
        for name, norms in chunk.items():
            layers[name][start : start + step] = norms
    total = torch.stack(list(layers.values())).square().sum(0).sqrt()  # (B,)
    checks.warn_non_finite("per_sample_grad_norms", total, "result")
    return (total, layers) if per_layer else total


def _losses_in(kept: dict, n: int, device: torch.device) -> Tensor:
    """A ``(n,)`` buffer in ``kept`` for a method's per-sample losses (its certificate's),
    on the parameters' device (no copy to the host on a GPU's hot path)."""
    kept["losses"] = torch.empty(n, dtype=torch.float64, device=device)
    return kept["losses"]


def _norms_checker(model, batch, targets, loss_fn, params, kept: dict, check: Any
                   ) -> Callable:
    """``certify(how, draws)`` of one batch's norms (see :func:`persample.methods.answer`):
    the rows behind them and the norms against the rows'."""
    checker = Checker(check, model, signature("norms", model, batch, targets,
                                              params.values()))

    def run(how: str, draws: Any) -> Any:
        if how != "rules":  # the norms are those of these rows
            summed = summed_rows(kept.pop("grads").__getitem__, params)
            return certify_grads(model, batch, targets, loss_fn, params, summed, draws, how,
                                 "per-sample gradient norms", losses=kept.get("losses"))
        captured, mats = kept["captured"], kept["materialised"]

        def summed(u: Tensor) -> dict[str, Tensor]:
            try:
                with internal("the norms' weighted sums"):
                    return weighted_sums(captured, params, mats, kept["ghosted"], u)
            except InternalError as err:  # a weighted-sum rule: each op's own backward
                if internal_errors_raised():
                    raise
                leave_rules(Taken(), err)
                return weighted_sums(captured, params, mats, kept["ghosted"], u,
                                     sum_rules=False)
        # the norms not from factors the identity checks: those of module norm rules
        ruled = {id(p) for _, _, _, normed in kept["by_module"] for p in normed.values()}
        squared = {name: kept["squared"][id(p)] for name, p in params.items()
                   if id(p) in ruled}
        rows = per_sample_rows(captured, params, mats)
        return certify_grads(model, batch, targets, loss_fn, params, summed, draws, how,
                             "per-sample gradient norms",
                             lambda: norms_disagree(squared, rows), kept.get("losses"),
                             read=captured.values_read())

    def certify(how: str, draws: Any) -> Any:
        try:
            return checker(how, lambda: run(how, draws))
        finally:
            kept.clear()
    certify.rejected = checker.rejected
    return certify
