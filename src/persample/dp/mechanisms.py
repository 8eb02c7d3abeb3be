"""Correlated noise: the banded matrix factorization mechanism (BandMF).

DP-SGD releases each step's clipped sum ``g_t`` plus independent noise. Training
uses only the prefix sums of the releases, ``A G`` (``A`` the lower-triangular
matrix of ones; with momentum, the Toeplitz matrix of ``sum_j beta^j``), so the
noise may be correlated across steps: factor ``A = B C``, release ``C G + Z``, and in
gradient form step ``t`` gets the noise ``(C^-1 Z)_t``, a combination of the current
and earlier draws (Denisov et al. 2022; Choquette-Choo et al. 2023, "(Amplified)
Banded Matrix Factorization: A unified approach to private training"). With ``C``
lower-triangular, banded (``bands`` nonzero diagonals) and Toeplitz, ``C^-1 Z`` is
the recursion

    W_t = (Z_t - sum_{k=1}^{bands-1} c_k W_{t-k}) / c_0,

which needs the last ``bands - 1`` draws (:class:`CorrelatedNoise`: a ring of
``bands`` parameter-sized rows, the release's own draw made in the oldest). ``C``'s
columns are scaled to norm 1 (the last ``bands - 1`` are shorter: their rows of
``C^-1`` scaled up to match), so that a
record sampled at most once in any ``bands`` consecutive steps (cyclic Poisson
sampling, :class:`~persample.dp.CyclicPoissonSampler` with ``cycle_length=bands``)
touches columns of disjoint support, and the run is accounted as DP-SGD over
``ceil(T / bands)`` steps at rate ``bands * q`` (Choquette-Choo et al. 2023,
Theorem 4). ``bands=1`` is DP-SGD exactly.

The coefficients ``c`` minimise the expected squared error of the noisy prefix sums,
``||A C^-1||_F^2 / T`` (or the last step's, ``"max"``), times the sensitivity
``||c||^2``, over banded Toeplitz ``C`` (McKenna 2024, "Scaling up the Banded Matrix
Factorization Mechanism for Differentially Private ML"): L-BFGS (scipy) in float64
from the optimal max-error coefficients of Fichtenberger, Henzinger & Upadhyay 2023,
each evaluation two linear recursions of ``T`` steps (``scipy.signal.lfilter``) for
the error and its exact gradient.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
from torch import Tensor

WORKLOADS = ("prefix", "momentum")
ERRORS = ("mean", "max")


class BandMF:
    """A banded Toeplitz strategy ``C`` for ``steps`` releases, optimised for a workload.

    Args:
        steps: ``T >= 1``, the releases the run will make (the mechanism refuses more:
            ``C``'s last columns are normalised for this ``T``).
        bands: ``b >= 1``, the nonzero diagonals of ``C``; the sampling must keep each
            record's participations at least ``b`` steps apart (cyclic Poisson sampling
            with ``b`` groups). ``1`` is DP-SGD.
        workload: ``"prefix"``: the model after each SGD step (prefix sums of the
            gradients); ``"momentum"``: SGD with heavy-ball momentum ``momentum``.
        momentum: ``beta`` in ``[0, 1)`` of the ``"momentum"`` workload.
        error: ``"mean"`` (the mean over the steps, the papers' RMSE squared) or
            ``"max"`` (the last step's, the largest for a Toeplitz strategy) squared
            error, minimised.
        coefs: ``(b,)`` the coefficients, given instead of optimised (from another
            library or an earlier run); scaled to norm 1.

    Attributes:
        coefs: ``(b,)`` float64, ``C``'s first column's nonzero entries, norm 1.
        row_scale: ``(T,)`` float64, each step's column norm of the Toeplitz ``C``
            (1 but for the last ``b - 1`` steps): the scale of that step's noise.

    Raises:
        ValueError: an argument outside its range, or ``coefs`` of the wrong length or
            with ``coefs[0] <= 0``.

    Examples:
        >>> mech = BandMF(steps=100, bands=4)
        >>> mech.coefs.shape, round(float(mech.coefs.norm()), 6)
        (torch.Size([4]), 1.0)
        >>> C = mech.matrix  # (steps, steps): lower-triangular, banded, columns of norm 1
        >>> bool(torch.allclose(C.norm(dim=0), torch.ones(100, dtype=torch.float64)))
        True
        >>> mech.expected_error() < BandMF(steps=100, bands=1).expected_error()  # vs DP-SGD
        True

    Source: Choquette-Choo et al. 2023 (NeurIPS), "(Amplified) Banded Matrix
    Factorization: A unified approach to private training"; McKenna 2024, "Scaling up
    the Banded Matrix Factorization Mechanism for Differentially Private ML" (Toeplitz
    strategies); Fichtenberger, Henzinger & Upadhyay 2023 (the starting point).
    """

    def __init__(self, steps: int, bands: int, *, workload: str = "prefix",
                 momentum: float = 0.9, error: str = "mean",
                 coefs: Iterable[float] | Tensor | None = None) -> None:
        _check_int("steps", steps)
        _check_int("bands", bands)
        if bands > steps:
            raise ValueError(f"bands must be at most steps, got bands={bands}, steps={steps}")
        if workload not in WORKLOADS:
            raise ValueError(f"workload must be one of {WORKLOADS}, got {workload!r}")
        if error not in ERRORS:
            raise ValueError(f"error must be one of {ERRORS}, got {error!r}")
        if not (isinstance(momentum, (int, float)) and 0 <= momentum < 1):
            raise ValueError(f"momentum must be in [0, 1), got {momentum!r}")
        self.steps, self.bands = steps, bands
        self.workload, self.momentum, self.error = workload, float(momentum), error
        if coefs is None:
            c = optimal_coefs(steps, bands, workload_coefs(steps, workload, momentum), error)
        else:
            c = np.asarray(torch.as_tensor(coefs, dtype=torch.float64).tolist(), dtype=float)
            if c.shape != (bands,) or not c[0] > 0 or not np.isfinite(c).all():
                raise ValueError(f"coefs must be {bands} finite numbers with coefs[0] > 0, "
                                 f"got {c.tolist()}")
        c = c / np.linalg.norm(c)
        self.coefs = torch.from_numpy(c)
        tail = np.sqrt(np.cumsum(c ** 2))  # column norms of the last b columns, reversed
        scale = np.ones(steps)
        scale[steps - len(tail):] = tail[::-1][-steps:] if steps < len(tail) else tail[::-1]
        self.row_scale = torch.from_numpy(scale)

    def __repr__(self) -> str:
        extra = f", momentum={self.momentum}" if self.workload == "momentum" else ""
        return (f"BandMF(steps={self.steps}, bands={self.bands}, "
                f"workload={self.workload!r}{extra})")

    @property
    def cycle_length(self) -> int:
        """The fewest steps between two participations of a record: ``bands``."""
        return self.bands

    @property
    def matrix(self) -> Tensor:
        """``C`` ``(T, T)`` float64: lower-triangular, ``bands`` diagonals, columns of
        norm 1 (the Toeplitz matrix of :attr:`coefs` with its columns scaled)."""
        return _toeplitz(self.coefs, self.steps) / self.row_scale  # (T, T)

    @property
    def noise_matrix(self) -> Tensor:
        """``C^-1`` ``(T, T)`` float64: row ``t`` weighs the draws ``Z_0 .. Z_t`` of
        step ``t``'s noise."""
        inverse = _inverse_coefs(self.coefs.numpy(), self.steps)
        return self.row_scale[:, None] * _toeplitz(torch.from_numpy(inverse), self.steps)

    def expected_error(self, error: str | None = None) -> float:
        """The squared error of the noisy workload per unit noise and sensitivity:
        ``mean_t ||(A C^-1)_t||^2 * ||c||^2`` (``"mean"``) or the last step's
        (``"max"``), for the Toeplitz ``C`` before its last columns are normalised (an
        upper bound: normalising shrinks the noise). DP-SGD (``bands=1``) on the
        prefix workload: ``(T + 1) / 2`` and ``T``.

        Raises:
            ValueError: ``error`` not ``"mean"`` or ``"max"``.
        """
        error = self.error if error is None else error
        if error not in ERRORS:
            raise ValueError(f"error must be one of {ERRORS}, got {error!r}")
        a = workload_coefs(self.steps, self.workload, self.momentum)
        return float(_loss(self.coefs.numpy(), a, error)[0])

    def participations(self, steps: int) -> int:
        """The most of the first ``steps`` releases one record takes part in under
        cyclic sampling: ``ceil(steps / bands)``."""
        return -(-steps // self.bands)


def workload_coefs(steps: int, workload: str = "prefix", momentum: float = 0.9) -> np.ndarray:
    """``(T,)`` float64: the first column of the workload ``A`` (Toeplitz): ones for the
    prefix sums; ``(1 - beta^(k+1)) / (1 - beta)`` for SGD with momentum ``beta``.

    Examples:
        >>> workload_coefs(3, "momentum", 0.5).tolist()
        [1.0, 1.5, 1.75]
    """
    k = np.arange(steps)
    if workload == "prefix":
        return np.ones(steps)
    return (1 - momentum ** (k + 1)) / (1 - momentum)


def max_error_coefs(bands: int) -> np.ndarray:
    """``(b,)``: the optimal coefficients for max error on the prefix workload under
    single participation (Fichtenberger, Henzinger & Upadhyay 2023),
    ``c_k = prod_{j<=k} (2j - 1) / (2j)``, truncated to ``b`` bands.

    Examples:
        >>> max_error_coefs(3).tolist()
        [1.0, 0.5, 0.375]
    """
    k = np.arange(1, bands)
    return np.concatenate([[1.0], np.cumprod((2 * k - 1) / (2 * k))])


def optimal_coefs(steps: int, bands: int, workload: np.ndarray, error: str = "mean",
                  max_iterations: int = 500) -> np.ndarray:
    """``(b,)`` float64 of norm 1: the banded Toeplitz strategy of least expected error
    on ``workload`` (:func:`workload_coefs`), by L-BFGS from :func:`max_error_coefs`.

    Examples:
        >>> c = optimal_coefs(64, 3, workload_coefs(64))
        >>> c.shape, round(float(np.linalg.norm(c)), 6)
        ((3,), 1.0)
    """
    from scipy.optimize import minimize

    start = max_error_coefs(bands)
    if bands == 1:
        return start
    found = minimize(_loss, start, args=(workload, error), jac=True, method="L-BFGS-B",
                     options={"maxiter": max_iterations, "ftol": 1e-13, "gtol": 1e-10})
    c = found.x if found.x[0] > 0 else -found.x  # (the loss is even in c)
    return c / np.linalg.norm(c)


def _loss(c: np.ndarray, workload: np.ndarray, error: str) -> tuple[float, np.ndarray]:
    """The expected error times the sensitivity, ``E(B) ||c||^2`` with ``B = C^-1 a``
    (``A C^-1``'s first column), and its gradient in ``c``."""
    from scipy.signal import lfilter

    n = len(workload)
    b = lfilter([1.0], c, workload)  # (T,) C b = a
    weight = (n - np.arange(n)) / n if error == "mean" else np.ones(n)  # (T,)
    e = float(weight @ (b * b))
    g = 2 * weight * b  # dE/db
    u = lfilter([1.0], c, g[::-1])[::-1]  # C^T u = g (upper-triangular Toeplitz)
    de = -np.array([u[k:] @ b[:n - k] for k in range(len(c))])  # dE/dc_k = -u . S^k b
    s = float(c @ c)
    return e * s, s * de + 2 * e * c


def _inverse_coefs(c: np.ndarray, steps: int) -> np.ndarray:
    """``(T,)``: the first column of ``C^-1`` (lower-triangular Toeplitz too)."""
    from scipy.signal import lfilter

    impulse = np.zeros(steps)
    impulse[0] = 1.0
    return lfilter([1.0], c, impulse)


def _toeplitz(first: Tensor, steps: int) -> Tensor:
    """The ``(T, T)`` lower-triangular Toeplitz matrix of first column ``first``."""
    col = torch.zeros(steps, dtype=torch.float64)
    col[:min(len(first), steps)] = first[:steps]
    k = torch.arange(steps)
    diff = k[:, None] - k[None, :]  # (T, T)
    return torch.where(diff >= 0, col[diff.clamp(min=0)], torch.zeros((), dtype=torch.float64))


def _check_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")


class CorrelatedNoise:
    """The running state of a mechanism's noise: the release count ``t`` and, for each
    parameter (each shard of it, under FSDP2), a ring of its last ``bands`` draws ``W``,
    ``(bands, numel)``.

    Release ``t`` draws ``Z_t`` into the ring's row ``t mod bands`` (:meth:`slot`: the
    row of ``W_{t-bands}``, no longer needed), and :meth:`settle` turns it into ``W_t``
    in place: one matrix-vector product with the other rows (each state read once),
    then ``/ c_0``; the release's noise is ``row_scale_t * W_t``. :meth:`correlate` does
    both for a draw made elsewhere. :meth:`advance` ends the release. The rings are of
    the draw's dtype and device, made (zeros) at the first release.

    Args:
        mechanism: the :class:`BandMF` strategy.

    Raises:
        RuntimeError: from :meth:`slot`, :meth:`correlate` (and :meth:`check`), a
            release past the ``steps`` the mechanism was made for.

    Examples:
        >>> mech = BandMF(steps=3, bands=2, coefs=[2.0, 1.0])
        >>> noise = CorrelatedNoise(mech)
        >>> z = torch.ones(3, 4, dtype=torch.float64)  # three releases' draws
        >>> got = []
        >>> for t in range(3):
        ...     w = z[t].clone()
        ...     noise.correlate("weight", w)
        ...     noise.advance()
        ...     got.append(w)
        >>> torch.allclose(torch.stack(got), mech.noise_matrix @ z)
        True
    """

    def __init__(self, mechanism: BandMF) -> None:
        self.mechanism = mechanism
        self.t = 0  # releases made
        self.history: dict[str, Tensor] = {}  # name -> (bands, numel): W_s at s mod bands
        self.coefs = mechanism.coefs.tolist()

    def check(self) -> None:
        """Raise the error of :meth:`correlate` past the planned releases, before any
        draw."""
        if self.t >= self.mechanism.steps:
            raise RuntimeError(
                f"{self.mechanism} was made for {self.mechanism.steps} releases; this is "
                f"release {self.t + 1}: its last columns are normalised for that many. Make "
                f"the mechanism with the steps the run takes")

    def slot(self, name: str, like: Tensor) -> Tensor:
        """Where release ``t``'s draw ``Z_t`` of parameter ``name`` goes: its ring's row
        ``t mod bands``, viewed as ``like`` (whose shape, dtype and device the ring
        takes)."""
        self.check()
        ring = self.history.get(name)
        if ring is None or ring.shape[1] != like.numel() or ring.dtype != like.dtype \
                or ring.device != like.device:
            ring = self.history[name] = torch.zeros((len(self.coefs), like.numel()),
                                                    dtype=like.dtype, device=like.device)
        return ring[self.t % len(self.coefs)].view(like.shape)

    def settle(self, name: str) -> tuple[Tensor, float]:
        """``Z_t`` in the slot becomes ``W_t = (Z_t - sum_j c_j W_{t-j}) / c_0`` in place;
        returns the slot (flat) and ``row_scale_t``: the release's noise is their
        product."""
        ring = self.history[name]
        b, here = len(self.coefs), self.t % len(self.coefs)
        flat = ring[here]
        if b > 1 and self.t:
            weights = [0.0] * b
            for j, cj in enumerate(self.coefs[1:], start=1):
                if self.t - j >= 0:
                    weights[(self.t - j) % b] = cj
            flat.addmv_(ring.t(), torch.tensor(weights, dtype=ring.dtype, device=ring.device),
                        alpha=-1)  # (the slot's own weight is 0)
        if self.coefs[0] != 1.0:
            flat.div_(self.coefs[0])
        return flat, float(self.mechanism.row_scale[self.t])

    def correlate(self, name: str, z: Tensor) -> None:
        """``z`` (``Z_t`` of parameter ``name``, contiguous, any shape) becomes its
        noise, in place."""
        self.slot(name, z).copy_(z)
        flat, scale = self.settle(name)
        z.view(-1).copy_(flat).mul_(scale)

    def advance(self) -> None:
        """The release is complete: the next draws are step ``t + 1``'s."""
        self.t += 1

    def state_dict(self) -> dict[str, Any]:
        """The release count and the kept draws (each parameter's, this process's
        shard), for a checkpoint."""
        return {"t": self.t, "history": {k: v.clone() for k, v in self.history.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`'s release count and draws."""
        self.t = int(state["t"])
        self.history = {k: v.clone() for k, v in state["history"].items()}


def check_mechanism(mechanism: Any) -> BandMF | None:
    """``mechanism`` if it is one (or ``None``).

    Raises:
        TypeError: anything else.

    Examples:
        >>> check_mechanism(None) is None
        True
        >>> check_mechanism("bandmf")
        Traceback (most recent call last):
        ...
        TypeError: mechanism must be a persample.dp.BandMF (or None for DP-SGD's independent noise), got str
    """  # noqa: E501
    if mechanism is None or isinstance(mechanism, BandMF):
        return mechanism
    raise TypeError(f"mechanism must be a persample.dp.BandMF (or None for DP-SGD's "
                    f"independent noise), got {type(mechanism).__name__}")


def amplified_runs(mechanism: BandMF | None, noise_multiplier: float, sample_rate: float,
                   releases: int) -> list[tuple[float, float, int]]:
    """The DP-SGD runs ``(sigma, rate, steps)`` the accountant composes for ``releases``
    releases: DP-SGD's own, or, with a mechanism and cyclic Poisson sampling,
    ``ceil(T / b)`` steps at rate ``b * q`` (Choquette-Choo et al. 2023, Theorem 4).

    Source: Choquette-Choo et al. 2023, "(Amplified) Banded Matrix Factorization",
    Theorem 4.

    Examples:
        >>> amplified_runs(None, 1.0, 0.01, 10)
        [(1.0, 0.01, 10)]
        >>> amplified_runs(BandMF(10, 4), 1.0, 0.01, 10)
        [(1.0, 0.04, 3)]
    """
    if mechanism is None or mechanism.bands == 1:
        return [(noise_multiplier, sample_rate, releases)]
    b = mechanism.bands
    return [(noise_multiplier, min(1.0, b * sample_rate), math.ceil(releases / b))]
