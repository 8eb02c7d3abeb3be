"""DP book-keeping's weighted-sum rules (one GEMM per linear map, no autograd call) give
the same clipped sums as the op's own backward and as clipping the loop's gradients;
the noise drawn in parallel chunks is N(0, std^2), reproducible, independent."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cases import clipped_mean
from persample import loop_per_sample_grads
from persample.dp import private_grad
from persample.dp.noise import PARALLEL_MIN, gaussian_like
from persample.engine import weighted

B = T = 4  # sizes chosen to coincide
E = 16  # wide enough for ghost norms over 4 positions (2T(i+o) < T i o)


class SequenceLinear(nn.Module):
    """A Linear over positions, sequence-first in the middle, and a head."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(E, E)
        self.head = nn.Linear(T * E, 3)

    def forward(self, x: Tensor) -> Tensor:  # (B, T, E)
        h = torch.tanh(self.fc(x.transpose(0, 1))).transpose(0, 1)  # via (T, B, E)
        return self.head(h.flatten(1))


class ScaledAddmm(nn.Module):
    """GPT-2's Conv1D form over merged rows, with beta and alpha not 1."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(E, E) / 2)
        self.bias = nn.Parameter(torch.randn(E))
        self.head = nn.Linear(T * E, 3)

    def forward(self, x: Tensor) -> Tensor:
        n, t, e = x.shape
        rows = torch.addmm(self.bias, x.reshape(-1, e), self.weight, beta=0.5, alpha=2.0)
        return self.head(torch.tanh(rows).view(n, t * e))


class SmallConvs(nn.Module):
    """Convolutions whose outputs have few positions (ghost norms and the summed
    backward) and one with many (materialised), a strided one with "same"-shared padding."""

    def __init__(self):
        super().__init__()
        self.wide = nn.Conv2d(2, 8, 3, padding=1)  # 4x4 -> 4x4: 16 positions, materialised
        self.down = nn.Conv2d(8, 16, 3, stride=2, padding=1)  # -> 2x2: 4 positions
        self.last = nn.Conv2d(16, 32, 2)  # -> 1x1
        self.head = nn.Linear(32, 3)

    def forward(self, x: Tensor) -> Tensor:  # (B, 2, 4, 4)
        h = torch.tanh(self.down(torch.tanh(self.wide(x))))
        return self.head(torch.tanh(self.last(h)).flatten(1))


class Lookups(nn.Module):
    """Ops with ghost norms but no weighted-sum rule (their clipped sums replay the op):
    an embedding over positions, a bag of embeddings and a bilinear map."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, E, padding_idx=0)
        self.bag = nn.EmbeddingBag(10, E, mode="mean")
        self.bilinear = nn.Bilinear(E, E, 3)

    def forward(self, ids: Tensor) -> Tensor:  # (B, T) ids
        h = torch.tanh(self.emb(ids)).sum(1)  # (B, E)
        return self.bilinear(h, self.bag(ids))


def _clipped_by_hand(model, x, y, loss_fn, c: float) -> dict[str, Tensor]:
    return clipped_mean(loop_per_sample_grads(model, x, y, loss_fn), c)[1]


@pytest.mark.parametrize("make", [SequenceLinear, ScaledAddmm, SmallConvs, Lookups])
@pytest.mark.parametrize("weighted_sums", [True, False], ids=["sum-rules", "local-backward"])
def test_clipped_sums_match_the_loop(make, weighted_sums, monkeypatch):
    used = []
    if weighted_sums:
        found = weighted.op_sum_rule
        monkeypatch.setattr(weighted, "op_sum_rule", lambda op: used.append(op.func) or found(op))
    else:  # every op through its own autograd node instead
        monkeypatch.setattr(weighted, "op_sum_rule", lambda op: None)
    torch.manual_seed(0)
    model = make()
    x = {SmallConvs: torch.randn(B, 2, 4, 4), Lookups: torch.randint(0, 10, (B, T))}.get(
        make, torch.randn(B, T, E))
    y = torch.randint(0, 3, (B,))
    loss_fn = nn.CrossEntropyLoss()
    want = _clipped_by_hand(model, x, y, loss_fn, c=0.05)  # clips every sample
    private_grad(model, x, y, loss_fn, max_grad_norm=0.05, noise_multiplier=0.0)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[name], rtol=1e-10, atol=1e-13)
    if weighted_sums:  # the wide map took its sum rule
        want_rule = {ScaledAddmm: "addmm", SmallConvs: "conv2d", Lookups: "bilinear"
                     }.get(make, "linear")
        assert want_rule in {getattr(f, "__name__", "") for f in used}


