"""Axis (a) of the threat model: session settings change no answer pglock gives.

The settings are generated from the server's own catalog (``pg_settings``): every setting a
role, a database or an application can set (context ``user`` or ``superuser``) in the
categories that decide how a session encodes, parses and formats values, which isolation and
access mode its transactions get, and how long it lives (client connection defaults, version
compatibility, error handling, lock management, connection settings, and every ``*timeout``),
each with the values its type admits (every other value of an enum, the other value of a bool,
the extremes of a number, a short time for a timeout, and for the few free-text settings the
values of ``STRINGS``). A setting without values here and without a reason in ``EXCLUDED``
fails the test, so a new server's new setting is not skipped silently.

For each value, the setting is put on every session of the workload through the startup
``options`` (what ``ALTER ROLE ... SET`` and ``ALTER DATABASE ... SET`` also do): on the
caller's connections (every API of ``test_caller_state.OPS``, idle and in the caller's
transaction) and on pglock's own (leases, semaphores, the leader, the NOTIFY listener, a
Locker's pool), except the settings that end idle sessions (``OWN_ONLY``), which would end the
test's own idle connections and are put on pglock's only. The answers are checked against the
database as an observer with default settings sees it.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from _pgdb import with_params
from test_caller_state import OPS, World
from test_caller_state import db as db  # the module's database (a fixture)
from test_lease_support import lease_database

import pglock
from pglock import _lease, _registry, _source, _waiting

pytestmark = pytest.mark.timeout(600)

CATEGORIES = (
    "Client Connection Defaults / Statement Behavior",
    "Client Connection Defaults / Locale and Formatting",
    "Client Connection Defaults / Other Defaults",
    "Version and Platform Compatibility / Previous PostgreSQL Versions",
    "Version and Platform Compatibility / Other Platforms and Clients",
    "Error Handling",
    "Lock Management",
    "Connections and Authentication / Connection Settings",
    "Connections and Authentication / TCP Settings",
)

#: Free-text settings: the values to try (spaces are not allowed in ``-c`` options).
STRINGS: dict[str, list[str]] = {
    "DateStyle": [f"{s},{o}" for s in ("ISO", "SQL", "Postgres", "German")
                  for o in ("MDY", "DMY", "YMD")],
    "TimeZone": ["Pacific/Chatham", "America/St_Johns", "EST5EDT"],
    "client_encoding": ["SQL_ASCII", "LATIN1", "EUC_JP", "WIN1251"],
    "lc_messages": ["C"],
    "lc_monetary": ["C"],
    "lc_numeric": ["C"],
    "lc_time": ["C"],
    "default_text_search_config": ["pg_catalog.simple"],
    "timezone_abbreviations": ["Australia"],
    "restrict_nonsystem_relation_kind": ["view,foreign-table"],
}

#: Settings not tried, and why.
EXCLUDED: dict[str, str] = {
    "search_path": "axis (c): tests/integration/test_search_path.py shadows every name",
    "transaction_isolation": "at session start it is default_transaction_isolation",
    "transaction_read_only": "at session start it is default_transaction_read_only",
    "transaction_deferrable": "at session start it is default_transaction_deferrable",
    "default_tablespace": "names a tablespace, which the server must have",
    "temp_tablespaces": "names tablespaces, which the server must have",
    "default_table_access_method": "names an access method, which the server must have",
    "local_preload_libraries": "names libraries, which the server must have",
    "session_preload_libraries": "names libraries, which the server must have",
    "dynamic_library_path": "where libraries are found; pglock loads none",
    "password_encryption": "how new passwords are stored",
    "wal_sender_timeout": "replication connections only",
}
EXCLUDED_PREFIXES = {
    "vacuum_": "vacuum's freezing ages: no statement of pglock reads them",
    "gin_": "GIN indexes: pglock has none",
}

#: Settings that end idle sessions: on pglock's own connections only.
OWN_ONLY = {"idle_session_timeout", "idle_in_transaction_session_timeout"}

#: Where a setting makes an API's refusal the right answer: (setting, value) -> those APIs.
#: A read-only transaction cannot take the row lock of guard(), which fences a write.
REFUSED = {("default_transaction_read_only", "on"): {"guard"}}

#: The settings the issue named: the generator must find each.
NAMED = {
    "DateStyle", "client_encoding", "extra_float_digits", "default_transaction_isolation",
    "idle_session_timeout",
}

#: A short time for a ``*timeout`` (ms): shorter than the workload's waits and gaps.
SHORT = 50


def _values(row: tuple[Any, ...]) -> list[str] | None:
    """The values to try for one pg_settings row (None: no rule for it)."""
    name, vartype, setting, enumvals, min_val, max_val, unit = row
    if name in STRINGS:
        return [v for v in STRINGS[name] if v != setting]
    if vartype == "bool":
        return ["off" if setting == "on" else "on"]
    if vartype == "enum":
        return [v for v in enumvals if v != setting]
    if vartype in ("integer", "real"):
        if name.endswith("timeout") and unit == "ms":
            return [str(SHORT)]
        return [v for v in (min_val, max_val) if v != setting]
    return None


def generate(obs: psycopg.Connection[Any]) -> list[tuple[str, str]]:
    rows = obs.execute(
        "SELECT name, vartype, setting, enumvals, min_val, max_val, unit FROM pg_settings"
        " WHERE context IN ('user', 'superuser')"
        " AND (category = ANY(%s) OR name LIKE '%%timeout') ORDER BY name",
        (list(CATEGORIES),),
    ).fetchall()
    found: list[tuple[str, str]] = []
    missing: list[str] = []
    for row in rows:
        name = row[0]
        if name in EXCLUDED or any(name.startswith(p) for p in EXCLUDED_PREFIXES):
            continue
        values = _values(row)
        if values is None:
            missing.append(name)
            continue
        found += [(name, v) for v in values]
    assert missing == [], f"settings with no values to try and no reason not to: {missing}"
    assert {n for n, _ in found} >= NAMED
    return found


# --- the workload under one setting ----------------------------------------------------------


def _own_workload(w: World, dsn: str, idle: float) -> None:
    """Leases, semaphores, the leader and a Locker on pglock's own connections (``dsn``);
    ``idle``: seconds pglock's connections are left idle where a setting may end them."""
    obs, n = w.obs, w.name
    first = pglock.lease(dsn, n + ":own", ttl=10, metadata={"é": "ключ", "x": 1.25})
    assert first.acquire(timeout=0)
    row = obs.execute(
        "SELECT holder, token, metadata, expires_at FROM pglock.lease WHERE name = %s",
        (n + ":own",),
    ).fetchone()
    assert row is not None and row[:3] == (first.holder, first.token, {"é": "ключ", "x": 1.25})
    info = pglock.lease_info(dsn, n + ":own")
    assert info is not None and (info.holder, info.token) == (first.holder, first.token)
    assert info.expires_at == row[3] and 0 < info.expires_in <= 10
    assert info.metadata == {"é": "ключ", "x": 1.25}
    first.extend(20)
    # A waiter in the queue, handed the lease by the release (its NOTIFY, its heartbeat).
    second = pglock.lease(dsn, n + ":own", ttl=10)
    got: list[bool] = []
    t = threading.Thread(target=lambda: got.append(second.acquire(timeout=20)))
    t.start()
    deadline = time.monotonic() + 10
    while not obs.execute(
        "SELECT count(*) FROM pglock.lease_waiter WHERE name = %s", (n + ":own",)
    ).fetchone()[0] and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(idle)  # past an idle timeout of SHORT ms on its connections
    first.release()
    t.join(30)
    assert got == [True]
    row = obs.execute(
        "SELECT holder, token FROM pglock.lease WHERE name = %s", (n + ":own",)
    ).fetchone()
    assert row == (second.holder, second.token)
    # Every token above the WAL timeline's floor (revision 0004's token_epoch trigger), which
    # keeps tokens rising across a failover.
    floor = obs.execute(
        "SELECT ('x' || lpad(substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8), 16, '0'))"
        "::bit(64)::bigint << 40"
    ).fetchone()[0]
    assert min(first.token or 0, second.token or 0) >= floor
    second.release()

    sem = pglock.semaphore(dsn, n + ":ownsem", 1, ttl=10)
    with sem.hold(timeout=0) as permit:
        assert obs.execute(
            "SELECT count(*) FROM pglock.semaphore_permit WHERE semaphore = %s AND holder = %s",
            (n + ":ownsem", permit.holder),
        ).fetchone() == (1,)
        assert sem.acquire(timeout=0) is False
    sem.close()

    election = pglock.leader(dsn, n + ":leader", check_interval=0.1)
    election.start()
    try:
        assert election.wait_elected(timeout=10)
        time.sleep(idle)  # past an idle timeout of SHORT ms on its session
        assert election.is_leader
        assert obs.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted"
            " AND ((classid::bigint << 32) | objid::bigint) = %s",
            (pglock.key(n + ":leader"),),
        ).fetchone() == (1,)
    finally:
        election.resign()

    with pglock.Locker(dsn) as locker, locker.lock(n + ":locker", timeout=1) as c:
        assert w.held(c.info.backend_pid, n + ":locker") == ["ExclusiveLock"]


