"""The methods ``persample bench`` compares, per workload, as :class:`Case` objects.

Each method is a function ``(buf) -> result`` that does what its users write and
returns what they get: a dict ``{name: (B, *param.shape)}`` for the loop,
``torch.func``, Opacus, BackPACK and persample's default call; a tensor for
persample's ``flat=True`` and ``out=`` calls and for input Jacobians. ``buf`` is a
caller-owned, already touched, contiguous tensor of the result's flat shape
(made with ``torch.zeros``) that only persample's ``out=`` row writes into. The
benchmark flattens each result to compare it with the reference, outside the
timed call (:func:`as_flat`). A method that cannot run here has ``fn=None`` and a
note saying why (not installed, not applicable, failed to build).
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, jacfwd, jacrev, vmap
from torch.utils._pytree import tree_leaves, tree_map

from ..api import param_jacobian, per_sample_grads
from ..reference import loop_param_jacobian, loop_per_sample_grads
from .workloads import DP_MAX_GRAD_NORM, PROJECTED_DIM, Workload

MEMORY_LIMIT_BYTES = 8e9  # a method estimated to need more is skipped with a note (CPU)
GPU_MEMORY_SHARE = 0.8  # on a GPU, the limit is this share of its memory


@dataclass
class Method:
    """One row of the table.

    Attributes:
        name: the row's label.
        fn: ``fn(buf) -> result`` (see the module docstring), or ``None`` if the
            method cannot run here.
        note: why ``fn`` is ``None``, or a remark printed under the table.
        ours: persample's default call, the row the speed-up line is about.
    """

    name: str
    fn: Callable[[Tensor], Any] | None
    note: str = ""
    ours: bool = False


@dataclass
class Case:
    """A workload with its baseline, its reference and the methods to compare.

    Attributes:
        workload: the :class:`~persample.cli.workloads.Workload`.
        base_label: what ``t_plain`` measures (``"plain backward"``, ``"one backward"``,
            ``"plain SGD step"``).
        base: runs it once.
        result_shape: the flat shape every result is compared in: ``(B, P)``,
            ``(B, Y, P)``, ``(B, Y, D)``, ``(B,)`` or ``(P,)``.
        reference_label: the method whose first result is the reference.
        reference: computes the reference result (any form :func:`as_flat` takes).
        methods: the rows.
        after_check: run once every result is checked (the DP step turns noise on).
        floor_label, floor: where one operation every method must do dominates (the
            input Jacobian's last matrix product), it is timed as the floor.
        diagnostics: ``(label, fn)`` timed in the same rounds and shown for information
            (the plain forward and the forward under persample's capture).
    """

    workload: Workload
    base_label: str
    base: Callable[[], object]
    result_shape: tuple[int, ...]
    reference_label: str
    reference: Callable[[], Any]
    methods: list[Method] = field(default_factory=list)
    after_check: Callable[[], None] = lambda: None
    floor_label: str | None = None
    floor: Callable[[], object] | None = None
    diagnostics: list[tuple[str, Callable[[], object]]] = field(default_factory=list)


def under_autocast(case: Case) -> Case:
    """The case with its baseline, floor, reference, diagnostics and every method run
    under ``torch.autocast`` with the workload's ``autocast`` dtype (as they are without
    one); returns ``case``, changed in place.

    Example:
        >>> from persample.cli.workloads import dp_workload
        >>> w = dp_workload("deep-mlp-dp-step", 2)
        >>> w.autocast = torch.bfloat16
        >>> case = under_autocast(dp_step_case(w))
        >>> case.base() is None
        True
    """
    dtype = case.workload.autocast
    if dtype is None:
        return case
    device = case.workload.device.type

    def wrap(fn):
        if fn is None:
            return None

        def run(*args):
            with torch.autocast(device, dtype=dtype):
                return fn(*args)
        return run

    case.base, case.reference, case.floor = wrap(case.base), wrap(case.reference), wrap(
        case.floor)
    case.diagnostics = [(label, wrap(fn)) for label, fn in case.diagnostics]
    case.methods = [replace(m, fn=wrap(m.fn)) for m in case.methods]
    return case


def as_flat(result: Any, shape: tuple[int, ...]) -> Tensor:
    """A method's result in the case's flat shape, for comparing (never timed).

    Args:
        result: a tensor of ``prod(shape)`` numbers, or a dict of tensors whose leading
            dims are ``shape[:-1]``, concatenated along the last dim in the dict's order.
        shape: the case's ``result_shape``.

    Returns:
        A tensor of ``shape`` (a view where the layout allows, else a copy).

    Raises:
        ValueError: a dict entry whose leading dims are not ``shape[:-1]`` (e.g. a
            per-sample gradient with a batch dim of 1), naming it.
        RuntimeError: the numbers do not fit ``shape``.

    Example:
        >>> g = {"w": torch.ones(2, 3, 4), "b": torch.zeros(2, 3)}
        >>> as_flat(g, (2, 15)).shape
        torch.Size([2, 15])
    """
    if isinstance(result, Mapping):
        lead = tuple(shape[:-1])
        for name, t in result.items():
            if tuple(t.shape[: len(lead)]) != lead:
                want = ", ".join(map(str, lead))
                raise ValueError(f"per-sample result {name!r} has shape {tuple(t.shape)}, "
                                 f"not ({want}, ...)")
        result = torch.cat([t.reshape(*lead, -1) for t in result.values()], dim=-1)
    return result.reshape(shape)


def num_params(model: nn.Module) -> int:
    """The number of trainable parameters' entries ``P``.

    Example:
        >>> num_params(nn.Linear(3, 2))
        8
    """
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def scalar_loss(loss: Tensor) -> Tensor:
    """The loss a plain training step calls ``backward()`` on: a scalar as it is, the
    mean of per-sample ``(B,)`` losses.

    Example:
        >>> scalar_loss(torch.tensor([1.0, 3.0]))
        tensor(2.)
    """
    return loss.mean() if loss.ndim else loss


def _note_failure(name: str, err: Exception) -> Method:
    return Method(name, None, f"failed: {type(err).__name__}: {err}"[:200])


# --- how much memory a per-sample method needs, before it runs ----------------------------


def memory_limit(device: torch.device) -> float:
    """The most bytes a method may be estimated to need: :data:`MEMORY_LIMIT_BYTES` on the
    CPU, :data:`GPU_MEMORY_SHARE` of the GPU's memory on a GPU.

    Example:
        >>> memory_limit(torch.device("cpu")) == MEMORY_LIMIT_BYTES
        True
    """
    if device.type == "cuda":
        return GPU_MEMORY_SHARE * torch.cuda.get_device_properties(device).total_memory
    return MEMORY_LIMIT_BYTES


def saved_bytes_per_sample(w: Workload) -> int:
    """The bytes autograd keeps for the backward of the first sample's loss: one forward
    of a batch of one under ``saved_tensors_hooks``, each distinct storage counted once,
    the parameters' own not counted. Outside the timed calls.

    Example:
        >>> from persample.cli.workloads import grads_workload
        >>> saved_bytes_per_sample(grads_workload("deep-mlp-grads", 2)) > 0
        True
    """
    from ..inputs import samples_of

    own = {p.untyped_storage().data_ptr() for p in w.model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: Tensor) -> Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in own:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        w.loss_fn(w.call(inputs=samples_of(w.inputs, 0, 1)), samples_of(w.targets, 0, 1))
    return sum(seen.values())


@dataclass
class MemoryEstimate:
    """What a per-sample gradients method needs besides the model, in bytes, from the
    result's size ``R = B * P * itemsize``, one sample's saved activations ``A``
    (:func:`saved_bytes_per_sample`) and the largest parameter's per-sample gradients
    ``G = B * itemsize * max numel``; compared with :func:`memory_limit` before a method
    is built. Rough (within a factor of about two), but it tells 3 GB from 30 GB.

    Example:
        >>> e = MemoryEstimate(result=4e9, per_sample=1e8, largest=2e9, n=8, limit=8e9)
        >>> e.skip("loop") is None, e.skip("torch.func vmap")
        (True, 'skipped: would need about 10 GB (over the 8 GB limit)')
    """

    result: float  # R: the per-sample gradients, B * P * itemsize
    per_sample: float  # A: one sample's saved activations
    largest: float  # G: the largest parameter's per-sample gradients
    n: int  # B
    limit: float

    def need(self, method: str) -> float:
        """The loop keeps the result and one sample's graph and gradients; ``torch.func``
        the result, the batch's activations and their gradients under ``vmap``, and the
        largest parameter's per-sample gradient twice (a tied weight's two uses);
        Opacus's and BackPACK's hooks the result, the batch's activations and the
        largest layer's per-sample product."""
        r, a, g, n = self.result, self.per_sample, self.largest, self.n
        if method.startswith("loop"):
            return r + a + r / n
        if method.startswith("torch.func"):
            return r + 2 * n * a + 2 * g
        return r + n * a + g  # Opacus hooks, BackPACK

    def skip(self, method: str) -> str | None:
        """``"skipped: ..."`` where ``method`` would need over the limit, else ``None``."""
        need = self.need(method)
        if need <= self.limit:
            return None
        return (f"skipped: would need about {need / 1e9:,.0f} GB (over the "
                f"{self.limit / 1e9:,.0f} GB limit)")


