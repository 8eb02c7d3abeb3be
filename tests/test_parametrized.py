"""Weights rewritten by a parametrization before a layer reads them
(``parametrizations.weight_norm``, ``orthogonal``, ``spectral_norm``, the older
``weight_norm`` hook, a matrix exponential written by hand): the reading op's rule gives
the per-sample cotangent of the rewritten weight, and the rewrite's own rule pulls all
samples' back at once (``_weight_norm``, ``matrix_exp`` of a skew-symmetric matrix,
``householder_product``).
A recurrent layer with such a weight takes its kernel's rule for all its weights, from
the kernel's outputs. Checked against the loop in float64, with the path each parameter
took, and that the batched pullbacks ran (not the op's own backward per sample)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils import parametrizations, parametrize

import persample
from battery import assert_exact, clipped_mean
from persample import loop_per_sample_grads
from persample.dp import private_grad
from persample.engine import pullback
from persample.rules import recurrent as recurrent_rules
from persample.rules import reparametrized

B = H = 6  # sizes chosen to coincide: the batch and the hidden width
T, IN = 5, 4
LOSS = nn.CrossEntropyLoss(reduction="none")


class Head(nn.Module):
    """A recurrent layer, then a Linear on its outputs' mean over time."""

    def __init__(self, rnn: nn.RNNBase):
        super().__init__()
        self.rnn = rnn
        width = rnn.hidden_size * (2 if rnn.bidirectional else 1)
        self.head = nn.Linear(width, 3)

    def forward(self, x: Tensor) -> Tensor:  # (B, T, IN) -> (B, 3)
        if not self.rnn.batch_first:
            x = x.transpose(0, 1)
        out = self.rnn(x)[0]
        return self.head(out.mean(1 if self.rnn.batch_first else 0))


def _weight_norm(m, name):
    return parametrizations.weight_norm(m, name)


def _weight_norm_dim1(m, name):
    return parametrizations.weight_norm(m, name, dim=1)


def _orthogonal(m, name):
    return parametrizations.orthogonal(m, name)


def _spectral(m, name):
    return parametrizations.spectral_norm(m, name)


RECURRENT = {
    "lstm-weight-norm-hh": (lambda: nn.LSTM(IN, H, batch_first=True), "weight_hh_l0",
                            _weight_norm),
    "lstm-weight-norm-no-bias": (lambda: nn.LSTM(IN, H, bias=False), "weight_hh_l0",
                                 _weight_norm),
    "gru-weight-norm-ih-dim1": (lambda: nn.GRU(IN, H, batch_first=True), "weight_ih_l0",
                                _weight_norm_dim1),
    "rnn-orthogonal-hh": (lambda: nn.RNN(IN, H, batch_first=True), "weight_hh_l0",
                          _orthogonal),
    "rnn-bidirectional-orthogonal": (lambda: nn.RNN(IN, H, bidirectional=True),
                                     "weight_hh_l0_reverse", _orthogonal),
    "lstm-householder": (lambda: nn.LSTM(IN, H, batch_first=True), "weight_hh_l0",
                         _orthogonal),  # (not square: Householder reflections)
    "gru-spectral-eval": (lambda: nn.GRU(IN, H, batch_first=True), "weight_hh_l0",
                          _spectral),
    "lstm-2-layers-weight-norm": (lambda: nn.LSTM(IN, H, num_layers=2, batch_first=True),
                                  "weight_hh_l1", _weight_norm),
}


def _case(name: str) -> nn.Module:
    make, weight, how = RECURRENT[name]
    torch.manual_seed(0)
    rnn = make()
    how(rnn, weight)
    model = Head(rnn)
    return model.eval() if "spectral" in name else model


def _data(seed: int = 1) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, IN, generator=g), torch.randint(0, 3, (B,), generator=g)


