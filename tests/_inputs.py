"""The input-types axis (tests/unit/test_input_coercion.py and
tests/integration/test_input_types.py): every public parameter of pglock, found from the API
itself, with plain sample values from one table (:data:`PARAMS`) and, for each, its variants:
subclasses of ``str``/``int``/``float``/``dict``/``list``/``tuple``/``set`` that answer for
themselves (their own ``__str__``, ``__hash__``, ``__eq__``, ``encode``, ``__float__``,
comparisons), str/int/float Enum members, ``StrEnum``/``IntEnum`` members, and Mappings that
are not dicts. pglock must take each by value: a variant is the same lock, lease, key, error
and state as its plain value.

This module holds no tests. Importable from every test module as ``_inputs``.
"""

from __future__ import annotations

import enum
import inspect
import math
import sys
import types
import typing
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import pglock
import pglock.alembic
import pglock.sqlalchemy

if sys.version_info >= (3, 11):
    from typing import Self, Unpack
else:  # pragma: no cover - Python 3.10
    from typing_extensions import Self, Unpack

#: The modules whose ``__all__`` is the public API.
MODULES = (pglock, pglock.sqlalchemy, pglock.alembic)

#: Public classes pglock builds and hands out (rows, permits): their constructors take nothing
#: from a caller.
RESULTS = frozenset(
    {
        pglock.AdvisoryLock,
        pglock.LeaseInfo,
        pglock.SemaphoreInfo,
        pglock.SemaphoreHolder,
        pglock.Permit,
    }
)


# --- the public surface -------------------------------------------------------------------


def _hints(fn: Callable[..., Any]) -> dict[str, Any]:
    try:
        return typing.get_type_hints(fn, localns={"Self": Self})
    except NameError:  # an annotation only a type checker can resolve
        return {}


def _classes_in(hint: Any) -> Iterator[type]:
    """pglock's own classes named by a type hint (``Lease | None``, ``list[LeaseInfo]``...)."""
    if isinstance(hint, type):
        if hint.__module__.startswith("pglock"):
            yield hint
        return
    for arg in typing.get_args(hint):
        yield from _classes_in(arg)


def _parameters(fn: Callable[..., Any]) -> list[str]:
    """The names a caller passes to ``fn`` (``**options: Unpack[SomeOptions]``: each key)."""
    names: list[str] = []
    hints = _hints(fn)
    for p in inspect.signature(fn).parameters.values():
        hint = hints.get(p.name)
        if p.kind is p.VAR_KEYWORD and typing.get_origin(hint) is Unpack:
            names.extend(typing.get_type_hints(typing.get_args(hint)[0]))
        elif p.name != "self":
            names.append(p.name)
    return names


def surface() -> dict[str, tuple[Callable[..., Any], list[str]]]:
    """Every public callable, ``qualname -> (callable, parameter names)``: the functions and
    classes of :data:`MODULES`, and the public methods of every pglock class any of them
    returns (``Locker.lease`` -> ``Lease``, ``RWLock.read`` -> ``RWHold``...)."""
    found: dict[str, tuple[Callable[..., Any], list[str]]] = {}
    todo: list[type] = []
    for mod in MODULES:
        prefix = "" if mod is pglock else mod.__name__.removeprefix("pglock.") + "."
        for n in mod.__all__:
            obj = getattr(mod, n)
            if isinstance(obj, type) and issubclass(obj, BaseException):
                continue
            if isinstance(obj, type):
                todo.append(obj)
                if obj not in RESULTS:
                    found[prefix + n] = (obj, _parameters(obj))
            elif callable(obj):
                found[prefix + n] = (obj, _parameters(obj))
                todo.extend(_classes_in(_hints(obj).get("return")))
    seen: set[type] = set()
    while todo:
        cls = todo.pop()
        if cls in seen or issubclass(cls, BaseException):
            continue
        seen.add(cls)
        for n, member in inspect.getmembers(cls, inspect.isfunction):
            if not n.startswith("_"):
                found[f"{cls.__name__}.{n}"] = (member, _parameters(member))
                todo.extend(_classes_in(_hints(member).get("return")))
    return found


# --- the variants ---------------------------------------------------------------------------


def by_value(value: Any) -> Any:
    """The test's own reading of a value (not pglock's): the builtin type's own copy of it."""
    copies = ((bool, bool), (str, str.__str__), (int, int.__index__), (float, float.__float__))
    for kind, copy in copies:
        if isinstance(value, kind):
            return copy(value)
    return value


class Str(str):
    """A str that answers for itself: printed, hashed, compared, encoded and concatenated
    otherwise than its value (an input taken by identity)."""

    def __str__(self) -> str:
        return f"Str<{str.__str__(self)}>"

    __repr__ = __str__

    def __format__(self, spec: str) -> str:
        return self.__str__()

    def __hash__(self) -> int:
        return hash(("Str", str.__str__(self)))

    def __eq__(self, other: object) -> bool:
        return type(other) is Str and str.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    def encode(self, encoding: str = "utf-8", errors: str = "strict") -> bytes:
        return str.encode(self.__str__(), encoding, errors)

    def __add__(self, other: str) -> str:
        return Str(str.__add__(self.__str__(), other))

    def __radd__(self, other: str) -> str:
        return Str(str.__add__(other, self.__str__()))


