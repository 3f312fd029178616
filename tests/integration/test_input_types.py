"""Input types, the database part: every public callable of pglock (``_inputs.surface()``),
for every parameter of a builtin type, each plain sample of ``_inputs.PARAMS`` and each variant
of it (a subclass that answers for itself, a str/int/float Enum member, StrEnum/IntEnum, a
Mapping that is not a dict, a dict subclass), does to Postgres what the plain value does.

A run makes and takes one lock (lease, permit, ...) with some arguments, then a second with
others while the first is held, and records each outcome (the result, or the exception with
its message and attributes) and what Postgres holds after each step and after the release:
the advisory locks of the test's sessions (per session) in pg_locks, the live lease rows
(name, holder, metadata, TTL), the semaphore and permit rows, the schemas. For a valid sample
``run(plain, variant)`` and ``run(variant, plain)`` must equal ``run(plain, plain)``: the same
key held, the same lease row, the same HolderInUse, SelfDeadlock or counted re-entry between a
handle made with the variant and one made with the plain value. For an invalid sample the
variant must fail as the plain value does, changing nothing. The pure part is
tests/unit/test_input_coercion.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import _inputs
import psycopg
import psycopg_pool
import pytest
import sqlalchemy as sa
from _pgdb import sa_url

import pglock
import pglock.alembic
import pglock.sqlalchemy

NAME = "inputs:a"
HOLDER = "inputs-holder"


@dataclass
class Ctx:
    dsn: str
    app: str
    conn: psycopg.Connection[Any]  # autocommit
    other: psycopg.Connection[Any]  # autocommit, another session
    tx: psycopg.Connection[Any]  # not autocommit: its transactions are rolled back
    watch: psycopg.Connection[Any]  # the observer, under another application_name
    pool: psycopg_pool.ConnectionPool[Any]
    engine: sa.Engine
    locker: pglock.Locker


@pytest.fixture
def ctx(dsn: str, app_name: str) -> Iterator[Ctx]:
    with contextlib.ExitStack() as stack:
        conns = [
            stack.enter_context(psycopg.connect(dsn, autocommit=ac)) for ac in (True, True, False)
        ]
        watch = stack.enter_context(
            psycopg.connect(dsn, autocommit=True, application_name="inputs-watch")
        )
        pool = stack.enter_context(
            psycopg_pool.ConnectionPool(
                dsn, min_size=1, max_size=4, reset=pglock.reset_connection, open=True
            )
        )
        engine = sa.create_engine(sa_url(dsn, application_name=app_name), pool_size=2)
        stack.callback(engine.dispose)
        locker = stack.enter_context(pglock.Locker(pool, namespace="inputs"))
        yield Ctx(dsn, app_name, *conns, watch, pool, engine, locker)


def observe(ctx: Ctx) -> Any:
    """What Postgres holds now for this test: advisory locks per session (key, mode,
    granted), live lease rows, semaphores and live permits (holder ids aside: a permit's is
    random), schemas."""
    q = ctx.watch.execute
    by_pid: dict[int, list[tuple[Any, ...]]] = {}
    for pid, *lock in q(
        "SELECT l.pid, (l.classid::bigint << 32) | l.objid::bigint, l.objsubid, l.mode,"
        " l.granted FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid"
        " WHERE l.locktype = 'advisory' AND a.application_name = %s",
        (ctx.app,),
    ).fetchall():
        by_pid.setdefault(pid, []).append(tuple(lock))
    return _inputs.typed(
        {
            "advisory": sorted(sorted(locks) for locks in by_pid.values()),
            "leases": q(
                "SELECT name, holder, metadata,"
                " round(extract(epoch FROM expires_at - acquired_at))::int"
                " FROM pglock.lease WHERE expires_at > clock_timestamp() ORDER BY name"
            ).fetchall(),
            "semaphores": q("SELECT name, max_permits FROM pglock.semaphore ORDER BY 1").fetchall(),
            "permits": q(
                "SELECT semaphore, permits, metadata FROM pglock.semaphore_permit"
                " WHERE expires_at > clock_timestamp() ORDER BY 1, 2, 3::text"
            ).fetchall(),
            "schemas": q(
                "SELECT nspname FROM pg_namespace WHERE nspname !~ '^pg_'"
                " AND nspname <> 'information_schema' ORDER BY 1"
            ).fetchall(),
        }
    )


def _acquired(stack: contextlib.ExitStack, handle: Any, **kwargs: Any) -> bool:
    ok = handle.acquire(**kwargs)
    if ok:
        stack.callback(handle.release)
    return bool(ok)


def _held(stack: contextlib.ExitStack, cm: Any) -> None:
    stack.enter_context(cm)


def _lease_held(ctx: Ctx, stack: contextlib.ExitStack) -> pglock.Lease:
    return stack.enter_context(pglock.lease(ctx.dsn, NAME, holder=HOLDER, timeout=0))


def _rolled_back(ctx: Ctx, stack: contextlib.ExitStack) -> psycopg.Connection[Any]:
    stack.callback(ctx.tx.rollback)
    return ctx.tx


def _leader(ctx: Ctx, stack: contextlib.ExitStack, make: Callable[[], Any], first: bool) -> Any:
    """A leader's run: elected (bounded wait), resigned at the end. Only the first handle
    campaigns: a second one would wait out its whole campaign to be refused, and its key is
    the first's (compared in pg_locks) when the name is taken by value. A leader on any DSN
    but the test's is made, not started: it would connect elsewhere."""
    election = make()
    if not first or _inputs.by_value(election._source) not in (ctx.dsn, ctx.pool):
        return None
    stack.callback(election.resign)
    election.start()
    return election.wait_elected(30)


