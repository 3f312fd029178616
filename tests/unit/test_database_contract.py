"""The database contract pinned to its literal values: changing one breaks installed schemas."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from pglock import _contract, _keys


def test_literal_values() -> None:
    assert _contract.DEFAULT_SCHEMA == "pglock"
    assert _contract.MAX_TTL == 86400
    assert _contract.LIMIT_MISMATCH == "PGL01"
    assert (_contract.NAMES_TABLE, _contract.NAMES_MARKER) == ("lock_names", "pglock name registry")
    assert _contract.install_lock_key("pglock") == 1593980019309567809
    assert _contract.install_lock_key("pglock") == _keys.key("pglock:install:pglock")


@pytest.mark.parametrize(
    ("schema", "lease", "semaphore"),
    [
        ("pglock", "pglock_lease", "pglock_semaphore"),
        ("app_locks", "app_locks_lease", "app_locks_semaphore"),
        ("x" * 63, "x" * 57 + "_lease", "x" * 53 + "_semaphore"),
        # Cut in UTF-8 bytes, on a character boundary: what pg_notify() accepts.
        ("é" * 30, "é" * 28 + "_lease", "é" * 26 + "_semaphore"),
    ],
)
def test_channels(schema: str, lease: str, semaphore: str) -> None:
    assert _contract.lease_channel(schema) == lease
    assert _contract.semaphore_channel(schema) == semaphore
    assert len(lease.encode()) <= 63 and len(semaphore.encode()) <= 63


@pytest.mark.parametrize("schema", ["pglock", "_x", "a" * 63, "app_locks_2"])
def test_schema_accepted(schema: str) -> None:
    assert _contract.validate_schema(schema) == schema


@pytest.mark.parametrize(
    ("schema", "error"),
    [(None, TypeError), ("", ValueError), ("Pglock", ValueError), ("a" * 64, ValueError),
     ("pg_locks", ValueError), ("1abc", ValueError), ("é", ValueError), ("a;b", ValueError)],
)
def test_schema_refused(schema: object, error: type[Exception]) -> None:
    with pytest.raises(error):
        _contract.validate_schema(schema)


def test_leaf_module() -> None:
    """_contract imports nothing from pglock, so anything may import it."""
    tree = ast.parse(Path(_contract.__file__).read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            assert node.level == 0 and not (node.module or "").startswith("pglock")
        elif isinstance(node, ast.Import):
            assert not any(a.name.startswith("pglock") for a in node.names)


def test_revisions_import_only_the_contract() -> None:
    """pglock.migrations and its revisions take the contract from _contract alone (no
    _schema: that was an import cycle)."""
    root = Path(_contract.__file__).parent / "migrations"
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                module = node.module or ""
                ours = node.level > 0 or module.startswith("pglock")
                private = module.removeprefix("pglock.").startswith("_")
                assert not (ours and private) or module.endswith("_contract"), (path, module)
