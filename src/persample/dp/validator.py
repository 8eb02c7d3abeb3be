"""Opacus's ``ModuleValidator``, for the one kind of layer persample cannot take in
DP training: a batch normalisation, which mixes the samples of a batch in training mode
(its per-sample gradients are not defined). Every other layer Opacus's validator fixes
(LSTM, multi-head attention, instance normalisation with running statistics) persample
takes as it is.

``fix`` replaces each ``BatchNorm1d/2d/3d`` and ``SyncBatchNorm`` by a ``GroupNorm`` of
``gcd(32, C)`` groups, as Opacus's default fixer does (Wu & He 2018, "Group
Normalization"; Opacus, Yousefpour et al. 2021).
"""

from __future__ import annotations

import copy
import math
from typing import Any

from torch import nn

from ..errors import UnsupportedModuleError


class ModuleValidator:
    """``validate``, ``is_valid``, ``fix`` and ``fix_and_validate`` as Opacus's
    ``opacus.validators.ModuleValidator`` has them.

    Examples:
        >>> net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU())
        >>> [str(e).split(":")[0] for e in ModuleValidator.validate(net)]
        ["module '1' (BatchNorm2d) mixes the samples of a batch"]
        >>> fixed = ModuleValidator.fix(net)
        >>> type(fixed[1]).__name__, fixed[1].num_groups, ModuleValidator.is_valid(fixed)
        ('GroupNorm', 8, True)

    Source: Opacus (Yousefpour et al. 2021), ``opacus.validators``.
    """

    @classmethod
    def validate(cls, module: nn.Module, *, strict: bool = False
                 ) -> list[UnsupportedModuleError]:
        """The layers of ``module`` DP training cannot take, one error each naming it.

        Args:
            module: the model.
            strict: raise the first error instead of returning them.

        Returns:
            A list of :class:`~persample.errors.UnsupportedModuleError` (empty: valid).

        Raises:
            UnsupportedModuleError: with ``strict=True``, for an invalid module.
        """
        errors = [UnsupportedModuleError(
            f"module '{name}' ({type(m).__name__}) mixes the samples of a batch: in "
            "training mode it normalises with the batch's statistics, so per-sample "
            "gradients are not defined. ModuleValidator.fix(model) replaces it by a "
            "GroupNorm (as Opacus's does)")
            for name, m in module.named_modules()
            if isinstance(m, nn.modules.batchnorm._BatchNorm)]
        if strict and errors:
            raise errors[0]
        return errors

    @classmethod
    def is_valid(cls, module: nn.Module) -> bool:
        """Whether :meth:`validate` finds nothing."""
        return not cls.validate(module)

    @classmethod
    def fix(cls, module: nn.Module, **kwargs: Any) -> nn.Module:
        """A copy of ``module`` with each batch normalisation replaced by a ``GroupNorm``
        of ``num_groups`` groups (keyword; default ``gcd(32, C)``) on its device and in
        its dtype; ``module`` itself unchanged."""
        num_groups = kwargs.get("num_groups")
        fixed = copy.deepcopy(module)
        if isinstance(fixed, nn.modules.batchnorm._BatchNorm):
            return _group_norm(fixed, num_groups)
        for name, m in list(fixed.named_modules()):
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                parent_name, _, child = name.rpartition(".")
                parent = fixed.get_submodule(parent_name) if parent_name else fixed
                setattr(parent, child, _group_norm(m, num_groups))
        return fixed

    @classmethod
    def fix_and_validate(cls, module: nn.Module, **kwargs: Any) -> nn.Module:
        """:meth:`fix`, then :meth:`validate` with ``strict=True``."""
        fixed = cls.fix(module, **kwargs)
        cls.validate(fixed, strict=True)
        return fixed


def _group_norm(bn: nn.modules.batchnorm._BatchNorm, num_groups: int | None) -> nn.GroupNorm:
    """A ``GroupNorm`` in place of ``bn``: its channels, its ``affine`` and ``eps``."""
    groups = num_groups or math.gcd(32, bn.num_features)
    like = next(bn.parameters(), None)
    norm = nn.GroupNorm(groups, bn.num_features, eps=bn.eps, affine=bn.affine)
    return norm if like is None else norm.to(device=like.device, dtype=like.dtype)
