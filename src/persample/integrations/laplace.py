"""persample as a curvature backend of ``laplace-torch`` (Daxberger et al. 2021, "Laplace
Redux: Effortless Bayesian Deep Learning"): :class:`PerSampleGGN` and
:class:`PerSampleEF`.

Laplace asks its backend for per-sample Jacobians ``(B, C, P)`` (the GLM predictive and
its ``full`` and ``diag`` GGN), per-sample gradients ``(B, P)`` (the empirical Fisher),
the diagonal of the GGN, and K-FAC factors (``hessian_structure="kron"``). Its own
backends take them from ``torch.func.jacrev`` (every Jacobian of the batch at once),
curvlinops and BackPACK (``nn.Linear`` and ``nn.Conv2d`` only, BackPACK in an
``nn.Sequential``) and ASDL. Here every one comes from persample's rules: GPT-2's
``Conv1D``, embeddings, attention, normalisation layers, the models of transformers and
timm as they ship.

``hessian_structure="kron"``: each parameter with K-FAC factors
(:class:`persample.KFAC`) gets its Kronecker pair in Laplace's order (the factor over
the parameter's dim 0 first); an embedding table's input side is the ids' frequencies,
a diagonal kept as a vector (never ``(vocabulary, vocabulary)``); a parameter without
factors (a normalisation scale, a tied or recurrent weight) gets its exact diagonal.
Both need :class:`DiagonalKron`, the ``Kron`` this backend returns: Laplace's own
``Kron`` adds a vector to its dense zeros by broadcasting, and decomposes a diagonal by
materialising an identity of its size. ``DiagonalKron.decompose`` keeps a diagonal's
eigenbasis implicit (:class:`DiagonalKronDecomposed`).

Import this module explicitly (it imports ``laplace``): ``laplace-torch`` is not a
dependency of persample.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from torch.utils.data import DataLoader, TensorDataset
    >>> from laplace import Laplace
    >>> from persample.integrations.laplace import PerSampleGGN
    >>> net = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Tanh(), nn.Linear(8, 3))
    >>> data = TensorDataset(torch.randn(32, 4), torch.randint(0, 3, (32,)))
    >>> la = Laplace(net, "classification", subset_of_weights="all",
    ...              hessian_structure="kron", backend=PerSampleGGN)
    >>> la.fit(DataLoader(data, batch_size=16))
    >>> la(torch.randn(5, 4), pred_type="glm").shape
    torch.Size([5, 3])
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from laplace.curvature import CurvatureInterface, EFInterface, GGNInterface
from laplace.utils import Kron, KronDecomposed
from laplace.utils.utils import symeig
from torch import Tensor, nn

from ..api import param_jacobian, per_sample_grads
from ..curvature import KFAC, KroneckerFactors, ggn_diag

__all__ = ["PerSampleGGN", "PerSampleEF", "DiagonalKron", "DiagonalKronDecomposed"]


class PerSampleInterface(CurvatureInterface):
    """What :class:`PerSampleGGN` and :class:`PerSampleEF` share: the per-sample
    Jacobians and gradients, and K-FAC; Laplace passes ``model``, ``likelihood``,
    ``last_layer``, ``subnetwork_indices``, ``dict_key_x`` and ``dict_key_y``, and
    ``backend_kwargs`` (``kind``, ``shared``) as keywords.

    Args:
        kind: K-FAC with positions (sequences, patches): ``"expand"`` or ``"reduce"``
            (Eschenhagen et al. 2023); Laplace's ``asdl_fisher_kwargs={"kfac_approx":
            ...}`` overrides it per fit.
        shared: a parameter several ops read (tied weights) in ``"kron"``: only
            ``"diagonal"`` (its exact diagonal) fits Laplace's one Kronecker pair per
            parameter.
    """

    fisher = "type-2"

    def __init__(self, model: nn.Module, likelihood: str, last_layer: bool = False,
                 subnetwork_indices: torch.LongTensor | None = None,
                 dict_key_x: str = "input_ids", dict_key_y: str = "labels",
                 kind: str = "expand", **rest: Any) -> None:
        super().__init__(model, likelihood, last_layer, subnetwork_indices, dict_key_x,
                         dict_key_y, **rest)
        self.kind = kind

    def _inputs(self, x: Any) -> Any:
        """Laplace calls ``model(x)`` with a dict as one argument; persample calls
        ``model(**inputs)`` for a dict: pass it as ``((x,), {})``."""
        return ((x,), {}) if isinstance(x, Mapping) else x

    def _loss(self, x: Any, y: Tensor) -> tuple[Tensor, Tensor]:
        """The model's output ``(B, C)`` and Laplace's loss of the batch (its units)."""
        with torch.no_grad():
            f = self.model(x)
        return f, self.factor * self.lossfunc(f, y)

    def jacobians(self, x: Any, enable_backprop: bool = False) -> tuple[Tensor, Tensor]:
        """``(Js (B, C, P), f (B, C))``: the per-sample Jacobians of the outputs w.r.t.
        the parameters (``self.params``' order), by :func:`persample.param_jacobian`;
        ``enable_backprop=True`` (a graph through ``Js``): ``torch.func`` as Laplace's."""
        if enable_backprop:
            return super().jacobians(x, enable_backprop=True)
        js = param_jacobian(self.model, self._inputs(x), flat=True, params=self.params)
        if self.subnetwork_indices is not None:
            js = js[:, :, self.subnetwork_indices]
        with torch.no_grad():
            f = self.model(x)
        return js, f

    functorch_jacobians = jacobians

    def gradients(self, x: Any, y: Tensor) -> tuple[Tensor, Tensor]:
        """``(Gs (B, P), loss)``: each sample's gradient of Laplace's loss
        (``CrossEntropyLoss`` or ``MSELoss``, reduction ``"sum"``), by
        :func:`persample.per_sample_grads`, and the batch's loss (without ``factor``)."""
        gs = per_sample_grads(self.model, self._inputs(x), y, self.lossfunc, flat=True,
                              params=self.params)
        if self.subnetwork_indices is not None:
            gs = gs[:, self.subnetwork_indices]
        with torch.no_grad():
            loss = self.lossfunc(self.model(x), y)
        return gs, loss

    def kron(self, x: Any, y: Tensor, N: int, **kwargs: Any) -> tuple[Tensor, DiagonalKron]:
        """``(loss, DiagonalKron)``: this batch's K-FAC, scaled as Laplace sums batches:
        the output side summed over the batch's ``M`` samples, the input side their mean
        times ``M / N`` (``N`` the data set's size), the whole times ``factor``.

        Raises:
            ValueError: ``subnetwork_indices`` (Laplace's subnetwork is ``full`` only).
        """
        if self.subnetwork_indices is not None:
            raise ValueError("hessian_structure='kron' covers whole parameters: a "
                             "subnetwork (subnetwork_indices) takes hessian_structure='full'")
        kind = kwargs.get("kfac_approx", self.kind)
        kfac = KFAC(self.model, fisher=self.fisher, kind=kind, params=self.params,
                    mc_samples=getattr(self, "num_samples", 1) or 1, shared="diagonal")
        kfac.update(self._inputs(x), y, self.lossfunc)
        m = kfac.num_data
        factors, diagonals = kfac.factors, kfac.diagonals
        names = {id(p): name for name, p in self.model.named_parameters()}
        kfacs = []
        for p in self.params:
            name = names[id(p)]
            if name in factors:
                (f,) = factors[name]
                kfacs.append(_laplace_pair(f, p, m, N))
            else:  # the exact diagonal, summed over the batch
                kfacs.append([diagonals[name].flatten() * m])
        _, loss = self._loss(x, y)
        return loss.detach(), DiagonalKron(kfacs) * self.factor


def _laplace_pair(f: KroneckerFactors, p: Tensor, m: int, n_data: int) -> list[Tensor]:
    """One parameter's K-FAC as Laplace holds it: ``[F0, F1]`` with ``F0`` over the
    parameter's dim 0 (its block ``F0 (x) F1`` in row-major order), or ``[G * A]`` for a
    bias (whose input side is the scalar 1)."""
    g = f.G * m  # summed over the batch
    if p.dim() == 1:  # one block, summed over the batches as it is
        return [g * f.A.reshape(())]
    a = f.A * (m / n_data)
    return [g, a] if f.rows == "G" else [a, g]


class PerSampleGGN(PerSampleInterface, GGNInterface):
    """The generalized Gauss-Newton (``stochastic=True``: the Monte Carlo Fisher, with
    ``num_samples`` labels drawn per sample) from persample, as Laplace's backend.

    Pass ``backend=PerSampleGGN`` to ``laplace.Laplace`` (and options through
    ``backend_kwargs``: ``stochastic``, ``num_samples``, ``kind``).

    Shapes and units are Laplace's: ``diag`` returns ``(loss, (P,))``, ``kron``
    ``(loss, DiagonalKron)``, ``full`` ``(loss, (P, P))`` (from :meth:`jacobians`), the
    curvature of Laplace's log-likelihood, per parameter unit squared.

    Raises:
        ValueError: as :func:`persample.ggn_diag` and :class:`persample.KFAC` (a model
            output that is not ``(B, C)``).

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> from laplace import Laplace
        >>> from persample.integrations.laplace import PerSampleGGN
        >>> net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
        >>> loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(
        ...     torch.randn(20, 4), torch.randint(0, 3, (20,))), batch_size=10)
        >>> la = Laplace(net, "classification", subset_of_weights="all",
        ...              hessian_structure="diag", backend=PerSampleGGN)
        >>> la.fit(loader)
        >>> la.H.shape
        torch.Size([67])

    Source: Daxberger et al. 2021 (Laplace Redux); Martens 2020 (the GGN); Martens &
    Grosse 2015 (K-FAC).
    """

    def __init__(self, model: nn.Module, likelihood: str, last_layer: bool = False,
                 subnetwork_indices: torch.LongTensor | None = None,
                 dict_key_x: str = "input_ids", dict_key_y: str = "labels",
                 stochastic: bool = False, num_samples: int = 1,
                 kind: str = "expand") -> None:
        super().__init__(model, likelihood, last_layer, subnetwork_indices, dict_key_x,
                         dict_key_y, kind=kind, stochastic=stochastic,
                         num_samples=num_samples)

    @property
    def fisher(self) -> str:  # type: ignore[override]
        return "mc" if self.stochastic else "type-2"

    def diag(self, x: Any, y: Tensor, **kwargs: Any) -> tuple[Tensor, Tensor]:
        """``(loss, (P,))``: the batch's GGN diagonal (:func:`persample.ggn_diag`), exact
        or from ``num_samples`` drawn labels, never forming ``(B, C, P)``."""
        if self.last_layer:
            return super().diag(x, y, **kwargs)
        parts = ggn_diag(self.model, self._inputs(x), y, self.lossfunc,
                         mc_samples=self.num_samples if self.stochastic else 0,
                         params=self.params)
        h = torch.cat([d.flatten() for d in parts.values()]) * self.factor
        if self.subnetwork_indices is not None:
            h = h[self.subnetwork_indices]
        _, loss = self._loss(x, y)
        return loss.detach(), h


class PerSampleEF(PerSampleInterface, EFInterface):
    """The empirical Fisher from persample's per-sample gradients, as Laplace's backend:
    ``diag`` and ``full`` from :meth:`gradients` (Laplace's ``EFInterface``), ``kron``
    from :class:`persample.KFAC` with ``fisher="empirical"``.

    Raises:
        ValueError: as :func:`persample.per_sample_grads`.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> from laplace import Laplace
        >>> from persample.integrations.laplace import PerSampleEF
        >>> net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        >>> loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(
        ...     torch.randn(20, 4), torch.randn(20, 1)), batch_size=10)
        >>> la = Laplace(net, "regression", subset_of_weights="all",
        ...              hessian_structure="full", backend=PerSampleEF)
        >>> la.fit(loader)
        >>> la.H.shape
        torch.Size([49, 49])

    Source: Daxberger et al. 2021 (Laplace Redux); Kunstner, Hennig & Balles 2019 (the
    empirical Fisher and its limits).
    """

    fisher = "empirical"


# -- Kronecker factors with diagonals -------------------------------------------------


def _zero(t: Tensor, chunk: int = 1 << 24) -> bool:
    """Whether every entry is 0, in chunks (``Tensor.any`` makes a boolean copy: 2.5 GB
    for Laplace's ``(50257, 50257)`` zeros)."""
    return not any(part.any() for part in t.reshape(-1).split(chunk))


def _add(a: Tensor, b: Tensor) -> Tensor:
    """Two factors' sum where either may be a diagonal kept as a vector; Laplace's zeros
    (its ``Kron.init_from_model``) add as nothing."""
    if a.shape == b.shape:
        return a + b
    dense, vector = (a, b) if a.dim() > b.dim() else (b, a)
    if _zero(dense):
        return vector.clone()
    if dense.dim() == 2 and dense.shape[0] == vector.numel():
        return dense + torch.diag(vector)
    raise ValueError(f"Kronecker factors of shapes {tuple(a.shape)} and {tuple(b.shape)} "
                     "do not add: the two hold different structures for one parameter")


class DiagonalKron(Kron):
    """Laplace's ``Kron`` whose factors may be diagonals kept as vectors (an embedding
    table's input side ``(vocabulary,)``, a parameter's exact diagonal ``(numel,)``):
    added to Laplace's zeros without broadcasting, decomposed without an identity of
    their size (:class:`DiagonalKronDecomposed`). Everything else is ``Kron``'s."""

    def __add__(self, other: Kron) -> DiagonalKron:
        if not isinstance(other, Kron):
            raise ValueError("Can only add Kron to Kron.")
        pairs = []
        for mine, theirs in zip(self.kfacs, other.kfacs):
            if len(mine) != len(theirs):  # a diagonal of the whole parameter vs zeros
                if not all(_zero(t) for t in theirs):
                    raise ValueError("a Kronecker pair and a parameter's diagonal do not add")
                pairs.append([m.clone() for m in mine])
            else:
                pairs.append([_add(m, t) for m, t in zip(mine, theirs)])
        return DiagonalKron(pairs)

    __radd__ = __add__

    def __mul__(self, scalar: float | Tensor) -> DiagonalKron:
        return DiagonalKron(Kron.__mul__(self, scalar).kfacs)

    __rmul__ = __mul__

    def decompose(self, damping: bool = False) -> DiagonalKronDecomposed:
        """Each dense factor's eigendecomposition; a diagonal's eigenvalues are itself
        and its eigenbasis the identity, kept implicit (an empty tensor)."""
        vectors, values = [], []
        for factors in self.kfacs:
            qs, ls = [], []
            for h in factors:
                if h.dim() > 1:
                    value, q = symeig(h)
                else:
                    value, q = h, h.new_empty(0)
                qs.append(q)
                ls.append(value)
            vectors.append(qs)
            values.append(ls)
        return DiagonalKronDecomposed(vectors, values, damping=damping)


def _rotate(q: Tensor, x: Tensor, transpose: bool) -> Tensor:
    """``q^T x`` (``transpose``) or ``q x`` over ``x``'s second-to-last dim; the identity
    when ``q`` is empty."""
    if not q.numel():
        return x
    return (q.T if transpose else q) @ x


class DiagonalKronDecomposed(KronDecomposed):
    """Laplace's ``KronDecomposed`` where an eigenbasis may be the identity (an empty
    tensor): products, diagonals and the dense form skip it."""

    # adding a prior and scaling are Laplace's own (what they keep, damping included),
    # the result still this class
    def __add__(self, deltas: Tensor) -> DiagonalKronDecomposed:
        return self._same(KronDecomposed.__add__(self, deltas))

    __radd__ = __add__

    def __mul__(self, scalar: float | Tensor) -> DiagonalKronDecomposed:
        return self._same(KronDecomposed.__mul__(self, scalar))

    __rmul__ = __mul__

    @staticmethod
    def _same(done: KronDecomposed) -> DiagonalKronDecomposed:
        return DiagonalKronDecomposed(done.eigenvectors, done.eigenvalues, done.deltas,
                                      done.damping)

    def _spectrum(self, ls: list[Tensor], delta: Tensor, exponent: float) -> Tensor:
        """The eigenvalues of one block plus its prior, to ``exponent``: ``(p,)`` or
        ``(p_in, p_out)``."""
        if len(ls) == 1:
            return torch.pow(ls[0] + delta, exponent)
        l1, l2 = ls
        if self.damping:
            return torch.pow(torch.outer(l1 + delta.sqrt(), l2 + delta.sqrt()), exponent)
        return torch.pow(torch.outer(l1, l2) + delta, exponent)

    def _bmm(self, W: Tensor, exponent: float = -1) -> Tensor:
        b, k, p_all = W.shape
        W = W.reshape(b * k, p_all)
        out, at = [], 0
        for ls, qs, delta in zip(self.eigenvalues, self.eigenvectors, self.deltas):
            spectrum = self._spectrum(ls, delta, exponent)
            p = spectrum.numel()
            w = W[:, at:at + p]
            if len(ls) == 1:  # (bk, p): rotate into the eigenbasis, scale, rotate back
                (q,) = qs
                w = _rotate(q, w.T, transpose=True) * spectrum[:, None]
                out.append(_rotate(q, w, transpose=False).T)
            else:  # (bk, p_in, p_out): Q1^T w Q2, scaled, Q1 (.) Q2^T
                q1, q2 = qs
                w = w.reshape(b * k, *spectrum.shape)
                w = _rotate(q2, _rotate(q1, w, True).mT, True).mT * spectrum
                w = _rotate(q2, _rotate(q1, w, False).mT, False).mT
                out.append(w.reshape(b * k, p))
            at += p
        return torch.cat(out, dim=1).reshape(b, k, p_all)

    def diag(self, exponent: float = 1) -> Tensor:
        diags = []
        for qs, ls, delta in zip(self.eigenvectors, self.eigenvalues, self.deltas):
            spectrum = self._spectrum(ls, delta, exponent)
            if len(ls) == 1:
                (q,) = qs
                diags.append(spectrum if not q.numel() else (q * q) @ spectrum)
            else:  # diag(Q1 L Q1^T (x) ...) = (Q1*Q1) S (Q2*Q2)^T
                q1, q2 = qs
                d = spectrum if not q1.numel() else (q1 * q1) @ spectrum
                d = d if not q2.numel() else d @ (q2 * q2).T
                diags.append(d.flatten())
        return torch.cat(diags)

    def to_matrix(self, exponent: float = 1) -> Tensor:
        blocks = []
        for qs, ls, delta in zip(self.eigenvectors, self.eigenvalues, self.deltas):
            spectrum = self._spectrum(ls, delta, exponent)
            dense = [q if q.numel() else torch.eye(len(lam), dtype=lam.dtype,
                                                    device=lam.device)
                     for q, lam in zip(qs, ls)]
            q = dense[0].contiguous()
            if len(dense) == 2:
                q = torch.kron(q, dense[1].contiguous())
            blocks.append(q @ torch.diag(spectrum.flatten()) @ q.T)
        return torch.block_diag(*blocks)
