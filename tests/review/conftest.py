"""Shared helpers for the hostile review's attack tests (tests/review/).

Every test here runs against the real server of the root conftest (``PGLOCK_TEST_DSN``), with
the pglock schema installed (idempotent), and is bounded by timeouts. Each test asserts what the
docs promise. A test that reproduces a finding is marked ``xfail(strict=True)`` with the
finding's number (run with ``--runxfail`` to see it fail); the others are attacks that held up.
"""

from __future__ import annotations

import pytest

import pglock


@pytest.fixture(scope="session")
def installed(pg_dsn: str) -> str:
    """``pg_dsn`` with the pglock schema installed (the name registry included)."""
    pglock.install(pg_dsn)
    return pg_dsn

