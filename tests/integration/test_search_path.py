"""A hostile ``search_path`` decides nothing in what pglock sends (DESIGN.md section 3).

Every function, aggregate, operator, type, relation and collation that pglock's statements
name is shadowed, the list derived from the statements themselves (tests/_shadows.py): a
same-signature object in a schema put before ``pg_catalog``, a better-matching one in a schema
searched after it. Each shadow bumps a sequence (rollbacks and swallowed exceptions do not
undo it) and answers wrongly. Then every public API runs with that ``search_path`` on the
caller's connections and on pglock's own, in both placements: set for a LOGIN role (``ALTER
ROLE ... SET``) with ``pg_catalog`` listed after the hostile schema, and in the DSN's
``options`` with ``pg_catalog`` searched first. The counter must stay where it was and every
answer must be what ``pg_locks`` and the lease tables show to an observer on a plain session.
"""

from __future__ import annotations

import io
import json
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import redirect_stdout
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from _pgdb import throwaway_database, with_params
from _shadows import Shadows, catalog, create, statement_texts, unqualified
from _threads import started
from _truth import held, holders
from psycopg import ClientCursor, sql
from psycopg.pq import TransactionStatus
from psycopg_pool import ConnectionPool

import pglock
import pglock.sqlalchemy
from pglock import _lease, _registry, _schema, cli

FIRST, AFTER = "sp_first", "sp_after"
#: placement -> the hostile search_path. "first": a role may list pg_catalog after its own
#: schema; "after": pg_catalog, unlisted, is searched first, and only better matches win.
PATHS = {"first": f"{FIRST}, pg_catalog, {AFTER}", "after": AFTER}
X, S = "ExclusiveLock", "ShareLock"

pytestmark = pytest.mark.timeout(120)


@dataclass
class Hostile:
    db: str
    role: str
    shadows: Shadows

    def dsn(self, placement: str, app_name: str, db: str | None = None) -> str:
        """Sessions of ``placement``: the role's setting, or the DSN's options."""
        if placement == "first":
            return with_params(db or self.db, user=self.role, application_name=app_name)
        return with_params(
            db or self.db, options=f"-c search_path={PATHS['after']}", application_name=app_name
        )


def _create_shadows(dsn: str, role: str) -> Shadows:
    with psycopg.connect(dsn, autocommit=True) as admin:
        shadows = create(admin, FIRST, AFTER)
        dbname = admin.info.dbname
        admin.execute(
            sql.SQL("ALTER ROLE {} IN DATABASE {} SET search_path = {}").format(
                sql.Identifier(role), sql.Identifier(dbname), sql.SQL(PATHS["first"])
            )
        )
    return shadows


@pytest.fixture(scope="module")
def hostile(pg_dsn: str) -> Iterator[Hostile]:
    """A database of the module's own, pglock installed, the shadows, and a LOGIN role whose
    search_path lists pg_catalog after them."""
    role = f"pglock_sp_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(pg_dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE ROLE {} LOGIN SUPERUSER").format(sql.Identifier(role)))
    try:
        with throwaway_database(pg_dsn, prefix="pglock_sp", install=True) as db:
            try:
                yield Hostile(db, role, _create_shadows(db, role))
            finally:
                _lease.shutdown()
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as admin:
            admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


@pytest.fixture
def observer(hostile: Hostile) -> Iterator[psycopg.Connection[Any]]:
    """A plain session (default search_path) that reads what the database says."""
    with psycopg.connect(hostile.db, autocommit=True, application_name="pglock-sp-observer") as c:
        yield c


class Counter:
    """The shadows' hit counter: ``clean(section)`` fails if any shadow ran since the last."""

    def __init__(self, shadows: Shadows, observer: psycopg.Connection[Any]) -> None:
        self.shadows, self.observer = shadows, observer
        self.seen = shadows.hits(observer)[0]

    def clean(self, section: str) -> None:
        count, last = self.shadows.hits(self.observer)
        ran, self.seen = count - self.seen, count
        assert ran == 0, f"{section}: {ran} call(s) of shadows on the search_path, last: {last}"