def memory_estimate(w: Workload) -> MemoryEstimate:
    """The :class:`MemoryEstimate` of a per-sample gradients workload on its device.

    Example:
        >>> from persample.cli.workloads import grads_workload
        >>> e = memory_estimate(grads_workload("cnn-grads", 2))
        >>> e.result == 2 * 1199882 * 4, e.skip("torch.func vmap")
        (True, None)
    """
    trainable = [p for p in w.model.parameters() if p.requires_grad]
    size = trainable[0].element_size()
    return MemoryEstimate(w.n * num_params(w.model) * size, saved_bytes_per_sample(w),
                          w.n * size * max(p.numel() for p in trainable), w.n,
                          memory_limit(w.device))


def _reference_fits(w: Workload) -> MemoryEstimate:
    """The workload's :class:`MemoryEstimate`, once the loop (the reference every row is
    checked against) is found to fit.

    Raises:
        MemoryError: the loop would need over the limit; the message names the workload.
    """
    estimate = memory_estimate(w)
    why = estimate.skip("loop")
    if why:
        raise MemoryError(f"{w.name}: the loop, the reference, {why.removeprefix('skipped: ')}"
                          "; run it with a smaller --batch")
    return estimate


def _built(name: str, only: str | None, build: Callable[[], Method]) -> Method:
    """``build()``, unless ``only`` names another row: a memory probe builds only the row
    it measures (no other model copies, no other library imported)."""
    if only is None or only == name:
        return build()
    return Method(name, None, f"not built: only {only!r} was asked for")


