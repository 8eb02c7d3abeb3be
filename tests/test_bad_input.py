"""Bad input: a clear error that names the problem (and the fix), and an untouched model."""

from __future__ import annotations

import warnings
from collections import OrderedDict

import pytest
import torch
from torch import nn

import persample
from battery import METHODS, assert_grads_equal
from cases import TwoInputs, randn
from persample import loop_per_sample_grads, per_sample_grads


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))


def data(n: int = 3):
    return randn(n, 4), torch.randint(0, 3, (n,))


def num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("n_targets", [2, 4])
def test_targets_with_wrong_batch_length(n_targets, method, snapshot):
    model = mlp()
    x, _ = data(3)
    y = torch.randint(0, 3, (n_targets,))
    state = snapshot(model)
    with pytest.raises(ValueError, match=rf"targets has shape \({n_targets},\).*batch size is 3"):
        per_sample_grads(model, x, y, nn.CrossEntropyLoss(), method=method)
    state.assert_unchanged()


def test_second_input_with_wrong_batch_length(snapshot):
    """A tensor input without the batch size in dim 0 is shared by all samples (as a
    position table would be); here the model cannot combine it with the batch, and its
    own error comes with a note naming the module."""
    model = TwoInputs()
    state = snapshot(model)
    with pytest.raises(RuntimeError) as caught:
        per_sample_grads(model, (randn(3, 4), randn(2, 2, 5)), randn(3, 3), nn.MSELoss())
    assert any("TwoInputs" in note for note in caught.value.__notes__)
    state.assert_unchanged()


def bn_model(**bn_kwargs) -> nn.Module:
    features = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2, **bn_kwargs), nn.ReLU())
    return nn.Sequential(OrderedDict(
        features=features, flatten=nn.Flatten(), head=nn.Linear(2 * 3 * 3, 3)))


@pytest.mark.parametrize("method", METHODS)
def test_batchnorm_in_training_mode(method, snapshot):
    model = bn_model().train()
    x, y = randn(3, 1, 5, 5), torch.randint(0, 3, (3,))
    state = snapshot(model)  # includes the running statistics
    with pytest.raises(ValueError, match=r"'features\.1' \(BatchNorm2d\)") as err:
        per_sample_grads(model, x, y, nn.CrossEntropyLoss(), method=method)
    assert "eval()" in str(err.value) and "GroupNorm" in str(err.value)
    assert "samples are mixed" in str(err.value)
    state.assert_unchanged()
    assert int(model.features[1].num_batches_tracked) == 0  # the model never ran


def test_batchnorm_without_running_stats_in_eval_mode(snapshot):
    model = bn_model(track_running_stats=False).eval()
    x, y = randn(3, 1, 5, 5), torch.randint(0, 3, (3,))
    state = snapshot(model)
    with pytest.raises(ValueError, match=r"'features\.1' \(BatchNorm2d\).*"
                       r"track_running_stats=True.*GroupNorm"):
        per_sample_grads(model, x, y, nn.CrossEntropyLoss())
    state.assert_unchanged()


def test_batchnorm_in_eval_mode_is_fine():
    model = bn_model().eval()
    x, y = randn(3, 1, 5, 5), torch.randint(0, 3, (3,))
    got = per_sample_grads(model, x, y, nn.CrossEntropyLoss(), method="rules")
    assert_grads_equal(got, loop_per_sample_grads(model, x, y, nn.CrossEntropyLoss()))


@pytest.mark.parametrize("model_fn", [
    lambda: nn.Sequential(nn.ReLU(), nn.Tanh()),
    lambda: mlp().requires_grad_(False),
], ids=["no-parameters", "all-frozen"])
def test_no_trainable_parameters(model_fn, snapshot):
    model = model_fn()
    state = snapshot(model)
    with pytest.raises(ValueError, match="no parameters with requires_grad=True"):
        per_sample_grads(model, randn(3, 4), randn(3, 4), nn.MSELoss())
    state.assert_unchanged()


@pytest.mark.parametrize("method", ["rules", "auto"])
def test_loss_neither_per_sample_nor_scalar(method, snapshot):
    model = mlp()
    x, _ = data(3)
    state = snapshot(model)
    loss = nn.MSELoss(reduction="none")  # (B, 3) for a (B, 3) output
    with pytest.raises(ValueError, match=r"loss_fn returned shape \(3, 3\).*\(3,\) or a scalar"):
        per_sample_grads(model, x, randn(3, 3), loss, method=method)
    state.assert_unchanged()

    def two_columns(out, y):  # (B, 2)
        return out[:, :2] ** 2

    with pytest.raises(ValueError, match=r"loss_fn returned shape \(3, 2\)"):
        per_sample_grads(model, x, None, two_columns, method=method)
    state.assert_unchanged()