def _caller_workload(w: World, dsn: str, refused: set[str]) -> None:
    """Every API of test_caller_state.OPS once on a caller's connection with the setting, in
    autocommit or not by turns (those that need a transaction: not); ``refused``: the APIs
    whose answer under the setting is a clear refusal (pglock.InvalidConnectionState)."""
    conns = {ac: w.connect_to(dsn, autocommit=ac) for ac in (True, False)}
    for i, (op, spec) in enumerate(OPS.items()):
        autocommit = bool(i % 2) and not spec.needs_transaction
        c = conns[autocommit]
        try:
            if op in refused:
                with pytest.raises(pglock.InvalidConnectionState):
                    spec.op(w, c)
            else:
                spec.op(w, c)
            if not autocommit:
                c.rollback()
        except BaseException as exc:
            raise AssertionError(f"{op} (autocommit={autocommit}): {exc!r}") from exc
    # A timed attempt that fails must not end the session, nor lose what it holds.
    c = conns[True]
    rival = w.connect(autocommit=True)
    rival.execute("SELECT pg_advisory_lock(%s)", (pglock.key(w.name + ":busy2"),))
    with pglock.pg_lock(c, w.name + ":kept"):
        assert pglock.pg_lock(c, w.name + ":busy2", timeout=0.05).acquire() is False
        assert w.held(c.info.backend_pid, w.name + ":kept") == ["ExclusiveLock"]
    rival.execute("SELECT pg_advisory_unlock_all()")