def _unless_too_big(name: str, estimate: MemoryEstimate | None,
                    build: Callable[[], Method]) -> Method:
    """``build()``, unless ``estimate`` says ``name`` would need over the limit."""
    why = estimate.skip(name) if estimate is not None else None
    return Method(name, None, why) if why else build()


# --- per-sample gradients (cnn-grads, deep-mlp-grads, resnet18-grads, gpt2-grads, ...) ------


def grads_case(w: Workload, only: str | None = None) -> Case:
    """The per-sample gradients rows: loop (the reference), ``torch.func``, Opacus, BackPACK,
    persample's default call (a dict), ``flat=True`` and ``out=`` (where the workload
    has ``layout_rows``). Result ``(B, P)``,
    ``P`` the trainable parameters' entries; the baseline is a plain backward of the
    mean loss. A competitor whose :class:`MemoryEstimate` is over
    :func:`memory_limit` is skipped with a note. ``only``: build that row only (and
    estimate nothing), for a memory probe of a row that ran.

    Raises:
        MemoryError: the loop, the reference, would need over the limit.

    Example:
        >>> from persample.cli.workloads import grads_workload
        >>> case = grads_case(grads_workload("cnn-grads", 2))
        >>> case.result_shape, [m.name for m in case.methods][-3:]
        ((2, 1199882), ['persample', 'persample (flat=True)', 'persample (out=)'])

    Source: the loop is ``compute_sample_grads`` of torch.func's "Per-sample-gradients"
    tutorial; the rest as each library's
    documentation shows it.
    """
    model = w.model

    def plain() -> None:
        for p in model.parameters():
            p.grad = None
        scalar_loss(w.loss_fn(w.call(), w.targets)).backward()

    def loop(_: Tensor) -> dict[str, Tensor]:
        return loop_per_sample_grads(model, w.inputs, w.targets, w.loss_fn)

    estimate = _reference_fits(w) if only is None else None
    case = Case(w, "plain backward", plain, (w.n, num_params(model)), "loop", lambda: loop(None), [
        Method("loop", loop),
        *(_built(name, only, lambda name=name, build=build: _unless_too_big(
            name, estimate, lambda: build(w))) for name, build in (
                ("torch.func vmap", torch_func), ("Opacus hooks", opacus),
                ("BackPACK BatchGrad", backpack))),
        Method("persample", lambda _: per_sample_grads(model, w.inputs, w.targets, w.loss_fn),
               ours=True),
    ])
    if w.layout_rows:
        case.methods += [
            Method("persample (flat=True)", lambda _: per_sample_grads(
                model, w.inputs, w.targets, w.loss_fn, flat=True)),
            Method("persample (out=)", lambda buf: per_sample_grads(
                model, w.inputs, w.targets, w.loss_fn, out=buf)),
        ]
    case.diagnostics = capture_overhead(w)
    return case


def capture_overhead(w: Workload) -> list[tuple[str, Callable[[], object]]]:
    """The plain forward (autograd on) and the same forward under persample's capture
    (:class:`persample.capture.Capture`: the data-flow rule of every op, the module
    calls): the capture's overhead, timed beside the methods.

    Example:
        >>> from persample.cli.workloads import grads_workload
        >>> [label for label, _ in capture_overhead(grads_workload("cnn-grads", 2))]
        ['plain forward', 'forward under capture']
    """
    from ..batch import located
    from ..inputs import as_batch
    from ..rules import open_capture

    batch = as_batch(w.inputs)
    watched = {id(p): p for p in w.model.parameters() if p.requires_grad}

    def plain() -> object:
        with torch.enable_grad():
            return w.call()

    def captured() -> object:
        with torch.enable_grad(), open_capture(w.model, watched, batch.n, located(batch),
                                               batch.shared):
            return batch.call(w.model)

    return [("plain forward", plain), ("forward under capture", captured)]


def torch_func(w: Workload) -> Method:
    """``vmap(grad(compute_loss))`` with ``functional_call``, as torch.func's tutorial has it.

    Returns ``{name: (B, *param.shape)}`` for the trainable parameters (frozen ones, as
    under LoRA, are passed as constants). Each sample is a batch of one
    (``unsqueeze(0)``). For a dict of inputs with an all-ones ``attention_mask`` (no
    padding), the mask is left out (noted): transformers tests it with data-dependent
    control flow, which ``vmap`` refuses, and without padding the model computes the
    same function without it.

    Example:
        >>> from persample.cli.workloads import grads_workload
        >>> m = torch_func(grads_workload("cnn-grads", 2))
        >>> m.fn(None)["conv1.weight"].shape
        torch.Size([2, 32, 1, 3, 3])

    Source: torch.func's "Per-sample-gradients" tutorial.
    """
    model, loss_fn = w.model, w.loss_fn
    params = {k: v.detach() for k, v in model.named_parameters() if v.requires_grad}
    frozen = {k: v.detach() for k, v in model.named_parameters() if not v.requires_grad}
    inputs, note = w.inputs, ""
    if isinstance(inputs, dict) and "attention_mask" in inputs \
            and bool((inputs["attention_mask"] == 1).all()):
        inputs = {k: v for k, v in inputs.items() if k != "attention_mask"}
        note = ("called without attention_mask (all ones here): transformers tests the mask "
                "with data-dependent control flow, which vmap refuses")

    def compute_loss(params: dict[str, Tensor], x: Any, y: Tensor) -> Tensor:
        batch, weights = tree_map(lambda t: t.unsqueeze(0), x), {**frozen, **params}
        out = (functional_call(model, weights, (), batch) if isinstance(batch, dict)
               else functional_call(model, weights, (batch,)))
        return loss_fn(out, y.unsqueeze(0)).sum()

    per_sample = vmap(grad(compute_loss), in_dims=(None, 0, 0))
    return Method("torch.func vmap", lambda _: per_sample(params, inputs, w.targets), note)


