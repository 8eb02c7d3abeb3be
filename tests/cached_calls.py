"""What the tests of the cached calls share (tests/test_lean_path.py, the program;
tests/test_compiled_path.py, the compiled forward): the check against the loop, the
kept plans, two tiny transformers and their loss."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import persample
from persample.engine import tapes

B = T = 6  # batch size, sequence length and width coincide: nothing inferred from sizes
D = 6


def check(model, x, y, loss_fn, rtol=1e-10, atol=1e-12):
    """The rules' per-sample gradients against the loop's."""
    fast = persample.per_sample_grads(model, x, y, loss_fn, method="rules")
    slow = persample.loop_per_sample_grads(model, x, y, loss_fn)
    assert fast.keys() == slow.keys()
    for name in slow:
        torch.testing.assert_close(fast[name], slow[name], rtol=rtol, atol=atol)


def kept(model):
    """What the engine keeps for the model's later calls (templates, programs...)."""
    return list(tapes._STOCK.get(model, {}).values())


def bert():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(vocab_size=50, hidden_size=D, num_hidden_layers=2,
                                  num_attention_heads=2, intermediate_size=2 * D,
                                  num_labels=3, max_position_embeddings=16)
    return transformers.BertForSequenceClassification(cfg).eval().double()


def gpt2():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=50, n_embd=D, n_layer=2, n_head=2,
                                  n_positions=16, num_labels=3, pad_token_id=0,
                                  bos_token_id=1, eos_token_id=1)
    return transformers.GPT2ForSequenceClassification(cfg).eval().double()


def logits_loss(out, y):
    return F.cross_entropy(out.logits, y, reduction="none")


class Logits(nn.Module):
    """A transformers classifier called with ids, its logits out (rows by sample)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, ids):
        return self.inner(input_ids=ids).logits


class Switch(nn.Module):
    """Paths taken by Python attributes and, where ``values``, by values (a branch on
    them: no one TorchDynamo graph)."""

    def __init__(self, values: bool = True):
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.head = nn.Linear(D, 2)
        self.register_buffer("scale", torch.ones(D))
        self.dim, self.perm, self.wire, self.values = 1, None, "own", values

    def forward(self, x):  # (B, T, D)
        h = torch.tanh(self.lin(x)) * self.scale  # (B, T, D)
        if self.perm is not None:  # rows of each sample taken by an index of this call
            h = h[:, self.perm]
        if self.wire == "shared":  # the same ops on a tensor with no sample in it
            h = torch.sin(self.scale.expand_as(h) * 1.0) + h.detach() * 0
            h = h.mean(0, keepdim=True) + self.lin(x)
        if self.values and bool((x[:, 0, 0] > 5).any()):  # a branch on the values: mixes
            h = h + h.mean(0, keepdim=True)  # the samples
        return self.head(h.sum(self.dim))  # dim 1: per sample; dim 0: sums the samples


def data():
    """``(B, T, D)`` float64 inputs and two-class targets, seeded."""
    torch.manual_seed(0)
    return torch.randn(B, T, D, dtype=torch.float64), torch.randint(0, 2, (B,))


def changed_between_calls(model, x, y, loss, owner=None):
    """Buffers, parameters, modules, dtypes and batch sizes changed between calls of a
    steady ``Switch`` (``owner``: the module changed, where ``model`` wraps it, as
    ``torch.compile``'s wrapper does): each answer still the loop's."""
    owner = model if owner is None else owner
    owner.scale.mul_(3.0)  # a buffer's values
    check(model, x, y, loss)
    with torch.no_grad():
        owner.lin.weight.add_(1.0)  # a parameter's values
    check(model, x, y, loss)
    owner.lin.weight.requires_grad_(False)  # frozen
    check(model, x, y, loss)
    owner.lin.weight.requires_grad_(True)
    owner.lin = nn.Linear(D, D).double()  # a replaced layer
    check(model, x, y, loss)
    owner.register_buffer("scale", torch.full((D,), 2.0, dtype=torch.float64))  # replaced
    check(model, x, y, loss)
    model.float()  # other dtypes
    check(model, x.float(), y, loss, rtol=1e-5, atol=1e-6)
    check(model, x.float()[:4], y[:4], loss, rtol=1e-5, atol=1e-6)  # another batch size
