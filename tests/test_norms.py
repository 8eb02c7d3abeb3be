"""``per_sample_grad_norms``: the norm rules and their paths, against the norms of the loop
reference's per-sample gradients (float64, tight tolerances).

The ghost-norm paths of the Linear and Embedding norm rules (and their cost-based switch
to materialising), checked both for their values and for the path taken; weight tying,
where the norm of the summed contribution is not the sum of the per-call norms; chunks;
batches of one and zero; nothing left on the model; bad options.

Every case of ``cases.py`` matching the loop with every method (total and per
parameter) is in ``test_battery.py``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import Tensor, nn

import persample
import persample.engine.norms as norms_module
import persample.rules as rules
from battery import METHODS, REDUCTIONS, TOL, layer_norms, norms_of
from cases import (
    BY_ID,
    CASE_IDS,
    CASES,
    EDGE_CASE_IDS,
    EDGE_CASES,
    LinearTwice,
    N,
    OpaqueGate,
    TiedLM,
    as_tuple,
    build,
    randn,
)
from persample import loop_per_sample_grads, per_sample_grad_norms, per_sample_grads
from persample.rules.outer import ghost_norm

ALL_CASES = CASES + EDGE_CASES
ALL_IDS = CASE_IDS + EDGE_CASE_IDS


def reference(c: dict, n: int = N, reduction: str = "mean"):
    model, inputs, targets = build(c, n)
    loss_fn = c["loss_fn"](reduction)
    return model, inputs, targets, loss_fn, loop_per_sample_grads(model, inputs, targets, loss_fn)


class Paths:
    """Spy on the engine: which parameters took the ghost norm, which were materialised.

    ``ghost``: ids of parameters whose op norm rule returned squared norms (the rule gets
    and returns the parameters themselves);
    ``declined``: whose norm rule declined; ``materialised``: whose per-sample
    gradients were computed. A module took a path if its weight did.
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.ghost: set[int] = set()
        self.declined: set[int] = set()
        self.materialised: set[int] = set()
        write = norms_module.write_per_sample
        table = rules.spec.SPECS

        def spied(norm):
            def spy(call, g, wanted):
                try:
                    got = norm(call, g, wanted)
                except rules.Decline:
                    self.declined.update(id(t) for t in wanted)
                    raise
                self.ghost.update(id(t) for t in wanted)
                return got

            return spy

        for func, spec in list(table.items()):
            if spec.norm is not None:
                monkeypatch.setitem(table, func, dataclasses.replace(spec, norm=spied(spec.norm)))

        def spy_write(cap, dest, *args):
            self.materialised.update(dest)
            return write(cap, dest, *args)

        monkeypatch.setattr(norms_module, "write_per_sample", spy_write)

    def took_ghost(self, module: nn.Module) -> bool:
        w = id(module.weight)
        return w in self.ghost and w not in self.declined | self.materialised

    def took_materialise(self, module: nn.Module) -> bool:
        w = id(module.weight)
        return w in self.materialised and w not in self.ghost


@pytest.fixture
def paths(monkeypatch):
    return Paths(monkeypatch)


# ---------------------------------------------------------------------------
# the reference


def test_reference_norms_are_not_trivial():
    """Distinct, non-zero norms per sample, or agreeing with them proves little."""
    *_, want = reference(BY_ID["simple-cnn"])
    norms = norms_of(want)
    assert (norms > 0).all()
    assert len(set(norms.tolist())) == N


# ---------------------------------------------------------------------------
# the norm rules themselves: values and the cost-based choice


def materialised_linear_sq(a: Tensor, g: Tensor) -> tuple[Tensor, Tensor]:
    """``a (n, t, i)``, ``g (n, t, o)`` -> squared norms of the weight and bias gradients."""
    w = torch.einsum("nto,nti->noi", g, a)
    return w.square().sum((1, 2)), g.sum(1).square().sum(1)


