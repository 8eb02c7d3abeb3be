"""The BackPACK rows: ``BatchGrad`` (per-sample gradients) and ``BatchL2Grad``
(per-sample gradient norms), as BackPACK's documentation shows them.

BackPACK needs its own ``nn.CrossEntropyLoss`` on ``(B, C)`` logits; a model that
is not an ``nn.Sequential`` goes through ``extend(model, use_converter=True)``
(torch.fx), as BackPACK's docs say for ResNets. Other losses and dict inputs get
a row with ``fn=None`` and a note.
"""

from __future__ import annotations

import copy
import warnings

from torch import Tensor, nn

from ..workloads import Workload
from .case import Method, failed, optional_method


def _extended(w: Workload) -> nn.Module:
    """A copy of the workload's model extended for BackPACK (its warnings hidden)."""
    from backpack import extend

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return extend(copy.deepcopy(w.model), use_converter=not isinstance(w.model, nn.Sequential))


def backpack(w: Workload) -> Method:
    """BackPACK ``BatchGrad``: ``{name: p.grad_batch * B}`` (it gives the mean loss's terms).

    Examples:
        >>> from persample_bench.workloads import grads_workload
        >>> backpack(grads_workload("cnn-grads", 2)).name
        'BackPACK BatchGrad'

    Source: BackPACK's ``BatchGrad`` documentation (``extend``, ``use_converter``).
    """
    name = "BackPACK BatchGrad"
    try:
        from backpack import backpack as context
        from backpack import extend
        from backpack.extensions import BatchGrad
    except ImportError:
        return Method(name, None, "not installed (pip install --no-deps backpack-for-pytorch)")
    if not isinstance(w.loss_fn, nn.CrossEntropyLoss) or isinstance(w.inputs, dict):
        return Method(name, None, "not applicable: BackPACK needs its own loss module on "
                      "(B, C) outputs")
    try:
        model = _extended(w)
    except Exception as err:
        return failed(name, err)
    loss_fn = extend(nn.CrossEntropyLoss())
    n = w.n

    def run(_: Tensor) -> dict[str, Tensor]:
        model.zero_grad(set_to_none=True)
        with context(BatchGrad()), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # full backward hooks on modules without input grads
            loss_fn(model(w.inputs), w.targets).backward()
        out = {k: p.grad_batch * n for k, p in model.named_parameters()}
        for p in model.parameters():  # (its own buffers, freed as users' next step would)
            p.grad_batch = None
        return out

    return Method(name, run)


def batch_l2(w: Workload) -> Method:
    """BackPACK ``BatchL2Grad``: the per-sample gradient norms ``(B,)`` (of the mean
    loss's terms, times ``B``).

    Examples:
        >>> from persample_bench.workloads import dp_workload
        >>> batch_l2(dp_workload("cnn-norms", 2)).name
        'BackPACK BatchL2Grad'

    Source: BackPACK's ``BatchL2Grad`` documentation.
    """
    return optional_method(lambda: _batch_l2_step(w), "BackPACK BatchL2Grad", "backpack", w,
                           lambda step: step())


def _batch_l2_step(w: Workload):
    """``run()``: one backward under ``BatchL2Grad``, the norms from ``p.batch_l2``."""
    from backpack import backpack as context
    from backpack import extend
    from backpack.extensions import BatchL2Grad

    model = _extended(w)
    loss_fn, n = extend(nn.CrossEntropyLoss()), w.n

    def run() -> Tensor:
        model.zero_grad(set_to_none=True)
        with context(BatchL2Grad()), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loss_fn(model(w.inputs), w.targets).backward()
        return sum(p.batch_l2 for p in model.parameters()).sqrt() * n  # of the mean's terms

    return run
