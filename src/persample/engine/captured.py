"""What the backward of one captured batch produced: :class:`Captured`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import Tensor, nn

from ..batch import Batched, Layout, front_cotangents
from ..capture import Capture, Edge
from ..capture.compiled import CompiledCapture
from ..capture.lean import LeanCapture
from ..capture.stock import StockCapture
from .paths import Path, Plan, edge_key


@dataclass
class Captured:
    """One batch after its backward: the capture, the plan, and the gradients at the
    planned edges.

    ``grads``: per gradient edge (:func:`persample.engine.paths.edge_key`), ``(v, *shape)`` or
    ``None``. A batch of one takes no capture: ``whole`` lists the parameters, whose
    plain gradients ``grads`` holds by ``id(param)`` (the per-sample gradient of a batch
    of one is the gradient). ``taken``: the paths the rules actually took, recorded as
    they ran (:mod:`persample.engine.pullback`); :attr:`paths` is the plan's, updated
    by them. ``losses``: each sample's own loss ``(n,)`` (detached) where the backward's
    root was the loss (:func:`~persample.engine.loss_backprops`), else ``None``.
    """

    capture: Capture | Any  # a Capture, or a batch of one's stand-in (engine.backward)
    plan: Plan
    grads: dict[Any, Tensor | None]
    n: int
    v: int
    whole: list[nn.Parameter] = field(default_factory=list)
    taken: dict[int, Path] = field(default_factory=dict)
    losses: Tensor | None = None  # (n,) each sample's loss, where the root was the loss
    replay_base: Any = None  # (the records' part of a replay's signature, made once:
    # :func:`persample.engine.replay.inputs_of`)

    @property
    def paths(self) -> dict[int, Path]:
        """``id(param) -> Path``: how each parameter's per-sample gradient was computed."""
        return {**self.plan.paths, **self.taken}

    def layout(self, t: Tensor) -> Layout:
        return self.capture.layout(t)

    def values_read(self) -> str | None:
        """The op by which the forward read sample data into Python, where it drew no
        random numbers (its certificate then also checks a sample alone:
        :func:`persample.certificate.certify_grads`), else ``None``."""
        if getattr(self.capture, "draws", None):
            return None
        return getattr(self.capture, "values_read", None)

    def plan_note(self) -> str:
        """Whether the capture took data flow from an earlier call like this one
        (:mod:`persample.capture.tape`): ``"cached: ..."`` or ``"new: ..."``."""
        steps = getattr(self.capture, "steps", None)
        if steps is None:
            return "new: a batch of one takes no capture"
        if isinstance(self.capture, StockCapture):
            return (f"cached: torch's own layers only, run as they are (no op intercepted; "
                    f"the {len(self.capture.ops)} layers that read parameters kept by a hook "
                    "each), the data flow an earlier call's like it")
        if isinstance(self.capture, CompiledCapture):
            return (f"cached: compiled (its forward one TorchDynamo graph, no op "
                    f"intercepted; the {len(self.capture.ops)} ops that read parameters "
                    "kept by the graph), the data flow an earlier call's like it")
        if isinstance(self.capture, LeanCapture):
            return (f"cached: each of its {len(self.capture.program.entries)} forward ops "
                    "checked against the program of an earlier call like it (its data flow "
                    "taken from there; ops that may read values decided again)")
        done = getattr(self.capture, "replayed", 0)
        if not done:
            return f"new: the data flow of its {len(steps)} ops decided in this call"
        return (f"cached: the data flow of {done} of its {len(steps)} ops from an earlier "
                "call like it (the others read parameters, values or random numbers: "
                "decided in every call)")

    @property
    def derived(self) -> dict:
        """``id -> Derived``: the shared tensors computed from parameters, and their ops."""
        return self.capture.derived

    def param(self, pid: int) -> nn.Parameter:
        """The watched parameter whose ``id`` is ``pid``."""
        return self.capture.watched[pid]

    def watched_param(self, t: Tensor) -> nn.Parameter | None:
        """``t`` if it is a watched parameter, else ``None``."""
        p = self.capture.watched.get(id(t))
        return p if p is t else None

    def grad(self, e: Edge | None) -> Tensor | None:
        """``(v, *output.shape)``: the backward's gradient at ``e`` (``None``: none)."""
        g = None if e is None else self.grads.get(edge_key(e.edge))
        return None if g is None else e.take(g)

    def backprops(self, edges: list[Edge | None], layouts: list[Layout]) -> list[Tensor | None]:
        """Per output: ``(n, v, *per_sample)`` cotangents (``None`` where no gradient
        reaches it)."""
        found = []
        for e, lay in zip(edges, layouts):
            g = self.grad(e)
            found.append(front_cotangents(g, lay, self.n) if g is not None
                         and isinstance(lay, Batched) else None)
        return found
