"""What a benchmark case is: a workload, its baseline, its reference and its rows.

A row is a :class:`Method`: a function ``(buf) -> result`` that does what its
users write and returns what they get (see :mod:`persample_bench.anchors`), or
``None`` with a note saying why it cannot run here. This module also holds what
every case builder shares: flattening a result to compare it
(:func:`as_flat`), the loss a plain step calls ``backward()`` on, the rows that
failed to build, and running a whole case under ``torch.autocast``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor, nn

from ..workloads import Workload


@dataclass
class Method:
    """One row of the table.

    Attributes:
        name: the row's label.
        fn: ``fn(buf) -> result`` (see the package docstring), or ``None`` if the
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
        workload: the :class:`~persample_bench.workloads.Workload`.
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
        forward_ops: the ops one forward of the model runs, as a ``TorchFunctionMode``
            sees them (the fixed cost per op is reported over it); ``None``: not counted.
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
    forward_ops: int | None = None


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

    Examples:
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

    Examples:
        >>> num_params(nn.Linear(3, 2))
        8
    """
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def scalar_loss(loss: Tensor) -> Tensor:
    """The loss a plain training step calls ``backward()`` on: a scalar as it is, the
    mean of per-sample ``(B,)`` losses.

    Examples:
        >>> scalar_loss(torch.tensor([1.0, 3.0]))
        tensor(2.)
    """
    return loss.mean() if loss.ndim else loss


def failed(name: str, err: Exception) -> Method:
    """The row ``name`` that could not be built: ``fn=None``, the error as its note.

    Examples:
        >>> failed("Opacus hooks", ValueError("BatchNorm")).note
        'failed: ValueError: BatchNorm'
    """
    return Method(name, None, f"failed: {type(err).__name__}: {err}"[:200])


def optional_method(build: Callable[[], Any], name: str, module: str, w: Workload,
                    call: Callable[[Any], Tensor]) -> Method:
    """A row of a library that takes an ``nn.CrossEntropyLoss`` on a tensor input: built
    once by ``build()`` (outside the timed calls), run as ``call(built)``.

    Args:
        build: makes what the row calls (imports ``module`` itself).
        name: the row's label.
        module: the library's top-level module: the row says ``"not installed"`` when it
            cannot be imported.
        w: the workload; another loss or a dict of inputs: ``"not applicable: ..."``.
        call: runs the built object once and returns the row's result.

    Returns:
        The :class:`Method`; ``fn=None`` with a note where it cannot run, or
        ``"failed: ..."`` where ``build()`` raised.

    Examples:
        >>> from persample_bench.workloads import jacobian_workload
        >>> optional_method(lambda: None, "x", "json", jacobian_workload("pinn-input-jac", 2),
        ...                 lambda built: built).note
        'not applicable: it takes an nn.CrossEntropyLoss'
    """
    try:
        __import__(module)
    except ImportError:
        return Method(name, None, "not installed")
    if not isinstance(w.loss_fn, nn.CrossEntropyLoss) or isinstance(w.inputs, dict):
        return Method(name, None, "not applicable: it takes an nn.CrossEntropyLoss")
    try:
        built = build()
    except Exception as err:
        return failed(name, err)
    return Method(name, lambda _: call(built))


def under_autocast(case: Case) -> Case:
    """The case with its baseline, floor, reference, diagnostics and every method run
    under ``torch.autocast`` with the workload's ``autocast`` dtype (as they are without
    one); returns ``case``, changed in place.

    Examples:
        >>> from persample_bench.anchors.builders import dp_step_case
        >>> from persample_bench.workloads import dp_workload
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