def opacus_ready(model: nn.Module) -> nn.Module:
    """A copy of ``model`` for Opacus: eval mode, except that the modules holding
    trainable parameters are in training mode (Opacus records activations only
    there). Dropout and attention dropout stay off, so the function is the model's.
    BatchNorm would change meaning, but Opacus refuses it anyway.

    Example:
        >>> net = opacus_ready(nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.5)))
        >>> [m.training for m in net]
        [True, False]
    """
    ready = copy.deepcopy(model).eval()
    for m in ready.modules():
        m.training = any(p.requires_grad for p in m.parameters(recurse=False))
    return ready


def opacus(w: Workload) -> Method:
    """Opacus ``GradSampleModule`` (hooks mode): ``{name: p.grad_sample}`` for the
    trainable parameters after one backward of the mean loss
    (``loss_reduction="mean"``, so that the rows are each sample's own gradient), the
    model called with the inputs as Opacus's users pass them
    (:meth:`~persample.cli.workloads.Workload.opacus_call`: per-sample position ids).
    A model Opacus refuses gives ``fn=None`` with ``"failed: ..."``; Opacus missing,
    ``"not installed ..."``.

    Example:
        >>> from persample.cli.workloads import grads_workload
        >>> opacus(grads_workload("cnn-grads", 2)).name
        'Opacus hooks'

    Source: Opacus's ``GradSampleModule`` documentation.
    """
    name = "Opacus hooks"
    try:
        from opacus import GradSampleModule
    except ImportError:
        return Method(name, None, "not installed (pip install -e '.[bench]')")
    try:
        model = GradSampleModule(opacus_ready(w.model), loss_reduction="mean")
    except Exception as err:  # e.g. a layer Opacus does not support
        return _note_failure(name, err)

    def run(_: Tensor) -> dict[str, Tensor]:
        model.zero_grad(set_to_none=True)
        scalar_loss(w.loss_fn(w.opacus_call(model), w.targets)).backward()
        return {k: p.grad_sample for k, p in model._module.named_parameters()
                if p.requires_grad}

    return Method(name, run)


def backpack(w: Workload) -> Method:
    """BackPACK ``BatchGrad``: ``{name: p.grad_batch * B}`` (it gives the mean loss's terms).

    Needs BackPACK's own ``nn.CrossEntropyLoss`` on ``(B, C)`` logits; a model that
    is not an ``nn.Sequential`` goes through ``extend(model, use_converter=True)``
    (torch.fx), as BackPACK's docs say for ResNets. Not applicable to other losses or
    to dict inputs (``fn=None`` with a note).

    Example:
        >>> from persample.cli.workloads import grads_workload
        >>> backpack(grads_workload("cnn-grads", 2)).name
        'BackPACK BatchGrad'

    Source: BackPACK's ``BatchGrad`` documentation (``extend``, ``use_converter``).
    """
    name = "BackPACK BatchGrad"
    try:
        from backpack import backpack as context
        from backpack import extend
        from backpack.extensions import BatchGrad
    except ImportError:
        return Method(name, None, "not installed (pip install --no-deps backpack-for-pytorch)")
    if not isinstance(w.loss_fn, nn.CrossEntropyLoss) or isinstance(w.inputs, dict):
        return Method(name, None, "not applicable: BackPACK needs its own loss module on "
                      "(B, C) outputs")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = extend(copy.deepcopy(w.model),
                           use_converter=not isinstance(w.model, nn.Sequential))
    except Exception as err:
        return _note_failure(name, err)
    loss_fn = extend(nn.CrossEntropyLoss())
    n = w.n

    def run(_: Tensor) -> dict[str, Tensor]:
        model.zero_grad(set_to_none=True)
        with context(BatchGrad()), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # full backward hooks on modules without input grads
            loss_fn(model(w.inputs), w.targets).backward()
        return {k: p.grad_batch * n for k, p in model.named_parameters()}

    return Method(name, run)


# --- per-sample parameter Jacobian (mlp-param-jac) ----------------------------------------


