"""Every ```python block in README.md and docs/ runs, one test per block (id: file:line).

Each block runs in a fresh namespace with ``DSN`` (and its alias ``dsn``) set to a libpq DSN of a
throwaway database that has the pglock schema installed, created for this module and dropped
after it. Sessions the examples open carry this test's ``application_name`` (through
``PGAPPNAME``), so the harness's leak check sees any advisory lock an example leaves behind;
each test also checks that no session is left inside a transaction, and a connection the
example forgot to close fails it through psycopg's ResourceWarning.

The blocks of docs/django.md run with Django configured (tests/_djangodb.py) and its "default"
database on that throwaway database, with the other settings of the ``DATABASES`` of the
nearest block above that defines one (its NAME, HOST, ... replaced); Django's connections, pool
and the request signals' receivers are put back after each block.

Blocks that must not run use another fence (```bash, ```text, ```sql, ...). A python block may
opt out only with ``<!-- no-run: reason -->`` on the line just before its fence; the reason is
shown in the test report (the block is collected and skipped, never silently dropped).
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest
from _pgdb import throwaway_database

ROOT = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`\s]*)[^`]*$")
NO_RUN = re.compile(r"^\s*<!--\s*no-run:\s*(?P<reason>.+?)\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    code: str
    no_run: str | None

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT).as_posix()}:{self.line}"


def markdown_files() -> list[Path]:
    files = [ROOT / "README.md"] if (ROOT / "README.md").exists() else []
    docs = ROOT / "docs"
    if docs.is_dir():
        files += sorted(docs.rglob("*.md"))
    return files


def python_blocks(path: Path) -> list[Block]:
    """The ```python / ```py blocks of one Markdown file (fences of any length, ` or ~)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, info, start = m["fence"], m["info"].lower(), i
        body: list[str] = []
        i += 1
        while i < len(lines) and not (
            lines[i].strip().startswith(fence[0] * len(fence))
            and set(lines[i].strip()) == {fence[0]}
        ):
            body.append(lines[i])
            i += 1
        i += 1  # the closing fence
        if info not in ("python", "py", "python3"):
            continue
        prev = start - 1
        while prev >= 0 and not lines[prev].strip():
            prev -= 1
        opt_out = NO_RUN.match(lines[prev]) if prev >= 0 else None
        indent = len(m["indent"])
        code = "\n".join(line[indent:] if line[:indent].isspace() else line for line in body)
        blocks.append(Block(path, start + 1, code, opt_out["reason"] if opt_out else None))
    return blocks


BLOCKS = [b for f in markdown_files() for b in python_blocks(f)]


def test_examples_were_found() -> None:
    """A collector that finds nothing would make every doc example pass."""
    assert len(BLOCKS) >= 10, [b.id for b in BLOCKS]


@pytest.fixture(scope="module")
def docs_dsn(pg_dsn: str) -> Iterator[str]:
    """A throwaway database with the pglock schema installed, for the examples."""
    with throwaway_database(pg_dsn, prefix="pglock_docs", install=True) as dsn:
        yield dsn


def _busy_sessions(dsn: str, app_name: str) -> list[tuple[int, str]]:
    """Sessions of this test that are inside a transaction or running a statement."""
    with psycopg.connect(dsn, autocommit=True, application_name="pglock-checker") as c:
        return c.execute(
            "SELECT pid, state FROM pg_stat_activity"
            " WHERE application_name = %s AND state <> 'idle'",
            (app_name,),
        ).fetchall()


def _close_background_connections() -> None:
    """pglock keeps per-process connections for leases (per DSN string, and the NOTIFY
    listener); close them so that one example's sessions do not outlive it."""
    from pglock import _lease

    _lease.shutdown()


def _django_settings(block: Block) -> dict[str, Any]:
    """The ``DATABASES["default"]`` of the nearest block above ``block`` that defines one."""
    for above in reversed([b for b in python_blocks(block.path) if b.line < block.line]):
        if "DATABASES = " in above.code:
            namespace: dict[str, Any] = {}
            exec(compile(above.code, above.id, "exec"), namespace)
            return dict(namespace["DATABASES"]["default"])
    return {}


@contextlib.contextmanager
def _django(block: Block, dsn: str) -> Iterator[None]:
    """For a block of docs/django.md: Django's "default" on ``dsn`` (see the module doc)."""
    if block.path.name != "django.md":
        yield
        return
    import _djangodb
    from django.core.signals import request_finished, request_started

    given = _django_settings(block)
    overrides = {k: v for k, v in given.items() if k not in _djangodb.OWN_KEYS.values()}
    overrides.pop("ENGINE", None)
    saved = {s: list(s.receivers) for s in (request_started, request_finished)}
    try:
        with _djangodb.database(dsn, **overrides):
            yield
    finally:
        for signal, receivers in saved.items():
            signal.receivers = receivers
            signal.sender_receivers_cache.clear()


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_example_runs(
    block: Block, docs_dsn: str, app_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if block.no_run is not None:
        pytest.skip(f"no-run: {block.no_run}")
    monkeypatch.setenv("PGAPPNAME", app_name)
    namespace = {"__name__": "__docs_example__", "DSN": docs_dsn, "dsn": docs_dsn}
    try:
        with _django(block, docs_dsn):
            exec(compile(block.code, block.id, "exec"), namespace)
    finally:
        # Drop the example's references: a connection it did not close is garbage-collected
        # now, and psycopg's ResourceWarning fails the test (filterwarnings = error).
        namespace.clear()
        _close_background_connections()
    # No session of the example may be left inside a transaction or a statement (a closed
    # connection leaves the server's view a moment later: poll, bounded).
    deadline = time.monotonic() + 5
    busy = _busy_sessions(docs_dsn, app_name)
    while busy and time.monotonic() < deadline:
        time.sleep(0.05)
        busy = _busy_sessions(docs_dsn, app_name)
    assert not busy, f"the example left sessions busy (pid, state): {busy}"
