"""The capture + rule engine: the batch by data flow, rules by op.

1. One forward under :class:`~persample.capture.Capture` records the layout of
   every tensor (by data flow, :mod:`persample.batch`) and every op that reads a
   trainable parameter.
2. :func:`~persample.engine.paths.plan` gives every parameter its path.
3. One ``torch.autograd.grad`` from the summed per-sample losses to the gradient
   edges of the planned ops' outputs gives their backprops; the summed weight
   gradients are never computed (:mod:`persample.engine.backward`). What it produced
   is a :class:`Captured`.
4. :func:`write_per_sample` runs the rules (:mod:`persample.rules`) into the result
   (:mod:`persample.engine.pullback`).

A batch of one needs no capture: its per-sample gradient is the gradient.
"""

from ..rules import EXPANSIONS, module_rule_of, open_capture
from ..rules.ghost import Factors, cross_inner, forming_cost
from .backward import (
    capture_backprops,
    captured_forward,
    cotangent_backprops,
    loss_backprops,
    one_hot,
    rules_grads,
    rules_param_jacobian,
)
from .captured import Captured
from .pullback import write_per_sample

# what the public modules read of the rules, through the engine: the capture with the
# rules' handlers, the module expansions the whole-model methods share, a module's
# rule, and the factors ``(A, G)`` of a linear use with their inner products
__all__ = ["Captured", "capture_backprops", "captured_forward", "cotangent_backprops",
           "loss_backprops",
           "one_hot", "rules_grads", "rules_param_jacobian", "write_per_sample",
           "EXPANSIONS", "Factors", "cross_inner", "forming_cost", "module_rule_of",
           "open_capture"]
