"""Training mode: per-sample gradients in the forward that ran, with the random numbers
it drew (dropout, attention dropout, stochastic depth, Gumbel noise, DropConnect).

Every case runs in float64 under a seed, against one batch forward under the same seed
(:func:`persample.reference.forward_per_sample_grads`: each sample's loss on its rows of
the output, one ``autograd.grad`` each), with every method: the rules, ``torch.func``
and the loop replay the same draws. ``B`` equals another dim of each model (features,
sequence, heads, channels) so that no size tells where the batch is.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import persample
from battery import METHODS, assert_exact, check, flat
from persample.draws import DrawNotReplayable
from persample.reference import forward_per_sample_grads

B = 4  # = features, sequence length, heads and channels below


class DropMLP(nn.Module):
    def __init__(self, drop: nn.Module):
        super().__init__()
        self.a, self.drop, self.b = nn.Linear(4, 4), drop, nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:  # (in place: the linear map keeps no output)
        return self.b(torch.tanh(self.drop(self.a(x))))


class Encoder(nn.Module):
    """The stock encoder, its default dropout 0.1 (attention and both residual paths)."""

    def __init__(self, norm_first: bool = False):
        super().__init__()
        layer = nn.TransformerEncoderLayer(16, 4, 32, batch_first=True, norm_first=norm_first)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(16, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.enc(x).mean(1))


class Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.dec = nn.TransformerDecoderLayer(16, 4, 32, dropout=0.2, batch_first=True)
        self.head = nn.Linear(16, 3)

    def forward(self, x: Tensor) -> Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], dtype=x.dtype)
        return self.head(self.dec(x, x.flip(1), tgt_mask=mask).mean(1))


class Weights(nn.Module):
    """``nn.MultiheadAttention`` returning its weights (after dropout, per head)."""

    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(16, 4, dropout=0.3, batch_first=True)
        self.head = nn.Linear(16, 3)

    def forward(self, x: Tensor) -> Tensor:
        out, w = self.attn(x, x, x, need_weights=True, average_attn_weights=False)
        return self.head(out.mean(1)) + w.sum((1, 2))[:, :3]


class DropConnect(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        w = F.dropout(self.a.weight, 0.4, self.training)
        return self.b(torch.tanh(F.linear(x, w, self.a.bias)))


class Gumbel(nn.Module):
    """Architecture logits sampled by ``gumbel_softmax`` (DARTS/SNAS), per op."""

    def __init__(self, hard: bool):
        super().__init__()
        self.alpha = nn.Parameter(torch.randn(4))
        self.ops = nn.ModuleList(nn.Linear(4, 3) for _ in range(4))
        self.hard = hard

    def forward(self, x: Tensor) -> Tensor:
        w = F.gumbel_softmax(self.alpha, tau=0.7, hard=self.hard)
        return sum(wi * op(x) for wi, op in zip(w, self.ops))


class BiasAttention(nn.Module):
    """A learned additive attention bias given to SDPA with attention dropout (BEiT)."""

    def __init__(self):
        super().__init__()
        self.qkv, self.out = nn.Linear(8, 24), nn.Linear(8, 3)
        self.bias = nn.Parameter(0.5 * torch.randn(4, 4, 4))  # (heads, T, T)

    def forward(self, x: Tensor) -> Tensor:
        n, t, _ = x.shape
        q, k, v = self.qkv(x).view(n, t, 3, 4, 2).permute(2, 0, 3, 1, 4)  # (n, h, t, 2)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=self.bias, dropout_p=0.3)
        return self.out(o.transpose(1, 2).reshape(n, t, 8).mean(1))


def drop_path(x: Tensor, p: float, training: bool) -> Tensor:
    """Stochastic depth as timm writes it: one draw per sample, ``(B, 1, 1, 1)``."""
    if p == 0.0 or not training:
        return x
    shape = (x.shape[0],) + (1,) * (x.ndim - 1)
    return x * x.new_empty(shape).bernoulli_(1 - p).div_(1 - p)


def stochastic_depth(x: Tensor, p: float) -> Tensor:
    """torchvision's ``ops.stochastic_depth(mode="row")``."""
    size = [x.shape[0]] + [1] * (x.ndim - 1)
    noise = torch.empty(size, dtype=x.dtype, device=x.device).bernoulli_(1 - p)
    return x * noise.div_(1 - p)


