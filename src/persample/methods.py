"""``method=``: the one policy that picks who answers a call.

Every public function that differentiates a model per sample (per-sample gradients,
the parameter Jacobian, the norms, the DP step and :class:`persample.dp.PrivateStep`)
has three exact ways to answer: the engine's rules (one captured forward and
backward), ``torch.func`` over the whole model, and the loop over samples.
``method="auto"`` is the rules; where they refuse a model (an op that cannot be
split by sample: :data:`~persample.errors.REFUSALS`) or where persample's own
machinery fails on it (:class:`~persample.errors.InternalError`, a bug), it warns
once, naming the op or module, and answers with ``torch.func``, then the loop. An
exception from the user's own ``forward`` or ``loss_fn`` is not caught: it
propagates as it is. :func:`answer` is that policy; :class:`Taken` records which
method answered, for :func:`persample.verify` and :func:`persample.supported`.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .errors import REFUSALS, InternalError, internal_errors_raised
from .rng import restore, snapshot

METHODS = ("auto", "rules", "vmap", "loop")
_PACKAGE = os.path.dirname(os.path.abspath(__file__))


@dataclass
class Taken:
    """Which method answered a call (``"rules"``, ``"vmap"`` or ``"loop"``), and why
    ``auto`` left the rules (empty if it did not). Shared by the chunks of one call, so
    that the warning is given once."""

    method: str = "rules"
    reason: str = ""
    plan: str = ""  # the rules' last capture: from an earlier call's data flow, or new

    def describe(self) -> str:
        """``"rules"``, or the method taken and why."""
        if not self.reason:
            return self.method
        return f"{self.method}: {self.reason}"


def answer(method: str, rules: Callable[[], Any], vmap: Callable[[], Any] | None,
           loop: Callable[[], Any], taken: Taken | None = None,
           hint: Callable[[], str | None] | None = None) -> Any:
    """The result of ``method`` (see the module docstring); ``vmap=None`` where
    ``torch.func`` has no form for the quantity (``auto`` then goes to the loop).
    ``hint()``: a note for an error that propagates (the likely cause in the user's
    inputs)."""
    try:
        return _answer(method, rules, vmap, loop, taken if taken is not None else Taken())
    except Exception as err:
        note = hint() if hint is not None else None
        if note:
            err.add_note(note)
        raise


def _answer(method: str, rules: Callable[[], Any], vmap: Callable[[], Any] | None,
            loop: Callable[[], Any], taken: Taken) -> Any:
    if method == "vmap":
        taken.method = "vmap"
        return vmap()
    if method == "loop":
        taken.method = "loop"
        return loop()
    states = snapshot()  # each method tried draws what the first one drew
    if taken.method == "rules":
        try:
            return rules()
        except REFUSALS + (InternalError,) as err:
            if method == "rules" or (isinstance(err, InternalError)
                                     and internal_errors_raised()):
                raise
            leave_rules(taken, err)
    if vmap is not None and taken.method in ("rules", "vmap"):
        restore(states)
        try:
            result = vmap()
            taken.method = "vmap"
            return result
        except Exception:  # torch.func cannot run this model: the loop always can
            pass
    restore(states)
    taken.method = "loop"
    try:
        return loop()
    except Exception as err:  # nor the loop: the model's own error; say why not the rules
        err.add_note(f"(method='auto' left the rules because: {taken.reason})")
        raise


def slower(vmap: Callable[[], Any], loop: Callable[[], Any]) -> Any:
    """``torch.func`` over the whole model, or where it cannot run the model, the loop
    (drawing what ``torch.func`` drew)."""
    states = snapshot()
    try:
        return vmap()
    except Exception:
        restore(states)
        return loop()


def leave_rules(taken: Taken, err: Exception) -> None:
    """Record and say (once per call) why ``auto`` leaves the rules: a refusal, or
    persample's own failure (an :class:`InternalError`, a bug)."""
    taken.reason = str(err)
    what = ("persample's own code failed on this model (a bug; please report it with "
            "this message)" if isinstance(err, InternalError)
            else "the rules cannot split this model by sample")
    warnings.warn(f"{what}: {err} Falling back to method='vmap' (torch.func over the whole "
                  "model; the loop if that fails); the result is exact.",
                  stacklevel=user_stacklevel())


def user_stacklevel() -> int:
    """The ``stacklevel`` of ``warnings.warn`` that points at the first frame outside
    persample (the user's call)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    return level
