"""persample: fast per-sample derivatives for PyTorch.

The public API: :func:`per_sample_grads`, :func:`param_jacobian`,
:func:`input_jacobian`, :func:`jacobian_diagonal`, :func:`per_sample_grad_norms`,
:func:`per_sample_grad_dots` and :class:`GradientProjector` (inner products and random
projections of per-sample gradients, for data attribution), :class:`KFAC` (Kronecker
factors of the curvature from the same records) and :func:`per_sample_ggn_diag` /
:func:`ggn_diag` (the GGN's diagonal, per sample or summed), the loop references,
:func:`register_rule` to add a layer rule, and
:func:`supported` / :func:`verify` to check a custom model (every result is also
certified on the first call of each plan: :mod:`persample.certificate`),
:func:`empty_cache` to free the result memory persample keeps for reuse,
:func:`clear_plans` / :func:`cache_plans` / :func:`compile_calls` for the data flow it keeps
from earlier calls, :func:`graphed` to replay a call from a CUDA graph on each new batch,
and
:class:`PackedRows` to pass the rows of several samples packed into one tensor.
"""

from .api import aligned_empty, param_jacobian, per_sample_grads
from .certificate import checking
from .curvature import KFAC, ggn_diag, per_sample_ggn_diag
from .dots import per_sample_grad_dots
from .draws import DrawNotReplayable
from .engine.tapes import cache_plans, clear_plans, compile_calls
from .errors import (
    CertificateError,
    InternalError,
    LossNotPerSampleError,
    MixesSamplesError,
    NeedsWholeModel,
    UnsupportedModuleError,
)
from .graphs import Graphed, graphed
from .influence import influence, self_influence
from .inputs import PackedRows
from .jacobian import input_jacobian, jacobian_diagonal
from .memory import empty_cache
from .norms import per_sample_grad_norms
from .projection import GradientProjector
from .reference import forward_per_sample_grads, loop_param_jacobian, loop_per_sample_grads
from .rules import register_rule
from .support import Route, Verification, supported, verify

__all__ = [
    "per_sample_grads",
    "param_jacobian",
    "per_sample_grad_norms",
    "per_sample_grad_dots",
    "GradientProjector",
    "KFAC",
    "per_sample_ggn_diag",
    "ggn_diag",
    "influence",
    "self_influence",
    "input_jacobian",
    "jacobian_diagonal",
    "aligned_empty",
    "PackedRows",
    "empty_cache",
    "clear_plans",
    "cache_plans",
    "compile_calls",
    "graphed",
    "Graphed",
    "loop_param_jacobian",
    "loop_per_sample_grads",
    "forward_per_sample_grads",
    "register_rule",
    "supported",
    "verify",
    "Route",
    "Verification",
    "UnsupportedModuleError",
    "MixesSamplesError",
    "LossNotPerSampleError",
    "NeedsWholeModel",
    "DrawNotReplayable",
    "InternalError",
    "CertificateError",
    "checking",
]
__version__ = "0.1.0"
