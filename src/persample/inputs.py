"""The model's inputs as users pass them, and where their samples are.

``inputs`` may be a tensor (``model(x)``), a tuple or list (``model(*inputs)``), a
mapping such as a tokenizer's ``BatchEncoding`` (``model(**inputs)``), or a pair
``(args, kwargs)`` of a tuple and a mapping (``model(*args, **kwargs)``). Inside
them, persample opens tuples, lists, dicts and dataclasses, and knows three forms
whose samples are not simply dim 0:

- a ``torch.nn.utils.rnn.PackedSequence``: ``batch_sizes[0]`` sequences, each a
  sample, its rows ordered by ``sorted_indices``;
- :class:`PackedRows`: the rows of several samples in one tensor, with the sample of
  every row (point clouds, sets, bags of items);
- a graph batch in torch_geometric's form (read by duck typing: ``num_graphs``,
  ``batch``, ``_slice_dict``, ``__cat_dim__``, ``index_select`` and
  ``from_data_list``; torch_geometric is not a dependency): each graph a sample.

The batch size ``B`` is the number of samples of those forms (they must agree), or
else dim 0 of the first tensor. Every other tensor with ``B`` in dim 0 is a
per-sample input (sliced by sample); every other tensor is shared by all samples (a
``(1, T)`` position tensor, a lookup table). Any other object that holds tensors is
refused with an error naming it: persample cannot know how to give each sample its
part, and passing it whole to every sample would be silently wrong.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

# Where the samples are in a tensor of the inputs, before any layout is made of it:
# ``(tensor, dim, rows)``, the samples along ``dim``, one per row in order where ``rows``
# is ``None``, else ``rows[r]`` the sample of row ``r`` (packed forms). persample.batch
# makes layouts of them (``persample.batch.located``).
Part = tuple[Tensor, int, "Tensor | None"]


@dataclass(frozen=True)
class PackedRows:
    """The rows of several samples packed into one tensor, with the sample of each row.

    Passed to the model as it is (the model reads ``.data``, ``.sample_index`` and
    ``.num_samples``, e.g. to pool each sample's rows with
    ``zeros(num_samples, F).index_add_(0, sample_index, h)``). persample follows the
    rows by their sample index, and the loop over samples gives sample ``i`` its rows
    alone: ``PackedRows(data[sample_index == i], zeros, 1)``. This is the "batch
    vector" of graph and point-cloud libraries (Fey & Lenssen 2019, "Fast Graph
    Representation Learning with PyTorch Geometric").

    Args:
        data: ``(R, *row_shape)``, the rows of all samples, any dtype.
        sample_index: ``(R,)`` integer tensor on ``data``'s device, the sample of each row,
            in ``[0, num_samples)``; rows need not be grouped or sorted.
        num_samples: ``B``, the number of samples (a sample may have no rows).

    Raises:
        TypeError: ``data`` or ``sample_index`` is not a tensor, or ``sample_index`` is
            not an integer tensor.
        ValueError: ``sample_index`` is not ``(R,)``, or holds a value outside
            ``[0, num_samples)``.

    Examples:
        >>> import torch
        >>> from persample import PackedRows
        >>> rows = PackedRows(torch.randn(5, 3), torch.tensor([0, 0, 1, 2, 2]), 3)
        >>> torch.zeros(3, 3).index_add_(0, rows.sample_index, rows.data).shape
        torch.Size([3, 3])
    """

    data: Tensor
    sample_index: Tensor
    num_samples: int

    def __post_init__(self) -> None:
        if not isinstance(self.data, Tensor) or not isinstance(self.sample_index, Tensor):
            raise TypeError("PackedRows(data, sample_index, num_samples) takes two tensors")
        if self.sample_index.is_floating_point() or self.sample_index.is_complex():
            raise TypeError(f"PackedRows: sample_index must be an integer tensor, got "
                            f"{self.sample_index.dtype}")
        if self.data.dim() == 0 or tuple(self.sample_index.shape) != (self.data.shape[0],):
            raise ValueError(
                f"PackedRows: sample_index has shape {tuple(self.sample_index.shape)}; it must "
                f"be ({self.data.shape[0] if self.data.dim() else 'R'},), one sample per row "
                "of data")
        n = int(self.num_samples)
        if self.sample_index.numel() and (int(self.sample_index.min()) < 0
                                          or int(self.sample_index.max()) >= n):
            raise ValueError(f"PackedRows: sample_index must be in [0, {n}) (num_samples={n})")

    def samples(self, start: int, stop: int) -> PackedRows:
        """Samples ``start:stop``, renumbered from 0."""
        keep = (self.sample_index >= start) & (self.sample_index < stop)
        return PackedRows(self.data[keep], self.sample_index[keep] - start,
                          max(0, min(stop, self.num_samples) - start))


# ---------------------------------------------------------------------------
# the per-sample forms: how many samples, their tensors' layouts, one slice


def _is_graph_batch(x: Any) -> bool:
    """torch_geometric's ``Batch`` (or anything with its interface)."""
    return (isinstance(getattr(x, "batch", None), Tensor) and hasattr(x, "num_graphs")
            and hasattr(x, "_slice_dict") and hasattr(x, "__cat_dim__")
            and callable(getattr(x, "index_select", None))
            and callable(getattr(type(x), "from_data_list", None)))


