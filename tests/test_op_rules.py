"""One registration per op: the rule tables agree with the data flow, every rule file is
loaded, and each case of ``cases_ops.py`` really takes its op rule.

(The cases themselves run against the loop over samples with every other case, in
``test_battery.py`` and ``test_dp_clip.py``.)
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import persample
import persample.rules as rules
from cases import as_tuple, assert_grads_equal, build
from cases_ops import OP_CASES
from persample.batch.flow import HANDLERS, handler_of, name_of
from persample.batch.forms import forms
from persample.engine import pullback
from persample.rules.spec import SPECS, OpSpec, register, unregister


def test_every_op_with_a_rule_has_a_data_flow_handler():
    """Without one the capture gives the op's output an unknown layout, and the rule never
    runs (the parameter would quietly take a slower path)."""
    assert [name_of(f) for f, spec in SPECS.items() if spec.grad and handler_of(f) is None] == []


def test_each_function_has_one_spec_covering_every_form_of_its_ops():
    for f, spec in SPECS.items():
        assert f in spec.funcs
        for op in spec.ops:  # (less what other libraries put in torch's place since:
            found = {f for f in forms(op)  # torch_geometric's torch.index_select)
                     if (getattr(f, "__module__", None) or "torch").split(".")[0] == "torch"}
            assert found <= set(spec.funcs), name_of(op)
    assert SPECS[torch.Tensor.__rmul__] is SPECS[torch.mul] is SPECS[torch.multiply]
    assert SPECS[torch.Tensor.__isub__] is SPECS[torch.sub] is not SPECS[torch.add]


def test_forms_keep_only_ops_with_the_same_arguments():
    """``torch.batch_norm`` takes ``(input, weight, bias, running_mean, ...)``, not
    ``F.batch_norm``'s ``(input, running_mean, running_var, ...)``: another op."""
    assert torch.batch_norm not in forms(F.batch_norm)
    assert torch.embedding not in forms(F.embedding)  # (weight, indices)
    assert torch.layer_norm in forms(F.layer_norm)
    assert {torch.Tensor.__truediv__, torch.true_divide, torch.Tensor.div_} <= set(forms(torch.div))


def test_a_rule_without_a_data_flow_handler_is_refused_when_registered():
    def unknown_op(x):
        return x

    with pytest.raises(ValueError, match="unknown_op has no data-flow handler.*flow=handler"):
        register(OpSpec((unknown_op,), grad=lambda call, g, out: None))
    assert unknown_op not in SPECS and unknown_op not in HANDLERS


def test_a_spec_is_refused_where_another_covers_the_op():
    with pytest.raises(ValueError, match="already covered by the spec of"):
        register(OpSpec((torch.Tensor.__mul__,), grad=lambda call, g, out: None))


def test_a_norm_rule_needs_a_gradient_rule():
    with pytest.raises(ValueError, match="norm rule but no gradient rule"):
        register(OpSpec((torch.cumsum,), norm=lambda call, g, wanted: {}))
    assert torch.cumsum not in SPECS


def test_a_spec_declares_its_data_flow_handler_with_it():
    """An op the data flow does not know yet is declared in one place: its spec names the
    handler, which lands in the data-flow table."""

    def new_op(x):
        return x

    def flow(ctx, func, args, kwargs, out):
        return ctx.layout(args[0])

    try:
        spec = register(OpSpec((new_op,), grad=lambda call, g, out: None, flow=flow))
        assert HANDLERS[new_op] is flow and SPECS[new_op] is spec
    finally:
        HANDLERS.pop(new_op, None)
        unregister(spec)


def test_every_rule_family_is_listed():
    """Each module of ``persample/rules/`` that registers specs is imported by the package,
    listed in its ``__init__``."""
    families = {spec.grad.__module__ if spec.grad else spec.expand.__module__
                for spec in SPECS.values()}
    listed = {f"persample.rules.{name}" for name in ("activation", "addcmul", "attention",
              "composite", "conv", "einsum", "elementwise", "embedding", "experts", "linear",
              "norm", "recurrent", "random_ops", "reparametrized", "resample", "sdpa", "solve",
              "views")}
    assert families <= listed
    assert rules.recurrent.RECURRENT.grad.__module__ in listed


@pytest.mark.parametrize("c", OP_CASES, ids=[c["id"] for c in OP_CASES])
def test_op_cases_take_their_rule(c, monkeypatch):
    """``supported`` plans the rule, and every op's rule runs without declining (a
    declined rule's exact fallback would answer the same)."""
    run = pullback._run_rule

    def strict(op, *args):
        why = run(op, *args)
        assert why is None, f"{op.where()}: its rule declined ({why})"
        return why

    monkeypatch.setattr(pullback, "_run_rule", strict)
    model, inputs, targets = build(c)
    loss_fn = c["loss_fn"]("sum")
    routes = persample.supported(model, inputs, targets, loss_fn)
    assert {r.path for r in routes} == {"rule"}, [(r.module, r.path, r.reason) for r in routes]
    got = persample.per_sample_grads(model, inputs, targets, loss_fn, method="rules")
    assert_grads_equal(got, persample.loop_per_sample_grads(model, inputs, targets, loss_fn))
    assert as_tuple(inputs)[0].dtype == torch.float64
