"""The rule tables: one decorator per kind of rule, all made by one factory.

Every op table is keyed by the function object the capture's ``TorchFunctionMode``
receives (``F.linear``, ``torch.Tensor.mul``, ...), the same key as the data-flow
handlers of :mod:`persample.batch.flow`; :func:`check_tables` asserts after the rule
files are imported that every op with a rule has a data-flow handler (else the capture
would give its output an unknown layout and the rule would never run) and that every
norm, weighted-sum and factor rule belongs to an op with a rule.

Kinds of op rules (see the signatures in :mod:`persample.rules`):

- ``OP_RULES``: the per-sample gradient of the op's parameter inputs;
- ``OP_NORMS``: their squared per-sample norms without the gradients ("ghost norms");
- ``OP_SUMS``: the sum over samples of clip-factor-weighted gradients (DP-SGD);
- ``OP_FACTORS``: each use's per-sample gradient as a sum of outer products, for a
  parameter several ops read (tied weights).

Module rules (``MODULE_RULES``, ``MODULE_NORMS``) are keyed by module class;
``EXPANSIONS`` by the op the capture runs as its decomposition instead.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from ..batch.flow import HANDLERS, Handler, name_of, register

OP_RULES: dict[Any, Callable] = {}
OP_NORMS: dict[Any, Callable] = {}
OP_SUMS: dict[Any, Callable] = {}
OP_FACTORS: dict[Any, Callable] = {}
ADDING: set[Any] = set()  # ops whose rule can add into a destination (``adds=True``)
EXPANSIONS: dict[Any, Callable] = {}  # func -> a decomposition run under the capture


def _registrar(table: dict, kind: str, name: str) -> Callable[..., Callable[[Callable], Callable]]:
    """A decorator factory putting its function in ``table`` under each of ``funcs``
    (``None`` entries, ops this torch lacks, are skipped). ``flow``: the op's data-flow
    handler (``persample.batch.flow``), for an op whose handler is not there yet;
    ``adds`` (op rules): see :func:`register_op_rule`."""

    def registration(*funcs: Any, flow: Handler | None = None, adds: bool = False
                     ) -> Callable[[Callable], Callable]:
        present = [f for f in funcs if f is not None]
        if flow is not None:
            register(flow, *present)
        lost = [f for f in present if table is OP_RULES and f not in HANDLERS]
        if lost:  # its output would have an unknown layout: the rule would never run
            raise ValueError(f"{name_of(lost[0])} has no data-flow handler: declare how it "
                             "carries the samples with register_op_rule(..., flow=handler)")
        if adds and table is not OP_RULES:
            raise TypeError(f"adds=True is for op rules, not for a {kind}")

        def decorate(fn: Callable) -> Callable:
            for f in present:
                table[f] = fn
                if adds:
                    ADDING.add(f)
            return fn

        return decorate

    registration.__name__ = registration.__qualname__ = name
    registration.__doc__ = f"Register the decorated function as the {kind} of the ops ``funcs``."
    return registration


register_op_rule = _registrar(OP_RULES, "op rule", "register_op_rule")
register_op_rule.__doc__ = """Register the decorated function as the per-sample rule of the
ops ``funcs`` (function objects as the ``TorchFunctionMode`` sees them: ``F.linear``,
``torch.Tensor.mul``, ...). See :mod:`persample.rules` for the signature.

``flow``: the op's data-flow handler (how the op carries the samples from its inputs
to its outputs, :mod:`persample.batch.flow`) if the op has none yet: a new op is then
declared in one file. ``adds``: the rule can add its result to a destination that
already holds another op's contribution (the tensors in
``call.adding``) instead of overwriting it; such rules run after the others, so that a
tied table's lookup adds its few rows to the output layer's dense gradient in place.

Raises ``ValueError`` naming the op if it has no data-flow handler and ``flow`` is not
given (the capture would give its output an unknown layout, and the rule never run)."""
register_op_norm = _registrar(OP_NORMS, "norm rule", "register_op_norm")
register_op_sum = _registrar(OP_SUMS, "weighted-sum rule", "register_op_sum")
register_op_factors = _registrar(OP_FACTORS, "factor rule", "register_op_factors")
register_expansion = _registrar(EXPANSIONS, "expansion", "register_expansion")
register_expansion.__doc__ = """Run ``fn(*args, **kwargs)`` instead of ``func`` during the
capture, with its ops captured one by one (``F.multi_head_attention_forward`` as the
linear maps and the attention it is made of). ``fn`` returns ``NotImplemented`` to
leave a call whole."""

OP_TABLES = {"op rule": OP_RULES, "norm rule": OP_NORMS, "weighted-sum rule": OP_SUMS,
             "factor rule": OP_FACTORS}


def rule_adds(func: Any) -> bool:
    """Whether the op's rule can add into a destination (``register_op_rule(adds=True)``)."""
    return func in ADDING


def find_op_rule(func: Any) -> Callable | None:
    return OP_RULES.get(func)


