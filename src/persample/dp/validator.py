"""Opacus's ``ModuleValidator``, for the one kind of layer persample cannot take in
DP training: a batch normalisation, which mixes the samples of a batch in training mode
(its per-sample gradients are not defined). Every other layer Opacus's validator fixes
(LSTM, multi-head attention, instance normalisation with running statistics) persample
takes as it is.

``fix`` replaces each ``BatchNorm1d/2d/3d`` and ``SyncBatchNorm`` by a ``GroupNorm`` of
``gcd(32, C)`` groups, as Opacus's default fixer does (Wu & He 2018, "Group
Normalization"; Opacus, Yousefpour et al. 2021), or with ``replace_bn_with_in=True`` by
an ``InstanceNorm`` of its dims (Ulyanov et al. 2016); each replacement is logged (at
``INFO``, logger ``persample.dp.validator``), as Opacus logs them.

Two differences from Opacus's validator, both from what persample checks: a batch
normalisation whose own parameters are frozen (or that has none) is still invalid, since
its batch statistics mix the samples of everything upstream; and a model in evaluation
mode is not invalid for that (Opacus's validator asks for training mode): its mode is
the user's to choose.
"""

from __future__ import annotations

import copy
import logging
import math
from typing import Any

from torch import nn

from ..errors import MixesSamplesError

logger = logging.getLogger(__name__)


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
                 ) -> list[MixesSamplesError]:
        """The layers of ``module`` DP training cannot take, one error each naming it.

        Args:
            module: the model.
            strict: raise the first error instead of returning them.

        Returns:
            A list of :class:`~persample.errors.MixesSamplesError` (empty: valid), a
            subclass of :class:`~persample.errors.UnsupportedModuleError` (as Opacus's
            validator's errors are its ``UnsupportedModuleError``) and of ``ValueError``.

        Raises:
            MixesSamplesError: with ``strict=True``, for an invalid module.
        """
        errors = [MixesSamplesError(
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
        of ``num_groups`` groups (keyword; default ``gcd(32, C)``), or with
        ``replace_bn_with_in=True`` by an ``InstanceNorm1d/2d/3d`` of its channels, on its
        device and in its dtype; ``module`` itself unchanged.

        Raises:
            ValueError: both ``replace_bn_with_in=True`` and ``num_groups``; a
                ``SyncBatchNorm`` with ``replace_bn_with_in=True`` (no InstanceNorm of
                its dims: use a GroupNorm).
        """
        num_groups = kwargs.get("num_groups")
        instance = bool(kwargs.get("replace_bn_with_in", False))
        if instance and num_groups is not None:
            raise ValueError("replace_bn_with_in=True and num_groups are exclusive: an "
                             "InstanceNorm has no groups")

        def replaced(name: str, bn: nn.modules.batchnorm._BatchNorm) -> nn.Module:
            norm = _instance_norm(bn) if instance else _group_norm(bn, num_groups)
            logger.info("Replaced sub_module %s : %s with %s", name or "<root>", bn, norm)
            return norm

        fixed = copy.deepcopy(module)
        if isinstance(fixed, nn.modules.batchnorm._BatchNorm):
            return replaced("", fixed)
        for name, m in list(fixed.named_modules()):
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                parent_name, _, child = name.rpartition(".")
                parent = fixed.get_submodule(parent_name) if parent_name else fixed
                setattr(parent, child, replaced(name, m))
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
    return _like(bn, nn.GroupNorm(groups, bn.num_features, eps=bn.eps, affine=bn.affine))


def _instance_norm(bn: nn.modules.batchnorm._BatchNorm) -> nn.Module:
    """An ``InstanceNorm`` of ``bn``'s dims in place of it: its channels, ``affine`` and
    ``eps``, no running statistics (each sample normalised by its own)."""
    kinds = {nn.BatchNorm1d: nn.InstanceNorm1d, nn.BatchNorm2d: nn.InstanceNorm2d,
             nn.BatchNorm3d: nn.InstanceNorm3d}
    kind = next((v for k, v in kinds.items() if isinstance(bn, k)), None)
    if kind is None:
        raise ValueError(f"replace_bn_with_in=True: {type(bn).__name__} has no InstanceNorm "
                         "of its dims; replace it by a GroupNorm (the default fix)")
    return _like(bn, kind(bn.num_features, eps=bn.eps, affine=bn.affine))


def _like(bn: nn.Module, norm: nn.Module) -> nn.Module:
    """``norm`` on ``bn``'s device and in its dtype."""
    like = next(bn.parameters(), None)
    return norm if like is None else norm.to(device=like.device, dtype=like.dtype)
