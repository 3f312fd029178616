"""The revisions' SQL files: shipped in the package, frozen once released, and, from revision
0004 on, defining functions under versioned names only (docs/alembic.md)."""

from __future__ import annotations

import hashlib
import re
from importlib import resources
from pathlib import Path

import pytest

from pglock import _schema
from pglock._contract import NAMES_MARKER, NAMES_TABLE
from pglock.migrations import split, sql_file

# Released revisions never change: what they install is what clients of that release call.
# A change goes into a new revision. sha256 of the statements rendered for schema "pglock".
FROZEN = {
    ("pglock_0001", "upgrade"): "002dde927d55f823",
    ("pglock_0001", "downgrade"): "c95508d53fb3b921",
    ("pglock_0002", "upgrade"): "ddab2692d28104be",
    ("pglock_0002", "downgrade"): "ab51c24bc21beb0f",
    ("pglock_0003", "upgrade"): "9ad255ac04d197dc",
    ("pglock_0003", "downgrade"): "7a6d8778502c6fc2",
}

_CREATE_FUNCTION = re.compile(
    r"\bCREATE\s+(?:OR\s+REPLACE\s+)?FUNCTION\s+(?:\{s\}\.|[\w\"]+\.)?\"?(\w+)\"?\s*\(",
    re.IGNORECASE,
)


def unversioned_functions(text: str) -> list[str]:
    """The functions ``text`` creates whose name does not end in ``_v<N>``."""
    return [n for n in _CREATE_FUNCTION.findall(text) if not re.search(r"_v\d+$", n)]


def sql_names() -> list[str]:
    root = resources.files("pglock").joinpath("sql")
    return sorted(p.name.removesuffix(".sql") for p in root.iterdir() if p.name.endswith(".sql"))


@pytest.mark.parametrize("rev", _schema.revisions(), ids=lambda r: r.revision)
def test_every_revision_finds_its_sql(rev: _schema.Revision) -> None:
    stem = Path(str(rev.module.__file__)).stem
    for direction in ("up", "down"):
        assert sql_file(f"{stem}.{direction}").strip()
        assert split(f"{stem}.{direction}")
    assert rev.upgrade_statements("pglock")
    assert rev.module.downgrade_statements("pglock")


def test_no_stray_sql_files() -> None:
    stems = {Path(str(r.module.__file__)).stem for r in _schema.revisions()}
    assert sql_names() == sorted(f"{s}.{d}" for s in stems for d in ("down", "up"))


@pytest.mark.parametrize(("revision", "direction"), sorted(FROZEN))
def test_released_revisions_are_frozen(revision: str, direction: str) -> None:
    (rev,) = [r for r in _schema.revisions() if r.revision == revision]
    stmts = getattr(rev.module, f"{direction}_statements")("pglock")
    text = ";\n".join(s.as_string(None) for s in stmts)
    assert hashlib.sha256(text.encode()).hexdigest()[:16] == FROZEN[(revision, direction)]


def test_registry_comment_carries_the_marker() -> None:
    """pglock trusts ``<schema>.lock_names`` only while its comment starts with the marker."""
    text = sql_file("0003_lock_names.up")
    assert f"COMMENT ON TABLE {{s}}.{NAMES_TABLE} IS '{NAMES_MARKER}" in text


def test_new_functions_are_versioned() -> None:
    for name in sql_names():
        if int(name.split("_", 1)[0]) > 3:
            assert unversioned_functions(sql_file(name)) == [], name


def test_checker_rejects_an_unversioned_function() -> None:
    bad = "CREATE OR REPLACE FUNCTION {s}.lease_acquire(p_name text)\nRETURNS boolean"
    assert unversioned_functions(bad) == ["lease_acquire"]
    assert unversioned_functions("create function {s}.extend (x int)") == ["extend"]
    good = "CREATE FUNCTION {s}.lease_acquire_v4(p text); CREATE OR REPLACE FUNCTION x.y_v12()"
    assert unversioned_functions(good) == []
    # The shipped revisions before the rule have unversioned names: the checker sees them.
    assert "acquire" in unversioned_functions(sql_file("0001_leases.up"))


def test_split_keeps_semicolons_inside_quotes_and_comments() -> None:
    from pglock import migrations

    text = "-- a; b\nSELECT ';';\n\nDO $x$ BEGIN PERFORM 1; END $x$;\n-- end;\n"
    assert migrations._split_text(text) == ["SELECT ';'", "DO $x$ BEGIN PERFORM 1; END $x$"]
