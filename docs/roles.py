"""A griffe extension for the documentation site: the docstrings' Sphinx roles
(``:func:`persample.influence```) shown as code (``persample.influence``), as a reader
of the rendered page sees them in a terminal's ``help()``."""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:func|class|mod|meth|data|attr|exc|obj):`(~?)([^`]+)`")


def _plain(match: re.Match) -> str:
    short, target = match.group(1), match.group(2)
    return f"`{target.rsplit('.', 1)[-1] if short else target}`"


class SphinxRoles(griffe.Extension):
    """Rewrite each object's docstring as it is loaded."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = ROLE.sub(_plain, obj.docstring.value)
