"""Every lock under test behind one small interface.

An :class:`Adapter` makes :class:`Client` objects; a client is one session (one connection, one
Redis client) that takes and gives back one lock at a time, blocking until it gets it. The
workloads only ever talk to clients, so pglock, the raw floor and the peers run the same code.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
import uuid
from collections.abc import Callable
from typing import Any

import psycopg

import pglock

from ._common import Context

POLL_INTERVAL = 0.1  # the design documents' TTL table polls every 100 ms


def sha256_key(name: str) -> int:
    """The raw floor's key: same contract as pglock.key, computed without pglock."""
    return int.from_bytes(hashlib.sha256(name.encode("utf-8")).digest()[:8], "big", signed=True)


class Client:
    """One session that takes and gives back one lock at a time."""

    #: Postgres makes the waiter wait (pg_locks shows it); False for polling or Redis waits.
    waits_in_postgres = True

    def acquire(self, name: str) -> None:
        raise NotImplementedError

    def release(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass

    def conns(self) -> list[psycopg.Connection[Any]]:
        """The psycopg connections this client uses, for round-trip tracing ([] if hidden)."""
        return []


class Adapter:
    """A lock implementation under test."""

    key = ""  # short id used in results
    label = ""  # what the table and chart say
    group = "postgres"  # postgres | redis | lease
    workloads = frozenset("ABCD")
    polls = False  # does a blocked waiter poll (handoff latency = poll phase)?

    def client(self, ctx: Context) -> Client:
        raise NotImplementedError

    def setup(self, ctx: Context) -> None:
        """Once per run, before any client (tables, connectivity checks)."""

    def teardown(self, ctx: Context) -> None:
        pass

    def extra_handoffs(self, ctx: Context, rounds: int) -> dict[str, dict[str, Any]]:
        """More handoff rows for workload C (leases add a waiter in another process)."""
        return {}


# --- raw psycopg: the floor -------------------------------------------------------------------


class _RawClient(Client):
    def __init__(self, ctx: Context) -> None:
        self.conn = ctx.connect()
        self._keys: dict[str, int] = {}
        self._key = 0

    def acquire(self, name: str) -> None:
        k = self._keys.get(name)
        if k is None:
            k = self._keys[name] = sha256_key(name)
        self._key = k
        self.conn.execute("SELECT pg_advisory_lock(%s)", (k,))

    def release(self) -> None:
        self.conn.execute("SELECT pg_advisory_unlock(%s)", (self._key,))

    def close(self) -> None:
        self.conn.close()

    def conns(self) -> list[psycopg.Connection[Any]]:
        return [self.conn]


class Raw(Adapter):
    key = "raw"
    label = "raw psycopg (floor)"

    def client(self, ctx: Context) -> Client:
        return _RawClient(ctx)


class _RawMultiClient(_RawClient):
    def __init__(self, ctx: Context, n: int) -> None:
        super().__init__(ctx)
        self.n = n
        self._many: dict[str, list[int]] = {}
        self._ks: list[int] = []

    def acquire(self, name: str) -> None:
        ks = self._many.get(name)
        if ks is None:
            ks = self._many[name] = sorted(sha256_key(f"{name}:{i}") for i in range(self.n))
        self._ks = ks
        self.conn.execute("SELECT pg_advisory_lock(k) FROM unnest(%s::bigint[]) AS k", (ks,))

    def release(self) -> None:
        self.conn.execute(
            "SELECT bool_and(pg_advisory_unlock(k)) FROM unnest(%s::bigint[]) AS k", (self._ks,)
        )


class RawMulti(Adapter):
    key = "raw-10"
    label = "raw psycopg, 10 names"
    workloads = frozenset("A")

    def client(self, ctx: Context) -> Client:
        return _RawMultiClient(ctx, 10)


class _RawXactClient(_RawClient):
    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self._tx: Any = None

    def acquire(self, name: str) -> None:
        k = self._keys.get(name)
        if k is None:
            k = self._keys[name] = sha256_key(name)
        self._tx = self.conn.transaction()
        self._tx.__enter__()
        self.conn.execute("SELECT pg_advisory_xact_lock(%s)", (k,))

    def release(self) -> None:
        tx, self._tx = self._tx, None
        tx.__exit__(None, None, None)


class RawXact(Adapter):
    key = "raw-xact"
    label = "raw pg_advisory_xact_lock in a transaction"
    workloads = frozenset("A")

    def client(self, ctx: Context) -> Client:
        return _RawXactClient(ctx)


# --- pglock ------------------------------------------------------------------------------------


class _PglockClient(Client):
    def __init__(self, ctx: Context, n: int = 1) -> None:
        self.conn = ctx.connect()
        self.n = n
        self._lock: pglock.PgLock | None = None
        self._many: dict[str, list[str]] = {}

    def acquire(self, name: str) -> None:
        if self.n == 1:
            lock = pglock.pg_lock(self.conn, name)
        else:
            names = self._many.get(name)
            if names is None:
                names = self._many[name] = [f"{name}:{i}" for i in range(self.n)]
            lock = pglock.pg_lock(self.conn, names)
        lock.acquire()
        self._lock = lock

    def release(self) -> None:
        lock, self._lock = self._lock, None
        assert lock is not None
        lock.release()

    def close(self) -> None:
        self.conn.close()

    def conns(self) -> list[psycopg.Connection[Any]]:
        return [self.conn]


class Pglock(Adapter):
    key = "pglock"
    label = "pglock.pg_lock"

    def client(self, ctx: Context) -> Client:
        return _PglockClient(ctx)


class PglockMulti(Adapter):
    key = "pglock-10"
    label = "pglock.pg_lock, 10 names"
    workloads = frozenset("A")

    def client(self, ctx: Context) -> Client:
        return _PglockClient(ctx, 10)


class _PglockXactClient(Client):
    def __init__(self, ctx: Context) -> None:
        self.conn = ctx.connect()
        self._tx: Any = None

    def acquire(self, name: str) -> None:
        self._tx = self.conn.transaction()
        self._tx.__enter__()
        pglock.xact_lock(self.conn, name)

    def release(self) -> None:
        tx, self._tx = self._tx, None
        tx.__exit__(None, None, None)

    def close(self) -> None:
        self.conn.close()

    def conns(self) -> list[psycopg.Connection[Any]]:
        return [self.conn]


class PglockXact(Adapter):
    key = "pglock-xact"
    label = "pglock.xact_lock in a transaction"
    workloads = frozenset("A")

    def client(self, ctx: Context) -> Client:
        return _PglockXactClient(ctx)


# --- Postgres peers ---------------------------------------------------------------------------


class _PostgresqlLockClient(Client):
    def __init__(self, ctx: Context) -> None:
        import postgresql_lock

        self._cls = postgresql_lock.Lock
        self.conn = ctx.connect()
        self._lock: Any = None

    def acquire(self, name: str) -> None:
        lock = self._cls(self.conn, name)
        lock.acquire()
        self._lock = lock

    def release(self) -> None:
        lock, self._lock = self._lock, None
        lock.release()

    def close(self) -> None:
        self.conn.close()

    def conns(self) -> list[psycopg.Connection[Any]]:
        return [self.conn]


class PostgresqlLock(Adapter):
    key = "postgresql-lock"
    label = "postgresql-lock 0.1.9"

    def client(self, ctx: Context) -> Client:
        return _PostgresqlLockClient(ctx)


class _PalsClient(Client):
    def __init__(self, ctx: Context) -> None:
        import pals  # type: ignore[import-untyped]
        import sqlalchemy as sa

        dsn, app = ctx.scratch_dsn, ctx.app_name
        # One engine per client (pals' Locker is an app-level factory over an engine pool), so
        # that each client is one session as for the other adapters.
        self.engine = sa.create_engine(
            "postgresql+psycopg://",
            creator=lambda: psycopg.connect(dsn, application_name=app),
            pool_size=1,
            max_overflow=1,
        )
        self.locker = pals.Locker("bench", create_engine_callable=lambda: self.engine)
        self._lock: Any = None

    def acquire(self, name: str) -> None:
        lock = self.locker.lock(name)
        if not lock.acquire():
            raise RuntimeError(f"pals did not acquire {name!r}")
        self._lock = lock

    def release(self) -> None:
        lock, self._lock = self._lock, None
        lock.release()

    def close(self) -> None:
        self.engine.dispose()


class Pals(Adapter):
    key = "pals"
    label = "pals 0.4 (SQLAlchemy, psycopg 3)"

    def client(self, ctx: Context) -> Client:
        return _PalsClient(ctx)


# The TTL table of the design documents, written here as the baseline a team would write
# before reaching for a library: one row per name, taken when absent or expired, polled.
TTL_TABLE_DDL = (
    "CREATE TABLE IF NOT EXISTS bench_ttl_lock ("
    " name text PRIMARY KEY, holder text NOT NULL, expires_at timestamptz NOT NULL)"
)
TTL_ACQUIRE = (
    "INSERT INTO bench_ttl_lock AS l (name, holder, expires_at)"
    " VALUES (%s, %s, clock_timestamp() + make_interval(secs => %s))"
    " ON CONFLICT (name) DO UPDATE SET holder = EXCLUDED.holder, expires_at = EXCLUDED.expires_at"
    " WHERE l.expires_at <= clock_timestamp()"
    " RETURNING l.holder"
)
TTL_RELEASE = "DELETE FROM bench_ttl_lock WHERE name = %s AND holder = %s"


class _TtlClient(Client):
    waits_in_postgres = False

    def __init__(self, ctx: Context, ttl: float = 30.0) -> None:
        self.conn = ctx.connect()
        self.holder = uuid.uuid4().hex
        self.ttl = ttl
        self._name = ""

    def acquire(self, name: str) -> None:
        while self.conn.execute(TTL_ACQUIRE, (name, self.holder, self.ttl)).fetchone() is None:
            time.sleep(POLL_INTERVAL)
        self._name = name

    def release(self) -> None:
        self.conn.execute(TTL_RELEASE, (self._name, self.holder))

    def close(self) -> None:
        self.conn.close()

    def conns(self) -> list[psycopg.Connection[Any]]:
        return [self.conn]


class TtlTable(Adapter):
    key = "ttl-table"
    label = "TTL table, 100 ms polling"
    polls = True

    def setup(self, ctx: Context) -> None:
        with ctx.connect() as c:
            c.execute(TTL_TABLE_DDL)

    def client(self, ctx: Context) -> Client:
        return _TtlClient(ctx)


# --- Redis peers ---------------------------------------------------------------------------


def _redis(ctx: Context) -> Any:
    import redis

    assert ctx.redis_url is not None
    return redis.Redis.from_url(ctx.redis_url, client_name=ctx.app_name)


class _RedisClient(Client):
    waits_in_postgres = False

    def __init__(self, ctx: Context, make: Callable[[Any, str], Any]) -> None:
        self.r = _redis(ctx)
        self._make = make
        self._lock: Any = None

    def acquire(self, name: str) -> None:
        lock = self._make(self.r, name)
        if not lock.acquire():
            raise RuntimeError(f"did not acquire {name!r}")
        self._lock = lock

    def release(self) -> None:
        lock, self._lock = self._lock, None
        lock.release()

    def close(self) -> None:
        self.r.close()


class _RedisAdapter(Adapter):
    group = "redis"

    def setup(self, ctx: Context) -> None:
        r = _redis(ctx)
        try:
            r.ping()
        finally:
            r.close()


class RedisPy(_RedisAdapter):
    key = "redis-py"
    label = "redis-py Lock"
    polls = True  # sleeps 0.1 s between attempts (its default)

    def client(self, ctx: Context) -> Client:
        return _RedisClient(ctx, lambda r, name: r.lock(name, timeout=30))


class PythonRedisLock(_RedisAdapter):
    key = "python-redis-lock"
    label = "python-redis-lock"

    def client(self, ctx: Context) -> Client:
        import redis_lock  # type: ignore[import-untyped]

        return _RedisClient(ctx, lambda r, name: redis_lock.Lock(r, name, expire=30))


class Pottery(_RedisAdapter):
    key = "pottery"
    label = "pottery Redlock (1 master)"
    polls = True  # random 0-0.2 s sleeps between attempts

    def client(self, ctx: Context) -> Client:
        from pottery import Redlock

        return _RedisClient(
            ctx, lambda r, name: Redlock(key=name, masters={r}, auto_release_time=30)
        )


class NoLock(Adapter):
    """No lock at all: only for the negative control of the lost-update check."""

    key = "none"
    label = "no lock (negative control)"

    def client(self, ctx: Context) -> Client:
        class _None(Client):
            waits_in_postgres = False

            def acquire(self, name: str) -> None:
                pass

            def release(self) -> None:
                pass

        return _None()


def advisory_adapters() -> list[Adapter]:
    """The Postgres adapters that need nothing but the server, in table order."""
    return [
        Raw(),
        Pglock(),
        RawMulti(),
        PglockMulti(),
        RawXact(),
        PglockXact(),
        PostgresqlLock(),
        Pals(),
        TtlTable(),
    ]


def redis_adapters() -> list[Adapter]:
    return [RedisPy(), PythonRedisLock(), Pottery()]


@contextlib.contextmanager
def clients(adapter: Adapter, ctx: Context, n: int) -> Any:
    """``n`` clients of ``adapter``, closed afterwards whatever happens."""
    made: list[Client] = []
    try:
        for _ in range(n):
            made.append(adapter.client(ctx))
        yield made
    finally:
        for c in made:
            with contextlib.suppress(Exception):
                c.close()
