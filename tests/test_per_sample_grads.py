"""``per_sample_grads``: its options and edge cases against the loop reference (``flat``,
``out``, chunks, batches of one and zero, dtypes and devices, the keys, losses of every
kind, the fallback of ``auto``).

Every case of ``cases.py`` matching the loop with every method is in
``test_battery.py``.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils._pytree import tree_map

import persample
from battery import METHODS, REDUCTIONS, TOL, assert_grads_equal, flat
from cases import BY_ID, CASE_IDS, CASES, N, OpaqueGate, as_tuple, build, randn
from persample import LossNotPerSampleError, loop_per_sample_grads, per_sample_grads

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def reference(c: dict, n: int = N, reduction: str = "mean"):
    model, inputs, targets = build(c, n)
    loss_fn = c["loss_fn"](reduction)
    return model, inputs, targets, loss_fn, loop_per_sample_grads(model, inputs, targets, loss_fn)


def trainable(model: nn.Module) -> dict[str, nn.Parameter]:
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("chunk_size", [None, 1, 2])
def test_dict_targets_are_split_per_sample_or_refused(method, chunk_size):
    """Targets in a dict: each sample (and chunk) must see its own rows, not the batch's.

    The docstring promises tensors, tuples and None; a dict may be refused with an
    error naming the targets, but must not be silently broadcast. Checked against
    the closed form of a Linear + summed squared error, not against the loop,
    which slices targets too.
    """
    model = nn.Linear(4, 3)
    x, y = randn(4, 4), {"y": randn(4, 3)}

    def loss_fn(out, t):
        return ((out - t["y"]) ** 2).sum()

    try:
        got = per_sample_grads(model, x, y, loss_fn, method=method, chunk_size=chunk_size)
    except (TypeError, ValueError) as err:
        assert "targets" in str(err)
        return
    residual = 2 * (model(x).detach() - y["y"])  # (B, 3)
    torch.testing.assert_close(got["weight"], torch.einsum("no,ni->noi", residual, x))
    torch.testing.assert_close(got["bias"], residual)


def test_reference_is_not_trivial():
    """The loop gives distinct, non-zero rows (else agreeing with it proves little)."""
    _, _, _, _, want = reference(BY_ID["mlp"])
    for g in want.values():
        assert g.abs().sum() > 0
        assert not torch.allclose(g[0], g[1])


def test_rows_are_each_samples_own_gradient():
    """Row i is d loss(x_i, y_i) / d theta, computed here by hand for a Linear + MSE."""
    model = nn.Linear(3, 2)
    x, y = randn(4, 3), randn(4, 2)
    got = per_sample_grads(model, x, y, nn.MSELoss(), method="rules")
    residual = model(x).detach() - y  # (B, 2); per-sample loss mean over 2 outputs
    torch.testing.assert_close(got["weight"], torch.einsum("no,ni->noi", residual, x))
    torch.testing.assert_close(got["bias"], residual)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_scalar_loss_is_evaluated_per_sample_whatever_its_reduction(reduction):
    """A vmappable scalar loss is re-evaluated per sample, so its reduction cannot matter."""
    model, inputs, targets, loss_fn, want = reference(BY_ID["mlp"], 4, reduction)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = per_sample_grads(model, inputs, targets, loss_fn)
    assert_grads_equal(got, want)


def _not_vmappable(reduction: str):
    """Cross-entropy reduced over the batch, with a Python branch on a value (vmap refuses,
    as for any loss calling .item())."""
    def loss_fn(output, targets):
        loss = F.cross_entropy(output, targets, reduction=reduction)
        return loss if loss.item() == loss.item() else loss * 0
    return loss_fn


@pytest.mark.parametrize("method", ["auto", "rules"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_a_loss_that_cannot_be_vmapped_is_evaluated_sample_by_sample(reduction, method):
    """Whatever its reduction: nothing is undone, each sample's slice gets its own call."""
    model, inputs, targets, _, _ = reference(BY_ID["mlp"], 4, "mean")
    loss_fn = _not_vmappable(reduction)
    want = loop_per_sample_grads(model, inputs, targets, loss_fn)
    got = per_sample_grads(model, inputs, targets, loss_fn, method=method)
    assert_grads_equal(got, want)
    assert float(want["0.weight"].abs().max()) > 0


