"""Small but realistic architectures against the loop reference, in float64.

Each model is built from several layer families at once (rules, the per-module
``torch.func`` fallback, parameters read in the parent's forward, tied weights,
skip connections), so that the pieces are checked together: ``per_sample_grads``
with ``method="rules"`` and ``"auto"`` (which must not fall back to the loop),
``per_sample_grad_norms`` (flat and per layer), ``param_jacobian`` where the
model returns one tensor, and ``persample.dp.private_grad`` with no noise against
clipping the loop's per-sample gradients by hand.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from battery import TOL, assert_grads_equal, flat, rows
from persample import (
    loop_param_jacobian,
    loop_per_sample_grads,
    param_jacobian,
    per_sample_grad_norms,
    per_sample_grads,
)
from persample.dp import private_grad

# torch.func's vmap of CPU attention (the per-module fallback of nn.MultiheadAttention)
pytestmark = pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")

N = 3  # batch size
STABILITY = 1e-6  # private_grad's c_i = min(1, C / (||g_i|| + 1e-6))


# ---------------------------------------------------------------------------
# models


class ResBlock(nn.Module):
    """conv-GN-relu-conv-GN plus a shortcut (a strided 1x1 conv + GN when the shape changes)."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, padding=1, bias=False)
        self.gn1 = nn.GroupNorm(2, cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.gn2 = nn.GroupNorm(2, cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                          nn.GroupNorm(2, cout))

    def forward(self, x: Tensor) -> Tensor:
        h = F.relu(self.gn1(self.conv1(x)))
        h = self.gn2(self.conv2(h))
        return F.relu(h + self.shortcut(x))


class ResNet(nn.Module):
    def __init__(self, classes: int = 5):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.ReLU())
        self.layer1 = ResBlock(4, 4, 1)
        self.layer2 = ResBlock(4, 8, 2)
        self.fc = nn.Linear(8, classes)

    def forward(self, x: Tensor) -> Tensor:
        h = self.layer2(self.layer1(self.stem(x)))
        return self.fc(F.adaptive_avg_pool2d(h, 1).flatten(1))


class TransformerClassifier(nn.Module):
    """Token ids -> embedding * learnable scale, a class token, learnable positions,
    a 2-layer encoder, (masked) mean pooling plus the class token, a Linear head."""

    def __init__(self, vocab: int = 13, d: int = 8, seq: int = 5, classes: int = 3):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(0.1 * torch.randn(1, seq + 1, d))
        self.cls = nn.Parameter(torch.randn(1, 1, d))
        self.scale = nn.Parameter(torch.tensor(1.5))
        layer = nn.TransformerEncoderLayer(d, 2, dim_feedforward=16, dropout=0.0,
                                           batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(d, classes)

    def forward(self, ids: Tensor, padding_mask: Tensor | None = None) -> Tensor:
        b = ids.shape[0]
        h = self.emb(ids) * self.scale
        h = torch.cat([self.cls.expand(b, -1, -1), h], dim=1) + self.pos
        mask = None
        if padding_mask is not None:
            mask = torch.cat([padding_mask.new_zeros(b, 1), padding_mask], dim=1)
        h = self.encoder(h, src_key_padding_mask=mask)
        tokens = h[:, 1:]
        if padding_mask is None:
            pooled = tokens.mean(1)
        else:
            keep = (~padding_mask).to(h.dtype).unsqueeze(-1)
            pooled = (tokens * keep).sum(1) / keep.sum(1)
        return self.head(h[:, 0] + pooled)


class TiedLM(nn.Module):
    """Embedding shared with the output projection; logits ``(B, V, T)``.

    ``head="module"``: the tied ``nn.Linear`` is called; ``"functional"``:
    ``F.linear(h, self.emb.weight)`` in this forward; ``"both"``: the sum of the two.
    """

    def __init__(self, head: str, vocab: int = 11, d: int = 6):
        super().__init__()
        self.head = head
        self.emb = nn.Embedding(vocab, d)
        self.mix = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)
        self.out = nn.Linear(d, vocab, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, ids: Tensor) -> Tensor:
        h = self.norm(torch.tanh(self.mix(self.emb(ids))))
        logits = 0
        if self.head in ("module", "both"):
            logits = logits + self.out(h)
        if self.head in ("functional", "both"):
            logits = logits + F.linear(h, self.emb.weight)
        return logits.transpose(1, 2)