def test_out_of_wrong_shape(snapshot):
    model = mlp()
    x, y = data(3)
    p = num_params(model)
    state = snapshot(model)
    for shape in [(3, p + 1), (4, p), (3 * p,), (3, p, 1)]:
        out = torch.zeros(shape)
        with pytest.raises(ValueError, match=rf"out has shape .*\(3, {p}\)"):
            per_sample_grads(model, x, y, nn.CrossEntropyLoss(), out=out)
        assert (out == 0).all()
    state.assert_unchanged()


def test_out_of_wrong_dtype(snapshot):
    model = mlp()  # float64
    x, y = data(3)
    out = torch.zeros(3, num_params(model), dtype=torch.float32)
    state = snapshot(model)
    with pytest.raises(ValueError, match=r"out is torch\.float32.*torch\.float64"):
        per_sample_grads(model, x, y, nn.CrossEntropyLoss(), out=out)
    assert (out == 0).all()
    state.assert_unchanged()


def test_out_not_contiguous_along_columns(snapshot):
    model = mlp()
    x, y = data(3)
    out = torch.zeros(num_params(model), 3).t()  # right shape, stride(1) == P
    state = snapshot(model)
    with pytest.raises(ValueError, match="must be contiguous along"):
        per_sample_grads(model, x, y, nn.CrossEntropyLoss(), out=out)
    state.assert_unchanged()


@pytest.mark.parametrize("kwargs, pattern", [
    ({"method": "fast"}, r"method='fast' is not one of"),
    ({"method": "Rules"}, r"method='Rules' is not one of"),
    ({"chunk_size": 0}, r"chunk_size must be a positive int or None, got 0"),
    ({"chunk_size": -2}, r"chunk_size must be a positive int or None, got -2"),
    ({"chunk_size": 1.5}, r"chunk_size must be a positive int or None, got 1\.5"),
], ids=["method", "method-case", "chunk-0", "chunk-neg", "chunk-float"])
def test_bad_options(kwargs, pattern, snapshot):
    model = mlp()
    x, y = data(3)
    state = snapshot(model)
    with pytest.raises(ValueError, match=pattern):
        per_sample_grads(model, x, y, nn.CrossEntropyLoss(), **kwargs)
    state.assert_unchanged()


class FlattensBatch(nn.Module):
    """Reshapes (B, T, F) to (B * T, F) before a Linear and back."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        b, t, f = x.shape
        return self.fc(x.reshape(b * t, f)).reshape(b, t, 2).sum(1)


@pytest.mark.parametrize("method", ["rules", "auto", "vmap"])
def test_reshape_that_merges_the_batch_dim(method, snapshot):
    """``(B*T, F)`` rows: the Linear rule sums each sample's rows (T == B here)."""
    model = FlattensBatch()
    x, y = randn(3, 3, 4), randn(3, 2)
    state = snapshot(model)
    got = per_sample_grads(model, x, y, nn.MSELoss(), method=method)
    assert_grads_equal(got, loop_per_sample_grads(model, x, y, nn.MSELoss()))
    assert {r.path for r in persample.supported(model, x)} == {"rule"}
    state.assert_unchanged()


def inplace_relu_model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 5), nn.ReLU(inplace=True), nn.Linear(5, 3))


