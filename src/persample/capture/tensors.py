"""Finding tensors: those a model holds (shared by every sample), the modules worth
hooking, and the tensors of a call's inputs and outputs, fast.
"""

from __future__ import annotations

import weakref
from typing import Any

from torch import Tensor, nn
from torch.utils._pytree import tree_leaves

from ..walk import dict_version

# what nn.Module keeps in its instance dict (parameters and buffers are read on their own)
_INTERNALS = frozenset(vars(nn.Module()))
_PLAIN = (int, float, bool, str, type(None))


def holders(model: nn.Module, watched: dict[int, Tensor]) -> list[tuple[str, nn.Module]]:
    """``(qualified name, module)`` of the modules holding a watched parameter at any
    depth, in ``named_modules()`` order; one walk of the tree (``named_parameters`` per
    module would walk it again for each)."""
    found: list[tuple[str, nn.Module] | None] = []
    seen: set[int] = set()

    def walk(name: str, module: nn.Module) -> bool:
        first, slot = id(module) not in seen, len(found)
        if first:
            seen.add(id(module))
            found.append(None)
        holds = any(id(p) in watched for p in module._parameters.values() if p is not None)
        for key, child in module._modules.items():
            if child is not None and walk(f"{name}.{key}" if name else key, child):
                holds = True
        if first and holds:
            found[slot] = (name, module)
        return holds

    walk("", model)
    return [entry for entry in found if entry is not None]


def free_tensors(model: nn.Module | None, shared: tuple) -> list[Tensor]:
    """The model's parameters and buffers, the tensors its modules hold as attributes
    (also in lists, tuples and dicts: masks, constants, caches made before the call), the
    tensors its modules' ``forward`` code holds as globals of its Python module (a
    normalisation constant, a mask made at import), and the shared inputs: every tensor
    shared by all samples before the forward runs."""
    found = [t for t in tree_leaves(shared) if isinstance(t, Tensor)]
    if model is None:
        return found
    scopes: dict[int, dict] = {}
    for m in model.modules():
        scope = _globals_of(type(m))
        if scope is not None:
            scopes[id(scope)] = scope
        found += [t for t in m._parameters.values() if t is not None]
        found += [t for t in m._buffers.values() if t is not None]
        for key, value in vars(m).items():
            if key in _INTERNALS or type(value) in _PLAIN:
                continue
            if isinstance(value, Tensor):
                found.append(value)
            elif isinstance(value, (list, tuple, dict)) and value:
                found += _held_tensors(value)
    for scope in scopes.values():
        found += _global_tensors(scope)
    return found


_SCANNED: dict[int, tuple[dict, int, list[weakref.ref]]] = {}  # id(globals) -> (them,
# their version tag, the tensors bound to their names then: held by them, not here)


def _global_tensors(scope: dict) -> list[Tensor]:
    """The tensors bound to names of a module's globals (names bound to a tensor alone: a
    container among a script's globals may hold a whole dataset), scanned again only
    where the dict was written since (its version tag)."""
    version = dict_version(scope) if dict_version is not None else None
    found = _SCANNED.get(id(scope))
    if found is not None and found[0] is scope and version is not None and (
            found[1] == version):
        return [t for t in (ref() for ref in found[2]) if t is not None]
    tensors = [t for t in scope.values() if isinstance(t, Tensor)]
    if version is not None:
        _SCANNED[id(scope)] = (scope, version, [weakref.ref(t) for t in tensors])
    return tensors


def _globals_of(cls: type) -> dict | None:
    """The globals of the Python module that defines ``cls.forward`` (``None``: a forward
    without them, TorchScript's)."""
    try:
        scope = getattr(cls.forward, "__globals__", None)
    except AttributeError:  # (a scripted module's forward is no plain function)
        return None
    return scope if type(scope) is dict else None


def _held_tensors(value: Any, depth: int = 3) -> list[Tensor]:
    """The tensors in nested lists, tuples and dicts (a module attribute), to ``depth``."""
    if isinstance(value, Tensor):
        return [value]
    if depth == 0 or not isinstance(value, (list, tuple, dict)):
        return []
    items = value.values() if isinstance(value, dict) else value
    return [t for item in items for t in _held_tensors(item, depth - 1)]


def tensor_leaves(tree: Any) -> list[Tensor]:
    """The tensors of ``tree`` in ``tree_leaves`` order. Module inputs and outputs are
    mostly a tensor, or plain tuples, lists and dicts of tensors and numbers: those are
    walked here, several times faster than the general pytree walk, which takes the rest."""
    if isinstance(tree, Tensor):
        return [tree]
    found: list[Tensor] = []
    stack = [tree]
    while stack:
        node = stack.pop()
        kind = type(node)
        if kind is tuple or kind is list:
            items = node
        elif kind is dict:
            items = list(node.values())
        else:
            return [t for t in tree_leaves(tree) if isinstance(t, Tensor)]
        for item in reversed(items):  # depth first, in order
            if isinstance(item, Tensor):
                stack.append(item)
            elif type(item) in (tuple, list, dict):
                stack.append(item)
            elif not isinstance(item, _PLAIN):
                return [t for t in tree_leaves(tree) if isinstance(t, Tensor)]
        while stack and isinstance(stack[-1], Tensor):
            found.append(stack.pop())
    return found


def has_tensor(out: Any) -> bool:
    """Is ``out`` a tensor, or a tuple/list holding one?"""
    if isinstance(out, Tensor):
        return True
    return isinstance(out, (tuple, list)) and any(isinstance(o, Tensor) for o in out)


def user_leaf(t: Tensor) -> bool:
    """A leaf tensor that requires grad, or a parameter: made by the user, never computed
    (from sample data or anything else), so shared by every sample (FSDP2 gathers a
    sharded model's parameters, frozen ones too, into new parameters in the forward)."""
    return (t.requires_grad or isinstance(t, nn.Parameter)) and t.grad_fn is None


class Kept:
    """Tensors made before any later call, by identity, holding none alive: those a
    capture saw made from no sample data, without a gradient path, that outlived it (a
    cached index table, transformers' ``lru_cache``-d relative positions); and those a
    capture read without having seen them made, without a gradient path (a table made
    by a plain forward before persample's first call and cached since), each at the
    version it had when that capture ended. A later capture reads them as shared rather
    than as tensors it never saw made: they hold none of its samples. (The second kind
    is unknown to the capture that first reads it: made by code it cannot see, in that
    call perhaps; a later call reads it as from before it, unless it was written since.)

    Examples:
        >>> import torch
        >>> kept, t, u = Kept(), torch.arange(3), torch.zeros(2)
        >>> kept.add(t); kept.add(u, version=u._version)
        >>> kept.holds(t), kept.holds(torch.arange(3)), kept.holds(u)
        (True, False, True)
        >>> _ = u.add_(1)
        >>> kept.holds(u)
        False
    """

    def __init__(self) -> None:
        self._by_id: dict[int, tuple[weakref.ref, int | None]] = {}

    def add(self, t: Tensor, version: int | None = None) -> None:
        """Keep ``t`` (``version``: held only while ``t`` is at it)."""
        key = id(t)

        def forget(ref: weakref.ref, key: int = key) -> None:
            entry = self._by_id.get(key)
            if entry is not None and entry[0] is ref:
                del self._by_id[key]

        self._by_id[key] = (weakref.ref(t, forget), version)

    def holds(self, t: Tensor) -> bool:
        entry = self._by_id.get(id(t))
        return entry is not None and entry[0]() is t and (
            entry[1] is None or entry[1] == t._version)


KEPT = Kept()
