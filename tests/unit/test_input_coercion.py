"""Input types, the pure part: every public parameter of pglock (found by ``_inputs.surface()``)
taken by value before any I/O. For each parameter, each plain sample of ``_inputs.PARAMS`` and
each variant of it (a subclass that answers for itself, a str/int/float Enum member, a
StrEnum/IntEnum member, a Mapping that is not a dict, a dict subclass), what pglock makes of
the variant equals what it makes of the plain value, type included: every value a handle keeps
(its attributes, into pglock's own objects, and its public properties), a function's result,
and an error's type, message and attributes. The database part is
tests/integration/test_input_types.py."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import _inputs
import psycopg_pool
import pytest

import pglock
from pglock import _telemetry

NAME = "inputs:a"
NOWHERE = _inputs.NOWHERE


@pytest.fixture(scope="module")
def pool() -> Iterator[psycopg_pool.ConnectionPool[Any]]:
    """A pool that is never opened: locks made on it do no I/O until acquired."""
    p: psycopg_pool.ConnectionPool[Any] = psycopg_pool.ConnectionPool(NOWHERE, open=False)
    yield p
    p.close()


def _telemetry_state(kw: dict[str, Any]) -> Any:
    try:
        pglock.configure_telemetry(**kw)
        return _telemetry._state
    finally:
        pglock.configure_telemetry(enabled=False)


def _locker() -> pglock.Locker:
    return pglock.Locker(NOWHERE, namespace="inputs")


#: The callables exercised here, where no I/O happens before what is compared:
#: ``qualname -> (base keyword arguments, call)``; the pool is the test's unopened one.
PURE: dict[str, tuple[dict[str, Any], Callable[[Any, dict[str, Any]], Any]]] = {
    "key": ({"name": NAME}, lambda pool, kw: pglock.key(**kw)),
    "Locker": ({"source": NOWHERE, "namespace": "inputs"}, lambda pool, kw: pglock.Locker(**kw)),
    "Locker.full_name": ({"name": NAME}, lambda pool, kw: _locker().full_name(**kw)),
    "Locker.lease": ({"name": NAME}, lambda pool, kw: _locker().lease(**kw)),
    "Locker.lock": ({"names": NAME}, lambda pool, kw: _locker().lock(**kw)),
    "Locker.rwlock": ({"name": NAME}, lambda pool, kw: _locker().rwlock(**kw)),
    "Locker.singleton": ({"name": NAME}, lambda pool, kw: _locker().singleton(**kw)),
    "Locker.leader": ({"name": NAME}, lambda pool, kw: _locker().leader(**kw)),
    "Locker.semaphore": ({"name": NAME, "limit": 3}, lambda pool, kw: _locker().semaphore(**kw)),
    "lease": ({"source": NOWHERE, "name": NAME}, lambda pool, kw: pglock.lease(**kw)),
    "Lease": ({"source": NOWHERE, "name": NAME}, lambda pool, kw: pglock.Lease(**kw)),
    "semaphore": (
        {"source": NOWHERE, "name": NAME, "limit": 3},
        lambda pool, kw: pglock.semaphore(**kw),
    ),
    "Semaphore": (
        {"source": NOWHERE, "name": NAME, "limit": 3},
        lambda pool, kw: pglock.Semaphore(**kw),
    ),
    "Semaphore.hold": ({}, lambda pool, kw: pglock.semaphore(NOWHERE, NAME, 3).hold(**kw)),
    "leader": ({"source": NOWHERE, "name": NAME}, lambda pool, kw: pglock.leader(**kw)),
    "LeaderElection": (
        {"source": NOWHERE, "name": NAME},
        lambda pool, kw: pglock.LeaderElection(**kw),
    ),
    "pool_lock": (
        {"pool_or_engine": None, "names": NAME},
        lambda pool, kw: pglock.pool_lock(**{"pool_or_engine": pool, **_given(kw)}),
    ),
    "PoolLock": (
        {"source": None, "names": NAME},
        lambda pool, kw: pglock.PoolLock(**{"source": pool, **_given(kw)}),
    ),
    "rwlock": (
        {"source": None, "name": NAME},
        lambda pool, kw: pglock.rwlock(**{"source": pool, **_given(kw)}),
    ),
    "RWLock": (
        {"source": None, "name": NAME},
        lambda pool, kw: pglock.RWLock(**{"source": pool, **_given(kw)}),
    ),
    "RWLock.read": ({}, lambda pool, kw: pglock.rwlock(pool, NAME).read(**kw)),
    "RWLock.write": ({}, lambda pool, kw: pglock.rwlock(pool, NAME).write(**kw)),
    "singleton": (
        {"source": None, "name": NAME},
        lambda pool, kw: pglock.singleton(**{"source": pool, **_given(kw)}),
    ),
    "Singleton": (
        {"source": None, "name": NAME},
        lambda pool, kw: pglock.Singleton(**{"source": pool, **_given(kw)}),
    ),
    "configure_telemetry": ({}, lambda pool, kw: _telemetry_state(kw)),
}


def _given(kw: dict[str, Any]) -> dict[str, Any]:
    """``kw`` without the None placeholders of the base (filled with the test's pool)."""
    return {k: v for k, v in kw.items() if v is not None}


def _attrs(obj: Any) -> list[str]:
    names = list(getattr(obj, "__dict__", {}))
    for cls in type(obj).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        names.extend([slots] if isinstance(slots, str) else slots)
    return [n for n in dict.fromkeys(names) if hasattr(obj, n)]


def fingerprint(obj: Any) -> dict[str, Any]:
    """Every value ``obj`` keeps, by path: its attributes (into pglock's own objects and into
    containers) and the public properties of pglock's objects, each typed."""
    out: dict[str, Any] = {}
    seen: set[int] = set()

    def walk(path: str, v: Any, depth: int) -> None:
        if isinstance(v, (str, int, float)) or v is None:
            out[path] = _inputs.typed(v)
            return
        out[path] = (type(v).__qualname__,)
        if id(v) in seen or depth > 4:
            return
        seen.add(id(v))
        if isinstance(v, Mapping):
            for k, x in sorted(v.items(), key=lambda kv: repr(_inputs.typed(kv[0]))):
                walk(f"{path}[{_inputs.typed(k)!r}]", x, depth + 1)
        elif isinstance(v, (set, frozenset)):
            out[path] = _inputs.typed(v)
        elif isinstance(v, (list, tuple)):
            for i, x in enumerate(v):
                walk(f"{path}[{i}]", x, depth + 1)
        elif type(v).__module__.startswith("pglock"):
            for k in _attrs(v):
                walk(f"{path}.{k}", getattr(v, k), depth + 1)
            out.update(_properties(path, v))

    walk("", obj, 0)
    return out


def _properties(path: str, obj: Any) -> dict[str, Any]:
    """The outcome of reading each public property of ``obj``."""
    return {
        f"{path}:{k}": _inputs.outcome(lambda k=k: getattr(obj, k))
        for k, prop in vars(type(obj)).items()
        if isinstance(prop, property) and not k.startswith("_")
    }


def result(call: Callable[[Any, dict[str, Any]], Any], pool: Any, kw: dict[str, Any]) -> Any:
    """What ``call(pool, kw)`` made (the fingerprint of what it returned), or what it raised."""
    try:
        made = call(pool, kw)
    except Exception:
        return _inputs.outcome(lambda: call(pool, kw))
    return fingerprint(made)


def _diff(a: Any, b: Any, noise: set[str]) -> list[str]:
    if not (isinstance(a, dict) and isinstance(b, dict)):
        return [] if a == b else [f"{a!r}\n    != {b!r}"]
    return [
        f"{k}: {a.get(k)!r} != {b.get(k)!r}"
        for k in sorted(set(a) | set(b))
        if k not in noise and a.get(k) != b.get(k)
    ]


def test_every_public_parameter_has_an_entry() -> None:
    """A new public parameter (or one renamed) fails here until PARAMS says what it takes."""
    used = {p for _, params in _inputs.surface().values() for p in params}
    missing = sorted(used - set(_inputs.PARAMS))
    assert not missing, f"public parameters without an entry in _inputs.PARAMS: {missing}"
    stale = sorted(set(_inputs.PARAMS) - used)
    assert not stale, f"entries of _inputs.PARAMS no public callable takes: {stale}"


def test_every_builtin_typed_sample_has_variants() -> None:
    """Each plain sample of a str, int, float or container is varied by every family that can
    vary it; only bool (no subclass) and objects have none."""
    for param, p in _inputs.PARAMS.items():
        for plain in (*p.valid, *p.invalid, *(["dsn"] if p.dsn else [])):
            families = {f for f, _ in _inputs.variants(plain)}
            if isinstance(plain, bool) or plain is None:
                assert not families, (param, plain)
            else:
                assert "subclass" in families, (param, plain, families)
                if plain not in ([], {}):
                    assert "enum" in families, (param, plain, families)


def test_pure_covers_what_it_can() -> None:
    assert set(PURE) <= set(_inputs.surface())


@pytest.mark.parametrize(
    ("qualname", "param"),
    [
        (q, p)
        for q, (_, params) in sorted(_inputs.surface().items())
        if q in PURE
        for p in params
        if any(_inputs.cases([p], NOWHERE))
    ],
)
def test_a_variant_makes_what_its_plain_value_makes(
    qualname: str, param: str, pool: psycopg_pool.ConnectionPool[Any]
) -> None:
    """For ``param`` of ``qualname``: a variant of each valid sample makes a handle (or result)
    that keeps exactly what the plain value's keeps, by type as well as value; a variant of
    each invalid sample raises the same exception, message and attributes."""
    base, call = PURE[qualname]
    failures: list[str] = []
    checked = 0
    for _, _, plain, family, variant in _inputs.cases([param], NOWHERE):
        first = result(call, pool, {**base, param: plain})
        again = result(call, pool, {**base, param: plain})
        got = result(call, pool, {**base, param: variant})
        noise = (
            {k for k in set(first) | set(again) if first.get(k) != again.get(k)}
            if isinstance(first, dict) and isinstance(again, dict)
            else set()
        )
        diff = _diff(first, got, noise)
        if diff:
            failures.append(f"{family} {variant!r} (plain {plain!r}):\n  " + "\n  ".join(diff))
        checked += 1
    assert checked, f"no variant of {param} was checked"
    assert not failures, f"{qualname}: {len(failures)} variant(s) differ:\n" + "\n".join(failures)
