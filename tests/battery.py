"""The one check against the loop, and the constants and comparisons the tests share.

:func:`check` runs every public function of persample on a model, a batch and a loss,
and compares each with "the loop" (one ``autograd.grad`` per sample, in float64):

- ``per_sample_grads`` for each of ``methods``, against ``loop_per_sample_grads``;
- ``per_sample_grad_norms`` for each of ``methods``: the total norms, the norms per
  parameter (``per_layer=True``), the total equal to the root of the summed squares of
  the per-parameter norms, and the call without ``per_layer`` equal to the one with;
- ``persample.dp.private_grad`` without noise (it takes ``method="auto"``), clipping at
  the median of the loop's norms so that some samples are clipped and some are not,
  against the clipped mean by hand (:func:`clipped_mean`): its ``p.grad`` and the
  norms it returns;
- with ``jacobian=True``, ``param_jacobian`` for each of ``methods`` against
  ``loop_param_jacobian``;
- ``persample.supported`` with the loss and without it (the sum of the outputs): both
  give each trainable parameter one path, the same, and ``paths`` says which;
- no warning matching ``forbid`` in any of those calls (by default: that ``auto`` left
  the rules, or that torch.func batched an op by its slow per-sample fallback);
- every sample's gradient not zero (``nonzero``), else the clipping proves little;
- the model left exactly as it was (:class:`conftest.ModelState`).

Each comparison: the same names in the same order, the same shape and dtype, the
largest error at most ``1e-8`` times the reference's largest entry or below ``1e-12``
(:func:`assert_exact`), and with ``elementwise=True`` also every entry within
:data:`TOL` (:func:`assert_grads_equal`).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

import persample
from conftest import ModelState
from persample import (
    loop_param_jacobian,
    loop_per_sample_grads,
    param_jacobian,
    per_sample_grad_norms,
    per_sample_grads,
)
from persample.reference import forward_per_sample_grads

# every method of the public functions; the loop is the reference the others match
METHODS = ["rules", "vmap", "auto", "loop"]
# how a scalar loss reduces over the batch (each sample's own loss is evaluated on its
# slice, so the reduction changes only what the per-sample loss is)
REDUCTIONS = ["mean", "sum"]
# float64 against the loop, entry by entry
TOL = {"rtol": 1e-10, "atol": 1e-12}

# warnings that fail a check (regular expressions, searched in the message)
LEAVING = "Falling back|rules cannot"  # auto left the rules
SLOWER = LEAVING + "|performance"  # ... or torch.func batched an op by its slow fallback
ANY = ""  # every warning


# ---------------------------------------------------------------------------
# comparisons


def rows(g: Tensor) -> Tensor:
    """``(B, ...)`` -> ``(B, numel per sample)``: also for a scalar parameter's ``(B,)``
    and for an empty batch."""
    return g.reshape(g.shape[0], math.prod(g.shape[1:]))


def flat(grads: Mapping[str, Tensor]) -> Tensor:
    """``{name: (B, ...)}`` -> ``(B, P)``, the columns in the dict's order."""
    return torch.cat([rows(g) for g in grads.values()], 1)


def norms_of(grads: Mapping[str, Tensor]) -> Tensor:
    """``(B,)``: the norm of each sample's gradient over all of ``grads``."""
    return flat(grads).norm(dim=1)


