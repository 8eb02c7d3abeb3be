"""A mixture of experts as transformers ships it (Mixtral from a small config: 4
experts, top-2, ``B`` = 4 = the experts = the sequence length): the experts module takes
its module rule whatever implementation runs inside (the eager loop over the experts,
the grouped one with ``torch._grouped_mm``), the router and the rest their op rules,
every row exact against the loop."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import persample
import zoo
from battery import assert_exact, check, flat

transformers = zoo.require("transformers")
B, T = 4, 4


def _mixtral(implementation: str | None, dtype: torch.dtype):
    config = transformers.MixtralConfig(
        vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=T, use_cache=False)
    config._experts_implementation = implementation
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(config).to(dtype).train()
    ids = torch.randint(0, 50, (B, T))
    return model, {"input_ids": ids}, ids


def next_token(out, ids: Tensor) -> Tensor:
    """Per-sample next-token cross-entropy ``(B,)``."""
    logits = out.logits[:, :-1]
    return F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none").mean(1)


def test_eager_experts_take_the_module_rule_and_are_exact():
    model, inputs, ids = _mixtral("eager", torch.float64)
    check(model, inputs, ids, next_token, methods=("rules", "auto", "loop"),
          paths={"rule", "module rule"})
    routes = {r.module: r.path for r in persample.supported(model, inputs, ids, next_token)}
    assert routes["model.layers.0.mlp.experts"] == "module rule"
    assert routes["model.layers.0.mlp.gate"] == "rule"


def test_grouped_experts_take_the_module_rule_and_match_the_loop():
    """transformers' default: tokens sorted by expert, ``histc`` offsets, grouped matrix
    products (float32 only)."""
    model, inputs, ids = _mixtral(None, torch.float32)
    got = persample.per_sample_grads(model, inputs, ids, next_token, method="rules")
    want = persample.loop_per_sample_grads(model, inputs, ids, next_token)
    err = (flat(got) - flat(want)).abs().max() / flat(want).abs().max()
    assert err < 1e-5, err
    paths = {r.path for r in persample.supported(model, inputs, ids, next_token)}
    assert paths == {"rule", "module rule"}


def _rel(got: dict, want: dict) -> float:
    return float((flat(got) - flat(want)).abs().max() / flat(want).abs().max())


def test_the_backward_is_asked_only_for_the_grouped_products(monkeypatch):
    """The gradients at the experts' inner ops are asked of the backward only for the
    grouped products the rule reads (two per call), never for the eager loop's
    per-expert products (each would hold its gradient until the rules run)."""
    from persample.rules import experts as rule

    real = rule._grouped_as_run
    for implementation, dtype, asked in (("eager", torch.float64, 0), (None, torch.float32, 2)):
        model, inputs, ids = _mixtral(implementation, dtype)
        seen = []

        def spy(layer, hidden, inner, seen=seen):
            seen.append(inner)
            return real(layer, hidden, inner)

        monkeypatch.setattr(rule, "_grouped_as_run", spy)
        persample.per_sample_grads(model, inputs, ids, next_token, method="rules")
        assert len(seen) == 2  # the two layers
        for inner in seen:
            assert sum(i.grad is not None for i in inner) == asked
            assert len(inner) > asked  # (the tables' views and the gathers are kept too)


def test_grouped_experts_read_the_products_as_they_ran(monkeypatch):
    """The grouped implementation's two products are read as they ran (their inputs and
    the backward's gradients at their outputs), at every call, the first and those
    that take the cached plan: the same rows as computing them again, and the loop's."""
    from persample.rules import experts as rule

    model, inputs, ids = _mixtral(None, torch.float32)
    seen, real = [], rule._grouped_as_run
    monkeypatch.setattr(rule, "_grouped_as_run", lambda *a: seen.append(real(*a)) or seen[-1])
    got = [persample.per_sample_grads(model, inputs, ids, next_token, method="rules")
           for _ in range(2)]
    assert len(seen) == 4 and all(r is not None for r in seen)  # 2 layers, 2 calls
    monkeypatch.setattr(rule, "_grouped_as_run", lambda *a: None)
    again = persample.per_sample_grads(model, inputs, ids, next_token, method="rules")
    want = persample.loop_per_sample_grads(model, inputs, ids, next_token)
    assert _rel(got[0], again) < 1e-6 and _rel(got[1], again) < 1e-6
    assert _rel(got[0], want) < 1e-5


