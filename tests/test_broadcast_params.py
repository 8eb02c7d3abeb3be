"""Parameters broadcast into the batch, and ops that run as the ops they are made of:
a learned query of attention pooling (Set Transformer's PMA, timm's MAP head), a
learned initial state of a GRU/LSTM/RNN cell decoder, ``baddbmm``/``addbmm`` with a
bias and a weight per head (RecurrentGemma's RG-LRU gates), a product with a parameter
that has dims of its own beside its matrices. Each against the loop in float64 on the
rules (``supported`` says ``rule`` for every parameter), with ``B`` equal to the
heads, the steps or the features."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import persample
from battery import check

B = 4  # = heads = steps = features below


def mse(out, y):
    return (out - y).pow(2).flatten(1).sum(1)


class Pooling(nn.Module):
    """Attention pooling by learned queries (Lee et al. 2019, PMA)."""

    def __init__(self):
        super().__init__()
        self.query = nn.Parameter(torch.randn(1, 2, 8))
        self.attention = nn.MultiheadAttention(8, B, batch_first=True)
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        q = self.query.expand(x.shape[0], -1, -1)
        pooled, _ = self.attention(q, x, x)
        return self.head(pooled.flatten(1))


class Decoder(nn.Module):
    """A cell unrolled from a learned initial state, attending over the input."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        cell = {"gru": nn.GRUCell, "lstm": nn.LSTMCell, "rnn": nn.RNNCell,
                "relu": lambda i, h: nn.RNNCell(i, h, nonlinearity="relu")}[kind]
        self.cell = cell(B, 6)
        self.h0 = nn.Parameter(torch.randn(6) * 0.5)
        self.c0 = nn.Parameter(torch.randn(6) * 0.5) if kind == "lstm" else None
        self.key = nn.Linear(6, B)
        self.out = nn.Linear(6, 3)

    def forward(self, x):  # (b, t, B)
        h, c = self.h0.expand(x.shape[0], 6), None
        for _ in range(B):
            weights = torch.softmax(torch.einsum("btf,bf->bt", x, self.key(h)), 1)
            context = torch.einsum("bt,btf->bf", weights, x)
            if self.kind == "lstm":
                h, c = self.cell(context, (h, self.c0.expand(x.shape[0], 6) if c is None else c))
            else:
                h = self.cell(context, h)
        return self.out(h)