@pytest.fixture
def hostile_connect(
    hostile: Hostile, app_name: str
) -> Iterator[Callable[..., psycopg.Connection[Any]]]:
    """``connect(placement, autocommit=True)``: a caller's connection with the hostile path."""
    opened: list[psycopg.Connection[Any]] = []

    def connect(placement: str, autocommit: bool = True, **kw: Any) -> psycopg.Connection[Any]:
        conn = psycopg.connect(hostile.dsn(placement, app_name), autocommit=autocommit, **kw)
        opened.append(conn)
        return conn

    yield connect
    for conn in opened:
        conn.close()
    _lease.shutdown()


def signed(prefix: str, *, negative: bool) -> str:
    """A name starting with ``prefix`` whose key has that sign: negative keys take other paths
    (a literal -5 is a constant, -5::bigint a minus operator applied to a cast)."""
    return next(
        n for i in range(100) if (pglock.key(n := f"{prefix}{i}") < 0) == negative
    )


def wait_until(predicate: Callable[[], Any], what: str, timeout: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.01)
    return value


def waiting(observer: psycopg.Connection[Any], pid: int) -> bool:
    return bool(observer.execute(
        "SELECT 1 FROM pg_locks WHERE pid = %s AND NOT granted AND locktype = 'advisory'", (pid,)
    ).fetchone())


def lease_row(observer: psycopg.Connection[Any], name: str) -> tuple[Any, ...] | None:
    return observer.execute(
        "SELECT holder, token, expires_at FROM pglock.lease"
        " WHERE name = %s AND expires_at > clock_timestamp()",
        (name,),
    ).fetchone()


def depends_on_shadows(conn: psycopg.Connection[Any]) -> list[tuple[str, str]]:
    """Objects outside the hostile schemas that depend on one inside them (a column of a
    shadow type or collation, a default calling a shadow function, a check with a shadow
    operator, a function whose signature has a shadow type...)."""
    rows = conn.execute(
        "SELECT pg_describe_object(d.classid, d.objid, d.objsubid),"
        " pg_describe_object(d.refclassid, d.refobjid, d.refobjsubid)"
        " FROM pg_depend d,"
        " LATERAL pg_identify_object(d.refclassid, d.refobjid, d.refobjsubid) r,"
        " LATERAL pg_identify_object(d.classid, d.objid, d.objsubid) o"
        " WHERE r.schema = ANY(%(s)s) AND coalesce(o.schema, '') <> ALL(%(s)s)"
        " AND NOT EXISTS (SELECT FROM pg_rewrite w JOIN pg_class c ON c.oid = w.ev_class"
        "  WHERE d.classid = 'pg_rewrite'::regclass AND w.oid = d.objid"
        "  AND c.relnamespace::regnamespace::text = ANY(%(s)s))",  # the shadow views' own rules
        {"s": [FIRST, AFTER]},
    ).fetchall()
    return [(a, b) for a, b in rows]


# --- the hostile schemas are what they claim ------------------------------------------------------


def test_every_name_the_statements_use_is_shadowed(hostile: Hostile) -> None:
    used, shadowed = hostile.shadows.used, hostile.shadows.shadowed
    for kind, names in used.items():
        assert names <= shadowed[kind], (kind, sorted(names - shadowed[kind]))
    # The derivation itself: names today's statements use, in each class (a tokenizer that
    # found nothing would shadow nothing and prove nothing).
    assert {"unnest", "count", "bool_and", "array_agg", "current_setting", "set_config",
            "pg_try_advisory_lock", "clock_timestamp", "txid_current"} <= used["function"]
    assert {"=", "<>", "||", "<<", "|", "*", ">", "-"} <= used["operator"]
    assert {"text", "jsonb", "float8", "timestamptz", "regclass", "int8"} <= used["type"]
    assert {"pg_locks", "pg_class", "pg_stat_activity"} <= used["relation"]
    assert used["collation"] == {"C"}
    assert hostile.shadows.variants > 100


