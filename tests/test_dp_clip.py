"""``persample.dp.private_grad`` against clipping the loop's per-sample gradients by hand.

With ``noise_multiplier=0`` the result is exactly ``sum_i c_i g_i / B`` with
``c_i = min(1, C / (||g_i|| + 1e-6))`` (flat), or each parameter clipped to
``C / sqrt(K)`` (per layer); with noise, its statistics over many draws from a
fixed generator. Bad input raises and leaves the model and every ``p.grad`` as
they were.
"""

from __future__ import annotations

import math
from collections import OrderedDict

import pytest
import torch
from torch import Tensor, nn

from battery import REDUCTIONS, TOL
from battery import norms_of as flat_norms
from cases import BY_ID, OpaqueGate, TiedLM, build, randn
from persample import loop_per_sample_grads
from persample.dp import microbatch, private_grad
from persample.errors import NeedsWholeModel

STABILITY = 1e-6
DP_CASES = [
    "linear-2d", "linear-seq", "mlp", "mlp-persample-ce", "conv1d-groups2", "conv2d",
    "conv2d-relu-linear-ce", "simple-cnn", "embedding-2d-ids",
    "embedding-repeated-ids-padding-idx", "embedding-linear-ce", "layernorm-last-dim",
    "groupnorm-2d-groups2", "custom-scale", "parent-param-and-children", "batchnorm-eval",
    "multihead-attention", "transformer-encoder-layer", "tied-embedding-output",
    "linear-called-twice", "conv-called-twice", "tied-rule-and-fallback",
    "param-used-inside-and-outside-its-module", "frozen-params", "unused-params", "two-inputs",
]
N = 4


def trainable(model: nn.Module) -> dict[str, nn.Parameter]:
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def clip_by_hand(grads: dict[str, Tensor], c: float, per_layer: bool,
                 divisor: float) -> dict[str, Tensor]:
    """``sum_i c_i g_i / divisor`` from the loop's per-sample gradients ``{name: (B, ...)}``."""
    if per_layer:
        bound = c / math.sqrt(len(grads))
        factors = {name: (bound / (g.flatten(1).norm(dim=1) + STABILITY)).clamp(max=1)
                   for name, g in grads.items()}
    else:
        f = (c / (flat_norms(grads) + STABILITY)).clamp(max=1)
        factors = dict.fromkeys(grads, f)
    return {name: torch.einsum("n,n...->...", factors[name], g) / divisor
            for name, g in grads.items()}


def setup(case_id: str, n: int = N, reduction: str = "mean"):
    c = BY_ID[case_id]
    model, inputs, targets = build(c, n)
    loss_fn = c["loss_fn"](reduction)
    return model, inputs, targets, loss_fn, loop_per_sample_grads(model, inputs, targets, loss_fn)


def grads_of(model: nn.Module) -> dict[str, Tensor | None]:
    return {name: p.grad for name, p in trainable(model).items()}


def assert_grads(model: nn.Module, want: dict[str, Tensor], **tol) -> None:
    got = grads_of(model)
    assert list(got) == list(want)
    for name, g in want.items():
        assert got[name] is not None, f"{name}: no .grad"
        assert got[name].shape == g.shape and got[name].dtype == g.dtype
        torch.testing.assert_close(got[name], g, **(tol or TOL),
                                   msg=lambda m, name=name: f"{name}: {m}")


def regime_norm(norms: Tensor, regime: str) -> float:
    """A clipping norm below every sample's norm, above all of them, or in between."""
    return {"all-clipped": 0.1 * float(norms[norms > 0].min()),
            "none-clipped": 10.0 * float(norms.max()),
            "some-clipped": float(norms.median())}[regime]


# ---------------------------------------------------------------------------
# noise 0: against clipping by hand


