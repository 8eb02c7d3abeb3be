"""Influence functions from persample's curvature: EK-FAC, K-FAC, the diagonal, or none.

The influence of training sample ``t`` on query ``q`` (Koh & Liang 2017; Grosse et al.
2023, "Studying Large Language Model Generalization with Influence Functions") is
``g_q^T (F + lambda I)^{-1} g_t``, with ``g`` each sample's own loss gradient and
``F`` a curvature of the training loss. Inverting ``F`` is what the curvature's
structure is for:

- ``"ekfac"``: each parameter's K-FAC eigenbasis ``Q_rows (x) Q_cols`` (:class:`KFAC`'s
  factors, decomposed) with the eigenvalues corrected to the per-sample curvature's
  own in that basis, ``mean_n (Q_rows^T G_n Q_cols)^2`` (George et al. 2018, EK-FAC);
- ``"kfac"``: the same basis with K-FAC's eigenvalues, ``lambda_rows lambda_cols^T``;
- ``"diagonal"``: the exact diagonal of the curvature;
- ``"identity"``: none (TracIn's inner products at one checkpoint, Pruthi et al. 2020).

Parameters with K-FAC factors use the first two; the rest (normalisation layers,
convolutions, tied weights, recurrent weights) their exact diagonal. The damping
``lambda`` defaults to a tenth of each block's mean eigenvalue (kronfluence's
heuristic).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from . import checks
from .api import grads_taken
from .curvature import KFAC, KroneckerFactors
from .engine import Captured, write_per_sample
from .engine.factored_batch import matrix_shape
from .errors import internal
from .inputs import as_batch, samples_of
from .precision import accumulate_dtype, without_autocast
from .projection import GradientProjector

CURVATURES = ("ekfac", "kfac", "diagonal", "identity")


@dataclass
class Eigenbasis:
    """One parameter's Kronecker eigenbasis, the parameter seen as a matrix ``(r, c)``.

    Attributes:
        rows: ``(r, r)`` orthonormal, or ``None`` for the identity (a lookup's diagonal
            side, whose eigenvectors are the ids).
        cols: ``(c, c)`` orthonormal.
        values: ``(r, c)`` the curvature's eigenvalues in this basis.
    """

    rows: Tensor | None
    cols: Tensor
    values: Tensor

    def rotate(self, m: Tensor) -> Tensor:
        """``Q_rows^T m Q_cols`` for ``m (..., r, c)``."""
        m = m @ self.cols
        return m if self.rows is None else self.rows.T @ m

    def back(self, m: Tensor) -> Tensor:
        """``Q_rows m Q_cols^T`` for ``m (..., r, c)``."""
        m = m @ self.cols.T
        return m if self.rows is None else self.rows @ m


def kfac_eigenbasis(f: KroneckerFactors) -> Eigenbasis:
    """The eigenbasis and eigenvalues (``lambda_rows lambda_cols^T``) of one use's K-FAC
    factors ``A (x) G``.

    Examples:
        >>> f = KroneckerFactors(torch.eye(3) * 2, torch.eye(2) * 5, rows="G")
        >>> kfac_eigenbasis(f).values
        tensor([[10., 10., 10.],
                [10., 10., 10.]])
    """
    row_side, col_side = (f.G, f.A) if f.rows == "G" else (f.A, f.G)
    if row_side.dim() == 1:  # a lookup's diagonal side
        row_values, row_vectors = row_side, None
    else:
        row_values, row_vectors = _eigh(row_side)
    col_values, col_vectors = _eigh(col_side)
    return Eigenbasis(row_vectors, col_vectors,
                      row_values.clamp(min=0)[:, None] * col_values.clamp(min=0)[None, :])


def _eigh(m: Tensor) -> tuple[Tensor, Tensor]:
    """``torch.linalg.eigh`` in float64 (a float32 basis loses the small directions the
    damping keeps), the results in ``m``'s dtype."""
    values, vectors = torch.linalg.eigh(m.double())
    return values.to(m.dtype), vectors.to(m.dtype)


