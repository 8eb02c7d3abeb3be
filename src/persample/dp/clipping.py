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
class ClipBounds:
    """A :class:`Clipping` bound to a step's parameters: ``groups`` of parameter names,
    each with its bound (the norm its part of a sample's gradient is clipped to, or
    normalised to when ``automatic``).

    Attributes:
        groups: the parameter names of each group, every trainable parameter in one.
        bounds: ``C_g > 0`` per group, in loss units per parameter unit.
        automatic: ``c = C_g / (||g|| + gamma)`` instead of ``min(1, C_g / (||g|| +
            1e-6))``.
        gamma: the stability constant of automatic clipping, ``> 0``.

    Examples:
        >>> clip = Clipping.flat(1.0).bound(["w", "b"])
        >>> clip.groups, clip.sensitivity
        ((('w', 'b'),), 1.0)
        >>> Clipping.grouped([3.0, 4.0], [["w"], ["b"]]).bound(["w", "b"]).sensitivity
        5.0
        >>> Clipping.automatic().bound(["w", "b"]).sensitivity
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

    def factors(self, squared: dict[str, Tensor]) -> dict[str, Tensor]:
        """Each parameter's per-sample factors ``(n,)`` from the squared per-sample norms
        ``{name: (n,)}`` of every parameter (at least float32): the same for every
        parameter of a group.

        Examples:
            >>> clip = Clipping.flat(1.0).bound(["w"])
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


