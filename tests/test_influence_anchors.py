"""Influence scores against kronfluence's (the same model, data, empirical Fisher and
damping heuristic, in float64), for each of its strategies."""

from __future__ import annotations

import copy

import pytest
import torch
from kronfluence.analyzer import Analyzer, prepare_model  # set-up: --no-deps
from kronfluence.arguments import FactorArguments, ScoreArguments
from kronfluence.task import Task
from torch import nn
from torch.utils.data import TensorDataset

import persample


class Classification(Task):
    """Summed cross-entropy, as kronfluence's examples write it."""

    def compute_train_loss(self, batch, model, sample=False):
        x, y = batch
        logits = model(x)
        if sample:
            with torch.no_grad():
                y = torch.multinomial(logits.softmax(-1), 1).flatten()
        return nn.functional.cross_entropy(logits, y, reduction="sum")

    def compute_measurement(self, batch, model):
        x, y = batch
        return nn.functional.cross_entropy(model(x), y, reduction="sum")


def _kronfluence_scores(model, train, query, strategy, tmp_path) -> torch.Tensor:
    theirs = prepare_model(copy.deepcopy(model), Classification())
    analyzer = Analyzer("audit", theirs, Classification(), cpu=True, output_dir=str(tmp_path),
                        disable_tqdm=True)
    dtypes = dict(activation_covariance_dtype=torch.float64,
                  gradient_covariance_dtype=torch.float64,
                  eigendecomposition_dtype=torch.float64, lambda_dtype=torch.float64)
    analyzer.fit_all_factors("factors", dataset=TensorDataset(*train), per_device_batch_size=50,
                             factor_args=FactorArguments(strategy=strategy,
                                                         use_empirical_fisher=True, **dtypes),
                             overwrite_output_dir=True)
    analyzer.compute_pairwise_scores(
        "scores", factors_name="factors", query_dataset=TensorDataset(*query),
        train_dataset=TensorDataset(*train), per_device_query_batch_size=10,
        score_args=ScoreArguments(damping_factor=None, score_dtype=torch.float64,
                                  per_sample_gradient_dtype=torch.float64,
                                  precondition_dtype=torch.float64),
        overwrite_output_dir=True)
    return analyzer.load_pairwise_scores("scores")["all_modules"]


@pytest.mark.filterwarnings("ignore::FutureWarning")  # (kronfluence's GradScaler)
@pytest.mark.parametrize("curvature", ["ekfac", "kfac", "diagonal", "identity"])
def test_scores_match_kronfluence(curvature, tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 16, bias=False), nn.Tanh(),
                          nn.Linear(16, 4, bias=False)).double()  # (kronfluence joins biases)
    g = torch.Generator().manual_seed(1)
    train = (torch.randn(200, 5, generator=g, dtype=torch.float64),
             torch.randint(0, 4, (200,), generator=g))
    query = (torch.randn(10, 5, generator=g, dtype=torch.float64),
             torch.randint(0, 4, (10,), generator=g))
    theirs = _kronfluence_scores(model, train, query, curvature, tmp_path)
    ours = persample.influence(model, train, query, nn.CrossEntropyLoss(), curvature=curvature,
                               fisher="empirical", batch_size=50)
    assert torch.corrcoef(torch.stack([ours.flatten(), theirs.flatten()]))[0, 1] > 0.999
    # (to 1e-7 of the largest score: a few near zero differ in their fifth digit)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7 * float(theirs.abs().max()))


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_kfac_factors_match_kronfluence(tmp_path):
    """K-FAC's factors (empirical Fisher, expand) against kronfluence's covariances on a
    convolution with a bias (which kronfluence appends to the patches as a last input
    of 1) and a linear layer: its sums over what it processed, divided as persample
    divides (the input side by the positions, the output side by the samples)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.Tanh(), nn.Flatten(),
                          nn.Linear(48, 4, bias=False)).double()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(40, 2, 6, 6, generator=g, dtype=torch.float64)
    y = torch.randint(0, 4, (40,), generator=g)
    theirs = prepare_model(copy.deepcopy(model), Classification())
    analyzer = Analyzer("factors", theirs, Classification(), cpu=True,
                        output_dir=str(tmp_path), disable_tqdm=True)
    analyzer.fit_covariance_matrices(
        "f", dataset=TensorDataset(x, y), per_device_batch_size=20, overwrite_output_dir=True,
        factor_args=FactorArguments(strategy="kfac", use_empirical_fisher=True,
                                    activation_covariance_dtype=torch.float64,
                                    gradient_covariance_dtype=torch.float64))
    cov = analyzer.load_covariance_matrices("f")
    ours = persample.KFAC(model, fisher="empirical")
    for k in range(0, 40, 20):
        ours.update(x[k:k + 20], y[k:k + 20], nn.CrossEntropyLoss())
    for module, name, inputs in (("0", "0.weight", 18), ("3", "3.weight", 48)):
        (f,) = ours.factors[name]
        a = cov["activation_covariance"][module] / cov["num_activation_covariance_processed"][
            module]
        g_sum = cov["gradient_covariance"][module]
        torch.testing.assert_close(f.A, a[:inputs, :inputs], rtol=1e-10, atol=1e-13)
        torch.testing.assert_close(f.G, g_sum / 40, rtol=1e-10, atol=1e-13)
