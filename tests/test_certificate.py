"""The certificate: every result checked by an identity persample does not compute itself.

A deliberately wrong rule (another sample's rows, twice the gradient) must be caught by
the first call of ``method="auto"`` and answered right, with a warning, in every public
function; an explicit method must raise. Models whose forwards draw from numpy, or mix
samples, are named; forwards that draw from torch's generators, packed and dict inputs
pass their certificates (no false alarm).
"""

from __future__ import annotations

import contextlib
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import persample
from persample import certificate, whole
from persample.dp import PrivateStep, private_grad
from persample.errors import CertificateError, NeedsWholeModel
from persample.rules import register_norm_rule, register_rule

B = 6


class Scale(nn.Module):
    """``x * w``, with a user rule registered below."""

    def __init__(self, width: int = 4):
        super().__init__()
        self.w = nn.Parameter(torch.randn(width))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.w


class OtherRows(Scale):
    pass


class Twice(Scale):
    pass


@register_rule(OtherRows)
def _other_rows(layer, activations, backprops, out):
    torch.mul(backprops, activations[0].roll(1, 0).unsqueeze(1), out=out["w"])  # sample i-1's


@register_rule(Twice)
def _twice(layer, activations, backprops, out):
    torch.mul(backprops, 2 * activations[0].unsqueeze(1), out=out["w"])


class WrongNorm(Scale):
    pass


@register_rule(WrongNorm)
def _right(layer, activations, backprops, out):
    torch.mul(backprops, activations[0].unsqueeze(1), out=out["w"])


@register_norm_rule(WrongNorm)
def _wrong_norm(layer, activations, backprops, names):
    return {"w": 4 * (backprops[:, 0] * activations[0]).square().sum(1)}


def _net(kind: type) -> nn.Module:
    return nn.Sequential(nn.Linear(3, 4), kind(), nn.Tanh(), nn.Linear(4, 2))


def _data() -> tuple[Tensor, Tensor]:
    return torch.randn(B, 3), torch.randn(B, 2)


def _flat(grads: dict[str, Tensor]) -> Tensor:
    return torch.cat([g.flatten(1) for g in grads.values()], 1)