def find_op_norm(func: Any) -> Callable | None:
    return OP_NORMS.get(func)


def find_op_sum(func: Any) -> Callable | None:
    return OP_SUMS.get(func)


def find_op_factors(func: Any) -> Callable | None:
    return OP_FACTORS.get(func)


def check_tables() -> None:
    """Every op with a rule has a data-flow handler; every other kind of op rule belongs
    to an op with a rule. Raises ``AssertionError`` naming the ops otherwise."""
    missing = [name_of(f) for f in OP_RULES if f not in HANDLERS]
    if missing:
        raise AssertionError(f"op rules without a data-flow handler: {missing} (declare "
                             "one with register_op_rule(..., flow=handler))")
    for kind, table in OP_TABLES.items():
        orphans = [name_of(f) for f in table if f not in OP_RULES]
        if orphans:
            raise AssertionError(f"{kind}s of ops without an op rule: {orphans}")


# ---------------------------------------------------------------------------
# module rules

RuleFn = Callable[[nn.Module, tuple, Tensor, dict[str, Tensor]], None]


@dataclass(frozen=True)
class Rule:
    fn: RuleFn
    base: type[nn.Module]
    unsupported: Callable[[nn.Module], str | None]
    multi_output: bool = False  # backprops: a list, one per output tensor


MODULE_RULES: dict[type[nn.Module], Rule] = {}

# Norm rules of module rules: ``norm(layer, activations, backprops (n, 1, *out), names) ->
# {name: (n,)}`` squared norms, or ``None`` to materialise instead.
NormFn = Callable[[nn.Module, tuple, Tensor, set[str]], dict[str, Tensor] | None]
MODULE_NORMS: dict[type[nn.Module], NormFn] = {}

TABLES = {**OP_TABLES, "module rule": MODULE_RULES, "module norm rule": MODULE_NORMS,
          "expansion": EXPANSIONS}


def _always(_: nn.Module) -> str | None:
    return None


def register_rule(*types: type[nn.Module], unsupported=_always, multi_output: bool = False
                  ) -> Callable[[RuleFn], RuleFn]:
    """Register the decorated function as the per-sample rule for the module ``types``.

    Most layers need none: the ops they are built from (``F.linear``, convolutions,
    norms, an elementwise scale, ...) have rules whatever the module class. A module
    rule is for a layer whose per-sample gradient is better computed as a whole; it
    takes over every op reading the module's own parameters inside its call.

    Args:
        types: module classes the rule serves (subclasses too, unless they
            override ``forward``).
        unsupported: ``unsupported(layer) -> str | None``; a returned reason leaves
            that configuration to the op rules (or the exact fallback).
        multi_output: the module returns several tensors (``nn.LSTM``); the rule
            then gets a list of backprops, one ``(n, v, *out)`` per output tensor
            that requires grad, in ``tree_leaves`` order.

    Returns:
        A decorator registering ``fn(layer, activations, backprops, out)``:
        ``activations`` the call's positional inputs with the samples in dim 0 (a
        sequence-first ``(T, B, F)`` input comes as ``(B, T, F)``), ``backprops``
        ``(n, v, *out)`` likewise, ``out`` ``{param_name: (n, v, *param.shape)}`` to
        overwrite for the module's own parameters. It returns ``fn`` unchanged.

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
            MODULE_RULES[cls] = Rule(fn, cls, unsupported, multi_output)
        return fn

    return decorate


def register_norm_rule(*types: type[nn.Module]) -> Callable[[NormFn], NormFn]:
    """Register a per-sample squared-norm rule ("ghost norm") for module ``types``.

    Args:
        types: module classes that already have a module rule.

    Returns:
        A decorator registering ``norm(layer, activations, backprops, names)``, which
        returns ``{name: (n,)}`` squared per-sample gradient norms for the
        parameter names in ``names``, or ``None`` to have the engine materialise the
        per-sample gradients with the module rule instead.

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
            MODULE_NORMS[cls] = fn
        return fn

    return decorate


def find_norm_rule(rule: Rule | None) -> NormFn | None:
    """The norm rule registered for the same module type as ``rule``, if any."""
    return None if rule is None else MODULE_NORMS.get(rule.base)


def find_rule(module: nn.Module) -> tuple[Rule | None, str]:
    """The module rule for ``module``, or ``None`` and the reason there is none."""
    for cls in type(module).__mro__:
        rule = MODULE_RULES.get(cls)
        if rule is None:
            continue
        if type(module).forward is not cls.forward:
            return None, f"{type(module).__name__} overrides {cls.__name__}.forward"
        reason = rule.unsupported(module)
        return (None, reason) if reason else (rule, "")
    return None, f"no module rule for {type(module).__name__}"


def module_rule(module: nn.Module) -> Rule | None:
    """The module rule that applies to ``module`` (for the capture), or ``None``."""
    return find_rule(module)[0] if MODULE_RULES else None