def _special(x: Any) -> bool:
    return isinstance(x, (PackedSequence, PackedRows)) or _is_graph_batch(x)


def _count(x: Any) -> int:
    """The number of samples of a special form."""
    if isinstance(x, PackedSequence):
        return int(x.batch_sizes[0]) if x.batch_sizes.numel() else 0
    if isinstance(x, PackedRows):
        return int(x.num_samples)
    return int(x.num_graphs)


def _special_parts(x: Any, n: int) -> tuple[list[Part], list[Tensor]]:
    """The special form's per-sample tensors with where their samples are, and its other
    tensors."""
    if isinstance(x, PackedSequence):
        order = x.sorted_indices if x.sorted_indices is not None else torch.arange(
            n, device=x.data.device)
        rows = torch.cat([order[: int(s)] for s in x.batch_sizes]) if n else order[:0]
        extra = [t for t in (x.sorted_indices, x.unsorted_indices) if t is not None]
        return [(x.data, 0, rows.to(x.data.device))], [x.batch_sizes, *extra]
    if isinstance(x, PackedRows):
        return [(x.data, 0, x.sample_index), (x.sample_index, 0, x.sample_index)], []
    return _graph_parts(x, n)


def _graph_parts(x: Any, n: int) -> tuple[list[Part], list[Tensor]]:
    """Every tensor attribute of a graph batch, by the graph of each row along its
    concatenation dim (torch_geometric's ``_slice_dict`` offsets)."""
    located, shared = [(x.batch, 0, x.batch)], []
    for key in _graph_keys(x):
        value = getattr(x, key)
        if not isinstance(value, Tensor) or value is x.batch:
            continue
        if key == "ptr":
            shared.append(value)
            continue
        if key not in x._slice_dict:
            raise TypeError(
                f"inputs: the graph batch's attribute '{key}' has no per-graph offsets "
                "(_slice_dict), so its rows cannot be given to their graphs; build the batch "
                "with Batch.from_data_list")
        dim = x.__cat_dim__(key, value)
        offsets = torch.as_tensor(x._slice_dict[key], device=value.device)
        if dim is None:  # stacked along a new dim 0: one row per graph
            located.append((value, 0, None))
            continue
        dim = dim + value.dim() if dim < 0 else dim
        graph = torch.repeat_interleave(torch.arange(n, device=value.device),
                                        offsets.diff())  # (rows along dim,)
        located.append((value, dim, graph))
    return located, shared


def _graph_keys(x: Any) -> list[str]:
    keys = x.keys() if callable(getattr(x, "keys", None)) else list(vars(x))
    return list(keys)