class EKFAC:
    """EK-FAC (George et al. 2018): the K-FAC eigenbases of a fitted :class:`KFAC` (one
    use per parameter: ``shared="diagonal"``), and the eigenvalues corrected by a second
    pass over the data: ``mean over samples (and cotangent columns) of (Q_rows^T G_nv
    Q_cols)^2``, from each sample's gradient in its own basis (formed a parameter at a
    time, never all at once).

    Args:
        kfac: the fitted K-FAC (its model, Fisher and parameters are reused).

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> from persample import KFAC
        >>> from persample.influence import EKFAC
        >>> net = nn.Linear(4, 3)
        >>> x, y = torch.randn(20, 4), torch.randint(0, 3, (20,))
        >>> kfac = KFAC(net, shared="diagonal")
        >>> kfac.update(x, y, nn.CrossEntropyLoss())
        >>> ekfac = EKFAC(kfac)
        >>> ekfac.update(x, y, nn.CrossEntropyLoss())
        >>> ekfac.bases["weight"].values.shape
        torch.Size([3, 4])

    Source: George, Laurent, Bouthillier, Ballas & Vincent 2018, "Fast Approximate
    Natural Gradient Descent in a Kronecker-factored Eigenbasis"; Grosse et al. 2023.
    """

    def __init__(self, kfac: KFAC):
        if any(len(uses) > 1 for uses in kfac.factors.values()):
            raise ValueError("EK-FAC takes one Kronecker product per parameter: fit the "
                             "K-FAC with shared='diagonal'")
        self.kfac = kfac
        self._bases = {name: kfac_eigenbasis(uses[0]) for name, uses in kfac.factors.items()}
        self._sums: dict[str, Tensor] = {}
        self.num_data = 0

    def update(self, inputs: Any, targets: Any, loss_fn: Callable[[Any, Any], Tensor]) -> None:
        """Add one batch's per-sample gradients, in each basis, squared."""
        kfac = self.kfac
        batch, n, _ = checks.validate_call(kfac.model, inputs, targets, loss_fn, "rules",
                                           None)
        if n == 0:
            return
        params = {name: kfac.params[name] for name in self._bases}
        captured = kfac.capture(batch, targets, loss_fn, params)
        scale = 1.0 / kfac.mc_samples if kfac.fisher == "mc" else 1.0
        with torch.no_grad(), without_autocast(), internal("the rules"):
            for name, p in params.items():
                columns = _columns(captured, p)  # (n, v, r, c)
                squared = self._bases[name].rotate(columns).square().sum((0, 1)) * scale
                self._sums[name] = squared if name not in self._sums else \
                    self._sums[name] + squared
        self.num_data += n

    @property
    def bases(self) -> dict[str, Eigenbasis]:
        """``{name: Eigenbasis}`` with the corrected eigenvalues (K-FAC's before any
        :meth:`update`)."""
        if not self.num_data:
            return dict(self._bases)
        return {name: Eigenbasis(b.rows, b.cols, self._sums[name] / self.num_data)
                for name, b in self._bases.items()}


def _columns(captured: Captured, p: nn.Parameter) -> Tensor:
    """``(n, v, r, c)``: each sample's gradient for each cotangent, as a matrix."""
    dest = p.new_zeros((captured.n, captured.v, *p.shape), dtype=accumulate_dtype(p.dtype))
    write_per_sample(captured, {id(p): dest})
    return dest.reshape(captured.n, captured.v, *matrix_shape(p))


@dataclass
class Preconditioner:
    """``(F + lambda I)^{-1}`` by blocks: Kronecker eigenbases for some parameters, a
    diagonal for the others, each with its own damping.

    Attributes:
        bases: ``{name: Eigenbasis}``.
        diagonals: ``{name: tensor of the parameter's shape}``.
        damping: ``{name: lambda}``.
    """

    bases: dict[str, Eigenbasis]
    diagonals: dict[str, Tensor]
    damping: dict[str, float]

    def apply(self, grads: dict[str, Tensor]) -> dict[str, Tensor]:
        """``(F + lambda)^{-1} g`` for per-sample gradients ``{name: (q, *shape)}``; a
        parameter the curvature does not cover is left as it is."""
        out = {}
        for name, g in grads.items():
            if name in self.bases:
                b = self.bases[name]
                m = g.reshape(len(g), *b.values.shape)
                out[name] = b.back(b.rotate(m) / (b.values + self.damping[name])).reshape(
                    g.shape)
            elif name in self.diagonals:
                out[name] = g / (self.diagonals[name] + self.damping[name])
            else:
                out[name] = g
        return out