@pytest.fixture
def batched_pullbacks_only(monkeypatch):
    """Fail where the engine differentiates ``_weight_norm`` or a skew-symmetric
    ``matrix_exp`` by the op's own backward (their rules must have taken them)."""
    original = pullback.shared_vjp

    def guarded(op, cots, wrt):
        if op.func is torch._weight_norm:
            raise AssertionError("_weight_norm pulled back by its own backward")
        if op.func in (torch.linalg.matrix_exp, torch.matrix_exp) and torch.equal(
                op.leaves[0], -op.leaves[0].mT):
            raise AssertionError("a skew-symmetric matrix_exp pulled back by autograd")
        if op.func in (torch.linalg.householder_product, torch.orgqr):
            raise AssertionError("householder_product pulled back by its own backward")
        return original(op, cots, wrt)

    monkeypatch.setattr(pullback, "shared_vjp", guarded)


@pytest.mark.parametrize("name", list(RECURRENT))
def test_parametrized_recurrent_layers(name, batched_pullbacks_only, monkeypatch):
    model = _case(name)
    x, y = _data()
    if "2-layers" not in name:  # one layer: the rule works from the kernel's outputs,
        def refused(*args, **kwargs):  # as the capture kept them
            raise AssertionError("the recurrence differentiated unrolled, or run again")
        monkeypatch.setattr(recurrent_rules, "_unrolled", refused)
        monkeypatch.setattr(recurrent_rules, "_outputs", refused)
    want = loop_per_sample_grads(model, x, y, LOSS)
    for _ in range(3):  # (calls after the first: the cached path)
        got = persample.per_sample_grads(model, x, y, LOSS, method="rules")
        assert_exact(got, want)
    routes = persample.supported(model, x, y, LOSS)
    assert {r.path for r in routes} == {"rule"}, routes
    rnn = next(r for r in routes if r.module == "rnn")
    assert rnn.type.startswith("Parametrized") and "in module 'rnn'" in rnn.reason


class Doubled(nn.Module):
    """An orthogonal RNN whose output is doubled in place after the kernel made it: the
    kept outputs no longer hold the states, and the rule runs the kernel again."""

    def __init__(self):
        super().__init__()
        self.rnn = parametrizations.orthogonal(nn.RNN(IN, H, batch_first=True), "weight_hh_l0")
        self.head = nn.Linear(H, 3)

    def forward(self, x: Tensor) -> Tensor:  # (B, T, IN) -> (B, 3)
        out = self.rnn(x)[0]
        out.mul_(2)
        return self.head(out.mean(1))


def test_outputs_changed_in_place(monkeypatch):
    torch.manual_seed(0)
    model = Doubled()
    x, y = _data()
    runs = []
    again = recurrent_rules._outputs

    def counted(*args):
        runs.append(1)
        return again(*args)

    monkeypatch.setattr(recurrent_rules, "_outputs", counted)
    for k in range(3):
        got = persample.per_sample_grads(model, x, y, LOSS, method="rules")
        assert_exact(got, loop_per_sample_grads(model, x, y, LOSS))
        assert len(runs) == k + 1


def test_cached_calls_and_new_values(batched_pullbacks_only):
    """Calls after the first (the cached path), and after the parametrized weight's
    original parameters changed."""
    model = _case("lstm-weight-norm-hh")
    for k in range(3):
        x, y = _data(k)
        if k == 2:
            with torch.no_grad():
                for p in model.rnn.parametrizations.weight_hh_l0.parameters():
                    p.mul_(1.5)
        got = persample.per_sample_grads(model, x, y, LOSS)
        assert_exact(got, loop_per_sample_grads(model, x, y, LOSS))


class WeightNormed(nn.Module):
    """``weight_norm`` over each dim choice: rows (0), columns (1), the whole tensor
    (the older hook's ``dim=None``), a convolution's output channels."""

    def __init__(self):
        super().__init__()
        self.rows = parametrizations.weight_norm(nn.Linear(IN, H))
        self.cols = parametrizations.weight_norm(nn.Linear(H, H), dim=1)
        with pytest.warns(FutureWarning):
            self.whole = nn.utils.weight_norm(nn.Linear(H, H), dim=None)
        self.conv = parametrizations.weight_norm(nn.Conv1d(1, 2, 3))
        self.head = nn.Linear(2 * (H - 2), 3)

    def forward(self, x: Tensor) -> Tensor:  # (B, T, IN) -> (B, 3)
        h = torch.tanh(self.whole(torch.tanh(self.cols(torch.tanh(self.rows(x))))))
        return self.head(self.conv(h.mean(1, keepdim=True)).flatten(1))


