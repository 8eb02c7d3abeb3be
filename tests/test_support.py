"""``persample.supported`` (the path each module takes) and ``persample.verify``."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

import persample
from cases import BY_ID, OpaqueGate, Scale, build
from persample import supported, verify


def paths(routes) -> dict[str, tuple[str, tuple[str, ...]]]:
    return {r.module: (r.path, r.params) for r in routes}


def test_static_paths_by_module_type():
    """Without inputs: stock layers are on rules, recurrent layers on their module rule,
    custom modules unknown until run, BatchNorm in training mode unsupported."""
    net = nn.Sequential(nn.Conv2d(1, 2, 3), nn.LSTM(2, 3), Scale(3), nn.Embedding(4, 2),
                        nn.BatchNorm1d(3), nn.Linear(3, 2))
    net[5].bias.requires_grad_(False)
    got = paths(supported(net))
    assert got == {
        "0": ("rule", ("weight", "bias")),
        "1": ("module rule", ("weight_ih_l0", "weight_hh_l0", "bias_ih_l0", "bias_hh_l0")),
        "2": ("unknown", ("weight",)),
        "3": ("rule", ("weight",)),
        "4": ("unsupported", ("weight", "bias")),  # BatchNorm in training mode
        "5": ("rule", ("weight",)),  # the frozen bias is left out
    }
    reasons = {r.module: r.reason for r in supported(net)}
    assert "pass inputs" in reasons["2"]
    assert "model.eval()" in reasons["4"]
    net.eval()
    assert paths(supported(net))["4"] == ("rule", ("weight", "bias"))


def test_rnn_dropout_in_training_mode_is_unsupported():
    lstm = nn.LSTM(2, 3, num_layers=2, dropout=0.5)
    (route,) = supported(lstm)
    assert route.path == "unsupported" and "dropout=0.5" in route.reason
    assert supported(lstm.eval())[0].path == "module rule"


def test_subclass_with_its_own_forward_is_followed_by_its_ops():
    """Unknown from its type; run, its ops (an F.linear and a scale) have rules."""
    class Doubled(nn.Linear):
        def forward(self, x: Tensor) -> Tensor:
            return 2 * super().forward(x)

    model = Doubled(3, 2)
    (route,) = supported(model)
    assert route.path == "unknown"
    (route,) = supported(model, torch.randn(4, 3))
    assert route.path == "rule" and "linear" in route.reason


def test_traced_paths_follow_the_parameters():
    """With inputs: the attention's parameters (out_proj's too) are on the rules of the
    ops it is made of, and a parameter the forward never reads is 'unused'."""
    model, inputs, _ = build(BY_ID["multihead-attention"])
    got = {r.module: r.path for r in supported(model, inputs)}
    assert set(got.values()) == {"rule"} and {"attn", "attn.out_proj", "head"} <= set(got)
    model, inputs, _ = build(BY_ID["unused-params"])
    routes = supported(model, inputs)
    assert paths(routes)["fc"] == ("rule", ("weight", "bias"))
    unused = [p for r in routes if r.path == "unused" for p in (
        f"{r.module}.{q}" if r.module else q for q in r.params)]
    assert sorted(unused) == ["unused_layer.bias", "unused_layer.weight", "unused_param"]


def test_traced_keyword_call_and_functional_use():
    model, inputs, _ = build(BY_ID["linear-called-with-keyword-input"])
    assert paths(supported(model, inputs))["fc"] == ("rule", ("weight", "bias"))
    model, inputs, _ = build(BY_ID["weight-used-functionally"])
    got = paths(supported(model, inputs))
    assert got["fc"] == ("rule", ("weight", "bias"))  # F.linear in the root's forward
    assert got["out"] == ("rule", ("weight", "bias"))


def test_traced_scale_and_opaque_function():
    """A custom module's scale is an op rule; a parameter inside a custom
    autograd.Function (which torch.func refuses too) sends the model to the whole-model
    methods, as the call does, and says why."""
    model = nn.Sequential(nn.Linear(3, 4), Scale(4), nn.Linear(4, 2))
    assert {r.path for r in supported(model, torch.randn(5, 3))} == {"rule"}
    model = nn.Sequential(nn.Linear(3, 4), OpaqueGate(), nn.Linear(4, 2), Scale(2))
    routes = supported(model, torch.randn(5, 3))
    assert {r.path for r in routes} == {"vmap"}
    assert "module '1' (OpaqueGate)" in routes[0].reason


def test_routes_print_as_a_table_and_model_is_unchanged(snapshot):
    model, inputs, _ = build(BY_ID["simple-cnn"])
    state = snapshot(model)
    text = str(supported(model, inputs))
    state.assert_unchanged()
    lines = text.splitlines()
    assert lines[0].split() == ["module", "type", "path", "parameters", "reason"]
    assert len(lines) == 5 and all(" rule " in line for line in lines[1:])


def test_supported_rejects_a_non_module():
    with pytest.raises(TypeError, match="must be a torch.nn.Module"):
        supported(lambda x: x)


@pytest.mark.parametrize("case_id", ["simple-cnn", "lstm-packed", "transformer-encoder-layer",
                                     "tied-embedding-output"])
def test_verify_passes_on_correct_paths(case_id):
    c = BY_ID[case_id]
    model, inputs, targets = build(c, 5)
    report = verify(model, inputs, targets, c["loss_fn"]("mean"), samples=4)
    assert report.ok and report.samples == 4 and report.rtol == 1e-8
    assert set(report.abs_error) == {n for n, p in model.named_parameters() if p.requires_grad}
    assert max(report.rel_error.values()) < 1e-10
    assert str(report).splitlines()[-1] == "OK: 4 samples, rtol 1e-08"


class Gain(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.w


def test_verify_finds_a_wrong_rule():
    """A user's rule that forgets the input: verify reports the parameter."""
    @persample.register_rule(Gain)
    def wrong(layer, activations, backprops, out):
        out["w"].copy_(backprops)  # missing "* activations[0]"

    net = nn.Sequential(nn.Linear(2, 3), Gain())
    x, y = torch.randn(6, 2), torch.randn(6, 3)
    report = verify(net, x, y, nn.MSELoss(), samples=10, method="rules")
    assert not report.ok and report.worst == "1.w" and report.samples == 6
    assert report.rel_error["0.weight"] < 1e-10
    assert "MISMATCH" in str(report)
    with pytest.warns(UserWarning, match="certificate caught"):  # auto: caught, answered
        report = verify(net, x, y, nn.MSELoss())
    assert report.ok and report.method.startswith("vmap")
    assert [c.ok for c in report.certificates] == [False, True]
    assert "1.w" in report.certificates[0].reason


