"""The connection set-up table of docs/guarantees.md: ``prepare_threshold`` is "followed for
single statements"."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

import pglock

pytestmark = pytest.mark.timeout(30)


def test_prepare_threshold_none_gets_no_named_statement(installed: str, connect: Any) -> None:
    """With prepare_threshold=None (what psycopg documents for PgBouncer < 1.21 and other
    proxies that do not keep prepared statements) the lease statements are sent unnamed, but the
    lock and unlock statements of pg_lock are still prepared once per connection and executed
    by name (_advisory._lock_statement / _session_unlock pass state.prepared regardless)."""
    c = connect(prepare_threshold=None)
    name = f"review:{uuid.uuid4()}"
    with pglock.pg_lock(c, name):  # first use: probe + registry batch, then the unlock
        pass
    with pglock.pg_lock(c, name):  # the one-statement path
        pass
    prepared = c.execute("SELECT name, statement FROM pg_prepared_statements").fetchall()
    assert prepared == [], prepared