def test_the_statements_leave_no_name_to_the_search_path(observer: psycopg.Connection[Any]) -> None:
    """The same texts, read statically: this covers statements the run below does not send
    (a pooler declared to pool sessions, a server before 13, a race's clean-up). The
    revisions' DDL (pglock/sql, pglock/migrations/versions) runs under a pinned search_path
    instead (test_install_under_a_hostile_search_path); the demo's workload plays an
    application."""
    cat = catalog(observer)
    runtime = [
        (where, text) for where, text in statement_texts()
        if not where.startswith(("pglock/sql/", "pglock/migrations/versions/", "pglock/_demo.py"))
    ]
    assert len(runtime) > 50
    assert [(w, u) for w, text in runtime if (u := unqualified(text, cat))] == []
    # The checker finds what it looks for.
    assert unqualified(
        "SELECT count(*) FROM unnest(x) k JOIN pg_locks l ON l.pid = k"
        " WHERE k::text IN ('a') AND NULLIF(k, 1) IS NULL", cat
    ) == ["function count", "function unnest", "operator =", "operator in 'IN ('",
          "operator in 'NULLIF'", "type text", "relation pg_locks"]
    assert unqualified(
        "SELECT pg_catalog.count(*) FROM pg_catalog.unnest(x) k JOIN pg_catalog.pg_locks l"
        " ON l.pid OPERATOR(pg_catalog.=) k WHERE k::pg_catalog.text::bigint::bit(64)"
        " OPERATOR(pg_catalog.=) ANY ('{a}'); SET LOCAL lock_timeout = 0", cat
    ) == []


@pytest.mark.parametrize("placement", PATHS)
def test_the_shadows_take_over_unqualified_names(
    placement: str, hostile: Hostile, hostile_connect: Callable[..., Any],
    observer: psycopg.Connection[Any],
) -> None:
    """The negative control: statements as pglock wrote them before (unqualified) run shadows
    in both placements, and the sessions really have the hostile path."""
    conn = hostile_connect(placement)
    assert conn.execute("SHOW search_path").fetchone() == (PATHS[placement],)
    for stmt in [
        "SELECT k, pg_catalog.pg_try_advisory_lock(k) FROM unnest($1::bigint[]) AS k",
        "SELECT (extract(epoch FROM pg_catalog.transaction_timestamp()) * 1000000)::int8",
    ]:
        before = hostile.shadows.hits(observer)[0]
        rows = conn.execute(stmt.replace("$1", "%s"), ([1, 2],) if "$1" in stmt else ())
        rows.fetchall()
        assert hostile.shadows.hits(observer)[0] > before, (placement, stmt)
    assert held(observer, conn.info.backend_pid) == []  # the shadow said granted, took nothing


# --- every public API -----------------------------------------------------------------------------


@pytest.mark.parametrize("placement", PATHS)
def test_every_api_under_a_hostile_search_path(
    placement: str, hostile: Hostile, hostile_connect: Callable[..., Any],
    observer: psycopg.Connection[Any], app_name: str,
) -> None:
    """Session and transaction locks (one key and several; timeout 0, > 0 and None; autocommit,
    idle in a transaction of psycopg's, inside the caller's transaction, client-side binding;
    free, contended and waited for), pool_lock and the reset hooks, Locker, rwlock, singleton,
    leader, leases (acquire, extend, guard, info, list, a queued wait and its handoff, an
    expired lease taken over, keepalive renewals), semaphores (a wait, renewals), inspection
    and ``pglock status``."""
    counter = Counter(hostile.shadows, observer)
    dsn = hostile.dsn(placement, app_name)
    name = f"sp.{placement}.{uuid.uuid4().hex[:8]}"
    busy = signed(f"{name}:busy", negative=True)
    # Another session holds `busy`: the contended paths (timeouts, waits) run too.
    with psycopg.connect(hostile.db, autocommit=True, application_name="pglock-sp-other") as other:
        other.execute("SELECT pg_advisory_lock(%s)", (pglock.key(busy),))
        try:
            _session_locks(hostile_connect, placement, observer, other, name, busy)
            counter.clean("pg_lock")
            _transaction_locks(hostile_connect, placement, observer, name, busy)
            counter.clean("xact_lock / try_xact_lock")
        finally:
            other.execute("SELECT pg_advisory_unlock_all()")
    with ConnectionPool(
        dsn, min_size=1, max_size=2, reset=pglock.reset_connection, open=True
    ) as pool:
        _pools(pool, observer, name)
        counter.clean("pool_lock, reset_connection, Locker, rwlock, singleton")
        _sqlalchemy(dsn, observer, name)
        counter.clean("SQLAlchemy pool_lock and checkin hook")
        _leader(dsn, hostile_connect(placement, autocommit=False), observer, name)
        counter.clean("leader")
        _leases(dsn, pool, hostile_connect(placement, autocommit=False), observer, name, counter)
        counter.clean("lease waits, handoffs, takeovers and renewals")
    _semaphores(dsn, observer, name)
    counter.clean("semaphores")
    _inspection(dsn, hostile_connect, placement, name)
    counter.clean("advisory_locks, semaphores(), pglock status")


