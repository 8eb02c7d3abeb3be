"""persample as laplace-torch's curvature backend, in float64: against Laplace's own
backends where they run (curvlinops for K-FAC and the full matrices, BackPACK for the
diagonals; an MLP, classification and regression, all weights and the last layer),
against Laplace's ``torch.func`` Jacobians where they do not (GPT-2 for sequence
classification: its ``Conv1D`` layers, embeddings and layer norms; a model with tied
weights), and the decomposed Kronecker factors with diagonals against Laplace's own
``KronDecomposed`` built with dense identities."""

from __future__ import annotations

import copy

import pytest
import torch
from laplace import Laplace
from laplace.curvature import (
    BackPackEF,
    BackPackGGN,
    CurvatureInterface,
    CurvlinopsEF,
    CurvlinopsGGN,
    GGNInterface,
)
from laplace.utils import Kron, KronDecomposed
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import zoo
from persample import KFAC, ggn_diag
from persample.integrations.laplace import (
    DiagonalKron,
    DiagonalKronDecomposed,
    PerSampleEF,
    PerSampleGGN,
)
from zoo import gpt2_config

TOL = dict(rtol=1e-8, atol=1e-12)

# (structure, ours) -> the anchor that computes the same thing
ANCHORS = {("diag", PerSampleGGN): BackPackGGN, ("diag", PerSampleEF): BackPackEF,
           ("kron", PerSampleGGN): CurvlinopsGGN, ("kron", PerSampleEF): CurvlinopsEF,
           ("full", PerSampleGGN): CurvlinopsGGN, ("full", PerSampleEF): CurvlinopsEF}


def _mlp_data(likelihood: str):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(30, 5, generator=g, dtype=torch.float64)
    y = (torch.randint(0, 3, (30,), generator=g) if likelihood == "classification"
         else torch.randn(30, 3, generator=g, dtype=torch.float64))
    return DataLoader(TensorDataset(x, y), batch_size=12)  # batches of 12, 12, 6


def _fit(model, likelihood, structure, backend, subset, loader):
    la = Laplace(copy.deepcopy(model), likelihood, hessian_structure=structure,
                 subset_of_weights=subset, backend=backend, prior_precision=0.7)
    la.fit(loader)
    return la


@pytest.mark.parametrize("subset", ["all", "last_layer"])
@pytest.mark.parametrize("likelihood", ["classification", "regression"])
@pytest.mark.parametrize("structure", ["diag", "kron", "full"])
@pytest.mark.parametrize("ours", [PerSampleGGN, PerSampleEF])
def test_matches_laplace_own_backends(ours, structure, likelihood, subset):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 6), nn.Tanh(),
                          nn.Linear(6, 3)).double()
    loader = _mlp_data(likelihood)
    got = _fit(model, likelihood, structure, ours, subset, loader)
    want = _fit(model, likelihood, structure, ANCHORS[structure, ours], subset, loader)
    torch.testing.assert_close(got.loss, want.loss, **TOL)
    if structure == "kron":
        assert isinstance(got.H_facs, DiagonalKron)
        assert len(got.H_facs.kfacs) == len(want.H_facs.kfacs) == (6 if subset == "all" else 2)
        for mine, theirs in zip(got.H_facs.kfacs, want.H_facs.kfacs):
            assert len(mine) == len(theirs)
            for a, b in zip(mine, theirs):
                torch.testing.assert_close(a, b, **TOL)
    else:
        torch.testing.assert_close(got.H, want.H, **TOL)
    torch.testing.assert_close(got.log_marginal_likelihood(), want.log_marginal_likelihood(),
                               **TOL)
    x = torch.randn(4, 5, dtype=torch.float64)
    mine, theirs = got(x, pred_type="glm"), want(x, pred_type="glm")
    if likelihood == "regression":  # (mean, variance)
        mine, theirs = torch.cat([mine[0], mine[1].flatten(1)], 1), \
            torch.cat([theirs[0], theirs[1].flatten(1)], 1)
    torch.testing.assert_close(mine, theirs, **TOL)


