"""Run a call in another thread and get back what it returned or raised (bounded).

Importable from every test module as ``_threads``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable


def in_thread(fn: Callable[[], object], timeout: float = 20) -> object:
    """Run ``fn`` in another thread; its result, or the exception it raised."""
    out: list[object] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as exc:
            out.append(exc)

    t = threading.Thread(target=run)
    t.start()
    t.join(timeout)
    assert not t.is_alive() and len(out) == 1
    return out[0]
