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

Each method's result may be certified (:mod:`persample.certificate`): ``certify(how,
draws)`` checks the result method ``how`` just gave, from ``draws`` (where the
generators stood when it started), by an identity persample does not compute itself.
A mismatch under ``auto`` warns once, naming the parameters, and takes the next method;
an explicit method raises :class:`~persample.errors.CertificateError`, as ``auto`` does
when the loop itself disagrees (a forward that does not reproduce, or mixes samples).
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .errors import (
    REFUSALS,
    CertificateError,
    DrawNotReplayable,
    InternalError,
    LossNotPerSampleError,
    internal_errors_raised,
)
from .rng import Draws, host_moved, restore, rewind_buffers, snapshot

METHODS = ("auto", "rules", "vmap", "loop")
AMBIGUOUS = "the output's samples may be in another dim of the same size"
"""Why a certificate is not decided where the method's per-sample losses are not those
of the output's dim 0 and another dim has the batch's size."""
_PACKAGE = os.path.dirname(os.path.abspath(__file__))


@dataclass
class Taken:
    """Which method answered a call (``"rules"``, ``"vmap"`` or ``"loop"``), and why
    ``auto`` left the rules (empty if it did not). Shared by the chunks of one call, so
    that the warning is given once."""

    method: str = "rules"
    reason: str = ""
    plan: str = ""  # the rules' last capture: from an earlier call's data flow, or new
    certificates: list = field(default_factory=list)  # each certificate run, in order
    mixing: bool = False  # the rules found samples mixed (LossNotPerSampleError)
    losses: Any = None  # (n,) each sample's loss, where the call had a loss
    values_read: str | None = None  # the rules' forward read sample data into Python
    # (the op), and drew no random numbers: its certificate also checks a sample alone

    def describe(self) -> str:
        """``"rules"``, or the method taken and why."""
        if not self.reason:
            return self.method
        return f"{self.method}: {self.reason}"


def answer(method: str, rules: Callable[[], Any], vmap: Callable[[], Any] | None,
           loop: Callable[[], Any], taken: Taken | None = None,
           hint: Callable[[], str | None] | None = None,
           certify: Callable[[str, Any], Any] | None = None) -> Any:
    """The result of ``method`` (see the module docstring); ``vmap=None`` where
    ``torch.func`` has no form for the quantity (``auto`` then goes to the loop).
    ``hint()``: a note for an error that propagates (the likely cause in the user's
    inputs). ``certify(how, draws)``: the certificate of the result method ``how`` gave
    (a :class:`~persample.certificate.Certificate`, or ``None`` where none is due)."""
    try:
        return _answer(method, rules, vmap, loop, taken if taken is not None else Taken(),
                       certify)
    except Exception as err:
        note = hint() if hint is not None else None
        if note:
            err.add_note(note)
        raise


def _answer(method: str, rules: Callable[[], Any], vmap: Callable[[], Any] | None,
            loop: Callable[[], Any], taken: Taken, certify: Callable | None) -> Any:
    draws = Draws.now()  # each method tried draws what the first one drew
    if (method == "auto" and taken.method == "rules" and certify is not None
            and certify.rejected("rules")):
        taken.method, taken.reason = "vmap", "a certificate rejected the rules' result " \
            "for this model and these shapes in an earlier call"
    if method in ("vmap", "loop"):
        taken.method = method
        result = (vmap if method == "vmap" else loop)()
        _replayable(method, draws)
        if method == "vmap":  # (the loop is the definition: each sample's forward alone)
            _stands(method, taken, certify, draws, explicit=True)
        return result
    if taken.method == "rules":
        try:
            result = rules()
        except REFUSALS + (InternalError,) as err:
            if method == "rules" or (isinstance(err, InternalError)
                                     and internal_errors_raised()):
                raise
            leave_rules(taken, err)
        else:
            if _stands("rules", taken, certify, draws, explicit=method == "rules"):
                return result
    if vmap is not None and taken.method in ("rules", "vmap"):
        draws.restore()
        rewind_buffers()
        try:
            result = vmap()
        except Exception:  # torch.func cannot run this model: the loop always can
            pass
        else:
            taken.method = "vmap"
            _replayable("vmap", draws)
            if _stands("vmap", taken, certify, draws, explicit=False):
                return result
    draws.restore()
    rewind_buffers()
    taken.method = "loop"
    try:
        result = loop()
    except Exception as err:  # nor the loop: the model's own error; say why not the rules
        err.add_note(f"(method='auto' left the rules because: {taken.reason})")
        raise
    _replayable("loop", draws)
    _stands("loop", taken, certify, draws, explicit=True)
    return result


