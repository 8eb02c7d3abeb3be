"""The attention rule takes its backprops from the captured projections (no recompute)."""

from __future__ import annotations

import pytest

import persample
import persample.rules.attention as attention
from cases import BY_ID, assert_grads_equal, build


@pytest.mark.parametrize("case_id", ["mha-sequence-first-3d-mask-bias-kv",
                                     "transformer-decoder-layer-sequence-first",
                                     "mha-per-head-weights-bool-mask-eval-dropout"])
def test_rule_uses_the_captured_projections(case_id, monkeypatch):
    calls = []
    real = attention._from_captured

    def spy(layer, activations, backprops, out, extras, ctx):
        calls.append((layer, len(extras)))
        return real(layer, activations, backprops, out, extras, ctx)

    monkeypatch.setattr(attention, "_from_captured", spy)
    c = BY_ID[case_id]
    model, inputs, targets = build(c)
    loss_fn = c["loss_fn"]("mean")
    got = persample.per_sample_grads(model, inputs, targets, loss_fn, method="rules")
    assert_grads_equal(got, persample.loop_per_sample_grads(model, inputs, targets, loss_fn))
    attn = [m for m in model.modules() if isinstance(m, attention.nn.MultiheadAttention)]
    assert sorted(id(layer) for layer, _ in calls) == sorted(map(id, attn))  # each once
    assert all(k >= 3 for _, k in calls)  # q, k, v (and bias_k, bias_v)
