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
* **No grant at all, forged notifications.** A role with no privilege in the database sends
  ``pg_notify`` on every channel pglock listens to (read from the listeners' sessions, and
  checked against the channels of the schemas in use), with forged grants naming the real
  holder id and waiter id of each queued lease waiter (read from ``lease_waiter``), forged
  release names and junk, while lease waiters wait in three schemas whose channels coincide
  (names sharing their first 57 bytes: ``_contract._channel``), two of them with the waiter
  queue and the same holder ids, one without it (waiting the 0001 way), and semaphore waiters
  wait in each. No waiter returns from acquire during the forgery; afterwards the holders
  release one schema at a time and every waiter gets its lease or permit, each at a moment when
  the lease row names its holder and token (the permit row exists, within the limit), checked
  by an independent connection before it releases.

Everything runs in a throwaway database of its own; the roles are dropped afterwards.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import random
import re
import threading
import uuid
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import psycopg
import pytest
from _pgdb import drop_roles, throwaway_database, with_params
from psycopg import sql
from psycopg_pool import ConnectionPool

import pglock
from pglock import _lease, _schema, _waiting
from pglock._contract import lease_channel, semaphore_channel

from .oracles import BIGINT_MAX, wait_for
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
        drop_roles(pg_dsn, (made.app, made.forger), owned_in=[db])


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


# --- no grant at all, forged notifications -----------------------------------------------------


def listened_channels(admin: psycopg.Connection[Any], app_name: str) -> Counter[str]:
    """The channels the LISTEN sessions of this test's application name listen on, with how
    many sessions listen on each."""
    rows = admin.execute(
        "SELECT query FROM pg_stat_activity WHERE application_name = %s"
        " AND query ILIKE 'LISTEN %%' AND state = 'idle'", (app_name,)
    ).fetchall()
    return Counter(json.loads(q.split(" ", 1)[1]) for (q,) in rows)  # LISTEN "<channel>"


def lease_truth(c: psycopg.Connection[Any], schema: str, name: str) -> Any:
    return c.execute(
        sql.SQL("SELECT holder, token, expires_at > clock_timestamp() FROM {}.lease"
                " WHERE name = %s").format(sql.Identifier(schema)), (name,)
    ).fetchone()


def permit_truth(c: psycopg.Connection[Any], schema: str, name: str) -> list[tuple[str, int]]:
    return c.execute(
        sql.SQL("SELECT holder, permits FROM {}.semaphore_permit WHERE semaphore = %s"
                " AND expires_at > clock_timestamp() ORDER BY 1").format(sql.Identifier(schema)),
        (name,),
    ).fetchall()


class Believers:
    """Waiters that, on returning with a grant, ask an independent connection what the
    database says at that moment, then release."""

    def __init__(self, db: str, lname: str, sname: str) -> None:
        self.db, self.lname, self.sname = db, lname, sname
        self.results: list[tuple[str, str, Any, Any]] = []  # (schema, who, believed, truth)
        self.errors: list[str] = []

    def lease(self, pool: ConnectionPool[Any], schema: str, holder: str) -> None:
        try:
            lease = pglock.lease(pool, self.lname, ttl=30, holder=holder, schema=schema)
            if not lease.acquire(timeout=90):
                self.errors.append(f"lease {schema} {holder}: not acquired")
                return
            with psycopg.connect(self.db, autocommit=True) as c:
                truth = lease_truth(c, schema, self.lname)
            self.results.append((schema, holder, (lease.holder, lease.token, True), truth))
            lease.release()
        except Exception as exc:
            self.errors.append(f"lease {schema} {holder}: {exc!r}")

    def served(self, schema: str, n: int) -> bool:
        """``n`` waiters of ``schema`` were served, or one failed."""
        return [r[0] for r in self.results].count(schema) == n or bool(self.errors)

    def permit(self, pool: ConnectionPool[Any], schema: str) -> None:
        try:
            sem = pglock.semaphore(pool, self.sname, limit=1, ttl=30, schema=schema)
            with sem.hold(timeout=90) as permit, psycopg.connect(self.db, autocommit=True) as c:
                truth = permit_truth(c, schema, self.sname)
                self.results.append((schema, "permit", [(permit.holder, 1)], truth))
        except Exception as exc:
            self.errors.append(f"semaphore {schema}: {exc!r}")


