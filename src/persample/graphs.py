"""A persample function captured in a CUDA graph and replayed on each new batch.

On a GPU a small model's kernels take microseconds, and the host launching them (the
Python of the model, of persample, of the loss) decides the time of a call: on one
NVIDIA H200 the per-sample gradients of an 8-layer MLP took 3.86 ms a call eagerly and
0.55 ms through :func:`graphed` (results cloned). A settled persample call reads no value
on the host, so a graph can capture it whole; :func:`graphed` does so, and keeps the
graph valid:

- each call's tensors are copied into the tensors the graph read (the same shapes and
  dtypes; other shapes get a graph of their own);
- the model's parameters, buffers, modules and their ``training`` flags are compared
  with those at capture on every call (identity, storage, ``requires_grad``); where any
  differs (a new parameter tensor, ``model.eval()``, a replaced submodule) the graphs are
  dropped and the call captured again;
- the results are cloned out of the graph's memory (``clone=False``: the graph's own
  tensors, overwritten by the next call).

What no check can see, as for any captured code: the Python the graph ran is not run
again, so a loss or a forward that reads Python values (a temperature, an attribute
set between calls) keeps the values it read at capture. Random ops (dropout) draw new
numbers at each replay (torch's graph-safe generator). Where no GPU is present a call is
the function's own call (no graph, nothing kept).

CUDA graphs: NVIDIA, "CUDA C++ Programming Guide", section "CUDA Graphs"; in PyTorch,
``torch.cuda.graph`` (the warm-up on a side stream, then the capture, as its guide
captures a training step).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from .precision import autocast_state

WARMUP = 6
"""Calls run before a capture: enough for a call's plan to settle (a full capture, a
traced program, then a compiled forward) so that the call captured is the steady one."""

KEPT = 8
"""Graphs a :class:`Graphed` keeps, one per kind of batch, the least recently used
dropped first (each holds one call's memory)."""


def graphed(function: Callable[..., Any], model: nn.Module, *, warmup: int = WARMUP,
            clone: bool = True, **kwargs: Any) -> Graphed:
    """``function(model, *args, **kwargs)`` as a callable ``step(*args)`` that replays a CUDA
    graph of it.

    Args:
        function: a persample function that reads no value on the host once settled,
            called as ``function(model, *args, **kwargs)``:
            :func:`~persample.per_sample_grads` (replayed against the loop on a GPU in
            the tests); others where they read no value (one that does raises at the
            capture). A DP step cannot be captured.
        model: the ``nn.Module`` (on a CUDA device for a graph).
        warmup: calls run (on a side stream) before each capture, ``>= 1``.
        clone: return the results cloned (default); ``False``: the graph's own result
            tensors, overwritten by the next call.
        **kwargs: keyword arguments of every call, fixed (``loss_fn=...``,
            ``flat=True``): pass what stays the same by keyword, the batch by position.

    Returns:
        :class:`Graphed`: ``step(*args)`` returns what ``function(model, *args,
        **kwargs)`` returns (e.g. ``{name: (B, *param.shape)}`` tensors in the
        parameters' dtype, on their device). Each kind of batch (its tensors' shapes,
        dtypes and devices; any other argument's value, or identity where it has no
        hash; the autocast state the call runs under) gets a graph of its own, which
        holds one call's memory while it is kept (the last :data:`KEPT` kinds;
        :meth:`Graphed.clear` drops them all).

    Raises:
        ValueError: ``warmup < 1``, or ``function`` is a DP step (``persample.dp``).
        RuntimeError: at a call, where the call cannot be captured (it reads values on
            the host), naming the function; torch's error is its cause. An error of the
            call itself (run eagerly before the capture) is raised as it is.

    Examples:
        >>> from torch import nn
        >>> import persample
        >>> net = nn.Linear(3, 2)
        >>> step = graphed(persample.per_sample_grads, net, loss_fn=nn.MSELoss())
        >>> grads = step(torch.randn(4, 3), torch.randn(4, 2))  # {name: (4, *shape)}
        >>> grads = step(torch.randn(4, 3), torch.randn(4, 2))  # the next batch
        >>> grads["weight"].shape  # (here no GPU: each call is the function's own)
        torch.Size([4, 2, 3])

    Source: CUDA Graphs (NVIDIA, "CUDA C++ Programming Guide"), captured and replayed
    through ``torch.cuda.graph``.
    """
    if warmup < 1:
        raise ValueError(f"graphed: warmup={warmup}; it must be >= 1 (calls before capture)")
    if getattr(function, "__module__", "").startswith("persample.dp"):
        raise ValueError(
            f"graphed: {function.__name__} is a DP step, which cannot be captured in a CUDA "
            "graph (it refuses non-finite per-sample gradients by reading their norms on "
            "the host, and each step draws new noise). Call it eagerly.")
    return Graphed(function, model, kwargs, warmup, clone)


class Graphed:
    """A persample function of one model, replayed from CUDA graphs (:func:`graphed`).

    Attributes:
        captures: how many graphs were captured so far (one per kind of batch, again
            after the model changed; 0 without a GPU).
    """

    def __init__(self, function: Callable[..., Any], model: nn.Module, kwargs: dict,
                 warmup: int, clone: bool) -> None:
        self.function, self.model, self.kwargs = function, model, kwargs
        self.warmup, self.clone = warmup, clone
        self.captures = 0
        self._graphs: OrderedDict[tuple, _Replay] = OrderedDict()
        self._state: tuple | None = None

    def clear(self) -> None:
        """Drop every graph (and the memory each holds); the next call captures again."""
        self._graphs.clear()
        self._state = None

    def __call__(self, *args: Any) -> Any:
        """``function(model, *args, **kwargs)``, replayed (see :func:`graphed`)."""
        leaves, spec = tree_flatten(args)
        device = _device(self.model, leaves)
        if device is None:  # (no GPU: the call itself)
            return self.function(self.model, *args, **self.kwargs)
        state = _model_state(self.model)
        if state != self._state:  # (a changed model: every graph read the old one)
            self._graphs.clear()
            self._state = state
        key = (spec, autocast_state(), *(_leaf_key(leaf) for leaf in leaves))
        replay = self._graphs.get(key)
        if replay is None:
            replay = self._graphs[key] = self._capture(leaves, spec, device)
            self.captures += 1
            if len(self._graphs) > KEPT:
                self._graphs.popitem(last=False)
        self._graphs.move_to_end(key)
        replay.run(leaves)
        out = replay.out
        return tree_map(lambda t: t.clone() if isinstance(t, Tensor) else t, out) \
            if self.clone else out

    def _capture(self, leaves: list, spec: Any, device: torch.device) -> _Replay:
        static = [leaf.detach().clone() if isinstance(leaf, Tensor) else leaf
                  for leaf in leaves]  # (the tensors every replay reads)

        def call() -> Any:
            return self.function(self.model, *tree_unflatten(static, spec), **self.kwargs)

        try:
            graph, out = _cuda_capture(call, device, self.warmup)
        except _Uncapturable as e:
            name = getattr(self.function, "__name__", "the function")
            raise RuntimeError(
                f"graphed: {name} on this model cannot be captured in a CUDA graph "
                f"({e.__cause__}). Something in the call reads values on the host: the "
                "model's own forward, the loss, or an index op whose layout persample "
                "decides from values (graph batches, mixtures of experts). Call it "
                "eagerly.") from e.__cause__
        return _Replay(static, graph, out)


class _Uncapturable(Exception):
    """A call that ran eagerly failed under the capture (its cause: torch's error)."""


def _cuda_capture(call: Callable[[], Any], device: torch.device, warmup: int
                  ) -> tuple[Any, Any]:
    """``call`` run ``warmup`` times on a side stream, then captured: ``(the graph, the
    outputs it writes)`` (the capture runs nothing: replay it for a result). An error of
    the warm-up is raised as it is; one of the capture as :class:`_Uncapturable`."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(warmup):
            call()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            out = call()
    except Exception as e:  # (the warm-up ran the same call eagerly: the capture failed)
        raise _Uncapturable() from e
    return graph, out


class _Replay:
    """One captured call: the tensors it reads, the graph, and the result it writes."""

    def __init__(self, static: list, graph: Any, out: Any) -> None:
        self.static, self.graph, self.out = static, graph, out

    def run(self, leaves: list) -> None:
        """Copy a batch's tensors into those the graph reads, and replay it."""
        for mine, leaf in zip(self.static, leaves):
            if isinstance(mine, Tensor) and mine is not leaf:
                mine.copy_(leaf)
        self.graph.replay()


def _leaf_key(leaf: Any) -> Any:
    """What of one argument a graph depends on: a tensor's shape, dtype, device and
    ``requires_grad`` (its values are copied in); anything else itself (by identity
    where it cannot be hashed)."""
    if isinstance(leaf, Tensor):
        return ("tensor", tuple(leaf.shape), leaf.dtype, leaf.device, leaf.requires_grad)
    try:
        hash(leaf)
    except TypeError:
        return ("object", id(leaf))
    return ("value", type(leaf), leaf)


def _model_state(model: nn.Module) -> tuple:
    """What a graph of ``model`` read: each module and its ``training`` flag, each
    parameter and buffer, its storage, shape, dtype and ``requires_grad``."""
    modules = tuple((id(m), m.training) for m in model.modules())
    tensors = tuple((id(t), t.data_ptr(), tuple(t.shape), t.dtype, t.requires_grad)
                    for t in (*model.parameters(), *model.buffers()))
    return modules, tensors


def _device(model: nn.Module, leaves: list) -> torch.device | None:
    """The CUDA device the call runs on, or ``None`` (no GPU there: no graph)."""
    tensors = [*model.parameters(), *(t for t in leaves if isinstance(t, Tensor))]
    cuda = [t.device for t in tensors if t.is_cuda]
    return cuda[0] if cuda and torch.cuda.is_available() else None