def _special_rows(x: Any, start: int, stop: int) -> Any:
    """Samples ``start:stop`` of a special form, in the same form."""
    if isinstance(x, PackedRows):
        return x.samples(start, stop)
    if isinstance(x, PackedSequence):
        padded, lengths = pad_packed_sequence(x, batch_first=True)  # (n, T, *f), (n,)
        part = lengths[start:stop]
        if part.numel() == 0:
            raise ValueError("a PackedSequence cannot hold 0 sequences")
        return pack_padded_sequence(padded[start:stop, : int(part.max())], part,
                                    batch_first=True,
                                    enforce_sorted=x.sorted_indices is None)
    return type(x).from_data_list(x.index_select(list(range(start, min(stop, _count(x))))))


# ---------------------------------------------------------------------------
# walking the inputs


def _walk(x: Any, fn: Callable[[Any, str], Any], path: str) -> Any:
    """``x`` rebuilt with ``fn(leaf, path)`` for each leaf (a tensor or a special form),
    in a fixed order; tuples, lists, dicts and dataclasses are opened. An object that
    holds tensors in another form is refused."""
    if isinstance(x, Tensor) or _special(x):
        return fn(x, path)
    if isinstance(x, (tuple, list)):
        items = [_walk(v, fn, f"{path}[{k}]") for k, v in enumerate(x)]
        if hasattr(x, "_fields"):  # a namedtuple
            return type(x)(*items)
        return type(x)(items)
    if isinstance(x, Mapping):
        items = {k: _walk(v, fn, f"{path}[{k!r}]") for k, v in x.items()}
        return items if type(x) is dict else _rebuilt_mapping(x, items)
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        new = copy.copy(x)
        for f in dataclasses.fields(x):
            object.__setattr__(new, f.name, _walk(getattr(x, f.name), fn, f"{path}.{f.name}"))
        return new
    if _holds_tensors(x):
        raise TypeError(
            f"{path} is a {type(x).__name__} that holds tensors, which persample cannot give "
            "to each sample (only tensors, tuples, lists, dicts, dataclasses, PackedSequence, "
            "persample.PackedRows and graph batches are opened). Pass its tensors as "
            "arguments, or make it a dataclass.")
    return x


def _rebuilt_mapping(x: Mapping, items: dict) -> Any:
    try:
        return type(x)(items)
    except Exception:  # a mapping type that cannot be built from a dict
        return items


def _holds_tensors(x: Any, depth: int = 3) -> bool:
    """Does ``x`` hold a tensor in its attributes (or their containers), to ``depth``?"""
    if isinstance(x, Tensor):
        return True
    if depth == 0 or isinstance(x, (nn.Module, type, str, bytes, int, float, bool, type(None))):
        return False
    if isinstance(x, Mapping):
        values = list(x.values())
    elif isinstance(x, (tuple, list, set)):
        values = list(x)
    else:
        try:
            values = list(vars(x).values())
        except TypeError:  # no __dict__ (slots, builtins)
            values = [getattr(x, s, None) for s in getattr(type(x), "__slots__", ())]
    return any(_holds_tensors(v, depth - 1) for v in values)


def _leaves(x: Any, path: str) -> list[tuple[str, Any]]:
    found: list[tuple[str, Any]] = []

    def keep(leaf: Any, where: str) -> Any:
        found.append((where, leaf))
        return leaf

    _walk(x, keep, path)
    return found