@contextlib.contextmanager
def _world(dsn: str, app_name: str, name: str) -> Iterator[World]:
    w = World(dsn, app_name, name, shutdown=False)  # other values' pglock sources go on meanwhile
    try:
        yield w
    finally:
        w.close()


def _forget(dsn: str) -> None:
    """Close what pglock keeps for ``dsn`` (its connections, its listeners): the values run
    one after another, each with a DSN of its own, in one process and one server."""
    with _source._dsn_lock:
        src = _source._dsn_sources.pop(dsn, None)
    if src is not None:
        src.close()
    for key, lst in list(_waiting.waiters.listeners.items()):
        if key[0] == ("dsn", dsn):
            _waiting.waiters.stop_listener_if_idle(lst, idle_for=None)


def _one(dsn: str, app_name: str, setting: str, value: str, name: str) -> str | None:
    """The workload under ``setting = value``: None, or what went wrong."""
    base = with_params(dsn, application_name=app_name)
    hostile = with_params(base, options=f"-c {setting}={value.replace(' ', chr(92) + ' ')}")
    try:
        with _world(dsn, app_name, name) as w:
            refused = REFUSED.get((setting, value), set())
            _caller_workload(w, base if setting in OWN_ONLY else hostile, refused)
            _own_workload(w, hostile, 4 * SHORT / 1000 if setting in OWN_ONLY else 0.0)
    except Exception as exc:
        return f"{setting}={value}: {type(exc).__name__}: {exc}"
    finally:
        _forget(hostile)
    return None


def test_generated_session_settings_change_no_answer(
    db: str, app_name: str, name: str, capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    base = with_params(db, application_name=app_name)
    with psycopg.connect(base, autocommit=True) as obs:
        cases = generate(obs)
    started = time.monotonic()
    try:
        # Two at a time: each value has sessions, names and pglock sources of its own.
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            outcomes = list(pool.map(
                lambda c: _one(db, app_name, *c[1], f"{name}:{c[0]}"), enumerate(cases)
            ))
    finally:
        _lease.shutdown()
    with capsys.disabled():
        print(f"\n{len(cases)} setting values in {time.monotonic() - started:.1f} s")
    # The name registry, one value after another: it sends a process's first names at once,
    # later ones when a rate allows (pglock._registry), and the values above shared one budget.
    for i, (setting, value) in enumerate(cases):
        if setting not in OWN_ONLY:
            outcomes.append(_registered(db, app_name, setting, value, f"{name}:r{i}"))
    failures = [o for o in outcomes if o is not None]
    assert failures == [], "\n".join(failures)
    # A connection of pglock's own ended by idle_session_timeout is replaced quietly (INFO).
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING
                and r.name.startswith("pglock") and "idle-session" in r.getMessage()]


def _registered(dsn: str, app_name: str, setting: str, value: str, name: str) -> str | None:
    """A session lock taken under the setting has its name recorded (pglock status shows it)."""
    base = with_params(dsn, application_name=app_name)
    hostile = with_params(base, options=f"-c {setting}={value.replace(' ', chr(92) + ' ')}")
    _registry.clear()
    try:
        with (
            psycopg.connect(hostile, autocommit=True) as c, pglock.pg_lock(c, name),
            psycopg.connect(base, autocommit=True) as obs,
        ):
            names = [x.name for x in pglock.advisory_locks(obs, name)]
        assert names == [name], names
    except Exception as exc:
        return f"{setting}={value}: the name registry: {type(exc).__name__}: {exc}"
    return None


def test_tokens_stay_above_the_timeline_floor_whatever_session_replication_role(
    pg_dsn: str, app_name: str
) -> None:
    """The generated run above grants its first lease under default settings, which moves the
    token sequence above the WAL timeline's floor for good; here the first grant of a new
    database comes from a session whose session_replication_role is replica, under which an
    ordinary trigger (token_epoch, before revision 0005) does not fire."""
    with lease_database(pg_dsn) as dsn:
        hostile = with_params(dsn, application_name=app_name,
                              options="-c session_replication_role=replica")
        with pglock.lease(hostile, "first", ttl=10) as lease, psycopg.connect(dsn) as obs:
            floor = obs.execute(
                "SELECT ('x' || lpad(substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8), 16,"
                " '0'))::bit(64)::bigint << 40"
            ).fetchone()
            assert floor is not None and lease.token is not None
            assert lease.token >= floor[0]
