"""The name -> key contract, name validation and timeout validation (no database)."""

from __future__ import annotations

import hashlib
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

import pglock
from pglock._keys import MAX_TIMEOUT, normalize_names, validate_name, validate_timeout

# Pinned literals: a change here breaks every deployed process that shares locks with an
# older version. Cross-checked independently in SQL (tests/integration/test_advisory_keys.py).
GOLDEN = [
    ("account:1", 6051513417264253602),
    ("a", -3848465438864589366),
    ("x", 3274422879871479876),
    (" ", 3938934374763561727),
    ("\u00e9", 5375421630974772051),  # precomposed é
    ("e\u0301", -4678546791977036110),  # e + combining acute: a different name
    ("\U0001f512 lock", -5947565950102618643),
    ("\u540d\u524d:\u30ed\u30c3\u30af", 8669883438701721941),
    ("a" * 1024, 3376741394271046068),  # the longest name accepted
    ("job:" + "z" * 500, 6359045308178564509),
]


@pytest.mark.parametrize(("name", "expected"), GOLDEN, ids=[repr(n[:12]) for n, _ in GOLDEN])
def test_golden_vectors(name: str, expected: int) -> None:
    assert pglock.key(name) == expected


def test_normalisation_is_not_applied() -> None:
    assert pglock.key("\u00e9") != pglock.key("e\u0301")
    assert pglock.key("A") != pglock.key("a")


@given(st.text(min_size=1, max_size=200).filter(lambda s: "\x00" not in s))
def test_key_matches_contract_and_range(name: str) -> None:
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return  # lone surrogates are rejected; tested below
    k = pglock.key(name)
    assert -(2**63) <= k < 2**63
    digest = hashlib.sha256(name.encode("utf-8")).digest()
    assert k == int.from_bytes(digest[:8], "big", signed=True)


def test_max_name_bytes_counts_utf8_bytes() -> None:
    assert pglock.MAX_NAME_BYTES == 1024
    validate_name("\u00e9" * 512)  # 1024 bytes
    with pytest.raises(ValueError, match="at most 1024 bytes"):
        validate_name("\u00e9" * 512 + "a")
    with pytest.raises(ValueError, match="at most 1024 bytes"):
        pglock.key("a" * 1025)


@pytest.mark.parametrize(
    ("bad", "exc", "match"),
    [
        ("", ValueError, "empty"),
        ("a\x00b", ValueError, "NUL"),
        ("\ud800", ValueError, "surrogate"),
        ("ok\udfffok", ValueError, "surrogate"),
        (b"account:1", TypeError, "str"),
        (None, TypeError, "str"),
        (42, TypeError, "str"),
        (["a"], TypeError, "str"),
    ],
)
def test_key_rejects_bad_names(bad: object, exc: type[Exception], match: str) -> None:
    with pytest.raises(exc, match=match):
        pglock.key(bad)  # type: ignore[arg-type]


def test_normalize_names_sorts_by_key_and_dedupes() -> None:
    names = ["b", "a", "c", "a"]
    pairs = normalize_names(names)
    assert [k for k, _ in pairs] == sorted({pglock.key(n) for n in names})
    assert sorted(n for _, n in pairs) == ["a", "b", "c"]
    assert normalize_names(("x",)) == [(pglock.key("x"), "x")]
    assert normalize_names("x") == [(pglock.key("x"), "x")]


@pytest.mark.parametrize(
    ("bad", "exc", "match"),
    [
        ([], ValueError, "at least one"),
        (set(), ValueError, "at least one"),
        (["a", 1], TypeError, "str"),
        (["a", b"b"], TypeError, "str"),
        (["a", ""], ValueError, "empty"),
        (b"a", TypeError, "bytes"),
        (bytearray(b"a"), TypeError, "bytes"),
        ({"a": 1}, TypeError, "list"),
        (iter(["a"]), TypeError, "list"),
        (None, TypeError, "list"),
    ],
)
def test_normalize_names_rejects(bad: object, exc: type[Exception], match: str) -> None:
    with pytest.raises(exc, match=match):
        normalize_names(bad)


@pytest.mark.parametrize("ok", [None, 0, 0.0, 1, 2.5, MAX_TIMEOUT])
def test_timeout_accepts(ok: object) -> None:
    got = validate_timeout(ok)
    assert got is None if ok is None else got == float(ok)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("bad", "exc", "match"),
    [
        (-1, ValueError, ">= 0"),
        (-0.001, ValueError, ">= 0"),
        (math.nan, ValueError, "NaN"),
        (math.inf, ValueError, "None to wait forever"),
        (-math.inf, ValueError, ">= 0"),
        (MAX_TIMEOUT + 1, ValueError, "at most"),
        (True, TypeError, "bool"),
        (False, TypeError, "bool"),
        ("5", TypeError, "str"),
        (b"5", TypeError, "bytes"),
        ([5], TypeError, "list"),
    ],
)
def test_timeout_rejects(bad: object, exc: type[Exception], match: str) -> None:
    with pytest.raises(exc, match=match):
        validate_timeout(bad)
