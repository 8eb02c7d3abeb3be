"""persample: fast per-sample derivatives for PyTorch.

The public API: :func:`per_sample_grads`, the loop reference
:func:`loop_per_sample_grads`, and :func:`register_rule` to add a layer rule.
"""

from .api import per_sample_grads
from .fallback import UnsupportedModuleError
from .reference import loop_per_sample_grads
from .rules import register_rule

__all__ = [
    "per_sample_grads",
    "loop_per_sample_grads",
    "register_rule",
    "UnsupportedModuleError",
]
__version__ = "0.1.0"