def _session_locks(
    connect: Callable[..., Any], placement: str, observer: psycopg.Connection[Any],
    other: psycopg.Connection[Any], name: str, busy: str,
) -> None:
    k = pglock.key
    a, b, c = (signed(f"{name}:{x}", negative=x != "b") for x in "abc")
    # Client-side binding sends pglock's statements through its own cursor, parameters inline.
    for autocommit, kw in ((True, {}), (False, {}), (True, {"cursor_factory": ClientCursor})):
        conn = connect(placement, autocommit=autocommit, **kw)
        pid = conn.info.backend_pid
        for timeout in (0, 0.5, None):
            for shared in (False, True):
                for names in ([a], [b, c]):
                    want = sorted((k(n), S if shared else X) for n in names)
                    target = names[0] if len(names) == 1 else names
                    with pglock.pg_lock(conn, target, timeout=timeout, shared=shared):
                        assert held(observer, pid) == want
                    assert held(observer, pid) == []
                    assert conn.info.transaction_status == TransactionStatus.IDLE
                    with conn.transaction(), pglock.pg_lock(conn, target, timeout=timeout,
                                                            shared=shared):
                        assert held(observer, pid) == want
                    assert held(observer, pid) == []
        for timeout in (0, 0.05):
            for target in (busy, [f"{name}:free", busy]):
                assert pglock.pg_lock(conn, target, timeout=timeout).acquire() is False
                with conn.transaction():
                    assert pglock.pg_lock(conn, target, timeout=timeout).acquire() is False
                assert held(observer, pid) == []
        # A wait without a timeout, granted when the other session lets go.
        lock = pglock.pg_lock(conn, busy)
        join = started(lock.acquire)
        wait_until(partial(waiting, observer, pid), "the waiter in pg_locks")
        other.execute("SELECT pg_advisory_unlock_all()")
        assert join() is True
        assert held(observer, pid) == [(k(busy), X)]
        lock.release()
        assert held(observer, pid) == []
        other.execute("SELECT pg_advisory_lock(%s)", (k(busy),))


def _transaction_locks(
    connect: Callable[..., Any], placement: str, observer: psycopg.Connection[Any], name: str,
    busy: str,
) -> None:
    k = pglock.key
    for autocommit in (True, False):
        conn = connect(placement, autocommit=autocommit)
        pid = conn.info.backend_pid
        with conn.transaction():
            pglock.xact_lock(conn, f"{name}:x")
            pglock.xact_lock(conn, [f"{name}:y", f"{name}:z"], timeout=0.5, shared=True)
            assert pglock.try_xact_lock(conn, f"{name}:t") is True
            assert pglock.try_xact_lock(conn, busy) is False
            assert pglock.try_xact_lock(conn, [f"{name}:u", busy]) is False
            for target in (busy, [f"{name}:v", busy]):
                with pytest.raises(pglock.LockNotAcquired):
                    pglock.xact_lock(conn, target, timeout=0.05)
            assert held(observer, pid) == sorted([
                (k(f"{name}:x"), X), (k(f"{name}:y"), S), (k(f"{name}:z"), S),
                (k(f"{name}:t"), X),
            ])
        assert held(observer, pid) == []