Drive = Callable[[Ctx, dict[str, Any], contextlib.ExitStack, bool], Any]

#: How each public callable is run: ``qualname -> (base arguments, drive)``. ``drive(ctx,
#: arguments, stack, first)`` makes and takes what the callable makes, leaves its release on
#: the stack, and returns what is compared (never a handle: only values).
DRIVERS: dict[str, tuple[Callable[[Ctx], dict[str, Any]], Drive]] = {
    "pg_lock": (
        lambda c: {"conn": c.conn, "names": NAME},
        lambda c, kw, st, first: _held(st, pglock.pg_lock(**kw)),
    ),
    "PgLock": (
        lambda c: {"conn": c.conn, "names": NAME},
        lambda c, kw, st, first: _held(st, pglock.PgLock(**kw)),
    ),
    "PgLock.acquire": (
        lambda c: {},
        lambda c, kw, st, first: _acquired(st, pglock.pg_lock(c.conn, NAME), **kw),
    ),
    "pool_lock": (
        lambda c: {"pool_or_engine": c.pool, "names": NAME},
        lambda c, kw, st, first: _held(st, pglock.pool_lock(**kw)),
    ),
    "PoolLock": (
        lambda c: {"source": c.pool, "names": NAME},
        lambda c, kw, st, first: _held(st, pglock.PoolLock(**kw)),
    ),
    "PoolLock.acquire": (
        lambda c: {},
        lambda c, kw, st, first: _acquired(st, pglock.pool_lock(c.pool, NAME), **kw),
    ),
    "Locker.lock": (
        lambda c: {"names": NAME},
        lambda c, kw, st, first: _held(st, c.locker.lock(**kw)),
    ),
    "xact_lock": (
        lambda c: {"names": NAME},
        lambda c, kw, st, first: pglock.xact_lock(**{"conn": _rolled_back(c, st), **kw}),
    ),
    "try_xact_lock": (
        lambda c: {"names": NAME},
        lambda c, kw, st, first: pglock.try_xact_lock(**{"conn": _rolled_back(c, st), **kw}),
    ),
    "lease": (
        lambda c: {"source": c.dsn, "name": NAME, "holder": HOLDER, "timeout": 0},
        lambda c, kw, st, first: _held(st, pglock.lease(**kw)),
    ),
    "Lease": (
        lambda c: {"source": c.dsn, "name": NAME, "holder": HOLDER, "timeout": 0},
        lambda c, kw, st, first: _held(st, pglock.Lease(**kw)),
    ),
    "Locker.lease": (
        lambda c: {"name": NAME, "holder": HOLDER, "timeout": 0},
        lambda c, kw, st, first: _held(st, c.locker.lease(**kw)),
    ),
    "Lease.acquire": (
        lambda c: {},
        lambda c, kw, st, first: _acquired(st, pglock.lease(c.dsn, NAME, holder=HOLDER), **kw),
    ),
    "Lease.extend": (lambda c: {}, lambda c, kw, st, first: _lease_held(c, st).extend(**kw)),
    "Lease.guard": (
        lambda c: {},
        lambda c, kw, st, first: _lease_held(c, st).guard(**{"conn": _rolled_back(c, st), **kw}),
    ),
    "semaphore": (
        lambda c: {"source": c.dsn, "name": NAME, "limit": 3, "timeout": 0},
        lambda c, kw, st, first: _held(st, pglock.semaphore(**kw)),
    ),
    "Semaphore": (
        lambda c: {"source": c.dsn, "name": NAME, "limit": 3, "timeout": 0},
        lambda c, kw, st, first: _held(st, pglock.Semaphore(**kw)),
    ),
    "Locker.semaphore": (
        lambda c: {"name": NAME, "limit": 3, "timeout": 0},
        lambda c, kw, st, first: _held(st, c.locker.semaphore(**kw)),
    ),
    "Semaphore.acquire": (
        lambda c: {"timeout": 0},
        lambda c, kw, st, first: _acquired(st, pglock.semaphore(c.dsn, NAME, 3), **kw),
    ),
    "Semaphore.hold": (
        lambda c: {"timeout": 0},
        lambda c, kw, st, first: _held(st, pglock.semaphore(c.dsn, NAME, 3).hold(**kw)),
    ),
    "rwlock": (
        lambda c: {"source": c.pool, "name": NAME},
        lambda c, kw, st, first: _held(st, pglock.rwlock(**kw).write()),
    ),
    "RWLock": (
        lambda c: {"source": c.pool, "name": NAME},
        lambda c, kw, st, first: _held(st, pglock.RWLock(**kw).write()),
    ),
    "Locker.rwlock": (
        lambda c: {"name": NAME},
        lambda c, kw, st, first: _held(st, c.locker.rwlock(**kw).read()),
    ),
    "RWLock.read": (
        lambda c: {},
        lambda c, kw, st, first: _held(st, pglock.rwlock(c.pool, NAME).read(**kw)),
    ),
    "RWLock.write": (
        lambda c: {},
        lambda c, kw, st, first: _held(st, pglock.rwlock(c.pool, NAME).write(**kw)),
    ),
    "RWHold.acquire": (
        lambda c: {},
        lambda c, kw, st, first: _acquired(st, pglock.rwlock(c.pool, NAME).write(), **kw),
    ),
    "singleton": (
        lambda c: {"source": c.pool, "name": NAME},
        lambda c, kw, st, first: _acquired(st, pglock.singleton(**kw)),
    ),
    "Singleton": (
        lambda c: {"source": c.pool, "name": NAME},
        lambda c, kw, st, first: _acquired(st, pglock.Singleton(**kw)),
    ),
    "Locker.singleton": (
        lambda c: {"name": NAME},
        lambda c, kw, st, first: _acquired(st, c.locker.singleton(**kw)),
    ),
    "Singleton.acquire": (
        lambda c: {},
        lambda c, kw, st, first: _acquired(st, pglock.singleton(c.pool, NAME), **kw),
    ),
    "leader": (
        lambda c: {"source": c.dsn, "name": NAME, "takeover_delay": 0},
        lambda c, kw, st, first: _leader(c, st, lambda: pglock.leader(**kw), first),
    ),
    "LeaderElection": (
        lambda c: {"source": c.dsn, "name": NAME, "takeover_delay": 0},
        lambda c, kw, st, first: _leader(c, st, lambda: pglock.LeaderElection(**kw), first),
    ),
    "Locker.leader": (
        lambda c: {"name": NAME, "takeover_delay": 0},
        lambda c, kw, st, first: _leader(c, st, lambda: c.locker.leader(**kw), first),
    ),
    "LeaderElection.wait_elected": (
        lambda c: {},
        lambda c, kw, st, first: _leader(
            c, st, lambda: _Waiting(pglock.leader(c.dsn, NAME, takeover_delay=0), kw), first
        ),
    ),
    "LeaderElection.guard": (
        lambda c: {},
        lambda c, kw, st, first: _leader(
            c,
            st,
            lambda: _Guarding(
                pglock.leader(c.dsn, NAME, takeover_delay=0), kw, _rolled_back(c, st)
            ),
            first,
        ),
    ),
    "Locker": (
        lambda c: {"source": c.dsn, "namespace": "inputs", "timeout": 0},
        lambda c, kw, st, first: _locker_run(st, pglock.Locker(**kw), first),
    ),
    "Locker.full_name": (
        lambda c: {"name": NAME},
        lambda c, kw, st, first: c.locker.full_name(**kw),
    ),
    "key": (lambda c: {"name": NAME}, lambda c, kw, st, first: pglock.key(**kw)),
    "lease_info": (
        lambda c: {"conn": c.conn, "name": NAME},
        lambda c, kw, st, first: _info(
            _after(lambda: _lease_held(c, st), first, kw)(pglock.lease_info)
        ),
    ),
    "list_leases": (
        lambda c: {"conn": c.conn, "prefix": "inputs:"},
        lambda c, kw, st, first: [
            _info(i) for i in _after(lambda: _lease_held(c, st), first, kw)(pglock.list_leases)
        ],
    ),
    "advisory_locks": (
        lambda c: {"conn": c.conn, "name": NAME},
        lambda c, kw, st, first: [
            (a.name, a.key, a.mode, a.granted)
            for a in _after(lambda: _held(st, pglock.pg_lock(c.other, NAME)), first, kw)(
                pglock.advisory_locks
            )
        ],
    ),
    "semaphores": (
        lambda c: {"conn": c.conn, "name": NAME},
        lambda c, kw, st, first: [
            (s.name, s.limit, s.held, len(s.holders))
            for s in _after(lambda: _held(st, pglock.semaphore(c.dsn, NAME, 3)), first, kw)(
                pglock.semaphores
            )
        ],
    ),
    "install": (
        lambda c: {"target": c.dsn, "schema": "pglock"},
        lambda c, kw, st, first: pglock.install(**kw),
    ),
    "reset_connection": (
        lambda c: {"conn": c.conn},
        lambda c, kw, st, first: pglock.reset_connection(**kw),
    ),
    "configure_telemetry": (
        lambda c: {},
        lambda c, kw, st, first: _with_telemetry(c, st, kw),
    ),
    "alembic.migration_lock": (
        lambda c: {"connection_or_url": c.dsn, "name": NAME},
        lambda c, kw, st, first: _held(
            st, pglock.alembic.migration_lock(**(kw if first else {**kw, "timeout": 0}))
        ),
    ),
    "sqlalchemy.locked_session": (
        lambda c: {"engine": c.engine, "names": NAME},
        lambda c, kw, st, first: _held(st, pglock.sqlalchemy.locked_session(**kw)),
    ),
    "sqlalchemy.release_on_checkin": (
        lambda c: {"engine_or_pool": c.engine},
        lambda c, kw, st, first: pglock.sqlalchemy.release_on_checkin(**kw),
    ),
}