class UNet(nn.Module):
    """Conv down, ConvTranspose up, skip concatenation, GroupNorm; (B, 2, H, W) logits."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Conv2d(1, 4, 3, padding=1)
        self.gn_enc = nn.GroupNorm(2, 4)
        self.down = nn.Conv2d(4, 6, 3, stride=2, padding=1)
        self.gn_down = nn.GroupNorm(2, 6)
        self.mid = nn.Conv2d(6, 6, 3, padding=1)
        self.up = nn.ConvTranspose2d(6, 4, 2, stride=2)
        self.gn_up = nn.GroupNorm(2, 4)
        self.dec = nn.Conv2d(8, 4, 3, padding=1)
        self.out = nn.Conv2d(4, 2, 1)

    def forward(self, x: Tensor) -> Tensor:
        e = F.relu(self.gn_enc(self.enc(x)))  # (B, 4, H, W)
        d = F.relu(self.gn_down(self.down(e)))  # (B, 6, H/2, W/2)
        m = torch.tanh(self.mid(d))
        u = F.relu(self.gn_up(self.up(m)))  # (B, 4, H, W)
        return self.out(F.relu(self.dec(torch.cat([u, e], dim=1))))


class MaskedBranches(nn.Module):
    """Each sample takes one of two branches (``select``), so the other branch's
    parameters get no gradient from it; ``frozen`` has ``requires_grad=False``."""

    def __init__(self):
        super().__init__()
        self.frozen = nn.Linear(4, 5).requires_grad_(False)
        self.a = nn.Linear(5, 3)
        self.b = nn.Sequential(nn.Linear(5, 5), nn.Tanh(), nn.Linear(5, 3))
        self.gain_b = nn.Parameter(torch.randn(3))
        self.unused = nn.Linear(2, 2)

    def forward(self, x: Tensor, select: Tensor) -> Tensor:
        h = torch.tanh(self.frozen(x))
        return torch.where(select.unsqueeze(1), self.a(h), self.b(h) * self.gain_b)


# ---------------------------------------------------------------------------
# the cases


@dataclass
class Arch:
    model: nn.Module
    inputs: Any  # a tensor, or a tuple passed as model(*inputs)
    targets: Any
    loss_fn: Callable
    single_output: bool  # returns one tensor: param_jacobian applies

    @property
    def args(self) -> tuple:
        return self.inputs if isinstance(self.inputs, tuple) else (self.inputs,)


def _resnet() -> Arch:
    return Arch(ResNet(), torch.randn(N, 3, 8, 8), torch.randint(0, 5, (N,)),
                nn.CrossEntropyLoss(), True)


def _transformer(mask: bool) -> Arch:
    ids = torch.randint(0, 13, (N, 5))
    inputs: Any = ids
    if mask:
        padding = torch.zeros(N, 5, dtype=torch.bool)
        padding[0, 3:] = True  # sample 0 has 3 tokens, sample 1 has 4, sample 2 all 5
        padding[1, 4:] = True
        inputs = (ids, padding)
    return Arch(TransformerClassifier(), inputs, torch.randint(0, 3, (N,)),
                nn.CrossEntropyLoss(), True)


def _lm(head: str) -> Arch:
    tokens = torch.randint(0, 11, (N, 6))

    def token_ce(logits: Tensor, y: Tensor) -> Tensor:  # (B,): summed over tokens
        return F.cross_entropy(logits, y, reduction="none").sum(1)

    return Arch(TiedLM(head), tokens[:, :-1], tokens[:, 1:], token_ce, True)


def _unet() -> Arch:
    return Arch(UNet(), torch.randn(N, 1, 6, 6), torch.randint(0, 2, (N, 6, 6)),
                nn.CrossEntropyLoss(), True)


def _masked_branches() -> Arch:
    select = torch.tensor([True, False, True])
    return Arch(MaskedBranches(), (torch.randn(N, 4), select), torch.randn(N, 3),
                nn.MSELoss(), True)


BUILDERS = {
    "resnet-groupnorm": _resnet,
    "transformer": functools.partial(_transformer, False),
    "transformer-padding-mask": functools.partial(_transformer, True),
    "tied-lm-module": functools.partial(_lm, "module"),
    "tied-lm-functional": functools.partial(_lm, "functional"),
    "tied-lm-both": functools.partial(_lm, "both"),
    "unet": _unet,
    "masked-branches-frozen": _masked_branches,
}
ARCHS = list(BUILDERS)


@functools.cache
def built(name: str) -> tuple[Arch, dict[str, Tensor]]:
    """The architecture (fixed seed) and the loop's per-sample gradients, cached.

    Built under the float64 default dtype of conftest.py; the calls under test
    leave the model as it was, so one build serves every test.
    """
    torch.manual_seed(sum(map(ord, name)))
    arch = BUILDERS[name]()
    assert all(p.dtype == torch.float64 for p in arch.model.parameters())
    ref = loop_per_sample_grads(arch.model, arch.inputs, arch.targets, arch.loss_fn)
    return arch, ref


@functools.cache
def _loop_jacobian(name: str) -> dict[str, Tensor]:
    arch, _ = built(name)
    return loop_param_jacobian(arch.model, arch.inputs)


def no_fallback_warning(record: list) -> None:
    fell_back = [str(w.message) for w in record if "Falling back" in str(w.message)]
    assert not fell_back, fell_back


# ---------------------------------------------------------------------------
# per-sample gradients, norms, Jacobians


@pytest.mark.parametrize("method", ["rules", "auto"])
@pytest.mark.parametrize("name", ARCHS)
def test_per_sample_grads_match_the_loop(name, method):
    arch, ref = built(name)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        got = per_sample_grads(arch.model, arch.inputs, arch.targets, arch.loss_fn,
                               method=method)
    no_fallback_warning(record)
    assert_grads_equal(got, ref)
    assert all(g.dtype == torch.float64 for g in got.values())
    assert any(g.abs().max() > 1e-3 for g in got.values())  # not trivially zero


@pytest.mark.parametrize("name", ARCHS)
def test_flat_per_sample_grads_match_the_loop(name):
    arch, ref = built(name)
    got = per_sample_grads(arch.model, arch.inputs, arch.targets, arch.loss_fn,
                           method="rules", flat=True)
    want = flat(ref)
    torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("method", ["rules", "auto"])
@pytest.mark.parametrize("name", ARCHS)
def test_norms_match_the_loop(name, method):
    arch, ref = built(name)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        total, layers = per_sample_grad_norms(arch.model, arch.inputs, arch.targets,
                                              arch.loss_fn, method=method, per_layer=True)
        alone = per_sample_grad_norms(arch.model, arch.inputs, arch.targets, arch.loss_fn,
                                      method=method)
    no_fallback_warning(record)
    want = flat(ref).norm(dim=1)
    torch.testing.assert_close(total, want, **TOL)
    torch.testing.assert_close(alone, want, **TOL)
    assert list(layers) == list(ref)
    for pname, g in ref.items():
        torch.testing.assert_close(layers[pname], rows(g).norm(dim=1), **TOL,
                                   msg=lambda m, pname=pname: f"{pname}: {m}")


@pytest.mark.parametrize("method", ["rules", "auto"])
@pytest.mark.parametrize("name", [a for a in ARCHS if not a.startswith("tied-lm-")]
                         + ["tied-lm-both"])
def test_param_jacobian_matches_the_loop(name, method):
    arch, _ = built(name)
    assert arch.single_output
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        got = param_jacobian(arch.model, arch.inputs, method=method)
    no_fallback_warning(record)
    assert_grads_equal(got, _loop_jacobian(name))


# ---------------------------------------------------------------------------
# what the architectures are there to exercise


def test_masked_branch_rows_are_zero_and_frozen_parameters_left_out():
    arch, ref = built("masked-branches-frozen")
    got = per_sample_grads(arch.model, arch.inputs, arch.targets, arch.loss_fn, method="rules")
    assert not any(k.startswith("frozen.") for k in got)
    assert list(got) == ["gain_b", "a.weight", "a.bias", "b.0.weight", "b.0.bias",
                         "b.2.weight", "b.2.bias", "unused.weight", "unused.bias"]
    select = arch.inputs[1]
    for pname, g in got.items():
        branch_a = pname.startswith("a.")
        if pname.startswith("unused."):
            assert (g == 0).all(), pname
            continue
        idle = select if not branch_a else ~select  # samples that took the other branch
        assert (g[idle] == 0).all(), pname
        assert (rows(g[~idle]).abs().amax(1) > 0).all(), pname
    got_rows = per_sample_grads(arch.model, arch.inputs, arch.targets, arch.loss_fn, flat=True)
    assert got_rows.shape == (N, sum(p.numel() for p in arch.model.parameters() if p.requires_grad))
    assert_grads_equal(got, ref)
    assert all(p.grad is None for p in arch.model.parameters())


def test_transformer_padding_changes_the_gradients():
    """The mask reaches the attention: masked positions' embeddings get no gradient."""
    arch, ref = built("transformer-padding-mask")
    ids, padding = arch.inputs
    got = per_sample_grads(arch.model, arch.inputs, arch.targets, arch.loss_fn, method="rules")
    emb = got["emb.weight"]  # (B, vocab, d)
    for i in range(N):
        seen = set(ids[i][~padding[i]].tolist())
        only_padded = set(ids[i][padding[i]].tolist()) - seen
        for token in only_padded:
            assert (emb[i, token] == 0).all()
        for token in seen:
            assert emb[i, token].abs().max() > 0
    unmasked = per_sample_grads(arch.model, ids, arch.targets, arch.loss_fn, method="rules")
    assert not torch.allclose(unmasked["head.weight"][0], got["head.weight"][0])
    assert_grads_equal(got, ref)