class Residual(nn.Module):
    def __init__(self, timm: bool):
        super().__init__()
        self.conv, self.block, self.head = nn.Conv2d(2, 4, 3, padding=1), nn.Conv2d(4, 4, 1), \
            nn.Linear(4, 3)
        self.timm = timm

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.conv(x))  # (B, 4, 4, 4): channels and sides equal to B
        r = self.block(h)
        h = h + (drop_path(r, 0.5, self.training) if self.timm else stochastic_depth(r, 0.5))
        return self.head(h.mean((2, 3)))


class Dropout2d(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.drop, self.head = nn.Conv2d(2, 4, 3, padding=1), nn.Dropout2d(0.5), \
            nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.drop(torch.tanh(self.conv(x))).mean((2, 3)))


class RandMask(nn.Module):
    """Dropout written by hand with ``rand_like``, in place."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.a(x))
        keep = torch.rand_like(h) > 0.4
        return self.b(h * keep / 0.6)


def _tokens(width: int = 16) -> Tensor:
    return torch.randn(B, 4, width)  # (B, T = B, width)


CASES = {
    "dropout": (lambda: DropMLP(nn.Dropout(0.5)), lambda: torch.randn(B, 4)),
    "dropout-inplace": (lambda: DropMLP(nn.Dropout(0.5, inplace=True)), lambda: torch.randn(B, 4)),
    "alpha-dropout": (lambda: DropMLP(nn.AlphaDropout(0.3)), lambda: torch.randn(B, 4)),
    "feature-alpha-dropout": (lambda: DropMLP(nn.FeatureAlphaDropout(0.3)),
                              lambda: torch.randn(B, 4)),
    "encoder": (Encoder, _tokens),
    "encoder-norm-first": (lambda: Encoder(norm_first=True), _tokens),
    "decoder": (Decoder, _tokens),
    "mha-weights": (Weights, _tokens),
    "dropconnect": (DropConnect, lambda: torch.randn(B, 4)),
    "gumbel": (lambda: Gumbel(hard=False), lambda: torch.randn(B, 4)),
    "gumbel-hard": (lambda: Gumbel(hard=True), lambda: torch.randn(B, 4)),
    "sdpa-bias": (BiasAttention, lambda: _tokens(8)),
    "drop-path-timm": (lambda: Residual(timm=True), lambda: torch.randn(B, 2, 4, 4)),
    "stochastic-depth-torchvision": (lambda: Residual(timm=False),
                                     lambda: torch.randn(B, 2, 4, 4)),
    "dropout2d": (Dropout2d, lambda: torch.randn(B, 2, 4, 4)),
    "rand-mask": (RandMask, lambda: torch.randn(B, 4)),
}


def _case(name: str) -> tuple[nn.Module, Tensor, Tensor]:
    torch.manual_seed(0)
    build, inputs = CASES[name]
    model = build().double().train()
    return model, inputs().double(), torch.randint(0, 3, (B,))


# torch.func cannot fill a tensor made for every sample (``torch.empty(size)``, no batch
# under vmap) with one sample's numbers: method="vmap" refuses, naming the op
VMAP_REFUSES = {"stochastic-depth-torchvision"}


@pytest.mark.parametrize("name", CASES)
def test_every_method_gives_the_forward_that_ran(name):
    model, x, y = _case(name)
    methods = [m for m in METHODS if m != "vmap" or name not in VMAP_REFUSES]
    check(model, x, y, nn.CrossEntropyLoss(), methods=methods, seed=7, jacobian=True)
    if name in VMAP_REFUSES:
        with pytest.raises(DrawNotReplayable, match="bernoulli_"):
            persample.per_sample_grads(model, x, y, nn.CrossEntropyLoss(), method="vmap")


@pytest.mark.parametrize("name", ["encoder", "drop-path-timm", "gumbel"])
def test_the_rows_sum_to_the_batch_gradient_of_the_forward_that_ran(name):
    model, x, y = _case(name)
    torch.manual_seed(3)
    g = persample.per_sample_grads(model, x, y, nn.CrossEntropyLoss(reduction="sum"))
    torch.manual_seed(3)
    loss = F.cross_entropy(model(x), y, reduction="sum")
    batch = torch.autograd.grad(loss, [p for p in model.parameters()])
    assert_exact({k: v.sum(0) for k, v in g.items()},
                 dict(zip(g, batch)))


def test_another_seed_gives_other_masks_and_the_loop_agrees():
    """The draws matter (another seed, another answer), and the loop replays them."""
    model, x, y = _case("encoder")
    loss = nn.CrossEntropyLoss()
    got = {}
    for seed in (1, 2):
        for method in ("rules", "loop"):
            torch.manual_seed(seed)
            got[seed, method] = flat(persample.per_sample_grads(model, x, y, loss,
                                                                method=method))
    assert torch.allclose(got[1, "rules"], got[1, "loop"], rtol=1e-9, atol=1e-12)
    assert torch.allclose(got[2, "rules"], got[2, "loop"], rtol=1e-9, atol=1e-12)
    assert not torch.allclose(got[1, "rules"], got[2, "rules"])


def test_the_generator_ends_where_a_plain_forward_leaves_it():
    """A call draws what one plain forward draws, whatever method answers."""
    model, x, y = _case("encoder")
    torch.manual_seed(5)
    model(x)
    after = torch.rand(3)
    for method in METHODS:
        torch.manual_seed(5)
        persample.per_sample_grads(model, x, y, nn.CrossEntropyLoss(), method=method)
        assert torch.equal(torch.rand(3), after), method
    torch.manual_seed(5)  # a diagnosis draws nothing of the caller's stream
    persample.supported(model, x, y, nn.CrossEntropyLoss())
    model(x)
    assert torch.equal(torch.rand(3), after)


def test_the_stock_encoder_in_training_mode_takes_the_rules():
    model, x, y = _case("encoder")
    routes = persample.supported(model, x, y, nn.CrossEntropyLoss())
    assert {r.path for r in routes} == {"rule"}


def test_a_draw_whose_shape_hides_the_batch_is_refused_by_the_loop():
    """A mask drawn for ``(B * T,)`` positions flattened: a sample alone draws ``(T,)``,
    and nothing says which ``T`` of the batch's are its own: the loop refuses, naming
    the op, rather than replay other numbers."""

    class Flat(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 3)

        def forward(self, x: Tensor) -> Tensor:
            h = self.a(x)  # (B, T, 3)
            keep = torch.rand(h.shape[0] * h.shape[1]) > 0.5
            return (h * keep.view(h.shape[0], h.shape[1], 1)).sum(1)

    model = Flat().double()
    x, y = torch.randn(B, 4, 4).double(), torch.randint(0, 3, (B,))
    torch.manual_seed(0)
    want = forward_per_sample_grads(model, x, y, nn.CrossEntropyLoss())
    torch.manual_seed(0)
    got = persample.per_sample_grads(model, x, y, nn.CrossEntropyLoss(), method="rules")
    assert_exact(got, want)  # the rules need no replay here
    with pytest.raises(DrawNotReplayable, match="rand"):
        persample.per_sample_grads(model, x, y, nn.CrossEntropyLoss(), method="loop")


def nt_xent(z: Tensor, _targets: Any = None, temperature: float = 0.5) -> Tensor:
    """SimCLR's contrastive loss over the batch: sample ``i``'s positive is ``i ^ 1``."""
    z = F.normalize(z, dim=1)
    sim = z @ z.t() / temperature  # (B, B): every pair of samples
    sim = sim.masked_fill(torch.eye(len(z), dtype=torch.bool), float("-inf"))
    positives = torch.arange(len(z)) ^ 1
    return F.cross_entropy(sim, positives)


def centred(out: Tensor, targets: Tensor) -> Tensor:
    """A loss on outputs centred over the batch."""
    return ((out - out.mean(0)) - targets).pow(2).sum()


@pytest.mark.parametrize("loss_fn", [nt_xent, centred])
@pytest.mark.parametrize("method", METHODS)
def test_a_loss_that_mixes_samples_is_refused_by_every_method(loss_fn, method):
    torch.manual_seed(0)
    model = nn.Linear(4, 4).double()
    x, y = torch.randn(B, 4).double(), torch.randn(B, 4).double()
    with pytest.raises(persample.LossNotPerSampleError, match="mixes samples: .*matmul|mean"):
        persample.per_sample_grads(model, x, y, loss_fn, method=method)


@pytest.mark.parametrize("name", ["dropout", "encoder", "drop-path-timm"])
def test_verify_passes_in_training_mode_and_names_the_random_ops(name):
    model, x, y = _case(name)
    report = persample.verify(model, x, y, nn.CrossEntropyLoss())
    assert report.ok, str(report)
    assert report.random_ops and "random ops: " in str(report)
    if name == "dropout":
        assert report.random_ops == ["dropout in module 'drop' (Dropout)"]


def test_verify_of_a_model_that_draws_nothing_names_no_random_op():
    model, x, y = _case("dropout")
    report = persample.verify(model.eval(), x, y, nn.CrossEntropyLoss())
    assert report.ok and report.random_ops == [] and "random ops" not in str(report)


def test_a_loss_on_an_output_the_model_mixed_is_the_models_matter():
    """The model mixes samples (a batch mean inside it): the rules refuse naming the
    model's output, not the loss (whose own ops, a transpose and a cross-entropy of
    per-sample terms, do not mix samples); ``auto`` refuses too, and the loop answers by
    its definition when asked for."""

    class Centred(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 12)

        def forward(self, x: Tensor) -> Tensor:
            h = self.a(x)
            return (h - h.mean(0)).view(len(x), 4, 3)  # (B, T, V)

    def loss_fn(logits: Tensor, labels: Tensor) -> Tensor:
        return F.cross_entropy(logits.transpose(1, 2), labels, reduction="none").mean(1)

    torch.manual_seed(0)
    model = Centred().double()
    x, y = torch.randn(B, 4).double(), torch.randint(0, 3, (B, 4))
    with pytest.warns(UserWarning, match="output, in which the samples are mixed"):
        with pytest.raises(persample.CertificateError, match="samples mixed|mixes samples"):
            persample.per_sample_grads(model, x, y, loss_fn)  # (T == B: either refusal)
    got = persample.per_sample_grads(model, x, y, loss_fn, method="loop")
    assert_exact(got, persample.loop_per_sample_grads(model, x, y, loss_fn))


def test_in_place_dropout_whose_output_is_dropped_is_replayed_in_place():
    """``F.dropout(h, 0.5, True, True)``, its output ignored: only ``h`` changed in place
    carries the mask, so the loop and torch.func must replay it in place too."""

    class InPlace(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 3)

        def forward(self, x: Tensor) -> Tensor:
            h = self.a(x)
            F.dropout(h, 0.5, True, True)  # its output ignored: h itself is dropped
            return self.b(torch.tanh(h))

    torch.manual_seed(0)
    model = InPlace().double()
    x, y = torch.randn(B, 4).double(), torch.randint(0, 3, (B,))
    check(model, x, y, nn.CrossEntropyLoss(), methods=METHODS, seed=3)
