"""Layer rules: per-sample parameter gradients from captured activations and backprops.

A rule is a plain function, one file per layer family, registered for its
module types with :func:`register_rule`::

    @register_rule(nn.Linear)
    def linear(layer, activations, backprops, out): ...

- ``layer``: the module that was called.
- ``activations``: the positional inputs of that call, as captured.
- ``backprops``: ``(n, v, *out_shape)``, the ``v`` cotangents of each sample
  pulled back to the call's output: ``v = 1`` for per-sample gradients (the
  gradient of sample ``i``'s own loss), ``v = Y`` one-hot output directions
  for a per-sample parameter Jacobian. One rule serves both.
- ``out``: ``{param_name: (n, v, *param.shape)}`` for the layer's own parameters
  that need a per-sample result. The rule overwrites every tensor in it; the
  tensors may be non-contiguous views of a flat ``(n, P)`` or ``(n, Y, P)``
  buffer, so rules write with ``out=`` / ``copy_`` instead of returning tensors.

A rule applies to a module whose type is (a subclass of) the registered type
and whose ``forward`` is the registered type's own, so a subclass with its own
forward goes to the per-module fallback instead. ``unsupported(layer)`` may
return a reason to send a particular configuration to the fallback too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor, nn

RuleFn = Callable[[nn.Module, tuple, Tensor, dict[str, Tensor]], None]


@dataclass(frozen=True)
class Rule:
    fn: RuleFn
    base: type[nn.Module]
    unsupported: Callable[[nn.Module], str | None]


_RULES: dict[type[nn.Module], Rule] = {}


def _always(_: nn.Module) -> str | None:
    return None


def register_rule(*types: type[nn.Module], unsupported=_always) -> Callable[[RuleFn], RuleFn]:
    """Register ``fn`` as the per-sample gradient rule for ``types``."""

    def decorate(fn: RuleFn) -> RuleFn:
        for cls in types:
            _RULES[cls] = Rule(fn, cls, unsupported)
        return fn

    return decorate


def find_rule(module: nn.Module) -> tuple[Rule | None, str]:
    """The rule for ``module``, or ``None`` and the reason there is none."""
    for cls in type(module).__mro__:
        rule = _RULES.get(cls)
        if rule is None:
            continue
        if type(module).forward is not cls.forward:
            return None, f"{type(module).__name__} overrides {cls.__name__}.forward"
        reason = rule.unsupported(module)
        return (None, reason) if reason else (rule, "")
    return None, f"no rule for {type(module).__name__}"


# Importing the rule files registers them.
from . import conv, embedding, linear, norm  # noqa: E402,F401