class Orthogonal(nn.Module):
    """``orthogonal`` on Linear weights that are not square (Householder reflections):
    tall, wide, and one left at its initial reflectors."""

    def __init__(self):
        super().__init__()
        self.tall = parametrizations.orthogonal(nn.Linear(IN, 2 * H))
        self.wide = parametrizations.orthogonal(nn.Linear(2 * H, H))
        self.head = nn.Linear(H, 3)
        with torch.no_grad():  # (as after some steps; the diagonal holds the signs)
            for layer in (self.tall, self.wide):
                original = layer.parametrizations.weight.original
                original.add_((1 - torch.eye(*original.shape)) * torch.randn_like(original))

    def forward(self, x: Tensor) -> Tensor:  # (B, T, IN) -> (B, 3)
        return self.head(torch.tanh(self.wide(torch.tanh(self.tall(x)))).mean(1))


class Reflected(nn.Module):
    """``householder_product`` called directly: a stack of reflectors with a zero scale,
    reflectors made from each sample's input, or a product whose matrix dims hold the
    samples."""

    def __init__(self, form: str):
        super().__init__()
        self.form = form
        self.a = nn.Parameter(torch.randn(2, 5, 3) * 0.4)
        self.tau = nn.Parameter(torch.tensor([[1.2, 0.0, 0.7], [0.3, 1.9, 1.0]]))
        self.head = nn.Linear(15 if form == "per-sample" else IN, 3)

    def forward(self, x: Tensor) -> Tensor:  # (B, T, IN) -> (B, 3)
        if self.form == "stack":
            q = torch.linalg.householder_product(self.a, self.tau)  # (2, 5, 3)
            h = torch.tanh(F.pad(x, (0, 1)) @ q[0]) @ q[1].mT  # (B, T, 5)
            return self.head(h[..., :IN]).mean(1)
        if self.form == "per-sample":
            a = x[:, :5, :3] * self.a[0]  # (B, 5, 3)
            tau = self.tau[0].expand(len(x), 3) * x[:, 0, :3].tanh()
            return self.head(torch.linalg.householder_product(a, tau).flatten(1))
        rows = x[:, 0, :3]  # (B, 3): a sample per row of the reflectors
        return self.head(F.pad(torch.linalg.householder_product(rows, self.tau[0]),
                               (0, IN - 3)))


def test_householder_products(batched_pullbacks_only):
    torch.manual_seed(0)
    x, y = _data()
    for model in (Orthogonal(), Reflected("stack")):
        got = persample.per_sample_grads(model, x, y, LOSS, method="rules")
        assert_exact(got, loop_per_sample_grads(model, x, y, LOSS))
        assert {r.path for r in persample.supported(model, x, y, LOSS)} == {"rule"}


def test_householder_per_sample():
    """Reflectors holding the samples in their leading dim keep them apart (the op's own
    backward per sample); in their matrix dims they mix, refused by name."""
    torch.manual_seed(0)
    x, y = _data()
    model = Reflected("per-sample")
    got = persample.per_sample_grads(model, x, y, LOSS, method="rules")
    assert_exact(got, loop_per_sample_grads(model, x, y, LOSS))
    flow = persample.supported(Reflected("across"), x, y, LOSS)
    assert any("householder" in r.reason and "mix" in r.reason for r in flow), flow


class Symmetric(nn.Module):
    """A custom parametrization (``register_parametrization``): a symmetric weight from
    its upper triangle, ``X.triu() + X.triu(1).mT``."""

    def forward(self, x: Tensor) -> Tensor:
        return x.triu() + x.triu(1).mT