def test_monte_carlo_fisher_is_the_ggn_on_average():
    """``stochastic=True``: the MC Fisher's diagonal, averaged over many drawn labels,
    tends to the exact GGN's (the draws are persample's own, so no anchor's numbers)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()
    x, y = torch.randn(40, 5, dtype=torch.float64), torch.randint(0, 3, (40,))
    exact = PerSampleGGN(model, "classification").diag(x, y)[1]
    mc = PerSampleGGN(model, "classification", stochastic=True, num_samples=4000).diag(x, y)[1]
    assert (mc - exact).abs().max() < 0.05 * exact.abs().max()
    assert (mc - exact).abs().max() > 0  # drawn, not the exact one


class Classifier(nn.Module):
    """GPT-2 for sequence classification as Laplace calls a transformers model: one dict
    argument (``input_ids``, ``attention_mask``), the logits ``(B, C)`` out."""

    def __init__(self, vocab: int = 40):
        super().__init__()
        transformers = zoo.require("transformers")
        torch.manual_seed(0)
        config = gpt2_config(pad_token_id=0, num_labels=3)
        config.vocab_size = vocab
        self.model = transformers.GPT2ForSequenceClassification(config).double().eval()

    def forward(self, batch):
        return self.model(input_ids=batch["input_ids"],
                          attention_mask=batch["attention_mask"]).logits


def _text_loader(n: int = 10, t: int = 6, vocab: int = 40):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, vocab, (n, t), generator=g)
    rows = [{"input_ids": ids[i], "attention_mask": torch.ones(t, dtype=torch.long),
             "labels": torch.randint(0, 3, (), generator=g)} for i in range(n)]
    return DataLoader(rows, batch_size=4)  # 4, 4, 2


def test_gpt2_diagonal_against_laplace_torch_func_jacobians():
    """GPT-2's GGN diagonal by persample's rules against Laplace's generic GGN diagonal
    from ``torch.func.jacrev`` (every Jacobian of the batch), which BackPACK and
    curvlinops cannot give (Conv1D, embeddings, attention)."""
    model = Classifier()
    batch = next(iter(_text_loader()))
    x, y = {k: batch[k] for k in ("input_ids", "attention_mask")}, batch["labels"]
    ours = PerSampleGGN(model, "classification")
    loss, h = ours.diag(x, y)
    js, f = CurvatureInterface.jacobians(ours, x)  # torch.func, Laplace's own
    p = torch.softmax(f, -1)
    lam = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]
    want = torch.einsum("bcp,bck,bkp->p", js, lam, js)
    torch.testing.assert_close(h, want, **TOL)
    torch.testing.assert_close(loss, nn.CrossEntropyLoss(reduction="sum")(f, y), **TOL)
    got_js, got_f = ours.jacobians(x)
    torch.testing.assert_close(got_js, js, **TOL)
    torch.testing.assert_close(got_f, f, **TOL)


def test_gpt2_kron_fit_keeps_the_vocabulary_side_a_vector():
    """A kron fit of GPT-2 with every weight: each entry is persample's K-FAC (summed
    over the batches as Laplace sums them), the table's input side a vector of id
    frequencies ``(vocabulary,)``, the layer norms' exact diagonals vectors; curvlinops,
    Laplace's default backend, refuses the model."""
    model, loader = Classifier(), _text_loader()
    with pytest.raises(Exception):  # noqa: B017 (whatever curvlinops raises)
        _fit(model, "classification", "kron", CurvlinopsGGN, "all", loader)
    la = _fit(model, "classification", "kron", PerSampleGGN, "all", loader)
    params = [p for p in la.model.parameters() if p.requires_grad]
    names = {id(p): n for n, p in la.model.named_parameters()}
    entries = dict(zip([names[id(p)] for p in params], la.H_facs.kfacs, strict=True))
    table, g = entries["model.transformer.wte.weight"]
    assert table.shape == (40,) and g.shape == (16, 16)
    assert entries["model.transformer.ln_f.weight"][0].shape == (16,)
    # the fit's entries are K-FAC's of all samples at once (summed: output side; mean:
    # input side), one Conv1D weight (in, out) checked: [A, G]
    kfac = KFAC(la.model, fisher="type-2")
    for batch in loader:
        kfac.update(((batch,), {}), batch["labels"], nn.CrossEntropyLoss(reduction="sum"))
    (f,) = kfac.factors["model.transformer.h.0.attn.c_attn.weight"]
    a, g = entries["model.transformer.h.0.attn.c_attn.weight"]
    # the batches' sums of each side, each side's product equal to the whole data's
    n = kfac.num_data
    torch.testing.assert_close(torch.kron(a, g), torch.kron(f.A, f.G) * n, **TOL)
    want = sum(ggn_diag(la.model, ((batch,), {}), batch["labels"],
                        nn.CrossEntropyLoss(reduction="sum"),
                        params=["model.transformer.ln_f.weight"])["model.transformer.ln_f.weight"]
               for batch in loader)
    torch.testing.assert_close(entries["model.transformer.ln_f.weight"][0], want, **TOL)
    x = {k: v for k, v in next(iter(loader)).items() if k != "labels"}
    probs = la(x, pred_type="glm", link_approx="probit")
    assert probs.shape == (4, 3) and torch.allclose(probs.sum(-1), torch.ones(4, dtype=probs.dtype))