def _pools(pool: ConnectionPool[Any], observer: psycopg.Connection[Any], name: str) -> None:
    k = pglock.key
    for timeout in (0, 0.5, None):
        with pglock.pool_lock(pool, f"{name}:p", timeout=timeout) as c:
            assert held(observer, c.info.backend_pid) == [(k(f"{name}:p"), X)]
    with pglock.pool_lock(pool, [f"{name}:p", f"{name}:q"], shared=True) as c:
        assert held(observer, c.info.backend_pid) == sorted(
            [(k(f"{name}:p"), S), (k(f"{name}:q"), S)]
        )
    # A lock left on a pooled connection: the reset hook gives it back.
    with pool.connection() as c:
        pid = c.info.backend_pid
        assert pglock.pg_lock(c, f"{name}:left").acquire() is True
    wait_until(lambda: held(observer, pid) == [], "the reset hook's release")
    locker = pglock.Locker(pool, namespace=name)
    with locker.lock("job") as c:
        assert held(observer, c.info.backend_pid) == [(k(f"{name}:job"), X)]
    rw = pglock.rwlock(pool, f"{name}:rw")
    for hold, mode in ((rw.read(), S), (rw.write(), X)):
        with hold as c:
            assert (k(f"{name}:rw"), mode) in held(observer, c.info.backend_pid)

    @pglock.singleton(pool, f"{name}:once")
    def once() -> list[tuple[int, str]]:
        return holders(observer, f"{name}:once")

    assert len(once() or []) == 1


def _sqlalchemy(dsn: str, observer: psycopg.Connection[Any], name: str) -> None:
    k = pglock.key
    # use_native_hstore=False: SQLAlchemy's own hstore lookup names types and operators
    # unqualified (not pglock's statements: it would bump the counter all the same).
    engine = sa.create_engine(
        "postgresql+psycopg://", creator=lambda: psycopg.connect(dsn), pool_size=1,
        use_native_hstore=False,
    )
    try:
        pglock.sqlalchemy.release_on_checkin(engine)
        with pglock.pool_lock(engine, f"{name}:e") as c:
            assert held(observer, _pid(c)) == [(k(f"{name}:e"), X)]
        with engine.connect() as c:
            pid = _pid(c)
            assert pglock.pg_lock(c, f"{name}:left").acquire() is True
        wait_until(lambda: held(observer, pid) == [], "the checkin hook's release")
    finally:
        engine.dispose()


def _pid(conn: sa.Connection) -> int:
    raw = conn.connection.driver_connection
    assert isinstance(raw, psycopg.Connection)
    return raw.info.backend_pid


def _leader(
    dsn: str, conn: psycopg.Connection[Any], observer: psycopg.Connection[Any], name: str
) -> None:
    lead = f"{name}:lead"
    with pglock.leader(dsn, lead, check_interval=0.1, takeover_delay=0) as election:
        assert election.wait_elected(10)
        ((pid, _),) = holders(observer, lead)
        with conn.transaction():
            assert election.guard(conn) == election.term
        # The leader's own check of its session (pg_locks, every check_interval) has run.
        wait_until(lambda: observer.execute(
            "SELECT 1 FROM pg_stat_activity WHERE pid = %s AND query LIKE '%%pg_locks%%'", (pid,)
        ).fetchone(), "the leader's session check")
        assert election.is_leader
    wait_until(lambda: holders(observer, lead) == [], "the resigned leader's unlock")


def _leases(
    dsn: str, pool: ConnectionPool[Any], conn: psycopg.Connection[Any],
    observer: psycopg.Connection[Any], name: str, counter: Counter,
) -> None:
    n = f"{name}:lease"
    a = pglock.lease(dsn, n, ttl=5, timeout=0, metadata={"by": "a"})
    assert a.acquire()
    row = lease_row(observer, n)
    assert row is not None and row[:2] == (a.holder, a.token)
    a.extend(ttl=6)
    with conn.transaction():
        a.guard(conn)
    info = pglock.lease_info(conn, n)
    assert info is not None and (info.holder, info.token, info.metadata) == (
        a.holder, a.token, {"by": "a"}
    )
    assert [i.name for i in pglock.list_leases(conn, prefix=name)] == [n]
    assert pglock.lease(pool, n, ttl=5, timeout=0).acquire() is False
    counter.clean("lease acquire, extend, guard, lease_info, list_leases")
    # A queued waiter, handed the lease by the release.
    b = pglock.lease(dsn, n, ttl=5)
    join = started(lambda: b.acquire(timeout=10))
    wait_until(lambda: observer.execute(
        "SELECT 1 FROM pglock.lease_waiter WHERE name = %s", (n,)).fetchone(), "the queued waiter")
    a.release()
    assert join() is True
    row = lease_row(observer, n)
    assert row is not None and row[:2] == (b.holder, b.token)
    assert a.token is not None and b.token is not None and b.token > a.token
    b.release()
    assert lease_row(observer, n) is None
    # An expired lease taken over, and keepalive renewals.
    old = pglock.lease(pool, f"{n}:old", ttl=0.3, keepalive=False)
    assert old.acquire(timeout=0)
    wait_until(lambda: lease_row(observer, f"{n}:old") is None, "the expiry")
    with pglock.lease(dsn, f"{n}:old", ttl=0.6, timeout=0) as new:
        assert old.token is not None and new.token is not None and new.token > old.token
        first = lease_row(observer, f"{n}:old")
        assert first is not None

        def renewed() -> bool:
            row = lease_row(observer, f"{n}:old")
            return row is not None and row[2] > first[2]

        wait_until(renewed, "a keepalive renewal")
        with pytest.raises(pglock.LockLost):
            old.extend()
    assert lease_row(observer, f"{n}:old") is None