@pytest.mark.parametrize("method", ["rules", "auto", "vmap", "loop"])
def test_inplace_relu_after_linear(method, snapshot):
    """The in-place ReLU overwrites the Linear's output: the backprops come from the
    autograd node that made it, so the rules stay exact and fast."""
    model = inplace_relu_model()
    x, y = data(3)
    want = loop_per_sample_grads(nn.Sequential(model[0], nn.ReLU(), model[2]), x, y,
                                 nn.CrossEntropyLoss())
    state = snapshot(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = per_sample_grads(model, x, y, nn.CrossEntropyLoss(), method=method)
    assert_grads_equal(got, want)
    state.assert_unchanged()


@pytest.mark.parametrize("inputs", [torch.tensor(2.0), 3.0, (), [None]],
                         ids=["0-d-tensor", "float", "empty-tuple", "no-tensor"])
def test_inputs_without_a_batch(inputs, snapshot):
    model = mlp()
    state = snapshot(model)
    with pytest.raises((TypeError, ValueError), match="batch"):
        per_sample_grads(model, inputs, None, nn.MSELoss())
    state.assert_unchanged()


def test_model_that_is_not_a_module():
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        per_sample_grads(lambda x: x, randn(3, 4), None, nn.MSELoss())


class LearnedVariance(nn.Module):
    """A mean per sample and a variance made from a parameter alone, expanded to the
    batch (a homoscedastic Gaussian): ``(mu (B, C), var (B, C))``, or the variance
    unexpanded ``(C,)`` (``expanded=False``)."""

    def __init__(self, expanded: bool = True):
        super().__init__()
        self.expanded = expanded
        self.mean, self.log_var = nn.Linear(3, 3), nn.Parameter(torch.linspace(-1, 1, 3))

    def forward(self, x):
        mu = self.mean(x)
        return mu, self.log_var.exp().expand_as(mu) if self.expanded else self.log_var.exp()


def _gaussian(out, y):
    return torch.nn.functional.gaussian_nll_loss(out[0], y, out[1].expand_as(out[0]))


def test_an_output_made_from_parameters_expanded_to_the_batch():
    """Each sample's loss gets such an output whole beside its own rows of the others,
    where its forward alone would have made it a sample's: the rules refuse, naming it,
    and ``auto`` answers by the whole model's methods (it raised torch's shape error)."""
    torch.manual_seed(0)
    model, x, y = LearnedVariance(), randn(5, 3), randn(5, 3)
    want = loop_per_sample_grads(model, x, y, _gaussian)
    with pytest.raises(persample.NeedsWholeModel, match=r"output\[1\] holds no sample"):
        per_sample_grads(model, x, y, _gaussian, method="rules")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert_grads_equal(per_sample_grads(model, x, y, _gaussian), want)


@pytest.mark.parametrize("what", ["dots", "projector", "private_grad", "PrivateStep"])
def test_complex_parameters_are_refused_where_real_ones_are_needed(what):
    """Inner products, projections and a DP step of complex gradients are not defined
    here: a TypeError naming the parameter (they crashed in torch's casts);
    ``per_sample_grads`` takes them."""
    from persample import dp

    class Complex(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(3, 4, dtype=torch.complex128))

        def forward(self, x):
            return (x.to(torch.complex128) @ self.w.T).abs()

    model, x, y, mse = Complex(), randn(5, 4), randn(5, 3), nn.MSELoss()
    assert per_sample_grads(model, x, y, mse)["w"].dtype == torch.complex128
    calls = {
        "dots": lambda: persample.per_sample_grad_dots(model, x, y, mse),
        "projector": lambda: persample.GradientProjector(model, 4)(x, y, mse),
        "private_grad": lambda: dp.private_grad(model, x, y, mse, max_grad_norm=1.0,
                                                noise_multiplier=0.0),
        "PrivateStep": lambda: dp.PrivateStep(model, mse, max_grad_norm=1.0,
                                              noise_multiplier=0.0, expected_batch_size=5),
    }
    with pytest.raises(TypeError, match="parameter 'w' is complex128"):
        calls[what]()


def test_packed_bags_of_one_dimensional_ids_are_refused_by_name():
    """``EmbeddingBag(ids, offsets)`` with the batch's ids packed into one 1-d tensor
    (not the batch's size in dim 0: shared, to persample) and a per-sample offset: each
    sample's bag ends at the next sample's offset, so the rules name the op and the two
    forms that keep samples apart (its output passed uncut to each sample's loss gave
    torch's batch size error)."""

    class Bags(nn.Module):
        def __init__(self):
            super().__init__()
            self.bags, self.out = nn.EmbeddingBag(10, 4, mode="mean"), nn.Linear(4, 2)

        def forward(self, offsets, ids):
            return self.out(self.bags(ids, offsets))

    offsets, ids = torch.arange(7) * 2, torch.randint(0, 10, (14,))
    with pytest.raises(persample.LossNotPerSampleError, match=r"embedding_bag.*PackedRows"):
        per_sample_grads(Bags(), (offsets, ids), torch.randint(0, 2, (7,)),
                         nn.CrossEntropyLoss(), method="rules")