class _Waiting:
    """A leader whose wait is ``wait_elected(**kwargs)`` (the method under test)."""

    def __init__(self, election: pglock.LeaderElection, kwargs: dict[str, Any]) -> None:
        self._source = election._source  # type: ignore[attr-defined]
        self.election, self.kwargs = election, kwargs

    def start(self) -> None:
        self.election.start()

    def resign(self) -> None:
        self.election.resign()

    def wait_elected(self, timeout: float) -> bool:
        return self.election.wait_elected(**self.kwargs)


class _Guarding(_Waiting):
    """A leader that, once elected, calls ``guard(**kwargs)`` in ``tx`` (the method under
    test); its term is left out (a new election, a new term)."""

    def __init__(self, election: Any, kwargs: dict[str, Any], tx: Any) -> None:
        super().__init__(election, {"conn": tx, **kwargs})

    def wait_elected(self, timeout: float) -> bool:
        elected = self.election.wait_elected(timeout)
        self.election.guard(**self.kwargs)
        return elected


def _locker_run(stack: contextlib.ExitStack, locker: pglock.Locker, first: bool) -> str:
    """A Locker's lock and lease on NAME; the second Locker only tries (its own pool)."""
    stack.callback(locker.close)
    _held(stack, locker.lock(NAME) if first else locker.lock(NAME, timeout=0))
    _held(stack, locker.lease(NAME, holder=HOLDER, timeout=0))
    return locker.full_name(NAME)