class Int(int):
    """An int that answers for itself: as a float, in comparisons, printed and hashed it is
    not its value."""

    def __float__(self) -> float:
        return int.__index__(self) + 1000.5

    def __str__(self) -> str:
        return f"Int<{int.__repr__(self)}>"

    __repr__ = __str__

    def __format__(self, spec: str) -> str:
        return self.__str__()

    def __hash__(self) -> int:
        return hash(("Int", int.__index__(self)))

    def __eq__(self, other: object) -> bool:
        return type(other) is Int and int.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    def __lt__(self, other: object) -> bool:
        return False

    __le__ = __gt__ = __ge__ = __lt__


class Float(float):
    """A float that answers for itself, as :class:`Int` does."""

    def __float__(self) -> float:
        return float.__float__(self) + 1000.5

    def __int__(self) -> int:
        return 1000

    def __str__(self) -> str:
        return f"Float<{float.__repr__(self)}>"

    __repr__ = __str__

    def __format__(self, spec: str) -> str:
        return self.__str__()

    def __hash__(self) -> int:
        return hash(("Float", float.__float__(self)))

    def __eq__(self, other: object) -> bool:
        return type(other) is Float and float.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    def __lt__(self, other: object) -> bool:
        return False

    __le__ = __gt__ = __ge__ = __lt__


class Dict(dict):  # type: ignore[type-arg]
    """A dict subclass (json.dumps takes it through its own items())."""


class List(list):  # type: ignore[type-arg]
    pass


class Tuple(tuple):  # type: ignore[type-arg]
    pass


class FrozenSet(frozenset):  # type: ignore[type-arg]
    pass


class Map(Mapping[Any, Any]):
    """A Mapping that is not a dict (json.dumps refuses it)."""

    def __init__(self, items: dict[Any, Any]) -> None:
        self._items = items

    def __getitem__(self, key: Any) -> Any:
        return self._items[key]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)


def _member(base: type | None, value: Any, *, std: type[enum.Enum] | None = None) -> Any:
    """A member with ``value`` of a new Enum: ``class E(base, Enum)``, or of ``std``."""
    if std is not None:
        return std("Std" + type(value).__name__.title(), {"M": value})["M"]  # type: ignore
    return enum.Enum("Mixed" + type(value).__name__.title(), {"M": value}, type=base)["M"]


#: Each family of variants: how it turns a plain leaf or container into its kind (None: left
#: plain). bool is left plain everywhere: it has no subclasses.
FAMILIES: dict[str, dict[type, Callable[[Any], Any]]] = {
    "subclass": {
        str: Str,
        int: Int,
        float: Float,
        dict: Dict,
        list: List,
        tuple: Tuple,
        frozenset: FrozenSet,
        set: FrozenSet,
    },
    "enum": {
        str: lambda v: _member(str, v),
        int: lambda v: _member(int, v),
        float: lambda v: _member(float, v),
        dict: Map,
    },
    "stdenum": {
        str: lambda v: _member(None, v, std=enum.StrEnum),
        int: lambda v: _member(None, v, std=enum.IntEnum),
        dict: types.MappingProxyType,
    },
}
if sys.version_info < (3, 11):  # pragma: no cover - no StrEnum
    del FAMILIES["stdenum"][str]


def _convert(value: Any, family: dict[type, Callable[[Any], Any]]) -> Any:
    kind = type(value)
    if kind is dict:
        items = {_convert(k, family): _convert(v, family) for k, v in value.items()}
        return family.get(dict, dict)(items)
    if kind in (list, tuple, set, frozenset):
        return family.get(kind, kind)(_convert(v, family) for v in value)
    if kind in (str, int, float) and kind in family:
        return family[kind](value)
    return value


def variants(plain: Any) -> list[tuple[str, Any]]:
    """``(family, variant)`` of ``plain`` for each family that changes something in it."""
    out = []
    for name, family in FAMILIES.items():
        v = _convert(plain, family)
        if typed(v) != typed(plain):
            out.append((name, v))
    return out


# --- comparing outcomes ---------------------------------------------------------------------


def typed(value: Any) -> Any:
    """``value`` with the exact type of every part, to compare by type as well as by value."""
    kind = type(value).__qualname__
    if isinstance(value, (str, int, float)) or value is None:
        v = by_value(value)
        return (kind, repr(v) if isinstance(v, float) else v)  # NaN equals NaN here
    if isinstance(value, Mapping):
        return (kind, sorted((repr(typed(k)), typed(v)) for k, v in value.items()))
    if isinstance(value, (set, frozenset)):
        return (kind, sorted(repr(typed(v)) for v in value))
    if isinstance(value, (list, tuple)):
        return (kind, [typed(v) for v in value])
    return (kind,)


