"""Lower-triangular Toeplitz matrices, as the matrix-factorization mechanisms use them.

A lower-triangular Toeplitz ``(T, T)`` matrix is its first column. The workload ``A``
(the prefix sums of SGD's gradients, or SGD with momentum), the strategy ``C`` and the
noise ``C^-1`` of :mod:`persample.dp.banded` and :mod:`persample.dp.blt` are all of this
kind, so the expected error of a strategy and its sensitivity are computed from first
columns, in ``O(T log T)`` or less, in float64 (Toeplitz forms as in McKenna 2024,
"Scaling up the Banded Matrix Factorization Mechanism for Differentially Private ML";
the min-separated sensitivity as in Kalinin & Lampert 2024, "Banded Square Root Matrix
Factorization for Differentially Private Model Training", Theorem 2).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor

WORKLOADS = ("prefix", "momentum")
ERRORS = ("mean", "max")


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


def toeplitz(first: Tensor, steps: int) -> Tensor:
    """The ``(T, T)`` float64 lower-triangular Toeplitz matrix of first column ``first``
    (zeros past its end).

    Examples:
        >>> toeplitz(torch.tensor([1.0, 0.5]), 3).tolist()
        [[1.0, 0.0, 0.0], [0.5, 1.0, 0.0], [0.0, 0.5, 1.0]]
    """
    col = torch.zeros(steps, dtype=torch.float64)
    col[:min(len(first), steps)] = first[:steps]
    k = torch.arange(steps)
    diff = k[:, None] - k[None, :]  # (T, T)
    return torch.where(diff >= 0, col[diff.clamp(min=0)], torch.zeros((), dtype=torch.float64))


def step_errors(noise_coefs: Tensor, workload: Tensor) -> Tensor:
    """``(T,)``: the expected squared error of each step's noisy workload, per unit noise,
    ``||(A C^-1)_t||^2``, from the first columns of ``C^-1`` and ``A`` (``(T,)`` each;
    differentiable). The mean is the papers' RMSE squared; the last is the largest.

    Examples:
        >>> identity = torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64)  # DP-SGD
        >>> step_errors(identity, torch.ones(3, dtype=torch.float64)).tolist()
        [1.0, 2.0, 3.0]
    """
    n = len(noise_coefs)
    if bool((workload == 1).all()):
        b = torch.cumsum(noise_coefs, 0)  # A C^-1's first column, A the prefix sums
    else:
        size = 2 * n
        b = torch.fft.irfft(torch.fft.rfft(workload, size) * torch.fft.rfft(noise_coefs, size),
                            size)[:n]
    return torch.cumsum(b * b, 0)


def separated_sensitivity(coefs: Tensor, cycle_length: int, participations: int) -> Tensor:
    """``(T,)``: ``C u``, ``u`` the indicator of the steps ``0, s, 2s, ...`` (at most
    ``participations`` of them, ``s = cycle_length``); ``C`` the lower-triangular Toeplitz
    matrix of first column ``coefs`` ``(T,)``. With ``coefs`` nonnegative and
    non-increasing, the worst record under ``s``-separated participation takes part
    exactly there (Kalinin & Lampert 2024, Theorem 2), in every leading block of ``C``
    too: the sensitivity of the first ``t`` releases is ``||(C u)_{<t}||``.

    Examples:
        >>> separated_sensitivity(torch.tensor([1.0, 0.5, 0.25, 0.125]), 2, 2).tolist()
        [1.0, 0.5, 1.25, 0.625]
    """
    n, s = len(coefs), cycle_length
    pad = (-n) % s
    v = torch.cat([coefs, coefs.new_zeros(pad)]).reshape(-1, s).cumsum(0)  # (rows, s)
    if participations < len(v):  # (the participations past the k-th: none)
        v = torch.cat([v[:participations], v[participations:] - v[:-participations]])
    return v.reshape(-1)[:n]


def check_int(name: str, value: Any) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``value`` is an int ``>= 1``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def check_strategy(workload: str, error: str, momentum: float) -> None:
    """Raise ``ValueError`` naming the argument unless ``workload`` is one of
    :data:`WORKLOADS`, ``error`` one of :data:`ERRORS` and ``momentum`` in ``[0, 1)``.

    Examples:
        >>> check_strategy("prefix", "mean", 0.9)
        >>> check_strategy("adam", "mean", 0.9)
        Traceback (most recent call last):
        ...
        ValueError: workload must be one of ('prefix', 'momentum'), got 'adam'
    """
    if workload not in WORKLOADS:
        raise ValueError(f"workload must be one of {WORKLOADS}, got {workload!r}")
    if error not in ERRORS:
        raise ValueError(f"error must be one of {ERRORS}, got {error!r}")
    if not (isinstance(momentum, (int, float)) and 0 <= momentum < 1):
        raise ValueError(f"momentum must be in [0, 1), got {momentum!r}")
