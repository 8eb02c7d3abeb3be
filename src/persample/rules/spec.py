"""The op contract: one :class:`OpSpec` per op, registered once, in one table.

An op's spec holds everything persample knows of it: the functions it covers (one
named, the others found: :func:`persample.batch.forms.forms`), how it carries the
samples (its data-flow handler, where :mod:`persample.batch` has none), its per-sample
gradient rule and, each optional, its norm, weighted-sum and factor rules, an
expansion (the op run as the ops it is made of during the capture), and its flags.

Every rule gets the backprops in one shape, ``g (n, v, *out)``: ``n`` samples, ``v``
cotangents per sample (``1`` for a loss gradient, the norms and the sums; ``Y``
one-hot output directions for a parameter Jacobian), ``out`` the op's output shape for
one sample. Every rule declines one way: it raises :class:`Decline` with the reason,
and the engine takes the exact slower path (the op's own per-sample vector-Jacobian
product for a gradient; the materialised per-sample gradients for a norm, a sum or
factors). The signatures (``call`` is the op as it ran, :class:`~persample.rules.calls.
OpCall`):

- ``grad(call, g, out) -> None``: overwrite each ``out[t] (n, v, *shape)`` (``t`` an
  input that is a parameter or computed from parameters; ``shape`` its own, or its
  per-sample shape where the op pairs it with the samples) with its per-sample
  gradient (views of a larger buffer: write with ``out=`` or ``copy_``);
- ``norm(call, g, wanted) -> {t: (n,)}``: squared per-sample gradient norms of the
  inputs ``wanted`` without the gradients ("ghost norms"; Goodfellow 2015; Li et al.
  2022), declining where materialising is cheaper;
- ``sum(call, g, c, into) -> None``: add ``sum_i c_i g_i`` (the gradient summed over
  samples with backprops scaled by the clip factors ``c (n,)``) to each ``into[t]`` (of
  ``t``'s shape) without autograd, for DP-SGD's clipped sum (book-keeping, Bu et al.
  2023); it declines before adding anything;
- ``factors(call, g, wanted) -> {t: Factors}``: each use's per-sample gradient as a sum
  of outer products (:class:`~persample.rules.ghost.Factors`), for a parameter several
  ops read (tied weights), and for projections and inner products.

Module rules (:class:`ModuleSpec`) are for layers whose own kernel keeps what a rule
needs to itself (``nn.LSTM``): keyed by module class, they claim the ops reading the
module's own parameters inside its calls.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

from torch import nn

from ..batch.flow import Handler, handler_of, name_of
from ..batch.flow import register as register_flow
from ..batch.forms import forms
from ..capture.records import UNREAD_INPUTS


class Decline(Exception):  # noqa: N818 (what a rule does, not an error)
    """Raised by a rule that cannot give this call's result; the message says why, and
    the engine takes the exact slower path (``supported()`` shows the reason).

    Examples:
        >>> try:
        ...     raise Decline("a weight paired with the samples")
        ... except Decline as why:
        ...     str(why)
        'a weight paired with the samples'
    """


GradRule = Callable[..., None]  # (call, g (n, v, *out), out {t: (n, v, *shape)})
NormRule = Callable[..., dict]  # (call, g (n, 1, *out), wanted) -> {t: (n,)}
SumRule = Callable[..., None]  # (call, g (n, 1, *out), c (n,), into {t: t.shape});
# it declines (raises Decline) before it adds anything, so that the engine may ask for
# several parameters of one op at once and fall back for them all
FactorRule = Callable[..., dict]  # (call, g (n, 1, *out), wanted) -> {t: Factors}


@dataclass(frozen=True, eq=False)
class OpSpec:
    """What persample knows of one op (see the module docstring for the rules'
    signatures).

    Attributes:
        ops: the op, one function per distinct op the rules serve (``torch.mul``;
            ``F.conv1d, F.conv2d, F.conv3d``); :func:`register` finds every other name
            the capture may see each by (``Tensor.mul``, ``__rmul__``, ``multiply``...).
        grad: the per-sample gradient rule.
        norm, sum, factors: the optional norm, weighted-sum and factor rules.
        curvature_factors: a factor rule for curvature (K-FAC) only, where forming the
            factors costs more than the norms and inner products gain from them (a
            convolution's patches); ``None``: ``factors``.
        expand: ``expand(*args, **kwargs)`` runs instead of the op during the capture,
            its ops captured one by one (``F.multi_head_attention_forward`` as its
            projections and attention); it returns ``NotImplemented`` to leave a call
            whole.
        flow: the op's data-flow handler (:mod:`persample.batch.flow`), for an op
            :mod:`persample.batch` has none for.
        adds: the gradient rule can add into a destination that already holds another
            op's contribution (the inputs in ``call.adding``): such rules run after the
            others, so that a tied table's lookup adds its few rows in place.
        reads_inputs: the rules read the op's input values (``False`` for a shift,
            whose gradient is the backprops alone: an input changed in place after the
            op does not matter).
        complex: the rules hold for complex tensors too, in PyTorch's convention (the
            vector-Jacobian product of ``a * b`` w.r.t. ``b`` is ``g * conj(a)``; a real
            input of a complex op gets the real part). Without it, a call reading or
            making a complex tensor takes the exact slower paths (:func:`rules_of`):
            formulas written for real tensors, ``g x^T`` for ``g x^H``, would be
            silently wrong there.
        reads_values: the gradient rule reads values into Python where the dispatcher
            does not see it (``Tensor.tolist()``): a cached call runs it again rather
            than replaying the ATen ops it ran (:mod:`persample.engine.replay`).
        multi_output: the op returns several tensors (a recurrent kernel's output and
            final states); the gradient rule gets ``g`` as a list, one ``(n, v, *out_k)``
            per output (``None`` where no cotangent reaches it).
        funcs: every function covered, found by :func:`register`.
    """

    ops: tuple[Any, ...]
    grad: GradRule | None = None
    norm: NormRule | None = None
    sum: SumRule | None = None
    factors: FactorRule | None = None
    curvature_factors: FactorRule | None = None
    expand: Callable[..., Any] | None = None
    flow: Handler | None = None
    adds: bool = False
    reads_inputs: bool = True
    complex: bool = False
    reads_values: bool = False
    multi_output: bool = False
    funcs: tuple[Any, ...] = ()

    @property
    def name(self) -> str:
        return name_of(self.ops[0])


SPECS: dict[Any, OpSpec] = {}  # every function of every spec -> its spec
EXPANSIONS: dict[Any, Callable[..., Any]] = {}  # func -> spec.expand, for the capture


def register(spec: OpSpec) -> OpSpec:
    """Put ``spec`` in the table under every function of its ops (their forms).

    Args:
        spec: the op's spec; ``ops`` entries that are ``None`` (ops this torch lacks)
            are skipped.

    Returns:
        The spec as registered, ``funcs`` filled in.

    Raises:
        ValueError: an op without a data-flow handler (its output would get an unknown
            layout and the rule would never run: pass ``flow=``), a function another
            spec covers, a norm, sum or factor rule without a gradient rule, or a spec
            with neither a gradient rule nor an expansion. Nothing is registered then.

    Examples:
        >>> import torch
        >>> def xlogy_rule(call, g, out): ...
        >>> spec = register(OpSpec((torch.special.xlogy,), grad=xlogy_rule))
        >>> SPECS[torch.special.xlogy] is spec, spec.funcs[0] is torch.special.xlogy
        (True, True)
        >>> unregister(spec)
    """
    ops = tuple(f for f in spec.ops if f is not None)
    funcs = tuple(dict.fromkeys(f for op in ops for f in forms(op)))
    spec = dataclasses.replace(spec, ops=ops, funcs=funcs)
    _check(spec)
    if spec.flow is not None:
        register_flow(spec.flow, *funcs)
    for f in funcs:
        SPECS[f] = spec
        if spec.expand is not None:
            EXPANSIONS[f] = spec.expand
        if not spec.reads_inputs:
            UNREAD_INPUTS.add(f)
    return spec


def unregister(spec: OpSpec) -> None:
    """Take ``spec`` out of the table (its data-flow handler stays)."""
    for f in spec.funcs:
        if SPECS.get(f) is spec:
            del SPECS[f]
            EXPANSIONS.pop(f, None)
            UNREAD_INPUTS.discard(f)


def _check(spec: OpSpec) -> None:
    """Raise ``ValueError`` naming what is wrong with ``spec`` (see :func:`register`)."""
    if not spec.funcs:
        raise ValueError("an OpSpec needs at least one op")
    extra = [k for k in ("norm", "sum", "factors") if getattr(spec, k) is not None]
    if extra and spec.grad is None:
        raise ValueError(f"the spec of {spec.name} has a {extra[0]} rule but no gradient rule")
    if spec.grad is None and spec.expand is None:
        raise ValueError(f"the spec of {spec.name} has neither a gradient rule nor an expansion")
    taken = [f for f in spec.funcs if f in SPECS]
    if taken:
        raise ValueError(f"{name_of(taken[0])} is already covered by the spec of "
                         f"{SPECS[taken[0]].name}: one spec per op")
    lost = [f for f in spec.funcs if handler_of(f) is None]
    if lost and spec.grad is not None and spec.flow is None:
        raise ValueError(f"{name_of(lost[0])} has no data-flow handler: declare how it "
                         "carries the samples with OpSpec(..., flow=handler)")


def spec_of(func: Any) -> OpSpec | None:
    """The spec covering ``func`` (as the capture's mode sees it), or ``None``."""
    return SPECS.get(func)


def rules_of(op: Any) -> OpSpec | None:
    """The spec whose rules (gradient, norm, sum, factors) apply to the recorded ``op``
    (:class:`persample.capture.Op`): ``spec_of(op.func)``, or ``None`` where the op
    reads or makes a complex tensor and the spec's rules are written for real ones
    (``OpSpec.complex``); the engine then takes the exact slower paths."""
    spec = SPECS.get(op.func)
    if spec is None or spec.complex:
        return spec
    if any(t.is_complex() for t in op.leaves) or any(
            t.is_complex() for t in op.outputs):
        return None
    return spec


# ---------------------------------------------------------------------------
# module rules

ModuleGrad = Callable[..., None]  # (layer, activations, backprops, out {name: (n, v, *shape)})
ModuleNorm = Callable[..., dict]  # (layer, activations, backprops (n, 1, *out), names)


@dataclass(frozen=True, eq=False)
class ModuleSpec:
    """A module rule: the per-sample gradients of a layer's own parameters, computed as a
    whole (see :func:`persample.rules.register_rule` for the signatures).

    Attributes:
        types: the module classes it serves (subclasses too, unless they override
            ``forward``).
        grad: ``grad(layer, activations, backprops, out)``.
        norm: ``norm(layer, activations, backprops, names) -> {name: (n,)}`` squared
            norms without the gradients; raises :class:`Decline` to materialise.
        check: ``check(layer)`` raises :class:`Decline` for a configuration the rule
            does not serve: its ops then take their op rules.
        refusal: ``refusal(layer) -> str | None``, why no method can split this layer by
            sample (an RNN's dropout between layers in training mode), for ``supported``.
        multi_output: the module returns several tensors (``nn.LSTM``); ``grad`` then
            gets a list of backprops, one per output tensor that requires grad.
        match: ``match(module) -> bool`` serves modules of classes persample does not
            import (a library's mixture of experts, recognised by its parameters and
            ``forward``), beside ``types``.
        rows: the call's inputs and outputs may hold several rows per sample (tokens
            merged with the batch, ``(B*T, H)``): they reach ``grad`` as ``(n, T, ...)``.
        keeps_layout: the call's output holds the samples as its first input does (what
            the ops inside do to them, routing and regrouping tokens, is the rule's).
        outputs: ``grad`` also gets ``outputs=``: the call's output tensors (those with
            backprops), samples in dim 0, or ``None`` where one changed in place since.
        inner: functions of the ops inside the call whose outputs' gradients ``grad``
            reads; if any, ``grad`` also gets ``inner=``: where the call's ops ran
            unfollowed (``keeps_layout``), those that read its parameters (or views of
            them) or gathered rows of its inputs, in order, as :class:`InnerOp` (with
            the backward's gradient at the output of each op of these functions, the
            backward asked for no other); else ``[]``.
        recurse: the rule gives the parameters of the module's children too (a
            ``ModuleDict`` of experts); ``out`` then has their dotted names.
    """

    types: tuple[type[nn.Module], ...]
    grad: ModuleGrad
    norm: ModuleNorm | None = None
    check: Callable[[nn.Module], None] | None = None
    refusal: Callable[[nn.Module], str | None] | None = None
    multi_output: bool = False
    match: Callable[[nn.Module], bool] | None = None
    rows: bool = False
    keeps_layout: bool = False
    outputs: bool = False
    inner: tuple = ()
    recurse: bool = False

    def params(self, module: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
        """``(name, parameter)`` of what the rule gives for ``module``."""
        return module.named_parameters(recurse=self.recurse)


class InnerOp(NamedTuple):
    """An op a module call ran (see ``ModuleSpec.inner``): ``func(*args, **kwargs) ->
    output``, and ``grad (v, *output.shape)``, the backward's gradient at ``output``
    (``None`` for a view, or where none reached it)."""

    func: Any
    args: tuple
    kwargs: dict
    output: Any
    grad: Any


@dataclass(frozen=True, eq=False)
class ModuleRule:
    """A module spec as it applies to one module: the spec and the class it matched."""

    spec: ModuleSpec
    base: type[nn.Module]


MODULE_SPECS: dict[type[nn.Module], ModuleSpec] = {}
MATCHED_SPECS: list[ModuleSpec] = []  # specs with ``match``, tried after the classes


def register_module(spec: ModuleSpec) -> ModuleSpec:
    """Put ``spec`` in the table under each of its module classes (replacing what was
    there: a user's rule for a class wins).

    Examples:
        >>> from torch import nn
        >>> class Twice(nn.Linear): ...
        >>> spec = register_module(ModuleSpec((Twice,), grad=lambda *a: None))
        >>> module_rule_of(Twice(2, 2))[0].spec is spec
        True
        >>> del MODULE_SPECS[Twice]
    """
    for cls in spec.types:
        MODULE_SPECS[cls] = spec
    if spec.match is not None:
        MATCHED_SPECS.append(spec)
    return spec


def module_rule_of(module: nn.Module) -> tuple[ModuleRule | None, str]:
    """The module rule for ``module``, or ``None`` and the reason there is none."""
    for cls in type(module).__mro__:
        spec = MODULE_SPECS.get(cls)
        if spec is None:
            continue
        if type(module).forward is not cls.forward:
            return None, f"{type(module).__name__} overrides {cls.__name__}.forward"
        try:
            if spec.check is not None:
                spec.check(module)
        except Decline as why:
            return None, str(why)
        return ModuleRule(spec, cls), ""
    for spec in MATCHED_SPECS:
        if spec.match(module):
            try:
                if spec.check is not None:
                    spec.check(module)
            except Decline as why:
                return None, str(why)
            return ModuleRule(spec, type(module)), ""
    return None, f"no module rule for {type(module).__name__}"


def module_rule(module: nn.Module) -> ModuleRule | None:
    """The module rule that applies to ``module`` (for the capture), or ``None``."""
    return module_rule_of(module)[0] if MODULE_SPECS or MATCHED_SPECS else None


def register_rule(*types: type[nn.Module], check: Callable[[nn.Module], None] | None = None,
                  multi_output: bool = False) -> Callable[[ModuleGrad], ModuleGrad]:
    """Register the decorated function as the per-sample rule for the module ``types``.

    Most layers need none: the ops they are built from (``F.linear``, convolutions,
    norms, an elementwise scale, ...) have rules whatever the module class. A module
    rule is for a layer whose per-sample gradient is better computed as a whole; it
    takes over every op reading the module's own parameters inside its call.

    Args:
        types: module classes the rule serves (subclasses too, unless they
            override ``forward``).
        check: ``check(layer)`` raises :class:`Decline` (with the reason) for a
            configuration the rule does not serve; that layer's ops then take their op
            rules (or the exact fallback).
        multi_output: the module returns several tensors (``nn.LSTM``); the rule
            then gets a list of backprops, one ``(n, v, *out)`` per output tensor
            that requires grad, in ``tree_leaves`` order.

    Returns:
        A decorator registering ``fn(layer, activations, backprops, out)``:
        ``activations`` the call's positional inputs with the samples in dim 0 (a
        sequence-first ``(T, B, F)`` input comes as ``(B, T, F)``), ``backprops``
        ``(n, v, *out)`` likewise, ``out`` ``{param_name: (n, v, *param.shape)}`` to
        overwrite for the module's own parameters. It returns ``fn`` unchanged.

    Nothing is raised at registration; a rule raising later propagates to the caller.

    Examples:
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

    def decorate(fn: ModuleGrad) -> ModuleGrad:
        register_module(ModuleSpec(types, fn, check=check, multi_output=multi_output))
        return fn

    return decorate


def register_norm_rule(*types: type[nn.Module]) -> Callable[[ModuleNorm], ModuleNorm]:
    """Register a per-sample squared-norm rule ("ghost norm") for module ``types``.

    Args:
        types: module classes that already have a module rule.

    Returns:
        A decorator registering ``norm(layer, activations, backprops, names)``, which
        returns ``{name: (n,)}`` squared per-sample gradient norms for the parameter
        names in ``names`` (``backprops`` ``(n, 1, *out)``), or raises :class:`Decline`
        to have the engine materialise the per-sample gradients with the module rule.

    Raises:
        ValueError: a type without a module rule.

    Examples:
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

    def decorate(fn: ModuleNorm) -> ModuleNorm:
        for cls in types:
            spec = MODULE_SPECS.get(cls)
            if spec is None:
                raise ValueError(f"{cls.__name__} has no module rule: register_rule first")
            MODULE_SPECS[cls] = dataclasses.replace(spec, norm=fn)
        return fn

    return decorate
