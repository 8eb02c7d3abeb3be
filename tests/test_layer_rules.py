"""The op rules of ConvTranspose, InstanceNorm, RMSNorm, BatchNorm (eval), PReLU, Bilinear and
EmbeddingBag: really used by ``method="rules"`` (``supported`` reports what the call
does), and the configurations the cases of ``cases_layers.py`` cannot hold (models
``method="vmap"`` cannot run).

Float64, tight tolerances, against the loop reference (``battery.check``: every function
with the rules and ``auto``, the paths ``supported`` reports, the model unchanged).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import battery
import persample
import persample.rules as rules_module
from battery import LEAVING, TOL, check
from cases import BY_ID, as_tuple, build
from cases_layers import LAYER_CASES
from persample import (
    loop_per_sample_grads,
    per_sample_grad_norms,
    per_sample_grads,
)

NEW_TYPES = (
    nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d,
    nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d, nn.RMSNorm,
    nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.PReLU, nn.Bilinear, nn.EmbeddingBag,
)
# Configurations the op rule leaves to the exact per-sample VJP of the op, and why.
FALLBACK = {"embeddingbag-scale-grad-by-freq": "scale_grad_by_freq=True"}
RULE_CASES = [c for c in LAYER_CASES if c["id"] not in FALLBACK]


@pytest.fixture
def ghosts(patch_spec, monkeypatch):
    """Wrap the norm rules of ``F.bilinear`` and ``F.embedding_bag``; the list holds the
    weight of each op whose norm rule returned norms (did not decline). The rules run at
    every call (a cached call's replay of them would run none)."""
    from persample.engine import replay

    monkeypatch.setattr(replay, "ENABLED", [False])
    took: list[Tensor] = []
    for func in (F.bilinear, F.embedding_bag):
        norm = rules_module.spec_of(func).norm

        def spy(call, g, wanted, norm=norm):
            got = norm(call, g, wanted)
            took.append(call.arg(2, "weight") if call.func is F.bilinear
                        else call.arg(1, "weight"))
            return got

        patch_spec(func, norm=spy)
    return took


def new_layers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, NEW_TYPES)
            and any(p.requires_grad for p in m.parameters(recurse=False))]


@pytest.mark.parametrize("c", RULE_CASES, ids=[c["id"] for c in RULE_CASES])
def test_rules_are_used_without_vmap(c):
    """Every parameter of the case (those of its new layers among them) goes through an
    op rule: no fallback, no vmap warning."""
    model, inputs, targets = build(c)
    assert any(isinstance(m, NEW_TYPES) for m in model.modules())
    check(model, inputs, targets, c["loss_fn"]("sum"), jacobian=True)


@pytest.mark.parametrize("case_id", list(FALLBACK))
def test_fallback_configurations(case_id):
    """The configurations the op rule leaves to the op's exact per-sample VJP ("op vjp"),
    which gets them right."""
    c = BY_ID[case_id]
    model, inputs, targets = build(c)
    (route,) = persample.supported(model, inputs)  # the bag is the model
    assert route.path == "op vjp" and FALLBACK[case_id] in route.reason
    # torch.func batches the op by its slow per-sample fallback: that warning is expected
    check(model, inputs, targets, c["loss_fn"]("mean"), paths={"op vjp"}, forbid=LEAVING)


GHOST_CASES = [c for c in RULE_CASES
               if any(isinstance(m, (nn.Bilinear, nn.EmbeddingBag)) for m in build(c)[0].modules())]


# Bilinear over T > 1 positions of few features: materialising is cheaper.
MATERIALISED = {"bilinear-extra-dims", "bilinear-extra-dims-nobias"}


@pytest.mark.parametrize("c", GHOST_CASES, ids=[c["id"] for c in GHOST_CASES])
def test_norm_rules_take_the_ghost_path(c, ghosts):
    """Bilinear and EmbeddingBag norms without their per-sample gradients."""
    model, inputs, targets = build(c)
    loss_fn = c["loss_fn"]("mean")
    check(model, inputs, targets, loss_fn)
    ghosts.clear()
    per_sample_grad_norms(model, inputs, targets, loss_fn, method="rules", per_layer=True)
    expected = [] if c["id"] in MATERIALISED else [
        m.weight for m in new_layers(model) if isinstance(m, (nn.Bilinear, nn.EmbeddingBag))]
    assert {id(w) for w in ghosts} == {id(w) for w in expected}


class OverPositions(nn.Module):
    def __init__(self, i: int, j: int, o: int):
        super().__init__()
        self.bil = nn.Bilinear(i, j, o)

    def forward(self, x1: Tensor, x2: Tensor) -> Tensor:
        return self.bil(x1, x2)


@pytest.mark.parametrize("features, ghost", [((2, 3, 2), False), ((6, 5, 4), True)])
def test_bilinear_norm_rule_over_positions(features, ghost, ghosts):
    """``T = 4`` positions: Gram matrices when ``T^2 (o + i + j) <= T o i j``, else the
    per-sample gradients; the norms are right either way."""
    i, j, o = features
    model = OverPositions(i, j, o).double()
    x = (torch.randn(3, 4, i), torch.randn(3, 4, j))
    y = torch.randn(3, 4, o)
    check(model, x, y, nn.MSELoss())
    ghosts.clear()
    per_sample_grad_norms(model, x, y, nn.MSELoss(), method="rules", per_layer=True)
    assert [id(w) for w in ghosts] == ([id(model.bil.weight)] if ghost else [])


# ---------------------------------------------------------------------------
# EmbeddingBag with bags of any length: flat ids and offsets built from each
# sample's length (data-dependent shapes: the loop and the rules only)


