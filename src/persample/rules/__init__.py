"""Rules: per-sample parameter gradients from captured activations and backprops.

**Op rules** are keyed by the op a parameter enters, whatever module class wraps it:
``F.linear``, ``torch.addmm`` (GPT-2's ``Conv1D``), ``matmul``, the convolutions,
``F.embedding``, the norms, an elementwise scale or shift, ``torch.cat``. One file per
family (every module of this package is imported, so a new op is one new file), each
registered with :func:`register_op_rule`::

    @register_op_rule(F.linear)
    def linear(call: OpCall, g: Tensor, out: dict[Tensor, Tensor]) -> str | None: ...

- ``call``: the op as it ran (:class:`OpCall`); ``call.front(t)`` gives an input
  with the samples in front, ``(n, *per_sample)``, ``per_sample`` the shape that
  input would have if the op ran on that sample alone (the batch dim of size 1, or
  the positions merged with it); an input shared by all samples comes back as it is.
- ``g``: ``(n, v, *per_sample_out)``, the ``v`` cotangents of each sample pulled
  back to the op's output: ``v = 1`` for per-sample gradients, ``v = Y`` one-hot
  output directions for a per-sample parameter Jacobian.
- ``out``: ``{t: (n, v, *shape)}``, keyed by the op's inputs ``t`` that are
  parameters or computed from them; ``shape`` is ``t.shape``, or, for an input the
  op pairs with the samples (``call.front(t)`` is not ``t``), its per-sample shape.
  The rule overwrites each tensor in it (views of a larger buffer: write with
  ``out=`` / ``copy_``), or returns a reason it cannot, and the engine then
  takes the exact per-sample vector-Jacobian product of the op instead.

The same op may have, registered in the same file, each optional:

- a **norm rule** (:func:`register_op_norm`): ``norm(call, g (n, 1, *out), wanted:
  set of parameter inputs) -> {t: (n,)}``, the squared per-sample gradient norms
  without the gradients ("ghost norms", Goodfellow 2015; Li et al. 2022), or ``None``
  where materialising them is cheaper;
- a **weighted-sum rule** (:func:`register_op_sum`), for DP-SGD's clipped sum:
  ``sum(call, g (n, *out), c (n,), into: {t: tensor of t's shape}) -> bool`` adds
  ``sum_i c_i g_i`` (the gradient summed over samples with backprops scaled by the
  clip factors) to each tensor of ``into`` without autograd, or returns ``False``
  having added nothing;
- a **factor rule** (:func:`register_op_factors`), for a parameter several ops read
  (tied weights): ``factors(call, g (n, 1, *out), wanted) -> {t: rules.ghost.Factors}``,
  each use's per-sample gradient as a sum of outer products, or ``None``.

:func:`~persample.rules.registry.check_tables` asserts at import that every op with a
rule has a data-flow handler (:mod:`persample.batch.flow`; a new op declares one with
``register_op_rule(..., flow=handler)``) and every other kind of rule an op rule.

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
