"""Rules: per-sample results from captured activations and backprops.

One :class:`~persample.rules.spec.OpSpec` per op (:mod:`persample.rules.spec`: the
contract, the signatures, the one table), in one file per family of ops, listed below
(as Opacus lists its grad samplers): importing a family registers its specs. A new
op is one new file here and one line below. The files a family may share:
:mod:`~persample.rules.spec` (the table), :mod:`~persample.rules.calls` (what a rule
reads), :mod:`~persample.rules.outer` (sums of outer products),
:mod:`~persample.rules.ghost` (factored gradients and their inner products) and
:mod:`~persample.engine.vjp` (the exact per-op and per-module VJPs the engine falls
back on); a family imports no other family.

**Op rules** are keyed by the op a parameter enters, whatever module class wraps it:
``F.linear``, ``torch.addmm`` (GPT-2's ``Conv1D``), ``matmul``, the convolutions,
``F.embedding``, the norms, an elementwise scale or shift, ``torch.cat``.
**Module rules** (:class:`~persample.rules.spec.ModuleSpec`, :func:`register_rule`) are
for layers whose own kernel keeps what a rule needs to itself (``nn.LSTM``); a module
rule *claims* the ops reading its own parameters inside its calls.
"""

from typing import Any

from torch import Tensor, nn

from ..batch import Layout
from ..capture import Capture
from . import (  # noqa: F401  (the families: importing one registers its specs)
    activation,
    addcmul,
    attention,
    composite,
    conv,
    einsum,
    elementwise,
    embedding,
    experts,
    linear,
    norm,
    random_ops,
    recurrent,
    reparametrized,
    resample,
    sdpa,
    solve,
    views,
)
from .calls import OpCall, module_front, module_inputs
from .spec import (
    EXPANSIONS,
    Decline,
    ModuleRule,
    ModuleSpec,
    OpSpec,
    module_rule,
    module_rule_of,
    register,
    register_module,
    register_norm_rule,
    register_rule,
    rules_of,
    spec_of,
)

__all__ = ["OpCall", "OpSpec", "ModuleSpec", "ModuleRule", "Decline", "register",
           "register_module", "register_rule", "register_norm_rule", "spec_of", "rules_of",
           "module_rule", "module_rule_of", "module_front", "module_inputs", "open_capture"]


def open_capture(model: nn.Module | None, watched: dict[int, nn.Parameter], n: int,
                 batched: list[Tensor | tuple[Tensor, Layout]], shared: tuple = (), *,
                 constant: Any = None, module_rules: bool = True,
                 tape: list | None = None) -> Capture:
    """A :class:`~persample.capture.Capture` wired with the rules: module rules claim
    their calls (unless ``module_rules=False``) and the ops with an expansion run as the
    ops they are made of. The one place a capture is opened.

    Args:
        model, watched, n, batched, shared, constant: as for
            :class:`~persample.capture.Capture`.
        module_rules: let module rules claim their calls (off where only the data flow
            is wanted: the input Jacobians).
        tape: the steps of an earlier capture of the same call
            (:mod:`persample.capture.tape`).

    Returns:
        The capture, to use as a context manager around the forward.

    Examples:
        >>> import torch
        >>> net = torch.nn.Linear(3, 2)
        >>> x = torch.randn(4, 3)
        >>> with open_capture(net, {id(p): p for p in net.parameters()}, 4, [x]) as cap:
        ...     y = net(x)
        >>> cap.layout(y)
        Batched(dim=0)
    """
    return Capture(model, watched, n, batched, shared, module_rule if module_rules else None,
                   constant=constant, expansions=EXPANSIONS, tape=tape)