def param_jacobian_case(w: Workload) -> Case:
    """The question's loop (the reference), ``vmap(jacrev)``, ``vmap(jacfwd)`` (dicts), and
    persample's ``param_jacobian`` default (a dict), ``flat=True`` and ``out=``.
    Result ``(B, Y, P)``; the baseline is one backward of ``model(x).sum()``.
    ``vmap(jacfwd)`` is skipped when it would need over ``MEMORY_LIMIT_BYTES``.

    Example:
        >>> from persample.cli.workloads import jacobian_workload
        >>> param_jacobian_case(jacobian_workload("mlp-param-jac", 2)).result_shape
        (2, 10, 15910)

    Source: the question "How to efficiently calculate gradients of all outputs with
    respect to parameters?" (its ``calculate_gradients`` and the ``vmap(jacrev)`` answer).
    """
    model, x = w.model, w.inputs
    n, y, p = x.shape[0], model(x[:1]).shape[1:].numel(), num_params(model)
    params = {k: v.detach() for k, v in model.named_parameters()}

    def one_backward() -> None:
        for q in model.parameters():
            q.grad = None
        model(x).sum().backward()

    def question_loop(_: Tensor) -> dict[str, Tensor]:  # the question's calculate_gradients
        return loop_param_jacobian(model, x)

    def sample_output(th: dict[str, Tensor], xi: Tensor) -> Tensor:
        return functional_call(model, th, (xi.unsqueeze(0),))[0]

    def transform(jac_fn) -> Callable[[Tensor], dict[str, Tensor]]:
        per_sample = vmap(jac_fn(sample_output), in_dims=(None, 0))
        return lambda _: per_sample(params, x)  # the accepted answer

    # jacfwd pushes P one-hot tangents; under vmap over the batch its largest
    # intermediate is about (B, P, largest parameter) numbers.
    need = n * p * max(q.numel() for q in params.values()) * x.element_size()
    fwd = (Method("vmap(jacfwd)", transform(jacfwd)) if need <= MEMORY_LIMIT_BYTES else
           Method("vmap(jacfwd)", None, f"skipped: would need about {need / 1e9:,.0f} GB"))
    return Case(w, "one backward", one_backward, (n, y, p), "calculate_gradients loop",
                lambda: question_loop(None), [
        Method("calculate_gradients loop", question_loop),
        Method("vmap(jacrev)", transform(jacrev)),
        fwd,
        Method("persample", lambda _: param_jacobian(model, x), ours=True),
        Method("persample (flat=True)", lambda _: param_jacobian(model, x, flat=True)),
        Method("persample (out=)", lambda buf: param_jacobian(model, x, out=buf)),
    ])


# --- batched input Jacobian (pinn-input-jac, clf-input-jac) --------------------------------


def input_jacobian_case(w: Workload) -> Case:
    """The question's own code (the reference), ``vmap(jacrev)``, ``vmap(jacfwd)`` and
    persample's ``input_jacobian``; all return ``(B, Y, D)`` tensors. For the classifier
    the floor is the one ``(B*Y, H) x (H, D)`` product every method needs
    (``H`` the first layer's width), into touched memory.

    Example:
        >>> from persample.cli.workloads import jacobian_workload
        >>> input_jacobian_case(jacobian_workload("clf-input-jac", 2)).floor_label
        '(20, 256) x (256, 784) product'

    Source: the Stack Overflow questions on only the diagonals of a batched Jacobian and
    "How to compute derivative of matrix output with respect to matrix input most
    efficiently?" (their own code is the reference).
    """
    from ..jacobian import input_jacobian

    model, x = w.model, w.inputs
    n, d, y = x.shape[0], x.shape[1], model(x[:1]).shape[1]

    def one_backward() -> None:
        xg = x.detach().requires_grad_()
        torch.autograd.grad(model(xg).sum(), xg)

    def sample_fn(xi: Tensor) -> Tensor:
        return model(xi.unsqueeze(0))[0]

    def full_jacobian(_: Tensor) -> Tensor:  # the full (B, Y, B, D) one, then its diagonal blocks
        full = torch.autograd.functional.jacobian(model, x)  # (B, Y, B, D)
        return torch.diagonal(full, dim1=0, dim2=2).permute(2, 0, 1)

    def class_loop(_: Tensor) -> Tensor:  # a loop over the classes
        xg = x.detach().requires_grad_()
        out = model(xg)
        ones = torch.ones(n, dtype=out.dtype, device=out.device)
        rows = [torch.autograd.grad(out[:, k], xg, ones, retain_graph=True)[0]
                for k in range(y)]
        return torch.stack(rows, dim=1)

    classifier = w.name == "clf-input-jac"
    own_fn = class_loop if classifier else full_jacobian
    own_label = "loop over classes" if classifier else "autograd.functional.jacobian"
    case = Case(w, "one backward", one_backward, (n, y, d), own_label, lambda: own_fn(None), [
        Method(own_label, own_fn),
        Method("vmap(jacrev)", lambda _: vmap(jacrev(sample_fn))(x)),
        Method("vmap(jacfwd)", lambda _: vmap(jacfwd(sample_fn))(x)),
        Method("persample", lambda _: input_jacobian(model, x), ours=True),
    ])
    first = next((m for m in model.modules() if isinstance(m, nn.Linear)), None)
    if classifier and first is not None:
        h = first.out_features
        g = torch.Generator(device=x.device).manual_seed(0)
        cotangents = torch.randn(n * y, h, generator=g, device=x.device, dtype=x.dtype)
        product = torch.zeros(n * y, d, device=x.device, dtype=x.dtype)
        weight = first.weight.detach()
        case.floor_label = f"({n * y}, {h}) x ({h}, {d}) product"
        case.floor = lambda: torch.mm(cotangents, weight, out=product)
    return case


# --- per-sample gradient norms and one DP-SGD step ----------------------------------------


def grad_norms(grads: Mapping[str, Tensor]) -> Tensor:
    """``(B,)`` norms over all parameters of per-sample gradients ``{name: (B, ...)}``,
    summed per parameter (no concatenation).

    Example:
        >>> grad_norms({"a": torch.full((2, 3), 2.0), "b": torch.full((2,), 2.0)})
        tensor([4., 4.])
    """
    return sum(g.reshape(len(g), -1).pow(2).sum(1) for g in grads.values()).sqrt()