class Views(nn.Module):
    """Weights through ``triu``, ``tril`` (and in place), ``.mT``, ``.mH``, ``.T``, ``.H``
    and a symmetric parametrization."""

    def __init__(self):
        super().__init__()
        self.sym = nn.Linear(IN, IN)
        parametrize.register_parametrization(self.sym, "weight", Symmetric())
        self.w = nn.Parameter(torch.randn(IN, IN))
        self.stack = nn.Parameter(torch.randn(2, IN, IN))
        self.head = nn.Linear(IN, 3)

    def forward(self, x: Tensor) -> Tensor:  # (B, T, IN) -> (B, 3)
        lower = self.w.tril(-1)
        lower.triu_(-2)  # (a band: in place on a derived tensor)
        h = torch.tanh(self.sym(x) @ lower.mT + x @ self.w.T)
        h = torch.tanh(h @ self.stack.mH[0] + h @ torch.tril(self.w).H)
        return self.head(h).mean(1)


def test_triangles_and_transposes(batched_pullbacks_only, monkeypatch):
    torch.manual_seed(0)
    model = Views()
    x, y = _data()
    ops = set()
    original = pullback.shared_vjp

    def seen(op, cots, wrt):
        ops.add(getattr(op.func, "__name__", ""))
        return original(op, cots, wrt)

    monkeypatch.setattr(pullback, "shared_vjp", seen)
    got = persample.per_sample_grads(model, x, y, LOSS, method="rules")
    assert_exact(got, loop_per_sample_grads(model, x, y, LOSS))
    assert not ops & {"triu", "tril", "triu_", "tril_", "__get__"}, ops


def test_weight_norm_dims(batched_pullbacks_only):
    torch.manual_seed(0)
    model = WeightNormed()
    x, y = _data()
    got = persample.per_sample_grads(model, x, y, LOSS, method="rules")
    assert_exact(got, loop_per_sample_grads(model, x, y, LOSS))


class Rotated(nn.Module):
    """``x exp(A)`` with ``A`` built from a parameter: skew-symmetric (``X - X^T``), a
    stack of them, or not skew-symmetric (``X`` itself: the op's own backward); ``size``:
    ``A``'s (the input padded with zeros to it)."""

    def __init__(self, form: str, init: Tensor | None = None, size: int = IN):
        super().__init__()
        self.form, self.size = form, size
        shape = (2, size, size) if form == "stack" else (size, size)
        self.x = nn.Parameter(torch.randn(shape) * 0.5 if init is None else init)
        self.head = nn.Linear(size, 3)

    def forward(self, x: Tensor) -> Tensor:  # (B, T, IN) -> (B, 3)
        x = F.pad(x, (0, self.size - IN))
        a = self.x if self.form == "general" else self.x - self.x.mT
        q = torch.linalg.matrix_exp(a)
        if self.form == "stack":
            return self.head(torch.tanh(x @ q[0]) @ torch.matrix_exp(a[1]).mT).mean(1)
        return self.head(torch.tanh(x @ q)).mean(1)


def _repeated() -> Tensor:
    """``X`` whose ``X - X^T`` has each eigenvalue twice (two equal rotation blocks)."""
    x = torch.zeros(IN, IN)
    x[1, 0] = x[3, 2] = 0.7
    return x


def _null() -> Tensor:
    """``X`` whose ``X - X^T`` has a null space of two dims beside one rotation."""
    x = torch.zeros(IN, IN)
    x[1, 0] = 0.7
    return x


MATRICES = {"skew": ("skew", None, IN), "stack": ("stack", None, IN),
            "odd": ("skew", None, 5), "wide-odd": ("skew", None, 33),
            "zero": ("skew", "zero", IN), "repeated": ("skew", "repeated", IN),
            "null-space": ("skew", "null", IN), "general": ("general", None, IN)}