class Gates(nn.Module):
    """RG-LRU's gates: ``baddbmm`` of a bias, the activations by head and a weight per
    head (De et al. 2024, Griffin), and ``addbmm`` of the heads' products."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(B, 3, 3) * 0.5)  # (heads, width, width)
        self.bias = nn.Parameter(torch.randn(B, 3) * 0.5)
        self.mix = nn.Parameter(torch.randn(3, 2) * 0.5)
        self.offset = nn.Parameter(torch.randn(2) * 0.5)

    def forward(self, x):  # (b, t, heads * width)
        b, t, _ = x.shape
        heads = x.reshape(b * t, B, 3).permute(1, 0, 2)  # (heads, b*t, width)
        gate = torch.sigmoid(torch.baddbmm(self.bias[:, None, :], heads, self.weight))
        mixed = torch.addbmm(self.offset, gate, self.mix.expand(B, 3, 2),
                             beta=0.5, alpha=2.0)  # (b*t, 2)
        return gate.permute(1, 0, 2).reshape(b, t, -1).sum(1)[:, :2] + mixed.view(b, t, 2).sum(1)


def _inputs(*shape):
    torch.manual_seed(1)
    return torch.randn(*shape, dtype=torch.float64)


def test_a_learned_query_pools_on_the_rules():
    torch.manual_seed(0)
    model = Pooling().double()
    check(model, _inputs(B, 5, 8), _inputs(B, 3), mse)


@pytest.mark.parametrize("kind", ["gru", "lstm", "rnn", "relu"])
def test_a_cell_from_a_learned_state_on_the_rules(kind):
    torch.manual_seed(0)
    model = Decoder(kind).double()
    check(model, _inputs(B, B, B), _inputs(B, 3), mse)


def test_batched_products_with_a_weight_per_head_on_the_rules():
    torch.manual_seed(0)
    model = Gates().double()
    x = _inputs(B, B, B * 3)  # b*t = 16 rows, 4 heads of width 3
    got = check(model, x, _inputs(B, 2), mse)
    assert got["weight"].shape == (B, B, 3, 3)


def test_in_place_and_out_forms_run_whole_and_exact():
    """``baddbmm_`` writes its first argument: it runs as itself, not as its ops."""
    class InPlace(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(2, 3, 3))

        def forward(self, x):  # (b, 3)
            y = x.new_ones(2, x.shape[0], 3)
            y.baddbmm_(x.unsqueeze(0).expand(2, -1, -1), self.weight)  # (2, b, 3)
            return y.sum(0)

    torch.manual_seed(0)
    model = InPlace().double()
    x = _inputs(B, 3)
    want = persample.loop_per_sample_grads(model, x, _inputs(B, 3), mse)
    got = persample.per_sample_grads(model, x, _inputs(B, 3), mse)
    torch.testing.assert_close(got["weight"], want["weight"], rtol=1e-10, atol=1e-12)


def test_the_expansions_compute_what_the_ops_do():
    from persample.rules import composite

    torch.manual_seed(0)
    x, h, c = torch.randn(5, 4), torch.randn(5, 6), torch.randn(5, 6)
    cell = nn.LSTMCell(4, 6)
    args = (cell.weight_ih, cell.weight_hh, cell.bias_ih, cell.bias_hh)
    for ours, theirs in zip(composite.lstm_cell(x, (h, c), *args),
                            torch.lstm_cell(x, (h, c), *args)):
        torch.testing.assert_close(ours, theirs)
    gru = nn.GRUCell(4, 6)
    args = (gru.weight_ih, gru.weight_hh, gru.bias_ih, gru.bias_hh)
    torch.testing.assert_close(composite.gru_cell(x, h, *args), torch.gru_cell(x, h, *args))
    a, b1, b2 = torch.randn(2, 3, 5), torch.randn(2, 3, 4), torch.randn(2, 4, 5)
    torch.testing.assert_close(composite.baddbmm(a, b1, b2, beta=0.5, alpha=3.0),
                               torch.baddbmm(a, b1, b2, beta=0.5, alpha=3.0))
    nan = torch.full((3, 5), float("nan"))
    torch.testing.assert_close(composite.addbmm(nan, b1, b2, beta=0),
                               torch.addbmm(nan, b1, b2, beta=0))



class Warp(nn.Module):
    """A spatial transformer's learned affine map, expanded to the batch: the grid is
    paired with the samples in ``grid_sample``."""

    def __init__(self):
        super().__init__()
        self.theta = nn.Parameter(torch.eye(2, 3) + 0.1 * torch.randn(2, 3))
        self.conv = nn.Conv2d(B, 2, 3)
        self.head = nn.Linear(2 * 4 * 4, 3)

    def forward(self, x):  # (b, B, 6, 6)
        grid = F.affine_grid(self.theta.expand(x.shape[0], 2, 3), list(x.shape),
                             align_corners=False)
        return self.head(self.conv(F.grid_sample(x, grid, align_corners=False)).flatten(1))


class Chain(nn.Module):
    """Gates applied in place: ``h.mul_(g)`` then ``h.add_(1)`` (the value ``mul_``
    overwrote is kept for its rule), and a bilinear form ``x^T W x`` by ``einsum``."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(B, B)
        self.gate = nn.Parameter(torch.randn(B))
        self.form = nn.Parameter(torch.randn(B, B) * 0.3)

    def forward(self, x):  # (b, B)
        h = self.lin(x)
        h.mul_(self.gate)
        h.add_(1.0)
        return torch.tanh(h) + torch.einsum("bi,ij,bj->b", x, self.form, x)[:, None]


@pytest.mark.parametrize("model, shape", [(Warp, (B, B, 6, 6)), (Chain, (B, B))])
def test_grids_in_place_chains_and_forms_on_the_rules(model, shape):
    torch.manual_seed(0)
    net = model().double()
    out = 3 if model is Warp else B
    check(net, _inputs(*shape), _inputs(B, out), mse)