def norms_case(w: Workload) -> Case:
    """Per-sample gradient norms ``(B,)``: each gradients method followed by
    :func:`grad_norms`, Opacus ghost clipping's norms, BackPACK ``BatchL2Grad`` and
    persample's ``per_sample_grad_norms``.

    Example:
        >>> from persample.cli.workloads import dp_workload
        >>> norms_case(dp_workload("cnn-norms", 2)).result_shape
        (2,)
    """
    from ..norms import per_sample_grad_norms

    grads = grads_case(w)  # the plain backward and the per-sample gradient methods
    by_name = {m.name: m for m in grads.methods}

    def norm_of(method: Method) -> Method:
        if method.fn is None:
            return method
        return Method(method.name, lambda buf: grad_norms(method.fn(None)), method.note)

    return Case(w, "plain backward", grads.base, (w.n,), "loop",
                lambda: grad_norms(by_name["loop"].fn(None)), [
        norm_of(by_name["loop"]),
        norm_of(by_name["torch.func vmap"]),
        norm_of(by_name["Opacus hooks"]),
        _optional(lambda: _opacus_ghost_step(w), "Opacus ghost clipping", "opacus", w,
                  lambda step: step(None, norms=True)),
        _optional(lambda: _backpack_l2(w), "BackPACK BatchL2Grad", "backpack", w,
                  lambda step: step()),
        Method("persample", lambda _: per_sample_grad_norms(
            w.model, w.inputs, w.targets, w.loss_fn), ours=True),
    ])


def gram_case(w: Workload, only: str | None = None) -> Case:
    """The ``(B, B)`` Gram matrix of per-sample gradients (TracIn's inner products):
    each gradients method followed by ``G @ G.T``, and persample's
    ``per_sample_grad_dots``, which forms no gradient where a rule has factors.
    ``only``: build that row's gradients method only, for a memory probe.

    Example:
        >>> from persample.cli.workloads import attribution_workload
        >>> gram_case(attribution_workload("deep-mlp-gram", 2)).result_shape
        (2, 2)
    """
    from ..dots import per_sample_grad_dots

    grads = grads_case(w, _gradients_row(only))
    by_name = {m.name: m for m in grads.methods}

    def gram_of(method: Method, name: str | None = None) -> Method:
        if method.fn is None:
            return method
        return Method(name or method.name, lambda buf: grad_gram(method.fn(None)),
                      method.note)

    return Case(w, "plain backward", grads.base, (w.n, w.n), "loop",
                lambda: grad_gram(by_name["loop"].fn(None)), floor_label=BACKPROPS_FLOOR,
                floor=backprops(w), methods=[
        gram_of(by_name["loop"]),
        gram_of(by_name["torch.func vmap"]),
        gram_of(by_name["Opacus hooks"]),
        gram_of(by_name["persample"], "persample per_sample_grads, then G G^T"),
        Method("persample", lambda _: per_sample_grad_dots(
            w.model, w.inputs, w.targets, w.loss_fn), ours=True),
    ])


def project_case(w: Workload, dim: int = PROJECTED_DIM, only: str | None = None) -> Case:
    """Per-sample gradients projected to ``dim`` numbers (``(B, dim)``, LoGra's Kronecker
    map of :class:`persample.GradientProjector`): each gradients method followed by
    ``proj.project``, and the projector itself, which forms no gradient where an op
    has factors. ``only``: build that row's gradients method only, for a memory probe.

    Example:
        >>> from persample.cli.workloads import attribution_workload
        >>> project_case(attribution_workload("deep-mlp-project", 2), 64).result_shape
        (2, 64)
    """
    from ..projection import GradientProjector

    grads = grads_case(w, _gradients_row(only))
    by_name = {m.name: m for m in grads.methods}
    proj = GradientProjector(w.model, dim, seed=0)

    def projected(method: Method, name: str | None = None) -> Method:
        if method.fn is None:
            return method
        return Method(name or method.name, lambda buf: proj.project(method.fn(None)),
                      method.note)

    return Case(w, "plain backward", grads.base, (w.n, proj.dim), "loop",
                lambda: proj.project(by_name["loop"].fn(None)), floor_label=BACKPROPS_FLOOR,
                floor=backprops(w), methods=[
        projected(by_name["loop"]),
        projected(by_name["torch.func vmap"]),
        projected(by_name["Opacus hooks"]),
        projected(by_name["persample"], "persample per_sample_grads, then project"),
        Method("persample", lambda _: proj(w.inputs, w.targets, w.loss_fn), ours=True),
    ])


BACKPROPS_FLOOR = "forward + backprops"


def backprops(w: Workload) -> Callable[[], object]:
    """The forward and the backprops every per-sample method needs, and nothing else: the
    loss's gradient with respect to the output of every module that holds a trained
    parameter (``torch.autograd.grad`` with those outputs as ``inputs``, so no parameter's
    gradient is formed). What a method that never forms the gradients (the Gram, the
    projections from factors) costs at least.

    Example:
        >>> from persample.cli.workloads import grads_workload
        >>> backprops(grads_workload("deep-mlp-grads", 2))() is None
        True
    """
    owners = [m for m in w.model.modules()
              if any(p.requires_grad for p in m.parameters(recurse=False))]

    def run() -> None:
        outputs: list[Tensor] = []
        keep = lambda module, args, out: outputs.extend(  # noqa: E731
            t for t in tree_leaves(out) if isinstance(t, Tensor) and t.requires_grad)
        handles = [m.register_forward_hook(keep) for m in owners]
        try:
            loss = scalar_loss(w.loss_fn(w.call(), w.targets))
        finally:
            for h in handles:
                h.remove()
        torch.autograd.grad(loss, outputs, allow_unused=True)
    return run