@pytest.mark.parametrize("name", list(MATRICES))
@pytest.mark.parametrize("basis", ["real", "complex"])
def test_matrix_exp(name, basis, batched_pullbacks_only, monkeypatch):
    """Each skew-symmetric form by the real basis where it exists and by the complex
    eigenbasis (forced), against the loop."""
    real = []
    if basis == "complex":
        monkeypatch.setattr(reparametrized, "_real_basis", lambda mu, vecs: None)
    else:
        adjoint = reparametrized._adjoint_real
        monkeypatch.setattr(reparametrized, "_adjoint_real",
                            lambda *args: real.append(1) or adjoint(*args))
    form, init, size = MATRICES[name]
    torch.manual_seed(0)
    start = {None: None, "zero": torch.zeros(IN, IN), "repeated": _repeated(),
             "null": _null()}[init]
    model = Rotated(form, start, size)
    x, y = _data()
    got = persample.per_sample_grads(model, x, y, LOSS, method="rules")
    assert_exact(got, loop_per_sample_grads(model, x, y, LOSS))
    if basis == "real" and name in ("skew", "stack", "odd", "wide-odd", "repeated"):
        assert real, "the real basis was not taken"


def test_real_basis_found_and_refused():
    """The real basis is taken where the eigenvalues pair (distinct, an odd size's one
    zero) and refused where a zero eigenvalue repeats (the identity basis of ``0``)."""
    x = torch.randn(7, 7)
    for a, found in ((x - x.T, True), (torch.zeros(4, 4), False)):
        mu, vecs = torch.linalg.eigh(a.to(torch.complex128) * 1j)
        assert (reparametrized._real_basis(mu, vecs) is not None) == found


def test_matrix_exp_per_sample():
    """A matrix made from each sample's input (the samples in its leading dim) keeps them
    apart; one whose matrix dims hold the samples mixes them and is refused by name."""
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(IN, IN) * 0.3)

    class PerSample(nn.Module):
        def __init__(self, across: bool):
            super().__init__()
            self.w, self.across = w, across
            self.head = nn.Linear(B if across else IN * IN, 3)

        def forward(self, x: Tensor) -> Tensor:  # (B, IN, IN) -> (B, 3)
            a = x * self.w  # (B, IN, IN): a matrix per sample
            if self.across:  # (B, B): a sample per row
                return self.head(torch.linalg.matrix_exp(a.flatten(1)[:, :B]))
            return self.head(torch.linalg.matrix_exp(a).flatten(1))

    x, y = torch.randn(B, IN, IN), torch.randint(0, 3, (B,))
    model = PerSample(False)
    got = persample.per_sample_grads(model, x, y, LOSS, method="rules")
    assert_exact(got, loop_per_sample_grads(model, x, y, LOSS))
    flow = persample.supported(PerSample(True), x, y, LOSS)
    assert any("matrix_exp" in r.reason and "mix" in r.reason for r in flow), flow


class Normed(nn.Module):
    """``_weight_norm`` of per-sample tensors: ``v`` and ``g`` both holding the samples
    along ``dim`` (``both``), along another dim (``across``), or a per-sample ``v`` with a
    shared ``g`` of a row per sample position (``shared-scale``)."""

    def __init__(self, form: str):
        super().__init__()
        self.form = form
        self.p, self.q = nn.Parameter(torch.randn(IN)), nn.Parameter(torch.randn(IN))
        self.scale = nn.Parameter(torch.rand(1, IN) + 0.5)

    def forward(self, x: Tensor) -> Tensor:  # (B, IN) -> (B, IN)
        if self.form == "both":
            v, g, dim = x * self.p, (x * self.q).sum(1, keepdim=True), 0
        elif self.form == "across":
            v, g, dim = x * self.p, self.scale, 1
        else:
            v, g, dim = x * self.p, self.scale[:, :1].expand(len(x), 1), 0
        return torch._weight_norm(v, g, dim)


