"""The lease and semaphore statements pglock sends, counted by kind: a test double over
``pglock._conn.fetch``, through which pglock sends every statement.

The kind is the pglock function a statement calls (``acquire``, ``extend_many``,
``semaphore_acquire``, ... and ``list`` for ``leases()``), ``listen``/``semaphore_listen`` for
a LISTEN, ``ping`` for a liveness check and ``retry_read_committed`` for the BEGIN of a
statement sent again at READ COMMITTED. Importable from every test module as ``_sent``.
"""

from __future__ import annotations

import re
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

from pglock import _conn

#: A call of a function in a (quoted) schema: ``"pglock".extend_many(``.
_CALL = re.compile(r'"\.(\w+?)(?:_v\d+)?\(')


def kind_of(query: object) -> str | None:
    """The kind of one statement pglock sends (None: not a lease or semaphore statement)."""
    if isinstance(query, bytes):
        text = query.decode()
    elif isinstance(query, str):
        text = query
    else:
        text = query.as_string(None)  # type: ignore[attr-defined]
    text = text.strip()
    if not text:
        return "ping"
    if text.upper().startswith("LISTEN"):
        return "semaphore_listen" if text.endswith('_semaphore"') else "listen"
    m = _CALL.search(text)
    if m is not None:
        return "list" if m.group(1) == "leases" else m.group(1)
    return "retry_read_committed" if text.upper().startswith("BEGIN") else None


class Statements(Counter[str]):
    """Statements sent by kind while installed; ``total()`` is all of them."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()

    def add(self, kind: str) -> None:
        with self._lock:
            self[kind] += 1


def install(setattr_: Callable[[Any, str, Any], None] = setattr) -> Statements:
    """Count from now on (``setattr_`` is pytest's ``monkeypatch.setattr`` in a test, to
    undo it afterwards; the default counts for the rest of the process)."""
    counted = Statements()
    fetch = _conn.fetch

    def counting(conn: Any, query: Any, *args: Any, **kwargs: Any) -> Any:
        kind = kind_of(query)
        if kind is not None:
            counted.add(kind)
        return fetch(conn, query, *args, **kwargs)

    setattr_(_conn, "fetch", counting)
    return counted
