"""The whole-model methods (``method="loop"`` and ``method="vmap"``) in the forward that
ran: where the model draws random numbers, each sample replays its part of one batch
forward's draws (:mod:`persample.draws`), so that every method returns the gradients
of the same forward.

A first run stops at the first random op (nothing is recorded for a model that draws
nothing); then one batch forward records the draws, with the generators where the
call found them (the numbers a plain forward would draw), and the method runs again
replaying them. The buffers that forward updates (running statistics) are restored.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from .batch import located, located_of
from .checks import kept_buffers
from .draws import Draw, Recorder, replayed
from .engine import EXPANSIONS, open_capture
from .engine.backward import mixing_error
from .inputs import Batch, as_batch
from .patches import plain_checkpoints
from .reference import loop_param_jacobian, loop_per_sample_grads
from .rng import restore, snapshot
from .vmap import vmap_param_jacobian, vmap_per_sample_grads


def recorded_draws(model: nn.Module, batch: Batch) -> list[Draw]:
    """The random ops of one forward of ``batch`` (buffers restored after), each named
    with the module it ran in."""
    recorder = Recorder(EXPANSIONS)
    with torch.enable_grad(), kept_buffers(model), plain_checkpoints(), _named(
            model, recorder.stack), recorder:
        batch.call(model)
    return recorder.draws


@contextmanager
def _named(model: nn.Module, stack: list[str]) -> Iterator[None]:
    """Inside: ``stack`` holds the modules under way (forward hooks, removed on exit)."""
    def pre(name: str) -> Callable:
        def hook(module: nn.Module, args: Any) -> None:
            stack.append(f"'{name or '<root>'}' ({type(module).__name__})")
        return hook

    def post(module: nn.Module, args: Any, output: Any) -> None:
        if stack:
            stack.pop()

    handles = []
    try:
        for name, module in model.named_modules():
            if not isinstance(module, torch.jit.ScriptModule):
                handles += [module.register_forward_pre_hook(pre(name)),
                            module.register_forward_hook(post)]
        yield
    finally:
        for h in handles:
            h.remove()


def _replayed(model: nn.Module, batch: Batch, run: Callable[[Callable], Any]) -> Any:
    return replayed(run, lambda: recorded_draws(model, batch), batch.n, EXPANSIONS)


def refuse_mixing_loss(model: nn.Module, batch: Batch, targets: Any, loss_fn: Callable
                       ) -> None:
    """Raise :class:`~persample.errors.LossNotPerSampleError` if ``loss_fn`` (not a
    ``torch.nn`` loss) mixes samples, as the rules find it: its ops followed on one
    batch forward (its draws and buffer updates undone). A model the capture cannot
    follow is not checked."""
    if isinstance(loss_fn, nn.modules.loss._Loss) or batch.n < 2:
        return
    states = snapshot()
    try:
        with torch.enable_grad(), kept_buffers(model), plain_checkpoints():
            with open_capture(model, {}, batch.n, located(batch), batch.shared) as cap:
                output = batch.call(model)
            cap.add_inputs(located_of(targets, batch.n))
            with cap.follow():
                loss_fn(output, targets)
        mixing = cap.mixing
    except Exception:  # (the method itself meets any error of the model or the loss)
        mixing = None
    finally:
        restore(states)
    if mixing:
        raise mixing_error(mixing)


def loop_grads(model: nn.Module, inputs: Any, targets: Any, loss_fn: Callable,
               losses: Tensor | None = None) -> dict[str, Tensor]:
    """:func:`persample.loop_per_sample_grads` in the forward that ran (``losses``: a
    ``(B,)`` tensor each sample's loss is written into, or ``None``)."""
    batch = as_batch(inputs)
    refuse_mixing_loss(model, batch, targets, loss_fn)
    return _replayed(model, batch, lambda around: loop_per_sample_grads(
        model, inputs, targets, loss_fn, around=around, losses=losses))


def loop_jacobian(model: nn.Module, inputs: Any) -> dict[str, Tensor]:
    """:func:`persample.loop_param_jacobian` in the forward that ran."""
    return _replayed(model, as_batch(inputs), lambda around: loop_param_jacobian(
        model, inputs, around=around))


def vmap_grads(model: nn.Module, batch: Batch, targets: Any, loss_fn: Callable,
               params: dict[str, nn.Parameter], losses: Tensor | None = None
               ) -> dict[str, Tensor]:
    """:func:`persample.vmap.vmap_per_sample_grads` in the forward that ran (``losses``
    as for :func:`loop_grads`)."""
    refuse_mixing_loss(model, batch, targets, loss_fn)
    return _replayed(model, batch, lambda around: vmap_per_sample_grads(
        model, batch, targets, loss_fn, params, around=around, losses=losses))


def vmap_jacobian(model: nn.Module, batch: Batch, params: dict[str, nn.Parameter]
                  ) -> dict[str, Tensor]:
    """:func:`persample.vmap.vmap_param_jacobian` in the forward that ran."""
    return _replayed(model, batch, lambda around: vmap_param_jacobian(
        model, batch, params, around=around))
