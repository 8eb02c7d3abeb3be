"""Record every call of the chosen modules during one forward pass.

DESIGN.md point 1 ("capture, don't re-derive"): a forward hook stores, for each
call of a parameterised module, its positional and keyword inputs and its
output. The engine then asks autograd once for the gradient of the loss with
respect to all recorded outputs (the layers' *backprops*).

State lives in the :class:`Capture` object, never on the model, and the hooks
exist only inside the ``with`` block: they are removed in ``finally``, also
when the forward raises.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn


@dataclass
class Call:
    """One call of one module during the captured forward."""

    name: str  # qualified name of the module in the model ("" for the root)
    module: nn.Module
    args: tuple[Any, ...]  # positional inputs as the module received them
    kwargs: dict[str, Any]  # keyword inputs
    output: Any  # what the module returned
    versions: list[int] = field(default_factory=list)  # version counters at capture

    def tensors(self) -> list[Tensor]:
        """The input and output tensors whose later in-place change would corrupt the rule."""
        found = [a for a in self.args if isinstance(a, Tensor)]
        found += [o for o in _flat_outputs(self.output)]
        return found


def _flat_outputs(output: Any) -> list[Tensor]:
    if isinstance(output, Tensor):
        return [output]
    if isinstance(output, (tuple, list)):
        return [o for o in output if isinstance(o, Tensor)]
    return []


def output_tensors(call: Call) -> list[Tensor]:
    """The output tensors of ``call`` that autograd can differentiate with respect to."""
    return [o for o in _flat_outputs(call.output) if o.requires_grad]


class Capture:
    """Context manager recording the calls of ``modules`` (a dict name -> module).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> net = nn.Sequential(nn.Linear(3, 2))
        >>> with Capture({"0": net[0]}) as cap:
        ...     _ = net(torch.randn(4, 3))
        >>> [c.name for c in cap.calls], len(net[0]._forward_hooks)
        (['0'], 0)
    """

    def __init__(self, modules: dict[str, nn.Module]):
        self.modules = modules
        self.calls: list[Call] = []
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def __enter__(self) -> Capture:
        try:
            for name, module in self.modules.items():
                hook = self._make_hook(name)
                self._handles.append(module.register_forward_hook(hook, with_kwargs=True))
        except BaseException:
            self._remove()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._remove()

    def _remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _make_hook(self, name: str):
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            call = Call(name, module, args, kwargs, output)
            call.versions = [t._version for t in call.tensors()]
            self.calls.append(call)

        return hook
