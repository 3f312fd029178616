"""A griffe extension for the API reference: ``:raises TypeError, ValueError: text`` in a
docstring (one field for several exceptions, a shorthand pglock's docstrings use) becomes one
``:raises X: text`` field per exception, which griffe's Sphinx-style parser understands."""

from __future__ import annotations

import re
from typing import Any

import griffe

_FIELD = re.compile(
    r"^(?P<indent>\s*):raises\s+(?P<types>[\w.]+(?:\s*,\s*[\w.]+)+)\s*:(?P<text>.*)$"
)


class SplitRaises(griffe.Extension):
    """Split multi-exception ``:raises`` fields before the docstrings are parsed."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        docstring = obj.docstring
        if docstring is None or ":raises" not in docstring.value:
            return
        out: list[str] = []
        for line in docstring.value.splitlines():
            m = _FIELD.match(line)
            if m is None:
                out.append(line)
                continue
            for name in re.split(r"\s*,\s*", m["types"]):
                out.append(f"{m['indent']}:raises {name}:{m['text']}")
        docstring.value = "\n".join(out)
