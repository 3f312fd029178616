"""Run a call in another thread and get back what it returned or raised (bounded).

Importable from every test module as ``_threads``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


def started(fn: Callable[[], Any], timeout: float = 30) -> Callable[[], Any]:
    """Start ``fn`` in another thread now; the returned function joins it (``timeout`` s at
    most, a hang guard) and returns its result, or the exception it raised."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as exc:
            out.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()

    def join() -> Any:
        t.join(timeout)
        assert not t.is_alive() and len(out) == 1, f"{fn!r} was still running {timeout} s later"
        return out[0]

    return join


def in_thread(fn: Callable[[], object], timeout: float = 20) -> object:
    """Run ``fn`` in another thread; its result, or the exception it raised."""
    result: object = started(fn, timeout)()
    return result