def test_forged_notifications_grant_nothing(
    db: str, roles: Roles, admin: psycopg.Connection[Any], app_name: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert {lease_channel(s) for s in (*QUEUED, PLAIN)} == {lease_channel(PLAIN)}
    assert {semaphore_channel(s) for s in (*QUEUED, PLAIN)} == {semaphore_channel(PLAIN)}
    tag = uuid.uuid4().hex[:8]
    lname, sname = f"forged:{tag}", f"forged-sem:{tag}"
    ids = [f"w{i}-{tag}" for i in (1, 2)]  # the same holder ids in every schema
    seen: list[tuple[str, str, str]] = []  # (channel, schema, payload) each listener dispatched
    dispatch = _waiting.waiters.on_notify

    def recording(lst: Any, payload: str) -> None:
        seen.append((lst.channel, lst.key[1], payload))
        dispatch(lst, payload)

    monkeypatch.setattr(_waiting.waiters, "on_notify", recording)
    waiters = Believers(db, lname, sname)
    app_dsn = role_dsn(db, roles.app, app_name)
    threads: list[threading.Thread] = []
    with ConnectionPool(app_dsn, min_size=2, max_size=12, kwargs={"autocommit": True}) as pool, \
            contextlib.ExitStack() as stack:
        stack.callback(_lease.shutdown)
        holders = {s: pglock.lease(pool, lname, ttl=30, schema=s) for s in SCHEMAS}
        permits = {}
        for s in SCHEMAS:
            assert holders[s].acquire(timeout=0)
            sem = pglock.semaphore(pool, sname, limit=1, ttl=30, schema=s)
            permits[s] = stack.enter_context(sem.hold(timeout=0))
        try:
            for holder in ids:  # one at a time: the waiter ids coincide between schemas
                for s in SCHEMAS:
                    threads.append(threading.Thread(target=waiters.lease, args=(pool, s, holder)))
                    threads.append(threading.Thread(target=waiters.permit, args=(pool, s)))
                    threads[-2].start()
                    threads[-1].start()
                wait_for(partial(all_waiting, admin, lname, sname, holder), timeout=30,
                         what=f"{holder} to wait")
            # A listener per schema and kind: the colliding schemas' share a channel.
            expected = Counter(f(s) for s in SCHEMAS for f in (lease_channel, semaphore_channel))
            wait_for(lambda: listened_channels(admin, app_name) == expected, timeout=30,
                     what=f"listeners on {expected}")
            forge(db, roles, admin, app_name, holders, lname, sname, ids, seen)
            assert waiters.results == [], "a waiter believed a forged notification"
            assert waiters.errors == []
            # Release one schema at a time, its waiters served before the next: a handoff's
            # NOTIFY reaches the waiters of the schemas whose channel it shares, with their
            # holder ids and waiter ids, while their leases are still held.
            for s in SCHEMAS:
                holders[s].release()
                permits[s].release()
                wait_for(partial(waiters.served, s, 4), timeout=60, what=f"the waiters of {s}")
        finally:
            for s in SCHEMAS:
                release_quietly(holders[s])
                with contextlib.suppress(Exception):
                    permits[s].release()
            for t in threads:
                t.join(60)
    assert not any(t.is_alive() for t in threads)
    assert waiters.errors == []
    for schema, who, believed, truth in waiters.results:
        assert truth == believed, (schema, who, "believed", believed, "the database", truth)
    assert sorted((r[0], r[1]) for r in waiters.results) == sorted(
        (s, who) for s in SCHEMAS for who in (*ids, "permit", "permit")
    )


def waiting(
    admin: psycopg.Connection[Any], schema: str, lname: str, sname: str, holder: str
) -> bool:
    """The lease waiter ``holder`` and a semaphore waiter of ``schema`` wait in the database."""
    s = sql.Identifier(schema)
    if schema == PLAIN:  # one waiter per name and process, marked on the lease row
        marked = sql.SQL("SELECT waiters FROM {}.lease WHERE name = %s").format(s)
        lease = admin.execute(marked, (lname,)).fetchone() == (True,)
    else:
        row = sql.SQL("SELECT 1 FROM {}.lease_waiter WHERE name = %s AND holder = %s").format(s)
        lease = admin.execute(row, (lname, holder)).fetchone() is not None
    sem = sql.SQL("SELECT waiters FROM {}.semaphore WHERE name = %s").format(s)
    return lease and admin.execute(sem, (sname,)).fetchone() == (True,)


def all_waiting(admin: psycopg.Connection[Any], lname: str, sname: str, holder: str) -> bool:
    return all(waiting(admin, s, lname, sname, holder) for s in SCHEMAS)


def dispatched(seen: list[tuple[str, str, str]], payload: str, listeners: set[Any]) -> bool:
    """Every listener of ``listeners`` ((channel, schema)) dispatched ``payload``."""
    return {(c, s) for c, s, p in seen if p == payload} == listeners


def forge(
    db: str, roles: Roles, admin: psycopg.Connection[Any], app_name: str,
    holders: dict[str, pglock.Lease], lname: str, sname: str, ids: list[str],
    seen: list[tuple[str, str, str]],
) -> None:
    """Three rounds of forged notifications on every channel pglock listens to, as a role with
    no grant; each round ends when every listener has dispatched its last one."""
    queued = [
        (s, *row)
        for s in (*QUEUED, "pglock")
        for row in admin.execute(
            sql.SQL("SELECT name, holder, id FROM {}.lease_waiter WHERE name = %s").format(
                sql.Identifier(s)), (lname,)
        )
    ]
    assert len(queued) == 6, queued
    now = admin.execute("SELECT extract(epoch FROM clock_timestamp())").fetchone()
    assert now is not None
    now_us = int(float(now[0]) * 1e6)
    payloads = [lname, sname, "", "not json", '["grant"]', json.dumps(["grant", lname, ids[0]])]
    for schema, name, holder, waiter in queued:
        # Tokens the database never grants this waiter: its holder's, and ones out of reach;
        # expired grants first, so that a client believing the latest has one to believe.
        for expires, token in itertools.product(
            (-1, 600), (holders[schema].token, 2**62 - 1, 0, -1)
        ):
            payloads.append(json.dumps(
                ["grant", name, holder, token, waiter, now_us, now_us + expires * 1_000_000]
            ))
    channels = listened_channels(admin, app_name)
    listeners = {(lease_channel(s), s) for s in SCHEMAS} | {(semaphore_channel(s), s)
                                                           for s in SCHEMAS}
    with psycopg.connect(role_dsn(db, roles.forger, f"{app_name}-forger"),
                         autocommit=True) as forger:
        privileges = forger.execute(
            "SELECT bool_or(has_schema_privilege(n.nspname, 'USAGE')) FROM pg_namespace n"
            " WHERE n.nspname = ANY(%s)", (list(SCHEMAS),)
        ).fetchone()
        assert privileges == (False,)
        for round_ in range(3):
            last = f"forged round {round_} done"
            for channel in sorted(channels):  # every channel pglock listens to
                # One transaction per channel and round: its notifications arrive in order.
                forger.execute(
                    "SELECT pg_notify(%s, p) FROM unnest(%s::text[]) AS p",
                    (channel, [*payloads, last]),
                )
            wait_for(partial(dispatched, seen, last, listeners), timeout=30,
                     what="every listener to dispatch the forged round")
    wait_for(lambda: not any(slot.poked for slots in _waiting.waiters.slots.values()
                             for slot in slots.values()),
             timeout=10, what="every poked waiter to look")
