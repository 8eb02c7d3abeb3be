"""The DP-SGD options ``dp-train`` and ``dp-finetune`` share: how gradients are clipped
(flat, per layer, per module, automatic, adaptive), user-level DP and secure noise;
their command-line flags, their checks, and :class:`~persample.dp.PrivateStep`'s
arguments for them.

A config here is any object with the attributes of :class:`DPOptions` (both commands'
dataclasses have them).
"""

from __future__ import annotations

import argparse
import math
from typing import Protocol

from torch import nn

from ..dp import AdaptiveClipping, Clipping

CLIPPINGS = ("flat", "per-layer", "per-module", "automatic", "adaptive")


class DPOptions(Protocol):
    """What :func:`clipping_of` and :func:`check_dp_options` read of a config."""

    clipping: str
    max_grad_norm: float
    automatic_gamma: float
    target_unclipped_quantile: float  # adaptive clipping's gamma
    unclipped_num_std: float | None  # adaptive clipping's sigma_b; None: B' / 20
    clipbound_learning_rate: float  # adaptive clipping's eta
    users: int | None
    records_per_user: int | None
    secure_mode: bool
    nproc: int


def clipping_of(model: nn.Module, cfg: DPOptions, expected_batch_size: float) -> Clipping:
    """The :class:`~persample.dp.Clipping` of ``cfg.clipping``: flat (``C``), per
    layer (each parameter to ``C / sqrt(K)``), per module (the trainable parameters of
    each module as one group, each to ``C / sqrt(m)``), automatic (Bu et al. 2023,
    "Automatic clipping: differentially private deep learning made easier and
    stronger") or adaptive (Andrew et al. 2021: ``C`` the first norm, moving towards
    the ``target_unclipped_quantile`` of the norms; ``sigma_b`` by default ``B' / 20``,
    as the paper takes it, for ``expected_batch_size`` ``B'``).

    Examples:
        >>> from types import SimpleNamespace
        >>> net = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1))
        >>> cfg = SimpleNamespace(clipping="per-module", max_grad_norm=2.0)
        >>> clip = clipping_of(net, cfg, expected_batch_size=64)
        >>> clip.max_grad_norm, clip.param_groups
        ((1.414..., 1.414...), (('0.weight', '0.bias'), ('2.weight', '2.bias')))
    """
    if cfg.clipping == "automatic":
        return Clipping.automatic(cfg.automatic_gamma)
    if cfg.clipping == "adaptive":
        std = cfg.unclipped_num_std or expected_batch_size / 20
        return Clipping.flat(cfg.max_grad_norm, adaptive=AdaptiveClipping(
            target_unclipped_quantile=cfg.target_unclipped_quantile, unclipped_num_std=std,
            clipbound_learning_rate=cfg.clipbound_learning_rate))
    if cfg.clipping == "per-layer":
        return Clipping.layerwise(cfg.max_grad_norm)
    if cfg.clipping == "per-module":
        groups: dict[str, list[str]] = {}
        for name, p in model.named_parameters():
            if p.requires_grad:
                groups.setdefault(name.rpartition(".")[0], []).append(name)
        bound = cfg.max_grad_norm / math.sqrt(len(groups))
        return Clipping.grouped([bound] * len(groups), list(groups.values()))
    return Clipping.flat(cfg.max_grad_norm)


def clipping_label(cfg: DPOptions) -> str:
    """How the run clips, for its report: ``"C 1"``, ``"C 1 per-module"``, ...

    Examples:
        >>> from types import SimpleNamespace
        >>> clipping_label(SimpleNamespace(clipping="per-layer", max_grad_norm=1.0))
        'C 1 per-layer'
    """
    if cfg.clipping == "automatic":
        return f"automatic clipping (gamma {cfg.automatic_gamma:g})"
    if cfg.clipping == "adaptive":
        return (f"adaptive clipping (C from {cfg.max_grad_norm:g} towards the "
                f"{cfg.target_unclipped_quantile:g} quantile)")
    return f"C {cfg.max_grad_norm:g}" + ("" if cfg.clipping == "flat" else f" {cfg.clipping}")


def check_dp_options(cfg: DPOptions) -> None:
    """Raise ``ValueError`` (naming the option and what it takes) for a clipping kind
    outside :data:`CLIPPINGS`, a ``users`` or ``records_per_user`` below 1,
    ``records_per_user`` without ``users``, or adaptive clipping with users or several
    processes (bad adaptive options: :class:`~persample.dp.AdaptiveClipping` names
    them)."""
    if cfg.clipping not in CLIPPINGS:
        raise ValueError(f"clipping must be one of {CLIPPINGS}, got {cfg.clipping!r}")
    if not cfg.automatic_gamma > 0:
        raise ValueError(f"automatic_gamma must be > 0, got {cfg.automatic_gamma}")
    for name in ("users", "records_per_user"):
        if getattr(cfg, name) is not None and getattr(cfg, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(cfg, name)}")
    if cfg.records_per_user is not None and cfg.users is None:
        raise ValueError("records_per_user needs users (user-level DP)")
    if cfg.clipping == "adaptive" and (cfg.users is not None or cfg.nproc > 1):
        raise ValueError("--clipping adaptive runs in one process at record level: not with "
                         "--users or --nproc > 1")


def add_dp_arguments(p: argparse.ArgumentParser, defaults: DPOptions, records: str,
                     dealt: str) -> None:
    """Add ``--clipping``, ``--automatic-gamma``, ``--users``, ``--records-per-user`` and
    ``--secure-mode`` to ``p``; ``records`` names what the users own ("records",
    "windows", ...) and ``dealt`` how they are dealt to the users, in the help."""
    p.add_argument("--clipping", choices=CLIPPINGS, default=defaults.clipping,
                   help="flat: each sample's gradient to C; per-layer: each parameter to "
                   "C/sqrt(K); per-module: each module's parameters together to C/sqrt(m); "
                   "automatic: g/(|g| + gamma), no C (Bu et al. 2023); adaptive: C follows a "
                   "quantile of the norms (Andrew et al. 2021) (default "
                   f"{defaults.clipping})")
    p.add_argument("--automatic-gamma", type=float, default=defaults.automatic_gamma,
                   help=f"gamma of --clipping automatic (default {defaults.automatic_gamma})")
    p.add_argument("--target-unclipped-quantile", type=float,
                   default=defaults.target_unclipped_quantile,
                   help="--clipping adaptive: the fraction of samples C leaves unclipped "
                   f"(default {defaults.target_unclipped_quantile}); --max-grad-norm is the "
                   "first C (Andrew et al. 2021)")
    p.add_argument("--unclipped-num-std", type=float, default=None,
                   help="--clipping adaptive: the noise std of the count of unclipped samples "
                   "(default: the expected batch / 20)")
    p.add_argument("--clipbound-learning-rate", type=float,
                   default=defaults.clipbound_learning_rate,
                   help="--clipping adaptive: the rate C moves at (default "
                   f"{defaults.clipbound_learning_rate})")
    p.add_argument("--users", type=int, default=None,
                   help=f"user-level DP: the training {records} dealt to USERS users ({dealt}); "
                   "--batch-size then counts users, each user's gradient is clipped once, "
                   "epsilon is per user")
    p.add_argument("--records-per-user", type=int, default=None,
                   help=f"with --users: at most this many of a user's {records} per step")
    p.add_argument("--secure-mode", action="store_true",
                   help="draw the noise from the operating system's cryptographically "
                   "secure generator (os.urandom) instead of --seed: about 20 ns a number "
                   "against 2.5; the batches stay seeded")
