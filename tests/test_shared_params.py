"""Parameters several ops read (a tied embedding and output layer, a layer called twice,
weights shared across depth as in ALBERT): their per-sample gradient norms come from
each use's factors and the cross terms, ``|G1 + G2|^2 = |G1|^2 + |G2|^2 + 2 <G1, G2>``,
without materialising, and their clipped sums from each use's weighted sum. Checked
against the loop in float64, with the path each parameter took."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import persample
from cases import assert_exact, clipped_mean
from persample import loop_per_sample_grads
from persample.dp import PrivateStep, private_grad
from persample.engine import loss_backprops
from persample.engine.norms import squared_norms
from persample.inputs import as_batch
from persample.rules import ghost

B = T = 6  # sizes chosen to coincide
V, D = 97, 8  # a vocabulary large enough that the ghost norm is the cheaper


class TiedLM(nn.Module):
    """An embedding whose table is also the output layer (GPT-2's tying), with a
    padding id and repeated ids."""

    def __init__(self, padding_idx: int | None = None):
        super().__init__()
        self.emb = nn.Embedding(V, D, padding_idx=padding_idx)
        self.mix = nn.Linear(D, D)
        self.head = nn.Linear(D, V, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: Tensor) -> Tensor:  # (B, T) -> (B, T, V)
        return self.head(torch.tanh(self.mix(self.emb(ids))))


class TwiceCalled(nn.Module):
    """One Linear called at two depths, with its bias (ALBERT shares whole layers)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 32)
        self.shared = nn.Linear(32, 32)
        self.out = nn.Linear(32, 3)

    def forward(self, x: Tensor) -> Tensor:  # (B, T, 4) -> (B, 3)
        h = torch.tanh(self.shared(torch.tanh(self.inp(x))))
        return self.out(torch.tanh(self.shared(h)).mean(1))


class SharedConv1D(nn.Module):
    """GPT-2's Conv1D form (addmm over merged rows) with one weight used twice, once
    with alpha and beta not 1."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(32, 32) / 6)
        self.bias = nn.Parameter(torch.randn(32))
        self.head = nn.Linear(32, 3)

    def forward(self, x: Tensor) -> Tensor:  # (B, T, 32)
        n, t, e = x.shape
        h = torch.tanh(torch.addmm(self.bias, x.reshape(-1, e), self.weight))
        h = torch.addmm(self.bias, h, self.weight, beta=0.5, alpha=2.0)
        return self.head(torch.tanh(h).view(n, t, e).sum(1))


class TwoLookups(nn.Module):
    """One table looked up twice (two id streams) and read by a linear map."""

    def __init__(self, width: int = 32):
        super().__init__()
        self.table = nn.Parameter(torch.randn(V, width) / 4)
        self.head = nn.Linear(width, 3)

    def forward(self, ids: Tensor) -> Tensor:  # (B, T)
        h = F.embedding(ids, self.table) + F.embedding(ids.flip(1), self.table)
        return self.head(F.linear(torch.tanh(h), self.table).softmax(-1) @ self.table).sum(1)


class SquaredWeight(nn.Module):
    """One op reading the same parameter twice (``h @ W @ W`` as ``W @ W`` first): not a
    sum of factored uses; materialised."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8) / 3)
        self.head = nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:  # (B, 8)
        return self.head(torch.tanh(x @ torch.matmul(self.w, self.w)))


def _lm_loss(out: Tensor, ids: Tensor) -> Tensor:
    return F.cross_entropy(out.transpose(1, 2), ids, reduction="none").mean(1)