@pytest.mark.parametrize("method", METHODS)
def test_a_per_sample_loss_that_mixes_samples_is_refused(method):
    """A (B,) loss whose entries read other samples (centred by the batch mean): a
    sample's own loss is not defined, and every method says so (the loop too, which
    would answer for each sample alone), naming the op."""
    model, inputs, targets, _, _ = reference(BY_ID["mlp"], 4, "mean")

    def centred(out, y):  # (B,): each entry depends on every sample through the mean
        return ((out - out.mean(0)) ** 2).sum(1) + F.cross_entropy(out, y, reduction="none")

    with pytest.raises(LossNotPerSampleError, match="mixes samples: .*sub"):
        per_sample_grads(model, inputs, targets, centred, method=method)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("c", CASES, ids=CASE_IDS)
def test_flat_is_concatenation_in_parameter_order(c, method):
    model, inputs, targets, loss_fn, want = reference(c)
    got = per_sample_grads(model, inputs, targets, loss_fn, method=method, flat=True)
    total = sum(p.numel() for p in trainable(model).values())
    assert got.shape == (N, total)
    torch.testing.assert_close(got, flat(want), **TOL)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("c", CASES, ids=CASE_IDS)
def test_out_is_written_and_returned(c, method):
    model, inputs, targets, loss_fn, want = reference(c)
    total = sum(p.numel() for p in trainable(model).values())
    out = torch.full((N, total), float("nan"))
    got = per_sample_grads(model, inputs, targets, loss_fn, method=method, out=out)
    assert got is out
    torch.testing.assert_close(out, flat(want), **TOL)


def test_out_may_be_a_column_slice_of_a_wider_buffer():
    """A view with stride(1) == 1 is filled; the columns around it are untouched."""
    model, inputs, targets, loss_fn, want = reference(BY_ID["custom-scale"], 4)
    total = sum(p.numel() for p in trainable(model).values())
    wide = torch.full((4, total + 5), -7.0)
    out = wide[:, 2 : 2 + total]
    got = per_sample_grads(model, inputs, targets, loss_fn, out=out, chunk_size=3)
    assert got is out
    torch.testing.assert_close(out, flat(want), **TOL)
    assert (wide[:, :2] == -7).all() and (wide[:, 2 + total :] == -7).all()


@pytest.mark.parametrize("chunk_size", [1, 2, 3])
@pytest.mark.parametrize("c", CASES, ids=CASE_IDS)
def test_chunks_equal_whole_batch(c, chunk_size):
    model, inputs, targets, loss_fn, want = reference(c, 5)
    whole = per_sample_grads(model, inputs, targets, loss_fn, method="rules")
    got = per_sample_grads(model, inputs, targets, loss_fn, method="rules",
                           chunk_size=chunk_size)
    assert_grads_equal(got, whole, rtol=1e-12, atol=1e-13)
    assert_grads_equal(got, want)


@pytest.mark.parametrize("method", ["vmap", "loop"])
@pytest.mark.parametrize("chunk_size", [2, 7])
def test_chunks_other_methods(method, chunk_size):
    model, inputs, targets, loss_fn, want = reference(BY_ID["tied-embedding-output"], 5)
    got = per_sample_grads(model, inputs, targets, loss_fn, method=method,
                           chunk_size=chunk_size)
    assert_grads_equal(got, want)
    rows = per_sample_grads(model, inputs, targets, loss_fn, method=method,
                            chunk_size=chunk_size, flat=True)
    torch.testing.assert_close(rows, flat(want), **TOL)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("c", CASES, ids=CASE_IDS)
def test_batch_of_one(c, method):
    model, inputs, targets, loss_fn, want = reference(c, 1)
    got = per_sample_grads(model, inputs, targets, loss_fn, method=method)
    assert_grads_equal(got, want)
    assert all(g.shape[0] == 1 for g in got.values())