def _semaphores(dsn: str, observer: psycopg.Connection[Any], name: str) -> None:
    n = f"{name}:sem"

    def permits() -> list[tuple[Any, ...]]:
        return observer.execute(
            "SELECT holder, expires_at, (SELECT waiters FROM pglock.semaphore WHERE name = %s)"
            " FROM pglock.semaphore_permit WHERE semaphore = %s AND expires_at > clock_timestamp()",
            (n, n),
        ).fetchall()

    first = pglock.semaphore(dsn, n, limit=1, ttl=0.9)
    second = pglock.semaphore(dsn, n, limit=1)
    with first.hold() as permit:
        (row,) = permits()
        assert row[0] == permit.holder
        assert second.acquire(timeout=0) is False
        wait_until(lambda: (rows := permits()) and rows[0][1] > row[1], "a keepalive renewal")

        def wait() -> tuple[bool, list[tuple[Any, ...]]]:
            granted = second.acquire(timeout=10)
            seen = permits()
            second.release()
            return granted, seen

        join = started(wait)
        wait_until(lambda: (rows := permits()) and rows[0][2], "the waiter's mark")
    granted, seen = join()
    assert granted is True and len(seen) == 1 and seen[0][0] != permit.holder
    assert permits() == []


def _inspection(
    dsn: str, connect: Callable[..., Any], placement: str, name: str
) -> None:
    conn, holder = connect(placement), connect(placement)
    lock_name, lease_name, sem_name = f"{name}:seen", f"{name}:seen-lease", f"{name}:seen-sem"
    # The run met more new names than the registry's rate in the last second: a fresh budget
    # registers this one with its lock statement, not in a batch later.
    _registry.clear()
    with (
        pglock.pg_lock(holder, lock_name),
        pglock.lease(dsn, lease_name, ttl=30, keepalive=False),
        pglock.semaphore(dsn, sem_name, limit=2),
    ):
        (lock,) = pglock.advisory_locks(conn, lock_name)
        assert (lock.name, lock.key, lock.pid, lock.granted, lock.mode) == (
            lock_name, pglock.key(lock_name), holder.info.backend_pid, True, "exclusive"
        )
        assert any(x.name == lock_name for x in pglock.advisory_locks(conn))
        (sem,) = pglock.semaphores(conn, sem_name)
        assert (sem.name, sem.limit, sem.held) == (sem_name, 2, 1)
        out = _cli("status", "--dsn", dsn, "--json")
        doc = json.loads(out)
        assert [lk["name"] for lk in doc["advisory_locks"]] == [lock_name]
        assert lease_name in {ls["name"] for ls in doc["leases"]}
        assert sem_name in {s["name"] for s in doc["semaphores"]}
        assert lock_name in _cli("status", "--dsn", dsn, lock_name)


def _cli(*args: str) -> str:
    buf = io.StringIO()
    with redirect_stdout(buf):
        assert cli.main(list(args)) == 0
    return buf.getvalue()


# --- the install ----------------------------------------------------------------------------------


