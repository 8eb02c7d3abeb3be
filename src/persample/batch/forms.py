"""Every name under which the capture's ``TorchFunctionMode`` may see one op.

``x * w`` reaches the mode as ``torch.Tensor.__mul__``, ``w * x`` as ``__rmul__``,
``x *= w`` as ``__imul__``, ``torch.mul(x, w)`` as ``torch.mul``, ``x.mul_(w)`` as
``torch.Tensor.mul_`` and ``torch.multiply(x, w)`` as ``torch.multiply``. A rule (or a
data-flow handler) is written for one op; :func:`forms` finds the others from one, so
that none is listed by hand and none is forgotten:

- the function of the same name in torch's namespaces (``torch``, ``torch.Tensor``,
  ``torch.nn.functional``, ``torch._C._nn``, ``torch.special``, ``torch.linalg``), its
  in-place method (``mul_``) and, for a Python operator, its operator methods
  (``__mul__``, ``__rmul__``, ``__imul__``; ``__truediv__`` for ``true_divide``);
- torch's documented synonyms ("Alias for :func:`torch.mul`": ``torch.multiply``) and
  theirs, in the same spellings.

A function of the same name in another namespace is kept only where it takes the same
leading positional arguments (``torch.batch_norm(input, weight, bias, ...)`` is not a
form of ``F.batch_norm(input, running_mean, running_var, ...)``, nor
``torch.embedding(weight, indices)`` one of ``F.embedding(input, weight)``). The
operator methods ``__r*__`` take their operands in the other order: a rule for a binary
op reads them by name (``call.func.__name__``).
"""

from __future__ import annotations

import functools
import inspect
import operator
import re
from typing import Any

import torch
import torch.nn.functional as F

SPACES = (torch, torch.Tensor, F, torch._C._nn, torch.special, torch.linalg)
"""Where torch defines its ops (the functional ones, the methods, the C bindings)."""

# Python's operator protocol under torch's name where the two differ (``a / b``)
_OPERATOR_NAMES = {"true_divide": "truediv"}


def forms(func: Any) -> tuple[Any, ...]:
    """``func`` and every other name of the same op (see the module docstring), ``func``
    first, each once.

    Args:
        func: a function as the mode sees it (``torch.mul``, ``F.linear``,
            ``torch.Tensor.expand``).

    Returns:
        A tuple of functions, ``func`` first.

    Raises:
        Nothing: a function without other names gives ``(func,)``.

    Examples:
        >>> import torch
        >>> names = [f.__name__ for f in forms(torch.sub)]
        >>> {"sub", "subtract", "sub_", "__sub__", "__rsub__", "__isub__"} <= set(names)
        True
        >>> import torch.nn.functional as F
        >>> torch.batch_norm in forms(F.batch_norm)  # other arguments, other op
        False
    """
    found = [func]
    base, mine = _base(func), _arguments(func)
    for name in _names(base):
        for f in _spellings(name):  # a documented synonym is the same op: no check
            if f not in found and (name != base or _same_arguments(mine, _arguments(f))):
                found.append(f)
    return tuple(found)


def _base(func: Any) -> str:
    """The op's name without in-place or operator decoration: ``__rmul__`` -> ``mul``."""
    name = getattr(func, "__name__", "")
    if name.startswith("__") and name.endswith("__"):
        inner = name[2:-2]
        if inner[:1] in ("r", "i") and hasattr(operator, inner[1:]):
            inner = inner[1:]
        return {v: k for k, v in _OPERATOR_NAMES.items()}.get(inner, inner)
    return name[:-1] if name.endswith("_") and not name.endswith("__") else name


def _names(base: str) -> list[str]:
    """``base``, what it is a synonym of, and every synonym of those."""
    synonyms = _synonyms()
    roots = {base, synonyms.get(base, base)}
    return sorted(roots | {name for name, root in synonyms.items() if root in roots})


@functools.cache
def _synonyms() -> dict[str, str]:
    """``{name: the op it is documented as an alias of}`` over torch and torch.Tensor."""
    found = {}
    pattern = re.compile(r"Alias (?:for|of) :(?:func|meth):`(?:torch\.)?(?:Tensor\.)?(\w+)`")
    for space in (torch, torch.Tensor, torch.linalg):
        # (a module's own entries only: getattr would import torch's lazy submodules)
        members = vars(space) if inspect.ismodule(space) else {n: getattr(space, n)
                                                                for n in dir(space)}
        for name, value in members.items():
            doc = getattr(value, "__doc__", None)
            if isinstance(doc, str) and "Alias" in doc:
                match = pattern.search(doc)
                if match and match.group(1) != name:
                    found[name] = match.group(1)
    return found


def _spellings(name: str) -> list[Any]:
    """The functions named after ``name``: in each namespace, in place, as an operator."""
    names = [name, f"{name}_"]
    symbol = _OPERATOR_NAMES.get(name, name)
    if hasattr(operator, symbol):
        names += [f"__{symbol}__", f"__r{symbol}__", f"__i{symbol}__"]
    found = []
    for space in SPACES:
        for attr in names:
            if attr.endswith("_") and not attr.endswith("__") and space is not torch.Tensor:
                continue  # in-place forms are methods
            f = getattr(space, attr, None)
            if f is not None and callable(f) and not isinstance(f, type):
                found.append(f)
    return found


def _arguments(func: Any) -> list[list[str]] | None:
    """The leading positional argument names of ``func``'s signatures (``self`` read as
    ``input``), or ``None`` where they cannot be read."""
    try:
        params = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):
        return _schema_arguments(_base(func))
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [[_plain(p.name) for p in params if p.kind in kinds]]


@functools.cache
def _schema_arguments(name: str) -> list[list[str]] | None:
    """The positional argument names of the ATen op ``name``'s overloads."""
    try:
        schemas = torch._C._jit_get_schemas_for_operator(f"aten::{name}")
    except RuntimeError:
        return None
    if not schemas:
        return None
    return [[_plain(a.name) for a in s.arguments if not a.kwarg_only] for s in schemas]


def _plain(name: str) -> str:
    return "input" if name == "self" else name


def _same_arguments(a: list[list[str]] | None, b: list[list[str]] | None) -> bool:
    """Do two ops take the same two leading positional arguments (where both are known)?"""
    if a is None or b is None:
        return True
    return any(x[:2] == y[:2] for x in a for y in b)