class Tied(nn.Module):
    """An embedding and an output layer sharing one table; mean-pooled positions."""

    def __init__(self):
        super().__init__()
        self.table = nn.Embedding(9, 4)
        self.mix = nn.Linear(4, 4)

    def forward(self, ids):  # (n, t) -> (n, 9)
        h = torch.tanh(self.mix(self.table(ids))).mean(1)
        return h @ self.table.weight.T


def test_tied_weight_gets_its_exact_diagonal_in_kron():
    torch.manual_seed(0)
    model = Tied().double()
    g = torch.Generator().manual_seed(1)
    ids, y = torch.randint(0, 9, (12, 5), generator=g), torch.randint(0, 9, (12,), generator=g)
    loader = DataLoader(TensorDataset(ids, y), batch_size=5)
    la = _fit(model, "classification", "kron", PerSampleGGN, "all", loader)
    table = la.H_facs.kfacs[0]
    want = ggn_diag(model, ids, y, nn.CrossEntropyLoss(reduction="sum"))["table.weight"]
    assert len(table) == 1
    torch.testing.assert_close(table[0], want.flatten(), **TOL)
    # the posterior's diagonal over the table: prior plus that diagonal, inverted
    torch.testing.assert_close(la.posterior_precision.diag(-1)[:36],
                               1 / (want.flatten() + 0.7), **TOL)


@pytest.mark.parametrize("damping", [False, True])
def test_decomposed_diagonals_match_laplace_with_dense_identities(damping):
    """``DiagonalKron``'s decomposition against Laplace's ``Kron.decompose`` of the same
    factors with each vector made a dense diagonal matrix: products with every exponent,
    diagonals, log-determinants, the dense form."""
    g = torch.Generator().manual_seed(0)

    def spd(k):
        m = torch.randn(k, k, generator=g, dtype=torch.float64)
        return m @ m.T + 0.1 * torch.eye(k, dtype=torch.float64)

    def vec(k):
        return torch.rand(k, generator=g, dtype=torch.float64) + 0.1

    ours = DiagonalKron([[vec(5), spd(3)], [spd(4), vec(2)], [vec(6)], [spd(3)],
                         [spd(2), spd(3)]])
    dense = Kron([[f if f.dim() == 2 else torch.diag(f) for f in fs] for fs in ours.kfacs])
    deltas = torch.tensor([0.3, 0.5, 0.2, 0.9, 0.4], dtype=torch.float64)
    mine, theirs = ours.decompose() * 1.7, dense.decompose() * 1.7
    assert isinstance(mine, DiagonalKronDecomposed)
    # a prior with damping at construction (Laplace's sum and product drop it)
    mine = DiagonalKronDecomposed(mine.eigenvectors, mine.eigenvalues, deltas, damping)
    theirs = KronDecomposed(theirs.eigenvectors, theirs.eigenvalues, deltas, damping)
    assert isinstance(mine + torch.tensor(0.1), DiagonalKronDecomposed)
    w = torch.randn(3, 2, 15 + 8 + 6 + 3 + 6, generator=g, dtype=torch.float64)
    for exponent in (1, -1, -0.5):
        torch.testing.assert_close(mine.bmm(w, exponent), theirs.bmm(w, exponent), **TOL)
        torch.testing.assert_close(mine.diag(exponent), theirs.diag(exponent), **TOL)
    torch.testing.assert_close(mine.logdet(), theirs.logdet(), **TOL)
    torch.testing.assert_close(mine.to_matrix(), theirs.to_matrix(), **TOL)
    torch.testing.assert_close(ours.diag(), dense.diag(), **TOL)
    torch.testing.assert_close(ours.bmm(w), dense.bmm(w), **TOL)