def test_experts_with_a_gate_of_their_own_leave_the_module_rule():
    """A gate other than ``act(g) * u`` (Step-3's clamped one) is not the rule's: the
    experts' ops take their own paths, and the rows stay exact."""

    class Clamped(_Experts):
        def _apply_gate(self, gate_up):
            gate, up = gate_up.chunk(2, dim=-1)
            return self.act_fn(gate).clamp(max=0.1) * up

        def forward(self, hidden_states, top_k_index, top_k_weights):
            out = torch.zeros_like(hidden_states)
            for e in range(3):
                token, slot = torch.where(top_k_index == e)
                h = self._apply_gate(F.linear(hidden_states[token], self.gate_up_proj[e]))
                y = F.linear(h, self.down_proj[e])
                out.index_add_(0, token, y * top_k_weights[token, slot, None])
            return out

    torch.manual_seed(0)
    model = _Routed(Clamped()).double()
    x, y = torch.randn(B, T, 4, dtype=torch.float64), torch.randint(0, 2, (B,))
    loss = nn.CrossEntropyLoss()
    assert_exact(persample.per_sample_grads(model, x, y, loss),
                 persample.loop_per_sample_grads(model, x, y, loss))
    routes = {r.module: r.path for r in persample.supported(model, x, y, loss)}
    assert routes["experts"] != "module rule"


def test_the_rows_sum_to_the_batch_gradient():
    model, inputs, ids = _mixtral("eager", torch.float64)
    got = persample.per_sample_grads(model, inputs, ids, next_token)
    loss = next_token(model(**inputs), ids).sum()
    batch = torch.autograd.grad(loss, list(model.parameters()))
    assert_exact({k: v.sum(0) for k, v in got.items()}, dict(zip(got, batch)))


