"""Correlated noise: the matrix factorization mechanisms (BandMF, BLT) and their state.

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
``C^-1`` scaled up to match), so that a record sampled at most once in any
``s >= bands`` consecutive steps (cyclic Poisson sampling,
:class:`~persample.dp.CyclicPoissonSampler` with ``cycle_length=s``; ``s`` groups taken
whole are fixed batches) touches columns of disjoint support, and the run is accounted
as DP-SGD over ``ceil(T / s)`` steps at rate ``s * q`` (Choquette-Choo et al. 2023,
Theorem 4; a ``b``-banded ``C`` is ``s``-banded too). ``bands=1`` is DP-SGD exactly.
:class:`~persample.dp.blt.BLT` correlates every step with all earlier ones through a
few buffers, accounted without amplification.

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

from .blt import BLT
from .toeplitz import ERRORS, check_int, check_strategy, toeplitz, workload_coefs

SCALE = 100.0  # the optimiser's variables are SCALE * c (see optimal_coefs)
Mechanism = Any  # a BandMF or a BLT: the strategy and how its noise is made and accounted


class BandMF:
    """A banded Toeplitz strategy ``C`` for ``steps`` releases, optimised for a workload.

    Args:
        steps: ``T >= 1``, the releases the run will make (the mechanism refuses more:
            ``C``'s last columns are normalised for this ``T``).
        bands: ``b >= 1``, the nonzero diagonals of ``C``. ``1`` is DP-SGD.
        workload: ``"prefix"``: the model after each SGD step (prefix sums of the
            gradients); ``"momentum"``: SGD with heavy-ball momentum ``momentum``.
        momentum: ``beta`` in ``[0, 1)`` of the ``"momentum"`` workload.
        error: ``"mean"`` (the mean over the steps, the papers' RMSE squared) or
            ``"max"`` (the last step's, the largest for a Toeplitz strategy) squared
            error, minimised.
        coefs: ``(b,)`` the coefficients, given instead of optimised (from another
            library or an earlier run); scaled to norm 1.
        cycle_length: ``s >= bands``, the groups of cyclic Poisson sampling: each
            record's participations at least ``s`` steps apart (default ``bands``; the
            steps of an epoch, for fixed batches).

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
                 coefs: Iterable[float] | Tensor | None = None,
                 cycle_length: int | None = None) -> None:
        check_int("steps", steps)
        check_int("bands", bands)
        if bands > steps:
            raise ValueError(f"bands must be at most steps, got bands={bands}, steps={steps}")
        cycle_length = bands if cycle_length is None else cycle_length
        check_int("cycle_length", cycle_length)
        if cycle_length < bands:
            raise ValueError(f"cycle_length must be at least bands ({bands}): a record's "
                             f"participations must touch disjoint columns of C, got "
                             f"cycle_length={cycle_length}")
        self.cycle_length = cycle_length
        check_strategy(workload, error, momentum)
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
        cycle = "" if self.cycle_length == self.bands else f", cycle_length={self.cycle_length}"
        return (f"BandMF(steps={self.steps}, bands={self.bands}, "
                f"workload={self.workload!r}{extra}{cycle})")

    @property
    def matrix(self) -> Tensor:
        """``C`` ``(T, T)`` float64: lower-triangular, ``bands`` diagonals, columns of
        norm 1 (the Toeplitz matrix of :attr:`coefs` with its columns scaled)."""
        return toeplitz(self.coefs, self.steps) / self.row_scale  # (T, T)

    @property
    def noise_matrix(self) -> Tensor:
        """``C^-1`` ``(T, T)`` float64: row ``t`` weighs the draws ``Z_0 .. Z_t`` of
        step ``t``'s noise."""
        inverse = _inverse_coefs(self.coefs.numpy(), self.steps)
        return self.row_scale[:, None] * toeplitz(torch.from_numpy(inverse), self.steps)

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
        cyclic sampling: ``ceil(steps / cycle_length)``."""
        return -(-steps // self.cycle_length)

    # the noise: a ring of the last b draws (CorrelatedNoise)
    @property
    def rows(self) -> int:
        """The rows of each parameter's ring: ``bands``."""
        return self.bands

    def slot_row(self, t: int) -> int:
        """The row release ``t``'s draw goes in: that of ``W_{t - bands}``."""
        return t % self.bands

    def settle(self, ring: Tensor, t: int) -> Tensor:
        """``Z_t`` in its row becomes ``W_t = (Z_t - sum_j c_j W_{t-j}) / c_0`` in place:
        one matrix-vector product with the other rows (each read once); returns it
        (flat, before :meth:`noise_scale`)."""
        b, flat = self.bands, ring[t % self.bands]
        coefs = self.coefs.tolist()
        if b > 1 and t:
            weights = [0.0] * b
            for j, cj in enumerate(coefs[1:], start=1):
                if t - j >= 0:
                    weights[(t - j) % b] = cj
            flat.addmv_(ring.t(), torch.tensor(weights, dtype=ring.dtype, device=ring.device),
                        alpha=-1)  # (the slot's own weight is 0)
        if coefs[0] != 1.0:
            flat.div_(coefs[0])
        return flat

    def noise_scale(self, t: int) -> float:
        """The factor of release ``t``'s noise: ``row_scale_t``."""
        return float(self.row_scale[t])

    # the accounting: amplified by cyclic Poisson sampling (Theorem 4)
    def release_runs(self, sigma: float, sample_rate: float, release: int
                     ) -> list[tuple[float, float]]:
        """What release ``release`` (from 0) adds to the accountant: a step of
        ``(sigma, s q)`` at the first release of each cycle, nothing at the others."""
        if release % self.cycle_length:
            return []
        return [(sigma, min(1.0, self.cycle_length * sample_rate))]

    def runs(self, sigma: float, sample_rate: float, releases: int
             ) -> list[tuple[float, float, int]]:
        """The first ``releases`` releases for the accountant: ``ceil(releases / s)``
        steps of ``(sigma, s q)``."""
        if releases == 0:
            return []
        return [(sigma, min(1.0, self.cycle_length * sample_rate),
                 self.participations(releases))]


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
    scale = SCALE  # over scale * c: the first trial step (unit length) a small one in c

    def loss(x: np.ndarray) -> tuple[float, np.ndarray]:
        value, grad = _loss(x / scale, workload, error)
        return value, grad / scale

    found = minimize(loss, start * scale, jac=True, method="L-BFGS-B",  # (gtol of c's 1e-10)
                     options={"maxiter": max_iterations, "ftol": 1e-13, "gtol": 1e-10 / scale})
    c = found.x if found.x[0] > 0 else -found.x  # (the loss is even in c)
    return c / np.linalg.norm(c)


def _loss(c: np.ndarray, workload: np.ndarray, error: str) -> tuple[float, np.ndarray]:
    """The expected error times the sensitivity, ``E(B) ||c||^2`` with ``B = C^-1 a``
    (``A C^-1``'s first column), and its gradient in ``c``."""
    from scipy.signal import lfilter

    n = len(workload)
    with np.errstate(over="ignore", invalid="ignore"):  # (a line search's unstable C)
        b = lfilter([1.0], c, workload)  # (T,) C b = a
        weight = (n - np.arange(n)) / n if error == "mean" else np.ones(n)  # (T,)
        e = float(weight @ (b * b))
        if not math.isfinite(e):  # C^-1 grows without bound: infinitely bad, step back
            return 1e30, np.zeros_like(c)
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


class CorrelatedNoise:
    """The running state of a mechanism's noise: the release count ``t`` and, for each
    parameter (each shard of it, under FSDP2), a ring of ``mechanism.rows`` flat rows:
    :class:`BandMF`'s last ``bands`` draws ``W``, or a :class:`~persample.dp.blt.BLT`'s
    ``d`` buffers and the draw.

    Release ``t`` draws ``Z_t`` into the ring's row ``mechanism.slot_row(t)`` (:meth:`slot`),
    and :meth:`settle` turns it into the release's noise (the mechanism's recursion, in
    place where it can); the noise is that times ``mechanism.noise_scale(t)``.
    :meth:`correlate` does both for a draw made elsewhere. :meth:`advance` ends the
    release. The rings are of the draw's dtype and device, made (zeros) at the first
    release.

    Args:
        mechanism: the strategy: :class:`BandMF` or :class:`~persample.dp.blt.BLT`.

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

    def __init__(self, mechanism: Mechanism) -> None:
        self.mechanism = mechanism
        self.t = 0  # releases made
        self.history: dict[str, Tensor] = {}  # name -> (rows, numel): the mechanism's state

    def check(self) -> None:
        """Raise the error of :meth:`correlate` past the planned releases, before any
        draw."""
        if self.t >= self.mechanism.steps:
            raise RuntimeError(
                f"{self.mechanism} was made for {self.mechanism.steps} releases; this is "
                f"release {self.t + 1}: its strategy (and its accounting) is for that many. "
                f"Make the mechanism with the steps the run takes")

    def slot(self, name: str, like: Tensor) -> Tensor:
        """Where release ``t``'s draw ``Z_t`` of parameter ``name`` goes: a row of its
        ring, viewed as ``like`` (whose shape, dtype and device the ring takes)."""
        self.check()
        ring = self.history.get(name)
        if ring is None or ring.shape[1] != like.numel() or ring.dtype != like.dtype \
                or ring.device != like.device:
            ring = self.history[name] = torch.zeros((self.mechanism.rows, like.numel()),
                                                    dtype=like.dtype, device=like.device)
        return ring[self.mechanism.slot_row(self.t)].view(like.shape)

    def settle(self, name: str) -> tuple[Tensor, float]:
        """The draw in the slot becomes the release's noise (before scaling); returns it
        (flat) and the scale: the release's noise is their product."""
        noise = self.mechanism.settle(self.history[name], self.t)
        return noise, self.mechanism.noise_scale(self.t)

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
        """The release count and the kept state (each parameter's, this process's
        shard), for a checkpoint."""
        return {"t": self.t, "history": {k: v.clone() for k, v in self.history.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`'s release count and state."""
        self.t = int(state["t"])
        self.history = {k: v.clone() for k, v in state["history"].items()}


def check_mechanism(mechanism: Any) -> Mechanism | None:
    """``mechanism`` if it is one (or ``None``).

    Raises:
        TypeError: anything else.

    Examples:
        >>> check_mechanism(None) is None
        True
        >>> check_mechanism("bandmf")
        Traceback (most recent call last):
        ...
        TypeError: mechanism must be a persample.dp.BandMF or persample.dp.BLT (or None for DP-SGD's independent noise), got str
    """  # noqa: E501
    if mechanism is None or isinstance(mechanism, (BandMF, BLT)):
        return mechanism
    raise TypeError(f"mechanism must be a persample.dp.BandMF or persample.dp.BLT (or None "
                    f"for DP-SGD's independent noise), got {type(mechanism).__name__}")


def check_sampling(mechanism: Mechanism | None, sample_rate: float | None) -> None:
    """Refuse a sampling rate the mechanism's cyclic sampling cannot have: each of its
    ``s = cycle_length`` groups is sampled at rate ``s q``, at most 1.

    Raises:
        ValueError: ``s q > 1``, naming the mechanism and the largest ``q``.

    Examples:
        >>> check_sampling(BandMF(100, 4), 0.3)
        Traceback (most recent call last):
        ...
        ValueError: sample_rate 0.3 with BandMF(steps=100, bands=4, workload='prefix'): its cyclic sampling draws each of 4 groups at rate cycle_length * q = 1.2 > 1; need sample_rate <= 1 / 4 (or fewer groups)
    """  # noqa: E501
    if mechanism is None or sample_rate is None:
        return
    s = mechanism.cycle_length
    if s * sample_rate > 1 + 1e-12:
        raise ValueError(f"sample_rate {sample_rate:g} with {mechanism}: its cyclic sampling "
                         f"draws each of {s} groups at rate cycle_length * q = "
                         f"{s * sample_rate:.4g} > 1; need sample_rate <= 1 / {s} (or fewer "
                         f"groups)")


def accounted_runs(mechanism: Mechanism | None, noise_multiplier: float, sample_rate: float,
                   releases: int) -> list[tuple[float, float, int]]:
    """The runs ``(sigma, rate, steps)`` the accountant composes for ``releases``
    releases: DP-SGD's own; with :class:`BandMF` and cyclic Poisson sampling over ``s``
    groups, ``ceil(T / s)`` steps at rate ``s * q`` (Choquette-Choo et al. 2023,
    Theorem 4); with a :class:`~persample.dp.blt.BLT`, one Gaussian mechanism (rate 1) of
    noise multiplier ``sigma / P``, ``P`` the sensitivity of the releases so far relative
    to the run's.

    Source: Choquette-Choo et al. 2023, "(Amplified) Banded Matrix Factorization",
    Theorem 4; McMahan et al. 2024 (BLTs under min-separated participation).

    Examples:
        >>> accounted_runs(None, 1.0, 0.01, 10)
        [(1.0, 0.01, 10)]
        >>> accounted_runs(BandMF(10, 4), 1.0, 0.01, 10)
        [(1.0, 0.04, 3)]
        >>> accounted_runs(BLT(10, 1, cycle_length=5), 2.0, 0.2, 10)
        [(2.0, 1.0, 1)]
    """
    if mechanism is None:
        return [(noise_multiplier, sample_rate, releases)]
    return mechanism.runs(noise_multiplier, sample_rate, releases)


def release_runs(mechanism: Mechanism | None, noise_multiplier: float, sample_rate: float,
                 release: int) -> list[tuple[float, float]]:
    """What one release (``release``, from 0) adds to the accountant, as
    ``[(sigma, rate)]`` steps: DP-SGD's one step, or the mechanism's share (none, one,
    or a Gaussian of the sensitivity it adds): composed over the releases, the same
    epsilon as :func:`accounted_runs`.

    Examples:
        >>> [release_runs(BandMF(10, 2), 1.0, 0.1, t) for t in range(3)]
        [[(1.0, 0.2)], [], [(1.0, 0.2)]]
    """
    if mechanism is None:
        return [(noise_multiplier, sample_rate)]
    return mechanism.release_runs(noise_multiplier, sample_rate, release)


MECHANISMS = ("bandmf", "blt")


def resolve_mechanism(mechanism: Mechanism | str | None, steps: int, sample_rate: float, *,
                      bands: int | None = None, buffers: int | None = None,
                      workload: str = "prefix", momentum: float = 0.9
                      ) -> Mechanism | None:
    """A run's mechanism from a front door's arguments: ``"bandmf"`` with ``bands=b``
    (cyclic Poisson sampling over ``b`` groups, amplified), ``"blt"`` with ``buffers=d``
    (default 3; fixed batches cycled each epoch: ``cycle_length = floor(1 / q)``, at
    most ``steps``), made for ``steps`` releases; or a :class:`BandMF` / ``BLT`` the caller
    made, checked against them; ``None``: DP-SGD.

    Raises:
        ValueError: an unknown name, ``bands``/``buffers`` without their mechanism (or
            ``bands`` missing with ``"bandmf"``), a mechanism made for other steps, or a
            sampling rate its groups cannot have (:func:`check_sampling`).
        TypeError: ``mechanism`` of another type.

    Examples:
        >>> resolve_mechanism("bandmf", 100, 0.05, bands=4)
        BandMF(steps=100, bands=4, workload='prefix')
        >>> resolve_mechanism("blt", 100, 0.05, buffers=2).cycle_length  # an epoch
        20
    """
    if isinstance(mechanism, str) and mechanism not in MECHANISMS:
        raise ValueError(f"mechanism must be one of {MECHANISMS}, a persample.dp.BandMF or "
                         f"BLT, or None (DP-SGD), got {mechanism!r}")
    if bands is not None and mechanism != "bandmf":
        raise ValueError("bands= goes with mechanism='bandmf' (a BandMF made by the caller "
                         "has its own bands)")
    if buffers is not None and mechanism != "blt":
        raise ValueError("buffers= goes with mechanism='blt' (a BLT made by the caller has "
                         "its own buffers)")
    if mechanism == "bandmf":
        if bands is None:
            raise ValueError(f"mechanism='bandmf' needs bands=b, the bands of C (at most "
                             f"1 / q = {int(1 / sample_rate + 1e-9)} here)")
        check_int("bands", bands)
        check_sampling(_Cycle(bands), sample_rate)
        return BandMF(steps, bands, workload=workload, momentum=momentum)
    if mechanism == "blt":
        epoch = min(steps, max(1, int(1 / sample_rate + 1e-9)))
        return BLT(steps, 3 if buffers is None else buffers, cycle_length=epoch,
                   workload=workload, momentum=momentum)
    mech = check_mechanism(mechanism)
    if mech is not None:
        if mech.steps != steps:
            raise ValueError(f"{mech} was made for {mech.steps} releases; this run takes "
                             f"{steps}: make it with steps={steps}")
        check_sampling(mech, sample_rate)
    return mech


class _Cycle:
    """A mechanism's sampling before it is made (for :func:`check_sampling`'s message)."""

    def __init__(self, bands: int) -> None:
        self.cycle_length = bands

    def __repr__(self) -> str:
        return f"mechanism='bandmf', bands={self.cycle_length}"
