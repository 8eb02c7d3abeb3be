"""How each sample's gradient is clipped, and the sensitivity that follows.

A DP-SGD step adds ``N(0, sigma^2 S^2 I)`` to the sum of the clipped per-sample
gradients, where ``S`` bounds the norm of any one sample's clipped gradient (the sum's
sensitivity). :class:`Clipping` is one of four ways to clip, each with its ``S``:

- **flat** (``max_grad_norm=C``): ``c_i = min(1, C / (||g_i|| + 1e-6))``, ``S = C``
  (Abadi et al. 2016).
- **per layer** (``per_layer=True``): each parameter tensor ``k`` of ``K`` clipped to
  ``C / sqrt(K)`` on its own, so ``S = sqrt(K (C / sqrt(K))^2) = C``: the budget split
  equally (McMahan et al. 2018, "A General Approach to Adding Differential Privacy to
  Iterative Training Procedures", per-layer clipping; Opacus's per-layer optimizer).
- **groups** (``max_grad_norm=[C_1, ..., C_m]`` with ``param_groups``): the parameters of
  group ``g`` clipped together to ``C_g``, so ``S = sqrt(sum_g C_g^2)``, and every
  coordinate gets noise of that one std ``sigma S`` (McMahan et al. 2018; He et al.
  2022, "Exploring the Limits of Differentially Private Deep Learning with Group-wise
  Clipping"; Opacus's per-layer optimizer takes ``S`` the same way).
- **automatic** (``max_grad_norm="automatic"``): ``c_i = 1 / (||g_i|| + gamma)``, so every
  clipped gradient has norm below 1 and ``S = 1``: no threshold to tune, the learning
  rate takes its place (Bu et al. 2023, "Automatic Clipping: Differentially Private
  Deep Learning Made Easier and Stronger"; with ``per_layer=True`` each parameter is
  normalised to ``1 / sqrt(K)``, their per-layer form).

All of them are one backward: the factors ``c_ig`` of sample ``i`` and group ``g`` come
from the per-sample squared norms of each parameter, which the step has already.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

STABILITY = 1e-6  # c_i = min(1, C / (||g_i|| + STABILITY)), as Opacus
AUTOMATIC = "automatic"


@dataclass(frozen=True)
class Clipping:
    """A clipping rule over named parameters: ``groups`` of parameter names, each with its
    bound (the norm its part of a sample's gradient is clipped to, or normalised to
    when ``automatic``).

    Attributes:
        groups: the parameter names of each group, every trainable parameter in one.
        bounds: ``C_g > 0`` per group, in loss units per parameter unit.
        automatic: ``c = C_g / (||g|| + gamma)`` instead of ``min(1, C_g / (||g|| +
            1e-6))``.
        gamma: the stability constant of automatic clipping, ``> 0``.

    Examples:
        >>> clip = Clipping.of(1.0, ["w", "b"])  # flat
        >>> clip.groups, clip.sensitivity
        ((('w', 'b'),), 1.0)
        >>> Clipping.of([3.0, 4.0], ["w", "b"], param_groups=[["w"], ["b"]]).sensitivity
        5.0
        >>> Clipping.of("automatic", ["w", "b"]).sensitivity
        1.0
    """

    groups: tuple[tuple[str, ...], ...]
    bounds: tuple[float, ...]
    automatic: bool = False
    gamma: float = 0.01

    @property
    def sensitivity(self) -> float:
        """``S = sqrt(sum_g C_g^2)``: the most any one sample's clipped gradient can move
        the sum (the noise's std is ``sigma * S``)."""
        return math.sqrt(sum(b * b for b in self.bounds))

    @classmethod
    def of(cls, max_grad_norm: Any, names: Sequence[str], *, per_layer: bool = False,
           param_groups: Sequence[Sequence[str]] | None = None,
           automatic_gamma: float = 0.01) -> Clipping:
        """The clipping of a step over the parameters ``names`` (``named_parameters()``
        order).

        Args:
            max_grad_norm: ``C > 0`` (flat, or per layer), a list of ``C_g > 0`` (one per
                group of ``param_groups``), or ``"automatic"``.
            names: the step's trainable parameters' names.
            per_layer: each parameter its own group, bound ``C / sqrt(K)`` (automatic:
                ``1 / sqrt(K)``); not with ``param_groups``.
            param_groups: lists of parameter names, every one of ``names`` in exactly
                one; with a list ``max_grad_norm`` (or ``"automatic"``: each group
                normalised to ``1 / sqrt(m)``).
            automatic_gamma: ``gamma > 0`` of automatic clipping.

        Returns:
            The :class:`Clipping`.

        Raises:
            ValueError: a bound that is not a positive finite number, a list without
                ``param_groups`` (or of another length), groups that miss, repeat or
                name unknown parameters, ``per_layer`` with ``param_groups``, or a bad
                ``automatic_gamma``.
        """
        names = list(names)
        auto = isinstance(max_grad_norm, str)
        if auto and max_grad_norm != AUTOMATIC:
            raise ValueError(f"max_grad_norm must be a number, a list of numbers (one per "
                             f"param_groups group) or 'automatic', got {max_grad_norm!r}")
        if not (_positive(automatic_gamma)):
            raise ValueError(f"automatic_gamma must be a positive number, got "
                             f"{automatic_gamma!r}")
        if per_layer and param_groups is not None:
            raise ValueError("per_layer=True makes each parameter its own group: pass it or "
                             "param_groups, not both")
        if param_groups is not None:
            groups = _checked_groups(param_groups, names)
            if auto:
                bounds = [1.0 / math.sqrt(len(groups))] * len(groups)
            else:
                bounds = _checked_bounds(max_grad_norm, len(groups))
        else:
            if not auto and not _positive(max_grad_norm):
                raise ValueError(
                    "max_grad_norm (the clipping norm C) must be a positive number"
                    + (" (a list needs param_groups, one group per number)"
                       if isinstance(max_grad_norm, (list, tuple)) else "")
                    + f", got {max_grad_norm!r}")
            total = 1.0 if auto else float(max_grad_norm)
            if per_layer:
                groups = [(name,) for name in names]
                bounds = [total / math.sqrt(len(names))] * len(names)
            else:
                groups, bounds = [tuple(names)], [total]
        return cls(tuple(groups), tuple(bounds), auto, float(automatic_gamma))

    def factors(self, squared: dict[str, Tensor]) -> dict[str, Tensor]:
        """Each parameter's per-sample factors ``(n,)`` from the squared per-sample norms
        ``{name: (n,)}`` of every parameter (at least float32): the same for every
        parameter of a group.

        Examples:
            >>> clip = Clipping.of(1.0, ["w"])
            >>> clip.factors({"w": torch.tensor([4.0, 0.25])})["w"]
            tensor([0.5000, 1.0000])
        """
        found = {}
        for names, bound in zip(self.groups, self.bounds):
            norms = torch.stack([squared[name] for name in names]).sum(0).sqrt()  # (n,)
            if self.automatic:
                c = bound / (norms + self.gamma)
            else:
                c = (bound / (norms + STABILITY)).clamp(max=1.0)
            found.update(dict.fromkeys(names, c))
        return found


def _positive(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value) and value > 0)