def _info(info: Any) -> Any:
    return None if info is None else (info.name, info.holder, info.token > 0, info.metadata)


def _after(setup: Callable[[], Any], first: bool, kw: dict[str, Any]) -> Callable[..., Any]:
    """Call ``fn(**kw)`` after ``setup()`` (on the first call of a run only)."""
    if first:
        setup()
    return lambda fn: fn(**kw)


def _with_telemetry(ctx: Ctx, stack: contextlib.ExitStack, kw: dict[str, Any]) -> None:
    stack.callback(pglock.configure_telemetry, enabled=False)
    pglock.configure_telemetry(**kw)
    _held(stack, pglock.pg_lock(ctx.conn, NAME))


def run(ctx: Ctx, drive: Drive, first: dict[str, Any], second: dict[str, Any]) -> list[Any]:
    """A run: the first call, Postgres's state, the second call while the first holds, the
    state again, and the state once everything is released."""
    steps: list[Any] = []
    with contextlib.ExitStack() as stack:
        steps.append(_inputs.outcome(lambda: drive(ctx, first, stack, True)))
        steps.append(observe(ctx))
        if steps[0][0] == "returned":
            steps.append(_inputs.outcome(lambda: drive(ctx, second, stack, False)))
            steps.append(observe(ctx))
    steps.append(observe(ctx))
    return steps