@dataclass(frozen=True)
class Clipping:
    """How each sample's gradient is clipped: the one value every DP front door takes as
    ``clipping=`` (:class:`~persample.dp.PrivateStep`, :func:`~persample.dp.private_grad`,
    :func:`~persample.dp.make_private`, ``PrivacyEngine.make_private`` and
    ``PrivacyArguments``). ``max_grad_norm=C`` is the Opacus-compatible shorthand for
    ``clipping=Clipping.flat(C)``.

    Build it with :meth:`flat`, :meth:`layerwise`, :meth:`grouped` or :meth:`automatic`
    (the module docstring gives each kind's sensitivity and source).

    Attributes:
        max_grad_norm: ``C > 0`` (flat, or per layer), a tuple of ``C_g > 0`` (one per
            group of ``param_groups``), or ``"automatic"``; in loss units per parameter
            unit.
        per_layer: each parameter its own group, bound ``C / sqrt(K)``.
        param_groups: tuples of parameter names (as ``named_parameters()`` gives them),
            every trainable parameter in exactly one, or ``None``.
        automatic_gamma: ``gamma > 0`` of automatic clipping.
        adaptive: a :class:`~persample.dp.AdaptiveClipping` (flat clipping only):
            ``max_grad_norm`` is then the first ``C``, moved at each release towards a
            quantile of the per-sample norms (Andrew et al. 2021), or ``None``.

    Raises:
        ValueError: a bound that is not a positive finite number, a tuple of bounds
            without ``param_groups`` (or of another length), ``per_layer`` with
            ``param_groups``, a bad ``automatic_gamma``, or ``adaptive`` with anything
            but flat clipping. Names are checked against the model's by :meth:`bound`.

    Examples:
        >>> Clipping.flat(1.0).bound(["w", "b"]).sensitivity
        1.0
        >>> Clipping.layerwise(1.0).bound(["w", "b"]).bounds  # C / sqrt(2) each
        (0.7071067811865475, 0.7071067811865475)
        >>> Clipping.grouped([3.0, 4.0], [["w"], ["b"]]).bound(["w", "b"]).sensitivity
        5.0
        >>> Clipping.flat(-1.0)
        Traceback (most recent call last):
        ...
        ValueError: max_grad_norm (the clipping norm C) must be a positive number, got -1.0
    """

    max_grad_norm: Any
    per_layer: bool = False
    param_groups: tuple[tuple[str, ...], ...] | None = None
    automatic_gamma: float = 0.01
    adaptive: Any = None

    def __post_init__(self) -> None:
        norm = self.max_grad_norm
        if isinstance(norm, list):
            object.__setattr__(self, "max_grad_norm", norm := tuple(norm))
        if self.param_groups is not None and not isinstance(self.param_groups, str):
            object.__setattr__(self, "param_groups", tuple(
                tuple(g) if isinstance(g, (list, tuple)) else g for g in self.param_groups))
        self.bound(None)  # the checks that need no names
        if self.adaptive is not None and (self.per_layer or self.param_groups is not None
                                          or not _positive(norm)):
            raise ValueError("adaptive_clipping moves one clipping norm: give max_grad_norm "
                             "as a number (the first C), without per_layer or param_groups")

    @classmethod
    def flat(cls, max_grad_norm: float, *, adaptive: Any = None) -> Clipping:
        """The whole per-sample gradient clipped to ``max_grad_norm`` (``C``; with
        ``adaptive``, the first ``C``). Abadi et al. 2016."""
        return cls(max_grad_norm, adaptive=adaptive)

    @classmethod
    def layerwise(cls, max_grad_norm: float) -> Clipping:
        """Each parameter tensor clipped to ``C / sqrt(K)`` on its own (``K`` tensors).
        McMahan et al. 2018."""
        return cls(max_grad_norm, per_layer=True)

    @classmethod
    def grouped(cls, max_grad_norms: Sequence[float],
                param_groups: Sequence[Sequence[str]]) -> Clipping:
        """Group ``g`` of ``param_groups`` (parameter names) clipped together to
        ``max_grad_norms[g]``. McMahan et al. 2018; He et al. 2022."""
        return cls(tuple(max_grad_norms), param_groups=param_groups)

    @classmethod
    def automatic(cls, gamma: float = 0.01, *, per_layer: bool = False) -> Clipping:
        """``c_i = 1 / (||g_i|| + gamma)``: no threshold to tune (Bu et al. 2023); with
        ``per_layer`` each parameter normalised to ``1 / sqrt(K)``."""
        return cls(AUTOMATIC, per_layer=per_layer, automatic_gamma=gamma)

    @classmethod
    def resolve(cls, clipping: Clipping | None, max_grad_norm: Any = None, *,
                per_layer: bool = False, param_groups: Sequence[Sequence[str]] | None = None,
                automatic_gamma: float = 0.01, adaptive_clipping: Any = None) -> Clipping:
        """The clipping of a front door called with ``clipping=`` or with the shorthand
        keywords (``max_grad_norm=`` and the options beside it), not both.

        Raises:
            TypeError: ``clipping`` is not a :class:`Clipping`.
            ValueError: both or neither given, or what :class:`Clipping` raises.
        """
        shorthand = (max_grad_norm is not None or per_layer or param_groups is not None
                     or automatic_gamma != 0.01 or adaptive_clipping is not None)
        if clipping is not None:
            if not isinstance(clipping, Clipping):
                raise TypeError(f"clipping must be a persample.dp.Clipping (Clipping.flat(C), "
                                f".layerwise, .grouped, .automatic), got {clipping!r}")
            if shorthand:
                raise ValueError("pass clipping= or max_grad_norm= (with per_layer, "
                                 "param_groups, automatic_gamma, adaptive_clipping), not both")
            return clipping
        if max_grad_norm is None:
            raise ValueError("how to clip is required: clipping=persample.dp.Clipping.flat(C) "
                             "(or another kind), or max_grad_norm=C")
        return cls(max_grad_norm, per_layer, param_groups, automatic_gamma, adaptive_clipping)

    @property
    def sensitivity(self) -> float:
        """``S``, the most any one sample's clipped gradient can move the sum (the noise's
        std is ``sigma * S``): ``C`` flat or per layer, ``sqrt(sum_g C_g^2)`` by groups,
        1 automatic (with adaptive clipping, of the first ``C``)."""
        if isinstance(self.max_grad_norm, str):
            return 1.0
        if isinstance(self.max_grad_norm, tuple):
            return math.sqrt(sum(b * b for b in self.max_grad_norm))
        return float(self.max_grad_norm)

    def bound(self, names: Sequence[str] | None) -> ClipBounds:
        """This clipping over a step's parameters ``names`` (``named_parameters()``
        order): their groups and bounds. ``names=None`` runs only the checks that need
        no names (what :class:`Clipping` does when made; the groups come out empty).

        Raises:
            ValueError: groups that miss, repeat or name unknown parameters, and what
                :class:`Clipping` raises.
        """
        max_grad_norm, per_layer = self.max_grad_norm, self.per_layer
        param_groups, automatic_gamma = self.param_groups, self.automatic_gamma
        check_only = names is None
        names = [] if names is None else list(names)
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
            groups = (_checked_shape(param_groups) if check_only
                      else _checked_groups(param_groups, names))
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
                bounds = [total / math.sqrt(max(len(names), 1))] * len(names)
            else:
                groups, bounds = [tuple(names)], [total]
        return ClipBounds(tuple(groups), tuple(bounds), auto, float(automatic_gamma))


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


def _checked_shape(param_groups: Any) -> list[tuple[str, ...]]:
    """``param_groups`` as tuples of names; ``ValueError`` unless a non-empty list of
    non-empty lists of names."""
    if isinstance(param_groups, str) or not all(
            isinstance(g, (list, tuple)) and g and all(isinstance(n, str) for n in g)
            for g in param_groups) or not param_groups:
        raise ValueError("param_groups must be a non-empty list of non-empty lists of "
                         f"parameter names (as in named_parameters()), got {param_groups!r}")
    return [tuple(g) for g in param_groups]


def _checked_groups(param_groups: Sequence[Sequence[str]], names: list[str]
                    ) -> list[tuple[str, ...]]:
    """``param_groups`` as tuples, each of ``names`` in exactly one; else ``ValueError``."""
    _checked_shape(param_groups)
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
