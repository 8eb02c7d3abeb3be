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
    multi_output: bool = False  # backprops: a list, one per output tensor
    nested: bool = False  # also writes parameters of submodules read inside the call
    capture: Callable | None = None  # capture(call, func, args, kwargs): see register_rule


_RULES: dict[type[nn.Module], Rule] = {}

# Norm rules: ``norm(layer, activations, backprops (n, 1, *out), names) ->
# {name: (n,) squared norm of each sample's gradient}``, or ``None`` when
# materialising the per-sample gradients is cheaper (the engine then does so).
NormFn = Callable[[nn.Module, tuple, Tensor, set[str]], dict[str, Tensor] | None]
_NORM_RULES: dict[type[nn.Module], NormFn] = {}


def _always(_: nn.Module) -> str | None:
    return None


def register_rule(*types: type[nn.Module], unsupported=_always, multi_output: bool = False,
                  nested: bool = False, capture: Callable | None = None
                  ) -> Callable[[RuleFn], RuleFn]:
    """Register the decorated function as the per-sample rule for the module ``types``.

    Args:
        types: module classes the rule serves (subclasses too, unless they
            override ``forward``).
        unsupported: ``unsupported(layer) -> str | None``; a returned reason sends
            that configuration to the per-module ``torch.func`` fallback instead.
        multi_output: the module returns several tensors (``nn.LSTM``); the rule
            then gets a list of backprops, one ``(n, v, *out)`` per output tensor
            that requires grad, in ``tree_leaves`` order.
        nested: parameters of submodules that are read inside the call without
            being called (``out_proj`` of ``nn.MultiheadAttention``) are given to the
            rule too, in ``out`` under their names relative to the module.
        capture: ``capture(call, func, args, kwargs)``, called for each op run
            directly inside a call of the module during the captured forward;
            it may compute the op itself, keep intermediate tensors whose
            backprops it wants in ``call.extras`` (and any values in
            ``call.saved``), and return the op's output (``None``: run the op as
            usual). The rule then gets the extras' backprops appended to
            ``backprops``, and ``extras=``, ``saved=``.

    Returns:
        A decorator that registers ``fn(layer, activations, backprops, out)`` (see
        the module docstring for the shapes) and returns it unchanged.

    Raises:
        Nothing at registration; a rule raising later propagates to the caller.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> class Scale(nn.Module):  # y = x * w, w of shape (f,)
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.w = nn.Parameter(torch.ones(3))
        ...     def forward(self, x):
        ...         return x * self.w
        >>> @register_rule(Scale)
        ... def scale(layer, activations, backprops, out):
        ...     x = activations[0]  # (n, f)
        ...     torch.mul(backprops, x.unsqueeze(1), out=out["w"])  # (n, v, f)
        >>> import persample
        >>> g = persample.per_sample_grads(Scale(), torch.randn(4, 3), None,
        ...                                lambda out, _: out.sum(1))
        >>> g["w"].shape
        torch.Size([4, 3])
    """

    def decorate(fn: RuleFn) -> RuleFn:
        for cls in types:
            _RULES[cls] = Rule(fn, cls, unsupported, multi_output, nested, capture)
        return fn

    return decorate


def register_norm_rule(*types: type[nn.Module]) -> Callable[[NormFn], NormFn]:
    """Register a per-sample squared-norm rule ("ghost norm") for ``types``.

    Args:
        types: module classes that already have a gradient rule.

    Returns:
        A decorator registering ``norm(layer, activations, backprops, names)``, which
        returns ``{name: (n,)}`` squared per-sample gradient norms for the
        parameter names in ``names``, or ``None`` to have the engine materialise the
        per-sample gradients with the gradient rule instead.

    Raises:
        Nothing at registration; a norm rule raising later propagates.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import persample
        >>> class Gain(nn.Module):  # y = x * w, w of shape (f,)
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.w = nn.Parameter(torch.ones(3))
        ...     def forward(self, x):
        ...         return x * self.w
        >>> @register_rule(Gain)
        ... def gain(layer, activations, backprops, out):
        ...     torch.mul(backprops, activations[0].unsqueeze(1), out=out["w"])
        >>> @register_norm_rule(Gain)
        ... def gain_norm(layer, activations, backprops, names):
        ...     return {"w": (backprops[:, 0] * activations[0]).square().sum(1)}
        >>> persample.per_sample_grad_norms(Gain(), torch.ones(2, 3), None,
        ...                                 lambda out, _: out.sum(1))
        tensor([1.7321, 1.7321])
    """

    def decorate(fn: NormFn) -> NormFn:
        for cls in types:
            _NORM_RULES[cls] = fn
        return fn

    return decorate


def find_norm_rule(rule: Rule | None) -> NormFn | None:
    """The norm rule registered for the same module type as ``rule``, if any."""
    return None if rule is None else _NORM_RULES.get(rule.base)


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
from . import (  # noqa: E402,F401
    activation,
    attention,
    bilinear,
    conv,
    embedding,
    linear,
    norm,
    recurrent,
)