def _case(make):
    torch.manual_seed(0)
    if make in (TiedLM, TwoLookups):
        model = make()
        ids = torch.randint(1, V, (B, T))
        ids[:, T // 2:] = ids[:, : T - T // 2]  # repeated ids within each sample
        ids[0, 1] = 0  # the padding id where there is one
        if make is TiedLM:
            return model, ids, ids, _lm_loss
        return model, ids, torch.randint(0, 3, (B,)), nn.CrossEntropyLoss()
    x = {TwiceCalled: torch.randn(B, T, 4), SharedConv1D: torch.randn(B, T, 32),
         SquaredWeight: torch.randn(B, 8)}[make]
    return make(), x, torch.randint(0, 3, (B,)), nn.CrossEntropyLoss()


def _ghosted(model, x, y, loss_fn) -> set[str]:
    """The parameters whose norms did not need their per-sample gradients."""
    params = {k: p for k, p in model.named_parameters() if p.requires_grad}
    cap = loss_backprops(model, as_batch(x), y, loss_fn, {id(p): p for p in params.values()})
    _, mats, _, _ = squared_norms(cap, params)
    return {k for k, p in params.items() if id(p) not in mats}


def _by_hand(model, x, y, loss_fn, c: float):
    return clipped_mean(loop_per_sample_grads(model, x, y, loss_fn), c)


SHARED = {TiedLM: "emb.weight", TwiceCalled: "shared.weight", SharedConv1D: "weight",
          TwoLookups: "table"}


@pytest.mark.parametrize("make", [TiedLM, TwiceCalled, SharedConv1D, TwoLookups])
def test_shared_parameter_norms_and_clipped_sums_without_materialising(make, snapshot):
    model, x, y, loss_fn = _case(make)
    assert SHARED[make] in _ghosted(model, x, y, loss_fn)  # (a bias is cheaper summed)
    before = snapshot(model)
    norms, want = _by_hand(model, x, y, loss_fn, c=0.05)  # clips every sample
    got = persample.per_sample_grad_norms(model, x, y, loss_fn)
    torch.testing.assert_close(got, norms, rtol=1e-10, atol=1e-13)
    before.assert_unchanged()
    _, got_norms = private_grad(model, x, y, loss_fn, max_grad_norm=0.05, noise_multiplier=0.0)
    torch.testing.assert_close(got_norms, norms, rtol=1e-10, atol=1e-13)
    assert_exact({k: p.grad for k, p in model.named_parameters()}, want)


def test_padding_id_of_a_tied_table_gets_no_lookup_gradient():
    model, ids, _, _ = _case(TiedLM)
    model = TiedLM(padding_idx=0)
    norms, want = _by_hand(model, ids, ids, _lm_loss, c=0.05)
    assert "emb.weight" in _ghosted(model, ids, ids, _lm_loss)
    torch.testing.assert_close(persample.per_sample_grad_norms(model, ids, ids, _lm_loss),
                               norms, rtol=1e-10, atol=1e-13)
    private_grad(model, ids, ids, _lm_loss, max_grad_norm=0.05, noise_multiplier=0.0)
    assert_exact({k: p.grad for k, p in model.named_parameters()}, want)


def test_one_op_reading_a_parameter_twice_is_materialised_and_exact():
    model, x, y, loss_fn = _case(SquaredWeight)
    assert "w" not in _ghosted(model, x, y, loss_fn)
    norms, want = _by_hand(model, x, y, loss_fn, c=0.05)
    torch.testing.assert_close(persample.per_sample_grad_norms(model, x, y, loss_fn), norms,
                               rtol=1e-10, atol=1e-13)
    private_grad(model, x, y, loss_fn, max_grad_norm=0.05, noise_multiplier=0.0)
    assert_exact({k: p.grad for k, p in model.named_parameters()}, want)


def test_a_derived_op_reading_one_parameter_twice_takes_its_vjp():
    """``W @ W`` pulled back from the product that reads it: a rule writes each operand's
    part into the one destination, the second over the first (half the gradient); the
    op's VJP adds them. Exact without the certificate."""
    model, x, y, loss_fn = _case(SquaredWeight)
    got = persample.per_sample_grads(model, x, y, loss_fn, method="rules", check="never")
    assert_exact(got, loop_per_sample_grads(model, x, y, loss_fn), rel=1e-10)


def test_materialising_stays_where_cheaper():
    """A small table read over long sequences: the cost model materialises it."""
    torch.manual_seed(0)
    model = TiedLM()
    model.emb = nn.Embedding(5, D)
    model.head = nn.Linear(D, 5, bias=False)
    model.head.weight = model.emb.weight
    ids = torch.randint(0, 5, (B, 40))
    assert "emb.weight" not in _ghosted(model, ids, ids, _lm_loss)
    norms, _ = _by_hand(model, ids, ids, _lm_loss, c=1.0)
    torch.testing.assert_close(persample.per_sample_grad_norms(model, ids, ids, _lm_loss),
                               norms, rtol=1e-10, atol=1e-13)


def test_private_step_over_micro_batches_with_a_tied_table():
    model, ids, _, _ = _case(TiedLM)
    _, want = _by_hand(model, ids, ids, _lm_loss, c=0.05)
    step = PrivateStep(model, _lm_loss, max_grad_norm=0.05, noise_multiplier=0.0,
                       expected_batch_size=B)
    for part in (slice(0, 2), slice(2, B)):
        step.accumulate(ids[part], ids[part])
    step.release()
    assert_exact({k: p.grad for k, p in model.named_parameters()}, want)


@pytest.mark.parametrize("layers", [2])
def test_albert_shares_its_layer_across_depth(layers):
    """transformers' ALBERT: one layer group applied at every depth; its weights' norms
    are the norms of the summed uses."""
    from zoo import require

    transformers = require("transformers")
    config = transformers.AlbertConfig(vocab_size=V, embedding_size=8, hidden_size=16,
                                       num_hidden_layers=layers, num_attention_heads=2,
                                       intermediate_size=32, max_position_embeddings=T,
                                       hidden_dropout_prob=0.0,
                                       attention_probs_dropout_prob=0.0, num_labels=3)
    torch.manual_seed(0)
    model = transformers.AlbertForSequenceClassification(config).eval().double()
    ids = torch.randint(0, V, (B, T))
    inputs = {"input_ids": ids, "attention_mask": torch.ones(B, T, dtype=torch.long)}
    y = torch.randint(0, 3, (B,))

    def loss_fn(out, target):
        return F.cross_entropy(out.logits, target, reduction="none")

    ghosted = _ghosted(model, inputs, y, loss_fn)
    shared = "albert.encoder.albert_layer_groups.0.albert_layers.0.ffn.weight"  # 16 -> 32
    assert shared in ghosted
    norms, want = _by_hand(model, inputs, y, loss_fn, c=0.05)
    torch.testing.assert_close(persample.per_sample_grad_norms(model, inputs, y, loss_fn),
                               norms, rtol=1e-9, atol=1e-12)
    private_grad(model, inputs, y, loss_fn, max_grad_norm=0.05, noise_multiplier=0.0)
    assert_exact({k: p.grad for k, p in model.named_parameters()}, want, rel=1e-8)


def test_inner_products_of_factors_match_the_materialised_gradients():
    """``ghost.inner`` for every pairing (dense-dense, ids-dense, dense-ids, ids-ids),
    computed in blocks of positions."""
    torch.manual_seed(0)
    n, r, c = 3, 11, 5
    dense = ghost.Factors(torch.randn(n, 7, r), torch.randn(n, 7, c))
    ids = ghost.Factors(torch.randint(0, r, (n, 9)), torch.randn(n, 9, c))

    def full(f: ghost.Factors) -> Tensor:
        left = F.one_hot(f.left, r).to(f.right.dtype) if f.ids else f.left
        return torch.einsum("ntr,ntc->nrc", left, f.right)

    old = ghost.BLOCK_BYTES
    for block in (old, 64):  # one block, and one position per block
        ghost.BLOCK_BYTES = block
        try:
            for a in (dense, ids):
                for b in (dense, ids):
                    want = (full(a) * full(b)).sum((1, 2))
                    torch.testing.assert_close(ghost.inner(a, b), want, rtol=1e-12, atol=1e-12)
        finally:
            ghost.BLOCK_BYTES = old
    total = full(dense) + full(ids)
    torch.testing.assert_close(ghost.squared_norm([dense, ids]), total.square().sum((1, 2)))


class TiedWithIndexing(TiedLM):
    """The tied table also read as ``table[ids]`` (the lookup rule for indexing)."""

    def forward(self, ids: Tensor) -> Tensor:
        return super().forward(ids) + self.emb.weight[ids.flip(1)].sum(-1, keepdim=True)


@pytest.mark.parametrize("make,padding_idx", [(TiedLM, None), (TiedLM, 0),
                                              (TiedWithIndexing, 0)])
def test_per_sample_grads_of_a_tied_table_add_the_lookups_in_place(make, padding_idx,
                                                                   patch_spec):
    """The output layer's dense per-sample gradient is written first and the lookups add
    their rows to it (no second (B, V, D) buffer): exact against the loop, the padding
    row keeping the output layer's part."""
    from persample import rules

    added = []
    for func in (F.embedding, torch.Tensor.__getitem__):
        rule = rules.spec_of(func).grad

        def spy(call, g, out, rule=rule):
            added.append(bool(call.adding))
            return rule(call, g, out)

        patch_spec(func, grad=spy)
    torch.manual_seed(0)
    model = make(padding_idx)
    ids = torch.randint(1, V, (B, T))
    ids[0, 1] = 0
    want = loop_per_sample_grads(model, ids, ids, _lm_loss)
    got = persample.per_sample_grads(model, ids, ids, _lm_loss, method="rules")
    assert_exact(got, want)
    assert added and all(added)
    assert got["emb.weight"][:, 0].abs().sum() > 0  # the output layer's row 0 is there


@pytest.mark.parametrize("func", [F.linear, F.embedding], ids=["output layer", "lookup"])
def test_a_fault_in_one_use_of_a_tied_table_leaves_the_clipped_sums_exact(
        func, patch_spec, fallbacks_answer_internal_errors):
    """A weighted-sum rule failing after (output layer) or before (lookup) the tied
    table's other use was added: the uses left come from each op's own backward, or the
    whole parameter from per-sample gradients; a warning names persample's bug."""
    def broken(*args, **kwargs):
        raise RuntimeError("injected")

    patch_spec(func, sum=broken)
    model, ids, _, _ = _case(TiedLM)
    _, want = _by_hand(model, ids, ids, _lm_loss, c=0.05)
    with pytest.warns(UserWarning, match="injected"):
        private_grad(model, ids, ids, _lm_loss, max_grad_norm=0.05, noise_multiplier=0.0)
    assert_exact({k: p.grad for k, p in model.named_parameters()}, want)


class Looped(nn.Module):
    """One Linear applied at every step of a loop over its own output (a recurrent
    cell, a looped transformer's shared block), and a GPT-2 ``Conv1D`` weight (addmm,
    ``(in, out)``) twice: ``8 x 6`` positions of a 32 x 32 weight, more than one product
    of joined factors holds."""

    def __init__(self, steps: int = 8):
        super().__init__()
        self.steps = steps
        self.inp = nn.Linear(4, 32)
        self.cell = nn.Linear(32, 32)
        self.conv = nn.Parameter(torch.randn(32, 32) / 6)
        self.out = nn.Linear(32, 3)

    def forward(self, x: Tensor) -> Tensor:  # (B, T, 4) -> (B, 3)
        h = torch.tanh(self.inp(x))
        for _ in range(self.steps):
            h = torch.tanh(self.cell(h)) + h
        n, t, e = h.shape
        for _ in range(2):
            h = torch.tanh(torch.addmm(h.new_zeros(e), h.reshape(-1, e), self.conv)).view(n, t, e)
        return self.out(h.mean(1))


class ScratchRNN(nn.Module):
    """An RNN written with two Linear layers, one step per position from a learned
    initial state: the first step's ``hh(h0)`` is made from the parameters alone (a
    derived tensor, pulled back through that call: its part of ``hh.weight`` is not
    zero), the others read per-sample states."""

    def __init__(self):
        super().__init__()
        self.h0 = nn.Parameter(torch.randn(32))
        self.ih = nn.Linear(4, 32)
        self.hh = nn.Linear(32, 32)
        self.out = nn.Linear(32, 3)

    def forward(self, x: Tensor) -> Tensor:  # (B, T, 4) -> (B, 3)
        h = torch.tanh(self.h0).expand(x.shape[0], 32)
        for t in range(x.shape[1]):
            h = torch.tanh(self.ih(x[:, t]) + self.hh(h))
        return self.out(h)


@pytest.mark.parametrize("make,shared", [(TwiceCalled, ["shared.weight"]),
                                         (SharedConv1D, ["weight"]),
                                         (Looped, ["cell.weight", "conv"]),
                                         (ScratchRNN, ["ih.weight", "hh.weight"])])
@pytest.mark.parametrize("flat", [False, True], ids=["dict", "flat"])
def test_a_layer_called_at_every_step_is_formed_from_its_joined_factors(
        make, shared, flat, monkeypatch):
    """A weight several ops read directly gets its per-sample gradient from one product
    over every such use's positions (``ghost.formed``), written into the result first
    (a use through a derived tensor then adds its part): exact against the loop, into a
    dict's blocks and a flat result's strided rows alike, and ``supported()`` says
    ``rule``."""
    from persample.engine import pullback

    formed = []

    def spy(uses, out=None):
        formed.append(sum(u.positions for u in uses))
        return ghost.formed(uses, out)

    monkeypatch.setattr(pullback, "formed", spy)
    model, x, y, loss_fn = _case(make) if make not in (Looped, ScratchRNN) else (
        make(), torch.randn(B, T, 4), torch.randint(0, 3, (B,)), nn.CrossEntropyLoss())
    want = loop_per_sample_grads(model, x, y, loss_fn)
    got = persample.per_sample_grads(model, x, y, loss_fn, method="rules", flat=flat)
    if flat:
        got = dict(zip(want, got.split([w[0].numel() for w in want.values()], 1)))
        got = {k: g.view_as(want[k]) for k, g in got.items()}
    assert_exact(got, want, rel=1e-10)
    uses = {TwiceCalled: [2 * T], SharedConv1D: [2 * T], Looped: [8 * T, 2 * T],
            ScratchRNN: [T, T - 1]}[make]  # (hh's first call: through its derived output)
    assert sorted(formed) == sorted(uses)
    routes = persample.supported(model, x, y, loss_fn)
    paths = {f"{r.module}.{p}".lstrip("."): r.path for r in routes for p in r.params}
    assert {paths[name] for name in shared} == {"rule"}, routes


def test_joined_factors_over_several_products_and_into_a_given_result():
    """``ghost.formed`` over uses that take more than one product (chunks added by
    ``baddbmm``), into a new tensor and into a strided one given."""
    torch.manual_seed(0)
    n, r, c = 3, 5, 4
    uses = [ghost.Factors(torch.randn(n, t, r), torch.randn(n, t, c)) for t in (2, 9, 1, 3)]
    want = sum(torch.einsum("ntr,ntc->nrc", u.left, u.right) for u in uses)
    torch.testing.assert_close(ghost.formed(uses), want, rtol=1e-12, atol=1e-12)
    block = torch.full((n, 2 * r * c), float("nan"))
    into = block[:, r * c:].view(n, r, c)  # (rows r * c apart: a flat result's block)
    assert ghost.formed(uses, into) is into
    torch.testing.assert_close(into, want, rtol=1e-12, atol=1e-12)
    assert block[:, : r * c].isnan().all()
    with pytest.raises(ValueError, match="row ids"):
        ghost.formed([ghost.Factors(torch.zeros(n, 2, dtype=torch.long), torch.randn(n, 2, c))])


def test_a_looped_layers_joined_gradient_at_every_cached_call_on_new_data(compiled):
    """The cached calls (a program, a compiled forward; the rules replayed) form the
    joined gradient again on each call's own data: exact against the loop at each."""
    torch.manual_seed(0)
    model, loss_fn = Looped(steps=3), nn.CrossEntropyLoss()
    for _ in range(5):
        x, y = torch.randn(B, T, 4), torch.randint(0, 3, (B,))
        got = persample.per_sample_grads(model, x, y, loss_fn, method="rules", check="never")
        assert_exact(got, loop_per_sample_grads(model, x, y, loss_fn), rel=1e-10)


def test_a_looped_layer_in_bfloat16_is_formed_in_float32_and_written_in_its_dtype():
    """A bfloat16 weight's uses are joined in float32 (the factors' dtype), then written
    into the bfloat16 result: within bfloat16's rounding of the loop in float64 on the
    same weights and inputs."""
    torch.manual_seed(0)
    model, loss_fn = Looped(steps=3), nn.CrossEntropyLoss()
    x, y = torch.randn(B, T, 4), torch.randint(0, 3, (B,))
    low = copy.deepcopy(model).to(torch.bfloat16)
    want = loop_per_sample_grads(low.double(), x.bfloat16().double(), y, loss_fn)
    got = persample.per_sample_grads(copy.deepcopy(model).to(torch.bfloat16), x.bfloat16(), y,
                                     loss_fn, method="rules", check="never")
    assert got["cell.weight"].dtype == torch.bfloat16
    for name in ("cell.weight", "conv"):
        err = (got[name].double() - want[name]).norm() / want[name].norm()
        assert err < 3e-2, (name, err)


class FourWays(nn.Module):
    """One square weight read as ``F.linear``'s ``(out, in)``, as ``h @ W``'s and
    ``addmm``'s ``(in, out)``, and through its transpose (a derived tensor)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 8) / 3)
        self.bias = nn.Parameter(torch.randn(8))
        self.head = nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:  # (B, T, 8) -> (B, 3)
        h = torch.tanh(F.linear(x, self.weight, self.bias))
        h = torch.tanh(h @ self.weight)
        n, t, e = h.shape
        h = torch.tanh(torch.addmm(self.bias, h.reshape(-1, e), self.weight)).view(n, t, e)
        return self.head(torch.tanh(torch.matmul(h, self.weight.T)).mean(1))


def test_uses_of_a_weight_in_either_orientation_are_joined_exactly(monkeypatch):
    """Each use's factors are in the weight's own ``(rows, cols)`` whichever side of
    the product it is on: the three direct uses joined, the transposed read added, the
    sum the loop's."""
    from persample.engine import pullback

    joined = []
    monkeypatch.setattr(pullback, "formed",
                        lambda uses, out=None: joined.append(len(uses)) or ghost.formed(uses, out))
    torch.manual_seed(0)
    model, x, y = FourWays(), torch.randn(B, T, 8), torch.randint(0, 3, (B,))
    got = persample.per_sample_grads(model, x, y, nn.CrossEntropyLoss(), method="rules",
                                     check="never")
    assert_exact(got, loop_per_sample_grads(model, x, y, nn.CrossEntropyLoss()), rel=1e-10)
    assert joined == [3]


class StepDecoder(nn.Module):
    """A decoder that calls a recurrent layer one step at a time, as the PyTorch
    sequence-to-sequence tutorial's does (``nn.GRU``, ``nn.LSTM``), with teacher forcing:
    the layer's module rule at every step."""

    def __init__(self, kind: str):
        super().__init__()
        self.emb = nn.Embedding(V, 8)
        self.rnn = getattr(nn, kind)(8, 16, batch_first=True)
        self.out = nn.Linear(16, V)

    def forward(self, ids: Tensor) -> Tensor:  # (B, T) -> (B, T, V)
        state, outs = None, []
        for t in range(ids.shape[1]):
            o, state = self.rnn(torch.relu(self.emb(ids[:, t:t + 1])), state)
            outs.append(self.out(o))
        return torch.cat(outs, 1)


@pytest.mark.parametrize("kind", ["GRU", "LSTM", "RNN"])
def test_a_recurrent_layer_called_at_every_step_is_formed_in_one_product(kind, monkeypatch):
    """The module rule of each step hands its weights' parts over as factors, and each
    weight is formed once over the steps: exact against the loop."""
    from persample.engine import pullback

    formed = []
    monkeypatch.setattr(pullback, "formed",
                        lambda uses, out=None: formed.append(len(uses)) or ghost.formed(uses, out))
    torch.manual_seed(0)
    model, ids = StepDecoder(kind), torch.randint(0, V, (B, T))
    got = persample.per_sample_grads(model, ids, ids, _lm_loss, method="rules", check="never")
    assert_exact(got, loop_per_sample_grads(model, ids, ids, _lm_loss), rel=1e-10)
    assert sorted(formed) == [T, T, T], formed  # (out.weight joined; the layer's two)