def _damped(values: dict[str, Tensor], damping: float | None) -> dict[str, float]:
    """Each block's damping: the one given, or a tenth of its mean eigenvalue."""
    return {name: float(damping) if damping is not None else 0.1 * float(v.mean())
            for name, v in values.items()}


def fit_preconditioner(model: nn.Module, train: tuple[Any, Any], loss_fn: Callable, *,
                       curvature: str = "ekfac", damping: float | None = None,
                       fisher: str = "type-2", kind: str = "expand", batch_size: int = 64,
                       params: Any = None, generator: torch.Generator | None = None
                       ) -> Preconditioner:
    """Fit the curvature on ``train`` (in batches) and return its damped inverse.

    Args:
        model, loss_fn: as for :func:`persample.per_sample_grads`.
        train: ``(inputs, targets)`` of the training set, the samples in dim 0.
        curvature: ``"ekfac"``, ``"kfac"``, ``"diagonal"`` or ``"identity"``.
        damping: ``lambda >= 0`` for every block, or ``None``: a tenth of each block's
            mean eigenvalue.
        fisher, kind: :class:`~persample.KFAC`'s.
        batch_size: samples per forward, ``>= 1``.
        params: names or parameters (default every trainable one).
        generator: for ``fisher="mc"``.

    Returns:
        The :class:`Preconditioner`.

    Raises:
        ValueError: an unknown ``curvature``, a negative ``damping``, a bad
            ``batch_size``; :class:`~persample.KFAC`'s errors.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> net = nn.Linear(4, 3)
        >>> train = (torch.randn(40, 4), torch.randint(0, 3, (40,)))
        >>> pre = fit_preconditioner(net, train, nn.CrossEntropyLoss(), damping=0.1)
        >>> pre.bases["weight"].values.shape, pre.damping["weight"]
        (torch.Size([3, 4]), 0.1)

    Source: George et al. 2018 (EK-FAC); Grosse et al. 2023 (its use for influence).
    """
    if curvature not in CURVATURES:
        raise ValueError(f"curvature must be one of {CURVATURES}, got {curvature!r}")
    if damping is not None and not damping >= 0:
        raise ValueError(f"damping must be >= 0 or None, got {damping!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    if curvature == "identity":
        return Preconditioner({}, {}, {})
    kfac = KFAC(model, fisher=fisher, kind=kind, params=params, generator=generator,
                shared="diagonal")
    if curvature == "diagonal":
        kfac._add_factors = lambda *args: set()  # every parameter by its exact diagonal
    for inputs, targets in _batches(train, batch_size):
        kfac.update(inputs, targets, loss_fn)
    bases = {}
    if curvature == "kfac":
        bases = {name: kfac_eigenbasis(uses[0]) for name, uses in kfac.factors.items()}
    elif curvature == "ekfac":
        ekfac = EKFAC(kfac)
        for inputs, targets in _batches(train, batch_size):
            ekfac.update(inputs, targets, loss_fn)
        bases = ekfac.bases
    diagonals = kfac.diagonals
    values = {**{n: b.values for n, b in bases.items()}, **diagonals}
    return Preconditioner(bases, diagonals, _damped(values, damping))


def influence(model: nn.Module, train: tuple[Any, Any], query: tuple[Any, Any],
              loss_fn: Callable[[Any, Any], Tensor], *, curvature: str = "ekfac",
              damping: float | None = None, fisher: str = "type-2", kind: str = "expand",
              batch_size: int = 64, params: Any = None,
              preconditioner: Preconditioner | None = None,
              projector: GradientProjector | None = None) -> Tensor:
    """Influence scores ``g_q^T (F + lambda I)^{-1} g_t`` of every training sample on
    every query, the curvature ``F`` fitted on ``train`` (see the module's docstring),
    both sets in batches.

    With a ``projector`` (:class:`persample.GradientProjector`, ``P`` with ``E[P P^T] =
    I``), the preconditioned query gradients are kept projected, ``(n_query, dim)``
    instead of ``(n_query, P)``, and each training batch's gradients are projected from
    its activations and backprops without forming them (LoGra's Kronecker form): the
    scores ``(P^T q)^T (P^T g_t)`` are the exact ones in expectation over ``P``
    (Johnson-Lindenstrauss), at a variance that falls as ``1 / dim``.

    Args:
        model, loss_fn: as for :func:`persample.per_sample_grads`.
        train, query: ``(inputs, targets)`` of each set, the samples in dim 0.
        curvature, damping, fisher, kind, batch_size, params: as for
            :func:`fit_preconditioner`.
        preconditioner: one fitted already (then ``curvature``, ``damping``, ``fisher``
            and ``kind`` are not used).
        projector: project the gradients with it (built for ``model`` over the same
            parameters as ``params``); default ``None``, the exact scores.

    Returns:
        ``(n_query, n_train)`` scores in the parameters' dtype (at least float32): loss
        units squared per curvature unit; positive where the training sample's gradient
        helps the query's loss go down with it.

    Warns:
        RuntimeWarning: a training sample or a query whose loss holds a NaN or an Inf,
            named by its index in ``train`` or ``query``.

    Raises:
        ValueError: as :func:`fit_preconditioner`, and the errors of
            :func:`persample.per_sample_grads`; a ``projector`` of another model or
            other parameters.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> import persample
        >>> net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
        >>> train = (torch.randn(30, 4), torch.randint(0, 3, (30,)))
        >>> query = (torch.randn(5, 4), torch.randint(0, 3, (5,)))
        >>> persample.influence(net, train, query, nn.CrossEntropyLoss()).shape
        torch.Size([5, 30])
        >>> proj = persample.GradientProjector(net, 16, seed=0)
        >>> persample.influence(net, train, query, nn.CrossEntropyLoss(), projector=proj).shape
        torch.Size([5, 30])

    Source: Koh & Liang 2017 (influence functions); George et al. 2018 and Grosse et al.
    2023 (EK-FAC for them); Pruthi et al. 2020 (TracIn, ``curvature="identity"``); Choe
    et al. 2024 (LoGra: Kronecker-projected gradients for influence at scale).
    """
    pre = preconditioner or fit_preconditioner(
        model, train, loss_fn, curvature=curvature, damping=damping, fisher=fisher,
        kind=kind, batch_size=batch_size, params=params)
    queries = _preconditioned(model, query, loss_fn, pre, batch_size, params)
    if projector is not None:
        return _projected_scores(model, train, loss_fn, queries, projector, batch_size)
    scores, each = [], _Grads("influence", "training loss")
    for inputs, targets in _batches(train, batch_size):
        grads = each(model, inputs, targets, loss_fn, params)
        scores.append(sum(q.unsqueeze(-1).flatten(1)  # (a 0-dim parameter's (B,) too)
                          @ grads[name].unsqueeze(-1).flatten(1).to(q.dtype).T
                          for name, q in queries.items()))
    each.warn()
    return torch.cat(scores, 1)


def self_influence(model: nn.Module, train: tuple[Any, Any],
                   loss_fn: Callable[[Any, Any], Tensor], *, curvature: str = "ekfac",
                   damping: float | None = None, fisher: str = "type-2", kind: str = "expand",
                   batch_size: int = 64, params: Any = None,
                   preconditioner: Preconditioner | None = None) -> Tensor:
    """``g_t^T (F + lambda I)^{-1} g_t`` of each training sample: high for the samples
    the model fits against the rest (mislabelled ones), as :func:`influence` computes it.

    Args:
        model, train, loss_fn: as for :func:`influence`.
        curvature, damping, fisher, kind, batch_size, params, preconditioner: as for
            :func:`influence`.

    Returns:
        ``(n_train,)``, in the units of :func:`influence`'s scores.

    Warns:
        RuntimeWarning: a training sample whose loss holds a NaN or an Inf, named by its
            index in ``train``.

    Raises:
        ValueError: as :func:`influence`.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> import persample
        >>> net = nn.Linear(4, 3)
        >>> train = (torch.randn(30, 4), torch.randint(0, 3, (30,)))
        >>> bool((persample.self_influence(net, train, nn.CrossEntropyLoss()) > 0).all())
        True

    Source: Koh & Liang 2017; Grosse et al. 2023 (self-influence to find mislabelled
    training samples).
    """
    pre = preconditioner or fit_preconditioner(
        model, train, loss_fn, curvature=curvature, damping=damping, fisher=fisher,
        kind=kind, batch_size=batch_size, params=params)
    out, each = [], _Grads("self_influence", "loss")
    for inputs, targets in _batches(train, batch_size):
        grads = each(model, inputs, targets, loss_fn, params)
        grads = {k: g.to(accumulate_dtype(g.dtype)) for k, g in grads.items()}
        pre_grads = pre.apply(grads)
        out.append(sum((pre_grads[k] * grads[k]).unsqueeze(-1).flatten(1).sum(1)
                       for k in grads))
    each.warn()
    return torch.cat(out)


def _projected_scores(model: nn.Module, train: tuple[Any, Any], loss_fn: Callable,
                      queries: dict[str, Tensor], projector: GradientProjector,
                      batch_size: int) -> Tensor:
    """``(n_query, n_train)``: the projected preconditioned queries ``(n_query, dim)``
    against each training batch's projected gradients ``(B, dim)``."""
    if projector.model is not model or set(projector.params) != set(queries):
        raise ValueError(
            "projector must be a GradientProjector of this model over the parameters the "
            f"scores cover ({sorted(queries)}); it projects {sorted(projector.params)}: "
            "build it as GradientProjector(model, dim, params=...) with the same params")
    q = projector.project(queries)  # (n_query, dim)
    return torch.cat([q @ projector(inputs, targets, loss_fn).to(q.dtype).T
                      for inputs, targets in _batches(train, batch_size)], 1)


def _preconditioned(model: nn.Module, query: tuple[Any, Any], loss_fn: Callable,
                    pre: Preconditioner, batch_size: int, params: Any) -> dict[str, Tensor]:
    """``{name: (n_query, *shape)}``: each query's gradient through the inverse."""
    parts: dict[str, list[Tensor]] = {}
    each = _Grads("influence", "query loss")
    for inputs, targets in _batches(query, batch_size):
        grads = each(model, inputs, targets, loss_fn, params)
        grads = {k: g.to(accumulate_dtype(g.dtype)) for k, g in grads.items()}
        for name, g in pre.apply(grads).items():
            parts.setdefault(name, []).append(g)
    each.warn()
    return {name: torch.cat(p) for name, p in parts.items()}


class _Grads:
    """Per-sample gradients batch by batch (``grads_taken``), each sample's loss kept:
    one warning at the end names the samples whose loss is not finite by their index in
    the whole set (``what``: whose loss, in ``function``'s words)."""

    def __init__(self, function: str, what: str):
        self.function, self.what, self.losses = function, what, []

    def __call__(self, model: nn.Module, inputs: Any, targets: Any, loss_fn: Callable,
                 params: Any) -> dict[str, Tensor]:
        grads, taken = grads_taken(model, inputs, targets, loss_fn, params=params)
        self.losses.append(taken.losses)
        return grads

    def warn(self) -> None:
        if self.losses:
            checks.warn_non_finite(self.function, torch.cat(self.losses), self.what)


def _batches(data: tuple[Any, Any], size: int):
    """``(inputs, targets)`` in consecutive batches of ``size`` samples."""
    inputs, targets = data
    batch = as_batch(inputs)
    for start in range(0, batch.n, size):
        yield batch.samples(start, start + size), samples_of(targets, start, start + size)
