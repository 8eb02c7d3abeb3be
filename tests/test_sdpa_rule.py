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
from persample.engine import pullback

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
            pk, pv = (self.prefix[j].expand(b, -1, -1, -1) for j in range(2))  # (b, H,
            # 2, E) each
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
    """No per-op VJP (they raise), and the attention's and the resize's rules never
    decline (a view of a learned prefix cut by samples takes another exact path)."""
    def refuse(*args, **kwargs):
        raise AssertionError("a per-op VJP ran")

    for name in ("expand_vjp", "op_vjp", "paired_vjp", "shared_vjp", "module_vjp"):
        monkeypatch.setattr(pullback, name, refuse)
    run = pullback._run_rule

    def strict(op, *args):
        why = run(op, *args)
        assert why is None or op.func not in (F.scaled_dot_product_attention, F.interpolate), (
            f"{op.where()}: its rule declined ({why})")
        return why

    monkeypatch.setattr(pullback, "_run_rule", strict)


@pytest.mark.parametrize("kind", KINDS)
def test_attention_reading_parameters_on_the_rule(kind, request):
    """(Latents attending to themselves read one tensor at three places: the op's VJP.)"""
    if kind != "self":
        request.getfixturevalue("no_vjp")
    torch.manual_seed(0)
    x, y = torch.randn(B, T, B, dtype=torch.float64), torch.randn(B, 3, dtype=torch.float64)
    check(Attention(kind).double(), x, y, mse)


class RelativeTable(nn.Module):
    """BEiT's relative position bias: a table's rows but the last three, resized
    (``interpolate`` to the same size) and joined back, looked up by a shared index of
    relative positions, the heads moved first: SDPA's mask."""

    def __init__(self):
        super().__init__()
        self.q, self.kv, self.head = nn.Linear(B, H * E), nn.Linear(B, 2 * H * E), (
            nn.Linear(H * T * E, 3))
        self.table = nn.Parameter(torch.randn((2 * 2 - 1) ** 2 + 3, H) * 0.5)

    def forward(self, x):  # (b, T, B), T = 2 x 2 positions
        b = x.shape[0]
        q = self.q(x).view(b, T, H, E).transpose(1, 2)
        k, v = self.kv(x).view(b, T, 2, H, E).permute(2, 0, 3, 1, 4)
        grid = self.table[:-3].reshape(1, 3, 3, H).permute(0, 3, 1, 2)  # (1, H, 3, 3)
        grid = F.interpolate(grid, size=(3, 3), mode="bilinear", align_corners=False)
        table = torch.cat([grid.permute(0, 2, 3, 1).reshape(9, H), self.table[-3:]])
        coords = torch.stack(torch.meshgrid(torch.arange(2), torch.arange(2), indexing="ij"))
        rel = (coords.flatten(1)[:, :, None] - coords.flatten(1)[:, None, :]) + 1  # (2, T, T)
        index = rel[0] * 3 + rel[1]  # (T, T)
        bias = table[index.view(-1)].view(T, T, H).permute(2, 0, 1).contiguous()  # (H, T, T)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.unsqueeze(0))
        return self.head(out.flatten(1))


def test_beits_relative_table_on_the_rules(no_vjp):
    torch.manual_seed(0)
    x, y = torch.randn(B, T, B, dtype=torch.float64), torch.randn(B, 3, dtype=torch.float64)
    check(RelativeTable().double(), x, y, mse)


@pytest.mark.parametrize("make", [lambda: Attention("bias"), RelativeTable],
                         ids=["bias", "relative-table"])
def test_a_cached_call_replays_the_rule(make):
    """The rules' ops are ATen ops on the records: a cached call replays them."""
    import persample.engine.replay as replay

    torch.manual_seed(0)
    model = make().double()
    n = 2  # (a batch no size of a derived tensor equals: the check of a shared tensor's
    # cotangents at each sample's own position, which reads their values, is not replayed)
    x, y = torch.randn(n, T, B, dtype=torch.float64), torch.randn(n, 3, dtype=torch.float64)
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