def test_tied_lm_weight_is_one_parameter():
    """The tied weight is reported once (as ``emb.weight``), with all its uses summed."""
    for name in ("tied-lm-module", "tied-lm-functional", "tied-lm-both"):
        arch, ref = built(name)
        assert arch.model.out.weight is arch.model.emb.weight
        got = per_sample_grads(arch.model, arch.inputs, arch.targets, arch.loss_fn,
                               method="rules")
        assert list(got) == ["emb.weight", "mix.weight", "mix.bias", "norm.weight",
                             "norm.bias"]
    both = built("tied-lm-both")[1]["emb.weight"]
    module = built("tied-lm-module")[1]["emb.weight"]
    assert not torch.allclose(both, module)  # the variants are different functions


# ---------------------------------------------------------------------------
# DP-SGD step


def clip_by_hand(grads: dict[str, Tensor], c: float, per_layer: bool) -> dict[str, Tensor]:
    """``sum_i c_i g_i / B`` from the loop's per-sample gradients (private_grad's docstring)."""
    n = next(iter(grads.values())).shape[0]
    if per_layer:
        bound = c / math.sqrt(len(grads))
        factors = {k: (bound / (rows(g).norm(dim=1) + STABILITY)).clamp(max=1)
                   for k, g in grads.items()}
    else:
        norms = flat(grads).norm(dim=1)
        factors = dict.fromkeys(grads, (c / (norms + STABILITY)).clamp(max=1))
    return {k: torch.einsum("n,n...->...", factors[k], g) / n for k, g in grads.items()}


