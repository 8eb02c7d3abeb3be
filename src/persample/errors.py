"""The errors of the engine: each names the module or op, what is wrong and the fix.

``method="auto"`` answers :class:`NeedsWholeModel`, :class:`UnsupportedModuleError`,
:class:`InPlaceModificationError` and :class:`LossNotPerSampleError` with a warning
and the exact whole-model methods (``torch.func``, then the loop), and
:class:`InternalError` (an exception inside persample's own machinery: a bug) likewise,
with a warning that asks for a report. An exception raised by the user's own
``forward`` or ``loss_fn`` is none of these: it propagates unchanged.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NoReturn

STRICT_ENV = "PERSAMPLE_RAISE_INTERNAL"
"""The switch for tests and benchmarks: with this environment variable set to ``1``, an
:class:`InternalError` (persample's own bug) is raised wherever ``method="auto"`` would
answer it with a slower method, so that a failing data-flow handler or rule fails the
run instead of hiding behind a fallback."""


def internal_errors_raised() -> bool:
    """Are persample's internal errors raised rather than answered by a fallback
    (:data:`STRICT_ENV` set to ``1``)?

    Examples:
        >>> import os
        >>> os.environ.get(STRICT_ENV) == "1" or not internal_errors_raised()
        True
    """
    return os.environ.get(STRICT_ENV) == "1"


class NeedsWholeModel(RuntimeError):
    """The engine cannot split some parameter's gradient by sample; ``torch.func``
    over the whole model or the loop can (``method="auto"`` takes them)."""


class DrawNotReplayable(NeedsWholeModel):
    """A random op whose numbers, or a sample's part of them, cannot be reused (a fused
    kernel's mask, a draw from numpy's or Python's generator in ``forward``)."""


class UnsupportedModuleError(RuntimeError):
    """A module or op has no rule and ``torch.func`` cannot differentiate it per sample."""


class MixesSamplesError(UnsupportedModuleError, ValueError):
    """A module mixes the samples of a batch (a batch normalisation in training mode), so
    DP training cannot take it: :class:`persample.dp.ModuleValidator` names it and
    ``fix`` replaces it (as Opacus's ``UnsupportedModuleError``; a ``ValueError`` too)."""


class InPlaceModificationError(RuntimeError):
    """A tensor a rule needs was modified in place after its op ran."""


class LossNotPerSampleError(ValueError):
    """``loss_fn`` read a model output that mixes the samples (a batch-wide mean)."""


class CertificateError(RuntimeError):
    """A result failed its certificate (:mod:`persample.certificate`): an identity that
    persample does not compute itself disagrees with it. Raised for an explicit
    ``method=``, and by ``method="auto"`` where even the loop disagrees (a forward that
    does not reproduce under torch's generators, or that mixes samples)."""


class InternalError(RuntimeError):
    """persample's own machinery (a data-flow handler, a rule, a pullback, the planning)
    raised on this model: a bug in persample, not in the model. ``method="auto"`` warns,
    asking for a report, and answers with the next exact method; the original exception
    is the ``__cause__``."""


# What the rules raise to refuse a model they cannot split by sample; the exact slower
# methods answer it (``method="auto"``).
REFUSALS = (NeedsWholeModel, UnsupportedModuleError, InPlaceModificationError,
            LossNotPerSampleError)


def raise_internal(err: Exception, where: str) -> NoReturn:
    """Raise ``err`` (raised inside persample while doing ``where``) as an
    :class:`InternalError`; persample's own refusals are raised unchanged."""
    if isinstance(err, REFUSALS + (InternalError,)):
        raise err
    raise InternalError(
        f"persample failed in {where}: {type(err).__name__}: {err}. This is a bug in "
        "persample, not in your model; please report it with this message.") from err


@contextmanager
def internal(where: str) -> Iterator[None]:
    """Inside: persample's own work (``where``: what it is doing). An exception raised
    there, other than a refusal, is an :class:`InternalError`."""
    try:
        yield
    except Exception as err:
        raise_internal(err, where)


def module_note(where: str, module: object, args: tuple, exc: BaseException) -> str:
    """A note for an exception raised inside a module's call (``where``: the module's
    name and class): the module, and for ids out of an embedding's range, the range.

    Examples:
        >>> import torch
        >>> note = module_note("'emb' (Embedding)", torch.nn.Embedding(5, 2),
        ...                    (torch.tensor([7]),), IndexError("index out of range"))
        >>> note.endswith("every id must be in [0, 5). Fix the tokenizer or vocabulary size.")
        True
    """
    note = f"(raised inside module {where})"
    ids = args[0] if args else None
    size = getattr(module, "num_embeddings", None)
    if isinstance(exc, IndexError) and size is not None and hasattr(ids, "is_floating_point"):
        if ids.numel() and not ids.is_floating_point():
            note = (f"module {where} got ids from {int(ids.min())} to {int(ids.max())}, but "
                    f"num_embeddings={size}: every id must be in [0, {size}). Fix the "
                    "tokenizer or vocabulary size.")
    return note


LOSS_NOTE = "(raised in loss_fn"


def describe(value: object) -> str:
    """A short description of a value passed to ``loss_fn``: a tensor's class, shape and
    dtype; a mapping's class and entries; a sequence's class and items (at most 6).

    Examples:
        >>> import torch
        >>> describe({"logits": torch.zeros(4, 3)})
        "dict {'logits': Tensor (4, 3) torch.float32}"
    """
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if shape is not None and dtype is not None:
        return f"Tensor {tuple(shape)} {dtype}"
    kind = type(value).__name__
    if hasattr(value, "items") and hasattr(value, "keys"):
        items = [f"{k!r}: {describe(v)}" for k, v in list(value.items())[:6]]
        more = ", ..." if len(value) > 6 else ""
        return f"{kind} {{{', '.join(items)}{more}}}"
    if isinstance(value, (tuple, list)):
        more = ", ..." if len(value) > 6 else ""
        return f"{kind} ({', '.join(describe(v) for v in value[:6])}{more})"
    return kind


def loss_note(loss_fn: object, output: object, targets: object) -> str:
    """The note added to an exception raised by ``loss_fn(output, targets)``: what was
    called with what, and for two common mistakes the fix.

    Examples:
        >>> import torch
        >>> print(loss_note(torch.nn.CrossEntropyLoss(), torch.zeros(4, 3),
        ...                 torch.zeros(4, 1, dtype=torch.long)))  # doctest: +NORMALIZE_WHITESPACE
        (raised in loss_fn CrossEntropyLoss(), called as loss_fn(output, targets) with
        output: Tensor (4, 3) torch.float32; targets: Tensor (4, 1) torch.int64) The
        targets have a trailing dim of size 1: class indices are (B,), e.g.
        targets.squeeze(-1).
    """
    name = type(loss_fn).__name__
    shown = f"{loss_fn!r}" if name.endswith("Loss") else getattr(loss_fn, "__qualname__", name)
    note = (f"{LOSS_NOTE} {shown}, called as loss_fn(output, targets) with output: "
            f"{describe(output)}; targets: {describe(targets)})")
    stock = type(loss_fn).__module__.startswith("torch.nn")
    if stock and hasattr(output, "keys") and not hasattr(output, "shape"):
        note += (f" The model returns a {type(output).__name__}, and {name} takes a "
                 "tensor: pass a loss_fn that picks it, e.g. "
                 f"lambda out, y: nn.{name}()(out['logits'], y).")
    elif (name in ("CrossEntropyLoss", "NLLLoss") and getattr(targets, "dim", None)
          and not targets.is_floating_point() and targets.dim() >= 2 and targets.shape[-1] == 1
          and getattr(output, "dim", None) and output.dim() == 2):
        note += (" The targets have a trailing dim of size 1: class indices are (B,), "
                 "e.g. targets.squeeze(-1).")
    return note


@contextmanager
def named_loss(loss_fn: object, output: object, targets: object) -> Iterator[None]:
    """Inside: a call of the user's ``loss_fn``. An exception it raises propagates
    unchanged but for one added note (:func:`loss_note`); persample's own refusals
    and an exception already noted pass as they are."""
    try:
        yield
    except Exception as err:
        if not isinstance(err, REFUSALS + (InternalError,)) and not any(
                str(n).startswith(LOSS_NOTE) for n in getattr(err, "__notes__", ())):
            err.add_note(loss_note(loss_fn, output, targets))
        raise
