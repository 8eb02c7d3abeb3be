"""``per_sample_grad_dots`` against the loop's per-sample gradients multiplied, in float64.

Every case of ``cases.py`` (the Gram of a batch, and a batch against one of another
size) and the real models of ``zoo.py``; the factor path taken where it is cheaper
(checked by forbidding the materialised one), tied weights' cross terms, ``params=``,
the whole-model methods, bad ``other``.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import Tensor, nn

import persample
from cases import BY_ID, CASE_IDS, CASES, N, TiedLM, build
from persample import loop_per_sample_grads, per_sample_grad_dots
from persample.engine.factored_batch import FactoredBatch
from test_real_models import masked_loop
from zoo import ZOO

REL = 1e-9


def flat(grads: dict[str, Tensor], names=None) -> Tensor:
    return torch.cat([g.flatten(1) for k, g in grads.items() if names is None or k in names],
                     dim=1)


def assert_dots(got: Tensor, want: Tensor, rel: float = REL) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    scale = want.abs().max().clamp(min=1e-30)
    assert ((got - want).abs().max() / scale).item() <= rel, (got, want)


def quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


@pytest.mark.parametrize("c", CASES, ids=CASE_IDS)
def test_gram_and_cross_match_the_loop(c):
    """The (N, N) Gram, and the (N, N + 2) products with a second batch of the same case
    (sizes chosen apart from the first's)."""
    model, x, y = build(c, N)
    _, x2, y2 = build({**c, "seed": c["seed"] + 1}, N + 2)
    loss_fn = c["loss_fn"]("mean")
    g = flat(loop_per_sample_grads(model, x, y, loss_fn))
    g2 = flat(loop_per_sample_grads(model, x2, y2, loss_fn))
    assert_dots(quiet(per_sample_grad_dots, model, x, y, loss_fn), g @ g.T)
    assert_dots(quiet(per_sample_grad_dots, model, x, y, loss_fn, other=(x2, y2)), g @ g2.T)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ZOO))
def test_real_models(name):
    """Hugging Face, peft, timm and torchvision models as users call them: the Gram, and
    the batch against itself through two captures (LeViT against the batch's own
    per-sample losses differentiated, where torch's batch-of-one BatchNorm backward is
    wrong: see test_real_models.masked_loop)."""
    model, inputs, targets, loss_fn = ZOO[name]()
    reference = masked_loop if name == "timm-levit" else loop_per_sample_grads
    g = flat(reference(model, inputs, targets, loss_fn))
    want = g @ g.T
    assert_dots(quiet(per_sample_grad_dots, model, inputs, targets, loss_fn), want, 1e-8)
    assert_dots(quiet(per_sample_grad_dots, model, inputs, targets, loss_fn,
                      other=(inputs, targets)), want, 1e-8)


def test_linear_layers_take_the_factors(monkeypatch):
    """An MLP's Linear weights and biases (T = 1) never materialise: (a_i . a'_j)(g_i .
    g'_j) is far cheaper than forming the rows."""
    def forbidden(self, group):
        raise AssertionError(f"materialised {len(group)} parameters")

    monkeypatch.setattr(FactoredBatch, "grads", forbidden)
    model = nn.Sequential(nn.Linear(30, 40), nn.Tanh(), nn.Linear(40, 5))
    x, y = torch.randn(7, 30), torch.randint(0, 5, (7,))
    x2, y2 = torch.randn(4, 30), torch.randint(0, 5, (4,))
    loss_fn = nn.CrossEntropyLoss()
    got = per_sample_grad_dots(model, x, y, loss_fn, other=(x2, y2), method="rules")
    want = flat(loop_per_sample_grads(model, x, y, loss_fn)) @ \
        flat(loop_per_sample_grads(model, x2, y2, loss_fn)).T
    assert_dots(got, want)


def test_tied_weights_cross_terms():
    """An embedding tied to the output layer: each side's two uses and all four cross
    products, ids against ids and ids against the dense factor."""
    c = BY_ID["tied-embedding-output"]
    model, x, y = build(c, 5)
    _, x2, y2 = build({**c, "seed": 9}, 6)
    loss_fn = c["loss_fn"]("sum")
    assert isinstance(model, TiedLM)
    g = flat(loop_per_sample_grads(model, x, y, loss_fn))
    g2 = flat(loop_per_sample_grads(model, x2, y2, loss_fn))
    assert_dots(per_sample_grad_dots(model, x, y, loss_fn, other=(x2, y2), method="rules"),
                g @ g2.T)


def test_params_and_methods():
    """params= multiplies only the chosen gradients; vmap and loop give the same."""
    model = nn.Sequential(nn.Conv2d(1, 3, 3), nn.ReLU(), nn.Flatten(), nn.Linear(3 * 36, 4))
    x, y = torch.randn(6, 1, 8, 8), torch.randint(0, 4, (6,))
    loss_fn = nn.CrossEntropyLoss()
    grads = loop_per_sample_grads(model, x, y, loss_fn)
    head = ["3.weight", "3.bias"]
    want = flat(grads, head) @ flat(grads, head).T
    for method in ("rules", "vmap", "loop", "auto"):
        assert_dots(per_sample_grad_dots(model, x, y, loss_fn, params=head, method=method),
                    want)
    conv = flat(grads, ["0.weight", "0.bias"])
    assert_dots(per_sample_grad_dots(model, x, y, loss_fn, params=[model[0].weight,
                                                                    model[0].bias]),
                conv @ conv.T)


def test_bad_other_is_named():
    model = nn.Linear(3, 2)
    x, y = torch.randn(4, 3), torch.randint(0, 2, (4,))
    with pytest.raises(ValueError, match="other must be a pair"):
        per_sample_grad_dots(model, x, y, nn.CrossEntropyLoss(), other=x)
    with pytest.raises(ValueError):
        per_sample_grad_dots(model, x, y, nn.CrossEntropyLoss(),
                             other=(torch.randn(5, 3), torch.randint(0, 2, (4,))))


def test_float32_accumulates_in_float32_and_model_untouched(snapshot):
    model = nn.Sequential(nn.Linear(5, 6), nn.ReLU(), nn.Linear(6, 2)).float()
    x, y = torch.randn(8, 5, dtype=torch.float32), torch.randint(0, 2, (8,))
    state = snapshot(model)
    got = persample.per_sample_grad_dots(model, x, y, nn.CrossEntropyLoss())
    state.assert_unchanged()
    g = flat(loop_per_sample_grads(model, x, y, nn.CrossEntropyLoss()))
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, g @ g.T, rtol=1e-4, atol=1e-6)
