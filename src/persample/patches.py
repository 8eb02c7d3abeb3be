"""What persample changes outside itself while it records or replays a model, and
where that reaches.

While any capture is open (counted over threads, undone when the last one closes):

- ``torch.utils.checkpoint``'s reentrant form (``use_reentrant=True``: a custom
  ``autograd.Function`` that runs the function under ``no_grad`` and runs it again in
  the backward) runs the function as it is, with autograd, **in a capturing thread
  only**: the capture then sees its ops with their gradient edges, and the backward
  needs no second forward (which ``torch.autograd.grad`` refuses). Its gradients are
  the checkpoint's: those of the function where an input requires grad; where none
  does, the checkpoint itself runs (no gradient reaches inside). The patch is on the
  class (``CheckpointFunction.apply``), shared by every thread, but it asks a
  thread-local depth: other threads get the original.
- once ``torch.compile`` is in use, compiled code runs eagerly
  (``torch.compiler.set_stance("force_eager")``): the capture must see every op, and
  TorchDynamo must not trace the capture's own work (``fullgraph=True`` would refuse
  the graph breaks). torch keeps one stance for the whole process, so **compiled code
  in other threads runs eagerly meanwhile**: correct, slower, and undone when the last
  capture closes. (Where the stance cannot be set, inside a compiled region, the mode
  hides its own code from TorchDynamo instead: :mod:`persample.capture.mode`.)

- transformers' attention masks made by ``torch.vmap`` (``sdpa_mask(use_vmap=True)``,
  which transformers takes wherever a mask function is combined with another: Gemma 3's
  image tokens attending to each other, sliding windows over them) are made by
  broadcasting instead, **in a capturing thread only**, where every mask function in
  the combination is one of ``transformers.masking_utils``' own. Those are written to
  give the same mask both ways (indexing only); the capture cannot follow the ops
  inside ``vmap``, which it would read as made outside it. A mask function of the
  model's or the user's own keeps ``vmap``.

The loop over samples and ``torch.func`` use the same checkpoint switch
(:func:`plain_checkpoints`), so that they can differentiate a model that uses reentrant
checkpoints at all.

Around persample's own ``torch.func`` calls (the whole model's ``vmap``, per-op VJPs, a
loss cut by sample, forward-mode input Jacobians), in the calling thread only:
``torch.linalg.solve`` and ``solve_ex`` get their operands expanded to the batch dims they
broadcast to (:func:`solves_broadcast`): ``torch.func``'s batched gradient of a solve whose
operands broadcast is wrong in torch 2.13 (a shared matrix against each sample's
``(1, C, 1)`` right-hand side: several times the loop's), and right with them expanded.
"""

from __future__ import annotations

import functools
import inspect
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode


class WhileCapturing:
    """The patches above, entered and exited by every capture (see the module docstring).

    ``stance`` is torch.compile's eager stance while it is set (``None`` otherwise)."""

    lock = threading.Lock()
    local = threading.local()
    users = 0
    saved: Any = None
    stance: Any = None
    masks: tuple | None = None  # (transformers' masking module, its sdpa_mask) while patched

    @classmethod
    def enter(cls) -> None:
        cls.local.depth = getattr(cls.local, "depth", 0) + 1
        with cls.lock:
            cls.users += 1
            if cls.users == 1:
                from torch.utils.checkpoint import CheckpointFunction

                cls.saved = CheckpointFunction.__dict__.get("apply")
                original = CheckpointFunction.apply
                CheckpointFunction.apply = classmethod(
                    lambda _, *args: cls.run(original, *args))
                cls.masks = _broadcast_masks(cls.local)
                if "torch._dynamo" in sys.modules:
                    try:
                        cls.stance = torch.compiler.set_stance("force_eager")
                    except RuntimeError:  # inside a compiled region: the hidden mode copes
                        cls.stance = None

    @classmethod
    def exit(cls) -> None:
        cls.local.depth -= 1
        with cls.lock:
            cls.users -= 1
            if cls.users == 0:
                from torch.utils.checkpoint import CheckpointFunction

                if cls.saved is None:
                    del CheckpointFunction.apply
                else:
                    CheckpointFunction.apply = cls.saved
                if cls.stance is not None:
                    cls.stance.__exit__(None, None, None)
                    cls.stance = None
                if cls.masks is not None:
                    _restore_masks(*cls.masks)
                    cls.masks = None

    @classmethod
    def run(cls, original: Callable, function: Callable, preserve_rng_state: bool, *args):
        """The checkpoint's ``apply``: the function itself in a capturing thread where an
        input requires grad, else the checkpoint."""
        if (getattr(cls.local, "depth", 0) and torch.is_grad_enabled()
                and any(isinstance(a, Tensor) and a.requires_grad for a in args)):
            return function(*args)
        return original(function, preserve_rng_state, *args)


