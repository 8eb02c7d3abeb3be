"""DP-SGD written by hand around a per-sample gradients method, as users of the loop
or of ``torch.func`` write it: each sample's gradient clipped to ``C``, summed per
parameter (no concatenation), Gaussian noise added, divided by ``B``, an SGD step.

Source: Abadi et al. 2016 (DP-SGD).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping

import torch
from torch import Tensor

from ..workloads import DP_MAX_GRAD_NORM, Workload


def grad_norms(grads: Mapping[str, Tensor]) -> Tensor:
    """``(B,)`` norms over all parameters of per-sample gradients ``{name: (B, ...)}``,
    summed per parameter (no concatenation).

    Examples:
        >>> grad_norms({"a": torch.full((2, 3), 2.0), "b": torch.full((2,), 2.0)})
        tensor([4., 4.])
    """
    return sum(g.reshape(len(g), -1).pow(2).sum(1) for g in grads.values()).sqrt()


def clipped_step(w: Workload, per_sample_fn: Callable[[Tensor | None], dict[str, Tensor]],
                 noise: dict) -> Callable[[Tensor | None], dict[str, Tensor]]:
    """One DP-SGD step on a copy of the workload's model (``lr = 0``, so that its
    weights stay as they are) from the per-sample gradients ``per_sample_fn(None)``
    returns; the step returns the noised gradients ``{name: p.grad}``.

    The clipping runs outside autocast, in the gradients' dtype; the noise's
    ``sigma`` is read from ``noise["sigma"]`` at each call.

    Examples:
        >>> from torch import nn
        >>> from persample_bench.anchors.loop_rows import loop_grads
        >>> w = Workload("tiny", "", nn.Linear(3, 2), torch.randn(4, 3),
        ...              torch.tensor([0, 1, 0, 1]), nn.CrossEntropyLoss(), "")
        >>> grads = clipped_step(w, loop_grads(w).fn, {"sigma": 0.0})(None)
        >>> sorted(grads), bool(grad_norms({k: g[None] for k, g in grads.items()}) <= 1.0)
        (['bias', 'weight'], True)
    """
    own = copy.deepcopy(w.model)
    params = dict(own.named_parameters())
    opt = torch.optim.SGD(own.parameters(), lr=0.0)

    def run(_: Tensor | None) -> dict[str, Tensor]:
        opt.zero_grad(set_to_none=True)  # as the plain step does
        grads = per_sample_fn(None)
        with torch.autocast(w.device.type, enabled=False):  # clipped in the grads' dtype
            clip = (DP_MAX_GRAD_NORM / (grad_norms(grads) + 1e-6)).clamp(max=1.0)  # (B,)
            for name, g in grads.items():
                total = torch.tensordot(clip.to(g.dtype), g, dims=1)
                total += torch.randn_like(total) * (noise["sigma"] * DP_MAX_GRAD_NORM)
                params[name].grad = total.div_(w.n)
        opt.step()
        return {k: p.grad for k, p in params.items() if p.requires_grad}

    return run
