"""``F.scaled_dot_product_attention`` reading tensors made of parameters
(``persample.rules.sdpa``): a relative position bias as its mask, a learned query, keys
and values of a learned prefix, grouped key heads, a causal query, a boolean padding
mask, latents attending to themselves. Each against the loop in float64, with the batch
size equal to the heads, the positions and the queries, the rule itself taking the call
(no per-op VJP), and a cached call replaying the rules."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import persample
from battery import check
from persample.engine import vjp
from persample.rules import sdpa as sdpa_rule

B = H = T = 4  # batch = heads = positions = queries: nothing inferred from sizes
E = 3  # a head's width
KINDS = ["bias", "query", "prefix", "gqa", "causal", "boolean", "scale", "self"]


def mse(out, y):
    return (out - y).pow(2).flatten(1).sum(1)


class Attention(nn.Module):
    """Per-sample keys and values (a linear layer of the input), and ``kind``'s tensor
    made of parameters."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        kv_heads = 2 if kind == "gqa" else H  # (grouped: two query heads per key head)
        self.q = nn.Linear(B, H * E) if kind in ("bias", "gqa", "scale", "prefix") else None
        self.kv = nn.Linear(B, 2 * kv_heads * E) if kind not in ("self", "gqa") else None
        made = {"table": torch.randn(H, T, T) * 0.5,  # (a position bias)
                "query": torch.randn(H, T, E),
                "prefix": torch.randn(2, kv_heads, 2, E)}  # (keys and values, 2 slots)
        for name in {"bias": ["table"], "gqa": ["prefix"], "scale": ["table"],
                     "prefix": ["prefix"]}.get(kind, ["query"]):
            self.register_parameter(name, nn.Parameter(made[name]))
        self.head = nn.Linear(H * T * E, 3)
        self.kv_heads = kv_heads

    def forward(self, x):  # (b, T, B)
        b = x.shape[0]
        k = v = None
        if self.kv is not None:
            k, v = self.kv(x).view(b, T, 2, self.kv_heads, E).permute(2, 0, 3, 1, 4)
        q = k if self.q is None else self.q(x).view(b, T, H, E).transpose(1, 2)  # (b, H,
        # T, E)
        kind, kw = self.kind, {}
        if kind in ("bias", "scale"):
            kw["attn_mask"] = self.table.unsqueeze(0)  # (1, H, T, T)
            kw.update({"scale": {"scale": 0.3}}.get(kind, {}))
        elif kind in ("query", "causal", "boolean"):
            q = self.query.expand(b, -1, -1, -1)
            kw = {"causal": {"is_causal": True},
                  "boolean": {"attn_mask": (x[:, None, None, :, 0] > -0.5)}}.get(kind, {})
        if kind in ("prefix", "gqa"):
            pk, pv = self.prefix.unsqueeze(1).expand(-1, b, -1, -1, -1)  # (b, H, 2, E)
            if kind == "gqa":  # (the learned keys and values alone, read by the op)
                k, v, kw = pk, pv, {"enable_gqa": True}
            else:
                k, v = torch.cat([pk, k], 2), torch.cat([pv, v], 2)  # (b, H, 2 + T, E)
        if kind == "self":
            q = k = v = self.query.expand(b, -1, -1, -1)
            kw["attn_mask"] = x[:, None, :, :1] * x[:, None, None, :, 1]  # (b, 1, T, T)
        out = F.scaled_dot_product_attention(q, k, v, **kw)  # (b, H, T, E)
        return self.head(out.flatten(1))


@pytest.fixture
def no_vjp(monkeypatch):
    """Every call the rule's: the per-op VJPs raise, and the rule never declines."""
    def refuse(*args, **kwargs):
        raise AssertionError("a per-op VJP ran")

    monkeypatch.setattr(vjp, "expand_vjp", refuse)
    monkeypatch.setattr(vjp, "per_sample_vjp", refuse)
    rule = sdpa_rule.SDPA.grad

    def strict(call, g, out):
        try:
            return rule(call, g, out)
        except persample.rules.Decline as why:
            raise AssertionError(f"the rule declined: {why}") from None

    monkeypatch.setitem(persample.rules.spec.SPECS, F.scaled_dot_product_attention,
                        persample.rules.spec.dataclasses.replace(sdpa_rule.SDPA, grad=strict))


@pytest.mark.parametrize("kind", KINDS)
def test_attention_reading_parameters_on_the_rule(kind, no_vjp):
    torch.manual_seed(0)
    x, y = torch.randn(B, T, B, dtype=torch.float64), torch.randn(B, 3, dtype=torch.float64)
    check(Attention(kind).double(), x, y, mse)


def test_a_cached_call_replays_the_rule():
    """The rule's ops are ATen ops on the records: a cached call replays them."""
    import persample.engine.replay as replay

    torch.manual_seed(0)
    model = Attention("bias").double()
    x, y = torch.randn(B, T, B, dtype=torch.float64), torch.randn(B, 3, dtype=torch.float64)
    calls = []
    run = replay.Replay.__call__

    def spy(self, inputs):
        calls.append(True)
        return run(self, inputs)

    replay.Replay.__call__ = spy
    try:
        want = persample.per_sample_grads(model, x, y, mse, method="loop")
        for _ in range(8):  # (the first runs of a call like it record; later ones replay)
            got = persample.per_sample_grads(model, x, y, mse)
            for name in want:
                torch.testing.assert_close(got[name], want[name], rtol=1e-10, atol=1e-12)
    finally:
        replay.Replay.__call__ = run
    assert calls, "no call replayed the rules"


def test_attention_dropout_declines_to_the_exact_vjp():
    """In training, the attention's dropout: the rule declines, the per-op VJP replays
    the numbers the forward drew."""
    class Dropped(Attention):
        def __init__(self):
            super().__init__("bias")

        def forward(self, x):
            b = x.shape[0]
            q = self.q(x).view(b, T, H, E).transpose(1, 2)
            k, v = self.kv(x).view(b, T, 2, H, E).permute(2, 0, 3, 1, 4)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=self.table.unsqueeze(0),
                                                 dropout_p=0.3)
            return self.head(out.flatten(1))

    torch.manual_seed(0)
    x, y = torch.randn(B, T, B, dtype=torch.float64), torch.randn(B, 3, dtype=torch.float64)
    check(Dropped().double(), x, y, mse, seed=3, paths=None)
