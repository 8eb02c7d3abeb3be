"""Rules: per-sample parameter gradients from captured activations and backprops.

**Op rules** are keyed by the op a parameter enters, whatever
module class wraps it: ``F.linear``, ``torch.addmm`` (GPT-2's ``Conv1D``),
``matmul``, the convolutions, ``F.embedding``, the norms, an elementwise scale or
shift, ``torch.cat``. One file per family, each registered with
:func:`register_op_rule`::

    @register_op_rule(F.linear)
    def linear(call: OpCall, g: Tensor, out: dict[int, Tensor]) -> str | None: ...

- ``call``: the op as it ran (:class:`OpCall`); ``call.front(t)`` gives an input
  with the samples in front, ``(n, *per_sample)``, ``per_sample`` the shape that
  input would have if the op ran on that sample alone (the batch dim of size 1, or
  the positions merged with it); an input shared by all samples comes back as it is.
- ``g``: ``(n, v, *per_sample_out)``, the ``v`` cotangents of each sample pulled
  back to the op's output: ``v = 1`` for per-sample gradients, ``v = Y`` one-hot
  output directions for a per-sample parameter Jacobian.
- ``out``: ``{id(t): (n, v, *shape)}`` for the op's inputs ``t`` that are
  parameters or computed from them; ``shape`` is ``t.shape``, or, for an input the
  op pairs with the samples (``call.front(t)`` is not ``t``), its per-sample shape.
  The rule overwrites each tensor in it (views of a larger buffer: write with
  ``out=`` / ``copy_``), or returns a reason it cannot, and the engine then
  takes the exact per-sample vector-Jacobian product of the op instead.

**Module rules** are for layers whose own kernel keeps what a rule needs to itself
(``nn.LSTM``): :func:`register_rule` (the public way to add a rule for a custom
module). A module rule *claims* the ops reading its own parameters inside its calls.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..batch import Batched, front
from ..precision import cast


class OpCall:
    """One recorded op (:class:`persample.capture.Op`) as a rule sees it.

    ``args``/``kwargs`` as the op received them; ``arg(i, name, default)`` reads one
    by position or keyword; ``front(t)`` brings the samples of input ``t`` to the
    front; ``shared(t)`` tells whether ``t`` is the same for every sample; ``n``
    is the batch size.
    """

    def __init__(self, op: Any, n: int, dtype: torch.dtype | None = None):
        self.op, self.n, self.dtype = op, n, dtype
        self.adding: set[int] = set()  # outputs to add to, not overwrite (``adds`` rules)
        self.func, self.args, self.kwargs = op.func, op.args, op.kwargs
        self._pos = {}
        for k, t in enumerate(op.leaves):
            self._pos.setdefault(id(t), k)

    def arg(self, i: int, name: str | None = None, default: Any = None) -> Any:
        if name is not None and name in self.kwargs:
            return self.kwargs[name]
        return self.args[i] if i < len(self.args) else default

    def _k(self, t: Tensor) -> int:
        return self._pos[id(t)]

    def pairing(self, t: Tensor) -> Batched | None:
        return self.op.pairing(self._k(t))

    def shared(self, t: Tensor) -> bool:
        return self.pairing(t) is None

    def front(self, t: Tensor) -> Tensor:
        """``(n, *per_sample)`` for an input carrying samples; a shared input as it is.
        The value the op read (the saved one if the op overwrote it in place)."""
        if not isinstance(t, Tensor):
            return t
        k = self._k(t)
        value = cast(self.op.value(k).detach(), self.dtype)
        lay = self.op.pairing(k)
        return value if lay is None else front(value, lay, self.n)

    def where(self) -> str:
        return self.op.where()

    def only(self, out: dict, *tensors: Any) -> str | None:
        """A reason to decline if ``out`` asks for inputs other than ``tensors`` (a
        derived input the rule does not differentiate: the engine then does)."""
        mine = {id(t) for t in tensors if isinstance(t, Tensor)}
        return None if set(out) <= mine else "asked for an input the rule does not cover"


OpRuleFn = Callable[[OpCall, Tensor, dict[int, Tensor]], "str | None"]
_OP_RULES: dict[Any, OpRuleFn] = {}

# Norm rules by op: ``norm(call, g (n, 1, *out), wanted: set[int]) -> {id(t): (n,)}``
# squared per-sample gradient norms without the gradients, or ``None`` when
# materialising them is cheaper.
OpNormFn = Callable[[OpCall, Tensor, set[int]], "dict[int, Tensor] | None"]
_OP_NORMS: dict[Any, OpNormFn] = {}

# Weighted-sum rules by op, for DP book-keeping: ``sum(call, g (n, *out), c (n,), into:
# {id(t): tensor of t's shape}) -> bool`` adds ``sum_i c_i g_i`` (the gradient summed
# over the samples for backprops scaled by the clip factors ``c``) to each tensor of
# ``into``, with no autograd call, or returns False having added nothing.
OpSumFn = Callable[[OpCall, Tensor, Tensor, dict[int, Tensor]], bool]
_OP_SUMS: dict[Any, OpSumFn] = {}


def register_op_rule(*funcs: Any, adds: bool = False) -> Callable[[OpRuleFn], OpRuleFn]:
    """Register the decorated function as the per-sample rule of the ops ``funcs``
    (function objects as the ``TorchFunctionMode`` sees them: ``F.linear``,
    ``torch.Tensor.mul``, ...). See the module docstring for the signature.

    ``adds``: the rule can add its result to a destination that already holds another
    op's contribution (the tensors whose ids are in ``call.adding``) instead of
    overwriting it; such rules run after the others, so that a tied table's lookup
    adds its few rows to the output layer's dense gradient in place."""

    def decorate(fn: OpRuleFn) -> OpRuleFn:
        for f in funcs:
            if f is not None:
                _OP_RULES[f] = fn
                if adds:
                    _ADDING.add(f)
        return fn

    return decorate