@pytest.mark.parametrize("shape, ghost", [
    ((), True),  # T = 1, (n, i) input: |a|^2 |g|^2
    ((1,), True),  # T = 1 as a sequence of one
    ((3,), True),  # 3 * (16 + 12) <= 16 * 12: the T x T Gram form
    ((2, 3), True),  # T = 6 over two dims: 6 * 28 = 168 <= 192
    ((12,), False),  # 12 * 28 > 192: materialising is cheaper
    ((4, 5), False),
], ids=["T1-2d", "T1-seq", "T3-gram", "T6-4d-gram", "T12-materialise", "T20-4d-materialise"])
def test_linear_ghost_norm(shape, ghost):
    n = 4
    a = randn(n, *shape, 16).reshape(n, -1, 16)  # (n, t, i)
    g = randn(n, *shape, 12).reshape(n, -1, 12)  # (n, t, o)
    got = ghost_norm(a, g)
    if not ghost:
        assert got is None
        return
    want_w, _ = materialised_linear_sq(a, g)
    torch.testing.assert_close(got, want_w, **TOL)


# ---------------------------------------------------------------------------
# the ghost paths end to end: values, and which path the engine took


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("shape, ghost", [
    ((), True), ((3,), True), ((2, 2), True), ((12,), False),
], ids=["T1", "T3-gram", "T4-4d-gram", "T12-materialise"])
def test_linear_sequence_paths(shape, ghost, reduction, paths):
    model = nn.Linear(16, 12)
    x = randn(5, *shape, 16)
    y = randn(5, *shape, 12)
    loss_fn = nn.MSELoss(reduction=reduction)
    want = loop_per_sample_grads(model, x, y, loss_fn)
    total, layers = per_sample_grad_norms(model, x, y, loss_fn, per_layer=True)
    torch.testing.assert_close(total, norms_of(want), **TOL)
    for name, norm in layer_norms(want).items():
        torch.testing.assert_close(layers[name], norm, **TOL)
    assert paths.took_ghost(model) if ghost else paths.took_materialise(model)


@pytest.mark.parametrize("padding_idx", [None, 0])
def test_embedding_large_vocabulary_takes_ghost_path(padding_idx, paths):
    emb = nn.Embedding(1000, 4, padding_idx=padding_idx)
    model = nn.Sequential(emb, nn.Tanh(), nn.Flatten(), nn.Linear(6 * 4, 3))
    ids = torch.randint(0, 4, (5, 6))  # repeated ids in every sample
    ids[:, 0] = 0
    y = torch.randint(0, 3, (5,))
    loss_fn = nn.CrossEntropyLoss()
    want = loop_per_sample_grads(model, ids, y, loss_fn)
    total, layers = per_sample_grad_norms(model, ids, y, loss_fn, per_layer=True)
    torch.testing.assert_close(total, norms_of(want), **TOL)
    torch.testing.assert_close(layers["0.weight"], layer_norms(want)["0.weight"], **TOL)
    assert paths.took_ghost(emb)
    assert paths.took_ghost(model[3])  # T = 1


def test_embedding_small_vocabulary_materialises(paths):
    emb = nn.Embedding(5, 3, padding_idx=1)
    ids = torch.randint(0, 5, (4, 6))
    ids[:, 0] = 1
    y = randn(4, 6, 3)
    want = loop_per_sample_grads(emb, ids, y, nn.MSELoss())
    got = per_sample_grad_norms(emb, ids, y, nn.MSELoss())
    torch.testing.assert_close(got, norms_of(want), **TOL)
    assert paths.took_materialise(emb)