def test_verify_float32_tolerance_and_bad_samples():
    net = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2)).float()
    x, y = torch.randn(3, 4, dtype=torch.float32), torch.randn(3, 2, dtype=torch.float32)
    report = verify(net, x, y, nn.MSELoss())
    assert report.ok and report.rtol == 1e-4 and report.samples == 3
    with pytest.raises(ValueError, match="samples must be a positive int"):
        verify(net, x, y, nn.MSELoss(), samples=0)


def test_verify_reports_the_path_auto_took():
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    x, y = torch.randn(5, 3), torch.randn(5, 2)
    assert verify(model, x, y, nn.MSELoss()).method == "rules"
    model = nn.Sequential(nn.Linear(3, 4), OpaqueGate(), nn.Linear(4, 2))
    with pytest.warns(UserWarning, match="OpaqueGate"):
        report = verify(model, x, y, nn.MSELoss())
    assert report.ok and report.method.startswith("loop: ")  # torch.func cannot run it
    assert "OpaqueGate" in report.method and "method: loop: " in str(report)


def test_supported_with_the_loss_of_the_call():
    """With targets and loss_fn: the call's own loss (here reading only the logits of a
    dict output, so the other output's head is unused); a loss the model computed over
    the batch sends everything to the whole-model methods, with the reason."""
    class TwoHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(3, 2), nn.Linear(3, 2)

        def forward(self, x, labels=None):
            out = {"logits": self.a(x), "other": self.b(x)}
            if labels is not None:
                out["loss"] = nn.functional.cross_entropy(out["logits"], labels)
            return out

    model, x, y = TwoHeads(), torch.randn(4, 3), torch.randint(0, 2, (4,))
    per_sample = lambda out, y: nn.functional.cross_entropy(out["logits"], y,  # noqa: E731
                                                           reduction="none")
    got = paths(supported(model, x, y, per_sample))
    assert got == {"a": ("rule", ("weight", "bias")), "b": ("unused", ("weight", "bias"))}
    routes = supported(model, {"x": x, "labels": y}, None, lambda out, _: out["loss"])
    assert {r.path for r in routes} == {"vmap"}
    assert "per-sample terms" in routes[0].reason


def test_verify_checks_every_sample_by_default(monkeypatch):
    """A fast path wrong in one late sample only is caught by default; four would miss it."""
    import persample.api as api

    real = api.grads_taken

    def wrong_in_sample_24(*args, **kwargs):
        grads, taken = real(*args, **kwargs)
        for g in grads.values():
            if g.shape[0] > 24:
                g[24] += 1.0
        return grads, taken

    monkeypatch.setattr(api, "grads_taken", wrong_in_sample_24)
    net = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2)).double()
    x, y = torch.randn(32, 4, dtype=torch.float64), torch.randn(32, 2, dtype=torch.float64)
    report = verify(net, x, y, nn.MSELoss())
    assert report.samples == 32 and not report.ok
    assert verify(net, x, y, nn.MSELoss(), samples=4).ok


def _perturbed_in(dtypes: tuple[torch.dtype, ...]):
    """grads_taken with sample 24 off by 1e-3 of its scale when the model is in ``dtypes``:
    a stand-in for a float32 near-tie (``(torch.float32,)``) or a real fault (both)."""
    import persample.api as api

    real = api.grads_taken

    def perturbed(model, *args, **kwargs):
        grads, taken = real(model, *args, **kwargs)
        for g in grads.values():
            if g.dtype in dtypes and g.shape[0] > 24:
                g[24] += 1e-3 * g.abs().max()
        return grads, taken

    return perturbed


def test_verify_says_when_a_difference_is_float32_rounding(monkeypatch):
    """A difference in one float32 sample that the float64 copy does not have is
    reported as rounding (naming the model's max-pool); one that stays in float64 is
    not explained away; the model is left in float32."""
    import persample.api as api

    net = nn.Sequential(nn.Conv2d(1, 2, 3), nn.MaxPool2d(2), nn.Flatten(),
                        nn.Linear(2 * 3 * 3, 3)).float()
    x, y = torch.randn(32, 1, 8, 8, dtype=torch.float32), torch.randint(0, 3, (32,))
    monkeypatch.setattr(api, "grads_taken", _perturbed_in((torch.float32,)))
    report = verify(net, x, y, nn.CrossEntropyLoss())
    assert not report.ok and report.mismatched == [24]
    assert report.note.startswith("rounding, not an error: in float64")
    assert "MaxPool2d '1'" in report.note and report.note in str(report)
    assert all(p.dtype == torch.float32 for p in net.parameters())
    monkeypatch.setattr(api, "grads_taken", _perturbed_in((torch.float32, torch.float64)))
    report = verify(net, x, y, nn.CrossEntropyLoss())
    assert report.mismatched == [24] and report.note is None
    assert "samples beyond rtol: 24" in str(report)
