"""``nn.MultiheadAttention`` runs as its ops during the capture (``rules/attention.py``):
every parameter takes an op rule, with backprops from the one main backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import persample
from cases import BY_ID, assert_grads_equal, build
from persample.rules import spec_of


@pytest.mark.parametrize("case_id", ["mha-sequence-first-3d-mask-bias-kv",
                                     "transformer-decoder-layer-sequence-first",
                                     "mha-per-head-weights-bool-mask-eval-dropout"])
def test_attention_runs_as_its_ops(case_id, patch_spec):
    expanded = []
    real = spec_of(F.multi_head_attention_forward).expand

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        expanded.append(out is not NotImplemented)
        return out

    patch_spec(F.multi_head_attention_forward, expand=spy)
    c = BY_ID[case_id]
    model, inputs, targets = build(c)
    loss_fn = c["loss_fn"]("mean")
    got = persample.per_sample_grads(model, inputs, targets, loss_fn, method="rules")
    assert_grads_equal(got, persample.loop_per_sample_grads(model, inputs, targets, loss_fn))
    attn = [m for m in model.modules() if isinstance(m, torch.nn.MultiheadAttention)]
    assert expanded == [True] * len(attn)  # each call once, as its ops
    assert {r.path for r in persample.supported(model, inputs)} == {"rule"}
