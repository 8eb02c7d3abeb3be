"""The errors of the engine: each names the module or op, what is wrong and the fix.

``method="auto"`` answers :class:`NeedsWholeModel`, :class:`UnsupportedModuleError`,
:class:`InPlaceModificationError` and :class:`LossNotPerSampleError` with a warning
and the exact whole-model methods (``torch.func``, then the loop).
"""

from __future__ import annotations


class NeedsWholeModel(RuntimeError):
    """The engine cannot split some parameter's gradient by sample; ``torch.func``
    over the whole model or the loop can (``method="auto"`` takes them)."""


class UnsupportedModuleError(RuntimeError):
    """A module or op has no rule and ``torch.func`` cannot differentiate it per sample."""


class InPlaceModificationError(RuntimeError):
    """A tensor a rule needs was modified in place after its op ran."""


class LossNotPerSampleError(ValueError):
    """``loss_fn`` read a model output that mixes the samples (a batch-wide mean)."""
