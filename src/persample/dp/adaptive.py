"""Adaptive clipping: the clipping norm ``C`` follows a quantile of the per-sample
gradient norms, itself estimated with differential privacy (Andrew, Thakkar, McMahan
& Ramaswamy 2021, "Differentially Private Learning with Adaptive Clipping"; Opacus's
``clipping="adaptive"``).

Each step counts the samples whose gradient was not clipped (``||g_i|| + 1e-6 <= C``),
adds ``N(0, sigma_b^2)`` to the count, and moves ``C`` geometrically towards the
``gamma`` quantile of the norms:

    C <- clamp(C * exp(-eta * (b / B' - gamma)), min_clipbound, max_clipbound)

with ``b`` the noised count and ``B'`` the expected batch size (not the batch's size,
which Poisson sampling makes private). The count is a second query on the same batch:
its indicator ``1[unclipped] - 1/2`` has sensitivity ``1/2``, so the gradient's noise
multiplier becomes ``sigma_g = (sigma^-2 - (2 sigma_b)^-2)^(-1/2)`` and the two queries
together cost exactly one Gaussian step of ``sigma`` (the accountant records
``sigma``). That needs ``sigma < 2 sigma_b``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .clipping import STABILITY
from .noise import SecureSource, gaussian_like


@dataclass(frozen=True)
class AdaptiveClipping:
    """The options of adaptive clipping (the module docstring gives the update and its
    privacy): pass one as ``PrivateStep(..., adaptive_clipping=)``, with
    ``max_grad_norm`` the first ``C``.

    Args:
        target_unclipped_quantile: ``gamma`` in ``[0, 1]``, the fraction of samples to
            leave unclipped (0.5: ``C`` follows the median norm).
        unclipped_num_std: ``sigma_b > 0``, the std of the noise on the count of
            unclipped samples (a sample's count); Andrew et al. take ``B' / 20``.
        clipbound_learning_rate: ``eta > 0`` of the geometric update.
        max_clipbound, min_clipbound: the bounds ``C`` stays within, ``0 <= min <=
            max``.

    Raises:
        ValueError: an option outside its range (named).

    Examples:
        >>> ada = AdaptiveClipping(target_unclipped_quantile=0.5, unclipped_num_std=2.0)
        >>> round(ada.gradient_noise_multiplier(1.0), 4)  # (1 - 1/16)^-1/2
        1.0328
        >>> ada.updated(1.0, unclipped=8.0, expected_batch_size=16)  # half unclipped
        1.0

    Source: Andrew et al. 2021 (NeurIPS), Algorithm 1; Opacus's ``AdaClipDPOptimizer``
    for the option names.
    """

    target_unclipped_quantile: float
    unclipped_num_std: float
    clipbound_learning_rate: float = 0.2
    max_clipbound: float = math.inf
    min_clipbound: float = 0.0

    def __post_init__(self) -> None:
        checks = {
            "target_unclipped_quantile must be in [0, 1]":
                0 <= self.target_unclipped_quantile <= 1,
            "unclipped_num_std must be > 0 (the count is noised too)":
                self.unclipped_num_std > 0,
            "clipbound_learning_rate must be > 0": self.clipbound_learning_rate > 0,
            "need 0 <= min_clipbound <= max_clipbound":
                0 <= self.min_clipbound <= self.max_clipbound,
        }
        for message, ok in checks.items():
            if not ok:
                raise ValueError(f"AdaptiveClipping: {message}, got {self}")

    def gradient_noise_multiplier(self, sigma: float) -> float:
        """``sigma_g = (sigma^-2 - (2 sigma_b)^-2)^(-1/2)``: the gradient's noise
        multiplier for a step whose two queries together cost ``sigma`` (0 for 0).

        Raises:
            ValueError: ``sigma >= 2 sigma_b`` (the count's noise alone would spend more).
        """
        if sigma == 0:
            return 0.0
        count_sigma = 2 * self.unclipped_num_std
        if sigma >= count_sigma:
            raise ValueError(
                f"adaptive clipping needs noise_multiplier < 2 * unclipped_num_std "
                f"({count_sigma:g}), got {sigma:g}: the noisy count of unclipped samples "
                "spends privacy too; raise unclipped_num_std")
        return (sigma ** -2 - count_sigma ** -2) ** -0.5

    def noised_count(self, unclipped: float, generator: torch.Generator | SecureSource | None,
                     like: Tensor) -> float:
        """``unclipped + N(0, sigma_b^2)``, drawn from the step's noise generator on
        ``like``'s device."""
        zero = torch.zeros((), dtype=torch.float64, device=like.device)
        return unclipped + float(gaussian_like([zero], self.unclipped_num_std, generator)[0])

    def updated(self, max_grad_norm: float, unclipped: float,
                expected_batch_size: float) -> float:
        """The next ``C`` from this step's (noised) count of unclipped samples."""
        frac = unclipped / expected_batch_size
        step = math.exp(-self.clipbound_learning_rate * (frac - self.target_unclipped_quantile))
        return min(max(max_grad_norm * step, self.min_clipbound), self.max_clipbound)


def unclipped_count(norms: Tensor, max_grad_norm: float) -> int:
    """The samples whose gradient flat clipping leaves as it is: ``||g_i|| + 1e-6 <= C``
    (their clip factor is 1).

    Examples:
        >>> unclipped_count(torch.tensor([0.5, 1.5, 0.9]), 1.0)
        2
    """
    return int((norms + STABILITY <= max_grad_norm).sum())
