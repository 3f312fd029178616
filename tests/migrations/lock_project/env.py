"""env.py of the throwaway project: runs the env.py snippet of docs/alembic.md verbatim.

With PGLOCK_TEST_NO_MIGRATION_LOCK=1 the snippet's migration_lock is replaced by a no-op (the
negative control: without it, concurrent upgrades collide). With PGLOCK_TEST_BARRIER=<dir>:<n>
the process waits until n processes got here (a file each in dir), so that they all start
migrating at once however long their imports took.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
import uuid
from pathlib import Path
from typing import Any

import pglock.alembic

DOC = Path(__file__).resolve().parents[3] / "docs" / "alembic.md"
SNIPPET = re.compile(r'^```python title="env\.py"\n(.*?)^```$', re.S | re.M)

if os.environ.get("PGLOCK_TEST_NO_MIGRATION_LOCK") == "1":

    def _no_lock(*args: Any, **kwargs: Any) -> contextlib.nullcontext[None]:
        return contextlib.nullcontext()

    pglock.alembic.migration_lock = _no_lock  # type: ignore[assignment]

_barrier = os.environ.get("PGLOCK_TEST_BARRIER")
if _barrier:
    _dir, _n = _barrier.rsplit(":", 1)
    Path(_dir, uuid.uuid4().hex).touch()
    _deadline = time.monotonic() + 60
    while len(os.listdir(_dir)) < int(_n) and time.monotonic() < _deadline:
        time.sleep(0.01)

_match = SNIPPET.search(DOC.read_text(encoding="utf-8"))
assert _match, f"no env.py snippet in {DOC}"
exec(compile(_match.group(1), f"{DOC}#env.py", "exec"))