def _broadcast_masks(local: threading.local) -> tuple | None:
    """Patch transformers' ``sdpa_mask`` (see the module docstring), if transformers'
    masking module is loaded: ``(module, the original)``, or ``None``."""
    module = sys.modules.get("transformers.masking_utils")
    original = getattr(module, "sdpa_mask", None)
    if original is None:
        return None
    signature = inspect.signature(original)

    @functools.wraps(original)
    def sdpa_mask(*args: Any, **kwargs: Any) -> Any:
        if getattr(local, "depth", 0):
            try:
                bound = signature.bind(*args, **kwargs)
            except TypeError:  # (transformers' own error, raised by its own call below)
                return original(*args, **kwargs)
            chosen = bound.arguments
            if chosen.get("use_vmap") and _indexing_only(chosen.get(
                    "mask_function", getattr(module, "causal_mask_function", None)),
                    module.__name__):
                chosen["use_vmap"] = False
                return original(*bound.args, **bound.kwargs)
        return original(*args, **kwargs)

    module.sdpa_mask = sdpa_mask
    mapping = getattr(getattr(module, "AttentionMaskInterface", None), "_global_mapping", {})
    if mapping.get("sdpa") is original:
        mapping["sdpa"] = sdpa_mask
    return module, original


def _restore_masks(module: Any, original: Callable) -> None:
    mapping = getattr(getattr(module, "AttentionMaskInterface", None), "_global_mapping", {})
    if mapping.get("sdpa") is module.sdpa_mask:
        mapping["sdpa"] = original
    module.sdpa_mask = original


def _indexing_only(function: Any, home: str, depth: int = 0) -> bool:
    """Is ``function`` one of the module ``home``'s, and so is every function its closure
    holds (``and_masks``'s, ``or_masks``'s), to a few levels?"""
    if depth > 8 or getattr(function, "__module__", None) != home:
        return False
    for cell in getattr(function, "__closure__", None) or ():
        held = cell.cell_contents
        for item in held if isinstance(held, (tuple, list)) else (held,):
            if callable(item) and not isinstance(item, (Tensor, type)) and not _indexing_only(
                    item, home, depth + 1):
                return False
    return True


@contextmanager
def plain_checkpoints() -> Iterator[None]:
    """Inside: reentrant checkpoints run their function as it is, as during a capture
    (see the module docstring), so that the loop and ``torch.func`` can differentiate a
    model that uses them (``torch.autograd.grad`` and ``vmap`` refuse the reentrant
    checkpoint's second forward); the gradients are the checkpoint's.

    Examples:
        >>> import torch
        >>> from torch.utils.checkpoint import checkpoint
        >>> w = torch.ones(3, requires_grad=True)
        >>> with plain_checkpoints():
        ...     y = checkpoint(lambda x: (x * w).sum(), torch.ones(3, requires_grad=True),
        ...                    use_reentrant=True)
        ...     (g,) = torch.autograd.grad(y, [w])
        >>> g
        tensor([1., 1., 1.])
    """
    WhileCapturing.enter()
    try:
        yield
    finally:
        WhileCapturing.exit()


_SOLVES = frozenset((torch.linalg.solve, torch.linalg.solve_ex))


class _SolvesBroadcast(TorchFunctionMode):
    """``torch.linalg.solve``/``solve_ex`` with their operands expanded to the batch dims
    they broadcast to (see :func:`solves_broadcast`)."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _SOLVES:
            args, kwargs = _expanded_solve(args, kwargs)
        return func(*args, **kwargs)


def _expanded_solve(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``solve(A, B, left=)``'s arguments with ``A (*a, C, C)`` and ``B (*b, C, k)``
    (``(*b, C)`` a batch of vectors, as ``linalg.solve`` reads it) expanded to the batch
    dims ``broadcast(a, b)``: the same values, the same result."""
    kwargs = dict(kwargs)
    a = args[0] if args else kwargs.pop("A", None)
    b = args[1] if len(args) > 1 else kwargs.pop("B", None)
    rest = tuple(args[2:])
    if not (isinstance(a, Tensor) and isinstance(b, Tensor)) or a.dim() < 2 or b.dim() < 1:
        return args, kwargs if args else {**kwargs, "A": a, "B": b}
    vector = b.dim() == 1 or (kwargs.get("left", True) and b.dim() == a.dim() - 1
                              and b.shape == a.shape[:-1])
    tail = 1 if vector else 2
    if b.dim() < tail:
        return (a, b, *rest), kwargs
    try:
        batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-tail])
    except RuntimeError:  # (not solvable: torch's own error)
        return (a, b, *rest), kwargs
    return (a.expand(*batch, *a.shape[-2:]), b.expand(*batch, *b.shape[-tail:]), *rest), kwargs


@contextmanager
def solves_broadcast() -> Iterator[None]:
    """Inside (this thread): ``torch.linalg.solve`` and ``solve_ex`` get operands expanded
    to the batch dims they broadcast to. ``torch.func``'s batched gradient of a solve whose
    operands broadcast (a shared ``(C, C)`` matrix against each sample's ``(1, C, k)``
    right-hand side, as a sample of a batch of one presents it) is wrong, or fails, in
    torch 2.13; with the operands expanded it is right, the values unchanged. Entered
    around persample's own ``torch.func`` calls only.

    Examples:
        >>> import torch
        >>> from torch.func import grad, vmap
        >>> a, x = torch.eye(2) * 2, torch.ones(3, 2)
        >>> f = lambda a, x: torch.linalg.solve(a, x[None, :, None]).sum()
        >>> with solves_broadcast():
        ...     g = vmap(grad(f), in_dims=(None, 0))(a, x)
        >>> g[0]
        tensor([[-0.2500, -0.2500],
                [-0.2500, -0.2500]])
    """
    with _SolvesBroadcast():
        yield