def outcome(call: Callable[[], Any]) -> tuple[Any, ...]:
    """What ``call()`` returned (typed), or the exception it raised: its type, message and
    public attributes (``.name``, ``.holder``, ``.keys``...)."""
    try:
        return ("returned", typed(call()))
    except Exception as exc:
        attrs = {k: v for k, v in vars(exc).items() if not k.startswith("_")}
        return ("raised", type(exc).__qualname__, str(exc), typed(attrs))


# --- the one table --------------------------------------------------------------------------

#: A DSN on which nothing listens: what a constructor does without I/O needs no server.
NOWHERE = "postgresql://nobody@127.0.0.1:1/none"


@dataclass(frozen=True)
class Param:
    """What a parameter takes: ``valid`` and ``invalid`` plain samples (a callable of the
    test's DSN for a source); ``why`` says why one has no sample of a builtin type."""

    valid: tuple[Any, ...] = ()
    invalid: tuple[Any, ...] = ()
    why: str = ""
    dsn: bool = field(default=False)


_SOURCE = Param(dsn=True, invalid=("", "   "))
_FLAG = Param(valid=(True, False), why="bool has no subclass or Enum")
_OBJECT = "an object (connection, callable, provider): no builtin type to vary"

#: Every public parameter name, mapped to plain samples. A new public parameter without an
#: entry fails the tests: nothing is skipped silently.
PARAMS: dict[str, Param] = {
    # Where connections come from: a DSN is the form of a builtin type (str) they may take.
    "conn": _SOURCE,
    "source": _SOURCE,
    "target": _SOURCE,
    "pool_or_engine": _SOURCE,
    "connection_or_url": _SOURCE,
    "engine": _SOURCE,
    "engine_or_pool": _SOURCE,
    "name": Param(valid=("inputs:a",), invalid=("", "a\x00b", "x" * 1025)),
    "names": Param(
        valid=("inputs:a", ["inputs:b", "inputs:a"], ("inputs:c",), {"inputs:d", "inputs:e"}),
        invalid=([], ["inputs:a", ""], "a\x00b"),
    ),
    "namespace": Param(valid=("inputs",), invalid=("a:b", "")),
    "prefix": Param(valid=("inputs:",), invalid=("a\x00",)),
    "holder": Param(valid=("inputs-holder",), invalid=("", "h\x00")),
    "schema": Param(valid=("pglock",), invalid=("Bad", "pg_x", "")),
    "pooler": Param(valid=("auto", "session"), invalid=("bogus", "Auto")),
    "timeout": Param(valid=(2.5, 3), invalid=(-1.0, -1, math.nan, 10**10)),
    "ttl": Param(valid=(30.0, 45), invalid=(0, -1.0, 86401, math.nan)),
    "span_threshold": Param(valid=(0.25, 1), invalid=(-1.0, math.inf)),
    "check_interval": Param(valid=(1.0, 2), invalid=(0.01, 0, math.nan)),
    "takeover_delay": Param(valid=(0.25, 0), invalid=(-1.0, math.inf)),
    "network_timeout": Param(valid=(5.0, 4), invalid=(0.5, math.nan)),
    "limit": Param(valid=(3,), invalid=(0, -1, 2**31)),
    "permits": Param(valid=(1, 2), invalid=(0, 2**31)),
    "metadata": Param(
        valid=({"by": "api", "n": 3, "f": 1.5, "tags": ["x", 2, ("y",)], "ok": True, "no": None},),
        invalid=({"k": math.nan}, {"k": "a\x00b"}, {"a\x00": 1}, {"k": "x" * 70000}),
    ),
    "pool_kwargs": Param(valid=({"max_size": 2, "min_size": 1},), invalid=({"open": True},)),
    "shared": _FLAG,
    "blocking": _FLAG,
    "keepalive": _FLAG,
    "resume": _FLAG,
    "durable": _FLAG,
    "enabled": _FLAG,
    "on_lost": Param(why=_OBJECT),
    "on_elected": Param(why=_OBJECT),
    "name_label": Param(why=_OBJECT),
    "session_factory": Param(why=_OBJECT),
    "fn": Param(why=_OBJECT),
    "meter_provider": Param(why=_OBJECT),
    "tracer_provider": Param(why=_OBJECT),
    "args": Param(why="the caller's own arguments to its function, passed through untouched"),
    "kwargs": Param(why="the caller's own arguments to its function, passed through untouched"),
}


def samples(param: str, dsn: str) -> tuple[list[Any], list[Any]]:
    """(valid, invalid) plain samples of ``param``, a source's made from ``dsn``."""
    p = PARAMS[param]
    valid = [dsn] if p.dsn else list(p.valid)
    return valid, list(p.invalid)


def cases(names: list[str], dsn: str) -> Iterator[tuple[str, bool, Any, str, Any]]:
    """``(param, valid?, plain, family, variant)`` for every parameter in ``names``."""
    for param in names:
        valid, invalid = samples(param, dsn)
        for ok, group in ((True, valid), (False, invalid)):
            for plain in group:
                for family, variant in variants(plain):
                    yield param, ok, plain, family, variant