class TinyLM(nn.Module):
    """Large-vocabulary embedding, then two Linear layers on a sequence (Gram forms)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(500, 8, padding_idx=0)
        self.up = nn.Linear(8, 32)  # T = 4: 4 * 40 <= 256
        self.down = nn.Linear(32, 5)  # T = 4: 4 * 37 <= 160

    def forward(self, x: Tensor) -> Tensor:
        return self.down(torch.tanh(self.up(self.emb(x)))).transpose(1, 2)  # (B, 5, T)


@pytest.mark.parametrize("chunk_size", [None, 2])
def test_sequence_model_all_ghost(chunk_size, paths):
    """(A chunk of one sample would take the plain gradient instead: 6 samples.)"""
    model = TinyLM()
    ids = torch.randint(0, 20, (6, 4))
    ids[1:, 3] = 0
    y = torch.randint(0, 5, (6, 4))
    loss_fn = nn.CrossEntropyLoss()
    want = loop_per_sample_grads(model, ids, y, loss_fn)
    total, layers = per_sample_grad_norms(model, ids, y, loss_fn, per_layer=True,
                                          chunk_size=chunk_size)
    torch.testing.assert_close(total, norms_of(want), **TOL)
    for name, norm in layer_norms(want).items():
        torch.testing.assert_close(layers[name], norm, **TOL)
    assert paths.took_ghost(model.emb) and paths.took_ghost(model.up)
    assert paths.took_ghost(model.down)


def test_conv_and_norm_layers_materialise_one_layer_at_a_time(paths):
    """The fallback and layers without a norm rule still give the loop's norms."""
    model, inputs, targets, loss_fn, want = reference(BY_ID["custom-scale"])
    got = per_sample_grad_norms(model, inputs, targets, loss_fn)
    torch.testing.assert_close(got, norms_of(want), **TOL)
    assert paths.took_materialise(model[1])  # Scale: no rule, the fallback
    assert paths.took_ghost(model[0]) and paths.took_ghost(model[3])


# ---------------------------------------------------------------------------
# weight tying: the norm of the summed contribution


def assert_tied_norm(got: Tensor, parts: list[Tensor]) -> None:
    """``got`` is ``|sum of parts|`` per sample, and neither wrong combination of part norms."""
    flat = [p.flatten(1) for p in parts]
    right = sum(flat).norm(dim=1)
    sum_of_norms = sum(f.norm(dim=1) for f in flat)
    root_sum_sq = torch.stack([f.norm(dim=1) for f in flat]).square().sum(0).sqrt()
    assert all(f.abs().sum() > 0 for f in flat)
    torch.testing.assert_close(got, right, **TOL)
    for wrong in (sum_of_norms, root_sum_sq):
        assert ((got - wrong).abs() > 1e-6 * wrong).all(), (got, wrong)


def untied_lm(model: TiedLM) -> TiedLM:
    untied = TiedLM(model.emb.num_embeddings, model.emb.embedding_dim)
    untied.load_state_dict(model.state_dict())
    untied.out.weight = nn.Parameter(model.emb.weight.detach().clone())
    return untied


@pytest.mark.parametrize("vocab, dim", [(11, 4), (200, 16)], ids=["small", "ghost-sized"])
@pytest.mark.parametrize("method", METHODS)
def test_tied_embedding_and_output(vocab, dim, method):
    """``(200, 16)``: untied, both calls would take the ghost norm (T = 4)."""
    model = TiedLM(vocab, dim)
    ids = torch.randint(0, vocab, (4, 4))
    y = torch.randint(0, vocab, (4, 4))
    loss_fn = nn.CrossEntropyLoss()
    want = loop_per_sample_grads(model, ids, y, loss_fn)
    total, layers = per_sample_grad_norms(model, ids, y, loss_fn, method=method, per_layer=True)
    assert list(layers) == ["emb.weight", "mix.weight", "mix.bias", "out.bias"]
    torch.testing.assert_close(total, norms_of(want), **TOL)
    untied = untied_lm(model)
    parts = per_sample_grads(untied, ids, y, loss_fn, method="loop")
    assert_tied_norm(layers["emb.weight"], [parts["emb.weight"], parts["out.weight"]])
    torch.testing.assert_close(layers["emb.weight"], layer_norms(want)["emb.weight"], **TOL)


class LinearTwiceUntied(nn.Module):
    """``LinearTwice`` with the two calls on two copies of the cell."""

    def __init__(self, tied: LinearTwice):
        super().__init__()
        self.cell1 = nn.Linear(4, 4)
        self.cell2 = nn.Linear(4, 4)
        self.cell1.load_state_dict(tied.cell.state_dict())
        self.cell2.load_state_dict(tied.cell.state_dict())
        self.head = tied.head

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.cell2(torch.tanh(self.cell1(x)))))