def _gradients_row(only: str | None) -> str | None:
    """The per-sample gradients row an attribution row (``only``, for a memory probe)
    is built on: the same name, or persample's for its own rows."""
    return "persample" if only is not None and only.startswith("persample") else only


def grad_gram(grads: Mapping[str, Tensor]) -> Tensor:
    """``(B, B)`` inner products of per-sample gradients ``{name: (B, ...)}``, summed
    per parameter (no concatenation).

    Example:
        >>> grad_gram({"a": torch.ones(2, 3), "b": torch.ones(2)})
        tensor([[4., 4.],
                [4., 4.]])
    """
    return sum(g.reshape(len(g), -1) @ g.reshape(len(g), -1).T for g in grads.values())


def _optional(build: Callable[[], Any], name: str, module: str, w: Workload,
              call: Callable[[Any], Tensor]) -> Method:
    """A method built once by ``build()`` (outside the timed calls), run as ``call(built)``."""
    try:
        __import__(module)
    except ImportError:
        return Method(name, None, "not installed")
    if not isinstance(w.loss_fn, nn.CrossEntropyLoss) or isinstance(w.inputs, dict):
        return Method(name, None, "not applicable: it takes an nn.CrossEntropyLoss")
    try:
        built = build()
    except Exception as err:
        return _note_failure(name, err)
    return Method(name, lambda _: call(built))


def _backpack_l2(w: Workload):
    from backpack import backpack as context
    from backpack import extend
    from backpack.extensions import BatchL2Grad

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = extend(copy.deepcopy(w.model),
                       use_converter=not isinstance(w.model, nn.Sequential))
    loss_fn, n = extend(nn.CrossEntropyLoss()), w.n

    def run() -> Tensor:
        model.zero_grad(set_to_none=True)
        with context(BatchL2Grad()), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loss_fn(model(w.inputs), w.targets).backward()
        return sum(p.batch_l2 for p in model.parameters()).sqrt() * n  # of the mean's terms

    return run


def dp_step_case(w: Workload, only: str | None = None) -> Case:
    """One DP-SGD step (clip to ``C``, sum, add noise, divide by ``B``, SGD step) on any
    gradients workload. Every row returns the noised gradients ``{name: p.grad}``
    (result ``(P,)``): the loop or ``torch.func`` followed by clipping as users write
    it (per parameter, no concatenation), Opacus ``DPOptimizer`` with hooks or ghost
    clipping, and persample's ``dp.private_grad``. The baseline is a plain SGD step.
    Noise is off while the results are checked, then ``sigma = 1``; ``lr = 0``, so
    that the weights stay as they are. Opacus is called with the inputs as its users
    pass them (:meth:`~persample.cli.workloads.Workload.opacus_call`), its ghost
    clipping given the loss as an ``nn.CrossEntropyLoss`` of the logits where the
    workload says how (``opacus_ce``). The loop, ``torch.func`` and Opacus hooks are
    subject to :class:`MemoryEstimate` as in :func:`grads_case`; ``only`` as there.

    Raises:
        MemoryError: the loop, the reference, would need over :func:`memory_limit`.

    Example:
        >>> from persample.cli.workloads import dp_workload
        >>> case = dp_step_case(dp_workload("cnn-dp-step", 2))
        >>> case.base_label, case.result_shape
        ('plain SGD step', (1199882,))

    Source: Abadi et al. 2016 (DP-SGD); Opacus's ``DPOptimizer`` for its rows.
    """
    from ..dp import private_grad

    n, model = w.n, w.model
    noise = {"sigma": 0.0}  # 0 while results are checked, then 1.0 for the timed rounds
    plain_model = copy.deepcopy(model) if only in (None, "plain SGD step") else model
    plain_opt = torch.optim.SGD(plain_model.parameters(), lr=0.0)

    def plain_step() -> None:
        plain_opt.zero_grad(set_to_none=True)
        scalar_loss(w.loss_fn(w.call(plain_model), w.targets)).backward()
        plain_opt.step()

    def manual(per_sample_fn: Callable[[Tensor | None], dict[str, Tensor]]
               ) -> Callable[[Tensor], dict[str, Tensor]]:
        own = copy.deepcopy(model)
        params = dict(own.named_parameters())
        opt = torch.optim.SGD(own.parameters(), lr=0.0)

        def run(_: Tensor) -> dict[str, Tensor]:
            opt.zero_grad(set_to_none=True)  # as the plain step does
            grads = per_sample_fn(None)
            with torch.autocast(w.device.type, enabled=False):  # clipped in the grads' dtype
                clip = (DP_MAX_GRAD_NORM / (grad_norms(grads) + 1e-6)).clamp(max=1.0)  # (B,)
                for name, g in grads.items():
                    total = torch.tensordot(clip.to(g.dtype), g, dims=1)
                    total += torch.randn_like(total) * (noise["sigma"] * DP_MAX_GRAD_NORM)
                    params[name].grad = total.div_(n)
            opt.step()
            return {k: p.grad for k, p in params.items() if p.requires_grad}

        return run

    def persample_method() -> Method:
        own = copy.deepcopy(model)
        own_opt = torch.optim.SGD(own.parameters(), lr=0.0)

        def persample_step(_: Tensor) -> dict[str, Tensor]:
            own_opt.zero_grad(set_to_none=True)  # as the plain step does
            private_grad(own, w.inputs, w.targets, w.loss_fn, max_grad_norm=DP_MAX_GRAD_NORM,
                         noise_multiplier=noise["sigma"])
            own_opt.step()
            return {k: p.grad for k, p in own.named_parameters() if p.requires_grad}

        return Method("persample", persample_step, ours=True)

    def loop(_: Tensor | None) -> dict[str, Tensor]:
        return loop_per_sample_grads(model, w.inputs, w.targets, w.loss_fn)

    def func_method() -> Method:
        func = _unless_too_big("torch.func vmap", estimate, lambda: torch_func(w))
        return Method("torch.func vmap + clipping", manual(func.fn) if func.fn else None,
                      func.note)

    estimate = _reference_fits(w) if only is None else None
    case = Case(w, "plain SGD step", plain_step, (num_params(model),), "loop + clipping",
                lambda: manual(loop)(None), [
        _built("loop + clipping", only, lambda: Method("loop + clipping", manual(loop))),
        _built("torch.func vmap + clipping", only, func_method),
        _built("Opacus hooks", only, lambda: _unless_too_big(
            "Opacus hooks", estimate, lambda: _opacus_dp_method(w, noise, ghost=False))),
        _built("Opacus ghost clipping", only, lambda: _opacus_dp_method(w, noise, ghost=True)),
        _built("persample", only, persample_method),
    ])
    case.after_check = lambda: noise.update(sigma=1.0)
    # every DP-SGD step also draws P Gaussian numbers: the floor is the plain step and that
    first = next(model.parameters())
    draws = torch.empty(num_params(model), dtype=first.dtype, device=first.device)
    case.floor_label = f"plain SGD step + {draws.numel():,} normal draws"
    case.floor = lambda: (plain_step(), draws.normal_())
    return case