class MustNotRun(nn.Module):
    """Parameters of several shapes; running it (or its loss) fails the test."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3)
        self.fc = nn.Linear(4, 5)
        self.fc.bias.requires_grad_(False)

    def forward(self, x):
        raise AssertionError("the model was run for an empty batch")


def _loss_must_not_run(out, y):
    raise AssertionError("the loss was computed for an empty batch")


@pytest.mark.parametrize("method", METHODS)
def test_batch_of_zero_is_empty_without_running_the_model(method):
    model = MustNotRun()
    x, y = randn(0, 2, 5, 5), torch.zeros(0, dtype=torch.long)
    got = per_sample_grads(model, x, y, _loss_must_not_run, method=method)
    assert list(got) == ["conv.weight", "conv.bias", "fc.weight"]
    for name, g in got.items():
        p = model.get_parameter(name)
        assert g.shape == (0, *p.shape) and g.dtype == p.dtype and g.device == p.device
    rows = per_sample_grads(model, x, y, _loss_must_not_run, method=method, flat=True)
    assert rows.shape == (0, 3 * 2 * 9 + 3 + 20) and rows.dtype == torch.float64
    out = torch.empty(0, 3 * 2 * 9 + 3 + 20)
    assert per_sample_grads(model, x, y, _loss_must_not_run, method=method, out=out) is out


@pytest.mark.parametrize("c", CASES, ids=CASE_IDS)
def test_batch_of_zero_matches_loop_shapes(c):
    model, inputs, targets, loss_fn, _ = reference(c)
    inputs = tuple(a[:0] for a in as_tuple(inputs))
    targets = tree_map(lambda t: t[:0] if isinstance(t, Tensor) else t, targets)
    got = per_sample_grads(model, inputs, targets, loss_fn)
    want = {name: p.new_zeros((0, *p.shape)) for name, p in trainable(model).items()}
    assert_grads_equal(got, want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_result_dtype_and_device_are_the_parameters(dtype, method, device):
    model = nn.Sequential(nn.Conv1d(2, 3, 3), nn.Flatten(), nn.Linear(9, 4))
    model = model.to(device=device, dtype=dtype)
    x = torch.randn(3, 2, 5, dtype=dtype, device=device)
    y = torch.randint(0, 4, (3,), device=device)
    got = per_sample_grads(model, x, y, nn.CrossEntropyLoss(), method=method)
    for name, p in model.named_parameters():
        assert got[name].dtype == p.dtype and got[name].device == p.device
    rows = per_sample_grads(model, x, y, nn.CrossEntropyLoss(), method=method, flat=True)
    assert rows.dtype == dtype and rows.device == x.device
    want = loop_per_sample_grads(model, x, y, nn.CrossEntropyLoss())
    tol = {"rtol": 1e-4, "atol": 1e-5} if dtype == torch.float32 else {}
    assert_grads_equal(got, want, **tol)


@pytest.mark.parametrize("method", ["rules", "loop"])
def test_mixed_dtypes_keep_each_parameters_dtype(method):
    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(3, 4).double()
            self.b = nn.Linear(4, 2).float()

        def forward(self, x):
            return self.b(torch.tanh(self.a(x)).float()).double()

    model = Mixed()
    x, y = randn(3, 3), randn(3, 2)
    got = per_sample_grads(model, x, y, nn.MSELoss(), method=method)
    assert got["a.weight"].dtype == torch.float64 and got["b.weight"].dtype == torch.float32
    want = loop_per_sample_grads(model, x, y, nn.MSELoss())
    assert_grads_equal(got, want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="one dtype and device"):
        per_sample_grads(model, x, y, nn.MSELoss(), method=method, flat=True)


@pytest.mark.parametrize("c", CASES, ids=CASE_IDS)
def test_keys_are_trainable_parameters_in_order(c):
    model, inputs, targets, loss_fn, _ = reference(c)
    got = per_sample_grads(model, inputs, targets, loss_fn)
    assert list(got) == list(trainable(model))
    for name, p in trainable(model).items():
        assert got[name].shape == (N, *p.shape)


def test_frozen_parameter_is_absent_and_unused_is_zero():
    model, inputs, targets, loss_fn, _ = reference(BY_ID["frozen-params"])
    got = per_sample_grads(model, inputs, targets, loss_fn)
    assert list(got) == ["0.bias", "2.weight"]
    model, inputs, targets, loss_fn, _ = reference(BY_ID["unused-params"])
    got = per_sample_grads(model, inputs, targets, loss_fn, method="rules")
    assert list(got) == ["unused_param", "fc.weight", "fc.bias", "unused_layer.weight",
                         "unused_layer.bias"]
    for name in ["unused_param", "unused_layer.weight", "unused_layer.bias"]:
        assert torch.equal(got[name], torch.zeros_like(got[name]))
    assert got["fc.weight"].abs().sum() > 0


def test_tied_weight_appears_once_and_sums_both_uses():
    model, inputs, targets, loss_fn, want = reference(BY_ID["tied-embedding-output"])
    got = per_sample_grads(model, inputs, targets, loss_fn, method="rules")
    assert list(got) == ["emb.weight", "mix.weight", "mix.bias", "out.bias"]
    # Untying the weight gives the two contributions separately; their sum is the tied row.
    untied = BY_ID["tied-embedding-output"]["module_fn"]().to(torch.float64)
    untied.load_state_dict(model.state_dict())
    untied.out.weight = nn.Parameter(model.emb.weight.detach().clone())
    parts = per_sample_grads(untied, inputs, targets, loss_fn, method="rules")
    assert parts["emb.weight"].abs().sum() > 0 and parts["out.weight"].abs().sum() > 0
    torch.testing.assert_close(got["emb.weight"], parts["emb.weight"] + parts["out.weight"])
    assert_grads_equal(got, want)


def test_embedding_padding_row_is_zero():
    model, inputs, targets, loss_fn, want = reference(BY_ID["embedding-repeated-ids-padding-idx"])
    assert (inputs == 0).any()
    got = per_sample_grads(model, inputs, targets, loss_fn, method="rules")
    assert torch.equal(got["weight"][:, 0], torch.zeros_like(got["weight"][:, 0]))
    assert_grads_equal(got, want)


def test_sample_independent_of_the_rest_of_the_batch():
    """Row 0 does not change when the other samples do (no mixing through the engine)."""
    model, inputs, targets, loss_fn, _ = reference(BY_ID["simple-cnn"], 4)
    a = per_sample_grads(model, inputs, targets, loss_fn, method="rules")
    inputs2 = inputs.clone()
    inputs2[1:] = torch.randn_like(inputs2[1:])
    b = per_sample_grads(model, inputs2, targets, loss_fn, method="rules")
    for name in a:
        torch.testing.assert_close(a[name][0], b[name][0], rtol=1e-12, atol=1e-13)
        assert not torch.allclose(a[name][1], b[name][1])



def test_auto_falls_back_to_loop_with_a_warning():
    model = nn.Sequential(nn.Linear(3, 4), OpaqueGate(), nn.Linear(4, 2))
    x, y = randn(3, 3), randn(3, 2)
    want = loop_per_sample_grads(model, x, y, nn.MSELoss())
    with pytest.raises(persample.UnsupportedModuleError, match="module '1' \\(OpaqueGate\\)"):
        per_sample_grads(model, x, y, nn.MSELoss(), method="rules")
    with pytest.warns(UserWarning, match="method='loop'"):
        got = per_sample_grads(model, x, y, nn.MSELoss(), method="auto")
    assert_grads_equal(got, want)


@pytest.mark.parametrize("form", ["columns", "right", "ex", "vectors"])
@pytest.mark.parametrize("what", ["grads", "jacobian"])
def test_vmap_of_a_broadcast_solve_is_exact(form, what):
    """torch.func's batched gradient of ``linalg.solve``/``solve_ex`` whose operands
    broadcast (a shared matrix against a sample's ``(1, C, 1)`` columns, as a sample of a
    batch of one presents them) is wrong in torch 2.13; persample's ``method="vmap"``
    expands the operands first. Uncertified (``check="never"``), with a per-sample sum
    (the batch's mean loss hid the error) and the batch size equal to the matrix's."""
    model, inputs, targets = build(BY_ID[f"solve-{form}"], N)

    def loss(out: Tensor, y: Tensor) -> Tensor:
        return ((out - y) ** 2 * torch.arange(1.0, N + 1)).sum(1)

    if what == "grads":
        got = per_sample_grads(model, inputs, targets, loss, method="vmap", check="never")
        assert_grads_equal(got, loop_per_sample_grads(model, inputs, targets, loss))
    else:
        got = persample.param_jacobian(model, inputs, method="vmap", check="never")
        assert_grads_equal(got, persample.loop_param_jacobian(model, inputs))


@pytest.mark.parametrize("c", [c for c in CASES if not c["vmap"]],
                         ids=[c["id"] for c in CASES if not c["vmap"]])
def test_vmap_refuses_recurrent_models(c):
    """torch.func cannot batch the fused RNN kernels: a clear error, not a shape error."""
    model, inputs, targets, loss_fn, _ = reference(c)
    with pytest.raises(persample.UnsupportedModuleError, match=r"method='vmap'.*'rnn|'lstm"):
        per_sample_grads(model, inputs, targets, loss_fn, method="vmap")
    with pytest.raises(persample.UnsupportedModuleError, match=r"no batching rule"):
        persample.param_jacobian(model, inputs, method="vmap")
