"""The curvature workloads: per-sample GGN diagonals and K-FAC factors, each method as
its users call it.

- ``ggn-diag`` (the seed CNN): persample's ``per_sample_ggn_diag`` against BackPACK's
  ``BatchDiagGGNExact`` and the loop (each sample's ``J^T H J`` from ``C`` backward
  passes of a batch of one); the floor is ``C`` backward passes of the batch, what the
  exact diagonal needs at least (one per column of the loss Hessian's square root).
- ``ggn-diag-mc``: the Monte Carlo diagonal (one label drawn per sample) against the
  loop with the same draws; the floor a plain backward.
- ``kfac-factors`` (the seed CNN): K-FAC's factors with the Monte Carlo Fisher (one
  backward) by persample's ``KFAC`` and curvlinops' ``KFACLinearOperator`` (the same
  seed draws the same labels), against the factors by hand from module hooks; the
  floor a plain backward.
- ``gpt2-768-kfac-factors`` (GPT-2 4x768, its 50,257-token table tied to the output
  layer): K-FAC's factors (empirical Fisher, expand) of the ``Conv1D`` layers' weights,
  and the exact diagonals of the tied table (one pair of factors per parameter cannot
  hold its two uses; its output side as ``lm_head`` would be ``(50257, 50257)``) and of
  the position table (the same lookup for every sample, a tensor of the parameters
  alone), by persample's ``KFAC`` against the same from module hooks by hand (the
  tables' per-sample gradients from their uses' inputs and output gradients, one sample
  at a time); curvlinops and kronfluence take ``nn.Linear`` and ``nn.Conv2d`` only.
  The floor a plain backward.
- ``ekfac-influence`` (a CNN on the 16x16 digits, without biases, which kronfluence
  joins to the weights): the ``(100, 1000)`` influence scores of 1,000 training samples
  on 100 queries with EK-FAC (empirical Fisher, the same damping heuristic), by
  persample's ``influence`` and by kronfluence (fitting its factors and scoring, its
  files in a temporary folder), the reference; the floor a plain backward of the
  training set.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable

import torch
from torch import Tensor, nn

from ..workloads import Workload
from .case import Case, Method, optional_method

KFAC_SEED = 5  # the Monte Carlo labels' seed, the same for persample and curvlinops


def ggn_diag_case(w: Workload, mc: bool = False) -> Case:
    """The per-sample GGN diagonal ``{name: (B, *shape)}``, exact or Monte Carlo.

    Examples:
        >>> from persample_bench.workloads import curvature_workload
        >>> ggn_diag_case(curvature_workload("ggn-diag", 2)).result_shape
        (2, 1199882)
    """
    from persample import per_sample_ggn_diag

    params = dict(w.model.named_parameters())
    total = sum(p.numel() for p in params.values())
    loss_fn = nn.CrossEntropyLoss()

    def ours(_: Tensor | None) -> dict[str, Tensor]:
        gen = torch.Generator().manual_seed(KFAC_SEED) if mc else None
        return per_sample_ggn_diag(w.model, w.inputs, w.targets, loss_fn,
                                   mc_samples=1 if mc else 0, generator=gen)

    methods = [Method("loop", lambda _: _loop_ggn(w, mc)),
               Method("persample", ours, ours=True)]
    if not mc:
        methods.insert(1, optional_method(lambda: _batch_diag_ggn(w),
                                          "BackPACK BatchDiagGGNExact", "backpack", w,
                                          lambda run: run()))
    base = _plain_backward(w)
    floor_label, floor = ("plain backward", base) if mc else (
        f"{_classes(w)} backward passes (the exact diagonal's columns)", _backwards(w))
    return Case(w, "plain backward", base, (w.n, total), "loop", lambda: _loop_ggn(w, mc),
                methods, floor_label=floor_label, floor=floor)


def kfac_case(w: Workload) -> Case:
    """K-FAC's factors (Monte Carlo Fisher, one label per sample, expand), flattened:
    each linear or convolution layer's ``A`` then ``G``.

    Examples:
        >>> from persample_bench.workloads import curvature_workload
        >>> kfac_case(curvature_workload("kfac-factors", 2)).result_shape
        (1, 85055669)
    """
    layers = [(name, m) for name, m in w.model.named_modules()
              if isinstance(m, (nn.Linear, nn.Conv2d))]
    size = sum(_factor_size(m) for _, m in layers)

    def ours(_: Tensor | None) -> Tensor:
        from persample import KFAC

        kfac = KFAC(w.model, fisher="mc",
                    generator=torch.Generator().manual_seed(KFAC_SEED),
                    params=[f"{name}.weight" for name, _ in layers])
        kfac.update(w.inputs, w.targets, nn.CrossEntropyLoss())
        factors = kfac.factors
        return _flat([t for name, _ in layers for t in (factors[f"{name}.weight"][0].A,
                                                        factors[f"{name}.weight"][0].G)])

    return Case(w, "plain backward", _plain_backward(w), (1, size), "by hand (module hooks)",
                lambda: _kfac_by_hand(w, layers), [
        Method("by hand (module hooks)", lambda _: _kfac_by_hand(w, layers)),
        optional_method(lambda: _curvlinops_kfac(w, layers), "curvlinops KFACLinearOperator",
                        "curvlinops", w, lambda run: run()),
        Method("persample", ours, ours=True),
    ], floor_label="plain backward", floor=_plain_backward(w))


def gpt2_kfac_case(w: Workload) -> Case:
    """GPT-2's K-FAC (empirical Fisher, expand), flattened: the tied table's and the
    position table's exact diagonals, then each ``Conv1D`` weight's ``A`` and ``G``.

    Examples:
        >>> from persample_bench.workloads import real_workload
        >>> w = real_workload("gpt2-768-grads", size="tiny")
        >>> gpt2_kfac_case(w).result_shape
        (1, 844048)
    """
    from transformers.pytorch_utils import Conv1D

    named = dict(w.model.named_modules())
    layers = [name for name, m in named.items() if isinstance(m, Conv1D)]
    wte, wpe = "transformer.wte", "transformer.wpe"
    params = [f"{name}.weight" for name in [wte, wpe] + layers]
    size = named[wte].weight.numel() + named[wpe].weight.numel() + sum(
        named[name].weight.shape[0] ** 2 + named[name].weight.shape[1] ** 2
        for name in layers)

    def ours(_: Tensor | None) -> Tensor:
        from persample import KFAC

        kfac = KFAC(w.model, fisher="empirical", params=params, shared="diagonal")
        kfac.update(w.inputs, w.targets, w.loss_fn)
        factors, diagonals = kfac.factors, kfac.diagonals
        return _flat([diagonals[f"{wte}.weight"], diagonals[f"{wpe}.weight"]] + [
            t for name in layers for t in (factors[f"{name}.weight"][0].A,
                                           factors[f"{name}.weight"][0].G)])

    def by_hand(_: Tensor | None) -> Tensor:
        return _gpt2_kfac_by_hand(w, named, layers, wte, wpe)

    def plain() -> None:
        chosen = [named[name.rsplit(".", 1)[0]].weight for name in params]
        torch.autograd.grad(w.loss_fn(w.call(), w.targets).sum(), chosen)

    return Case(w, "plain backward", plain, (1, size), "by hand (module hooks)",
                lambda: by_hand(None), [
        Method("by hand (module hooks)", by_hand),
        Method("curvlinops KFACLinearOperator", None,
               "not applicable: nn.Linear and nn.Conv2d only (GPT-2's layers are Conv1D)"),
        Method("kronfluence", None, "not applicable: nn.Linear and nn.Conv2d only"),
        Method("persample", ours, ours=True),
    ], floor_label="plain backward", floor=plain)


def _gpt2_kfac_by_hand(w: Workload, named: dict[str, nn.Module], layers: list[str],
                       wte: str, wpe: str) -> Tensor:
    """From module hooks: each ``Conv1D``'s inputs and output gradients, and the tables'
    per-sample gradients, squared and summed over the samples: the tied table's the sum
    of its two uses (``lm_head``: ``sum_t g_t h_t^T``; the lookup: its output gradients
    added at the ids), the position table's its sample's gradient at the sum of the
    two lookups, added at the positions (the same for every sample)."""
    inputs, grads, handles = _watch({name: named[name]
                                     for name in [wte, wpe, "lm_head"] + layers})
    try:
        loss = w.loss_fn(w.call(), w.targets).sum()  # each sample's own loss, summed
    finally:
        for h in handles:
            h.remove()
    torch.autograd.grad(loss, [named[name].weight for name in [wte, wpe] + layers])
    n = w.n
    table = named[wte].weight
    diagonal = torch.zeros_like(table)
    for i in range(n):  # (V, d): this sample's gradient of the tied table
        g = grads["lm_head"][i].T @ inputs["lm_head"][i]
        g.index_add_(0, inputs[wte][i], grads[wte][i])
        diagonal += g.square()
    positions = torch.zeros_like(named[wpe].weight)
    ids = inputs[wpe].reshape(-1)  # (T,): the same for every sample
    for i in range(n):
        # the sum of the two lookups is the first block's input: one gradient for both
        g = torch.zeros_like(positions).index_add_(0, ids, grads[wte][i])
        positions += g.square()
    factors = [diagonal / n, positions / n]
    for name in layers:
        a = inputs[name].reshape(-1, inputs[name].shape[-1])
        g = grads[name].reshape(-1, grads[name].shape[-1])
        factors += [a.T @ a / len(a), g.T @ g / n]
    return _flat(factors)


def influence_case(w: Workload, train: int = 1000) -> Case:
    """EK-FAC influence scores ``(queries, train)``: the workload's first ``train``
    samples are the training set, the rest the queries.

    Examples:
        >>> from persample_bench.workloads import curvature_workload
        >>> influence_case(curvature_workload("ekfac-influence", 12), 10).result_shape
        (2, 10)
    """
    x, y = w.inputs, w.targets
    data, queries = (x[:train], y[:train]), (x[train:], y[train:])

    def ours(_: Tensor | None) -> Tensor:
        from persample import influence

        return influence(w.model, data, queries, nn.CrossEntropyLoss(), curvature="ekfac",
                         fisher="empirical", batch_size=250)

    def plain() -> None:
        params = [p for p in w.model.parameters() if p.requires_grad]
        for k in range(0, train, 250):
            loss = nn.CrossEntropyLoss()(w.call(inputs=x[k:k + 250]), y[k:k + 250])
            torch.autograd.grad(loss, params)

    theirs = optional_method(lambda: _kronfluence(w.model, data, queries), "kronfluence",
                             "kronfluence", w, lambda run: run())
    mine = Method("persample", ours, ours=True)
    if theirs.fn is None:  # (no reference to check against: persample's own, said so)
        mine = Method(f"persample (unchecked: kronfluence {theirs.note})", ours, ours=True)
    reference = theirs if theirs.fn is not None else mine
    return Case(w, "plain backward of the training set", plain, (len(queries[1]), train),
                reference.name, lambda: reference.fn(None), [theirs, mine],
                floor_label="plain backward of the training set", floor=plain)


def _kronfluence(model: nn.Module, train: tuple, query: tuple) -> Callable[[], Tensor]:
    """kronfluence's EK-FAC scores (empirical Fisher, damping ``None``: its heuristic,
    0.1 of the mean eigenvalue), its factors and scores written to a temporary folder."""
    import tempfile

    from kronfluence.analyzer import Analyzer, prepare_model
    from kronfluence.arguments import FactorArguments, ScoreArguments
    from kronfluence.task import Task
    from torch.utils.data import TensorDataset

    class Classification(Task):
        def compute_train_loss(self, batch, model, sample=False):
            inputs, labels = batch
            return nn.functional.cross_entropy(model(inputs), labels, reduction="sum")

        def compute_measurement(self, batch, model):
            inputs, labels = batch
            return nn.functional.cross_entropy(model(inputs), labels, reduction="sum")

    prepared = prepare_model(copy.deepcopy(model), Classification())

    def run() -> Tensor:
        with tempfile.TemporaryDirectory() as folder, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            analyzer = Analyzer("bench", prepared, Classification(), cpu=True,
                                output_dir=folder, disable_tqdm=True)
            analyzer.fit_all_factors("factors", dataset=TensorDataset(*train),
                                     per_device_batch_size=250,
                                     factor_args=FactorArguments(strategy="ekfac",
                                                                 use_empirical_fisher=True),
                                     overwrite_output_dir=True)
            analyzer.compute_pairwise_scores(
                "scores", factors_name="factors", query_dataset=TensorDataset(*query),
                train_dataset=TensorDataset(*train), per_device_query_batch_size=100,
                per_device_train_batch_size=250,
                score_args=ScoreArguments(damping_factor=None), overwrite_output_dir=True)
            return analyzer.load_pairwise_scores("scores")["all_modules"]
    return run


# -- the baselines -----------------------------------------------------------------------


def _plain_backward(w: Workload) -> Callable[[], None]:
    params = [p for p in w.model.parameters() if p.requires_grad]

    def plain() -> None:
        torch.autograd.grad(nn.CrossEntropyLoss()(w.call(), w.targets), params)
    return plain


def _classes(w: Workload) -> int:
    with torch.no_grad():
        return w.call(inputs=w.inputs[:1]).shape[1]


def _backwards(w: Workload) -> Callable[[], None]:
    """One forward and ``C`` backward passes of the batch's output, one cotangent column
    each (retaining the graph between them)."""
    params = [p for p in w.model.parameters() if p.requires_grad]

    def run() -> None:
        out = w.call()
        for c in range(out.shape[1]):
            cot = torch.zeros_like(out)
            cot[:, c] = 1
            torch.autograd.grad(out, params, cot, retain_graph=c < out.shape[1] - 1)
    return run


# -- the GGN's diagonal ------------------------------------------------------------------


def _loop_ggn(w: Workload, mc: bool) -> dict[str, Tensor]:
    """Each sample alone: its output's Jacobian by ``C`` backward passes, its loss's
    Hessian at the output (exact: ``diag(J^T H J)``), or the gradient at a drawn label
    (Monte Carlo, the same draws as persample's)."""
    from persample.curvature import hessian_columns, label_sampler

    params = dict(w.model.named_parameters())
    loss_fn = nn.CrossEntropyLoss()
    out_all = w.call().detach()
    if mc:
        cols = label_sampler(loss_fn, torch.Generator().manual_seed(KFAC_SEED))(
            out_all, w.targets).unsqueeze(0)  # (1, n, C)
    else:
        cols = hessian_columns(out_all, w.targets, loss_fn)  # (C, n, C)
    rows = {name: torch.zeros(w.n, *p.shape) for name, p in params.items()}
    for i in range(w.n):
        out = w.call(inputs=w.inputs[i:i + 1])[0]
        for c in range(len(cols)):
            grads = torch.autograd.grad(out, list(params.values()), cols[c, i],
                                        retain_graph=c < len(cols) - 1)
            for (name, _), g in zip(params.items(), grads):
                rows[name][i] += g.square()
    return rows


def _batch_diag_ggn(w: Workload) -> Callable[[], dict[str, Tensor]]:
    """BackPACK ``BatchDiagGGNExact`` of the summed loss (each sample's own term)."""
    from backpack import backpack as context
    from backpack import extend
    from backpack.extensions import BatchDiagGGNExact

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = extend(copy.deepcopy(w.model))
    loss_fn = extend(nn.CrossEntropyLoss(reduction="sum"))

    def run() -> dict[str, Tensor]:
        model.zero_grad(set_to_none=True)
        with context(BatchDiagGGNExact()), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loss_fn(model(w.inputs), w.targets).backward()
        out = {name: p.diag_ggn_exact_batch for name, p in model.named_parameters()}
        for p in model.parameters():  # the result holds them; the model need not
            p.diag_ggn_exact_batch = None
        return out
    return run


# -- K-FAC ---------------------------------------------------------------------------------


def _factor_size(m: nn.Module) -> int:
    d_in = m.weight[0].numel()
    return d_in * d_in + m.weight.shape[0] ** 2


def _flat(tensors: list[Tensor]) -> Tensor:
    return torch.cat([t.reshape(-1) for t in tensors]).unsqueeze(0)


def _watch(modules: dict[str, nn.Module]) -> tuple[dict, dict, list]:
    """Forward hooks keeping each module's input and, when the backward reaches it, the
    gradient at its output: ``(inputs, grads, handles)`` by module name (remove the
    handles after the forward)."""
    inputs: dict[str, Tensor] = {}
    grads: dict[str, Tensor] = {}

    def hook(name: str):
        def keep(module, args, output):
            inputs[name] = args[0].detach()
            output.register_hook(lambda g: grads.__setitem__(name, g.detach()))
        return keep

    return inputs, grads, [m.register_forward_hook(hook(n)) for n, m in modules.items()]


def _kfac_by_hand(w: Workload, layers: list[tuple[str, nn.Module]]) -> Tensor:
    """The factors from module hooks: each layer's inputs (a convolution's unfolded
    patches) and the gradients at its outputs for labels drawn as persample draws them."""
    from persample.curvature import label_sampler

    inputs, grads, handles = _watch(dict(layers))
    try:
        out = w.call()
    finally:
        for h in handles:
            h.remove()
    cot = label_sampler(nn.CrossEntropyLoss(), torch.Generator().manual_seed(KFAC_SEED))(
        out.detach(), w.targets)
    torch.autograd.grad(out, [m.weight for _, m in layers], cot)
    factors = []
    for name, m in layers:
        a, g = inputs[name], grads[name]
        if isinstance(m, nn.Conv2d):
            a = nn.functional.unfold(a, m.kernel_size, m.dilation, m.padding, m.stride
                                     ).transpose(1, 2)  # (n, t, c*k)
            g = g.flatten(2).transpose(1, 2)  # (n, t, o)
        a, g = a.reshape(-1, a.shape[-1]), g.reshape(-1, g.shape[-1])
        factors += [a.T @ a / len(a), g.T @ g / w.n]
    return _flat(factors)


def _curvlinops_kfac(w: Workload, layers: list[tuple[str, nn.Module]]) -> Callable[[], Tensor]:
    """curvlinops' ``KFACLinearOperator`` (MC Fisher, the same seed as persample's)."""
    from curvlinops import KFACLinearOperator

    params = [m.weight for _, m in layers]

    def run() -> Tensor:
        op = KFACLinearOperator(w.model, nn.CrossEntropyLoss(), params, [(w.inputs, w.targets)],
                                fisher_type="mc", mc_samples=1, seed=KFAC_SEED,
                                check_deterministic=False)
        op.compute_kronecker_factors()
        return _flat([t for name, _ in layers for t in (op._input_covariances[name],
                                                         op._gradient_covariances[name])])
    return run

