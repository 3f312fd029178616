"""Adversary axis (e), other roles: what a role can do to pglock through the database alone.

* **Exactly the documented grants, every function, hostile arguments.** A LOGIN role with the
  statements of docs/leases.md's "Permissions" section and nothing more calls every function of
  the installed schema (enumerated from ``pg_proc``: a new function is covered without a change
  here) directly, with arguments generated per parameter type from what that role can see or
  guess (``leases()``: names, holder ids, tokens; the queue's waiter ids; a semaphore's name)
  and from hostile values (NULL, '', huge, negative, NaN and infinite TTLs and windows, arrays
  of mismatched lengths, other schemas' names), each call bounded by ``statement_timeout``
  (waiting is an acceptable outcome). Meanwhile another holder holds a lease, with a live
  waiter queued behind it, and has a ``guard()`` transaction open on it: its holder and token
  never change, its expiry never moves back, tokens never go back. Then, without the guard, no
  call lacking the holder's id changes the lease, and no call changes a semaphore permit (its
  holder id is not visible to the role). Control: every public function succeeds for some
  generated call; the internal helpers (``pglock internal`` in their comment) and the trigger
  function for none.

Everything runs in a throwaway database of its own; the roles are dropped afterwards.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import random
import re
import uuid
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest
from _pgdb import throwaway_database, with_params
from psycopg import sql
from psycopg_pool import ConnectionPool

import pglock
from pglock import _lease, _schema

from .oracles import BIGINT_MAX
from .test_privileges import DOCS

pytestmark = pytest.mark.timeout(300)

#: Three schemas whose NOTIFY channels coincide: 57 bytes in common, the longest valid names.
_PREFIX = f"roles_{uuid.uuid4().hex[:8]}_".ljust(57, "x")
QUEUED = (_PREFIX + "aaaaaa", _PREFIX + "bbbbbb")  # every revision
PLAIN = _PREFIX + "cccccc"  # up to pglock_0003: lease waiters wait the 0001 way
SCHEMAS = ("pglock", *QUEUED, PLAIN)
#: A call of the hostile role that blocks (a guard()ed row) is cut off after this (ms).
CALL_TIMEOUT_MS = 150


def documented_statements() -> list[str]:
    """Every statement of the sql blocks in docs/leases.md's "Permissions" section up to the
    monitoring role's: the two GRANTs and the ALTER DEFAULT PRIVILEGES for app_role."""
    text = DOCS.read_text(encoding="utf-8")
    section = text.split("\n## Permissions\n", 1)[1].split("\n## ", 1)[0]
    found = [
        s.strip()
        for block in re.findall(r"```sql\n(.*?)```", section, re.S)
        for s in block.split(";")
        if re.search(r"\bapp_role\b", s)
    ]
    assert any(s.startswith("GRANT USAGE") for s in found), found
    assert any(s.startswith("ALTER DEFAULT PRIVILEGES") for s in found), found
    return found


@dataclass(frozen=True)
class Roles:
    app: str  # exactly the documented grants, on every schema
    forger: str  # LOGIN, no grant at all


@pytest.fixture(scope="module")
def db(pg_dsn: str) -> Iterator[str]:
    with throwaway_database(pg_dsn, prefix="pglock_roles", install=True) as dsn:
        with psycopg.connect(dsn, autocommit=True) as c, c.transaction():
            for schema, upto in [(s, None) for s in QUEUED] + [(PLAIN, "pglock_0003")]:
                for rev in _schema.revisions():
                    for stmt in rev.upgrade_statements(schema):
                        c.execute(stmt)
                    if rev.revision == upto:
                        break
        try:
            yield dsn
        finally:
            _lease.shutdown()


@pytest.fixture(scope="module")
def roles(db: str, pg_dsn: str) -> Iterator[Roles]:
    tag = uuid.uuid4().hex[:8]
    made = Roles(f"pglock_app_{tag}", f"pglock_forger_{tag}")
    with psycopg.connect(db, autocommit=True) as admin:
        installer = admin.execute("SELECT current_user").fetchone()
        assert installer is not None
        for role in (made.app, made.forger):
            admin.execute(f"CREATE ROLE {role} LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE")
        for schema in SCHEMAS:
            for stmt in documented_statements():
                stmt = re.sub(r"\bapp_role\b", made.app, stmt)
                stmt = re.sub(r"\bmigrator\b", installer[0], stmt)
                admin.execute(re.sub(r"\bpglock\b", schema, stmt))
    try:
        yield made
    finally:
        _lease.shutdown()
        with psycopg.connect(db, autocommit=True) as admin:
            for role in (made.app, made.forger):
                admin.execute(f"DROP OWNED BY {role}")
        with psycopg.connect(pg_dsn, autocommit=True) as admin:
            for role in (made.app, made.forger):
                admin.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s",
                    (role,),
                )
                admin.execute(f"DROP ROLE {role}")