def test_weight_norm_per_sample():
    """Per-sample ``_weight_norm``: on the rules where both tensors hold the samples along
    ``dim``; ``torch.func``'s exact path where only one does (the model's output cannot be
    located by sample); refused by name where the norm runs over the samples."""
    x, y = torch.randn(B, IN), torch.randint(0, 3, (B,))
    for form, path in (("both", "rule"), ("shared-scale", "vmap")):
        torch.manual_seed(0)
        model = nn.Sequential(Normed(form), nn.Linear(IN, 3))
        for _ in range(3):  # (calls after the first: the cached path)
            got = persample.per_sample_grads(model, x, y, LOSS)
            assert_exact(got, loop_per_sample_grads(model, x, y, LOSS))
        routes = persample.supported(model, x, y, LOSS)
        assert {r.path for r in routes if r.module == "0" and r.path != "unused"} == {
            path}, routes
    model = nn.Sequential(Normed("across"), nn.Linear(IN, 3))
    flow = persample.supported(model, x, y, LOSS)
    assert any("_weight_norm" in r.reason and "mix" in r.reason for r in flow), flow


def test_bfloat16_weight_norm_lstm():
    """A bfloat16 model: the kernel's rule and the pullback in float32, written in
    bfloat16, near the float64 loop."""
    model = _case("lstm-weight-norm-hh")
    x, y = _data()
    want = loop_per_sample_grads(model, x, y, LOSS)
    low = Head(nn.LSTM(IN, H, batch_first=True))
    parametrizations.weight_norm(low.rnn, "weight_hh_l0")
    low.load_state_dict(model.state_dict())
    low = low.to(torch.bfloat16)
    got = persample.per_sample_grads(low, x.to(torch.bfloat16), y, LOSS)
    for name, w in want.items():
        err = (got[name].double() - w).norm() / w.norm()
        assert err < 2e-2, (name, err.item())
    assert F.cosine_similarity(got["rnn.parametrizations.weight_hh_l0.original1"].double()
                               .flatten(1), want["rnn.parametrizations.weight_hh_l0."
                                                 "original1"].flatten(1)).min() > 0.999


@pytest.mark.parametrize("name", ["lstm-weight-norm-hh", "rnn-orthogonal-hh"])
def test_dp_step(name, batched_pullbacks_only):
    """Norms and DP-SGD's clipped sum (no noise) through the parametrizations, against
    the loop's per-sample gradients clipped by hand."""
    model = _case(name)
    x, y = _data()
    norms, want = clipped_mean(loop_per_sample_grads(model, x, y, LOSS), 0.05)
    torch.testing.assert_close(persample.per_sample_grad_norms(model, x, y, LOSS), norms,
                               rtol=1e-10, atol=1e-13)
    _, got_norms = private_grad(model, x, y, LOSS, max_grad_norm=0.05, noise_multiplier=0.0)
    torch.testing.assert_close(got_norms, norms, rtol=1e-10, atol=1e-13)
    assert_exact({k: p.grad for k, p in model.named_parameters()}, want)


@pytest.mark.parametrize("make", [lambda: _case("rnn-orthogonal-hh"),
                                  lambda: _case("lstm-householder"),
                                  lambda: _case("lstm-weight-norm-hh"), Views,
                                  lambda: Rotated("skew", None, 5)],
                         ids=["orthogonal", "householder", "weight-norm", "views", "rotated"])
def test_flat_and_out_results(make, batched_pullbacks_only):
    """The results as one flat ``(B, P)`` tensor and into the caller's buffer, whose
    per-parameter parts are strided views (a rule writing with ``out=`` into such a view
    must write where the view says), over calls after the first."""
    torch.manual_seed(0)
    model = make()
    x, y = _data()
    want = loop_per_sample_grads(model, x, y, LOSS)
    flat = torch.cat([g.flatten(1) for g in want.values()], 1)
    buf = torch.full_like(flat, float("nan"))
    for _ in range(2):
        got = persample.per_sample_grads(model, x, y, LOSS, flat=True, method="rules")
        assert_exact({"flat": got}, {"flat": flat})
        persample.per_sample_grads(model, x, y, LOSS, out=buf, method="rules")
        assert_exact({"flat": buf}, {"flat": flat})