def test_kron_of_a_subnetwork_is_refused():
    model = nn.Sequential(nn.Linear(3, 2)).double()
    backend = PerSampleGGN(model, "classification", subnetwork_indices=torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="subnetwork"):
        backend.kron(torch.randn(4, 3, dtype=torch.float64), torch.tensor([0, 1, 0, 1]), N=4)


@pytest.mark.slow
def test_gpt2_768_real_vocabulary_kron_fits_in_memory():
    """GPT-2 4x768 with its 50,257-token table, every weight, ``kron``: the fit runs
    within 16 GiB, 10.1 of them Laplace's own zero factor ``(50257, 50257)`` made at
    construction (curvlinops and BackPACK refuse the model; ASDL runs out of the
    machine's 24 GiB). The table's input side is a vector, its GLM predictive finite."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    zoo.require("transformers")
    script = Path(__file__).with_name("laplace_gpt2_fit.py")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert "error" not in report
    assert report["kron_entries"][0] == [[50257], [768, 768]]  # wte: ids' frequencies, G
    assert report["fit_peak_gib"] < 16
    probs = torch.tensor(report["probs"])
    assert probs.shape == (2, 2) and torch.allclose(probs.sum(-1), torch.ones(2))


def test_subnetwork_full_against_laplace_torch_func():
    """``subset_of_weights="subnetwork"`` (``full``): persample's Jacobians at the chosen
    entries against Laplace's own ``torch.func`` fallback (curvlinops' backend uses it
    for a subnetwork)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()
    loader = _mlp_data("classification")
    chosen = torch.tensor([0, 3, 8, 20, 41, 50, 63])
    fits = []
    for backend in (PerSampleGGN, CurvlinopsGGN):
        la = Laplace(copy.deepcopy(model), "classification", subset_of_weights="subnetwork",
                     hessian_structure="full", subnetwork_indices=chosen, backend=backend)
        la.fit(loader)
        fits.append(la)
    ours, theirs = fits
    assert ours.H.shape == (7, 7)
    torch.testing.assert_close(ours.H, theirs.H, **TOL)
    x = torch.randn(4, 5, dtype=torch.float64)
    torch.testing.assert_close(ours(x, pred_type="glm"), theirs(x, pred_type="glm"), **TOL)


def test_timm_vit_fits_every_structure():
    """timm's ViT (patch convolution, class token, position table, LayerScale) with every
    weight: ``diag`` equal to Laplace's generic diagonal from ``torch.func`` Jacobians,
    ``kron`` with an entry per parameter (the convolution's ``[G, A]`` of its patches,
    the tokens' and scales' exact diagonals), both with finite GLM predictives."""
    from zoo import timm_vit_layerscale

    model, x, labels, _ = timm_vit_layerscale()
    loader = DataLoader(TensorDataset(x, labels), batch_size=2)
    diag = _fit(model, "classification", "diag", PerSampleGGN, "all", loader)
    backend = PerSampleGGN(diag.model, "classification")
    want = sum(GGNInterface.diag(backend, xb, yb)[1] for xb, yb in loader)
    torch.testing.assert_close(diag.H, want, **TOL)
    kron = _fit(model, "classification", "kron", PerSampleGGN, "all", loader)
    params = [p for p in kron.model.parameters() if p.requires_grad]
    assert len(kron.H_facs.kfacs) == len(params)
    shapes = {n: [tuple(f.shape) for f in fs] for (n, p), fs in zip(
        [(n, p) for n, p in kron.model.named_parameters() if p.requires_grad],
        kron.H_facs.kfacs)}
    assert shapes["patch_embed.proj.weight"] == [(16, 16), (48, 48)]
    assert shapes["cls_token"] == [(16,)] and shapes["blocks.0.ls1.gamma"] == [(16,)]
    for la in (diag, kron):
        probs = la(x, pred_type="glm", link_approx="probit")
        assert probs.shape == (len(x), 5) and bool(torch.isfinite(probs).all())
