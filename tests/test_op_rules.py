"""One registration per op: the rule tables agree with the data flow, every rule file is
loaded, and each case of ``cases_ops.py`` really takes its op rule.

(The cases themselves run against the loop over samples with every other case, in
``test_per_sample_grads.py``, ``test_param_jacobian.py``, ``test_norms.py`` and
``test_dp_clip.py``.)
"""

from __future__ import annotations

import pkgutil
import sys

import pytest
import torch

import persample
import persample.rules as rules
from cases import as_tuple, assert_grads_equal, build
from cases_ops import OP_CASES
from persample.batch.flow import HANDLERS, name_of
from persample.rules import registry


def test_every_op_with_a_rule_has_a_data_flow_handler():
    """Without one the capture gives the op's output an unknown layout, and the rule never
    runs (the parameter would quietly take a slower path)."""
    assert [name_of(f) for f in registry.OP_RULES if f not in HANDLERS] == []
    for kind, table in registry.OP_TABLES.items():
        assert [name_of(f) for f in table if f not in registry.OP_RULES] == [], kind
    registry.check_tables()


def test_the_check_names_an_op_rule_without_a_handler(monkeypatch):
    def lonely(x):
        return x

    monkeypatch.setitem(registry.OP_RULES, lonely, lambda call, g, out: None)
    with pytest.raises(AssertionError, match="lonely.*flow=handler"):
        registry.check_tables()


def test_the_check_names_a_norm_rule_without_an_op_rule(monkeypatch):
    monkeypatch.setitem(registry.OP_NORMS, torch.cumsum, lambda call, g, wanted: None)
    with pytest.raises(AssertionError, match="norm rules of ops without an op rule.*cumsum"):
        registry.check_tables()


def test_a_rule_without_a_data_flow_handler_is_refused_when_registered():
    def unknown_op(x):
        return x

    with pytest.raises(ValueError, match="unknown_op has no data-flow handler.*flow=handler"):
        registry.register_op_rule(unknown_op)
    assert unknown_op not in registry.OP_RULES and unknown_op not in HANDLERS


def test_a_rule_declares_its_data_flow_handler_with_it():
    """An op the data flow does not know yet is declared in one place: its rule names the
    handler, which lands in the data-flow table."""

    def new_op(x):
        return x

    def flow(ctx, func, args, kwargs, out):
        return ctx.layout(args[0])

    try:
        @registry.register_op_rule(new_op, flow=flow)
        def rule(call, g, out):
            return None

        assert HANDLERS[new_op] is flow and registry.OP_RULES[new_op] is rule
        registry.check_tables()
    finally:
        HANDLERS.pop(new_op, None)
        registry.OP_RULES.pop(new_op, None)


def test_every_rule_file_is_loaded():
    """A new file in ``persample/rules/`` is imported with the package: nothing to list."""
    for found in pkgutil.iter_modules(rules.__path__):
        assert f"persample.rules.{found.name}" in sys.modules


@pytest.mark.parametrize("c", OP_CASES, ids=[c["id"] for c in OP_CASES])
def test_op_cases_take_their_rule(c):
    model, inputs, targets = build(c)
    loss_fn = c["loss_fn"]("sum")
    routes = persample.supported(model, inputs, targets, loss_fn)
    assert {r.path for r in routes} == {"rule"}, [(r.module, r.path, r.reason) for r in routes]
    got = persample.per_sample_grads(model, inputs, targets, loss_fn, method="rules")
    assert_grads_equal(got, persample.loop_per_sample_grads(model, inputs, targets, loss_fn))
    assert as_tuple(inputs)[0].dtype == torch.float64