def layer_norms(grads: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """``{name: (B,)}``: the norm of each parameter's per-sample gradient."""
    return {name: rows(g).norm(dim=1) for name, g in grads.items()}


def assert_grads_equal(
    got: dict[str, Tensor], want: dict[str, Tensor], rtol: float = 1e-10, atol: float = 1e-12,
    **options: Any,
) -> None:
    """Same names in the same order, and every tensor close in value, dtype and shape
    (``options`` go to ``torch.testing.assert_close``: ``equal_nan``...)."""
    assert list(got) == list(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=rtol, atol=atol, **options,
                                   msg=lambda m, name=name: f"{name}: {m}")


def assert_exact(got: dict[str, Tensor], want: dict[str, Tensor], rel: float = 1e-8,
                 abs_: float = 1e-12) -> None:
    """Same names in the same order; per parameter, the largest error at most ``rel``
    times the reference's largest entry, or below ``abs_`` (exact)."""
    assert list(got) == list(want)
    for name, w in want.items():
        err = (got[name] - w).abs().max().item() if w.numel() else 0.0
        scale = w.abs().max().item() if w.numel() else 0.0
        assert err <= abs_ or err <= rel * scale, f"{name}: error {err:.3e}, scale {scale:.3e}"


def assert_matches(got: dict[str, Tensor], want: dict[str, Tensor], what: str,
                   elementwise: bool = True) -> None:
    """The battery's comparison (see the module's docstring); ``what`` names the call."""
    assert list(got) == list(want), f"{what}: names {list(got)}, loop {list(want)}"
    got = {k: g.to_dense() if g.is_sparse else g for k, g in got.items()}
    for name, w in want.items():
        g = got[name]
        assert g.shape == w.shape, f"{what} {name}: shape {tuple(g.shape)}, loop {tuple(w.shape)}"
        assert g.dtype == w.dtype, f"{what} {name}: dtype {g.dtype}, loop {w.dtype}"
    try:
        assert_exact(got, want)
        if elementwise:
            assert_grads_equal(got, want, **TOL)
    except AssertionError as err:
        raise AssertionError(f"{what}: {err}") from None


# ---------------------------------------------------------------------------
# DP-SGD's step without noise


def clipped_mean(grads: dict[str, Tensor], max_grad_norm: float,
                 divisor: float | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """DP-SGD's step without noise, by hand from per-sample gradients ``{name: (B,
    ...)}``: their total norms ``(B,)`` and ``sum_i c_i g_i / B`` per parameter (or over
    ``divisor``), with ``c_i = min(1, C / (|g_i| + 1e-6))`` as ``private_grad`` clips."""
    norms = norms_of(grads)
    factors = (max_grad_norm / (norms + 1e-6)).clamp(max=1.0)
    divisor = len(norms) if divisor is None else divisor
    return norms, {k: torch.tensordot(factors, g, dims=1) / divisor for k, g in grads.items()}


def clipped_sum_by_hand(grads: dict[str, Tensor], max_grad_norm: Any, *,
                        per_layer: bool = False, param_groups: list | None = None,
                        gamma: float = 0.01, divisor: float = 1.0) -> dict[str, Tensor]:
    """DP-SGD's clipped sum without noise, by hand from per-sample gradients ``{name: (B,
    ...)}``, for every clipping kind: flat (``max_grad_norm=C``), per layer (each
    parameter to ``C / sqrt(K)``), by groups (a list of ``C_g`` and ``param_groups``) and
    automatic (``"automatic"``: ``b / (|g| + gamma)`` with ``b = 1``, ``1 / sqrt(K)`` per
    layer, ``1 / sqrt(m)`` per group); over ``divisor``."""
    names = list(grads)
    groups = param_groups or ([[n] for n in names] if per_layer else [names])
    m = len(groups)
    auto = max_grad_norm == "automatic"
    if auto:
        bounds = [1.0 / math.sqrt(m)] * m
    elif isinstance(max_grad_norm, (list, tuple)):
        bounds = list(max_grad_norm)
    else:
        bounds = [max_grad_norm / math.sqrt(m)] * m
    factors = {}
    for group, bound in zip(groups, bounds):
        norm = sum(rows(grads[n]).pow(2).sum(1) for n in group).sqrt()  # (B,)
        f = bound / (norm + gamma) if auto else (bound / (norm + 1e-6)).clamp(max=1.0)
        factors.update(dict.fromkeys(group, f))
    return {n: torch.tensordot(factors[n], g, dims=1) / divisor for n, g in grads.items()}


def dp_grads(model: nn.Module, inputs: Any, targets: Any, loss_fn: Callable,
             max_grad_norm: float, **options: Any) -> tuple[Tensor, dict[str, Tensor]]:
    """``private_grad`` without noise (``options`` passed on): its norms ``(B,)`` and the
    ``p.grad`` it wrote (``{name: tensor}`` over the trainable parameters); every
    ``p.grad`` is None during the call and as it was afterwards."""
    from persample.dp import private_grad

    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    before = {n: p.grad for n, p in params.items()}
    try:
        for p in params.values():
            p.grad = None
        _, norms = private_grad(model, inputs, targets, loss_fn, max_grad_norm=max_grad_norm,
                                noise_multiplier=0.0, **options)
        return norms, {n: p.grad.clone() for n, p in params.items()}
    finally:
        for n, p in params.items():
            p.grad = before[n]


# ---------------------------------------------------------------------------
# the paths supported() reports


def param_paths(model: nn.Module, inputs: Any, targets: Any = None,
                loss_fn: Callable | None = None) -> dict[str, set[str]]:
    """``{parameter: {paths}}`` as ``supported`` reports the call (one path each, unless
    two routes name the same parameter)."""
    got: dict[str, set[str]] = {}
    for r in persample.supported(model, inputs, targets, loss_fn):
        for p in r.params:
            got.setdefault(f"{r.module}.{p}" if r.module else p, set()).add(r.path)
    return got


def module_paths(model: nn.Module, by_module: Mapping[str, str]) -> dict[str, str]:
    """``{parameter: path}`` from ``{module: path}``: each trainable parameter takes the
    path of the module holding it ("" for the root), which must be named."""
    out = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            owner = name.rpartition(".")[0]
            assert owner in by_module, f"{name}: its module {owner!r} has no expected path"
            out[name] = by_module[owner]
    return out


def _check_paths(model: nn.Module, inputs: Any, targets: Any, loss_fn: Callable,
                 paths: set[str] | Mapping[str, str] | None, paths_within: set[str] | None,
                 ) -> None:
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    with_loss = param_paths(model, inputs, targets, loss_fn)
    alone = param_paths(model, inputs)
    table = sorted((n, sorted(s)) for n, s in with_loss.items())
    assert set(with_loss) == trainable, f"supported covers {table}, trainable {sorted(trainable)}"
    assert all(len(s) == 1 for s in with_loss.values()), table
    assert alone == with_loss, f"without the loss: {sorted(alone.items())}; with it: {table}"
    taken = set().union(*with_loss.values()) if with_loss else set()
    if isinstance(paths, Mapping):
        assert {n: s for n, s in with_loss.items()} == {n: {p} for n, p in paths.items()}, table
    elif paths is not None:
        assert taken == set(paths), table
    if paths_within is not None:
        assert taken <= set(paths_within), table


# ---------------------------------------------------------------------------
# the battery


def check(model: nn.Module, inputs: Any, targets: Any, loss_fn: Callable, *,
          want: dict[str, Tensor] | None = None,
          methods: Iterable[str] = ("rules", "auto"),
          paths: set[str] | Mapping[str, str] | None = frozenset({"rule"}),
          paths_within: set[str] | None = None,
          jacobian: bool = False,
          dp: bool = True,
          forbid: str | None = SLOWER,
          elementwise: bool = True,
          nonzero: bool = True,
          seed: int | None = None) -> dict[str, Tensor]:
    """Every public function on ``model`` against the loop (see the module's docstring);
    returns the loop's per-sample gradients.

    Args:
        want: the reference per-sample gradients where ``loop_per_sample_grads`` cannot
            run (a reentrant checkpoint refuses ``autograd.grad``).
        methods: the methods each function is called with.
        paths: the path ``supported`` reports: a set (the paths over all trainable
            parameters), ``{parameter: path}`` (each parameter's; see
            :func:`module_paths`), or None (not checked).
        paths_within: the paths any parameter may take (checked beside ``paths``).
        jacobian: also ``param_jacobian`` (a model returning one tensor, batch in dim 0).
        dp: also ``private_grad`` (which takes ``method="auto"`` whatever ``methods``).
        forbid: a warning whose message matches fails the check (None: none does).
        elementwise: every entry within :data:`TOL` too, beside the largest error
            relative to the largest entry.
        nonzero: every sample's gradient is not zero.
        seed: for a model that draws random numbers (dropout in training mode): the
            reference is the forward that ran (:func:`persample.reference.
            forward_per_sample_grads`, one batch forward under ``torch.manual_seed(
            seed)``), and every call runs under that seed too.
    """
    state = ModelState(model)
    reseed = (lambda: None) if seed is None else (lambda: torch.manual_seed(seed))
    if want is None:
        reseed()
        want = (loop_per_sample_grads(model, inputs, targets, loss_fn) if seed is None
                else forward_per_sample_grads(model, inputs, targets, loss_fn))
    n = len(next(iter(want.values()))) if want else 0
    want_norms = norms_of(want)
    if nonzero:
        assert n and bool((want_norms > 0).all()), f"the loop's norms {want_norms}"
    reseed()
    want_jacobian = None if not jacobian else (
        loop_param_jacobian(model, inputs) if seed is None else forward_param_jacobian(
            model, inputs))

    def same(got: dict[str, Tensor], ref: dict[str, Tensor], what: str) -> None:
        assert_matches(got, ref, what, elementwise)

    with warnings.catch_warnings():
        if forbid is not None:
            warnings.filterwarnings("error", message=f".*({forbid})" if forbid else "")
        for method in methods:
            reseed()
            got = per_sample_grads(model, inputs, targets, loss_fn, method=method)
            assert isinstance(got, dict), f"per_sample_grads({method}): {type(got)}"
            same(got, want, f"per_sample_grads({method})")
            reseed()
            both = per_sample_grad_norms(model, inputs, targets, loss_fn, method=method,
                                         per_layer=True)
            assert isinstance(both, tuple) and len(both) == 2, type(both)
            total, layers = both
            assert isinstance(total, Tensor) and isinstance(layers, dict)
            same({"total": total}, {"total": want_norms}, f"per_sample_grad_norms({method})")
            same(layers, layer_norms(want), f"per_sample_grad_norms({method}, per_layer)")
            if layers:
                torch.testing.assert_close(
                    total, torch.stack(list(layers.values())).square().sum(0).sqrt(),
                    rtol=1e-13, atol=1e-14)
            reseed()
            alone = per_sample_grad_norms(model, inputs, targets, loss_fn, method=method)
            torch.testing.assert_close(alone, total, rtol=1e-13, atol=1e-14)
            if jacobian:
                reseed()
                same(param_jacobian(model, inputs, method=method), want_jacobian,
                     f"param_jacobian({method})")
        if dp:
            c = want_norms.median().item() if n and want_norms.max() > 0 else 1.0
            reseed()
            norms, summed = dp_grads(model, inputs, targets, loss_fn, c,
                                     expected_batch_size=None if n else 1.0)
            same({"norms": norms}, {"norms": want_norms}, "private_grad's norms")
            same(summed, clipped_mean(want, c, max(n, 1))[1], "private_grad")
    if n and (paths is not None or paths_within is not None):
        _check_paths(model, inputs, targets, loss_fn, paths, paths_within)
    state.assert_unchanged()
    return want


def forward_param_jacobian(model: nn.Module, inputs: Tensor) -> dict[str, Tensor]:
    """The per-sample parameter Jacobian ``{name: (B, *out, *param.shape)}`` of the
    forward that ran: one batch forward (under the caller's seed), one ``autograd.grad``
    per sample and output entry."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    out = model(inputs)  # (B, *out)
    rows = []
    for i in range(out.shape[0]):
        entries = out[i].reshape(-1)
        per = [torch.autograd.grad(e, list(params.values()), retain_graph=True,
                                   allow_unused=True) for e in entries]
        rows.append({name: torch.stack([torch.zeros_like(p) if g[j] is None else g[j]
                                        for g in per]).view(*out.shape[1:], *p.shape)
                     for j, (name, p) in enumerate(params.items())})
    return {name: torch.stack([r[name] for r in rows]) for name in params}