@dataclass
class Batch:
    """The positional and keyword inputs of one call of the model, the batch size, and
    which of their leaves (tensors and special forms, in :func:`_walk` order) carry
    samples: decided once, kept when the batch is cut into chunks."""

    args: tuple
    kwargs: dict
    n: int
    sample_leaves: frozenset[int]
    form: str = "tuple"  # how the user passed them: "one", "tuple", "dict" or "pair"
    opened: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    # (id of a special form -> (it, its parts): opened once per call, a graph batch's
    # row indices being a repeat_interleave per attribute)

    def _parts_of(self, leaf: Any) -> tuple[list[Part], list[Tensor]]:
        """:func:`_special_parts` of one of this batch's special forms."""
        found = self.opened.get(id(leaf))
        if found is None or found[0] is not leaf:
            found = self.opened[id(leaf)] = (leaf, _special_parts(leaf, _count(leaf)))
        return found[1]

    def roots(self) -> list[tuple[Any, str]]:
        """The arguments with their names as the user passed them, in order."""
        prefix = {"one": ("inputs", ""), "tuple": ("inputs[{}]", ""),
                  "dict": ("", "inputs[{!r}]"), "pair": ("inputs[0][{}]", "inputs[1][{!r}]")}
        pos, key = prefix[self.form]
        found = [(a, pos.format(k) if self.form != "one" else "inputs")
                 for k, a in enumerate(self.args)]
        return found + [(v, key.format(k)) for k, v in self.kwargs.items()]

    def named_leaves(self) -> list[tuple[str, Any]]:
        """``(name, leaf)`` for every tensor and special form, in order."""
        return [leaf for root, name in self.roots() for leaf in _leaves(root, name)]

    def parts(self) -> list[Part]:
        """Every tensor carrying samples, with where its samples are."""
        found = []
        for k, (_, leaf) in enumerate(self.named_leaves()):
            if k not in self.sample_leaves:
                continue
            if isinstance(leaf, Tensor):
                found.append((leaf, 0, None))
            else:
                found += self._parts_of(leaf)[0]
        return found

    @property
    def shared(self) -> list[Tensor]:
        """The tensors shared by all samples."""
        found = []
        for k, (_, leaf) in enumerate(self.named_leaves()):
            if isinstance(leaf, Tensor) and k not in self.sample_leaves:
                found.append(leaf)
            elif not isinstance(leaf, Tensor):
                found += self._parts_of(leaf)[1]
        return found

    def named_tensors(self) -> list[tuple[str, Tensor]]:
        """``(name, tensor)`` for every tensor of the inputs (special forms opened)."""
        found = []
        for name, leaf in self.named_leaves():
            if isinstance(leaf, Tensor):
                found.append((name, leaf))
            else:
                parts, shared = self._parts_of(leaf)
                found += [(name, t) for t, _, _ in parts] + [(name, t) for t in shared]
        return found

    def call(self, model: Callable) -> Any:
        return model(*self.args, **self.kwargs)

    def as_inputs(self) -> Batch:
        """This batch as the ``inputs`` of the public functions (a batch is taken as
        it is: which leaves carry samples is not decided again)."""
        return self

    def leaves(self) -> list[Any]:
        """The tensors and special forms of the inputs, in order."""
        return [leaf for _, leaf in self.named_leaves()]

    def rebuilt(self, values: list[Any]) -> tuple[tuple, dict]:
        """``(args, kwargs)`` with the leaves replaced by ``values``, in order."""
        found = iter(values)
        return _walk((self.args, self.kwargs), lambda leaf, _: next(found), "inputs")

    def samples(self, start: int, stop: int) -> Batch:
        """Samples ``start:stop``; shared tensors stay whole (the whole batch: itself, not
        rebuilt: a graph ``Batch`` cut again costs a ``from_data_list``)."""
        if start <= 0 and stop >= self.n:
            return self
        counter = iter(range(1 << 62))

        def cut(leaf: Any, _: str) -> Any:
            k = next(counter)
            if k not in self.sample_leaves:
                return leaf
            return leaf[start:stop] if isinstance(leaf, Tensor) else _special_rows(
                leaf, start, stop)

        args = _walk(self.args, cut, "args")
        kwargs = _walk(self.kwargs, cut, "kwargs")
        return Batch(args, kwargs, max(0, min(stop, self.n) - start), self.sample_leaves,
                     self.form)


