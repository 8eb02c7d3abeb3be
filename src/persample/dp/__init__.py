"""Differentially private SGD on per-sample gradients.

- :func:`private_grad`: one DP-SGD step's gradient, clipped and noised, from one
  forward and one backward, written to ``p.grad`` for any ``torch.optim`` optimizer.
- :class:`PrivateStep`: the same over a logical batch of many micro-batches
  (``accumulate`` each, then ``release``), with a ``state_dict`` for checkpoints.
- :func:`make_private`: a DP-SGD run set up from a privacy target in one call (the
  noise multiplier, Poisson-sampled logical batches split into physical ones, the
  step and its accountant), the model and the optimizer left as they are.
- :class:`PrivacyEngine`: Opacus's ``PrivacyEngine`` on persample's step, so that an
  Opacus script runs unchanged but for the import; :class:`BatchMemoryManager` with it
  splits logical batches into physical ones, as Opacus's does.
- :mod:`persample.dp.clipping`: flat, per-layer, per-group and automatic clipping, and
  the sensitivity each gives the noise; :class:`AdaptiveClipping` moves ``C`` towards a
  quantile of the norms (:mod:`persample.dp.adaptive`); ``user_ids=`` clips each user's
  gradient once (user-level DP), :class:`UserPoissonSampler` samples users.
- :mod:`persample.dp.sampling`: Poisson sampling of batches (of records, of users, or
  cyclic: a record in one step of every few, as correlated noise needs).
- :mod:`persample.dp.setup`: what every front door above (and ``PrivateTrainer``, ``persample
  dp-train``, ``persample dp-finetune``) sets up alike: each process's share of a
  logical batch, its cut into physical batches (a user's records in one), and the
  seeds all ranks share.
- :mod:`persample.dp.accounting`: privacy accounting with Google's ``dp-accounting``.
- :func:`audit` (:mod:`persample.dp.auditing`): a lower bound on the epsilon a training
  run actually has, from canaries, in one run (Steinke et al. 2023): above the
  accountant's epsilon, the step is broken.

Inside: :mod:`~persample.dp.microbatch` computes one micro-batch's clipped sums (Bu et al.
2023's book-keeping), :mod:`~persample.dp.reduce` takes a step's sums to ``p.grad`` in
each mode (one process, several, FSDP2), :mod:`~persample.dp.noise` draws the noise (or,
``secure_mode``, takes it from the operating system's secure generator), and
:mod:`~persample.dp.step` holds the step itself.
"""

from .accounting import PrivacyAccountant, epsilon, noise_multiplier_for
from .adaptive import AdaptiveClipping
from .auditing import Audit, audit
from .clipping import Clipping
from .mechanisms import BLT, BandMF
from .microbatch import Accumulated
from .privacy_engine import BatchMemoryManager, DPDataLoader, PrivacyEngine
from .sampling import (
    CyclicPoissonSampler,
    CyclicUserPoissonSampler,
    EmptySafeCollate,
    PoissonBatchSampler,
    UserPoissonSampler,
    poisson_batches,
    poisson_loader,
)
from .step import PrivateStep, private_grad
from .training import PrivateRun, make_private
from .validator import ModuleValidator

__all__ = [
    "private_grad",
    "PrivateStep",
    "Accumulated",
    "make_private",
    "PrivateRun",
    "PrivacyAccountant",
    "epsilon",
    "noise_multiplier_for",
    "CyclicPoissonSampler",
    "CyclicUserPoissonSampler",
    "PoissonBatchSampler",
    "UserPoissonSampler",
    "poisson_batches",
    "poisson_loader",
    "EmptySafeCollate",
    "PrivacyEngine",
    "BatchMemoryManager",
    "DPDataLoader",
    "ModuleValidator",
    "BandMF",
    "BLT",
    "Clipping",
    "AdaptiveClipping",
    "audit",
    "Audit",
]
