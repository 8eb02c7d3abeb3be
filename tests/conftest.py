"""Shared fixtures: float64 by default, a seeded RNG, and a snapshot of a model's state.

``snapshot(model)`` records everything ``per_sample_grads`` promises to leave
alone (nothing is left behind on the model); ``.assert_unchanged()``
compares the model with it afterwards.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


# persample's internal errors fail the tests instead of being answered by a fallback
# (also in the processes the tests start, which inherit the environment)
os.environ["PERSAMPLE_RAISE_INTERNAL"] = "1"


@pytest.fixture
def fallbacks_answer_internal_errors(monkeypatch):
    """For a test of the fallback itself: persample's internal errors answered by the
    next method, as users get them."""
    monkeypatch.delenv("PERSAMPLE_RAISE_INTERNAL", raising=False)


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "keep_default_dtype: run with torch's own default dtype (float32), not float64",
    )
    config.addinivalue_line(
        "markers", "slow: seconds, not milliseconds: a fresh process, several processes, a "
        "real-size model or a training run (deselected by default; run with -m slow)")
    config.addinivalue_line(
        "markers", "cuda: runs on a CUDA GPU where one is present (tests/test_cuda.py)")


# Doctests that run whole benchmark workloads (seconds each): slow, like the tests that do.
SLOW_DOCTESTS = {"persample_bench.bench.bench_case", "persample_bench.bench.format_report",
                 "persample_bench.bench.format_markdown",
                 "persample_bench.bench.run", "persample_bench.anchors.case.under_autocast",
                 "persample_bench.anchors.builders.backprops"}


# Tests of seconds each (summed over their parametrizations): anchors' own runs
# (kronfluence, BackPACK, Opacus's layer configurations drawn by hypothesis), accounting
# sweeps, real-size rows and real models, training runs, the API site's build. They run
# under the slow marker, so that the default run stays near six minutes on two cores.
SLOW_TESTS = {
    "tests/test_peer_suites.py::test_opacus_layer_configurations",
    "tests/test_peer_suites.py::test_backpack_batch_grad_problems",
    "tests/test_peer_suites.py::test_opacus_embedding_bag_configurations",
    "tests/test_peer_suites.py::test_opinfo_samples_match_the_loop",
    "tests/test_bench_real.py::test_every_row_agrees_with_the_reference",
    "tests/test_bench_real.py::test_very_slow_baseline_and_methods_are_timed_in_one_round",
    "tests/test_influence_anchors.py::test_scores_match_kronfluence",
    "tests/test_influence.py::test_projected_scores_are_the_projections_of_the_exact_ones",
    "tests/test_real_models.py::test_param_jacobian",
    "tests/test_real_models.py::test_per_sample_grads",
    "tests/test_dp_accounting.py::test_noise_multiplier_for_prv_meets_the_target",
    "tests/test_dp_accounting.py::test_epsilon_matches_dp_accounting",
    "tests/test_dp_accounting.py::test_prv_is_opacus_prv_and_as_tight_as_pld",
    "tests/test_dp_accounting.py::test_noise_multiplier_round_trip",
    "tests/test_dp_accounting.py::test_noise_multiplier_for_pld_is_near_the_exact_gaussian",
    "tests/test_dp_audit.py::test_the_command_line",
    "tests/test_dp_training.py::test_a_seed_reproduces_the_run",
    "tests/test_dp_training.py::test_the_target_is_spent_over_the_planned_steps",
    "tests/test_dp_training.py::test_a_dataloader_is_taken_as_opacus_takes_it",
    "tests/test_ggn_diag.py::test_monte_carlo_draws_by_hand_and_their_mean",
    "tests/test_laplace_backend.py::test_monte_carlo_fisher_is_the_ggn_on_average",
    "tests/test_readme.py::test_api_reference_has_every_public_name",
}


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config, items):
    """Mark the doctests of :data:`SLOW_DOCTESTS` slow (a doctest takes no marker of its
    own), then drop the combinations that do not exist: ``method="vmap"`` on a case
    torch.func cannot batch (``vmap=False``, the RNNs). ``test_vmap_refuses_recurrent_models``
    checks that every such case gets the clear error instead."""
    from cases import BY_ID

    for item in items:
        if type(item).__name__ == "DoctestItem" and item.name in SLOW_DOCTESTS:
            item.add_marker(pytest.mark.slow)
        if item.nodeid.split("[")[0] in SLOW_TESTS:
            item.add_marker(pytest.mark.slow)

    def exists(item) -> bool:
        params = getattr(item, "callspec", None)
        params = params.params if params else {}
        c = params.get("c") or BY_ID.get(params.get("case_id"))
        return not (params.get("method") == "vmap" and isinstance(c, dict) and not c["vmap"])

    kept = [item for item in items if exists(item)]
    if len(kept) != len(items):
        config.hook.pytest_deselected(items=[i for i in items if i not in kept])
        items[:] = kept


@pytest.fixture(autouse=True)
def float64_and_seed(request):
    """Every test runs with float64 as the default dtype, a fixed seed and one CPU thread.

    All three are restored afterwards. One thread: the tensors here are tiny, and
    on a busy 2-core machine torch's spinning worker threads make the suite
    several times slower. A test (or module, via ``pytestmark``) marked
    ``keep_default_dtype`` keeps torch's default dtype, e.g. one that runs the
    float32 benchmark workloads.
    """
    dtype = torch.get_default_dtype()
    rng = torch.random.get_rng_state()
    threads = torch.get_num_threads()
    if request.node.get_closest_marker("keep_default_dtype") is None:
        torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_default_dtype(dtype)
        torch.random.set_rng_state(rng)
        torch.set_num_threads(threads)


def _hooks(module: nn.Module) -> dict[str, list]:
    return {
        name: list(getattr(module, name).items())
        for name in _HOOK_DICTS
        if hasattr(module, name)
    }


def _same(a: object, b: object) -> bool:
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False
    return bool(a == b)


class ModelState:
    """Everything about ``model`` that a per-sample call must not change."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.modules = list(model.named_modules(remove_duplicate=False))
        self.module_ids = [(name, id(m)) for name, m in self.modules]
        self.vars = {name: dict(vars(m)) for name, m in self.modules}
        self.hooks = {name: _hooks(m) for name, m in self.modules}
        self.training = {name: m.training for name, m in self.modules}
        self.params = list(model.named_parameters(remove_duplicate=False))
        self.param_ids = [(name, id(p)) for name, p in self.params]
        self.values = {name: p.detach().clone() for name, p in self.params}
        self.requires_grad = {name: p.requires_grad for name, p in self.params}
        self.grads = {
            name: None if p.grad is None else (id(p.grad), p.grad.detach().clone())
            for name, p in self.params
        }
        self.param_vars = {name: dict(vars(p)) for name, p in self.params}
        self.buffers = {n: b.detach().clone() for n, b in model.named_buffers()}

    def assert_unchanged(self) -> None:
        model = self.model
        modules = list(model.named_modules(remove_duplicate=False))
        assert [(name, id(m)) for name, m in modules] == self.module_ids
        for name, m in modules:
            where = f"module {name!r}"
            assert _hooks(m) == self.hooks[name], f"{where}: hooks changed"
            now = vars(m)
            assert now.keys() == self.vars[name].keys(), f"{where}: attributes changed"
            for key, value in self.vars[name].items():
                if key.startswith("_") and isinstance(value, dict):
                    # _parameters, _buffers, _modules and the hook dicts: same entries.
                    assert list(now[key].items()) == list(value.items()), f"{where}: {key}"
                else:
                    assert _same(now[key], value), f"{where}: {key} changed"
            assert m.training == self.training[name], f"{where}: training flag changed"
        params = list(model.named_parameters(remove_duplicate=False))
        assert [(name, id(p)) for name, p in params] == self.param_ids
        for name, p in params:
            assert torch.equal(p.detach(), self.values[name]), f"{name}: value changed"
            assert p.requires_grad == self.requires_grad[name], f"{name}: requires_grad"
            assert vars(p).keys() == self.param_vars[name].keys(), f"{name}: attributes"
            before = self.grads[name]
            if before is None:
                assert p.grad is None, f"{name}: .grad was None and is now set"
            else:
                assert p.grad is not None, f"{name}: .grad was removed"
                assert id(p.grad) == before[0], f"{name}: .grad replaced"
                assert torch.equal(p.grad, before[1]), f"{name}: .grad values changed"
        for name, b in model.named_buffers():
            assert torch.equal(b, self.buffers[name]), f"buffer {name}: changed"


@pytest.fixture
def patch_spec(monkeypatch):
    """``patch_spec(func, **changes)`` replaces the spec of the op ``func`` (for every
    function it covers) by a copy with ``changes`` (``grad=spy``, ``norm=None``...) for
    the test; returns the spec it replaced."""
    import dataclasses

    from persample.rules import spec as table

    def patch(func, **changes):
        old = table.SPECS[func]
        new = dataclasses.replace(old, **changes)
        for f in old.funcs:
            monkeypatch.setitem(table.SPECS, f, new)
            if new.expand is not None:
                monkeypatch.setitem(table.EXPANSIONS, f, new.expand)
        return old

    return patch


@pytest.fixture
def snapshot():
    """``snapshot(model)`` -> a :class:`ModelState` with ``assert_unchanged()``."""
    return ModelState


@pytest.fixture(params=[False, True], ids=["program", "compiled"])
def compiled(request, monkeypatch):
    """Each test of the cached calls twice: the program checked op by op, and the forward
    compiled from the call after the one that traced its program."""
    import persample
    from persample.engine import tapes

    monkeypatch.setattr(tapes, "COMPILE_AFTER", 0)
    before = persample.compile_calls(request.param)
    persample.clear_plans()
    yield request.param
    persample.compile_calls(before)
