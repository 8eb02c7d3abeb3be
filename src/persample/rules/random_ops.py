"""Ops that draw random numbers inside, run as the ops they are made of.

``F.gumbel_softmax`` (Jang, Gu & Poole 2017; DARTS and SNAS sample architectures with
it) is one Python function drawing one ``exponential_`` of its logits' shape: under the
capture it runs as its ops (:func:`persample.draws.gumbel_softmax`, the same draws), so
that its noise is a recorded fill and a parameter's gradient through it flows by the
ordinary rules (a shared table of architecture logits is a derived tensor pulled back
through ``add``, ``div`` and ``softmax``), never by evaluating the op again, which would
draw other numbers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .spec import OpSpec, register


def gumbel_softmax(logits: Tensor, tau: float = 1.0, hard: bool = False, eps: float = 1e-10,
                   dim: int = -1) -> Tensor:
    """``F.gumbel_softmax`` as the ops it is made of (the same draws: one
    ``exponential_`` of ``logits``' shape), so that its noise is a recorded fill and its
    gradient flows through ordinary ops (Jang, Gu & Poole 2017, "Categorical
    Reparameterization with Gumbel-Softmax")."""
    gumbels = -torch.empty_like(logits, memory_format=torch.legacy_contiguous_format
                                ).exponential_().log()
    y_soft = ((logits + gumbels) / tau).softmax(dim)
    if not hard:
        return y_soft
    index = y_soft.max(dim, keepdim=True)[1]
    y_hard = torch.zeros_like(logits, memory_format=torch.legacy_contiguous_format
                              ).scatter_(dim, index, 1.0)
    return y_hard - y_soft.detach() + y_soft


GUMBEL_SOFTMAX = register(OpSpec((F.gumbel_softmax,), expand=gumbel_softmax))