@pytest.fixture
def admin(db: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(db, autocommit=True) as c:
        yield c


def role_dsn(db: str, role: str, app_name: str, **params: Any) -> str:
    return with_params(db, user=role, application_name=app_name, **params)


# --- the documented grants, every function, hostile arguments ----------------------------------


@dataclass(frozen=True)
class Function:
    name: str
    types: tuple[str, ...]  # format_type() of each parameter
    internal: bool  # its comment says "pglock internal"
    trigger: bool


def functions(admin: psycopg.Connection[Any], schema: str) -> list[Function]:
    rows = admin.execute(
        "SELECT p.proname, array(SELECT format_type(t, NULL) FROM unnest(p.proargtypes) t),"
        " coalesce(obj_description(p.oid, 'pg_proc'), '') LIKE 'pglock internal%%',"
        " p.prorettype = 'trigger'::regtype"
        " FROM pg_proc p WHERE p.pronamespace = %s::regnamespace ORDER BY 1",
        (schema,),
    ).fetchall()
    return [Function(n, tuple(t), i, g) for n, t, i, g in rows]


Values = dict[str, list[Any]]


def values(texts: list[Any], bigints: list[Any]) -> tuple[Values, Values]:
    """Argument values per parameter type: the plausible ones (``core``: what the role can see,
    and sane numbers), and hostile ones (``edge``)."""
    core: Values = {
        "text": texts,
        "bigint": bigints,
        "double precision": [1.0, 600.0],
        "integer": [1, 2],
        "boolean": [True, False],
        "jsonb": [None],
    }
    edge: Values = {
        "text": [None, "", "pglock", PLAIN, texts[0].upper(), texts[0] + " ", "x" * 3000,
                 "'); DELETE FROM pglock.lease; --"],
        "bigint": [None, 0, -1, BIGINT_MAX, -BIGINT_MAX - 1, bigints[0] + 1, bigints[0] - 1],
        "double precision": [None, math.nan, math.inf, -math.inf, -1.0, 0.0, 5e-324, 1e308,
                             60.0, 60.5, 86400.0, 86400.5],
        "integer": [None, 0, -1, 2**31 - 1, -(2**31)],
        "boolean": [None],
        "jsonb": ["{}", json.dumps("x" * 70000)],
    }
    for scalar in list(core):
        arr = f"{scalar}[]"
        core[arr] = [[v] for v in core[scalar]]
        edge[arr] = [None, [], [None], core[scalar], core[scalar][:1] * 3] + [
            [v] for v in edge[scalar] if v is not None
        ]
    return core, edge


def hostile_calls(fn: Function, core: Values, edge: Values, rng: random.Random) -> list[Any]:
    """Up to 160 combinations of plausible values (all of them, for most functions), then each
    parameter of three of them swept through its hostile values."""
    unknown = [t for t in fn.types if t not in core]
    assert not unknown, f"{fn.name} takes {unknown}: give that type values in values()"
    combos = list(itertools.product(*(core[t] for t in fn.types)))
    rng.shuffle(combos)
    calls = combos[:160]
    for base in combos[:3]:
        for i, t in enumerate(fn.types):
            calls += [(*base[:i], v, *base[i + 1 :]) for v in edge[t]]
    return calls


@dataclass
class Victim:
    """The lease and the permit another holder holds, and what may not happen to them."""

    name: str
    holder: str
    token: int
    semaphore: str
    permit: tuple[Any, ...]  # (holder, permits, acquired_at) of its permit row
    expires: Any = None
    permit_expires: Any = None
    last_token: int = 0

    def check(self, admin: psycopg.Connection[Any], call: str) -> None:
        row = admin.execute(
            "SELECT holder, token, expires_at, expires_at > clock_timestamp(),"
            " (SELECT last_value FROM pglock.lease_token)"
            " FROM pglock.lease WHERE name = %s",
            (self.name,),
        ).fetchone()
        assert row is not None, f"{call} removed the lease"
        holder, token, expires, live, last = row
        assert (holder, token, live) == (self.holder, self.token, True), (call, row)
        assert self.expires is None or expires >= self.expires, (call, "expiry moved back")
        assert last >= self.last_token, (call, "the token sequence went back")
        self.expires, self.last_token = expires, last
        permits = admin.execute(
            "SELECT holder, permits, acquired_at, expires_at, expires_at > clock_timestamp()"
            " FROM pglock.semaphore_permit WHERE semaphore = %s",
            (self.semaphore,),
        ).fetchall()
        assert [(*p[:3], p[4]) for p in permits] == [(*self.permit, True)], (call, permits)
        assert self.permit_expires is None or permits[0][3] >= self.permit_expires, call
        self.permit_expires = permits[0][3]


def keep_a_waiter(admin: psycopg.Connection[Any], name: str, holder: str) -> None:
    """A live waiter queued for ``name`` (again, if a call removed it or let it lapse)."""
    admin.execute(
        "INSERT INTO pglock.lease_waiter (name, holder, ttl, alive_until)"
        " VALUES (%s, %s, 600, clock_timestamp() + interval '1 hour')"
        " ON CONFLICT (name, holder) DO UPDATE SET alive_until = excluded.alive_until",
        (name, holder),
    )


def call_everything(
    app: psycopg.Connection[Any], admin: psycopg.Connection[Any], fns: list[Function],
    victim: Victim, texts: list[Any], waiter_holder: str, seed: int,
) -> dict[str, Counter[str]]:
    """Every function with its hostile calls, the victim checked after each; the outcomes
    (``ok`` or the SQLSTATE) per function."""
    waiter_ids = [r[0] for r in admin.execute(
        "SELECT id FROM pglock.lease_waiter WHERE name = %s ORDER BY id", (victim.name,)
    )]
    core, edge = values(texts, [victim.token, *waiter_ids])
    rng = random.Random(seed)
    outcomes: dict[str, Counter[str]] = defaultdict(Counter)
    for fn in fns:
        query = sql.SQL("SELECT * FROM pglock.{}({})").format(
            sql.Identifier(fn.name),
            sql.SQL(", ").join(sql.SQL("%s::" + t) for t in fn.types),  # types from pg_proc
        )
        for args in hostile_calls(fn, core, edge, rng):
            keep_a_waiter(admin, victim.name, waiter_holder)
            try:
                app.execute(query, args).fetchall()
                outcome = "ok"
            except psycopg.Error as exc:
                outcome = exc.sqlstate or type(exc).__name__
            outcomes[fn.name][outcome] += 1
            victim.check(admin, f"{fn.name}{tuple(str(a)[:40] for a in args)} -> {outcome}")
    return outcomes


def release_quietly(lease: pglock.Lease) -> None:
    """After the test: a failure inside it is what the run reports."""
    with contextlib.suppress(Exception):
        lease.release()


def test_documented_grants_call_every_function_with_hostile_arguments(
    db: str, roles: Roles, admin: psycopg.Connection[Any], app_name: str
) -> None:
    app_dsn = role_dsn(db, roles.app, app_name)
    fns = functions(admin, "pglock")
    assert {f.name for f in fns} >= {"acquire", "release", "acquire_v4", "hand_over_v4"}
    name, sem_name = f"victim:{uuid.uuid4()}", f"victim-sem:{uuid.uuid4()}"
    waiter_holder = f"queued-{uuid.uuid4().hex[:8]}"
    with ConnectionPool(app_dsn, min_size=1, max_size=2, kwargs={"autocommit": True}) as pool, \
            contextlib.ExitStack() as stack:
        lease = pglock.lease(pool, name, ttl=600, keepalive=False)
        assert lease.acquire(timeout=0) and lease.token is not None
        stack.callback(release_quietly, lease)
        sem = pglock.semaphore(pool, sem_name, limit=1, ttl=600)
        permit = stack.enter_context(sem.hold(timeout=0))
        row = admin.execute(
            "SELECT holder, permits, acquired_at FROM pglock.semaphore_permit"
            " WHERE semaphore = %s", (sem_name,)
        ).fetchone()
        assert row is not None and row[0] == permit.holder
        victim = Victim(name, lease.holder, lease.token, sem_name, tuple(row))
        keep_a_waiter(admin, name, waiter_holder)
        victim.check(admin, "before any call")
        app = stack.enter_context(psycopg.connect(
            role_dsn(db, roles.app, app_name, options=f"-c statement_timeout={CALL_TIMEOUT_MS}"),
            autocommit=True,
        ))
        # What the role sees: the live leases, with their holders and tokens.
        seen = app.execute("SELECT name, holder, token FROM pglock.leases()").fetchall()
        assert (name, lease.holder, lease.token) in seen

        # 1. The holder guards the lease in its own open transaction.
        guard = stack.enter_context(psycopg.connect(app_dsn))
        lease.guard(guard)
        texts = [name, lease.holder, waiter_holder, sem_name]
        guarded = call_everything(app, admin, fns, victim, texts, waiter_holder, seed=1)
        guard.rollback()

        # 2. No guard; the calls know everything but the holder id.
        texts = [name, waiter_holder, sem_name, f"{lease.holder}x"]
        free = call_everything(app, admin, fns, victim, texts, waiter_holder, seed=2)
        assert lease.locked

    for fn in fns:
        got = guarded[fn.name] + free[fn.name]
        assert got, fn.name
        if fn.internal:
            # Run with the caller's rights (0005): the role has none on the tables.
            assert set(got) == {"42501"}, (fn.name, got)
        elif fn.trigger:
            assert "ok" not in got, (fn.name, got)
        else:  # control: the harness reached the function's body with valid arguments
            assert got["ok"] > 0, (fn.name, got)
