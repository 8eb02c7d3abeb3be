"""Every case of ``cases.py`` through every function, against the loop over samples.

One test per case, method and reduction (ids ``case-method-reduction``), each running
:func:`battery.check` on the case's model in float64: ``per_sample_grads``,
``per_sample_grad_norms`` (total and per parameter) and, where the model returns one
tensor with the batch in dim 0, ``param_jacobian``, each called with the method and
compared with the loop; ``private_grad`` (noise 0, against the clipped mean by hand)
once per case; the model left unchanged.

The axes:

- case: every case of ``cases.CASES`` (the layers, ops and models of ``cases.py``,
  ``cases_layers.py``, ``cases_ops.py``, ``cases_recurrent.py``) and of
  ``cases.EDGE_CASES`` (structures a capture engine can misread);
- method: ``"rules"``, ``"vmap"``, ``"auto"`` and ``"loop"`` (the same functions over
  the loop's per-sample gradients). Any warning that ``auto`` left the rules fails the
  test, and with ``"rules"`` and ``"auto"`` one that torch.func batched an op by its
  slow per-sample fallback too. ``"vmap"`` on a case torch.func cannot batch
  (``vmap=False``, the recurrent layers) is deselected (``conftest.py``), its refusal
  tested in ``test_per_sample_grads.py``; ``param_jacobian(method="vmap")`` on a case
  marked ``vmap_jacobian=False`` must refuse, clearly;
- reduction: how the case's loss reduces over the batch. Each sample's loss is
  evaluated on its own slice of the output, so the reduction only changes what that
  per-sample loss is, which the rules split; every other method gets it the same way,
  so only ``"rules"`` is crossed with both, the others run ``"mean"``.
  ``param_jacobian`` has no loss: it runs in the ``"mean"`` tests; ``private_grad``
  always takes ``method="auto"``: it runs in the ``auto`` test.

The battery itself is tested last: it passes a right answer and fails each kind of
wrong one (a gradient, a norm, a Jacobian, a clipped mean, a path, a warning, a change
to the model).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import Tensor, nn

import battery
import persample
from battery import LEAVING, METHODS, SLOWER, check
from cases import CASE_IDS, CASES, EDGE_CASE_IDS, EDGE_CASES, N, build, jacobian_cases, randn

ALL_CASES = CASES + EDGE_CASES
ALL_IDS = CASE_IDS + EDGE_CASE_IDS
RUNS = [("rules", "mean"), ("rules", "sum"), ("vmap", "mean"), ("auto", "mean"),
        ("loop", "mean")]
JACOBIAN = {c["id"] for c in jacobian_cases()}
# The op rule leaves this configuration to the op's per-sample VJP from torch.func, which
# batches embedding_bag by torch's slow per-sample fallback (its warning is expected; see
# test_layer_rules.py). Every other case must raise no such warning on the rules.
OP_VJP = {"embeddingbag-scale-grad-by-freq"}


def test_enough_cases():
    assert len(CASES) >= 150 and len(EDGE_CASES) >= 6 and len(JACOBIAN) >= 40


@pytest.mark.parametrize("method, reduction", RUNS, ids=[f"{m}-{r}" for m, r in RUNS])
@pytest.mark.parametrize("c", ALL_CASES, ids=ALL_IDS)
def test_matches_loop(c, method, reduction):
    model, inputs, targets = build(c, N)
    jacobian = c["id"] in JACOBIAN and reduction == "mean"
    if jacobian and method == "vmap" and not c.get("vmap_jacobian", True):
        # torch.func gets vmap(jacrev(...)) of F.prelu wrong (torch 2.13: a shape error,
        # or silently wrong rows for the layers before it): refused, naming the layer
        with pytest.raises(persample.UnsupportedModuleError, match=r"\(PReLU\)"):
            persample.param_jacobian(model, inputs, method="vmap")
        jacobian = False
    check(model, inputs, targets, c["loss_fn"](reduction), methods=(method,), paths=None,
          jacobian=jacobian, dp=method == "auto",
          forbid=SLOWER if method in ("rules", "auto") and c["id"] not in OP_VJP else LEAVING)


# ---------------------------------------------------------------------------
# the battery itself: it passes a right answer, and fails a wrong one


def _mse(out: Tensor, y: Tensor) -> Tensor:
    return ((out - y) ** 2).sum(1)


def _mlp() -> tuple[nn.Module, Tensor, Tensor]:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)), randn(3, 4), randn(3, 3)


def _off(grads: dict[str, Tensor], by: float) -> dict[str, Tensor]:
    return {k: g * (1 + by) if k == "0.weight" else g for k, g in grads.items()}


def _wrong_reference(monkeypatch, model, x, y) -> dict:
    """1e-9 relative: within the largest-error criterion, not entry by entry."""
    return {"want": _off(persample.loop_per_sample_grads(model, x, y, _mse), 1e-9)}


def _wrong_norms(monkeypatch, *_) -> dict:
    real = battery.per_sample_grad_norms

    def norms(*args, **kwargs):
        got = real(*args, **kwargs)
        return (got[0] * 1.001, got[1]) if kwargs.get("per_layer") else got * 1.001

    monkeypatch.setattr(battery, "per_sample_grad_norms", norms)
    return {}


def _wrong_jacobian(monkeypatch, *_) -> dict:
    real = battery.loop_param_jacobian
    monkeypatch.setattr(battery, "loop_param_jacobian", lambda *a: _off(real(*a), 1e-3))
    return {"jacobian": True}


def _wrong_clipping(monkeypatch, *_) -> dict:
    real = battery.clipped_mean
    monkeypatch.setattr(battery, "clipped_mean", lambda g, c, d=None: real(g, 1.01 * c, d))
    return {}


def _a_fallback_warning(monkeypatch, *_) -> dict:
    real = battery.per_sample_grads

    def grads(*args, **kwargs):
        warnings.warn("the rules cannot split it. Falling back to method='vmap'", stacklevel=2)
        return real(*args, **kwargs)

    monkeypatch.setattr(battery, "per_sample_grads", grads)
    return {}


def _model_changed(monkeypatch, *_) -> dict:
    real = battery.per_sample_grads

    def grads(model, *args, **kwargs):
        model[0].touched = True
        return real(model, *args, **kwargs)

    monkeypatch.setattr(battery, "per_sample_grads", grads)
    return {}


FAULTS = {  # name: (what the failure says, the fault)
    "wrong-reference": ("per_sample_grads", _wrong_reference),
    "wrong-norms": ("per_sample_grad_norms", _wrong_norms),
    "wrong-jacobian": ("param_jacobian", _wrong_jacobian),
    "wrong-clipping": ("private_grad", _wrong_clipping),
    "wrong-paths": ("rule", lambda *_: {"paths": {"fallback"}}),
    "wrong-path-of-a-parameter": ("rule", lambda *_: {"paths": {"0.weight": "op vjp"}}),
    "a-fallback-warning": ("Falling back", _a_fallback_warning),
    "model-changed": ("touched", _model_changed),
}


def test_the_battery_passes_the_right_answer():
    check(*_mlp(), _mse, methods=METHODS, jacobian=True)


@pytest.mark.parametrize("fault", list(FAULTS))
def test_the_battery_fails_a_wrong_one(fault, monkeypatch):
    match, make = FAULTS[fault]
    model, x, y = _mlp()
    with pytest.raises((AssertionError, UserWarning), match=match):
        check(model, x, y, _mse, **make(monkeypatch, model, x, y))
