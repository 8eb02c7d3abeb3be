"""The methods ``persample bench`` compares, per workload, as :class:`Case` objects.

Each method is a function ``(buf) -> result`` that does what its users write and
returns what they get: a dict ``{name: (B, *param.shape)}`` for the loop,
``torch.func``, Opacus, BackPACK and persample's default call; a tensor for
persample's ``flat=True`` and ``out=`` calls and for input Jacobians. ``buf`` is a
caller-owned, already touched, contiguous tensor of the result's flat shape
(made with ``torch.zeros``) that only persample's ``out=`` row writes into. The
benchmark flattens each result to compare it with the reference, outside the
timed call (:func:`as_flat`). A method that cannot run here has ``fn=None`` and a
note saying why (not installed, not applicable, failed to build, skipped).

The modules, one concern each:

- :mod:`~persample_bench.anchors.case`: what a case and a row are, and what every
  builder shares (flattening results, the mean loss, running under autocast);
- :mod:`~persample_bench.anchors.memory`: how much memory a method would need, to
  skip the ones that would not fit;
- one module per competitor: :mod:`~persample_bench.anchors.loop_rows` (the loops,
  the reference), :mod:`~persample_bench.anchors.torch_func_rows`,
  :mod:`~persample_bench.anchors.opacus_rows`, :mod:`~persample_bench.anchors.backpack_rows`,
  :mod:`~persample_bench.anchors.clipping` (DP-SGD by hand around the loop or
  ``torch.func``) and :mod:`~persample_bench.anchors.persample_rows` (persample's own);
- :mod:`~persample_bench.anchors.builders`: the case of each kind of workload, its
  rows in the table's order.
"""

from .builders import (
    dp_step_case,
    grads_case,
    gram_case,
    input_jacobian_case,
    norms_case,
    param_jacobian_case,
    project_case,
)
from .case import Case, Method, as_flat, num_params, under_autocast
from .memory import memory_estimate

__all__ = ["Case", "Method", "as_flat", "dp_step_case", "grads_case", "gram_case",
           "input_jacobian_case", "memory_estimate", "norms_case", "num_params",
           "param_jacobian_case", "project_case", "under_autocast"]