def test_spectral_norm_in_training_mode_is_captured():
    """Its power iteration reads the weight through a view made under ``no_grad`` (no
    gradient edge): the capture follows it, no internal error."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.utils.parametrizations.spectral_norm(nn.Linear(B, 5)), nn.Tanh(),
                        nn.Linear(5, 3)).double()
    x, y = _inputs(B, B), _inputs(B, 3)
    assert {r.path for r in persample.supported(net, x, y, mse)} == {"rule"}
    net.eval()
    check(net, x, y, mse)


class LearnedStates(nn.Module):
    """``nn.LSTM``/``nn.GRU`` from learned initial states expanded to the batch: the
    module rule gives the layer's weights, the kernel's own backward (one for the batch,
    each sequence its own column) the states' per-sample cotangents."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        layer = nn.LSTM if kind == "lstm" else nn.GRU
        self.rnn = layer(B, 6, num_layers=2, batch_first=True)
        self.h0 = nn.Parameter(torch.randn(2, 1, 6) * 0.5)
        self.c0 = nn.Parameter(torch.randn(2, 1, 6) * 0.5) if kind == "lstm" else None
        self.head = nn.Linear(6, 3)

    def forward(self, x):  # (b, B, B)
        h0 = self.h0.expand(2, x.shape[0], 6).contiguous()
        state = (h0, self.c0.expand(2, x.shape[0], 6).contiguous()) if self.c0 is not None \
            else h0
        out, _ = self.rnn(x, state)
        return self.head(out[:, -1])


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_recurrent_layers_from_learned_states(kind):
    torch.manual_seed(0)
    net = LearnedStates(kind).double()
    paths = {"rule", "module rule"}
    check(net, _inputs(B, B, B), _inputs(B, 3), mse, paths=paths)


class TwoSteps(nn.Module):
    """One ``nn.LSTM`` called twice (Set2Set's loop): first on zeros (no sample inside,
    its outputs made from its own parameters alone), then on each sample's input from the
    state of that first call. The second call's module rule gives the weights as that
    call reads them; the state carries the first call's share, pulled back through it."""

    def __init__(self, keep: str):
        super().__init__()
        self.keep = keep  # the first call's state kept whole, or only its h, or its c
        self.rnn = nn.LSTM(B, B, batch_first=True)
        self.head = nn.Linear(B, 3)

    def forward(self, x):  # (b, B)
        zeros = x.new_zeros(x.shape[0], 1, B)
        first, (h, c) = self.rnn(zeros)
        if self.keep == "h":
            c = torch.zeros_like(c)
        elif self.keep == "c":
            h = torch.zeros_like(h)
        out, _ = self.rnn(x.unsqueeze(1), (h, c))
        return self.head(out[:, 0] + first[:, 0])


@pytest.mark.parametrize("keep", ["both", "h", "c"])
def test_a_recurrent_layer_from_its_own_earlier_state(keep):
    torch.manual_seed(0)
    net = TwoSteps(keep).double()
    check(net, _inputs(B, B), _inputs(B, 3), mse, paths={"rule", "op vjp"})


class QueryPooling(nn.Module):
    """Learned queries, one set per head, expanded to the batch and attending over each
    sample's keys by ``F.scaled_dot_product_attention`` (timm's MAP head)."""

    def __init__(self):
        super().__init__()
        self.query = nn.Parameter(torch.randn(B, 2, 3))  # (heads, queries, width)
        self.kv = nn.Linear(B, 2 * B * 3)
        self.head = nn.Linear(B * 2 * 3, 3)

    def forward(self, x):  # (b, t, B)
        b, t, _ = x.shape
        k, v = self.kv(x).view(b, t, 2, B, 3).permute(2, 0, 3, 1, 4)  # 2 x (b, heads, t, 3)
        pooled = F.scaled_dot_product_attention(self.query.expand(b, -1, -1, -1), k, v)
        return self.head(pooled.flatten(1))


def test_a_learned_query_of_sdpa_on_the_rules():
    torch.manual_seed(0)
    check(QueryPooling().double(), _inputs(B, B + 1, B), _inputs(B, 3), mse)