class VariableBags(nn.Module):
    """``model(ids (B, L), lengths (B,), weights (B, L))``: bag ``i`` is ``ids[i, :lengths[i]]``,
    passed to the EmbeddingBag as flat ids with offsets (empty bags included)."""

    def __init__(self, mode: str, include_last_offset: bool, padding_idx: int | None,
                 weighted: bool):
        super().__init__()
        self.bag = nn.EmbeddingBag(6, 3, mode=mode, include_last_offset=include_last_offset,
                                   padding_idx=padding_idx)
        self.weighted = weighted

    def forward(self, ids: Tensor, lengths: Tensor, weights: Tensor) -> Tensor:
        keep = torch.arange(ids.shape[1]) < lengths.unsqueeze(1)  # (B, L)
        offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])  # (B + 1,)
        if not self.bag.include_last_offset:
            offsets = offsets[:-1]
        flat_weights = weights[keep] if self.weighted else None
        return self.bag(ids[keep], offsets, flat_weights)  # (B, 3)


@pytest.mark.parametrize("padding_idx", [None, 2])
@pytest.mark.parametrize("include_last_offset", [False, True], ids=["", "last-offset"])
@pytest.mark.parametrize("mode, weighted", [("sum", False), ("sum", True), ("mean", False),
                                            ("max", False)],
                         ids=["sum", "sum-weighted", "mean", "max"])
def test_embedding_bag_variable_offsets(mode, weighted, include_last_offset, padding_idx):
    """``ids[keep]``: each kept position is its sample's (the mask's values); the offsets
    from ``lengths.cumsum(0)`` mix samples but only place them."""
    torch.manual_seed(0)
    model = VariableBags(mode, include_last_offset, padding_idx, weighted)
    x = (torch.randint(0, 4, (6, 5)), torch.tensor([2, 0, 5, 1, 3, 4]), torch.randn(6, 5))
    y = torch.randn(6, 3)
    # sample 1's bag is empty: its gradient is zero
    check(model, x, y, nn.MSELoss(), jacobian=True, paths={"bag.weight": "rule"},
          nonzero=False)


# ---------------------------------------------------------------------------
# InstanceNorm in training mode with running statistics


def instance_norm_training() -> nn.Module:
    net = nn.Sequential(nn.Conv1d(2, 3, 2), nn.InstanceNorm1d(3, affine=True,
                                                              track_running_stats=True))
    return net.double().train()


def test_instance_norm_training_with_running_stats():
    """Normalised with each sample's own statistics: the rule matches the loop."""
    model = instance_norm_training()
    check(model, torch.randn(3, 2, 5), torch.randn(3, 3, 4), nn.MSELoss())


@pytest.mark.parametrize("method", ["rules", "auto", "loop"])
def test_instance_norm_training_with_running_stats_leaves_buffers(snapshot, method):
    """The forward updates the running statistics; every function restores them."""
    model = instance_norm_training()
    x, y = torch.randn(3, 2, 5), torch.randn(3, 3, 4)
    state = snapshot(model)
    loop_per_sample_grads(model, x, y, nn.MSELoss())
    state.assert_unchanged()
    check(model, x, y, nn.MSELoss(), methods=(method,), jacobian=True)


# ---------------------------------------------------------------------------
# direct calls of the rules


def test_bilinear_flat_result_is_exact():
    """A flat result: the weight's ``(o, i, j)`` block is a strided view of the buffer."""
    model = OverPositions(3, 2, 4).double()
    x, y = (torch.randn(5, 3), torch.randn(5, 2)), torch.randn(5, 4)
    flat = per_sample_grads(model, x, y, nn.MSELoss(), flat=True, method="rules")
    want = loop_per_sample_grads(model, x, y, nn.MSELoss())
    torch.testing.assert_close(flat, battery.flat(want), **TOL)


@pytest.mark.parametrize("layer, x", [
    (nn.ConvTranspose2d(2, 2, 3), torch.randn(2, 4, 4)),
    (nn.InstanceNorm2d(2, affine=True), torch.randn(2, 4, 4)),
], ids=["conv-transpose", "instance-norm"])
def test_unbatched_input_mixes_samples(layer, x):
    """An unbatched input ``(C, H, W)`` whose dim 0 passes for a batch: the op mixes its
    dim 0 (channels), so the rules refuse, naming the module; ``auto`` warns and tries
    torch.func and the loop, which cannot run a slice of it either: their error comes
    with the reason the rules gave."""
    layer = layer.double()
    y = torch.randn_like(layer(x.double()))
    with pytest.raises(ValueError, match="unbatched input.*in module '<root>'"):
        per_sample_grads(layer, x.double(), y, nn.MSELoss(), method="rules")
    with pytest.warns(UserWarning, match="unbatched input"):
        with pytest.raises(Exception) as caught:
            per_sample_grads(layer, x.double(), y, nn.MSELoss())
    assert any("unbatched input" in note for note in caught.value.__notes__)


def test_batch_norm_rule_refuses_training_mode():
    """checks.py refuses it first, naming the module and the fix."""
    layer = nn.BatchNorm1d(3).double()
    with pytest.raises(ValueError, match="model.eval"):
        per_sample_grads(layer, torch.randn(4, 3), torch.randn(4, 3), nn.MSELoss())


def test_cases_hold_every_new_layer():
    kinds = {type(m) for c in LAYER_CASES for m in build(c)[0].modules()}
    assert set(NEW_TYPES) <= kinds
    assert all(isinstance(as_tuple(build(c)[1])[0], Tensor) for c in LAYER_CASES)
