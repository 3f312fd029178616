"""Django for tests, against the test server: configured once per process with
``settings.configure()`` (no models, no test database creation), and a database alias pointed
at a DSN with the given settings for the length of a ``with`` block, then closed (its
connection and, for ``OPTIONS["pool"]``, its pool) and forgotten.

Importable from every test module as ``_djangodb`` (as ``_pgdb``). Not a package named
``django``: tests/ is on ``sys.path``, and that would shadow Django itself.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from psycopg.conninfo import conninfo_to_dict

#: libpq parameters that have a settings key of their own in Django's DATABASES.
OWN_KEYS = {"dbname": "NAME", "user": "USER", "password": "PASSWORD", "host": "HOST",
             "port": "PORT"}


def configure() -> None:
    """Configure Django once for this process (an empty DATABASES, UTC, no apps)."""
    import django
    from django.conf import settings

    if not settings.configured:
        settings.configure(DATABASES={}, USE_TZ=True, TIME_ZONE="UTC", INSTALLED_APPS=[])
        django.setup()


def database_settings(dsn: str, **overrides: Any) -> dict[str, Any]:
    """A DATABASES entry for Django's PostgreSQL backend connecting where ``dsn`` says (every
    libpq parameter kept: those Django has no key for go in OPTIONS); ``overrides`` replace
    keys, and an ``OPTIONS`` override is merged into the one from the DSN."""
    params = conninfo_to_dict(dsn)
    entry: dict[str, Any] = {"ENGINE": "django.db.backends.postgresql"}
    options: dict[str, Any] = {}
    for key, value in params.items():
        if key in OWN_KEYS:
            entry[OWN_KEYS[key]] = value
        else:
            options[key] = value
    options.update(overrides.pop("OPTIONS", {}))
    entry["OPTIONS"] = options
    entry.update(overrides)
    return entry


def forget(alias: str) -> None:
    """Close this thread's connection of ``alias`` and its pool, and forget both."""
    from django.db import connections

    wrapper = getattr(connections._connections, alias, None)
    if wrapper is None:
        return
    try:
        wrapper.close()
    finally:
        pools = getattr(type(wrapper), "_connection_pools", {})
        if alias in pools:
            pools.pop(alias).close()
        del connections[alias]


@contextlib.contextmanager
def database(dsn: str, alias: str = "default", **overrides: Any) -> Iterator[Any]:
    """Point Django's ``alias`` at ``dsn`` (see :func:`database_settings`) for the block;
    yields ``connections[alias]`` (not connected yet)."""
    configure()
    from django.db import connections

    entry = database_settings(dsn, **overrides)
    # configure_settings() fills Django's defaults (AUTOCOMMIT, CONN_MAX_AGE, TEST, ...).
    full = connections.configure_settings({"default": entry})["default"]
    forget(alias)
    connections.settings[alias] = full
    try:
        yield connections[alias]
    finally:
        forget(alias)