def _replayable(how: str, draws: Any) -> None:
    """Refuse the result of ``torch.func`` or the loop where the forward drew from
    numpy's or Python's global generator: each sample's forward ran alone and drew other
    numbers than the batch's forward would (``draws``: where the generators stood)."""
    moved = host_moved(draws.host)
    if moved:
        raise DrawNotReplayable(
            f"the model draws random numbers from {' and '.join(moved)} in its forward: "
            f"method={how!r} runs each sample's forward alone, which draws other numbers "
            "than the batch's forward, and persample cannot replay them. Draw them with "
            "torch's generators (torch.rand, torch.randint, ...: replayed per sample), or "
            "use method='rules' (one forward of the batch).")


def _stands(how: str, taken: Taken, certify: Callable | None, draws: Any,
            explicit: bool) -> bool:
    """Does the result method ``how`` just gave stand? Certified where due; a mismatch
    raises (``explicit``: the method was asked for, or it is the last) or warns once per
    call and says to take the next method."""
    try:
        cert = certify(how, draws) if certify is not None else None
    except (InternalError, *REFUSALS) as err:  # persample's own code, reading the result
        if explicit or internal_errors_raised():
            raise
        leave_rules(taken, err)
        taken.method = {"rules": "vmap", "vmap": "loop"}.get(how, how)
        return False
    if cert is None:
        return True
    taken.certificates.append(cert)
    if not cert.decided and cert.reason == AMBIGUOUS and taken.mixing and how != "rules":
        raise CertificateError(
            f"the rules found this model's samples mixed ({taken.reason.split('. ')[0]}), and "
            f"the whole-model answer cannot be certified ({cert.describe()}): a per-sample "
            "gradient may not exist. method='loop' answers each sample's gradient in a batch "
            "of its own, if that is what you want.")
    if cert.ok:
        return True
    if explicit:
        if how == "loop" and taken.mixing:
            raise CertificateError(
                f"the model mixes samples, so no per-sample gradient of the batch exists: "
                f"{taken.reason.split('. ')[0]}; and the loop over samples (each sample's "
                f"forward alone) disagrees with the batch's forward ({cert.describe()}). "
                "method='loop' answers each sample's gradient in a batch of its own, if "
                "that is what you want.")
        earlier = [c.describe() for c in taken.certificates[:-1] if not c.ok]
        raise CertificateError(
            f"persample's certificate rejects the result: {cert.describe()}."
            + (f" Before it: {'; '.join(earlier)}." if earlier else "")
            + (f" The rules refused this model: {taken.reason}" if how == "loop"
               and taken.reason else "")
            + _certificate_fix(how))
    if not taken.reason:
        taken.reason = f"certificate mismatch: {cert.describe()}"
        warnings.warn(
            f"persample's certificate caught a wrong result and discarded it: "
            f"{cert.describe()}. Taking the next exact method (torch.func over the whole "
            "model, then the loop), itself certified; please report this model.",
            stacklevel=user_stacklevel())
    taken.method = {"rules": "vmap", "vmap": "loop"}.get(how, how)
    return False


def _certificate_fix(how: str) -> str:
    if how == "loop":
        return (" Even the loop over samples (each sample's forward alone) disagrees with "
                "the batch's forward: the model mixes samples (a statistic or a permutation "
                "of the batch), so no per-sample gradient of the batch exists, or its "
                "forward does not reproduce under torch's generators (a state that changes "
                "between calls). method='loop' answers each sample's gradient in a batch "
                "of its own, if that is what you want.")
    return (" Use method='auto', which takes the next exact method, or method='loop'; "
            "check='never' skips the certificate.")


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
    taken.mixing = isinstance(err, LossNotPerSampleError)
    what = ("persample's own code failed on this model (a bug; please report it with "
            "this message)" if isinstance(err, InternalError)
            else "the rules cannot split this model by sample")
    warnings.warn(f"{what}: {err} Falling back to method='vmap' (torch.func over the whole "
                  "model; the loop if that fails), exact where samples do not mix (the "
                  "first call of each plan certified).",
                  stacklevel=user_stacklevel())


def user_stacklevel() -> int:
    """The ``stacklevel`` of ``warnings.warn`` that points at the first frame outside
    persample (the user's call)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    return level