def _caught(run):
    """``run()``'s result and the certificate's warnings."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = run()
    return got, [str(w.message) for w in seen if "certificate" in str(w.message)]


@pytest.fixture(autouse=True)
def forget():
    certificate.forget()
    yield
    certificate.forget()


@pytest.mark.parametrize("kind", [OtherRows, Twice], ids=["other rows", "twice"])
def test_a_wrong_user_rule_is_caught_and_answered_right(kind):
    model, (x, y), loss = _net(kind), _data(), nn.MSELoss()
    want = persample.loop_per_sample_grads(model, x, y, loss)

    got, said = _caught(lambda: persample.per_sample_grads(model, x, y, loss))
    assert said and "1.w" in said[0] and "'rules'" in said[0]
    torch.testing.assert_close(_flat(got), _flat(want), rtol=1e-10, atol=1e-12)

    certificate.forget()
    norms, said = _caught(lambda: persample.per_sample_grad_norms(model, x, y, loss))
    assert said and "1.w" in said[0]
    torch.testing.assert_close(norms, _flat(want).norm(dim=1), rtol=1e-10, atol=1e-12)

    certificate.forget()
    c = (0.05 / (_flat(want).norm(dim=1) + 1e-6)).clamp(max=1)  # (B,)
    _, said = _caught(lambda: private_grad(model, x, y, loss, max_grad_norm=0.05,
                                           noise_multiplier=0.0))
    assert said and "1.w" in said[0]
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, torch.tensordot(c, want[name], 1) / B,
                                   rtol=1e-10, atol=1e-12)


def test_a_wrong_norm_rule_is_caught_in_the_norms_and_the_dp_step():
    model, (x, y), loss = _net(WrongNorm), _data(), nn.MSELoss()
    want = _flat(persample.loop_per_sample_grads(model, x, y, loss)).norm(dim=1)
    norms, said = _caught(lambda: persample.per_sample_grad_norms(model, x, y, loss))
    assert said and "norms of 1.w" in said[0]
    torch.testing.assert_close(norms, want, rtol=1e-10, atol=1e-12)
    certificate.forget()
    _, said = _caught(lambda: private_grad(model, x, y, loss, max_grad_norm=1.0,
                                           noise_multiplier=0.0))
    assert said and "norms of 1.w" in said[0]


@pytest.mark.parametrize("fn", ["grads", "norms", "jacobian"])
def test_an_explicit_method_raises_on_a_mismatch(fn):
    model, (x, y), loss = _net(OtherRows), _data(), nn.MSELoss()
    calls = {"grads": lambda: persample.per_sample_grads(model, x, y, loss, method="rules"),
             "norms": lambda: persample.per_sample_grad_norms(model, x, y, loss,
                                                              method="rules"),
             "jacobian": lambda: persample.param_jacobian(model, x, method="rules")}
    with pytest.raises(CertificateError, match=r"1\.w"):
        calls[fn]()


def test_the_jacobian_of_a_wrong_rule_is_answered_right():
    model, (x, _) = _net(Twice), _data()
    got, said = _caught(lambda: persample.param_jacobian(model, x, flat=True))
    assert said
    want = persample.loop_param_jacobian(model, x)
    torch.testing.assert_close(got, torch.cat([w.flatten(2) for w in want.values()], 2),
                               rtol=1e-10, atol=1e-12)


def test_a_dp_step_with_a_wrong_rule_keeps_the_exact_method_afterwards():
    """The first micro-batch is certified and answered by torch.func; the later ones of
    the same plan start there (no rules, no warning) and stay exact."""
    model, loss = _net(OtherRows), nn.MSELoss()
    step = PrivateStep(model, loss, max_grad_norm=1e3, noise_multiplier=0.0,
                       expected_batch_size=B)
    for k in range(3):
        x, y = _data()
        _, said = _caught(lambda x=x, y=y: step.accumulate(x, y))
        assert bool(said) == (k == 0)
        want = persample.loop_per_sample_grads(model, x, y, loss)
        step.release()
        for name, p in model.named_parameters():  # C large: nothing clipped
            torch.testing.assert_close(p.grad, want[name].sum(0) / B, rtol=1e-10,
                                       atol=1e-12)


def _count(monkeypatch) -> list[str]:
    seen: list[str] = []
    real = certificate.certify_grads

    def spy(*args, **kwargs):
        seen.append(args[7])
        return real(*args, **kwargs)
    monkeypatch.setattr("persample.api.certify_grads", spy)
    return seen


@pytest.mark.parametrize("check, certified", [("first", 1), ("always", 5), ("never", 0),
                                              (2, 3)])
def test_the_policy_certifies_the_calls_it_says(check, certified, monkeypatch):
    seen = _count(monkeypatch)
    model, (x, y) = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)), _data()
    for _ in range(5):
        persample.per_sample_grads(model, x, y, nn.MSELoss(), check=check)
    assert len(seen) == certified


def test_checking_sets_the_policy_of_calls_that_do_not_pass_one(monkeypatch):
    seen = _count(monkeypatch)
    model, (x, y) = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)), _data()
    with persample.checking("always"):
        for _ in range(3):
            persample.per_sample_grads(model, x, y, nn.MSELoss())
        persample.per_sample_grads(model, x, y, nn.MSELoss(), check="never")  # its own
        with persample.checking("never"):
            persample.per_sample_grads(model, x, y, nn.MSELoss())
        persample.per_sample_grads(model, x, y, nn.MSELoss())
    persample.per_sample_grads(model, x, y, nn.MSELoss())  # "first": certified already
    assert len(seen) == 4
    with pytest.raises(ValueError, match="check="):
        with persample.checking("sometimes"):
            pass


def test_checking_reaches_the_dp_step(monkeypatch):
    seen = []
    real = certificate.certify_step
    monkeypatch.setattr("persample.dp.microbatch.certify_step",
                        lambda *a, **k: seen.append(1) or real(*a, **k))
    model, (x, y) = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)), _data()
    step = PrivateStep(model, nn.MSELoss(), max_grad_norm=1.0, noise_multiplier=0.0,
                       expected_batch_size=B)
    for check, runs in [("always", 2), ("never", 0), (None, 0)]:
        before = len(seen)
        with persample.checking(check) if check else contextlib.nullcontext():
            for _ in range(runs or 2):
                step.accumulate(x, y)
                step.release()
        assert len(seen) - before == runs  # (outside: "first", certified by "always")


def test_a_new_shape_or_mode_is_certified_again_a_new_batch_size_is_not(monkeypatch):
    seen = _count(monkeypatch)
    model = nn.Sequential(nn.Linear(3, 4), nn.Dropout(0.3), nn.Linear(4, 2))
    x, y = torch.randn(B, 5, 3), torch.randn(B, 5, 2)
    persample.per_sample_grads(model, x, y, nn.MSELoss())
    persample.per_sample_grads(model, x, y, nn.MSELoss())
    persample.per_sample_grads(model, x[:4], y[:4], nn.MSELoss())  # a Poisson batch: same plan
    assert len(seen) == 1
    persample.per_sample_grads(model, x[:, :3], y[:, :3], nn.MSELoss())  # T: a new plan
    model.eval()
    persample.per_sample_grads(model, x, y, nn.MSELoss())
    assert len(seen) == 3


@pytest.mark.parametrize("check", ["sometimes", 0, -1, True, 1.5])
def test_a_bad_check_is_refused_by_name(check):
    model, (x, y) = nn.Linear(3, 2), _data()
    with pytest.raises(ValueError, match="check="):
        persample.per_sample_grads(model, x, y, nn.MSELoss(), check=check)


@pytest.mark.parametrize("method", ["auto", "rules", "vmap", "loop"])
def test_dropout_in_training_mode_passes_its_certificate(method):
    """The reference replays the draws of the forward that ran: no false alarm, in every
    method, and the rows are those of that forward."""
    model = nn.Sequential(nn.Linear(3, 8), nn.Dropout(0.5), nn.Tanh(), nn.Linear(8, 2))
    x, y = _data()
    torch.manual_seed(3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = persample.per_sample_grads(model, x, y, nn.MSELoss(), method=method,
                                         check="always")
    after = torch.random.get_rng_state()
    torch.manual_seed(3)
    want = persample.forward_per_sample_grads(model, x, y, nn.MSELoss())
    assert torch.equal(after, torch.random.get_rng_state())  # one forward's draws
    torch.testing.assert_close(_flat(got), _flat(want), rtol=1e-10, atol=1e-12)


class NumpyMask(nn.Module):
    """A mask drawn with numpy in ``forward``: one for the batch (``shared``), or a row per
    sample (SpecAugment's time masks in wav2vec2 and HuBERT)."""

    def __init__(self, shared: bool):
        super().__init__()
        self.shared = shared
        self.a, self.b = nn.Linear(3, 8), nn.Linear(8, 2)

    def forward(self, x: Tensor) -> Tensor:
        shape = (8,) if self.shared else (len(x), 8)
        keep = torch.from_numpy(np.random.rand(*shape) > 0.3).to(x.dtype)
        return self.b(torch.tanh(self.a(x)) * keep)


@pytest.mark.parametrize("shared", [True, False], ids=["one mask", "a mask per sample"])
def test_numpy_draws_are_named_never_answered_with_other_rows(shared):
    """A tensor made from numpy is outside the data flow (the rules leave), and
    torch.func and the loop would draw each sample's mask anew: refused, naming numpy."""
    model, (x, y), loss = NumpyMask(shared), _data(), nn.MSELoss()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(persample.DrawNotReplayable, match="numpy"):
            persample.per_sample_grads(model, x, y, loss)
    for method in ("vmap", "loop"):
        with pytest.raises(persample.DrawNotReplayable, match="numpy"):
            persample.per_sample_grads(model, x, y, loss, method=method)


class Centred(nn.Module):
    """A batch statistic written by hand: samples mix."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.a(x))
        return self.b(h - h.mean(0))


class Mixup(nn.Module):
    """Manifold mixup: each sample's features mixed with another's by a permutation."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.a(x))
        return self.b(0.7 * h + 0.3 * h[torch.randperm(len(x))])


@pytest.mark.parametrize("make", [Centred, Mixup])
def test_a_model_that_mixes_samples_is_refused_by_name_and_the_loop_is_explicit(make):
    model, (x, y), loss = make(), _data(), nn.MSELoss()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(CertificateError, match="mixes samples"):
            persample.per_sample_grads(model, x, y, loss)
        with pytest.raises(CertificateError, match="mixes samples"):
            persample.per_sample_grad_norms(model, x, y, loss)
        with pytest.raises(CertificateError, match="mixes samples"):
            private_grad(model, x, y, loss, max_grad_norm=1.0, noise_multiplier=0.0)
    assert all(p.grad is None for p in model.parameters())
    torch.manual_seed(1)
    got = persample.per_sample_grads(model, x, y, loss, method="loop")  # each sample alone
    torch.manual_seed(1)
    torch.testing.assert_close(_flat(got), _flat(persample.loop_per_sample_grads(
        model, x, y, loss)), rtol=1e-10, atol=1e-12)


def test_packed_sequences_and_dict_inputs_pass_their_certificates():
    """The identity never splits the inputs: it holds for the packed forms the fast path
    splits by persample's own reading of the inputs."""

    class Packed(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn, self.head = nn.LSTM(3, 4, batch_first=True), nn.Linear(4, 2)

        def forward(self, packed):
            _, (h, _) = self.rnn(packed)
            return self.head(h[-1])

    class Keywords(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.head = nn.Embedding(10, 4), nn.Linear(4, 2)

        def forward(self, input_ids, attention_mask):
            h = self.emb(input_ids) * attention_mask.unsqueeze(-1)
            return {"logits": self.head(h.sum(1))}

    lengths = torch.tensor([5, 3, 6, 2, 6, 4])
    seqs = torch.randn(B, 6, 3)
    packed = nn.utils.rnn.pack_padded_sequence(seqs, lengths, batch_first=True,
                                               enforce_sorted=False)
    y = torch.randn(B, 2)
    ids, mask = torch.randint(0, 10, (B, 6)), (torch.rand(B, 6) > 0.3).double()
    cases = [(Packed(), (packed,), nn.MSELoss()),
             (Keywords(), {"input_ids": ids, "attention_mask": mask},
              lambda out, t: F.mse_loss(out["logits"], t, reduction="none").sum(1))]
    for model, inputs, loss in cases:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            got = persample.per_sample_grads(model, inputs, y, loss, check="always")
        want = persample.loop_per_sample_grads(model, inputs, y, loss)
        torch.testing.assert_close(_flat(got), _flat(want), rtol=1e-9, atol=1e-12)


def test_verify_reports_the_certificates():
    model, (x, y) = _net(Twice), _data()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = persample.verify(model, x, y, nn.MSELoss())
    assert report.ok
    assert [c.method for c in report.certificates] == ["rules", "vmap"]
    assert [c.ok for c in report.certificates] == [False, True]
    assert "certificate" in str(report)


@pytest.mark.parametrize("kind", ["hand", "gcn"])
def test_graph_batches_pass_their_certificates(kind):
    """torch_geometric's ``Batch``: the certificate runs (never split by persample's
    reading of the graphs) and passes."""
    from test_mechanisms import HandGIN, PyGNet, graph_batch

    model = HandGIN() if kind == "hand" else PyGNet("gcn").double()
    data, y = graph_batch(), torch.randn(4, 2)
    report = persample.verify(model, data, y, nn.MSELoss())
    assert report.ok and report.certificates
    assert all(c.ok for c in report.certificates), [c.describe() for c in report.certificates]


def test_a_wrong_input_jacobian_is_caught(monkeypatch):
    """A fault in the forward-mode path (twice the Jacobian): ``mode="auto"`` warns and
    answers each sample's block on its own; ``mode="forward"`` raises."""
    from persample import jacobian

    real = jacobian._double_backward_jacobian
    monkeypatch.setattr(jacobian, "_double_backward_jacobian",
                        lambda *args: 2 * real(*args))
    model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 5))
    x = torch.randn(B, 3)
    got, said = _caught(lambda: persample.input_jacobian(model, x))
    assert said and "input Jacobians" in said[0]
    full = torch.autograd.functional.jacobian(model, x)  # (B, 5, B, 3)
    torch.testing.assert_close(got, torch.stack([full[i, :, i] for i in range(B)]),
                               rtol=1e-10, atol=1e-12)
    with pytest.raises(CertificateError):
        persample.input_jacobian(model, x, mode="forward", check="always")


@pytest.mark.parametrize("kind", ["dots", "dots with another batch", "kronecker", "gaussian"])
def test_wrong_rows_behind_dots_and_projections_are_caught(kind):
    model, (x, y), loss = _net(Twice), _data(), nn.MSELoss()
    x2, y2 = torch.randn(4, 3), torch.randn(4, 2)
    g = _flat(persample.loop_per_sample_grads(model, x, y, loss))
    if kind.startswith("dots"):
        other = (x2, y2) if "another" in kind else None
        got, said = _caught(lambda: persample.per_sample_grad_dots(model, x, y, loss,
                                                                   other=other))
        g2 = g if other is None else _flat(persample.loop_per_sample_grads(model, x2, y2, loss))
        want = g @ g2.T
    else:
        proj = persample.GradientProjector(model, 8, kind=kind, seed=2)
        got, said = _caught(lambda: proj(x, y, loss))
        want = proj.project(persample.loop_per_sample_grads(model, x, y, loss))
    assert said
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


def test_losses_that_agree_by_chance_on_another_cut_of_the_output_are_not_certified():
    """Samples in dim 1 of the output and as many positions in dim 0 (Opacus's
    ``batch_first=False`` embedding; hypothesis found the draw): the identity cuts the
    output by dim 0, the wrong dim. Each cut's L1 means came within 1e-3 of the true
    ones at these seeds (of the first 400, in float64), which had passed for "the same
    losses" and certified the right answer as a mismatch; only rounding may separate the
    same losses now, and the answer (the loop's) stands uncertified."""
    from test_peer_suites import BatchInDim1, l1

    ids = torch.tensor([[[15, 15, 9, 14], [7, 3, 6, 11]], [[9, 10, 4, 6], [10, 11, 4, 5]]])
    for seed in (5, 28, 176):
        torch.manual_seed(seed)
        model = BatchInDim1(nn.Embedding(16, 13, dtype=torch.float64))
        persample.clear_plans()
        certificate.forget()
        with persample.checking("always"):
            got = persample.per_sample_grads(model, ids, None, l1("mean"), method="rules")
        want = persample.loop_per_sample_grads(model, ids, None, l1("mean"))
        torch.testing.assert_close(got["layer.weight"], want["layer.weight"], rtol=1e-10,
                                   atol=1e-12)


class OffByAPercent(Scale):
    pass


@register_rule(OffByAPercent)
def _off_by_a_percent(layer, activations, backprops, out):
    torch.mul(backprops, 1.01 * activations[0].unsqueeze(1), out=out["w"])


def _offset_layer_norm(offset: float) -> nn.Module:
    """float32, ill-conditioned: a LayerNorm of features ``offset`` from zero and spread
    by about 0.3, so that its centring cancels about ``log10(offset / 0.3)`` digits: float32
    autograd itself is off by about ``1e-7 * offset / 0.3`` (3000: 1e-3 to 1e-2)."""
    model = nn.Sequential(nn.Linear(4, 16), nn.LayerNorm(16), nn.Tanh(), nn.Linear(16, 2))
    with torch.no_grad():
        model[0].bias.fill_(offset)
        model[0].weight.mul_(0.1)
    return model.float()


def test_float32_rounding_of_an_ill_conditioned_model_is_not_a_mismatch():
    """float32 autograd is off the float64 answer by 1e-3 to 1e-2 here (beyond the
    certificate's float32 tolerance, 1e-3), and so is any float32 method: every
    certificate passes (judged against a float64 reference, the parameters named in
    ``rounded``), the rules answer, and no other function warns of anything (the DP
    step, the norms, both Jacobians, projections). Before, the rules, torch.func and the
    loop were each rejected and the model refused as mixing samples."""
    for seed in range(3):
        torch.manual_seed(seed)
        model = _offset_layer_norm(3000.0)
        x, y = torch.randn(16, 4, dtype=torch.float32), torch.randn(16, 2, dtype=torch.float32)
        exact = _offset_layer_norm(3000.0).double()
        exact.load_state_dict(model.state_dict())
        want = persample.loop_per_sample_grads(exact, x.double(), y.double(), nn.MSELoss())
        autograd = persample.loop_per_sample_grads(model, x, y, nn.MSELoss())
        own = (_flat(autograd).double() - _flat(want)).norm() / _flat(want).norm()
        assert own > 1e-3  # (the precision itself is off by more than the tolerance)
        certificate.forget()
        report = persample.verify(model, x, y, nn.MSELoss())
        assert [c.method for c in report.certificates] == ["rules"]
        assert report.certificates[0].ok and report.certificates[0].rounded, \
            report.certificates[0].describe()
        assert "rounding" in report.certificates[0].describe()
        certificate.forget()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            got = persample.per_sample_grads(model, x, y, nn.MSELoss(), check="always")
            private_grad(model, x, y, nn.MSELoss(), max_grad_norm=1.0, noise_multiplier=0.0,
                         check="always")
            persample.param_jacobian(model, x, check="always")
            persample.input_jacobian(model, x, check="always")
            persample.per_sample_grad_norms(model, x, y, nn.MSELoss(), check="always")
            persample.GradientProjector(model, 20, seed=0)(x, y, nn.MSELoss(), check="always")
        assert (_flat(got).double() - _flat(want)).norm() / _flat(want).norm() < 4 * own


def test_a_float32_result_off_by_more_than_rounding_is_caught_within_the_gray_zone():
    """A rule 1% off on a well-conditioned float32 model: beyond the tolerance but
    within the range judged against float64, where autograd is exact to 1e-6: caught,
    and answered right, in the per-sample gradients and the DP step."""
    torch.manual_seed(0)
    model = _net(OffByAPercent).float()
    x, y = torch.randn(B, 3, dtype=torch.float32), torch.randn(B, 2, dtype=torch.float32)
    want = persample.loop_per_sample_grads(model, x, y, nn.MSELoss())
    got, said = _caught(lambda: persample.per_sample_grads(model, x, y, nn.MSELoss()))
    assert said and "1.w" in said[0] and "'rules'" in said[0]
    torch.testing.assert_close(_flat(got), _flat(want), rtol=1e-5, atol=1e-6)
    certificate.forget()
    _, said = _caught(lambda: private_grad(model, x, y, nn.MSELoss(), max_grad_norm=1e3,
                                           noise_multiplier=0.0))
    assert said and "1.w" in said[0]


class _AlikeKeys(nn.Module):
    """Opacus's text model of its own tests: every weight uniform in (0, 1), so all keys
    are alike and the softmax's backward cancels; float32 autograd is off by 1e-4 to
    1e-3 on it."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(100, 8)
        self.attn = nn.MultiheadAttention(8, 1, batch_first=True)
        self.fc = nn.Linear(8, 1)
        for p in self.parameters():
            nn.init.uniform_(p)

    def forward(self, x: Tensor) -> Tensor:
        h = self.emb(x)
        return self.fc(self.attn(h, h, h)[0]).squeeze(-1)  # (B, T): logits over positions


def test_a_dp_step_on_alike_keys_is_certified_every_time():
    """Certified at float32's tolerance, the DP step of the model above passes every time
    (its errors are autograd's), so its steps are the same at every run: a spurious
    mismatch had sent a run to torch.func, whose rounding differs, and two runs from one
    seed apart. (The margin is a few times, not more: the attention's input bias, whose
    key part has a true gradient of zero here, holds rounding of up to 3.5e-4 of its norm
    in some random certificates.)"""
    torch.manual_seed(0)
    model = _AlikeKeys().float()
    x, y = torch.randint(0, 100, (64, 12)), torch.randint(0, 12, (64,))
    grads = []
    for _ in range(4):
        certificate.forget()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            private_grad(model, x, y, nn.CrossEntropyLoss(), max_grad_norm=1.0,
                         noise_multiplier=0.0, check="always")
        grads.append([p.grad.clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for g in grads[1:] for a, b in zip(g, grads[0]))


class BatchScale(nn.Module):
    """Every sample scaled by a number read out of the whole batch into Python: no tensor
    joins the samples, so the data flow and the identity see a constant; alone, each
    sample reads its own number."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.b(torch.tanh(self.a(x)) * x.sum().item())


class ReadsItsChecks(nn.Module):
    """Values read into Python only to check the batch (as transformers checks its image
    tokens): each sample alone is as in the batch."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        if bool(torch.isnan(x).any()) or int((x.abs() > 1e9).sum()):
            raise ValueError("not finite")
        return self.b(torch.tanh(self.a(x)))


def test_a_number_read_out_of_the_batch_is_caught_by_a_sample_alone():
    model, (x, y), loss = BatchScale(), _data(), nn.MSELoss()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(CertificateError, match="not its gradient alone"):
            persample.per_sample_grads(model, x, y, loss, method="rules")
        with pytest.raises(CertificateError, match="mixes samples"):
            persample.per_sample_grads(model, x, y, loss)
        with pytest.raises(CertificateError, match="not its gradient alone"):
            persample.per_sample_grad_norms(model, x, y, loss, method="rules")
    model, (x, y) = ReadsItsChecks(), _data()
    got = persample.per_sample_grads(model, x, y, loss, method="rules")
    torch.testing.assert_close(_flat(got), _flat(persample.loop_per_sample_grads(
        model, x, y, loss)), rtol=1e-10, atol=1e-12)
    note = persample.verify(model, x, y, loss).certificates[0]
    assert note.ok and any("alone" in name for name in note.errors), note


class SharedProduct(nn.Module):
    """Each sample's row times a parameter matrix ``(C, C)`` by ``linalg.multi_dot``,
    which has no data-flow rule: ``auto`` takes ``torch.func`` over the whole model."""

    def __init__(self, c: int):
        super().__init__()
        self.a = nn.Parameter(torch.randn(c, c, dtype=torch.float64))

    def forward(self, x):
        return torch.linalg.multi_dot([x, self.a, self.a])  # (B, C)


@pytest.fixture
def wrong_vmap(monkeypatch):
    """``torch.func`` over the whole model answering 3x its gradients and losses, as its
    ``vmap`` of a broadcast ``linalg.solve`` did in torch 2.13 (each sample's loss several
    times too large)."""
    vmap_grads = whole.vmap_grads

    def wrong(*args, losses=None, **kwargs):
        got = vmap_grads(*args, losses=losses, **kwargs)
        if losses is not None:
            losses.mul_(3)
        return {name: g * 3 for name, g in got.items()}

    monkeypatch.setattr("persample.api.vmap_grads", wrong)
    monkeypatch.setattr("persample.dp.microbatch.vmap_grads", wrong)


class SamplesInDimOneByChance(nn.Module):
    """``(B, T, C)`` to ``(B T, C)``, a linear map, then ``view(T, B, C)`` and a
    transpose: at ``B = T`` the view fits, and the samples land in dim 1 of a ``(T, B,
    C)`` output, where a sample alone gives ``(1, T, C)``."""

    def __init__(self, t: int, c: int):
        super().__init__()
        self.t, self.lin = t, nn.Linear(c, c, dtype=torch.float64)

    def forward(self, x):
        h = self.lin(x.reshape(-1, x.shape[-1]))
        return h.view(self.t, x.shape[0], -1).transpose(0, 1)


class RepeatedAndSummed(nn.Module):
    """Each sample's row repeated ``k`` times along the batch, viewed as ``(k, B, C)`` and
    summed over the first dim: row ``i`` of the output sums rows of samples other than
    ``i`` (it mixes samples)."""

    def __init__(self, k: int, c: int):
        super().__init__()
        self.k, self.lin = k, nn.Linear(c, c, dtype=torch.float64)

    def forward(self, x):
        r = self.lin(x).repeat_interleave(self.k, dim=0)
        return r.view(self.k, x.shape[0], -1).sum(0)


def _sums(out, y):
    return (out - y).pow(2).flatten(1).sum(1)


def test_an_identity_that_cannot_be_formed_is_decided_by_a_sample_alone(wrong_vmap):
    """Where the output has another dim of the batch's size and the method's losses are
    not those of its dim-0 rows, the identity cannot tell where the samples are; the last
    sample's forward alone decides: its row must be that sample's gradient alone, and
    where its output is not the batch's with that other dim of size 1, the samples are in
    dim 0 and the identity is formed by it. A wrong answer of torch.func's with wrong
    losses (``B = C``) is caught and the loop answers; a view that puts the
    samples in dim 1 only because ``B = T``, and a model that mixes samples by a
    ``repeat_interleave`` and a view at ``B = C``, are refused as at any other batch
    size. Before, the first two were answered wrong and the third answered (the loop's
    answer), each uncertified, without a word. A sequence-first output (the samples in
    dim 1 of the batch's output, and alone too) still stands uncertified (the test
    above)."""
    torch.manual_seed(1)
    model, x, y = SharedProduct(4), torch.randn(4, 4), torch.randn(4, 4)
    want = persample.loop_per_sample_grads(model, x, y, _sums)
    got, _ = _caught(lambda: persample.per_sample_grads(model, x, y, _sums))
    torch.testing.assert_close(got["a"], want["a"], rtol=1e-10, atol=1e-12)

    for model, x in [(SamplesInDimOneByChance(4, 3), torch.randn(4, 4, 3)),
                     (RepeatedAndSummed(3, 4), torch.randn(4, 4))]:
        y = torch.randn_like(model(x))
        for method in ("rules", "auto"):
            certificate.forget()
            persample.clear_plans()
            refused = (CertificateError, NeedsWholeModel) if method == "rules" else (
                CertificateError)  # (the rules may not follow the view at all)
            with pytest.raises(refused), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                persample.per_sample_grads(model, x, y, _sums, method=method, check="always")


def test_a_dp_step_whose_identity_cannot_be_formed_is_decided_by_a_sample_alone(wrong_vmap):
    """The DP step's certificate resolves the same way: torch.func's wrong gradient (and
    losses) at ``B = C`` is caught and the loop's clipped sum is released. Before, the
    step released torch.func's (off by 3x here, as its gradient of a broadcast
    ``linalg.solve`` once was), uncertified, without a word."""
    torch.manual_seed(1)
    model, x, y = SharedProduct(4), torch.randn(4, 4), torch.randn(4, 4)
    want = persample.loop_per_sample_grads(model, x, y, _sums)["a"].sum(0) / 4
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        private_grad(model, x, y, _sums, max_grad_norm=1e6, noise_multiplier=0.0,
                     expected_batch_size=4)
    torch.testing.assert_close(model.a.grad, want, rtol=1e-10, atol=1e-12)


def test_a_forward_that_cannot_run_one_sample_alone_leaves_an_undecided_identity_undecided():
    """The comparison with a sample alone is a best effort: a sequence-first model whose
    forward refuses a batch of one (the test above, the samples in dim 1 at ``B = T``)
    gets the rules' answer, uncertified, as before the comparison existed; the error of
    the forward alone does not escape the certificate."""
    from test_peer_suites import BatchInDim1, l1

    class NeedsTwoSamples(BatchInDim1):
        def forward(self, x):
            if x.shape[0] < 2:
                raise ValueError("a batch of one")
            return super().forward(x)

    ids = torch.tensor([[[15, 15, 9, 14], [7, 3, 6, 11]], [[9, 10, 4, 6], [10, 11, 4, 5]]])
    torch.manual_seed(5)
    model = NeedsTwoSamples(nn.Embedding(16, 13, dtype=torch.float64))
    with persample.checking("always"):
        got = persample.per_sample_grads(model, ids, None, l1("mean"), method="rules")
    want = persample.loop_per_sample_grads(BatchInDim1(model.layer), ids, None, l1("mean"))
    torch.testing.assert_close(got["layer.weight"], want["layer.weight"], rtol=1e-10,
                               atol=1e-12)


class MeanAndVariance(nn.Module):
    """``(mu (B, C), var (C,))``: the variance made from a parameter alone; at ``B = C``
    its dim 0 has the batch's size."""

    def __init__(self, c: int):
        super().__init__()
        self.mean = nn.Linear(c, c, dtype=torch.float64)
        self.log_var = nn.Parameter(torch.zeros(c, dtype=torch.float64))

    def forward(self, x):
        return self.mean(x), self.log_var.exp()


def _gaussian(out, y):
    return F.gaussian_nll_loss(out[0], y, out[1].expand_as(out[0]))


def test_an_output_holding_no_sample_as_long_as_the_batch_is_passed_whole():
    """At ``B = C`` the certificate cut the ``(C,)`` variance by sample as if its dim 0
    were the batch's (each sample's loss then read one entry), and rejected the loop's
    right answer (``auto`` raised). A sample's forward alone shows the variance the same
    shape: it goes whole to each sample's loss, and the identity holds."""
    torch.manual_seed(0)
    model, x, y = MeanAndVariance(3), torch.randn(3, 3), torch.randn(3, 3)
    want = persample.loop_per_sample_grads(model, x, y, _gaussian)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = persample.per_sample_grads(model, x, y, _gaussian, check="always")
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-10, atol=1e-12)


def test_a_loss_that_fails_on_the_rows_of_dim_0_leaves_the_identity_undecided():
    """A sequence-first output ``(T, B, C)`` read by a loss that permutes it, at ``B = T``:
    the certificate's cut by dim 0 made ``loss_fn`` fail (torch's batch size error
    escaped the certificate); the identity is now undecided, as for the losses that
    disagree, and the rules' answer stands."""

    class SequenceFirst(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = nn.GRU(3, 4, dtype=torch.float64)
            self.out = nn.Linear(4, 3, dtype=torch.float64)

        def forward(self, x):  # (B, T, 3) -> (T, B, 3)
            return self.out(self.rnn(x.transpose(0, 1))[0])

    def loss(out, y):
        return F.cross_entropy(out.permute(1, 2, 0), y)

    torch.manual_seed(0)
    model, x, y = SequenceFirst(), torch.randn(5, 5, 3), torch.randint(0, 3, (5, 5))
    want = persample.loop_per_sample_grads(model, x, y, loss)
    got = persample.per_sample_grads(model, x, y, loss, check="always")
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-10, atol=1e-12)