class Written(nn.Module):
    """Parameters written in place into a shared tensor, then read with the samples:
    ``w[idx] = p``, ``index_put_``, ``masked_scatter_``, ``copy_`` of a whole tensor,
    and two writes into one tensor."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.p = nn.Parameter(torch.randn(3))
        self.q = nn.Parameter(torch.randn(B + 2 - 3)) if how in ("copy", "twice") else None
        self.register_buffer("buf", torch.zeros(B + 2))
        self.head = nn.Linear(B + 2, 3)

    def forward(self, x):  # (b, B + 2)
        w = self.buf.clone()
        if self.how == "setitem":
            w[:3] = self.p
        elif self.how == "index_put":
            w.index_put_((torch.tensor([0, 2, 4]),), self.p)
        elif self.how == "masked_scatter":
            w.masked_scatter_(torch.arange(B + 2) % 2 == 0, self.p)
        elif self.how == "copy":
            w.copy_(torch.cat([self.p, self.q]))
        else:  # "twice": the second write reads the first's result
            w[:3] = self.p
            w[3:] = self.q * w[:3].sum()
        return self.head(x * w)


@pytest.mark.parametrize("how", ["setitem", "index_put", "masked_scatter", "copy", "twice"])
def test_parameters_written_into_a_tensor_on_the_rules(how):
    """Written twice, the second write reads the first's result: the earlier value's
    cotangent goes to the first write. The first write's parameter there takes the
    fallback: its result is read through a view (``w[:3]``) that the second write then
    changes in place, and the op that made the view is taken for stale (``supported()``
    had said ``rule``, from the rules of the ops reading what both writes made)."""
    torch.manual_seed(0)
    net = Written(how).double()
    check(net, _inputs(B, B + 2), _inputs(B, 3), mse, paths={
        "p": "fallback", "q": "rule", "head.weight": "rule", "head.bias": "rule"}
        if how == "twice" else frozenset({"rule"}))


def test_a_write_read_through_another_alias_is_not_taken_for_the_op():
    """A view made before ``w[:3] = p`` and read after it, or a write into a view: the
    capture does not take the write's op for what is read; ``auto`` stays exact."""
    class Aliased(nn.Module):
        def __init__(self, into_view: bool):
            super().__init__()
            self.into_view = into_view
            self.p = nn.Parameter(torch.randn(3))
            self.head = nn.Linear(3, 3)

        def forward(self, x):  # (b, 3)
            w = torch.zeros(6, dtype=x.dtype)
            first = w[:3]
            if self.into_view:
                first.copy_(self.p)
            else:
                w[:3] = self.p
            return self.head(x * first)

    for into_view in (False, True):
        torch.manual_seed(0)
        net = Aliased(into_view).double()
        x, y = _inputs(B, 3), _inputs(B, 3)
        assert "rule" not in {r.path for r in persample.supported(net, x, y, mse)
                              if r.module == ""}
        torch.testing.assert_close(persample.per_sample_grads(net, x, y, mse)["p"],
                                   persample.loop_per_sample_grads(net, x, y, mse)["p"])


class RelativePositions(nn.Module):
    """VitDet's decomposed relative positions: queries with the samples merged with the
    heads in dim 0 (``(B * heads, H, W, C)``) against tables of a parameter looked up by
    position (``einsum("bhwc,hkc->bhwk")``); ``B`` = the heads = ``H``."""

    def __init__(self, heads: int = B, h: int = B, w: int = 3, c: int = 4):
        super().__init__()
        self.heads, self.h, self.w, self.c = heads, h, w, c
        self.q = nn.Linear(8, heads * c)
        self.rel_h = nn.Parameter(torch.randn(2 * h - 1, c))
        self.rel_w = nn.Parameter(torch.randn(2 * w - 1, c))
        self.head = nn.Linear(heads * h * w * (h + w), 3)

    def forward(self, x):  # (b, h, w, 8)
        b, h, w, c = x.shape[0], self.h, self.w, self.c
        q = self.q(x).reshape(b, h, w, self.heads, c).permute(0, 3, 1, 2, 4)
        q = q.reshape(b * self.heads, h, w, c)
        rh = self.rel_h[torch.arange(h)[:, None] - torch.arange(h)[None, :] + h - 1]
        rw = self.rel_w[torch.arange(w)[:, None] - torch.arange(w)[None, :] + w - 1]
        out = torch.cat([torch.einsum("bhwc,hkc->bhwk", q, rh),
                         torch.einsum("bhwc,wkc->bhwk", q, rw)], -1)
        return self.head(out.reshape(b, -1))


def test_an_einsum_with_the_samples_merged_with_the_heads_takes_its_rule():
    """The samples merged with other positions alike in the operands and the output: a
    sample's part of that letter holds its heads, in the same order in each (the per-op
    VJP before)."""
    torch.manual_seed(0)
    model = RelativePositions()
    x, y = torch.randn(B, B, 3, 8), torch.randint(0, 3, (B,))
    check(model, x, y, nn.CrossEntropyLoss(reduction="none"))
