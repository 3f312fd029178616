"""Every SQL statement pglock sends, composed with :mod:`psycopg.sql`.

Advisory-lock statements embed their keys as literals (they are Python ints computed by
pglock, never user text), so several statements can travel in one simple-query round trip:
``SAVEPOINT ...; SET LOCAL lock_timeout ...; SELECT pg_advisory_lock(...)``.
"""

from __future__ import annotations

from collections.abc import Sequence

from psycopg import sql

SAVEPOINT_NAME = sql.Identifier("_pglock_acquire")

# (transaction-level, shared, try) -> Postgres function
_LOCK_FUNCS = {
    (False, False, False): "pg_advisory_lock",
    (False, True, False): "pg_advisory_lock_shared",
    (False, False, True): "pg_try_advisory_lock",
    (False, True, True): "pg_try_advisory_lock_shared",
    (True, False, False): "pg_advisory_xact_lock",
    (True, True, False): "pg_advisory_xact_lock_shared",
    (True, False, True): "pg_try_advisory_xact_lock",
    (True, True, True): "pg_try_advisory_xact_lock_shared",
}

# Single-key statements as fixed, parameterized text: psycopg caches their conversion and
# prepares them after a few executions, so the common uncontended cycle costs exactly what the
# raw statements cost. (transaction-level, shared, try) -> query
LOCK_ONE = {
    flags: f"SELECT pg_catalog.{func}(%s)"
    for flags, func in _LOCK_FUNCS.items()
}
UNLOCK_ONE = {
    False: "SELECT pg_catalog.pg_advisory_unlock(%s)",
    True: "SELECT pg_catalog.pg_advisory_unlock_shared(%s)",
}

PROBE = sql.SQL("SELECT pg_catalog.pg_is_in_recovery(), pg_catalog.pg_backend_pid()")

# Identifies the current transaction (its start time): transaction locks taken in it by one
# thread must not be handed to another thread sharing the connection.
TRANSACTION_START = sql.SQL("SELECT pg_catalog.transaction_timestamp()")


def _keys_array(keys: Sequence[int]) -> sql.Composable:
    return sql.SQL("ARRAY[{}]::bigint[]").format(sql.SQL(", ").join(map(sql.Literal, keys)))


def lock(keys: Sequence[int], *, shared: bool, xact: bool, try_: bool) -> sql.Composed:
    """One statement taking ``keys`` in order. Try-locks return ``(key, granted)`` rows."""
    func = sql.Identifier("pg_catalog", _LOCK_FUNCS[(xact, shared, try_)])
    if try_:
        return sql.SQL(
            "SELECT k, {}(k) FROM unnest({}) WITH ORDINALITY AS t(k, i) ORDER BY i"
        ).format(func, _keys_array(keys))
    if len(keys) == 1:
        return sql.SQL("SELECT {}({})").format(func, sql.Literal(keys[0]))
    # unnest() yields the sorted array in order, and the function runs once per row in scan
    # order, so keys are taken one after another in key order within one statement.
    return sql.SQL("SELECT {}(k) FROM unnest({}) AS k").format(func, _keys_array(keys))


def unlock(keys: Sequence[int], *, shared: bool) -> sql.Composed:
    """Release session locks; returns one row: were all of them held?"""
    func = sql.Identifier(
        "pg_catalog", "pg_advisory_unlock_shared" if shared else "pg_advisory_unlock"
    )
    if len(keys) == 1:
        return sql.SQL("SELECT {}({})").format(func, sql.Literal(keys[0]))
    return sql.SQL("SELECT bool_and({}(k)) FROM unnest({}) AS k").format(func, _keys_array(keys))


def set_local_timeouts(timeout_ms: int) -> sql.Composed:
    """Bound the next statement's lock waits (and the statement itself, for several keys)."""
    value = sql.Literal(f"{timeout_ms}ms")
    return sql.SQL("SET LOCAL lock_timeout = {}; SET LOCAL statement_timeout = {}").format(
        value, value
    )


def savepoint() -> sql.Composed:
    return sql.SQL("SAVEPOINT {}").format(SAVEPOINT_NAME)


def rollback_to_savepoint() -> sql.Composed:
    return sql.SQL("ROLLBACK TO SAVEPOINT {0}; RELEASE SAVEPOINT {0}").format(SAVEPOINT_NAME)


def release_savepoint() -> sql.Composed:
    return sql.SQL("RELEASE SAVEPOINT {}").format(SAVEPOINT_NAME)


def current_timeouts() -> sql.Composed:
    return sql.SQL(
        "SELECT current_setting('lock_timeout'), current_setting('statement_timeout')"
    ).format()


def restore_timeouts(lock_timeout: str, statement_timeout: str) -> sql.Composed:
    return sql.SQL(
        "SELECT set_config('lock_timeout', {}, true), set_config('statement_timeout', {}, true)"
    ).format(sql.Literal(lock_timeout), sql.Literal(statement_timeout))


def held_advisory(keys: Sequence[int], *, shared: bool) -> sql.Composed:
    """The subset of ``keys`` this session holds in pg_locks in the given mode."""
    return sql.SQL(
        "SELECT k FROM unnest({keys}) AS k WHERE EXISTS ("
        " SELECT 1 FROM pg_catalog.pg_locks l"
        " WHERE l.locktype = 'advisory' AND l.pid = pg_catalog.pg_backend_pid()"
        " AND l.granted AND l.objsubid = 1 AND l.mode = {mode}"
        " AND l.database = (SELECT oid FROM pg_catalog.pg_database"
        "                   WHERE datname = pg_catalog.current_database())"
        " AND ((l.classid::bigint << 32) | l.objid::bigint) = k)"
    ).format(keys=_keys_array(keys), mode=sql.Literal("ShareLock" if shared else "ExclusiveLock"))


def unlock_if_held(keys: Sequence[int], *, shared: bool) -> sql.Composed:
    """Undo a session lock that Postgres granted although the attempt failed (timeout race,
    cancel, partial multi-key acquisition). Unlocks only keys that pg_locks shows as held."""
    func = sql.Identifier(
        "pg_catalog", "pg_advisory_unlock_shared" if shared else "pg_advisory_unlock"
    )
    return sql.SQL("WITH held AS MATERIALIZED ({}) SELECT k, {}(k) FROM held").format(
        held_advisory(keys, shared=shared), func
    )


UNLOCK_ALL = sql.SQL("SELECT pg_catalog.pg_advisory_unlock_all()")

# The pool reset hook: one round trip that reports which advisory locks the session still holds
# (as "key" or "key shared"; two-int4 keys as "classid,objid") and then drops them all. The
# aggregate subquery is not flattened, so it reads pg_locks completely before the outer
# select list calls pg_advisory_unlock_all().
UNLOCK_ALL_REPORTING = sql.SQL(
    "SELECT s.held, pg_catalog.pg_advisory_unlock_all() FROM ("
    " SELECT array_agg(CASE WHEN l.objsubid = 1"
    "   THEN ((l.classid::bigint << 32) | l.objid::bigint)::text"
    "   ELSE l.classid::text || ',' || l.objid::text END"
    "   || CASE WHEN l.mode = 'ShareLock' THEN ' shared' ELSE '' END"
    "   ORDER BY l.classid, l.objid) AS held"
    " FROM pg_catalog.pg_locks l"
    " WHERE l.locktype = 'advisory' AND l.pid = pg_catalog.pg_backend_pid() AND l.granted"
    ") s"
)
