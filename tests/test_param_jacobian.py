"""``param_jacobian``: its options against the loop of ``autograd.grad`` over samples
and outputs (``loop_param_jacobian``), in float64: chunks, ``flat`` and ``out``, a batch
of one, shapes, refusals, the model left unchanged.

The cases used are those of ``cases.py`` whose model returns one tensor with the batch
in dim 0 (``cases.jacobian_cases``); the rules get a leading cotangent dim of ``Y``
one-hot output directions. Every one of them matching the loop with every method is
in ``test_battery.py``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import persample
from battery import TOL, assert_grads_equal
from cases import as_tuple, build, jacobian_cases
from persample import loop_param_jacobian, param_jacobian

JAC_CASES = jacobian_cases()
JAC_IDS = [c["id"] for c in JAC_CASES]


def reference(c: dict, n: int = 3):
    model, inputs, _ = build(c, n)
    return model, inputs, loop_param_jacobian(model, inputs)


def refused_by_vmap(c: dict, method: str) -> bool:
    """``method="vmap"`` on a case marked ``vmap_jacobian=False``: torch.func gets
    ``vmap(jacrev(...))`` of its model wrong (``F.prelu`` in torch 2.13: a shape error,
    or silently wrong rows for the layers before it), so it must refuse, clearly."""
    if method == "vmap" and not c.get("vmap_jacobian", True):
        model, inputs, _ = build(c)
        with pytest.raises(persample.UnsupportedModuleError, match=r"\(PReLU\)"):
            param_jacobian(model, inputs, method="vmap")
        return True
    return False


@pytest.mark.parametrize("method", ["auto", "vmap"])
@pytest.mark.parametrize("chunk_size", [1, 2, 5, 7, 1000])
@pytest.mark.parametrize("c", JAC_CASES[::4], ids=JAC_IDS[::4])
def test_chunked_over_samples_and_outputs(c, chunk_size, method):
    if refused_by_vmap(c, method):
        return
    model, inputs, want = reference(c)
    got = param_jacobian(model, inputs, chunk_size=chunk_size, method=method)
    assert_grads_equal(got, want)


@pytest.mark.parametrize("c", JAC_CASES[::3], ids=JAC_IDS[::3])
def test_flat_and_out(c):
    model, inputs, want = reference(c)
    n = as_tuple(inputs)[0].shape[0]
    params = trainable(model).values()
    flat_want = torch.cat([t.reshape(n, t[0].numel() // p.numel(), p.numel())
                           for t, p in zip(want.values(), params)], dim=2)  # (B, Y, P)
    got = param_jacobian(model, inputs, flat=True)
    torch.testing.assert_close(got, flat_want, **TOL)
    out = torch.full_like(flat_want, float("nan"))
    assert param_jacobian(model, inputs, out=out) is out
    torch.testing.assert_close(out, flat_want, **TOL)


def trainable(model: nn.Module) -> dict[str, nn.Parameter]:
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def test_the_questions_mlp_shape_and_values():
    """The MLP 784 -> 20 -> 10 of the question of computing (B, Y, P) Jacobians:
    (B, Y, P) = (B, 10, 15910)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(784, 20), nn.ReLU(), nn.Linear(20, 10))
    x = torch.randn(4, 784)
    got = param_jacobian(net, x, flat=True)
    assert got.shape == (4, 10, 15910)
    want = torch.cat([t.flatten(2) for t in loop_param_jacobian(net, x).values()], dim=2)
    torch.testing.assert_close(got, want, **TOL)


def test_multi_dimensional_output_keeps_its_shape():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 2, 3), nn.Flatten(), nn.Linear(72, 10),
                        nn.Unflatten(1, (2, 5)))
    x = torch.randn(3, 3, 8, 8)
    got = param_jacobian(net, x)
    assert got["2.weight"].shape == (3, 2, 5, 10, 72)
    assert_grads_equal(got, loop_param_jacobian(net, x))


def test_batch_of_one():
    c = JAC_CASES[0]
    model, inputs, want = reference(c, 1)
    assert_grads_equal(param_jacobian(model, inputs), want)


def test_model_left_unchanged(snapshot):
    c = JAC_CASES[0]
    model, inputs, _ = reference(c)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    state = snapshot(model)
    param_jacobian(model, inputs)
    state.assert_unchanged()


def test_output_not_a_batched_tensor_is_refused():
    class Pair(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 2)

        def forward(self, x):
            return self.lin(x), x

    with pytest.raises(ValueError, match="one tensor with the batch"):
        param_jacobian(Pair(), torch.randn(4, 3))


def test_wrong_out_is_refused():
    net = nn.Linear(3, 2)
    with pytest.raises(ValueError, match="out has shape"):
        param_jacobian(net, torch.randn(4, 3), out=torch.empty(4, 8))


def test_exported():
    assert persample.param_jacobian is param_jacobian