@pytest.mark.parametrize("method", METHODS)
def test_linear_called_twice(method):
    """Each call alone would take the ghost norm (T = 1); the parameter gets the sum."""
    model, inputs, targets, loss_fn, want = reference(BY_ID["linear-called-twice"], 4)
    total, layers = per_sample_grad_norms(model, inputs, targets, loss_fn, method=method,
                                          per_layer=True)
    torch.testing.assert_close(total, norms_of(want), **TOL)
    parts = per_sample_grads(LinearTwiceUntied(model), inputs, targets, loss_fn, method="loop")
    for name in ["weight", "bias"]:
        assert_tied_norm(layers[f"cell.{name}"], [parts[f"cell1.{name}"], parts[f"cell2.{name}"]])


def test_linear_called_twice_on_sequences_gram_sized():
    """A Linear called twice on sequences where each call alone would use the Gram form."""

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.cell = nn.Linear(16, 16)  # T = 3: 3 * 32 <= 256

        def forward(self, x):
            return self.cell(torch.tanh(self.cell(x)))

    model = Twice()
    x, y = randn(4, 3, 16), randn(4, 3, 16)
    want = loop_per_sample_grads(model, x, y, nn.MSELoss())
    total, layers = per_sample_grad_norms(model, x, y, nn.MSELoss(), per_layer=True)
    torch.testing.assert_close(total, norms_of(want), **TOL)
    torch.testing.assert_close(layers["cell.weight"], layer_norms(want)["cell.weight"], **TOL)


# ---------------------------------------------------------------------------
# chunks, batch sizes, dtypes