def _opacus_dp_method(w: Workload, noise: dict, ghost: bool) -> Method:
    name = "Opacus ghost clipping" if ghost else "Opacus hooks"
    try:
        import opacus  # noqa: F401
    except ImportError:
        return Method(name, None, "not installed (pip install -e '.[bench]')")
    if ghost and not isinstance(w.loss_fn, nn.CrossEntropyLoss) and w.opacus_ce is None:
        return Method(name, None, "not applicable: it takes an nn.CrossEntropyLoss")
    try:
        step = _opacus_ghost_step(w, noise) if ghost else _opacus_hooks_step(w, noise)
    except Exception as err:  # e.g. a layer Opacus does not support
        return _note_failure(name, err)
    return Method(name, lambda _: step(None))


def _opacus_hooks_step(w: Workload, noise: dict):
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer

    model = GradSampleModule(opacus_ready(w.model))
    state = {}

    def run(_: Tensor | None) -> dict[str, Tensor]:
        if state.get("sigma") != noise["sigma"]:  # Opacus fixes sigma at construction
            state["opt"] = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                       noise_multiplier=noise["sigma"],
                                       max_grad_norm=DP_MAX_GRAD_NORM,
                                       expected_batch_size=w.n)
            state["sigma"] = noise["sigma"]
        opt = state["opt"]
        opt.zero_grad(set_to_none=True)
        scalar_loss(w.loss_fn(w.opacus_call(model), w.targets)).backward()
        opt.step()
        return {k: p.grad for k, p in model._module.named_parameters() if p.requires_grad}

    return run


def _opacus_ghost_step(w: Workload, noise: dict | None = None):
    from opacus.grad_sample import GradSampleModuleFastGradientClipping
    from opacus.optimizers import DPOptimizerFastGradientClipping
    from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping

    noise = noise if noise is not None else {"sigma": 0.0}
    model = GradSampleModuleFastGradientClipping(
        opacus_ready(w.model), max_grad_norm=DP_MAX_GRAD_NORM, use_ghost_clipping=True)
    state = {}

    def run(_: Tensor | None, norms: bool = False) -> Any:
        if state.get("sigma") != noise["sigma"]:
            opt = DPOptimizerFastGradientClipping(
                torch.optim.SGD(model.parameters(), lr=0.0), noise_multiplier=noise["sigma"],
                max_grad_norm=DP_MAX_GRAD_NORM, expected_batch_size=w.n)
            state.update(sigma=noise["sigma"], opt=opt, loss=DPLossFastGradientClipping(
                model, opt, nn.CrossEntropyLoss(), "mean"))
        opt = state["opt"]
        opt.zero_grad(set_to_none=True)
        out = w.opacus_call(model)
        if w.opacus_ce is None:  # the loss is an nn.CrossEntropyLoss of the output
            loss = state["loss"](out, w.targets)
        else:  # logits (N, C), labels (N,), and (B, L) for the per-sample mean
            logits, labels, shape = w.opacus_ce(out, w.targets)
            loss = state["loss"](logits, labels, shape=shape)
        if norms:  # the first of Opacus's two backwards gives the norms
            torch.mean(loss.loss_per_sample).backward()
            return model.get_norm_sample()
        loss.backward()
        opt.step()
        return {k: p.grad for k, p in model._module.named_parameters() if p.requires_grad}

    return run
