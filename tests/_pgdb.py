"""DSNs and throwaway databases for tests, whatever form the test server's DSN takes.

The server may come as a libpq ``key=value`` string, a TCP URI
(``postgresql://postgres@127.0.0.1:5432/test``) or, from the embedded ``pgserver``, a URI with
a Unix-socket directory in its query string (``postgresql://postgres:@/postgres?host=/tmp/x``).
String surgery on any of them breaks another, so every DSN or SQLAlchemy URL derived from the
server's goes through psycopg's conninfo parser here, which keeps every parameter.

Importable from every test module as ``_pgdb`` (pytest puts ``tests/`` on ``sys.path``, as it
holds the root conftest and no ``__init__.py``).
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

if TYPE_CHECKING:
    from sqlalchemy.engine import URL


def with_params(dsn: str, **params: Any) -> str:
    """``dsn`` as a libpq ``key=value`` string with ``params`` set (a ``None`` value removes
    a parameter); the host, a socket directory included, and everything else are kept."""
    return make_conninfo(dsn, **params)


def with_db(dsn: str, dbname: str, **params: Any) -> str:
    """The libpq DSN of database ``dbname`` on ``dsn``'s server."""
    return make_conninfo(dsn, dbname=dbname, **params)


def dbname_of(dsn: str) -> str:
    """The database ``dsn`` names (libpq's default, the user name, when it names none)."""
    p = conninfo_to_dict(dsn)
    return str(p.get("dbname") or p.get("user") or "postgres")


def sa_url(dsn: str, driver: str = "psycopg", **params: Any) -> URL:
    """A SQLAlchemy URL (``postgresql+<driver>``) for ``dsn`` with ``params`` set.

    A single TCP host goes in the URL's authority; a socket directory (or several hosts)
    goes in the query string, where SQLAlchemy's Postgres dialects hand it to the driver.
    Render it with ``render_as_string(hide_password=False)``; in an ``alembic.ini`` also
    double every ``%`` (ConfigParser interpolation).
    """
    from sqlalchemy.engine import URL

    p: dict[str, Any] = conninfo_to_dict(with_params(dsn, **params))
    user, password, dbname = p.pop("user", None), p.pop("password", None), p.pop("dbname", None)
    host, port = p.pop("host", None), p.pop("port", None)
    query = {k: str(v) for k, v in p.items()}
    single_tcp = (
        host is not None
        and not str(host).startswith(("/", "@"))
        and "," not in str(host)
        and (port is None or str(port).isdigit())
    )
    if single_tcp:
        url_host, url_port = str(host), int(port) if port is not None else None
    else:
        url_host, url_port = None, None
        if host is not None:
            query["host"] = str(host)
        if port is not None:
            query["port"] = str(port)
    return URL.create(
        f"postgresql+{driver}",
        username=user,
        password=password,
        host=url_host,
        port=url_port,
        database=dbname,
        query=query,
    )


def install_schema(dsn: str, schema: str = "pglock") -> None:
    """Install the pglock schema (every shipped revision) into the database at ``dsn``."""
    from pglock import _schema

    _schema.install(dsn, schema=schema)


@contextlib.contextmanager
def own_schema(pg_dsn: str, *, prefix: str) -> Iterator[str]:
    """Install the pglock schema under a new name in ``pg_dsn``'s database, yield the name, drop
    it afterwards: a module's own schema (other modules install and drop the default one)."""
    from pglock import _schema

    name = f"{prefix}_{uuid.uuid4().hex[:8]}"
    _schema.install(pg_dsn, schema=name)
    try:
        yield name
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as c:
            c.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(name)))


@contextlib.contextmanager
def throwaway_database(
    pg_dsn: str,
    *,
    prefix: str,
    install: bool = False,
    schemas: tuple[str, ...] = ("pglock",),
) -> Iterator[str]:
    """Create a database next to ``pg_dsn``'s, yield its libpq DSN, drop it afterwards.

    With ``install`` the pglock schema is installed into it under each name in ``schemas``.
    """
    dbname = f"{prefix}_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(pg_dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(dbname)))
    dsn = with_db(pg_dsn, dbname)
    try:
        if install:
            for schema in schemas:
                install_schema(dsn, schema)
        yield dsn
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as admin:
            # FORCE ends sessions still connected to it: only this test's, as the name is new.
            admin.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(dbname))
            )


def drop_roles(server_dsn: str, roles: Iterable[str], *, owned_in: Iterable[str] = ()) -> None:
    """Drop test ``roles`` (cluster-wide): end their sessions, drop what they own or were
    granted in each database DSN of ``owned_in``, then the roles (``IF EXISTS``)."""
    roles = list(roles)
    for dsn in owned_in:
        with psycopg.connect(dsn, autocommit=True) as admin:
            for role in roles:
                admin.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
    with psycopg.connect(server_dsn, autocommit=True) as admin:
        for role in roles:
            admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s",
                (role,),
            )
            admin.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(role)))
