"""A model's modules, parameters and buffers, walked once and kept while its structure
holds.

Every call validates the model (a module that mixes samples), lists its trainable
parameters, keeps its buffers and looks for FSDP2 units: each is a walk of
``named_modules()``, which costs tens of microseconds per hundred modules, several
times per call. The walk's answer is a function of the modules' types and of their
``_modules``, ``_parameters`` and ``_buffers`` dicts alone, so it is kept with a stamp
of those: each module's type and the version tags CPython gives each dict (a new tag
at every write to it, as TorchDynamo's guards read them). A module added, removed or
replaced, a parameter or buffer registered, replaced or deleted, or a class swapped
(``fully_shard``, a parametrization) changes the stamp, and the model is walked again.
Reading the stamp costs a fraction of a walk; where the version tags cannot be read,
every call walks.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from operator import attrgetter
from typing import Any

from torch import Tensor, nn

try:  # (CPython's dict version tags, as TorchDynamo reads them)
    from torch._C._dynamo.guards import dict_version
except ImportError:  # pragma: no cover - a torch without TorchDynamo's guards
    dict_version = None


class _Walk:
    """One walk: the modules (held weakly, so that the walk keeps none of them alive,
    the model included), the parameters and the stamp."""

    __slots__ = ("names", "refs", "parameters", "buffers", "stamp", "picked")

    def __init__(self, model: nn.Module):
        modules = list(model.named_modules())
        self.names = [name for name, _ in modules]
        self.refs = [weakref.ref(m) for _, m in modules]
        self.buffers: list[Tensor] | None = None  # (on first use)
        self.parameters: list[tuple[str, nn.Parameter]] | None = None  # (on first use:
        # a model may fail to list them where its modules list fine, FSDP1's wrapper)
        self.stamp = _stamp([m for _, m in modules]) if dict_version is not None and all(
            _walks_plainly(type(m)) for _, m in modules) else None  # (None: walked at
        # every call)
        self.picked: dict[Any, list[int]] = {}  # (picked_modules' answers, by test)

    def modules(self) -> list[nn.Module] | None:
        """The modules, or ``None`` where one is gone."""
        out = [r() for r in self.refs]
        return None if any(m is None for m in out) else out


def _walks_plainly(cls: type) -> bool:
    """Does ``cls`` walk its modules and parameters as ``nn.Module`` does (no override
    that could answer otherwise with the same dicts)?"""
    return all(getattr(cls, name) is getattr(nn.Module, name) for name in _WALKERS)


_WALKERS = ("named_modules", "named_parameters", "_named_members")


_WALKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> _Walk


def _stamp(modules: list[nn.Module]) -> tuple | None:
    """The modules' types and their three dicts' version tags, in walk order; ``None``
    where a module keeps them in something else than a dict (TorchScript's modules).
    (Read by C calls alone: no Python frame per module.)"""
    try:
        return (tuple(map(type, modules)), tuple(map(dict_version, map(_HELD, modules))),
                tuple(map(dict_version, map(_PARAMS, modules))),
                tuple(map(dict_version, map(_BUFFERS, modules))))
    except (AttributeError, RuntimeError, TypeError):  # (not a dict: dict_version raises)
        return None


_HELD, _PARAMS, _BUFFERS = (attrgetter("_modules"), attrgetter("_parameters"),
                            attrgetter("_buffers"))


def _walk(model: nn.Module) -> tuple[_Walk, list[nn.Module]]:
    """The model's walk and its modules, walked again where the stamp moved."""
    found = _WALKS.get(model) if dict_version is not None else None
    if found is not None and found.stamp is not None:
        modules = found.modules()
        if modules is not None and _stamp(modules) == found.stamp:
            return found, modules
    found = _Walk(model)
    if dict_version is not None:
        _WALKS[model] = found
    return found, found.modules()


def named_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``list(model.named_modules())``, kept while the model's structure holds (see the
    module docstring)."""
    walk, modules = _walk(model)
    return list(zip(walk.names, modules))


def picked_modules(model: nn.Module, test: Callable[[str, nn.Module], bool]
                   ) -> list[nn.Module]:
    """The modules ``m`` (named ``name``) of ``model`` with ``test(name, m)``, in
    ``named_modules()`` order. The answer is kept with the walk (by ``test``, which must
    read the modules' names, types and nesting alone: a module's class, never its flags
    or tensors) while the model's structure holds; an error ``test`` raises is raised
    again at every call.

    Examples:
        >>> net = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
        >>> picked_modules(net, lambda name, m: isinstance(m, nn.ReLU))
        [ReLU()]
    """
    walk, modules = _walk(model)
    found = walk.picked.get(test)
    if found is None:
        found = [k for k, (name, m) in enumerate(zip(walk.names, modules)) if test(name, m)]
        if walk.stamp is not None:
            walk.picked[test] = found
    return [modules[k] for k in found]


def buffers(model: nn.Module) -> list[Tensor]:
    """``list(model.buffers())``, kept while the model's structure holds (see the module
    docstring: a buffer registered, replaced or deleted writes its module's ``_buffers``
    dict, whose version tag the stamp holds). The list is shared: do not change it.

    Examples:
        >>> net = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
        >>> [tuple(b.shape) for b in buffers(net)]
        [(2,), (2,), ()]
    """
    walk = _walk(model)[0]
    if walk.buffers is None:
        walk.buffers = list(model.buffers())
    return walk.buffers


def named_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``list(model.named_parameters())``, kept while the model's structure holds (see
    the module docstring). The list is shared: do not change it."""
    walk = _walk(model)[0]
    if walk.parameters is None:
        walk.parameters = list(model.named_parameters())
    return walk.parameters
