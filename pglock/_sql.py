"""Every SQL statement pglock sends from Python, each under its own name.

Fixed text with ``%s`` parameters where no identifier varies (psycopg caches and prepares it);
:mod:`psycopg.sql` composition where the schema varies, and for batches of statements, which
travel as one simple query with their values as literals. The PL/pgSQL is in ``pglock/sql/``.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

from psycopg import sql

from ._contract import DEFAULT_SCHEMA, NAMES_MARKER, NAMES_TABLE, SCHEMA_OPEN

SAVEPOINT_NAME = sql.Identifier("_pglock_acquire")

#: A transaction of pglock's own on a caller's connection: its isolation whatever the session's.
OWN_BEGIN = sql.SQL("BEGIN ISOLATION LEVEL READ COMMITTED, READ WRITE")

_SHIELD = b"SET LOCAL statement_timeout = 0; SET LOCAL lock_timeout = 0; " \
    b"SET LOCAL exit_on_error = off; "


def shielded(stmt: bytes, in_transaction: bool) -> bytes:
    """``stmt`` (one statement without parameters) where the session's own statement_timeout,
    lock_timeout and exit_on_error can neither cut it nor end the session: in a transaction of
    pglock's own, or under pglock's savepoint in the caller's, rolled back to afterwards (a
    session lock or unlock survives that)."""
    if in_transaction:
        return (b'SAVEPOINT "_pglock_acquire"; ' + _SHIELD + stmt
                + b'; ROLLBACK TO SAVEPOINT "_pglock_acquire"; RELEASE SAVEPOINT "_pglock_acquire"')
    return OWN_BEGIN.as_bytes(None) + b"; " + _SHIELD + stmt + b"; COMMIT"

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

_UNLOCK_FUNCS = {False: "pg_advisory_unlock", True: "pg_advisory_unlock_shared"}

#: The open transaction's identity for pglock's transaction-lock records: its start in
#: microseconds since 1970 (a bigint reads the same in text and binary, whatever DateStyle).
_TX_START = (
    "(extract(epoch FROM pg_catalog.transaction_timestamp()) OPERATOR(pg_catalog.*) 1000000)"
    "::bigint"
)

# Fixed text with ``$1`` placeholders, sent by pglock._conn.call straight through libpq (the key
# in binary): the uncontended cycle costs what raw SQL costs.
LOCK_ONE = {
    flags: f"SELECT pg_catalog.{func}($1)".encode() for flags, func in _LOCK_FUNCS.items()
}
UNLOCK_ONE = {
    shared: f"SELECT pg_catalog.{func}($1)".encode() for shared, func in _UNLOCK_FUNCS.items()
}
# The same for several keys (sorted by the caller), as one array parameter: unnest() yields them
# in order and the function runs once per row in scan order. Session-level only.
# (shared, try) -> query; try-locks return (key, granted) rows.
LOCK_MANY = {
    (shared, try_): (  # func is one of the fixed names above, never input
        f"SELECT k, pg_catalog.{func}(k) FROM pg_catalog.unnest($1::bigint[])"  # noqa: S608
        " WITH ORDINALITY AS t(k, i) ORDER BY i"
        if try_
        else f"SELECT pg_catalog.{func}(k) FROM pg_catalog.unnest($1::bigint[]) AS k"  # noqa: S608
    ).encode()
    for (xact, shared, try_), func in _LOCK_FUNCS.items()
    if not xact
}
UNLOCK_MANY = {
    shared: (
        f"SELECT pg_catalog.bool_and(pg_catalog.{func}(k))"  # noqa: S608
        " FROM pg_catalog.unnest($1::bigint[]) AS k"
    ).encode()
    for shared, func in _UNLOCK_FUNCS.items()
}


def _names_schema(schema: str, privilege: str) -> sql.Composed:
    """``schema`` when the current role may use its name registry this way, else NULL: only a table
    pglock can trust (docs/guarantees.md, "The name registry is pglock's own"). One catalog lookup:
    ``to_regclass`` would raise without USAGE, ``obj_description()`` costs four times as much."""
    return sql.SQL(
        "(SELECT n.nspname::pg_catalog.text FROM pg_catalog.pg_namespace n"
        " JOIN pg_catalog.pg_class c ON c.relnamespace OPERATOR(pg_catalog.=) n.oid"
        " JOIN pg_catalog.pg_roles o ON o.oid OPERATOR(pg_catalog.=) c.relowner"
        " JOIN pg_catalog.pg_roles u ON u.rolname OPERATOR(pg_catalog.=) CURRENT_USER"
        " WHERE n.nspname OPERATOR(pg_catalog.=) {schema}"
        " AND c.relname OPERATOR(pg_catalog.=) {table} AND c.relkind OPERATOR(pg_catalog.=) 'r'"
        " AND c.relowner OPERATOR(pg_catalog.=) n.nspowner"
        " AND NOT (c.relhastriggers OR c.relhasrules OR c.relrowsecurity)"
        " AND (o.oid OPERATOR(pg_catalog.=) u.oid OR o.rolsuper"
        "  OR o.oid OPERATOR(pg_catalog.=) (SELECT d.datdba FROM pg_catalog.pg_database d"
        "   WHERE d.datname OPERATOR(pg_catalog.=) pg_catalog.current_database())"
        "  OR (NOT u.rolsuper AND pg_catalog.pg_has_role(o.oid, 'USAGE')))"
        " AND pg_catalog.starts_with((SELECT d.description FROM pg_catalog.pg_description d"
        "  WHERE d.objoid OPERATOR(pg_catalog.=) c.oid"
        "  AND d.classoid OPERATOR(pg_catalog.=) 'pg_catalog.pg_class'::pg_catalog.regclass"
        "  AND d.objsubid OPERATOR(pg_catalog.=) 0), {marker})"
        " AND pg_catalog.has_schema_privilege(n.oid, 'USAGE')"
        " AND pg_catalog.has_table_privilege(c.oid, {privilege}))"
    ).format(
        schema=sql.Literal(schema),
        table=sql.Literal(NAMES_TABLE),
        marker=sql.Literal(NAMES_MARKER),
        privilege=sql.Literal(privilege),
    )


# Transaction-level lock on one key and the transaction's start (which tells the caller's
# transactions apart), in a savepoint that keeps the caller's transaction usable on failure.
# Pre-rendered: composing it with psycopg.sql on every call cost more CPU than the round trip.
_XACT_ONE = {
    (shared, try_): (
        'SAVEPOINT "_pglock_acquire"; '
        f"SELECT {_TX_START}, pg_catalog.{func}(%d); "
        'RELEASE SAVEPOINT "_pglock_acquire"'
    )
    for (xact, shared, try_), func in _LOCK_FUNCS.items()
    if xact
}


def xact_one(key: int, *, shared: bool, try_: bool) -> bytes:  # for pglock._conn.call
    """See ``_XACT_ONE``; ``key`` goes in as a Python int, never as text from outside."""
    return (_XACT_ONE[(shared, try_)] % int(key)).encode()


#: Does the session bound statements or lock waits of its own (``statement_timeout`` or
#: ``lock_timeout`` not 0, from ``ALTER ROLE ... SET``, the DSN's options or a ``SET``), or end
#: itself at any error (``exit_on_error``: a cancel by close() or a deadlock would end it, with
#: every lock)? Then a wait meant to last until acquired overrides them for pglock's statement
#: (see _advisory).
SESSION_TIMEOUTS = (
    "SELECT pg_catalog.current_setting('lock_timeout') OPERATOR(pg_catalog.<>) '0'"
    " OR pg_catalog.current_setting('statement_timeout') OPERATOR(pg_catalog.<>) '0'"
    " OR pg_catalog.current_setting('exit_on_error') OPERATOR(pg_catalog.=) 'on'"
)

# Once per connection. The lock APIs take no schema: they register names in the default schema's.
PROBE = sql.SQL(
    "SELECT pg_catalog.pg_is_in_recovery(), pg_catalog.pg_backend_pid(), {}, ({})"
).format(_names_schema(DEFAULT_SCHEMA, "INSERT"), sql.SQL(SESSION_TIMEOUTS[len("SELECT ") :]))


def names_readable(schema: str) -> sql.Composed:
    """One row: ``schema`` if its name registry may be read (see ``_names_schema``), else NULL."""
    return sql.SQL("SELECT {}").format(_names_schema(schema, "SELECT"))

# Never fails and never waits more than 1 ms: a concurrent uncommitted registration of the same
# key makes ON CONFLICT wait for that transaction, so lock_timeout is lowered for the INSERT
# and restored afterwards (SET LOCAL inside a block that succeeds would outlive it). Names
# travel hex-encoded, so no user text is ever inside the dollar-quoted body.
_REGISTER = (
    "DO $pglock$DECLARE lt pg_catalog.text := pg_catalog.current_setting('lock_timeout');"
    " ee pg_catalog.text := pg_catalog.current_setting('exit_on_error'); BEGIN"
    " IF pg_catalog.current_setting('transaction_isolation') OPERATOR(pg_catalog.<>) 'serializable'"
    " THEN"
    " PERFORM pg_catalog.set_config('exit_on_error', 'off', true);"  # the error below is caught
    " BEGIN"
    " SET LOCAL lock_timeout = '1ms';"
    " INSERT INTO {table} (key, name) VALUES {values} ON CONFLICT (key) DO NOTHING;"
    "{asynchronous}"
    " EXCEPTION WHEN OTHERS THEN NULL;"
    " END;"
    " PERFORM pg_catalog.set_config('lock_timeout', lt, true);"
    " PERFORM pg_catalog.set_config('exit_on_error', ee, true);"
    " END IF;"
    " END$pglock$"
)


def register_names(
    schema: str, pairs: Sequence[tuple[int, str]], *, asynchronous: bool
) -> sql.Composed:
    """Record ``(key, name)`` pairs in the name registry; never raises, returns no rows.
    ``asynchronous`` (only in pglock's own transaction) turns ``synchronous_commit`` off: a
    registration lost in a server crash is sent again by the next process."""
    values = sql.SQL(", ").join(
        sql.SQL("({}, pg_catalog.convert_from(pg_catalog.decode({}, 'hex'), 'UTF8'))").format(
            sql.Literal(k), sql.Literal(n.encode("utf-8").hex())
        )
        for k, n in pairs
    )
    off = " PERFORM pg_catalog.set_config('synchronous_commit', 'off', true);"
    return sql.SQL(_REGISTER).format(
        table=sql.Identifier(schema, NAMES_TABLE),
        values=values,
        asynchronous=sql.SQL(off if asynchronous else ""),
    )

# Identifies the current transaction (its start time): transaction locks taken in it by one
# thread must not be handed to another thread sharing the connection.
TRANSACTION_START = sql.SQL(f"SELECT {_TX_START}")


def held_in_transaction(keys: Sequence[int]) -> sql.Composed:
    """The current transaction's start, and which of ``keys`` this session holds (any mode), in a
    savepoint of pglock's own: did another thread's record of a transaction lock outlive it (a
    rolled-back savepoint releases the locks taken inside)?"""
    return sql.SQL(
        "SAVEPOINT {sp}; SELECT " + _TX_START + ", ARRAY({held}); "
        "RELEASE SAVEPOINT {sp}"
    ).format(sp=SAVEPOINT_NAME, held=_held(keys, sql.SQL("")))

# --- introspection (pglock._inspect) ---------------------------------------------------

def status_header(schema: str) -> sql.Composed:
    """``pglock status``'s header: the database, the server's clock, its version, the current
    role (quoted for a GRANT), USAGE on ``schema`` and SELECT on its name registry (each NULL
    when missing). Catalog lookups only: it works without any grant."""
    return sql.SQL(
        "SELECT pg_catalog.current_database(), pg_catalog.clock_timestamp(),"
        " pg_catalog.split_part(pg_catalog.current_setting('server_version'), ' ', 1),"
        " pg_catalog.quote_ident(CURRENT_USER),"
        " (SELECT pg_catalog.has_schema_privilege(n.oid, 'USAGE')"
        "  FROM pg_catalog.pg_namespace n WHERE n.nspname OPERATOR(pg_catalog.=) {schema}),"
        " (SELECT pg_catalog.has_table_privilege(c.oid, 'SELECT') FROM pg_catalog.pg_class c"
        "  JOIN pg_catalog.pg_namespace n ON n.oid OPERATOR(pg_catalog.=) c.relnamespace"
        "  WHERE n.nspname OPERATOR(pg_catalog.=) {schema}"
        "  AND c.relname OPERATOR(pg_catalog.=) {table})"
    ).format(schema=sql.Literal(schema), table=sql.Literal(NAMES_TABLE))


def relations_exist(schema: str, relations: Sequence[str]) -> sql.Composed:
    """One row: are all ``relations`` in ``schema``? A catalog lookup that works without USAGE
    on the schema (reading them without the grants then fails with SQLSTATE 42501)."""
    return sql.SQL(
        "SELECT pg_catalog.count(*) OPERATOR(pg_catalog.=) {} FROM pg_catalog.pg_class c"
        " JOIN pg_catalog.pg_namespace n ON n.oid OPERATOR(pg_catalog.=) c.relnamespace"
        " WHERE n.nspname OPERATOR(pg_catalog.=) {} AND c.relname OPERATOR(pg_catalog.=) ANY ({})"
    ).format(*map(sql.Literal, (len(relations), schema, list(relations))))


def semaphores(schema: str, name: str | None) -> sql.Composed:
    """Every semaphore (or one) with its live permit holders: one row per holder, or one row
    with NULL holder columns for a semaphore nobody holds."""
    where: sql.Composable = sql.SQL("")
    if name is not None:
        where = sql.SQL(" WHERE m.name OPERATOR(pg_catalog.=) {}").format(sql.Literal(name))
    return sql.SQL(
        "SELECT m.name, m.max_permits, m.waiters, p.holder, p.permits, p.acquired_at,"
        " p.expires_at, p.metadata,"
        " extract(epoch FROM p.expires_at OPERATOR(pg_catalog.-) pg_catalog.clock_timestamp())"
        "::double precision"
        " FROM {s}.semaphore m"
        " LEFT JOIN {s}.semaphore_permit p ON p.semaphore OPERATOR(pg_catalog.=) m.name"
        " AND p.expires_at OPERATOR(pg_catalog.>) pg_catalog.clock_timestamp()"
        "{where} ORDER BY m.name, p.acquired_at, p.holder"
    ).format(s=sql.Identifier(schema), where=where)


_ADVISORY_KEY = sql.SQL(
    "((l.classid::bigint OPERATOR(pg_catalog.<<) 32) OPERATOR(pg_catalog.|) l.objid::bigint)"
)


def advisory_locks(
    keys: Sequence[int] | None, *, names_schema: str | None, waitstart: bool
) -> sql.Composed:
    """Advisory locks in the current database: holders and waiters, with their sessions, named
    from ``names_schema``'s registry; ``waitstart`` reads ``pg_locks.waitstart`` (PG 14+)."""
    key_filter: sql.Composable = sql.SQL("")
    if keys is not None:
        key_filter = sql.SQL(
            " AND l.objsubid OPERATOR(pg_catalog.=) 1 AND {} OPERATOR(pg_catalog.=) ANY ({})"
        ).format(_ADVISORY_KEY, _keys_array(keys))
    name: sql.Composable = sql.SQL("NULL::pg_catalog.text")
    if names_schema is not None:
        name = sql.SQL(
            "(SELECT r.name FROM {} r"
            " WHERE l.objsubid OPERATOR(pg_catalog.=) 1 AND r.key OPERATOR(pg_catalog.=) {})"
        ).format(sql.Identifier(names_schema, NAMES_TABLE), _ADVISORY_KEY)
    since = sql.SQL("l.waitstart" if waitstart else "NULL::pg_catalog.timestamptz")
    return sql.SQL(
        "SELECT l.objsubid, l.classid::bigint, l.objid::bigint, {name} AS name,"
        " l.mode, l.granted, l.pid,"
        " a.application_name, pg_catalog.host(a.client_addr), a.client_port, a.usename,"
        " a.backend_start, a.xact_start, a.query_start, a.state_change, a.state,"
        " a.wait_event_type, a.query, {waitstart},"
        " CASE WHEN NOT l.granted THEN pg_catalog.pg_blocking_pids(l.pid) END,"
        " pg_catalog.clock_timestamp(),"
        " l.held_by_pid"
        " FROM (SELECT l.*, pg_catalog.count(*) FILTER (WHERE l.granted)"
        "       OVER (PARTITION BY l.pid) AS held_by_pid"
        "       FROM pg_catalog.pg_locks l WHERE l.locktype OPERATOR(pg_catalog.=) 'advisory') l"
        " LEFT JOIN pg_catalog.pg_stat_activity a ON a.pid OPERATOR(pg_catalog.=) l.pid"
        " WHERE l.database OPERATOR(pg_catalog.=) (SELECT d.oid FROM pg_catalog.pg_database d"
        "  WHERE d.datname OPERATOR(pg_catalog.=) pg_catalog.current_database()){key_filter}"
        " ORDER BY l.classid, l.objid, l.objsubid, l.granted DESC, l.pid"
    ).format(name=name, waitstart=since, key_filter=key_filter)


def _keys_array(keys: Sequence[int]) -> sql.Composable:
    return sql.SQL("ARRAY[{}]::bigint[]").format(sql.SQL(", ").join(map(sql.Literal, keys)))


def lock(keys: Sequence[int], *, shared: bool, xact: bool, try_: bool) -> sql.Composed:
    """One statement taking ``keys`` in order. Try-locks return ``(key, granted)`` rows."""
    func = sql.Identifier("pg_catalog", _LOCK_FUNCS[(xact, shared, try_)])
    if try_:
        return sql.SQL(
            "SELECT k, {}(k) FROM pg_catalog.unnest({}) WITH ORDINALITY AS t(k, i) ORDER BY i"
        ).format(func, _keys_array(keys))
    if len(keys) == 1:
        return sql.SQL("SELECT {}({})").format(func, sql.Literal(keys[0]))
    # In key order, one after another: see LOCK_MANY.
    return sql.SQL("SELECT {}(k) FROM pg_catalog.unnest({}) AS k").format(func, _keys_array(keys))


def unlock(keys: Sequence[int], *, shared: bool) -> sql.Composed:
    """Release session locks; returns one row: were all of them held?"""
    func = sql.Identifier("pg_catalog", _UNLOCK_FUNCS[shared])
    if len(keys) == 1:
        return sql.SQL("SELECT {}({})").format(func, sql.Literal(keys[0]))
    return sql.SQL("SELECT pg_catalog.bool_and({}(k)) FROM pg_catalog.unnest({}) AS k").format(
        func, _keys_array(keys)
    )


#: The custom setting that tags a server session behind a pooler with the pglock client using
#: it (docs/pgbouncer.md, "Sharing checks"). Session-level: PgBouncer's reset (DISCARD ALL)
#: clears it between the clients of session pooling; transaction pooling never resets it.
POOLER_MARK = "pglock.client"

# Through a pooler declared to pool sessions: one statement checks that it runs on the server
# session probed ($2, its pid) and that the session carries no other client's mark (this
# client's is $3), tags it, and only then takes the keys ($1, in order). One row: the server
# pid, the mark found, and the grants as text, 't' or 'f' per key (NULL when a check failed:
# nothing was taken). CASE fixes the order of evaluation; a CTE with a volatile function is
# evaluated once. The unlock checks the same (an empty mark is allowed: pglock's savepoint in a
# caller's transaction rolls the mark back) and returns whether every key was held, or NULL.
# (shared, try) -> query; sent by pglock._conn.call, or with literals in a batch (with_literals).
POOLED_LOCK = {
    (shared, try_): (  # func is one of the fixed names above, never input
        "WITH s AS (SELECT pg_catalog.pg_backend_pid()::bigint AS pid,"  # noqa: S608
        " coalesce(pg_catalog.current_setting('pglock.client', true), '') AS mark),"
        " c AS (SELECT pid, mark, CASE WHEN pid OPERATOR(pg_catalog.=) $2"
        " AND mark OPERATOR(pg_catalog.=) ANY (ARRAY['', $3::pg_catalog.text])"
        " THEN pg_catalog.set_config('pglock.client', $3::pg_catalog.text, false)"
        " OPERATOR(pg_catalog.=) $3::pg_catalog.text"
        " ELSE false END AS ok FROM s)"
        " SELECT c.pid, c.mark, CASE WHEN c.ok THEN (SELECT pg_catalog.string_agg("
        f"CASE WHEN pg_catalog.{func}(t.k){'' if try_ else ' IS NOT NULL'} THEN 't' ELSE 'f' END,"
        " '' ORDER BY t.i) FROM pg_catalog.unnest($1::bigint[]) WITH ORDINALITY AS t(k, i))"
        " END FROM c"
    ).encode()
    for (xact, shared, try_), func in _LOCK_FUNCS.items()
    if not xact
}
POOLED_UNLOCK = {
    shared: (
        "WITH c AS (SELECT pg_catalog.pg_backend_pid()::bigint AS pid,"  # noqa: S608
        " coalesce(pg_catalog.current_setting('pglock.client', true), '') AS mark)"
        " SELECT c.pid, c.mark, CASE WHEN c.pid OPERATOR(pg_catalog.=) $2"
        " AND c.mark OPERATOR(pg_catalog.=) ANY (ARRAY['', $3::pg_catalog.text])"
        f" THEN (SELECT pg_catalog.bool_and(pg_catalog.{func}(k))"
        " FROM pg_catalog.unnest($1::bigint[]) AS k) END FROM c"
    ).encode()
    for shared, func in _UNLOCK_FUNCS.items()
}


def with_literals(query: bytes, params: Sequence[int | Sequence[int]]) -> sql.Composed:
    """A fixed ``$n`` statement with bigint or bigint[] parameters as literals, for a batch."""
    text = query.decode()
    for n in range(len(params), 0, -1):  # $10 before $1
        text = text.replace(f"${n}", f"{{{n - 1}}}")
    return sql.SQL(text).format(
        *(sql.Literal(p) if isinstance(p, int) else _keys_array(p) for p in params)
    )


def set_local_timeouts(timeout_ms: int, *, several: bool) -> sql.Composed:
    """Bound the next statement's lock waits, and for ``several`` keys the statement itself. The
    caller's ``statement_timeout`` is always replaced: for one key by 0, since until pglock
    restores it, it would also bound pglock's own statements after the grant. A session's
    ``exit_on_error`` would end the whole session (and every lock of it) when the wait runs out:
    off meanwhile."""
    value = sql.Literal(f"{timeout_ms}ms")
    return sql.SQL(
        "SET LOCAL lock_timeout = {}; SET LOCAL statement_timeout = {}; "
        "SET LOCAL exit_on_error = off"
    ).format(value, value if several else sql.Literal("0"))


def _savepoint(query: str) -> sql.Composed:
    return sql.SQL(query).format(SAVEPOINT_NAME)


savepoint = partial(_savepoint, "SAVEPOINT {}")
rollback_to_savepoint = partial(_savepoint, "ROLLBACK TO SAVEPOINT {0}; RELEASE SAVEPOINT {0}")
release_savepoint = partial(_savepoint, "RELEASE SAVEPOINT {}")


#: The settings :func:`set_local_timeouts` changes, which a batch in the caller's transaction
#: reads first and restores after (:func:`restore_settings`).
_TIMED = ("lock_timeout", "statement_timeout", "exit_on_error")


def current_settings() -> sql.Composed:
    return sql.SQL("SELECT {}").format(sql.SQL(", ").join(
        sql.SQL("pg_catalog.current_setting({})").format(sql.Literal(n)) for n in _TIMED
    ))


def restore_settings(values: Sequence[str]) -> sql.Composed:
    return sql.SQL("SELECT {}").format(sql.SQL(", ").join(
        sql.SQL("pg_catalog.set_config({}, {}, true)").format(sql.Literal(n), sql.Literal(v))
        for n, v in zip(_TIMED, values, strict=True)
    ))


def held_advisory(keys: Sequence[int], *, shared: bool) -> sql.Composed:
    """The subset of ``keys`` this session holds in pg_locks in the given mode. By pid alone: a
    pg_database lookup would need a slot in a lock table that may be full (this runs after
    "out of shared memory", among other failures)."""
    mode = sql.Literal("ShareLock" if shared else "ExclusiveLock")
    return _held(keys, sql.SQL(" AND l.mode OPERATOR(pg_catalog.=) {}").format(mode))


def _held(keys: Sequence[int], mode: sql.Composable) -> sql.Composed:
    return sql.SQL(
        "SELECT k FROM pg_catalog.unnest({keys}) AS k WHERE EXISTS ("
        " SELECT 1 FROM pg_catalog.pg_locks l"
        " WHERE l.locktype OPERATOR(pg_catalog.=) 'advisory'"
        " AND l.pid OPERATOR(pg_catalog.=) pg_catalog.pg_backend_pid()"
        " AND l.granted AND l.objsubid OPERATOR(pg_catalog.=) 1{mode}"
        " AND {key} OPERATOR(pg_catalog.=) k)"
    ).format(keys=_keys_array(keys), mode=mode, key=_ADVISORY_KEY)


def unlock_if_held(keys: Sequence[int], *, shared: bool) -> sql.Composed:
    """Undo a session lock that Postgres granted although the attempt failed (timeout race,
    cancel, partial multi-key acquisition). Unlocks only keys that pg_locks shows as held."""
    func = sql.Identifier("pg_catalog", _UNLOCK_FUNCS[shared])
    return sql.SQL("WITH held AS MATERIALIZED ({}) SELECT k, {}(k) FROM held").format(
        held_advisory(keys, shared=shared), func
    )


# The pool reset hook, at every checkin (so fixed text): the advisory locks the session holds
# ("key", "key shared", "classid,objid"), then none. The aggregate subquery is not flattened,
# so it reads pg_locks completely before the outer select list calls pg_advisory_unlock_all().
UNLOCK_ALL_REPORTING = (
    "SELECT s.held, pg_catalog.pg_advisory_unlock_all() FROM ("
    " SELECT pg_catalog.array_agg(CASE WHEN l.objsubid OPERATOR(pg_catalog.=) 1"
    "   THEN ((l.classid::bigint OPERATOR(pg_catalog.<<) 32)"
    "    OPERATOR(pg_catalog.|) l.objid::bigint)::pg_catalog.text"
    "   ELSE l.classid::pg_catalog.text OPERATOR(pg_catalog.||) ','"
    "   OPERATOR(pg_catalog.||) l.objid::pg_catalog.text END"
    "   OPERATOR(pg_catalog.||)"
    "   CASE WHEN l.mode OPERATOR(pg_catalog.=) 'ShareLock' THEN ' shared' ELSE '' END"
    "   ORDER BY l.classid, l.objid) AS held"
    " FROM pg_catalog.pg_locks l"
    " WHERE l.locktype OPERATOR(pg_catalog.=) 'advisory'"
    " AND l.pid OPERATOR(pg_catalog.=) pg_catalog.pg_backend_pid() AND l.granted"
    ") s"
)


# --- coordination: read-write locks, leader election, singleton jobs, semaphores -----------
# Leader election keeps its session lock with pg_lock's statements above; these are its extras.


def leader_session_setup(
    keepalives_idle: int, keepalives_interval: int, keepalives_count: int, user_timeout_ms: int
) -> sql.Composed:
    """Session settings of a leader's dedicated connection: server-side TCP keepalives end a
    vanished leader's session (and lock) about when the leader notices, and the role's
    statement and idle timeouts must not cut the campaign's waits."""
    settings = (keepalives_idle, keepalives_interval, keepalives_count, user_timeout_ms)
    return sql.SQL(
        "SET tcp_keepalives_idle = {}; SET tcp_keepalives_interval = {}; "
        "SET tcp_keepalives_count = {}; SET tcp_user_timeout = {}; "
        "SET statement_timeout = 0; SET idle_in_transaction_session_timeout = 0; "
        "SET idle_session_timeout = 0"
    ).format(*map(sql.Literal, settings))


# A resigning leader gives its lock back before closing its dedicated session: the server ends
# a closed session's backend (and drops its locks) only a moment after the client has gone.
LEADER_UNLOCK = "SELECT pg_catalog.pg_advisory_unlock_all()"

LEADER_SESSION = (
    "SELECT pg_catalog.pg_backend_pid(), a.backend_start, pg_catalog.pg_is_in_recovery()"
    " FROM pg_catalog.pg_stat_activity a"
    " WHERE a.pid OPERATOR(pg_catalog.=) pg_catalog.pg_backend_pid()"
)


def new_term(server_version: int) -> sql.Composed:
    """A number larger than every term handed out before: the 64-bit id (increasing, never
    wrapping) of a transaction begun after the lock was won, committed durably, plus the WAL
    timeline << 44. An asynchronous failover can lose the last transaction ids and hand them out
    again; the promotion's new timeline puts every later term above them (docs/leader.md)."""
    current = "pg_catalog.pg_current_xact_id()::pg_catalog.text::bigint"
    xid = current if server_version >= 130000 else "pg_catalog.txid_current()"
    return sql.SQL(
        "BEGIN READ WRITE; SET LOCAL synchronous_commit = on; SELECT (('x' OPERATOR(pg_catalog.||)"
        " pg_catalog.lpad(pg_catalog.substr(pg_catalog.pg_walfile_name("
        "pg_catalog.pg_current_wal_lsn()), 1, 8), 16, '0'))::bit(64)::bigint"
        " OPERATOR(pg_catalog.<<) 44) OPERATOR(pg_catalog.+) {}; COMMIT"
    ).format(sql.SQL(xid))


def fence_wait(fence_key: int) -> sql.Composed:
    """Wait until every transaction that passed the previous leader's guard has ended."""
    return sql.SQL("BEGIN; SELECT pg_catalog.pg_advisory_xact_lock({}); COMMIT").format(
        sql.Literal(fence_key)
    )


def leader_holds(key: int, pid: int, backend_start: object) -> sql.Composed:
    """Does the session (pid, backend_start) hold the exclusive advisory lock ``key``? The start
    (NULL without pg_read_all_stats: then the pid alone counts) guards against a reused pid."""
    return sql.SQL(
        "SELECT EXISTS ("
        " SELECT 1 FROM pg_catalog.pg_locks l"
        " WHERE l.locktype OPERATOR(pg_catalog.=) 'advisory'"
        " AND l.pid OPERATOR(pg_catalog.=) {pid} AND l.granted"
        " AND l.objsubid OPERATOR(pg_catalog.=) 1"
        " AND l.mode OPERATOR(pg_catalog.=) 'ExclusiveLock'"
        " AND l.database OPERATOR(pg_catalog.=) (SELECT oid FROM pg_catalog.pg_database"
        "  WHERE datname OPERATOR(pg_catalog.=) pg_catalog.current_database())"
        " AND {lock_key} OPERATOR(pg_catalog.=) {key}"
        ") AND EXISTS ("
        " SELECT 1 FROM pg_catalog.pg_stat_activity a WHERE a.pid OPERATOR(pg_catalog.=) {pid}"
        " AND (a.backend_start IS NULL"
        "  OR a.backend_start OPERATOR(pg_catalog.=) {start}::pg_catalog.timestamptz))"
    ).format(
        pid=sql.Literal(pid), lock_key=_ADVISORY_KEY, key=sql.Literal(key),
        # As text: psycopg would add an unqualified ::timestamptz to a datetime literal.
        start=sql.Literal(None if backend_start is None else str(backend_start)),
    )


# Semaphores (pglock/sql/0002_semaphores.up.sql): each call is one simple query with literal
# values, so the acquire can run at READ COMMITTED (its row lock and reads must see the latest
# commits) whatever the session's default isolation is.


def semaphore_acquire(
    schema: str, name: str, limit: int, holder: str, permits: int, ttl: float,
    metadata_json: str | None, wait: bool,
) -> sql.Composed:
    """One row: granted, held (live permits after the call), retry_in (seconds until the
    earliest live permit expires, when refused). A grant is committed durably even where
    ``synchronous_commit`` is off (the function turns it off for a refusal)."""
    args = (name, limit, holder, permits, ttl, metadata_json, wait)
    return sql.SQL(
        "BEGIN ISOLATION LEVEL READ COMMITTED, READ WRITE; SET LOCAL synchronous_commit = on; "
        "SET LOCAL statement_timeout = 0; SET LOCAL lock_timeout = 0; "
        "SELECT granted, max_permits, held, retry_in FROM {}.semaphore_acquire({}::pg_catalog.text,"
        " {}::integer, {}::pg_catalog.text, {}::integer, {}::double precision,"
        " {}::pg_catalog.jsonb, {}::boolean); COMMIT"
    ).format(sql.Identifier(schema), *map(sql.Literal, args))


def semaphore_extend(
    schema: str, permits: Sequence[tuple[str, Sequence[str], float]]
) -> sql.Composed:
    """The holders renewed among the (name, holders, ttl) given, in one round trip. Committed
    durably: after a crash the server must not believe a permit ends sooner than its holder."""
    renew = sql.SQL(" UNION ALL ").join(
        sql.SQL(
            "SELECT holder FROM {}.semaphore_extend("
            "{}::pg_catalog.text, {}::pg_catalog.text[], {}::double precision)"
        ).format(
            sql.Identifier(schema), sql.Literal(name), sql.Literal(list(holders)), sql.Literal(ttl)
        )
        for name, holders, ttl in permits
    )
    return sql.SQL(
        "BEGIN READ WRITE; SET LOCAL synchronous_commit = on; "
        "SET LOCAL statement_timeout = 0; SET LOCAL lock_timeout = 0; {renew}; COMMIT"
    ).format(renew=renew)


def semaphore_release(schema: str, name: str, holder: str) -> sql.Composed:
    """One row: status ('released', 'expired', 'not_held'), notified. In a transaction of
    its own, READ WRITE whatever the session's default."""
    return sql.SQL(
        "BEGIN READ WRITE; SELECT status, notified"
        " FROM {s}.semaphore_release({name}::pg_catalog.text, {holder}::pg_catalog.text); COMMIT"
    ).format(s=sql.Identifier(schema), name=sql.Literal(name), holder=sql.Literal(holder))


def semaphore_info(schema: str, name: str) -> sql.Composed:
    """Zero or one row: name, max_permits, held (live permits), holders."""
    return sql.SQL(
        "SELECT name, max_permits, held, holders FROM {s}.semaphore_info({name}::pg_catalog.text)"
    ).format(s=sql.Identifier(schema), name=sql.Literal(name))


# --- leases (pglock/_lease.py) and the schema install (pglock/_schema.py) -------------------
# The lease functions are in pglock/sql/0001_leases.up.sql; each call is one statement.


#: Lease statements by kind: (function, result columns or "" for its one value, parameter
#: types, as pg_catalog names; ``%b``: sent in binary). Revision 0004's ``_v4`` functions
#: (pglock/sql/0004_*) queue waiters: acquire_v4 adds liveness seconds and returns waiter_id
#: (not NULL: queued).
LEASE_STATEMENTS = {
    # (name, holder, ttl, metadata json text, wait seconds, durable) -> one row
    "acquire": ("acquire", "granted, holder, token, acquired_at, expires_at, server_time",
                "text text float8 jsonb float8 bool"),
    "acquire_v4": ("acquire_v4", "granted, holder, token, acquired_at, expires_at, server_time, "
                   "waiter_id", "text text float8 jsonb float8 bool float8"),
    # (name, holder, token or NULL for any, ttl, durable) -> zero or one row
    "extend": ("extend", "token, acquired_at, expires_at, metadata",
               "text text int8 float8 bool"),
    # (names[], holders[], tokens[], ttls[], durable, wait seconds) -> the leases renewed (the
    # arrays in binary: text dumping would quote-scan every element of a 10,000-lease round)
    "extend_many": ("extend_many", "name, token, expires_at",
                    "text[]%b text[]%b int8[]%b float8[]%b bool float8"),
    # (name, holder, token) -> status ('released', 'expired', 'not_held'), notified; _v4: and the
    # grant it handed to the first live waiter in the same transaction
    "release": ("release", "status, notified", "text text int8"),
    "release_v4": ("release_v4", "status, notified, next_holder, next_token, next_waiter, "
                   "next_acquired_at, next_expires_at", "text text int8"),
    # (name, holder, waiter_id, liveness) -> state ('waiting', 'granted', 'gone') and its grant
    "wait_v4": ("wait_v4", "state, ahead, token, acquired_at, expires_at, server_time",
                "text text int8 float8"),
    "leave_v4": ("leave_v4", "", "text text int8"),  # -> whether the waiter row was there
    "guard": ("guard", "", "text text int8"),  # -> held; its row locked until the txn ends
    # (name) -> the live lease of that name, if any; (prefix or NULL) -> every live lease
    "info": ("info", "name, holder, token, acquired_at, expires_at, metadata, expires_in", "text"),
    "list": ("leases", "name, holder, token, acquired_at, expires_at, metadata, expires_in",
             "text"),
}


def lease_statement(kind: str, schema: str) -> sql.Composed:
    """The statement of lease ``kind`` (:data:`LEASE_STATEMENTS`) in ``schema``."""
    function, columns, types = LEASE_STATEMENTS[kind]
    casts = [("%b", t[:-2]) if t.endswith("%b") else ("%s", t) for t in types.split()]
    args = ", ".join(f"{p}::pg_catalog.{t}" for p, t in casts)
    call = sql.SQL("{}.{}(" + args + ")").format(sql.Identifier(schema), sql.SQL(function))
    if not columns:
        return sql.SQL("SELECT {}").format(call)
    return sql.SQL("SELECT {} FROM {}").format(sql.SQL(columns), call)


# A lease statement that failed with a serialization failure or a deadlock (possible under a
# stricter default isolation), that the session's own timeouts cut short, or that a read-only
# default refused, is sent again in these, and so is every statement of a session whose
# synchronous_commit is off: at READ COMMITTED it sees the latest commits, a client-side deadline
# bounds it, a grant is durable (a function turns it off where it may), and an error the
# functions catch themselves cannot end the session.
LEASE_RETRY_BEGIN = (
    "BEGIN ISOLATION LEVEL READ COMMITTED, READ WRITE;"
    " SET LOCAL statement_timeout = 0; SET LOCAL lock_timeout = 0;"
    " SET LOCAL synchronous_commit = on; SET LOCAL exit_on_error = off"
)
LEASE_RETRY_COMMIT = "COMMIT"
LEASE_RETRY_ROLLBACK = "ROLLBACK"


def schema_check(schema: str) -> sql.Composed:
    """One row: does ``schema`` exist; may the current role trust it (its owner is the role, a
    superuser, the database's owner or a role it is a member of, as for the name registry, and no
    other role may create objects in it or owns one: pglock._contract.SCHEMA_OPEN); is the
    session's ``synchronous_commit`` off (a grant would not be durable)."""
    return sql.SQL(
        "SELECT n.oid IS NOT NULL, (o.oid OPERATOR(pg_catalog.=) u.oid OR o.rolsuper"  # noqa: S608
        " OR o.oid OPERATOR(pg_catalog.=) d.datdba"
        " OR (NOT u.rolsuper AND pg_catalog.pg_has_role(o.oid, 'USAGE'))) AND NOT " + SCHEMA_OPEN
        + ", pg_catalog.current_setting('synchronous_commit') OPERATOR(pg_catalog.=) 'off'"
        " FROM pg_catalog.pg_roles u JOIN pg_catalog.pg_database d"
        " ON d.datname OPERATOR(pg_catalog.=) pg_catalog.current_database()"
        " LEFT JOIN pg_catalog.pg_namespace n ON n.nspname OPERATOR(pg_catalog.=) {schema}"
        " LEFT JOIN pg_catalog.pg_roles o ON o.oid OPERATOR(pg_catalog.=) n.nspowner"
        " WHERE u.rolname OPERATOR(pg_catalog.=) CURRENT_USER"
    ).format(schema=sql.Literal(schema))


def client_encoding(name: str) -> sql.Composed:
    """Switch the session's client_encoding (see pglock._conn.utf8)."""
    return sql.SQL("SELECT pg_catalog.set_config('client_encoding', {}, false)").format(
        sql.Literal(name)
    )


#: The isolation level of the caller's transaction (why a guard() does not see a lease).
TRANSACTION_ISOLATION = "SELECT pg_catalog.current_setting('transaction_isolation')"


def listen(channel: str) -> sql.Composed:
    """Subscribe to lease releases (release() notifies the channel named after the schema)."""
    return sql.SQL("LISTEN {}").format(sql.Identifier(channel))


#: A LISTEN connection sits idle between notifications, which carry names: the role's
#: idle_session_timeout must not end it, and its client_encoding must carry any name.
LISTENER_SETUP = b"SET idle_session_timeout = 0; SET client_encoding = 'UTF8'"


def schema_install_lock(lock_key: int) -> sql.Composed:
    """Serializes installs of one schema (the revisions take the same lock)."""
    return sql.SQL("SELECT pg_catalog.pg_advisory_xact_lock({})").format(sql.Literal(lock_key))


def schema_revision_table(schema: str) -> sql.Composed:
    """One row: the revision table's regclass, or NULL when the schema is not installed."""
    return sql.SQL("SELECT pg_catalog.to_regclass({})").format(
        sql.Literal(f"{sql.Identifier(schema).as_string(None)}.schema_revision")
    )


def schema_revisions(schema: str) -> sql.Composed:
    """The revisions recorded as installed in ``schema``."""
    return sql.SQL(
        "SELECT revision FROM {}.schema_revision ORDER BY installed_at, revision"
    ).format(sql.Identifier(schema))
