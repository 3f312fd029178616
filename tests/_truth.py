"""Postgres truth for the tests: what pg_locks says is held, whatever pglock believes."""

from __future__ import annotations

from typing import Any

import psycopg

import pglock


def held(observer: psycopg.Connection[Any], pid: int) -> list[tuple[int, str]]:
    """(key, mode) of the advisory locks granted to backend ``pid``, as pg_locks shows them."""
    rows = observer.execute(
        "SELECT (classid::bigint << 32) | objid::bigint, mode FROM pg_locks "
        "WHERE locktype = 'advisory' AND objsubid = 1 AND granted AND pid = %s ORDER BY 1, 2",
        (pid,),
    ).fetchall()
    return [(k, m) for k, m in rows]


def holders(observer: psycopg.Connection[Any], name: str) -> list[tuple[int, str]]:
    """(pid, mode) of every session holding ``name``."""
    rows = observer.execute(
        "SELECT pid, mode FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 1 "
        "AND granted AND (classid::bigint << 32) | objid::bigint = %s ORDER BY 1",
        (pglock.key(name),),
    ).fetchall()
    return [(p, m) for p, m in rows]


def holder_pids(observer: psycopg.Connection[Any], name: str) -> list[int]:
    """The backend pids holding ``name`` (any mode)."""
    return [pid for pid, _ in holders(observer, name)]
