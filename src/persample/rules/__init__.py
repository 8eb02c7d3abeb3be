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

import importlib
import pkgutil

from .calls import OpCall, module_front, module_inputs
from .registry import (
    Rule,
    check_tables,
    find_norm_rule,
    find_op_factors,
    find_op_norm,
    find_op_rule,
    find_op_sum,
    find_rule,
    module_rule,
    register_expansion,
    register_norm_rule,
    register_op_factors,
    register_op_norm,
    register_op_rule,
    register_op_sum,
    register_rule,
    rule_adds,
)

__all__ = ["OpCall", "Rule", "module_front", "module_inputs", "register_op_rule",
           "register_op_norm", "register_op_sum", "register_op_factors", "register_expansion",
           "register_rule", "register_norm_rule", "find_op_rule", "find_op_norm", "find_op_sum",
           "find_op_factors", "find_rule", "find_norm_rule", "module_rule", "rule_adds",
           "check_tables"]

# Importing the rule files registers them: every module of this package is imported, so
# a new op is one new file here.
for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

check_tables()
