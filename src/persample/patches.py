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

The loop over samples and ``torch.func`` use the same checkpoint switch
(:func:`plain_checkpoints`), so that they can differentiate a model that uses reentrant
checkpoints at all.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor


class WhileCapturing:
    """The patches above, entered and exited by every capture (see the module docstring).

    ``stance`` is torch.compile's eager stance while it is set (``None`` otherwise)."""

    lock = threading.Lock()
    local = threading.local()
    users = 0
    saved: Any = None
    stance: Any = None

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

    @classmethod
    def run(cls, original: Callable, function: Callable, preserve_rng_state: bool, *args):
        """The checkpoint's ``apply``: the function itself in a capturing thread where an
        input requires grad, else the checkpoint."""
        if (getattr(cls.local, "depth", 0) and torch.is_grad_enabled()
                and any(isinstance(a, Tensor) and a.requires_grad for a in args)):
            return function(*args)
        return original(function, preserve_rng_state, *args)


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