def _checked_bounds(max_grad_norm: Any, count: int) -> list[float]:
    if not isinstance(max_grad_norm, (list, tuple)) or len(max_grad_norm) != count:
        raise ValueError(f"with {count} param_groups, max_grad_norm must be a list of "
                         f"{count} clipping norms (or 'automatic'), got {max_grad_norm!r}")
    bad = [b for b in max_grad_norm if not _positive(b)]
    if bad:
        raise ValueError(f"every clipping norm must be a positive number, got {bad[0]!r} in "
                         f"max_grad_norm={list(max_grad_norm)!r}")
    return [float(b) for b in max_grad_norm]


def _checked_groups(param_groups: Sequence[Sequence[str]], names: list[str]
                    ) -> list[tuple[str, ...]]:
    """``param_groups`` as tuples, each of ``names`` in exactly one; else ``ValueError``."""
    if isinstance(param_groups, str) or not all(
            isinstance(g, (list, tuple)) and g and all(isinstance(n, str) for n in g)
            for g in param_groups) or not param_groups:
        raise ValueError("param_groups must be a non-empty list of non-empty lists of "
                         f"parameter names (as in named_parameters()), got {param_groups!r}")
    seen: dict[str, int] = {}
    for k, group in enumerate(param_groups):
        for name in group:
            if name not in names:
                raise ValueError(f"param_groups[{k}] names {name!r}, which is not a "
                                 f"trainable parameter of the model; those are {names}")
            if name in seen:
                raise ValueError(f"parameter {name!r} is in param_groups[{seen[name]}] and "
                                 f"param_groups[{k}]: each must be in exactly one group")
            seen[name] = k
    missing = [name for name in names if name not in seen]
    if missing:
        raise ValueError(f"parameter {missing[0]!r} is in no group of param_groups: every "
                         f"trainable parameter must be clipped ({len(missing)} missing)")
    return [tuple(g) for g in param_groups]