def test_parallel_noise_is_gaussian_reproducible_and_chunks_independent():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        params = [nn.Parameter(torch.zeros(PARALLEL_MIN // 2 + 3)),
                  nn.Parameter(torch.zeros(3, PARALLEL_MIN // 6 + 1))]
        a = gaussian_like(params, 0.7, torch.Generator().manual_seed(3))
        b = gaussian_like(params, 0.7, torch.Generator().manual_seed(3))
        c = gaussian_like(params, 0.7, torch.Generator().manual_seed(4))
    finally:
        torch.set_num_threads(threads)
    assert [t.shape for t in a] == [p.shape for p in params]
    assert all(torch.equal(u, v) for u, v in zip(a, b))
    assert not any(torch.equal(u, v) for u, v in zip(a, c))
    z = torch.cat([t.flatten() for t in a]) / 0.7  # about 1.05 M draws
    assert abs(float(z.mean())) < 5 / math.sqrt(z.numel())
    assert abs(float(z.std()) - 1) < 0.005
    half = z.numel() // 2  # the two chunks are not copies or shifts of one another
    first, second = z[:half], z[half : 2 * half]
    assert abs(float(torch.corrcoef(torch.stack([first, second]))[0, 1])) < 0.01


def test_conv_ghost_norms_match_the_loop(patch_spec):
    from persample import per_sample_grad_norms
    from persample.rules import Decline, conv

    calls = []
    found = conv.conv_norm

    def counted(call, g, wanted):
        try:
            got = found(call, g, wanted)
        except Decline:
            calls.append(False)
            raise
        calls.append(True)
        return got

    torch.manual_seed(0)
    model = SmallConvs()
    x, y = torch.randn(B, 2, 4, 4), torch.randint(0, 3, (B,))
    patch_spec(F.conv2d, norm=counted)
    norms = per_sample_grad_norms(model, x, y, nn.CrossEntropyLoss())
    grads = loop_per_sample_grads(model, x, y, nn.CrossEntropyLoss())
    want = torch.cat([g.flatten(1) for g in grads.values()], 1).norm(dim=1)
    torch.testing.assert_close(norms, want, rtol=1e-10, atol=1e-13)
    assert calls.count(True) == 2 and calls.count(False) == 1  # down, last ghosted; wide not


class Gain(nn.Module):
    """``y = x * w`` with a module rule and a module norm rule registered by the test."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(E))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.w


class GainNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.gain, self.head = nn.Linear(E, E), Gain(), nn.Linear(E, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.gain(torch.tanh(self.fc(x)))))


def test_a_module_norm_rule_gets_its_clipped_sum(monkeypatch):
    """The parameters normed by a user's module norm rule get their clipped sum from the
    module's own backward (not zeros)."""
    from persample import rules

    monkeypatch.setattr(rules.spec, "MODULE_SPECS", dict(rules.spec.MODULE_SPECS))
    normed = []

    @rules.register_rule(Gain)
    def gain(layer, activations, backprops, out):  # backprops (n, v, E)
        torch.mul(backprops, activations[0].unsqueeze(1), out=out["w"])

    @rules.register_norm_rule(Gain)
    def gain_norm(layer, activations, backprops, names):
        normed.append(names)
        return {"w": (backprops[:, 0] * activations[0]).square().sum(1)}

    torch.manual_seed(0)
    model = GainNet()
    x, y = torch.randn(B, E), torch.randint(0, 3, (B,))
    loss_fn = nn.CrossEntropyLoss()
    want = _clipped_by_hand(model, x, y, loss_fn, c=0.05)
    private_grad(model, x, y, loss_fn, max_grad_norm=0.05, noise_multiplier=0.0)
    assert normed == [{"w"}]
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[name], rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("make", [SequenceLinear, ScaledAddmm, SmallConvs])
@pytest.mark.parametrize("declines", [False, True], ids=["one-call", "declines-together"])
def test_an_ops_parameters_are_summed_by_one_call_of_its_rule(make, declines, monkeypatch):
    """Flat clipping gives a weight and its bias one tensor of factors: one call of the
    op's sum rule adds both. A rule that declines the pair (having added nothing) is
    asked for each alone, and the sums still match the loop."""
    asked = []
    found = weighted.op_sum_rule

    def counting(op):
        rule = found(op)
        if rule is None:
            return None

        def counted(n, dtype, g, c, into):
            asked.append(len(into))
            if declines and len(into) > 1:
                return False
            return rule(n, dtype, g, c, into)
        return counted

    monkeypatch.setattr(weighted, "op_sum_rule", counting)
    torch.manual_seed(0)
    model = make()
    x = torch.randn(B, 2, 4, 4) if make is SmallConvs else torch.randn(B, T, E)
    y = torch.randint(0, 3, (B,))
    loss_fn = nn.CrossEntropyLoss()
    want = _clipped_by_hand(model, x, y, loss_fn, c=0.05)
    private_grad(model, x, y, loss_fn, max_grad_norm=0.05, noise_multiplier=0.0)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[name], rtol=1e-10, atol=1e-13)
    assert 2 in asked  # (a weight and its bias asked for together)
    if declines:  # (then each alone)
        assert asked.count(1) >= 2 * asked.count(2)
    else:
        assert 1 not in asked


def test_layerwise_factors_sum_each_parameter_alone(monkeypatch):
    asked = []
    found = weighted.op_sum_rule
    monkeypatch.setattr(weighted, "op_sum_rule", lambda op: (lambda rule: None if rule is None
                        else (lambda n, dtype, g, c, into: asked.append(len(into))
                              or rule(n, dtype, g, c, into)))(found(op)))
    torch.manual_seed(0)
    model = SequenceLinear()
    x, y = torch.randn(B, T, E), torch.randint(0, 3, (B,))
    private_grad(model, x, y, nn.CrossEntropyLoss(), max_grad_norm=0.05, per_layer=True,
                 noise_multiplier=0.0)
    assert asked and set(asked) == {1}  # (each parameter its own factors)