@pytest.mark.parametrize("chunk_size", [1, 3])
@pytest.mark.parametrize("c", ALL_CASES, ids=ALL_IDS)
def test_chunks_equal_whole_batch(c, chunk_size):
    model, inputs, targets, loss_fn, want = reference(c, 5)
    whole = per_sample_grad_norms(model, inputs, targets, loss_fn, method="rules")
    total, layers = per_sample_grad_norms(model, inputs, targets, loss_fn, method="rules",
                                          chunk_size=chunk_size, per_layer=True)
    torch.testing.assert_close(total, whole, rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(total, norms_of(want), **TOL)
    for name, norm in layer_norms(want).items():
        torch.testing.assert_close(layers[name], norm, **TOL)


@pytest.mark.parametrize("method", ["vmap", "loop"])
def test_chunks_other_methods(method):
    model, inputs, targets, loss_fn, want = reference(BY_ID["tied-embedding-output"], 5)
    got = per_sample_grad_norms(model, inputs, targets, loss_fn, method=method, chunk_size=2)
    torch.testing.assert_close(got, norms_of(want), **TOL)


@pytest.mark.parametrize("method", ["rules", "vmap", "loop"])
@pytest.mark.parametrize("c", ALL_CASES, ids=ALL_IDS)
def test_batch_of_one(c, method):
    model, inputs, targets, loss_fn, want = reference(c, 1)
    total, layers = per_sample_grad_norms(model, inputs, targets, loss_fn, method=method,
                                          per_layer=True)
    assert total.shape == (1,)
    torch.testing.assert_close(total, norms_of(want), **TOL)
    for name, norm in layer_norms(want).items():
        torch.testing.assert_close(layers[name], norm, **TOL)


@pytest.mark.parametrize("method", METHODS)
def test_batch_of_zero(method):
    model, inputs, targets, loss_fn, _ = reference(BY_ID["simple-cnn"])
    total, layers = per_sample_grad_norms(model, inputs[:0], targets[:0], loss_fn,
                                          method=method, per_layer=True)
    assert total.shape == (0,) and total.dtype == torch.float64
    assert list(layers) == [name for name, _ in model.named_parameters()]
    assert all(v.shape == (0,) for v in layers.values())


@pytest.mark.parametrize("method", METHODS)
def test_float32_model_gives_float32_norms(method):
    model = nn.Sequential(nn.Conv1d(2, 3, 3), nn.Flatten(), nn.Linear(9, 4)).float()
    x = torch.randn(3, 2, 5, dtype=torch.float32)
    y = torch.randint(0, 4, (3,))
    got = per_sample_grad_norms(model, x, y, nn.CrossEntropyLoss(), method=method)
    assert got.dtype == torch.float32
    want = norms_of(loop_per_sample_grads(model, x, y, nn.CrossEntropyLoss()))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_sample_norm_independent_of_the_rest_of_the_batch():
    model, inputs, targets, loss_fn, _ = reference(BY_ID["simple-cnn"], 4)
    a = per_sample_grad_norms(model, inputs, targets, loss_fn)
    inputs2 = inputs.clone()
    inputs2[1:] = torch.randn_like(inputs2[1:])
    b = per_sample_grad_norms(model, inputs2, targets, loss_fn)
    torch.testing.assert_close(a[0], b[0], rtol=1e-12, atol=1e-13)
    assert not torch.allclose(a[1:], b[1:])


# ---------------------------------------------------------------------------
# nothing left on the model; bad options


@pytest.mark.parametrize("method", ["rules", "vmap"])
@pytest.mark.parametrize("c", ALL_CASES, ids=ALL_IDS)
def test_model_unchanged(c, method, snapshot):
    model, inputs, targets = build(c)
    for k, p in enumerate(model.parameters()):
        if k % 2 == 0:
            p.grad = torch.randn_like(p)  # an existing .grad keeps its identity and values
    state = snapshot(model)
    per_sample_grad_norms(model, inputs, targets, c["loss_fn"]("mean"), method=method,
                          per_layer=True)
    state.assert_unchanged()
    assert torch.is_grad_enabled()


@pytest.mark.parametrize("kwargs, pattern", [
    ({"method": "fast"}, r"method='fast' is not one of"),
    ({"chunk_size": 0}, r"chunk_size must be a positive int or None, got 0"),
], ids=["method", "chunk-0"])
def test_bad_options(kwargs, pattern, snapshot):
    model, inputs, targets, loss_fn, _ = reference(BY_ID["mlp"])
    state = snapshot(model)
    with pytest.raises(ValueError, match=pattern):
        per_sample_grad_norms(model, inputs, targets, loss_fn, **kwargs)
    state.assert_unchanged()


def test_batchnorm_in_training_mode(snapshot):
    model, inputs, targets, loss_fn, _ = reference(BY_ID["batchnorm-eval"])
    model.train()
    state = snapshot(model)
    with pytest.raises(ValueError, match=r"'1' \(BatchNorm2d\).*eval\(\)"):
        per_sample_grad_norms(model, inputs, targets, loss_fn)
    state.assert_unchanged()



def test_unsupported_module():
    """"rules" raises naming the module; "auto" falls back to the loop as per_sample_grads."""
    model = nn.Sequential(nn.Linear(3, 4), OpaqueGate(), nn.Linear(4, 2))
    x, y = randn(3, 3), randn(3, 2)
    want = norms_of(loop_per_sample_grads(model, x, y, nn.MSELoss()))
    with pytest.raises(persample.UnsupportedModuleError, match=r"module '1' \(OpaqueGate\)"):
        per_sample_grad_norms(model, x, y, nn.MSELoss(), method="rules")
    with pytest.warns(UserWarning, match="method='loop'"):
        got = per_sample_grad_norms(model, x, y, nn.MSELoss(), method="auto")
    torch.testing.assert_close(got, want, **TOL)


def test_inputs_tuple_unpacked():
    """Several positional inputs reach the model as ``model(*inputs)``."""
    model, inputs, targets, loss_fn, want = reference(BY_ID["two-inputs"])
    assert len(as_tuple(inputs)) == 2
    got = per_sample_grad_norms(model, list(inputs), targets, loss_fn)
    torch.testing.assert_close(got, norms_of(want), **TOL)