class _Experts(nn.Module):
    """transformers' experts module as a user could write it (recognised by its tables
    and ``forward``), with a scale read from another module's parameter (``foreign``)."""

    def __init__(self, foreign: bool = False, act: nn.Module | None = None):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(3, 8, 4) / 2)
        self.down_proj = nn.Parameter(torch.randn(3, 4, 4) / 2)
        self.act_fn = nn.SiLU() if act is None else act
        self.scale = nn.Linear(1, 1) if foreign else None

    def forward(self, hidden_states, top_k_index, top_k_weights):  # (R, H), (R, k), (R, k)
        out = torch.zeros_like(hidden_states)
        for e in range(3):
            token, slot = torch.where(top_k_index == e)
            gate, up = F.linear(hidden_states[token], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(self.act_fn(gate) * up, self.down_proj[e])
            out.index_add_(0, token, y * top_k_weights[token, slot, None])
        if self.scale is not None:
            out = out * self.scale.weight[0]
        return out


class _Routed(nn.Module):
    def __init__(self, experts: nn.Module):
        super().__init__()
        self.router, self.experts, self.head = nn.Linear(4, 3), experts, nn.Linear(4, 2)

    def forward(self, x):  # (B, T, 4)
        rows = x.reshape(-1, 4)
        weights, index = torch.topk(torch.softmax(self.router(rows), -1), 2, dim=-1)
        return self.head(self.experts(rows, index, weights).reshape(x.shape).sum(1))


@pytest.mark.parametrize("foreign", [False, True])
def test_ops_inside_the_experts_call_run_unfollowed_unless_they_must_be(foreign):
    """The experts' own ops run without data flow (the rule computes the call from its
    inputs); a parameter of another module read inside is followed (the module rule then
    leaves the call, whose parameters take an exact slower path), and the answer stays
    exact."""
    torch.manual_seed(0)
    model = _Routed(_Experts(foreign)).double()
    x, y = torch.randn(B, T, 4, dtype=torch.float64), torch.randint(0, 2, (B,))
    loss = nn.CrossEntropyLoss()
    fast = persample.per_sample_grads(model, x, y, loss)
    slow = persample.loop_per_sample_grads(model, x, y, loss)
    assert_exact(fast, slow)
    routes = {r.module: r.path for r in persample.supported(model, x, y, loss)}
    assert (routes["experts"] == "module rule") is not foreign


@pytest.mark.parametrize("act", [nn.SiLU(), nn.GELU(approximate="tanh")])
def test_the_experts_parameter_jacobian_with_each_activation(act):
    """Several cotangents at once (the per-sample parameter Jacobian, ``v`` = 2 = the
    experts' top-k), through SiLU (torch's fused pullback) and another activation
    (autograd's), against the loop."""
    torch.manual_seed(0)
    model = _Routed(_Experts(act=act)).double()
    x = torch.randn(B, T, 4, dtype=torch.float64)
    got = persample.param_jacobian(model, x, method="rules")
    want = persample.loop_param_jacobian(model, x)
    assert_exact(got, want)


class _Grouped(_Experts):
    """transformers' default grouped implementation as it is written: the (token,
    expert) pairs sorted by expert, two grouped products, the rows put back."""

    def forward(self, hidden_states, top_k_index, top_k_weights):  # (R, H), (R, k), (R, k)
        k = top_k_index.shape[-1]
        ids, perm = torch.sort(top_k_index.reshape(-1))
        x, w = hidden_states[perm // k], top_k_weights.reshape(-1)[perm]
        offs = torch.cumsum(torch.histc(ids.float(), bins=3, min=0, max=2), 0,
                            dtype=torch.int32)
        gate, up = torch._grouped_mm(x, self.gate_up_proj.transpose(-2, -1),
                                     offs=offs).chunk(2, dim=-1)
        y = torch._grouped_mm(self.act_fn(gate) * up, self.down_proj.transpose(-2, -1),
                              offs=offs) * w[:, None]
        back = torch.empty_like(perm)
        back[perm] = torch.arange(perm.numel())
        return y[back].view(-1, k, y.shape[-1]).sum(1)


@pytest.mark.parametrize("kind, dtype", [(_Experts, torch.float64), (_Grouped, torch.float32)])
def test_an_expert_no_token_chose_gets_zeros(monkeypatch, kind, dtype):
    """An expert the router never picks (its logit pushed down) gets exact zeros in every
    row, whether its products are computed again (the eager loop) or read as they ran
    (the grouped products); the others match the loop."""
    from persample.rules import experts as rule

    torch.manual_seed(0)
    model = _Routed(kind()).to(dtype)
    with torch.no_grad():
        model.router.bias[2] = -1e4
    x, y = torch.randn(B, T, 4, dtype=dtype), torch.randint(0, 2, (B,))
    loss = nn.CrossEntropyLoss()
    read, real = [], rule._grouped_as_run
    monkeypatch.setattr(rule, "_grouped_as_run", lambda *a: read.append(real(*a)) or read[-1])
    got = persample.per_sample_grads(model, x, y, loss, method="rules")
    assert (read[0] is not None) is (kind is _Grouped)
    for name in ("experts.gate_up_proj", "experts.down_proj"):
        assert torch.equal(got[name][:, 2], torch.zeros_like(got[name][:, 2]))
    want = persample.loop_per_sample_grads(model, x, y, loss)
    assert _rel(got, want) < (1e-12 if dtype == torch.float64 else 1e-5)


def test_per_sample_outer_sums_grouped_and_padded_agree():
    """Each sample's sum of outer products over its tokens: ``torch._grouped_mm`` over
    the samples' runs (float32) and the padded batched product (float64) against the
    sum written out, with a sample that has no token and uneven counts."""
    from persample.rules.experts import _Padded

    torch.manual_seed(0)
    owner = torch.tensor([0, 0, 0, 2, 3, 3, 3, 3, 3])  # sample 1 has none
    for dtype in (torch.float32, torch.float64):
        g, x = torch.randn(2, 9, 8, dtype=dtype), torch.randn(9, 4, dtype=dtype)
        want = torch.stack([torch.einsum("vmo,mi->voi", g[:, owner == k], x[owner == k])
                            for k in range(4)])
        for order in ((0, 1, 2, 3), (0, 1, 3, 2)):  # (the result's (o, i) or (i, o) order)
            held = torch.full([(4, 2, 8, 4)[k] for k in order], float("nan"), dtype=dtype)
            into = held.permute(*order)  # (n, v, o, i)
            _Padded(owner, 4).outer_sums(g, x, into)
            torch.testing.assert_close(into, want, rtol=1e-6, atol=1e-6)
            assert not into[1].any()


class _SortedRuns(nn.Module):
    """A mixture written as transformers' grouped implementation is, with a bias per
    expert (gpt-oss): the (token, expert) pairs sorted by expert, counted by ``histc``,
    both products by ``F.grouped_mm`` over the runs, summed back by ``index_add_``.
    ``by_key=False`` groups the rows in fixed runs instead (not each row's expert)."""

    def __init__(self, by_key: bool = True, experts: int = B, top: int = 2, width: int = 8):
        super().__init__()
        self.by_key, self.experts, self.top = by_key, experts, top
        self.router = nn.Linear(width, experts)
        self.up = nn.Parameter(torch.randn(experts, width, 16) * 0.3)
        self.bias = nn.Parameter(torch.randn(experts, 16) * 0.3)
        self.down = nn.Parameter(torch.randn(experts, 16, width) * 0.3)
        self.head = nn.Linear(width, 3)

    def forward(self, x):  # (b, t, width)
        rows = x.reshape(-1, x.shape[-1])
        weights, chosen = self.router(rows).softmax(-1).topk(self.top)  # (R, k) each
        keys, perm = torch.sort(chosen.reshape(-1))  # (S,) the pairs by expert
        tokens = rows[perm // self.top]  # (S, width)
        counts = torch.histc(keys.float(), bins=self.experts, min=0, max=self.experts - 1)
        if not self.by_key:
            counts = torch.full_like(counts, keys.numel() // self.experts)
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        h = F.gelu(F.grouped_mm(tokens, self.up, offs=offs) + self.bias[keys])
        y = F.grouped_mm(h, self.down, offs=offs) * weights.reshape(-1)[perm, None]
        out = torch.zeros_like(rows).index_add_(0, perm // self.top, y)
        return self.head(out.view(*x.shape).mean(1))


def test_grouped_products_by_expert_take_their_rule():
    """``grouped_mm`` over runs that are each row's own expert (sorted keys, ``histc``
    offsets) is followed and takes its rule: each (sample, expert) pair's sum of outer
    products; ``B`` = 4 = the experts = the tokens (float32: the kernel's dtype)."""
    torch.manual_seed(0)
    model = _SortedRuns().float()
    x, y = torch.randn(B, T, 8, dtype=torch.float32), torch.randint(0, 3, (B,))
    loss = nn.CrossEntropyLoss(reduction="none")
    got = persample.per_sample_grads(model, x, y, loss, method="rules")
    want = persample.loop_per_sample_grads(model, x, y, loss)
    assert _rel(got, want) < 1e-5
    assert bool((got["up"].flatten(1).norm(dim=1) > 0).all())
    paths = {r.module or "<root>": r.path for r in persample.supported(model, x, y, loss)}
    assert set(paths.values()) == {"rule"}, paths


@pytest.mark.parametrize("grouped", [True, False])
def test_grouped_products_into_a_flat_result_and_a_jacobian(grouped, monkeypatch):
    """The grouped rule writes each (sample, expert) pair's sums into the result's
    tables, whatever their strides: a flat result (the rows of one parameter not one
    block, so the (sample, expert) pairs are not one dim) and a Jacobian's several
    cotangents, by torch's grouped kernel and by the padded products (``grouped``
    False: rows it cannot take): both the loop's."""
    from persample.rules import experts as rule

    if not grouped:
        monkeypatch.setattr(rule, "_groups", lambda g, x: False)
    torch.manual_seed(0)
    model = _SortedRuns().float()
    x, y = torch.randn(B, T, 8, dtype=torch.float32), torch.randint(0, 3, (B,))
    loss = nn.CrossEntropyLoss(reduction="none")
    flat = persample.per_sample_grads(model, x, y, loss, method="rules", flat=True)
    want = persample.loop_per_sample_grads(model, x, y, loss)
    assert _rel({"all": flat}, {"all": torch.cat([t.flatten(1) for t in want.values()], 1)}
                ) < 1e-5
    got = persample.param_jacobian(model, x, method="rules")  # (B, 3, *shape): v = 3
    assert _rel(got, persample.loop_param_jacobian(model, x)) < 1e-5


class _EveryExpert(_SortedRuns):
    """One grouped product of every token by every expert (top-k = all of them): each
    token's rows repeated per expert and sorted by it, stably, hold the samples in a
    regular layout (each expert's run the whole batch in order)."""

    def __init__(self):
        super().__init__(top=B)

    def forward(self, x):  # (b, t, width)
        rows = x.reshape(-1, x.shape[-1]).repeat_interleave(self.top, 0)  # (R k, width)
        chosen = self.router(x.reshape(-1, x.shape[-1])).topk(self.top).indices  # (R, k)
        keys, perm = torch.sort(chosen.reshape(-1), stable=True)  # (S,) by expert
        counts = torch.histc(keys.float(), bins=self.experts, min=0, max=self.experts - 1)
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        h = F.grouped_mm(rows.index_select(0, perm), self.up, offs=offs)  # (S, 16)
        return self.head(h.view(self.experts, *x.shape[:2], -1)[..., :8].mean((0, 2)))


def test_grouped_products_in_a_regular_layout_take_their_rule(monkeypatch):
    """Rows sorted by expert that hold the samples in a regular layout (not an index
    layout) are sorted by sample for the rule all the same (float32: the kernel's)."""
    from persample.rules import experts as rule

    torch.manual_seed(0)
    model, loss = _EveryExpert().float(), nn.CrossEntropyLoss(reduction="none")
    x, y = torch.randn(B, T, 8, dtype=torch.float32), torch.randint(0, 3, (B,))
    seen, real = [], rule._by_sample
    monkeypatch.setattr(rule, "_by_sample", lambda lay, *a: seen.append(lay) or real(lay, *a))
    got = persample.per_sample_grads(model, x, y, loss, method="rules")
    assert seen and all(lay.index is None for lay in seen), seen
    want = persample.loop_per_sample_grads(model, x, y, loss)
    assert _rel(got, want) < 1e-5 and bool((got["up"].flatten(1).norm(dim=1) > 0).all())
    paths = {p: r.path for r in persample.supported(model, x, y, loss) for p in r.params}
    assert paths["up"] == "rule", paths  # (the router's indices only are read: unused)


def test_grouped_products_by_position_are_not_followed():
    """Fixed runs put a row with another expert's weights depending on where the other
    samples' rows sorted: not per sample, refused by name."""
    torch.manual_seed(0)
    model = _SortedRuns(by_key=False).float()
    x, y = torch.randn(B, T, 8, dtype=torch.float32), torch.randint(0, 3, (B,))
    loss = nn.CrossEntropyLoss(reduction="none")
    with pytest.raises(persample.LossNotPerSampleError, match="sort key"):
        persample.per_sample_grads(model, x, y, loss, method="rules")
    assert "rule" not in {r.path for r in persample.supported(model, x, y, loss)}


def test_gpt_oss_experts_take_the_grouped_rule():
    """gpt-oss's experts (biases, a clamped interleaved SwiGLU: not the module rule's) in
    transformers' default grouped implementation: every parameter on the rules, the rows
    the loop's (float32)."""
    model = zoo.gpt_oss(T)
    ids = torch.randint(0, 50, (B, T))
    got = persample.per_sample_grads(model, {"input_ids": ids}, ids, next_token, method="rules")
    want = persample.loop_per_sample_grads(model, {"input_ids": ids}, ids, next_token)
    assert _rel(got, want) < 1e-5
    paths = {r.path for r in persample.supported(model, {"input_ids": ids}, ids, next_token)}
    assert paths == {"rule"}, paths


def _switch(capacity: int):
    """Switch Transformers (Fedus et al. 2022) from a small config: top-1 routing, each
    expert taking at most ``capacity`` tokens of a sequence (the rest dropped: their rows
    zero), one sparse layer in the encoder and one in the decoder."""
    config = transformers.SwitchTransformersConfig(
        vocab_size=50, d_model=8, d_kv=4, d_ff=16, num_layers=2, num_decoder_layers=2,
        num_heads=4, num_experts=4, expert_capacity=capacity, num_sparse_encoder_layers=1,
        num_sparse_decoder_layers=1, decoder_start_token_id=0, pad_token_id=0,
        dropout_rate=0.0)
    torch.manual_seed(0)
    model = transformers.SwitchTransformersForConditionalGeneration(config).double().eval()
    for module in model.modules():  # (a router casts itself to its dtype at every call,
        if type(module).__name__.endswith("Top1Router"):  # float32 by the config's
            module.dtype = torch.float64  # choices: float64 here, as the rest)
    ids = torch.randint(1, 50, (B, T))
    inputs = {"input_ids": ids, "decoder_input_ids": ids}
    with torch.no_grad():  # (its routers keep an attribute of their first call)
        model(**inputs)
    return model, inputs, ids


def next_logits(out, ids: Tensor) -> Tensor:
    """Per-sample cross-entropy of the decoder's logits against ``ids`` ``(B,)``."""
    return F.cross_entropy(out.logits.transpose(1, 2), ids, reduction="none").mean(1)


@pytest.mark.parametrize("capacity", [1, T])
def test_switch_experts_take_their_module_rule_and_are_exact(capacity):
    """The experts (a ``ModuleDict`` run by a loop over the experts any token of the
    batch chose) take their module rule; with a capacity of 1 tokens are dropped."""
    model, inputs, ids = _switch(capacity)
    dropped = []
    hook = model.encoder.block[1].layer[1].mlp.router.register_forward_hook(
        lambda module, args, out: dropped.append(bool((out[0].sum(-1) == 0).any())))
    try:
        check(model, inputs, ids, next_logits, paths={"rule", "module rule", "unused"})
    finally:
        hook.remove()
    assert any(dropped) == (capacity == 1)
    routes = {r.module: r.path for r in persample.supported(model, inputs, ids, next_logits)}
    assert routes["encoder.block.1.layer.1.mlp.experts.expert_0.wi"] == "module rule"
    assert routes["encoder.block.1.layer.1.mlp.router.classifier"] == "rule"


def test_a_router_casting_itself_with_gradients_kept_stays_on_the_rules():
    """Switch's router calls ``self.classifier.to(dtype)`` in its forward, which reads
    and sets each parameter's ``.grad`` where one is kept (a plain step before, gradients
    accumulated): no gradient path, so the router keeps its rule."""
    model, inputs, ids = _switch(1)
    next_logits(model(**inputs), ids).sum().backward()
    assert model.encoder.block[1].layer[1].mlp.router.classifier.weight.grad is not None
    routes = {r.module: r.path for r in persample.supported(model, inputs, ids, next_logits)}
    assert routes["encoder.block.1.layer.1.mlp.router.classifier"] == "rule"
    got = persample.per_sample_grads(model, inputs, ids, next_logits, method="rules")
    want = persample.loop_per_sample_grads(model, inputs, ids, next_logits)
    assert_exact(got, want)


class _SplitExperts(nn.Module):
    """JetMoE's mixture: the (token, expert) pairs sorted by expert, the tokens gathered
    by ``perm.div(k, rounding_mode="trunc")``, ``split`` by each expert's count (read into
    Python), a linear map per expert, ``cat`` back, then a second ``split`` of that result
    for the second layer (``twice``), and ``index_add`` into the tokens."""

    def __init__(self, twice: bool = True, experts: int = B, top: int = 2, width: int = 8):
        super().__init__()
        self.twice, self.experts, self.top = twice, experts, top
        self.router = nn.Linear(width, experts, bias=False)
        self.up = nn.Parameter(torch.randn(experts, 16, width) * 0.3)
        self.down = nn.Parameter(torch.randn(experts, width, 16) * 0.3)
        self.head = nn.Linear(width, 3)

    def _experts(self, h: Tensor, weight: Tensor, counts: list) -> Tensor:
        pieces = h.split(counts, dim=0)
        return torch.cat([F.linear(pieces[e], weight[e]) for e in range(self.experts)])

    def forward(self, x):  # (b, t, width)
        rows = x.reshape(-1, x.shape[-1])  # (R, width)
        gates, chosen = self.router(rows).topk(self.top, dim=1)  # (R, k)
        counts = torch.zeros(rows.shape[0], self.experts).scatter(1, chosen, 1).long().sum(0)
        _, perm = chosen.flatten().sort(0)  # (S,)
        token = perm.div(self.top, rounding_mode="trunc")  # (S,)
        h = F.silu(self._experts(rows[token], self.up, counts.tolist()))  # (S, 16)
        if self.twice:
            h = self._experts(h, self.down, counts.tolist())  # (S, width)
        else:
            h = h @ self.down[0].T
        h = h * gates.softmax(1).flatten()[perm, None]
        out = torch.zeros_like(rows).index_add(0, token, h)
        return self.head(out.view(*x.shape).mean(1))


@pytest.mark.parametrize("twice", [True, False])
def test_experts_split_by_count_and_joined_again_take_the_rules(twice):
    """Each piece of a split by the sorted experts' counts keeps its positions' keys, and
    ``cat`` of such pieces keeps them, so the second layer's split is followed as the
    first's (JetMoE went to ``torch.func`` over the whole model); ``B`` = the experts = the
    tokens."""
    torch.manual_seed(0)
    model = _SplitExperts(twice)
    x, y = torch.randn(B, T, 8), torch.randint(0, 3, (B,))
    loss = nn.CrossEntropyLoss(reduction="none")
    paths = {r.path for r in persample.supported(model, x, y, loss)}
    assert paths == {"rule"}, paths
    check(model, x, y, loss, paths=None)


class _ExpertsHit(nn.Module):
    """DBRX's experts: a loop over the experts some token of the batch chose (``nonzero``
    of counts summed over the batch), each expert's slice of a stacked weight indexed by
    that 0-d tensor, its tokens by ``torch.where`` of the expert's mask."""

    def __init__(self, experts: int = B, top: int = 2, width: int = 8):
        super().__init__()
        self.experts, self.top = experts, top
        self.router = nn.Linear(width, experts, bias=False)
        self.w = nn.Parameter(torch.randn(experts * 16, width) * 0.3)
        self.v = nn.Parameter(torch.randn(experts * 16, width) * 0.3)
        self.head = nn.Linear(width, 3)

    def forward(self, x):  # (b, t, width)
        rows = x.reshape(-1, x.shape[-1])
        gates, chosen = self.router(rows).softmax(-1).topk(self.top)  # (R, k)
        out = torch.zeros_like(rows)
        with torch.no_grad():
            mask = F.one_hot(chosen, self.experts).permute(2, 1, 0)  # (E, k, R)
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for e in hit:
            e = e[0]
            with torch.no_grad():
                slot, token = torch.where(mask[e])
            w, v = self.w.view(-1, 16, rows.shape[1])[e], self.v.view(-1, 16, rows.shape[1])[e]
            h = (F.silu(rows[token] @ w.T) @ v) * gates[token, slot, None]
            out.index_add_(0, token, h)
        return self.head(out.view(*x.shape).mean(1))


class _ChosenByTheBatch(nn.Module):
    """A row of a table chosen by the whole batch (the argmax of a sum over it) and used
    for every sample: it mixes samples, where each sample alone chooses its own."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(4, 8))
        self.head = nn.Linear(8, 3)

    def forward(self, x):  # (b, 8)
        k = (x[:, :4].sum(0)).argmax()
        return self.head(x * self.table[k])


def test_a_loop_over_the_experts_the_batch_hit_takes_the_rules():
    """The expert of each turn of the loop is chosen by the batch (its counts), a constant
    of the forward, as a number read into Python is: each expert's tokens keep their
    samples, and the certificate compares a sample alone (DBRX went to ``torch.func``
    over the whole model); ``B`` = the experts = the tokens."""
    torch.manual_seed(0)
    model = _ExpertsHit()
    x, y = torch.randn(B, T, 8), torch.randint(0, 3, (B,))
    loss = nn.CrossEntropyLoss(reduction="none")
    assert {r.path for r in persample.supported(model, x, y, loss)} == {"rule"}
    with persample.checking("always"):
        check(model, x, y, loss, paths=None)


def test_a_row_chosen_by_the_batch_for_every_sample_is_caught_by_a_sample_alone():
    """The same constant choice where it steers each sample by the others: the rules'
    rows sum to the batch's gradient, and the certificate's comparison of the last sample
    with its forward alone refuses them; so does ``auto``, whose loop disagrees with the
    batch: the model mixes samples (the loop answers when asked for)."""
    torch.manual_seed(0)
    model, loss = _ChosenByTheBatch(), nn.CrossEntropyLoss(reduction="none")
    x, y = torch.randn(B, 8), torch.randint(0, 3, (B,))
    x[-1, :4] = torch.tensor([0.0, 0.0, 0.0, 9.0])  # (the last sample alone picks row 3)
    x[:-1, 1] += 9.0  # (the batch picks row 1)
    with pytest.raises(persample.CertificateError, match="alone"):
        persample.per_sample_grads(model, x, y, loss, method="rules")
    with pytest.raises(persample.CertificateError, match="mixes samples"), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")
        persample.per_sample_grads(model, x, y, loss)
