"""The name -> key contract computed independently in SQL, and the key pglock really locks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import psycopg
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pglock

Connect = Callable[..., psycopg.Connection[Any]]

# The same contract, written in SQL from the definition (not from pglock's code).
SQL_KEY = (
    "SELECT ('x' || substr(encode(sha256(convert_to(%s::text, 'UTF8')), 'hex'), 1, 16))"
    "::bit(64)::bigint"
)

NAMES = [
    "account:1",
    "a",
    " ",
    "\u00e9",
    "e\u0301",
    "\U0001f512 lock",
    "\u540d\u524d:\u30ed\u30c3\u30af",
    "a" * 1024,
    "job:" + "z" * 500,
    "\u00e9" * 512,
]

valid_names = st.text(
    alphabet=st.characters(exclude_categories=["Cs"], exclude_characters="\x00"),
    min_size=1,
    max_size=80,
)


def sql_key(conn: psycopg.Connection[Any], name: str) -> int:
    row = conn.execute(SQL_KEY, (name,)).fetchone()
    assert row is not None
    return int(row[0])


def test_golden_names_match_sql(conn: psycopg.Connection[Any]) -> None:
    for name in NAMES:
        assert pglock.key(name) == sql_key(conn, name), name
    assert sql_key(conn, "\u00e9") != sql_key(conn, "e\u0301")


def test_generated_names_match_sql(conn: psycopg.Connection[Any]) -> None:
    @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(valid_names)
    def check(name: str) -> None:
        assert pglock.key(name) == sql_key(conn, name)

    check()


def test_pg_locks_shows_the_documented_key(connect: Connect) -> None:
    c, obs = connect(), connect()
    for name in NAMES:
        with pglock.pg_lock(c, name):
            rows = obs.execute(
                "SELECT (classid::bigint << 32) | objid::bigint FROM pg_locks "
                "WHERE locktype = 'advisory' AND objsubid = 1 AND pid = %s",
                (c.info.backend_pid,),
            ).fetchall()
            assert rows == [(sql_key(obs, name),)]
            # And a raw pg_advisory_lock on that key from another session conflicts.
            assert obs.execute(
                "SELECT pg_try_advisory_lock(%s)", (pglock.key(name),)
            ).fetchone() == (False,)
