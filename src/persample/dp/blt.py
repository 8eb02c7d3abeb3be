"""Buffered linear Toeplitz (BLT) strategies: correlated noise from a few buffers.

A BLT ``C`` with ``d`` buffers is the lower-triangular Toeplitz matrix of first column
``1, sum_i w_i, sum_i w_i theta_i, sum_i w_i theta_i^2, ...`` (buffer decays ``theta``
in ``(0, 1)``, output scales ``w > 0``). Its inverse is a BLT too, of decays
``theta_hat`` and scales ``w_hat`` (Dvijotham et al. 2024, Lemma 5.2: each pair of
decays fixes both sets of scales), so step ``t``'s noise ``(C^-1 Z)_t`` is

    y_t = Z_t + sum_i w_hat_i S_i,     then S_i <- theta_hat_i S_i + Z_t,

with ``d`` parameter-sized states ``S`` however many steps are taken (the banded
recursion of :mod:`persample.dp.banded` keeps ``bands - 1``), and every step's noise
correlated with all earlier draws.

``C``'s columns overlap, so there is no amplification by sampling: a record takes part
in at most ``k = ceil(T / s)`` steps, at least ``s`` apart (``s = cycle_length``: fixed
batches cycled in the same order, an epoch apart, or cyclic Poisson sampling), and the
whole run is one Gaussian mechanism of sensitivity ``||C u||``, ``u`` the worst
participation pattern, ``0, s, 2s, ...`` for a ``C`` of nonnegative non-increasing
coefficients (Kalinin & Lampert 2024, Theorem 2; McMahan et al. 2024). The noise is
scaled by that sensitivity, so that the ``noise_multiplier`` is the run's.

The decays minimise the expected error of the workload times the squared sensitivity
(McMahan et al. 2024, "A Hassle-free Algorithm for Private Learning in Practice: Don't
Use Tree Aggregation, Use BLTs"), by L-BFGS (scipy) in float64 over the pair of decays
(JAX-Privacy's parametrisation), kept interlaced, ``theta_1 > theta_hat_1 > theta_2 >
...``, which makes ``C``'s scales positive and ``C^-1``'s negative (the valid BLTs of
Dvijotham et al. 2025, "An Inversion Theorem for Buffered Linear Toeplitz (BLT)
Matrices"), from the rational approximation of ``(1 - x)^(-1/2)`` (Dvijotham et al.
2024, Proposition 4.5) and a few other starts, each evaluation ``O(T d)`` with its
exact gradient by autograd.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
from torch import Tensor

from .toeplitz import (
    ERRORS,
    check_int,
    check_strategy,
    separated_sensitivity,
    step_errors,
    toeplitz,
    workload_coefs,
)

STARTS = (1 - 1e-4, 1 - 1e-3, 1 - 1e-2, 0.9)  # the largest decay of the even starts


class BLT:
    """A buffered linear Toeplitz strategy ``C`` for ``steps`` releases, optimised for a
    workload under ``cycle_length``-separated participation.

    Args:
        steps: ``T >= 1``, the releases the run will make (more are refused).
        buffers: ``d >= 1``, the noise's parameter-sized states (2 to 4 in practice).
        cycle_length: ``s >= 1``, the fewest steps between two participations of a
            record (the steps of an epoch, for fixed batches cycled in order); default
            ``steps``: each record once.
        workload: ``"prefix"`` (SGD) or ``"momentum"`` (heavy-ball momentum ``momentum``).
        momentum: ``beta`` in ``[0, 1)`` of the ``"momentum"`` workload.
        error: ``"mean"`` (the mean over the steps, the papers' RMSE squared) or
            ``"max"`` (the last step's) squared error, minimised.
        decays: ``(theta, theta_hat)``, each ``(d,)``: the decays of ``C`` and
            ``C^-1``, given instead of optimised (from another library or run).

    Attributes:
        buf_decay, output_scale: ``(d,)`` float64, ``C``'s ``theta`` and ``w``.
        inverse_decay, inverse_scale: ``(d,)`` float64, ``C^-1``'s.
        sensitivity: the run's sensitivity ``||C u||`` for ``C`` with ``C[0, 0] = 1``:
            the noise is scaled by it, so that :attr:`matrix` has sensitivity 1.
        prefix_sensitivity: ``(T,)`` float64, the sensitivity of the first ``t + 1``
            releases, relative to the run's (the last is 1): what the accountant has
            spent after each.

    Raises:
        ValueError: an argument outside its range; ``decays`` of the wrong shape, or
            whose ``C`` is not valid (decays in ``(0, 1]``, scales nonnegative, summing
            to at most 1: nonnegative non-increasing coefficients, which the
            sensitivity needs).
        RuntimeError: the optimisation ended on an invalid ``C`` (try fewer buffers).

    Examples:
        >>> mech = BLT(steps=200, buffers=2, cycle_length=50)  # 4 epochs of 50 batches
        >>> mech.participations(200), mech.matrix.shape
        (4, torch.Size([200, 200]))
        >>> DPSGD = 4 * 201 / 2  # DP-SGD's mean error on the prefix sums, 4 participations
        >>> round(mech.expected_error() / DPSGD, 2) < 0.5
        True

    Source: Dvijotham, McMahan, Pillutla, Steinke & Thakurta 2024, "Efficient and
    Near-Optimal Noise Generation for Streaming Differential Privacy" (FOCS); McMahan,
    Xu & Zhang 2024, "A Hassle-free Algorithm for Private Learning in Practice: Don't
    Use Tree Aggregation, Use BLTs" (EMNLP industry track).
    """

    def __init__(self, steps: int, buffers: int = 3, *, cycle_length: int | None = None,
                 workload: str = "prefix", momentum: float = 0.9, error: str = "mean",
                 decays: tuple[Iterable[float], Iterable[float]] | None = None) -> None:
        check_int("steps", steps)
        check_int("buffers", buffers)
        cycle_length = steps if cycle_length is None else cycle_length
        check_int("cycle_length", cycle_length)
        check_strategy(workload, error, momentum)
        self.steps, self.buffers, self.cycle_length = steps, buffers, cycle_length
        self.workload, self.momentum, self.error = workload, float(momentum), error
        self.most = -(-steps // cycle_length)  # participations of the worst record
        self._workload = torch.from_numpy(workload_coefs(steps, workload, momentum))
        if decays is None:
            theta, theta_hat = optimal_decays(self, buffers)
        else:
            theta, theta_hat = (torch.as_tensor(list(x), dtype=torch.float64) for x in decays)
            if theta.shape != (buffers,) or theta_hat.shape != (buffers,):
                raise ValueError(f"decays must be two sequences of {buffers} numbers, got "
                                 f"shapes {tuple(theta.shape)} and {tuple(theta_hat.shape)}")
        omega, omega_hat = inverse_pair(theta, theta_hat)
        bad = _invalid(theta, omega)
        if bad:
            raise (ValueError if decays is not None else RuntimeError)(
                f"a BLT of decays {theta.tolist()} and scales {omega.tolist()}: {bad}")
        order = torch.argsort(theta, descending=True)
        self.buf_decay, self.output_scale = theta[order], omega[order]
        order = torch.argsort(theta_hat, descending=True)
        self.inverse_decay, self.inverse_scale = theta_hat[order], omega_hat[order]
        v = separated_sensitivity(blt_coefs(self.buf_decay, self.output_scale, steps),
                                  cycle_length, self.most)  # (T,) C u
        prefix = torch.cumsum(v * v, 0).sqrt()  # (T,)
        self.sensitivity = float(prefix[-1])
        self.prefix_sensitivity = prefix / prefix[-1]

    def __repr__(self) -> str:
        return (f"BLT(steps={self.steps}, buffers={self.buffers}, "
                f"cycle_length={self.cycle_length}, workload={self.workload!r})")

    @property
    def matrix(self) -> Tensor:
        """``C`` ``(T, T)`` float64, scaled to sensitivity 1 under the run's
        participation."""
        return toeplitz(blt_coefs(self.buf_decay, self.output_scale, self.steps),
                        self.steps) / self.sensitivity

    @property
    def noise_matrix(self) -> Tensor:
        """``C^-1`` ``(T, T)`` float64 (of :attr:`matrix`): row ``t`` weighs the draws
        ``Z_0 .. Z_t`` of step ``t``'s noise."""
        return toeplitz(blt_coefs(self.inverse_decay, self.inverse_scale, self.steps),
                        self.steps) * self.sensitivity

    def expected_error(self, error: str | None = None) -> float:
        """The squared error of the noisy workload per unit noise multiplier: the mean
        over the steps (``"mean"``) or the last step's (``"max"``) of
        ``||(A C^-1)_t||^2``, times the squared sensitivity (JAX-Privacy's loss).

        Raises:
            ValueError: ``error`` not ``"mean"`` or ``"max"``.
        """
        error = self.error if error is None else error
        if error not in ERRORS:
            raise ValueError(f"error must be one of {ERRORS}, got {error!r}")
        e = step_errors(blt_coefs(self.inverse_decay, self.inverse_scale, self.steps),
                        self._workload)
        return float((e.mean() if error == "mean" else e[-1]) * self.sensitivity ** 2)

    def participations(self, steps: int) -> int:
        """The most of the first ``steps`` releases one record takes part in:
        ``ceil(steps / cycle_length)``."""
        return -(-steps // self.cycle_length)

    # the noise: a ring of d states and the release's draw (persample.dp.mechanisms)
    @property
    def rows(self) -> int:
        """The rows of each parameter's state: ``d`` buffers and the draw."""
        return self.buffers + 1

    def slot_row(self, t: int) -> int:
        """The row release ``t``'s draw goes in: the last."""
        return self.buffers

    def settle(self, ring: Tensor, t: int) -> Tensor:
        """Release ``t``'s noise (flat, before :meth:`noise_scale`) from ``ring``
        ``(d + 1, numel)``, whose last row holds the draw; the states move on."""
        z, states = ring[-1], ring[:-1]
        y = torch.addmv(z, states.t(), self.inverse_scale.to(ring))  # Z_t + sum w_hat S
        states.mul_(self.inverse_decay.to(ring)[:, None]).add_(z)
        return y

    def noise_scale(self, t: int) -> float:
        """The factor of release ``t``'s noise: the run's sensitivity."""
        return self.sensitivity

    # the accounting: one Gaussian mechanism, spent as the sensitivity grows
    def release_runs(self, sigma: float, sample_rate: float, release: int
                     ) -> list[tuple[float, float]]:
        """What release ``release`` (from 0) adds to the accountant: a Gaussian
        ``(sigma / sqrt(P_t^2 - P_{t-1}^2), 1.0)``, ``P`` :attr:`prefix_sensitivity`, so
        that the releases so far compose to the Gaussian of sensitivity ``P_t``."""
        p = self.prefix_sensitivity
        grown = float(p[release] ** 2 - (p[release - 1] ** 2 if release else 0.0))
        if grown <= 1e-15:
            return []
        return [(sigma / math.sqrt(grown), 1.0)]

    def runs(self, sigma: float, sample_rate: float, releases: int
             ) -> list[tuple[float, float, int]]:
        """The first ``releases`` releases for the accountant: the Gaussian mechanism of
        noise multiplier ``sigma / P_{releases-1}``."""
        if releases == 0:
            return []
        return [(sigma / float(self.prefix_sensitivity[releases - 1]), 1.0, 1)]


def blt_coefs(decay: Tensor, scale: Tensor, steps: int) -> Tensor:
    """``(T,)``: the first column of the BLT: ``1, sum_i w_i theta_i^(k-1)`` for
    ``k >= 1`` (differentiable in ``decay`` and ``scale``, ``(d,)`` each).

    Examples:
        >>> blt_coefs(torch.tensor([0.5]), torch.tensor([0.25]), 4).tolist()
        [1.0, 0.25, 0.125, 0.0625]
    """
    k = torch.arange(steps - 1, dtype=decay.dtype)
    rest = torch.exp(k[:, None] * torch.log(decay)[None, :]) @ scale  # (T - 1,)
    return torch.cat([torch.ones(1, dtype=decay.dtype), rest])


def inverse_pair(theta: Tensor, theta_hat: Tensor) -> tuple[Tensor, Tensor]:
    """The output scales ``(w, w_hat)`` that make the BLTs of decays ``theta`` and
    ``theta_hat`` inverse to each other: ``w_i = prod_j (theta_i - theta_hat_j) /
    prod_{j != i} (theta_i - theta_j)`` and the same with the roles swapped
    (Dvijotham et al. 2024, Lemma 5.2).

    Examples:
        >>> w, w_hat = inverse_pair(torch.tensor([0.5]), torch.tensor([0.25]))
        >>> w.tolist(), w_hat.tolist()
        ([0.25], [-0.25])
    """
    def scales(a: Tensor, b: Tensor) -> Tensor:
        num = (a[:, None] - b[None, :]).prod(1)
        den = (a[:, None] - a[None, :] + torch.eye(len(a), dtype=a.dtype)).prod(1)
        return num / den

    return scales(theta, theta_hat), scales(theta_hat, theta)


def _invalid(theta: Tensor, omega: Tensor) -> str:
    """What makes the BLT unfit for the min-separated sensitivity (empty: nothing)."""
    if not bool(((theta > 0) & (theta <= 1)).all()):
        return "its decays must lie in (0, 1]"
    if not bool((omega >= 0).all()):
        return "its output scales must be nonnegative"
    if float(omega.sum()) > 1 + 1e-12:
        return "its scales must sum to at most 1 (non-increasing coefficients)"
    return ""


def start_decays(buffers: int, top: float = 1 - 1e-6) -> tuple[np.ndarray, np.ndarray]:
    """``(theta, theta_hat)``: the rational approximation of ``(1 - x)^(-1/2)`` by
    ``buffers`` poles (Dvijotham et al. 2024, Proposition 4.5), ``C``'s decays below 1.

    Examples:
        >>> theta, theta_hat = start_decays(2)
        >>> bool((theta_hat < theta).all() and (theta < 1).all())
        True
    """
    d1 = (buffers + 1) // 2
    h = 1.6 * math.pi / math.sqrt(2 * (d1 + 1))
    ks = np.arange(-d1 + 1, buffers - d1 + 1) - 1
    theta_hat = 1 / (1 + np.exp(2 * h * ks))
    omega_hat = -theta_hat ** 2 * np.exp(3 * h * ks) / np.sum(np.exp(h * ks) * theta_hat)
    theta = _inverse_decays(theta_hat, omega_hat)  # C's
    omega = inverse_pair(torch.from_numpy(theta), torch.from_numpy(theta_hat))[0].numpy()
    theta = theta * min(1.0, top / theta.max())  # (the largest decay at most top)
    # its Pillutla score sum(w / theta) below 1 (Dvijotham et al. 2025, Theorem 1 (a)):
    omega = omega * min(1.0, (1 - 1e-6) / float(np.sum(omega / theta)))
    return np.sort(theta)[::-1].copy(), np.sort(_inverse_decays(theta, omega))[::-1].copy()


def _inverse_decays(theta: np.ndarray, omega: np.ndarray) -> np.ndarray:
    """The decays of a BLT's inverse: the eigenvalues of its state matrix
    ``diag(theta) - w 1^T`` (real for the BLTs here)."""
    return np.linalg.eigvals(np.diag(theta) - np.outer(omega, np.ones(len(theta)))).real


def even_decays(buffers: int, top: float) -> tuple[np.ndarray, np.ndarray]:
    """``(theta, theta_hat)``: interlaced decays of evenly spaced logits from ``top`` down
    to ``sigmoid(-3)`` (a start for multiple participations, whose optimum stays further
    from 1 than the rational approximation's).

    Examples:
        >>> theta, theta_hat = even_decays(2, 0.99)
        >>> round(float(theta[0]), 2), bool(theta[0] > theta_hat[0] > theta[1] > theta_hat[1])
        (0.99, True)
    """
    z = np.linspace(math.log(top / (1 - top)), -3.0, 2 * buffers)
    u = 1 / (1 + np.exp(-z))
    return u[0::2], u[1::2]


def optimal_decays(mech: BLT, buffers: int, max_iterations: int = 1000
                   ) -> tuple[Tensor, Tensor]:
    """``(theta, theta_hat)`` ``(d,)`` each, float64: the BLT of least expected error
    times squared sensitivity for ``mech``'s steps, workload and participation, by
    L-BFGS (scipy) over interlaced decays ``1 > theta_1 > theta_hat_1 > theta_2 > ...
    > theta_hat_d > 0``, which make both BLTs valid (positive scales for ``C``,
    negative for ``C^-1``), from :func:`start_decays` and a few :func:`even_decays`
    (the loss has local minima), the best kept.

    Examples:
        >>> mech = BLT(50, 1, decays=([0.5], [0.25]))  # a BLT whose plan is reused
        >>> theta, theta_hat = optimal_decays(mech, 1)
        >>> bool(0 < theta_hat[0] < theta[0] < 1)
        True

    Source: McMahan, Xu & Zhang 2024 (the loss); Dvijotham et al. 2024, Lemma 5.2 (the
    scales from the decays).
    """
    from scipy.optimize import minimize

    identity = torch.zeros(mech.steps, dtype=torch.float64)
    identity[0] = 1.0
    dpsgd = mech.most * float(step_errors(identity, mech._workload).mean())  # the scale

    def objective(x: np.ndarray) -> tuple[float, np.ndarray]:
        xt = torch.tensor(x, dtype=torch.float64, requires_grad=True)
        theta, theta_hat = _interlaced(xt)
        loss = _loss(mech, theta, theta_hat) / dpsgd
        if not torch.isfinite(loss):
            return 1e30, np.zeros_like(x)
        loss.backward()
        return float(loss.detach()), xt.grad.numpy()

    def run(x: np.ndarray) -> Any:
        return minimize(objective, x, jac=True, method="L-BFGS-B",
                        options={"maxiter": max_iterations, "ftol": 1e-11, "gtol": 1e-9})

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # (vectors of T: threads cost more than they give, 7x)
    try:
        starts = [start_decays(buffers)] + [even_decays(buffers, top) for top in STARTS]
        best = min((run(_uninterlaced(*start)) for start in starts), key=lambda f: f.fun)
        for _ in range(5):  # restarts from the best (fresh curvature) while they help
            found = run(best.x)
            if not found.fun < best.fun - 1e-13 * abs(best.fun):
                break
            best = found
    finally:
        torch.set_num_threads(threads)
    with torch.no_grad():
        return _interlaced(torch.from_numpy(best.x))


def _interlaced(x: Tensor) -> tuple[Tensor, Tensor]:
    """``(2d,)`` unconstrained -> ``(theta, theta_hat)``: the logits of the interlaced
    decays go down from ``x_0`` by ``softplus(x_k)`` steps."""
    logits = torch.cat([x[:1], x[:1] - torch.cumsum(torch.nn.functional.softplus(x[1:]), 0)])
    u = torch.sigmoid(logits)  # (2d,) decreasing in (0, 1)
    return u[0::2], u[1::2]


def _uninterlaced(theta: np.ndarray, theta_hat: np.ndarray) -> np.ndarray:
    """The inverse of :func:`_interlaced` (decays interlaced, largest first)."""
    u = np.empty(2 * len(theta))
    u[0::2], u[1::2] = theta, theta_hat
    logits = np.log(u) - np.log1p(-u)
    steps = logits[:-1] - logits[1:]
    if not (steps > 0).all():
        raise RuntimeError(f"start decays not interlaced: {theta.tolist()}, "
                           f"{theta_hat.tolist()}")
    return np.concatenate([logits[:1], np.log(np.expm1(steps))])


def _loss(mech: BLT, theta: Tensor, theta_hat: Tensor) -> Tensor:
    """The loss: ``error(C^-1) * sensitivity(C)^2`` (JAX-Privacy's)."""
    omega, omega_hat = inverse_pair(theta, theta_hat)
    e = step_errors(blt_coefs(theta_hat, omega_hat, mech.steps), mech._workload)
    e = e.mean() if mech.error == "mean" else e[-1]
    v = separated_sensitivity(blt_coefs(theta, omega, mech.steps), mech.cycle_length,
                              mech.most)
    return e * (v * v).sum()