def test_install_under_a_hostile_search_path(
    hostile: Hostile, hostile_connect: Callable[..., Any], observer: psycopg.Connection[Any],
    app_name: str, pg_dsn: str,
) -> None:
    """pglock.install() into a new schema (on a caller's connection and from a DSN), the
    revisions under Alembic, ``pglock install`` into a new database, in both placements:
    nothing installed depends on a shadow (column and parameter types, defaults, checks,
    collations, signatures), no shadow ran, and the caller's search_path is the same after.
    (8f1836e's install failed this with pg_catalog listed after the shadows; with pg_catalog
    searched first its DDL found no better match, which the second placement keeps so.)"""
    counter = Counter(hostile.shadows, observer)
    installed = []
    for placement in PATHS:
        suffix = f"{placement}_{uuid.uuid4().hex[:6]}"
        conn = hostile_connect(placement, autocommit=False)
        assert pglock.install(conn, schema=f"sp_conn_{suffix}")
        assert conn.execute("SHOW search_path").fetchone() == (PATHS[placement],)
        conn.rollback()
        assert pglock.install(hostile.dsn(placement, app_name), schema=f"sp_dsn_{suffix}")
        counter.clean(f"install() ({placement})")
        _alembic(hostile, placement, app_name, f"sp_alembic_{suffix}", observer)
        counter.clean(f"Alembic upgrade and downgrade ({placement})")
        installed += [(placement, f"sp_conn_{suffix}"), (placement, f"sp_dsn_{suffix}")]
    assert depends_on_shadows(observer) == []
    for placement, schema in installed:
        with pglock.lease(hostile.dsn(placement, app_name), "works", schema=schema, ttl=5,
                          timeout=0) as lease:
            assert lease.token > 0
    counter.clean("leases in the new schemas")
    with throwaway_database(pg_dsn, prefix="pglock_sp_install") as db:
        shadows = _create_shadows(db, hostile.role)
        with psycopg.connect(db, autocommit=True) as plain:
            seen = shadows.hits(plain)[0]
            for placement in PATHS:
                dsn = hostile.dsn(placement, app_name, db=db)
                _cli("install", "--dsn", dsn, "--schema", f"pglock_{placement}")
                assert _schema.installed_revisions(plain, f"pglock_{placement}") == [
                    r.revision for r in _schema.revisions()
                ]
            assert shadows.hits(plain)[0] == seen
            assert depends_on_shadows(plain) == []


def _alembic(
    hostile: Hostile, placement: str, app_name: str, schema: str,
    observer: psycopg.Connection[Any],
) -> None:
    """pglock's revisions through Alembic on a hostile session, each direction in one
    transaction: the statement after them still sees the caller's search_path."""
    from alembic.config import Config
    from alembic.operations import Operations
    from alembic.runtime.environment import EnvironmentContext
    from alembic.script import ScriptDirectory

    from pglock.migrations import VERSIONS_DIR

    cfg = Config()
    cfg.set_main_option("script_location", str(Path(pglock.__file__).parents[1] / "alembic"))
    cfg.set_main_option("path_separator", "os")
    cfg.set_main_option("version_locations", VERSIONS_DIR)
    cfg.attributes["pglock_schema"] = schema
    dsn = hostile.dsn(placement, app_name)
    engine = sa.create_engine(
        "postgresql+psycopg://", creator=lambda: psycopg.connect(dsn), poolclass=sa.NullPool,
        use_native_hstore=False,
    )
    revisions = _schema.revisions()
    try:
        for direction in ("upgrade", "downgrade"):
            with (
                engine.begin() as conn,
                EnvironmentContext(cfg, ScriptDirectory.from_config(cfg)) as env,
            ):
                env.configure(connection=conn)
                with Operations.context(env.get_context()):
                    for rev in revisions if direction == "upgrade" else reversed(revisions):
                        getattr(rev.module, direction)()
                    assert conn.exec_driver_sql("SHOW search_path").scalar() == PATHS[placement]
            if direction == "upgrade":
                assert _schema.installed_revisions(observer, schema) == [
                    r.revision for r in revisions
                ]
                assert depends_on_shadows(observer) == []
        # The downgrade found every object it drops (by signature, under the pinned path).
        assert observer.execute(
            "SELECT count(*) FROM pg_namespace WHERE nspname = %s", (schema,)
        ).fetchone() == (0,)
    finally:
        engine.dispose()
