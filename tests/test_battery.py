"""Every case of ``cases.py`` through every function, against the loop over samples.

One test per case, method and reduction (ids ``case-method-reduction``), each running
:func:`battery.check` on the case's model in float64: ``per_sample_grads``,
``per_sample_grad_norms`` (total and per parameter) and, where the model returns one
tensor with the batch in dim 0, ``param_jacobian``, each called with the method and
compared with the loop; ``private_grad`` (noise 0, against the clipped mean by hand)
once per case; the model left unchanged.

The axes:

- case: every case of ``cases.CASES`` (the layers, ops and models of ``cases.py``,
  ``cases_layers.py``, ``cases_ops.py``, ``cases_recurrent.py``) and of
  ``cases.EDGE_CASES`` (structures a capture engine can misread);
- method: ``"rules"``, ``"vmap"``, ``"auto"`` (which must not leave the rules: a
  warning that it did fails the test, as does one that torch.func batched an op by its
  slow per-sample fallback, on the rules) and ``"loop"`` (the same functions over the loop's
  per-sample gradients). ``"vmap"`` on a case torch.func cannot batch (``vmap=False``,
  the recurrent layers) is deselected (``conftest.py``), its refusal tested in
  ``test_per_sample_grads.py``; ``param_jacobian(method="vmap")`` on a case marked
  ``vmap_jacobian=False`` must refuse, clearly;
- reduction: how the case's loss reduces over the batch. Each sample's loss is
  evaluated on its own slice of the output, so the reduction only changes what that
  per-sample loss is, which the rules split; every other method gets it the same way,
  so only ``"rules"`` is crossed with both, the others run ``"mean"``.
  ``param_jacobian`` has no loss: it runs in the ``"mean"`` tests; ``private_grad``
  always takes ``method="auto"``: it runs in the ``auto`` test.
"""

from __future__ import annotations

import pytest

import persample
from battery import LEAVING, SLOWER, check
from cases import CASE_IDS, CASES, EDGE_CASE_IDS, EDGE_CASES, N, build, jacobian_cases

ALL_CASES = CASES + EDGE_CASES
ALL_IDS = CASE_IDS + EDGE_CASE_IDS
RUNS = [("rules", "mean"), ("rules", "sum"), ("vmap", "mean"), ("auto", "mean"),
        ("loop", "mean")]
JACOBIAN = {c["id"] for c in jacobian_cases()}
# The op rule leaves this configuration to the op's per-sample VJP from torch.func, which
# batches embedding_bag by torch's slow per-sample fallback (its warning is expected; see
# test_layer_rules.py). Every other case must raise no such warning on the rules.
OP_VJP = {"embeddingbag-scale-grad-by-freq"}


def test_enough_cases():
    assert len(CASES) >= 150 and len(EDGE_CASES) >= 6 and len(JACOBIAN) >= 40


@pytest.mark.parametrize("method, reduction", RUNS, ids=[f"{m}-{r}" for m, r in RUNS])
@pytest.mark.parametrize("c", ALL_CASES, ids=ALL_IDS)
def test_matches_loop(c, method, reduction):
    model, inputs, targets = build(c, N)
    jacobian = c["id"] in JACOBIAN and reduction == "mean"
    if jacobian and method == "vmap" and not c.get("vmap_jacobian", True):
        # torch.func gets vmap(jacrev(...)) of F.prelu wrong (torch 2.13: a shape error,
        # or silently wrong rows for the layers before it): refused, naming the layer
        with pytest.raises(persample.UnsupportedModuleError, match=r"\(PReLU\)"):
            persample.param_jacobian(model, inputs, method="vmap")
        jacobian = False
    check(model, inputs, targets, c["loss_fn"](reduction), methods=(method,), paths=None,
          jacobian=jacobian, dp=method == "auto",
          forbid=SLOWER if method in ("rules", "auto") and c["id"] not in OP_VJP else LEAVING)