@pytest.mark.parametrize("per_layer", [False, True], ids=["flat", "per-layer"])
@pytest.mark.parametrize("regime", ["all-clipped", "some-clipped", "none-clipped"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("case_id", DP_CASES)
def test_matches_clipping_by_hand(case_id, reduction, regime, per_layer):
    model, inputs, targets, loss_fn, g = setup(case_id, reduction=reduction)
    norms = flat_norms(g)
    assert (norms > 0).all() and len(set(norms.tolist())) == N  # the reference is not trivial
    c = regime_norm(norms, regime)
    losses = torch.full((N,), math.nan, dtype=torch.float64)  # the loop's, sample by sample
    loop_per_sample_grads(model, inputs, targets, loss_fn, losses=losses)
    got = private_grad(model, inputs, targets, loss_fn, max_grad_norm=c, noise_multiplier=0.0,
                       per_layer=per_layer)
    torch.testing.assert_close(got.norms, norms, **TOL)
    assert got.losses.shape == (N,) and not got.losses.requires_grad
    torch.testing.assert_close(got.losses.double(), losses, **TOL)
    assert_grads(model, clip_by_hand(g, c, per_layer, N))


@pytest.mark.parametrize("per_layer", [False, True], ids=["flat", "per-layer"])
@pytest.mark.parametrize("case_id", DP_CASES)
def test_large_norm_gives_the_mean_gradient(case_id, per_layer):
    """No sample is clipped: ``p.grad`` is the mean of the per-sample gradients."""
    model, inputs, targets, loss_fn, g = setup(case_id)
    c = 1e3 * float(flat_norms(g).max())
    private_grad(model, inputs, targets, loss_fn, max_grad_norm=c, noise_multiplier=0.0,
                 per_layer=per_layer)
    assert_grads(model, {name: gi.mean(0) for name, gi in g.items()}, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("per_layer", [False, True], ids=["flat", "per-layer"])
@pytest.mark.parametrize("case_id", DP_CASES)
def test_clipped_mean_has_norm_at_most_c(case_id, per_layer):
    """Each clipped contribution has norm <= C, so their mean has norm <= C (per layer too)."""
    model, inputs, targets, loss_fn, g = setup(case_id)
    c = 0.05 * float(flat_norms(g).min())
    private_grad(model, inputs, targets, loss_fn, max_grad_norm=c, noise_multiplier=0.0,
                 per_layer=per_layer)
    grads = list(grads_of(model).values())
    total = torch.cat([p.flatten() for p in grads]).norm()
    assert 0 < total <= c
    if per_layer:
        bound = c / math.sqrt(len(grads))
        assert all(p.norm() <= bound * (1 + 1e-12) for p in grads)


@pytest.mark.parametrize("per_layer", [False, True], ids=["flat", "per-layer"])
@pytest.mark.parametrize("case_id", ["mlp", "simple-cnn", "tied-embedding-output",
                                     "embedding-2d-ids", "custom-scale"])
def test_one_sample_clipped_to_exactly_c(case_id, per_layer):
    """B = 1 and small C: ``p.grad`` is the sample's gradient rescaled to norm C (C/sqrt(K)
    per parameter), and points the same way."""
    model, inputs, targets, loss_fn, g = setup(case_id, n=1)
    c = 1e-3 * float(flat_norms(g)[0])
    got = private_grad(model, inputs, targets, loss_fn, max_grad_norm=c, noise_multiplier=0.0,
                       per_layer=per_layer)
    torch.testing.assert_close(got.norms, flat_norms(g), **TOL)
    losses = torch.full((1,), math.nan, dtype=torch.float64)
    loop_per_sample_grads(model, inputs, targets, loss_fn, losses=losses)
    torch.testing.assert_close(got.losses.double(), losses, **TOL)  # a batch of one
    grads = grads_of(model)
    if per_layer:
        bound = c / math.sqrt(len(grads))
        for name, p in grads.items():
            n_k = g[name].norm()
            want = torch.minimum(n_k, bound * n_k / (n_k + STABILITY))
            assert want <= bound
            torch.testing.assert_close(p.norm(), want, rtol=1e-10, atol=1e-15)
        assert (torch.stack([p.norm() for p in grads.values()]) > 0.99 * bound).any()
    else:
        total = torch.cat([p.flatten() for p in grads.values()]).norm()
        n_1 = flat_norms(g)[0]
        torch.testing.assert_close(total, c * n_1 / (n_1 + STABILITY), rtol=1e-10, atol=0)
        torch.testing.assert_close(total, torch.tensor(c), rtol=1e-6, atol=0)
    assert_grads(model, clip_by_hand(g, c, per_layer, 1))


def test_per_layer_counts_each_tied_parameter_once():
    """K is the number of trainable parameter tensors: a tied weight is one of them."""
    model, inputs, targets, loss_fn, g = setup("tied-embedding-output")
    assert len(g) == 4  # emb.weight (= out.weight), mix.weight, mix.bias, out.bias
    c = 0.01 * float(flat_norms(g).min())
    private_grad(model, inputs, targets, loss_fn, max_grad_norm=c, noise_multiplier=0.0,
                 per_layer=True)
    assert_grads(model, clip_by_hand(g, c, True, N))
    wrong = clip_by_hand(g, c * math.sqrt(4 / 5), True, N)  # K = 5, counting the tie twice
    assert not torch.allclose(model.emb.weight.grad, wrong["emb.weight"])


def test_per_layer_differs_from_flat():
    model, inputs, targets, loss_fn, g = setup("mlp")
    c = float(flat_norms(g).median())
    private_grad(model, inputs, targets, loss_fn, max_grad_norm=c, noise_multiplier=0.0,
                 per_layer=True)
    per_layer = {n: p.grad.clone() for n, p in trainable(model).items()}
    private_grad(model, inputs, targets, loss_fn, max_grad_norm=c, noise_multiplier=0.0)
    assert_grads(model, clip_by_hand(g, c, False, N))
    assert not all(torch.allclose(per_layer[n], p.grad) for n, p in trainable(model).items())


class TinyLM(nn.Module):
    """A large-vocabulary embedding and Linear layers on sequences: all ghost norms."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(500, 8, padding_idx=0)
        self.up = nn.Linear(8, 32)  # T = 4: the Gram form
        self.down = nn.Linear(32, 5)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(torch.tanh(self.up(self.emb(x)))).transpose(1, 2)  # (B, 5, T)


@pytest.mark.parametrize("per_layer", [False, True], ids=["flat", "per-layer"])
@pytest.mark.parametrize("model_fn, vocab", [(TinyLM, 5), (lambda: TiedLM(200, 16), 200)],
                         ids=["tiny-lm", "tied-lm-ghost-sized"])
def test_sequence_models_with_ghost_norms(model_fn, vocab, per_layer):
    """Book-keeping on Gram-form layers; a tied weight whose calls alone would be ghost."""
    model = model_fn()
    ids = torch.randint(0, 20, (6, 4))
    ids[1:, 3] = 0
    y = torch.randint(0, vocab, (6, 4))
    loss_fn = nn.CrossEntropyLoss()
    g = loop_per_sample_grads(model, ids, y, loss_fn)
    c = float(flat_norms(g).median())
    _, norms = private_grad(model, ids, y, loss_fn, max_grad_norm=c, noise_multiplier=0.0,
                         per_layer=per_layer)
    torch.testing.assert_close(norms, flat_norms(g), **TOL)
    assert_grads(model, clip_by_hand(g, c, per_layer, 6))


@pytest.mark.parametrize("per_layer", [False, True], ids=["flat", "per-layer"])
def test_float32_model(per_layer):
    model = nn.Sequential(nn.Conv1d(2, 3, 3), nn.Flatten(), nn.Linear(9, 4)).float()
    x = torch.randn(5, 2, 5, dtype=torch.float32)
    y = torch.randint(0, 4, (5,))
    g = loop_per_sample_grads(model, x, y, nn.CrossEntropyLoss())
    c = float(flat_norms(g).median())
    _, norms = private_grad(model, x, y, nn.CrossEntropyLoss(), max_grad_norm=c,
                         noise_multiplier=0.0, per_layer=per_layer)
    assert norms.dtype == torch.float32
    torch.testing.assert_close(norms, flat_norms(g), rtol=1e-5, atol=1e-6)
    assert_grads(model, clip_by_hand(g, c, per_layer, 5), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------
# p.grad is overwritten, frozen parameters untouched, the divisor


@pytest.mark.parametrize("case_id", ["mlp", "simple-cnn", "tied-embedding-output",
                                     "custom-scale", "linear-called-twice"])
def test_existing_grad_is_replaced_not_accumulated(case_id):
    model, inputs, targets, loss_fn, g = setup(case_id)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e3)
    c = float(flat_norms(g).median())
    private_grad(model, inputs, targets, loss_fn, max_grad_norm=c, noise_multiplier=0.0)
    assert_grads(model, clip_by_hand(g, c, False, N))
    for p in model.parameters():
        assert not p.grad.requires_grad and p.grad.grad_fn is None


def test_frozen_parameters_keep_their_grad():
    model, inputs, targets, loss_fn, g = setup("frozen-params")
    assert list(g) == ["0.bias", "2.weight"]
    old = torch.randn_like(model[0].weight)
    model[0].weight.grad = old
    c = float(flat_norms(g).median())
    private_grad(model, inputs, targets, loss_fn, max_grad_norm=c, noise_multiplier=1.0,
                 generator=torch.Generator().manual_seed(0))
    assert model[0].weight.grad is old and model[2].bias.grad is None
    assert model[0].bias.grad is not None and model[2].weight.grad is not None


def test_unused_parameters_get_zero_without_noise_and_noise_with():
    model, inputs, targets, loss_fn, g = setup("unused-params")
    c = float(flat_norms(g).median())
    private_grad(model, inputs, targets, loss_fn, max_grad_norm=c, noise_multiplier=0.0)
    assert torch.equal(model.unused_param.grad, torch.zeros(2, 2))
    assert_grads(model, clip_by_hand(g, c, False, N))
    private_grad(model, inputs, targets, loss_fn, max_grad_norm=c, noise_multiplier=1.0,
                 generator=torch.Generator().manual_seed(0))
    assert (model.unused_param.grad != 0).all()  # the noise covers every parameter


@pytest.mark.parametrize("per_layer", [False, True], ids=["flat", "per-layer"])
@pytest.mark.parametrize("expected", [10, 2.5])
def test_expected_batch_size_is_the_divisor(expected, per_layer):
    model, inputs, targets, loss_fn, g = setup("simple-cnn")
    c = float(flat_norms(g).median())
    private_grad(model, inputs, targets, loss_fn, max_grad_norm=c, noise_multiplier=0.0,
                 per_layer=per_layer, expected_batch_size=expected)
    assert_grads(model, clip_by_hand(g, c, per_layer, expected))


def test_optimizer_steps_on_the_private_grad():
    model, inputs, targets, loss_fn, g = setup("mlp")
    before = {n: p.detach().clone() for n, p in trainable(model).items()}
    c = float(flat_norms(g).median())
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    opt.zero_grad()
    private_grad(model, inputs, targets, loss_fn, max_grad_norm=c, noise_multiplier=0.0)
    opt.step()
    for name, want in clip_by_hand(g, c, False, N).items():
        torch.testing.assert_close(model.get_parameter(name).detach(), before[name] - 0.5 * want)


def test_model_state_unchanged_apart_from_grad(snapshot):
    """Hooks, attributes, training flags, values and buffers as before; only p.grad is set."""
    model, inputs, targets, loss_fn, g = setup("batchnorm-eval")
    state = snapshot(model)  # every .grad None
    private_grad(model, inputs, targets, loss_fn, max_grad_norm=1.0, noise_multiplier=1.0,
                 generator=torch.Generator().manual_seed(0))
    assert all(p.grad is not None for p in model.parameters())
    for p in model.parameters():
        p.grad = None
    state.assert_unchanged()
    assert torch.is_grad_enabled()


# ---------------------------------------------------------------------------
# noise


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.scale = nn.Parameter(torch.randn(5))  # unused: a noise-only parameter

    def forward(self, x):
        return self.fc(x)


B, SIGMA, C, DRAWS = 9, 1.3, 0.5, 200


@pytest.fixture(scope="module")
def noise_draws() -> dict[bool, Tensor]:
    """``{per_layer: (DRAWS, P)}``: the noise part of p.grad, i.e. minus the noiseless result."""
    dtype, rng = torch.get_default_dtype(), torch.random.get_rng_state()
    torch.set_default_dtype(torch.float64)  # module scope: before conftest's autouse fixture
    try:
        torch.manual_seed(0)
        model = Tiny()
        x, y = randn(B, 4), randn(B, 3)
        result = {}
        for per_layer in (False, True):
            private_grad(model, x, y, nn.MSELoss(), max_grad_norm=C, noise_multiplier=0.0,
                         per_layer=per_layer)
            clean = torch.cat([p.grad.flatten() for p in model.parameters()])
            gen = torch.Generator().manual_seed(1234)
            draws = []
            for _ in range(DRAWS):
                private_grad(model, x, y, nn.MSELoss(), max_grad_norm=C, noise_multiplier=SIGMA,
                             generator=gen, per_layer=per_layer)
                draws.append(torch.cat([p.grad.flatten() for p in model.parameters()]) - clean)
            result[per_layer] = torch.stack(draws)
        return result
    finally:
        torch.set_default_dtype(dtype)
        torch.random.set_rng_state(rng)


@pytest.mark.parametrize("per_layer", [False, True], ids=["flat", "per-layer"])
def test_noise_mean_and_std(noise_draws, per_layer):
    """std sigma * C / B per coordinate; a factor sqrt(B) = 3 or 2 off fails by far."""
    noise = noise_draws[per_layer]  # (DRAWS, 20)
    want = SIGMA * C / B
    count = noise.numel()  # 4000
    assert abs(float(noise.mean())) < 4 * want / math.sqrt(count)
    assert 0.93 < float(noise.std()) / want < 1.07
    per_coord = noise.std(0) / want  # (20,): each coordinate (of every parameter) is noised
    assert (per_coord > 0.7).all() and (per_coord < 1.3).all()
    assert (noise.mean(0).abs() < 5 * want / math.sqrt(DRAWS)).all()


@pytest.mark.parametrize("per_layer", [False, True], ids=["flat", "per-layer"])
def test_noise_is_gaussian_and_independent(noise_draws, per_layer):
    z = noise_draws[per_layer] / (SIGMA * C / B)
    within_one = float((z.abs() < 1).double().mean())  # 0.683 for a Gaussian, 0.577 uniform
    assert abs(within_one - 0.6827) < 0.04
    corr = torch.corrcoef(z.T)  # (20, 20): coordinates independent
    off = corr - torch.eye(corr.shape[0])
    assert off.abs().max() < 0.45
    lag = torch.corrcoef(torch.stack([z[:-1].flatten(), z[1:].flatten()]))[0, 1]
    assert abs(float(lag)) < 0.1  # successive draws independent


def run_noisy(seed: int | None, per_layer: bool = False) -> list[Tensor]:
    torch.manual_seed(0)
    model = Tiny()
    x, y = randn(B, 4), randn(B, 3)
    gen = None if seed is None else torch.Generator().manual_seed(seed)
    private_grad(model, x, y, nn.MSELoss(), max_grad_norm=C, noise_multiplier=SIGMA,
                 generator=gen, per_layer=per_layer)
    return [p.grad.clone() for p in model.parameters()]


def test_same_seed_same_result_different_seed_different():
    a, b, other = run_noisy(7), run_noisy(7), run_noisy(8)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert all(not torch.allclose(x, y) for x, y in zip(a, other))


def test_without_generator_the_global_seed_decides():
    torch.manual_seed(5)
    model = Tiny()
    x, y = randn(B, 4), randn(B, 3)
    results = []
    for seed in (11, 11, 12):
        torch.manual_seed(seed)
        private_grad(model, x, y, nn.MSELoss(), max_grad_norm=C, noise_multiplier=SIGMA)
        results.append([p.grad.clone() for p in model.parameters()])
    assert all(torch.equal(u, v) for u, v in zip(results[0], results[1]))
    assert all(not torch.allclose(u, v) for u, v in zip(results[0], results[2]))


# ---------------------------------------------------------------------------
# bad input: an error, and the model and every p.grad exactly as before


def dressed(case_id: str = "mlp", n: int = N):
    """A case's model with an existing .grad on every parameter (to check it is kept)."""
    model, inputs, targets, loss_fn, _ = setup(case_id, n)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    return model, inputs, targets, loss_fn


@pytest.mark.parametrize("c", [0.0, -1.0, float("nan"), float("inf")])
def test_max_grad_norm_not_positive_and_finite(c, snapshot):
    model, inputs, targets, loss_fn = dressed()
    state = snapshot(model)
    with pytest.raises(ValueError, match=r"max_grad_norm \(the clipping norm C\) must be a pos"):
        private_grad(model, inputs, targets, loss_fn, max_grad_norm=c, noise_multiplier=1.0)
    state.assert_unchanged()


@pytest.mark.parametrize("sigma", [-0.1, -1, float("nan")])
def test_noise_multiplier_negative(sigma, snapshot):
    model, inputs, targets, loss_fn = dressed()
    state = snapshot(model)
    with pytest.raises(ValueError, match=r"noise_multiplier \(sigma\) must be >= 0"):
        private_grad(model, inputs, targets, loss_fn, max_grad_norm=1.0, noise_multiplier=sigma)
    state.assert_unchanged()


@pytest.mark.parametrize("expected", [0, -3])
def test_expected_batch_size_not_positive(expected, snapshot):
    model, inputs, targets, loss_fn = dressed()
    state = snapshot(model)
    with pytest.raises(ValueError, match="expected_batch_size must be a positive number"):
        private_grad(model, inputs, targets, loss_fn, max_grad_norm=1.0, noise_multiplier=1.0,
                     expected_batch_size=expected)
    state.assert_unchanged()


def test_batchnorm_in_training_mode(snapshot):
    model = nn.Sequential(OrderedDict(
        conv=nn.Conv2d(1, 2, 3), bn=nn.BatchNorm2d(2), flat=nn.Flatten(),
        head=nn.Linear(2 * 3 * 3, 3))).train()
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    x, y = randn(3, 1, 5, 5), torch.randint(0, 3, (3,))
    state = snapshot(model)  # includes the running statistics
    with pytest.raises(ValueError, match=r"'bn' \(BatchNorm2d\).*eval\(\)"):
        private_grad(model, x, y, nn.CrossEntropyLoss(), max_grad_norm=1.0,
                     noise_multiplier=1.0)
    state.assert_unchanged()
    assert int(model.bn.num_batches_tracked) == 0  # the model never ran



def test_unsupported_module_falls_back_to_the_loop():
    """A parameter inside a custom autograd.Function that torch.func refuses: like
    method="auto", a warning naming the module, then the loop's clipped sum."""
    model = nn.Sequential(nn.Linear(3, 4), OpaqueGate(), nn.Linear(4, 2))
    x, y = randn(3, 3), randn(3, 2)
    want = loop_per_sample_grads(model, x, y, nn.MSELoss())
    flat = torch.cat([g.flatten(1) for g in want.values()], 1)
    c = (1.0 / (flat.norm(dim=1) + 1e-6)).clamp(max=1.0)
    with pytest.warns(UserWarning, match=r"(?s)module '1' \(OpaqueGate\).*Falling back"):
        losses, _ = private_grad(model, x, y, nn.MSELoss(), max_grad_norm=1.0,
                                 noise_multiplier=0.0)
    got = torch.cat([p.grad.flatten() for p in model.parameters()])
    torch.testing.assert_close(got, (c[:, None] * flat).sum(0) / 3, rtol=1e-10, atol=1e-12)
    want_losses = torch.full((3,), math.nan, dtype=torch.float64)
    loop_per_sample_grads(model, x, y, nn.MSELoss(), losses=want_losses)
    torch.testing.assert_close(losses, want_losses, rtol=1e-12, atol=1e-14)


def test_losses_of_the_torch_func_fallback(monkeypatch):
    """Where the rules refuse and torch.func answers, the step's per-sample losses are
    those torch.func evaluated: the loop's, sample by sample."""
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    x, y = randn(5, 3), randn(5, 2)
    want = torch.full((5,), math.nan, dtype=torch.float64)
    loop_per_sample_grads(model, x, y, nn.MSELoss(), losses=want)

    def refused(*args, **kwargs):
        raise NeedsWholeModel("a refusal made for this test")

    monkeypatch.setattr(microbatch, "loss_backprops", refused)
    with pytest.warns(UserWarning, match=r"(?s)a refusal made for this test.*torch\.func"):
        losses, norms = private_grad(model, x, y, nn.MSELoss(), max_grad_norm=1.0,
                                     noise_multiplier=0.0)
    torch.testing.assert_close(losses, want, rtol=1e-12, atol=1e-14)
    assert norms.shape == (5,)


@pytest.mark.parametrize("per_layer", [False, True], ids=["flat", "per-layer"])
@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_non_finite_input_raises_and_keeps_grad(bad, per_layer, snapshot):
    model, inputs, targets, loss_fn = dressed("mlp", 5)
    inputs = inputs.clone()
    inputs[1, 0] = bad
    inputs[3, 2] = bad
    state = snapshot(model)  # checks every p.grad keeps its identity and exact values
    with pytest.raises(FloatingPointError, match=r"samples \[1, 3\].*not finite") as err:
        private_grad(model, inputs, targets, loss_fn, max_grad_norm=1.0, noise_multiplier=1.0,
                     generator=torch.Generator().manual_seed(0), per_layer=per_layer)
    assert "p.grad was left unchanged" in str(err.value)
    state.assert_unchanged()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_log_of_zero_in_the_loss_raises_and_keeps_grad(snapshot):
    """``-log(out . w)`` with ``w = 0`` for sample 2: the loss is inf and its gradient NaN."""
    model = nn.Linear(3, 2)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    x = randn(4, 3)
    w = torch.rand(4, 2) + 0.5
    w[2] = 0

    def loss_fn(out, weights):  # (B,)
        return -torch.log((torch.sigmoid(out) * weights).sum(1))

    state = snapshot(model)
    with pytest.raises(FloatingPointError, match=r"samples \[2\]"):
        private_grad(model, x, w, loss_fn, max_grad_norm=1.0, noise_multiplier=0.0)
    state.assert_unchanged()


def test_non_finite_sample_dropped_then_works():
    """The fix the error suggests: drop the named samples and call again."""
    model, inputs, targets, loss_fn, _ = setup("mlp", 5)
    bad = inputs.clone()
    bad[2, 1] = float("inf")
    with pytest.raises(FloatingPointError, match=r"samples \[2\]"):
        private_grad(model, bad, targets, loss_fn, max_grad_norm=1.0, noise_multiplier=0.0)
    keep = torch.tensor([0, 1, 3, 4])
    g = loop_per_sample_grads(model, inputs[keep], targets[keep], loss_fn)
    private_grad(model, bad[keep], targets[keep], loss_fn, max_grad_norm=1.0,
                 noise_multiplier=0.0)
    assert_grads(model, clip_by_hand(g, 1.0, False, 4))


@pytest.mark.parametrize("per_layer", [False, True], ids=["flat", "per-layer"])
def test_batch_of_zero_is_pure_noise(per_layer):
    model = nn.Sequential(nn.Linear(20, 30), nn.Tanh(), nn.Linear(30, 4))
    x, y = randn(0, 20), torch.zeros(0, dtype=torch.long)
    losses, norms = private_grad(model, x, y, nn.CrossEntropyLoss(), max_grad_norm=2.0,
                         noise_multiplier=1.5, generator=torch.Generator().manual_seed(3),
                         expected_batch_size=5, per_layer=per_layer)
    assert norms.shape == (0,) and losses.shape == (0,)
    for p in model.parameters():
        assert p.grad.shape == p.shape and p.grad.dtype == p.dtype
        assert torch.isfinite(p.grad).all()
    z = torch.cat([p.grad.flatten() for p in model.parameters()]) / (1.5 * 2.0 / 5)
    assert z.numel() == 754
    assert abs(float(z.mean())) < 0.2 and 0.85 < float(z.std()) < 1.15
    private_grad(model, x, y, nn.CrossEntropyLoss(), max_grad_norm=2.0, noise_multiplier=0.0,
                 expected_batch_size=5, per_layer=per_layer)
    assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in model.parameters())


def test_batch_of_zero_needs_expected_batch_size(snapshot):
    model = nn.Sequential(nn.Linear(3, 2))
    state = snapshot(model)
    with pytest.raises(ValueError, match="batch is empty.*expected_batch_size"):
        private_grad(model, randn(0, 3), torch.zeros(0, dtype=torch.long),
                     nn.CrossEntropyLoss(), max_grad_norm=1.0, noise_multiplier=1.0)
    state.assert_unchanged()
