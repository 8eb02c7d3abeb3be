"""Layouts that hold a call's own indices in the cached calls (persample.capture.lean,
.compiled): tokens routed to experts by a sort of their expert ids (as transformers'
grouped mixtures dispatch them), the rows' samples decided again at every call from
that call's routing, every answer the loop's in float64."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import persample
import zoo
from cached_calls import B, D, T, check, kept
from persample.capture.compiled import Compiled
from persample.capture.lean import Program

E, K = 3, 2  # experts, experts per token


class Routed(nn.Module):
    """A mixture of ``E`` experts, top-``K``, dispatched by a sort of the expert ids: each
    token's rows gathered in expert order, each row multiplied by its expert's weight
    (gathered by id), then put back by the inverse permutation and summed."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(D, E)
        self.weight = nn.Parameter(torch.randn(E, D, D) / D**0.5)
        self.bias = nn.Parameter(torch.randn(E, D) * 0.1)
        self.head = nn.Linear(D, 2)
        self.shift = torch.zeros((), dtype=torch.long)  # (0: each row put back in place)

    def forward(self, x):  # (B, T, D)
        tokens = x.reshape(-1, D)  # (B*T, D)
        weights, ids = torch.topk(torch.softmax(self.router(tokens), -1), K)  # (B*T, K)
        weights = weights / weights.sum(-1, keepdim=True)
        ids_g, perm = torch.sort(ids.reshape(-1))  # (B*T*K,) in expert order
        rows = tokens[perm // K]  # (B*T*K, D)
        out = torch.einsum("nd,nde->ne", rows, self.weight[ids_g])
        out.add_(self.bias[ids_g])
        out = out * weights.reshape(-1)[perm].unsqueeze(-1)
        inverse = torch.empty_like(perm)
        inverse[perm] = torch.arange(perm.shape[0])
        inverse = (inverse + self.shift) % perm.shape[0]
        out = out[inverse].reshape(-1, K, D).sum(1)  # (B*T, D)
        return self.head(out.reshape(x.shape).mean(1))


def _x(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, D, generator=g, dtype=torch.float64)


def test_a_routing_of_each_call_takes_the_cached_call(compiled):
    model, y, loss = Routed().double(), torch.randint(0, 2, (B,)), nn.CrossEntropyLoss()
    routes = set()
    for k in range(5):  # (each call routes its tokens otherwise)
        x = _x(k)
        routes.add(tuple(torch.topk(model.router(x.reshape(-1, D)), K).indices.flatten()
                         .tolist()))
        check(model, x, y, loss)
    assert len(routes) == 5
    assert any(isinstance(found, (Program, Compiled)) for found in kept(model)), kept(model)
    note = persample.verify(model, _x(9), y, loss).plan
    assert note.startswith("cached: compiled" if compiled else "cached: each of"), note
    assert all(r.path == "rule" for r in persample.supported(model, _x(9), y, loss))


def test_index_values_that_move_rows_to_another_sample_are_caught(compiled):
    model, y, loss = Routed().double(), torch.randint(0, 2, (B,)), nn.CrossEntropyLoss()
    for k in range(3):
        check(model, _x(k), y, loss)
    model.shift.fill_(T * K)  # (the same ops and arguments: each token's rows put back
    for k in range(2):  # into the next sample's place)
        with pytest.raises(persample.LossNotPerSampleError):
            persample.per_sample_grads(model, _x(k), y, loss, method="rules")
    model.shift.fill_(0)
    for k in range(3):
        check(model, _x(k), y, loss)


def _gpt_oss_calls(compiles: bool, calls: int, kind: type, plan: str) -> None:
    """``calls`` calls of gpt-oss on other ids each, every one the loop's (float32: its
    router runs there), with calls compiled or not: the kept plan is a ``kind`` and
    ``verify`` says ``plan``."""
    model = zoo.gpt_oss(T)
    before = persample.compile_calls(compiles)
    try:
        persample.clear_plans()
        for k in range(calls):
            ids = torch.randint(0, 50, (B, T), generator=torch.Generator().manual_seed(k))
            check(model, {"input_ids": ids}, ids, zoo.causal_lm_loss, rtol=1e-4, atol=1e-6)
        assert any(isinstance(found, kind) for found in kept(model)), kept(model)
        note = persample.verify(model, {"input_ids": ids}, ids, zoo.causal_lm_loss).plan
        assert note.startswith(plan), note
    finally:
        persample.compile_calls(before)


def test_gpt_oss_takes_the_program_and_stays_exact():
    """transformers' gpt-oss (its experts dispatched by a sort, biases added in place,
    the inverse permutation written into an empty tensor): a program holds its forward,
    each call's routing decided again."""
    pytest.importorskip("transformers")
    _gpt_oss_calls(False, 4, Program, "cached: each of")


def test_gpt_oss_compiled_runs_the_eager_grouped_product_and_stays_exact(monkeypatch):
    """Under TorchDynamo transformers calls its own ``grouped_mm_fallback`` op for float32
    experts, where its eager forward calls ``torch._grouped_mm``: the compiled call runs
    the eager op (the fallback's backward would also make the weights' gradients), which
    takes its rule, and every call stays the loop's."""
    pytest.importorskip("transformers")
    import transformers.integrations.moe  # noqa: F401  (it registers the op)

    from persample.capture import compiled as compiled_module

    graphs, real = [], compiled_module._as_eager
    monkeypatch.setattr(compiled_module, "_as_eager", lambda gm: (real(gm), graphs.append(
        [str(n.target) for n in gm.graph.nodes if n.op == "call_function"])))
    _gpt_oss_calls(True, 6, Compiled, "cached: compiled")
    names = [name for graph in graphs for name in graph]
    assert sum("_grouped_mm" in name for name in names) == 4, names  # (2 layers x 2)
    assert not any("grouped_mm_fallback" in name for name in names)