_ADDING: set[Any] = set()


def rule_adds(func: Any) -> bool:
    """Whether the op's rule can add into a destination (``register_op_rule(adds=True)``)."""
    return func in _ADDING


def _registering(table: dict[Any, Callable], funcs: tuple) -> Callable[[Callable], Callable]:
    """A decorator putting its function in ``table`` under each of ``funcs``."""

    def decorate(fn: Callable) -> Callable:
        for f in funcs:
            if f is not None:
                table[f] = fn
        return fn

    return decorate


def register_op_norm(*funcs: Any) -> Callable[[OpNormFn], OpNormFn]:
    """Register a squared-norm rule ("ghost norm") for ops that have an op rule."""
    return _registering(_OP_NORMS, funcs)


def register_op_sum(*funcs: Any) -> Callable[[OpSumFn], OpSumFn]:
    """Register a weighted-sum rule (the clipped sum of DP book-keeping) for ops that
    have a norm rule."""
    return _registering(_OP_SUMS, funcs)


# Factor rules by op, for a parameter several ops read (tied weights, a layer called
# twice): ``factors(call, g (n, 1, *out), wanted) -> {id(t): rules.ghost.Factors}``, each
# use's per-sample gradient of ``t`` (seen as ``(t.shape[0], -1)``) as a sum of outer
# products, or ``None`` where the op's form has none.
_OP_FACTORS: dict[Any, Callable] = {}


def register_op_factors(*funcs: Any) -> Callable[[Callable], Callable]:
    """Register a factor rule (see ``rules.ghost``) for ops that have an op rule."""
    return _registering(_OP_FACTORS, funcs)


def find_op_factors(func: Any) -> Callable | None:
    return _OP_FACTORS.get(func)


def find_op_sum(func: Any) -> OpSumFn | None:
    return _OP_SUMS.get(func)


def find_op_rule(func: Any) -> OpRuleFn | None:
    return _OP_RULES.get(func)


def find_op_norm(func: Any) -> OpNormFn | None:
    return _OP_NORMS.get(func)


# ---------------------------------------------------------------------------
# module rules

RuleFn = Callable[[nn.Module, tuple, Tensor, dict[str, Tensor]], None]


@dataclass(frozen=True)
class Rule:
    fn: RuleFn
    base: type[nn.Module]
    unsupported: Callable[[nn.Module], str | None]
    multi_output: bool = False  # backprops: a list, one per output tensor


_RULES: dict[type[nn.Module], Rule] = {}

# Norm rules of module rules: ``norm(layer, activations, backprops (n, 1, *out), names) ->
# {name: (n,)}`` squared norms, or ``None`` to materialise instead.
NormFn = Callable[[nn.Module, tuple, Tensor, set[str]], dict[str, Tensor] | None]
_NORM_RULES: dict[type[nn.Module], NormFn] = {}


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
            _RULES[cls] = Rule(fn, cls, unsupported, multi_output)
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
            _NORM_RULES[cls] = fn
        return fn

    return decorate


def find_norm_rule(rule: Rule | None) -> NormFn | None:
    """The norm rule registered for the same module type as ``rule``, if any."""
    return None if rule is None else _NORM_RULES.get(rule.base)


def find_rule(module: nn.Module) -> tuple[Rule | None, str]:
    """The module rule for ``module``, or ``None`` and the reason there is none."""
    for cls in type(module).__mro__:
        rule = _RULES.get(cls)
        if rule is None:
            continue
        if type(module).forward is not cls.forward:
            return None, f"{type(module).__name__} overrides {cls.__name__}.forward"
        reason = rule.unsupported(module)
        return (None, reason) if reason else (rule, "")
    return None, f"no module rule for {type(module).__name__}"


def module_rule(module: nn.Module) -> Rule | None:
    """The module rule that applies to ``module`` (for the capture), or ``None``."""
    return find_rule(module)[0] if _RULES else None


# Importing the rule files registers them.
from . import (  # noqa: E402,F401
    activation,
    attention,
    conv,
    elementwise,
    embedding,
    linear,
    norm,
    recurrent,
    views,
)