def _varied() -> list[tuple[str, str]]:
    return [
        (q, p)
        for q, (_, params) in sorted(_inputs.surface().items())
        for p in params
        if any(_inputs.cases([p], _inputs.NOWHERE))
    ]


def test_every_callable_with_a_value_parameter_has_a_driver() -> None:
    """A new public callable (or method) taking a str, number or mapping fails here until it
    has a driver: nothing is skipped silently."""
    missing = sorted({q for q, _ in _varied()} - set(DRIVERS))
    assert not missing, f"public callables without a driver in DRIVERS: {missing}"
    assert not set(DRIVERS) - set(_inputs.surface()), "drivers of callables that are gone"


def _diff(a: list[Any], b: list[Any]) -> str:
    return (
        "\n".join(
            f"    step {i}: {x!r}\n         != {y!r}"
            for i, (x, y) in enumerate(zip(a, b, strict=False))
            if x != y
        )
        or f"    {a!r}\n    != {b!r}"
    )


@pytest.mark.parametrize(("qualname", "param"), _varied())
def test_a_variant_does_to_postgres_what_its_plain_value_does(
    qualname: str, param: str, ctx: Ctx
) -> None:
    base_of, drive = DRIVERS[qualname]
    base = base_of(ctx)
    valid, invalid = _inputs.samples(param, ctx.dsn)
    failures: list[str] = []
    for plain in valid:
        expected = run(ctx, drive, {**base, param: plain}, {**base, param: plain})
        if not _inputs.PARAMS[param].dsn:  # a DSN where a connection is needed: refused
            assert expected[0][0] == "returned", f"{qualname}({param}={plain!r}): {expected}"
        for family, variant in _inputs.variants(plain):
            for order, (a, b) in {
                "plain then variant": (plain, variant),
                "variant then plain": (variant, plain),
            }.items():
                got = run(ctx, drive, {**base, param: a}, {**base, param: b})
                if got != expected:
                    failures.append(f"{family} {variant!r}, {order}:\n{_diff(expected, got)}")
    for plain in invalid:
        expected = run(ctx, drive, {**base, param: plain}, base)
        for family, variant in _inputs.variants(plain):
            got = run(ctx, drive, {**base, param: variant}, base)
            if got != expected:
                failures.append(f"invalid {family} {variant!r}:\n{_diff(expected, got)}")
    assert not failures, f"{qualname}, {param}: {len(failures)} difference(s):\n" + "\n".join(
        failures
    )
