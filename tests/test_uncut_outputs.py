"""A model output beside which the model returns an object that holds the samples' data
and that no pytree opens (a Hugging Face causal LM's key/value cache, with
``use_cache=True``): a scalar loss is evaluated again on each sample's part of the
output, and the object has no such part. A loss that leaves it unread takes the rules,
exactly; one that reads it is refused by the rules, naming it, and ``auto`` answers by
the whole model's methods. Sizes coincide (batch, sequence, width)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import persample

B = T = D = 6


def causal_lm():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=40, n_embd=D, n_layer=2, n_head=2, n_positions=16,
                                  use_cache=True, bos_token_id=1, eos_token_id=1)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).eval().double()


def summed(out, labels):  # (a scalar: the whole batch's next-token cross-entropy)
    return F.cross_entropy(out.logits[:, :-1].reshape(-1, out.logits.shape[-1]),
                           labels[:, 1:].reshape(-1), reduction="sum")


def reads_cache(out, labels):
    keys = out.past_key_values.layers[0].keys  # (reads the cache)
    return summed(out, labels) + keys.sum()


def test_a_scalar_loss_beside_a_cache_it_does_not_read_takes_the_rules():
    model = causal_lm()
    ids = torch.randint(0, 40, (B, T), generator=torch.Generator().manual_seed(0))
    assert type(model(ids).past_key_values).__name__ == "DynamicCache"  # (as it comes)
    want = persample.loop_per_sample_grads(model, ids, ids, summed)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (no fallback, no certificate's catch)
        got = persample.per_sample_grads(model, ids, ids, summed, method="rules")
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-9, atol=1e-12)
    assert {r.path for r in persample.supported(model, ids, ids, summed)} <= {"rule", "unused"}


def test_a_scalar_loss_that_reads_the_cache_is_refused_by_its_name():
    model = causal_lm()
    ids = torch.randint(0, 40, (B, T), generator=torch.Generator().manual_seed(1))
    with pytest.raises(persample.NeedsWholeModel, match="a DynamicCache that holds"):
        persample.per_sample_grads(model, ids, ids, reads_cache, method="rules")