@pytest.mark.parametrize("per_layer", [False, True], ids=["flat", "per-layer"])
@pytest.mark.parametrize("name", ["resnet-groupnorm", "transformer",
                                  "transformer-padding-mask"])
def test_private_grad_matches_clipping_the_loop(name, per_layer):
    arch, ref = built(name)
    model = arch.model
    loop_norms = flat(ref).norm(dim=1)
    c = float(loop_norms.median())  # one sample clipped, one at the bound, one not
    if per_layer:
        c = float(torch.stack([rows(g).norm(dim=1) for g in ref.values()]).median()) \
            * math.sqrt(len(ref))
    want = clip_by_hand(ref, c, per_layer)
    unclipped = clip_by_hand(ref, 1e6, False)
    assert not all(torch.allclose(want[k], unclipped[k]) for k in want), "nothing clipped"
    try:
        _, norms = private_grad(model, arch.inputs, arch.targets, arch.loss_fn, max_grad_norm=c,
                             noise_multiplier=0.0, per_layer=per_layer)
        torch.testing.assert_close(norms, loop_norms, **TOL)
        for pname, p in model.named_parameters():
            torch.testing.assert_close(p.grad, want[pname], **TOL,
                                       msg=lambda m, pname=pname: f"{pname}: {m}")
    finally:
        for p in model.parameters():
            p.grad = None
