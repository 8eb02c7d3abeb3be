"""The command line's help in plain text: the docstrings it shows are reStructuredText
(``code``, :func:`roles`), which ``--help`` prints as a reader would write them."""

from __future__ import annotations

import argparse
import re

_ROLE = re.compile(r":[a-z]+(?::[a-z]+)?:`(~?)([^`<]*?)\s*(?:<([^>]*)>)?`")


def plain(text: str) -> str:
    """``text`` without reStructuredText markup: ````code```` as ``code``, a role as its
    target (``~`` keeps the last name; an explicit title is kept).

    Examples:
        >>> plain("``persample dp-finetune``: see :class:`~persample.dp.PrivateStep`.")
        'persample dp-finetune: see PrivateStep.'
        >>> plain(":func:`persample.cli.data.docstring_batch` and :mod:`the data <x.y>`")
        'persample.cli.data.docstring_batch and the data'
    """
    def role(m: re.Match) -> str:
        short, target, _ = m.groups()
        return target.rsplit(".", 1)[-1] if short else target

    return _ROLE.sub(role, text).replace("``", "")


class PlainHelp(argparse.HelpFormatter):
    """argparse's formatter, with the description and every option's help in plain
    text (:func:`plain`)."""

    def _format_text(self, text: str) -> str:
        return super()._format_text(plain(text))

    def _expand_help(self, action: argparse.Action) -> str:
        return plain(super()._expand_help(action))