def as_batch(inputs: Any) -> Batch:
    """``inputs`` (see the module docstring) as a :class:`Batch`.

    Raises:
        TypeError: no tensor with a batch dim among the inputs; an object holding
            tensors in a form persample does not open.
        ValueError: special forms that disagree on the number of samples.
    """
    if isinstance(inputs, Batch):
        return inputs
    if isinstance(inputs, Mapping):
        args, kwargs, form = (), dict(inputs), "dict"
    elif (isinstance(inputs, (tuple, list)) and not _special(inputs) and len(inputs) == 2
          and isinstance(inputs[0], (tuple, list)) and not _special(inputs[0])
          and isinstance(inputs[1], Mapping)):
        args, kwargs, form = tuple(inputs[0]), dict(inputs[1]), "pair"
    elif isinstance(inputs, (tuple, list)) and not _special(inputs):
        args, kwargs, form = tuple(inputs), {}, "tuple"
    else:
        args, kwargs, form = (inputs,), {}, "one"
    shell = Batch(args, kwargs, 0, frozenset(), form)
    leaves = shell.named_leaves()
    specials = [(name, leaf) for name, leaf in leaves if not isinstance(leaf, Tensor)]
    counts = {name: _count(leaf) for name, leaf in specials}
    if len(set(counts.values())) > 1:
        raise ValueError(f"inputs hold packed forms with different numbers of samples: "
                         f"{counts}; every one must hold the same samples")
    first = next((leaf for _, leaf in leaves if isinstance(leaf, Tensor)), None)
    if not specials and (first is None or first.dim() == 0):
        raise TypeError(
            "inputs must hold a tensor with the batch in dim 0: a tensor, a tuple (passed "
            "as model(*inputs)), a dict (model(**inputs)) or a pair (args, kwargs); got "
            f"{type(inputs).__name__}"
            + ("" if first is None else " whose first tensor is a scalar"))
    n = next(iter(counts.values())) if specials else first.shape[0]
    sample = frozenset(k for k, (_, leaf) in enumerate(leaves)
                       if not isinstance(leaf, Tensor)
                       or (leaf.dim() > 0 and leaf.shape[0] == n))
    return Batch(args, kwargs, n, sample, form)


def samples_of(x: Any, start: int, stop: int) -> Any:
    """Rows ``start:stop`` of every tensor in ``x`` (targets: a tensor, or any nest of
    them, dataclasses and the packed forms included; ``None`` stays ``None``)."""
    def cut(leaf: Any, _: str) -> Any:
        if isinstance(leaf, Tensor):
            return leaf[start:stop] if leaf.dim() else leaf
        return _special_rows(leaf, start, stop)

    return _walk(x, cut, "targets")


def mapped_targets(targets: Any) -> tuple[list[Tensor], list[int | None],
                                          Callable[[list[Tensor]], Any]] | None:
    """``targets`` for ``torch.func.vmap`` over the samples: its tensors (dataclasses and
    containers opened), their ``in_dims`` (0, or ``None`` for a 0-dim tensor), and
    ``one(rows)`` that rebuilds one sample's targets from its rows (each a batch of one).
    ``None`` where the targets hold a packed form, whose samples are not slices of dim 0
    (the caller then cuts them with :func:`samples_of`)."""
    leaves = [leaf for _, leaf in _leaves(targets, "targets")]
    if any(not isinstance(t, Tensor) for t in leaves):
        return None
    dims = [0 if t.dim() else None for t in leaves]

    def one(rows: list[Tensor]) -> Any:
        found = iter([t.unsqueeze(0) if d == 0 else t for t, d in zip(rows, dims)])
        return _walk(targets, lambda leaf, _: next(found), "targets")

    return leaves, dims, one


def parts_of(x: Any, n: int) -> list[Part]:
    """The tensors of ``x`` (targets) that carry samples, with where their samples are:
    those with ``n`` rows in dim 0, and the special forms' per-sample tensors."""
    found = []
    for _, leaf in _leaves(x, "targets"):
        if not isinstance(leaf, Tensor):
            found += _special_parts(leaf, _count(leaf))[0]
        elif leaf.dim() and leaf.shape[0] == n:
            found.append((leaf, 0, None))
    return found


def named_tensors(x: Any, path: str) -> list[tuple[str, Tensor]]:
    """``(name, tensor)`` of every tensor in ``x`` (special forms opened)."""
    found = []
    for name, leaf in _leaves(x, path):
        if isinstance(leaf, Tensor):
            found.append((name, leaf))
        else:
            parts, shared = _special_parts(leaf, _count(leaf))
            found += [(name, t) for t, _, _ in parts] + [(name, t) for t in shared]
    return found


__all__ = ["Batch", "PackedRows", "as_batch", "parts_of", "mapped_targets", "named_tensors",
           "samples_of"]
