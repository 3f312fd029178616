"""The ``pglock`` command (also ``python -m pglock``; docs/reference/cli.md). Each subcommand is
a ``register_<name>(subparsers)`` in :data:`COMMANDS` that sets ``func`` (arguments -> exit
code). Errors are one line on stderr, ``pglock: error: ...``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any, NoReturn

import psycopg
from psycopg.conninfo import make_conninfo
from psycopg.errors import InsufficientPrivilege

from . import __version__, _conn, _inspect, _lease, _schema, _sql
from ._contract import DEFAULT_SCHEMA, validate_schema
from ._deadline import connect_extra
from ._keys import normalize_names
from .errors import SchemaNotInstalled

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130

PROG = "pglock"

EXIT_CODES_HELP = """\
exit codes:
  0    success (also a --watch ended with Ctrl-C, and a status that showed the advisory
       locks but not every section: it says which grant or install would show the rest)
  1    the operation failed: cannot connect, the database refused, the demo failed
  2    bad usage: unknown option, missing DSN, invalid name or schema
  130  interrupted (Ctrl-C)
"""


class UsageError(Exception):
    """Bad usage found after parsing (exit code 2)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # One line, not argparse's usage block.
        self.exit(EXIT_USAGE, f"{PROG}: error: {message} (see '{self.prog} --help')\n")


def one_line(exc: BaseException) -> str:
    """An exception as one readable line."""
    return " ".join(str(exc).split()) or type(exc).__name__


def _database_args(p: argparse.ArgumentParser, schema_help: str) -> None:
    p.add_argument(
        "--dsn", default=None, help="libpq connection string or URL (default: $PGLOCK_DSN)"
    )
    p.add_argument("--schema", default=DEFAULT_SCHEMA, help=schema_help)


def _schema_arg(args: argparse.Namespace) -> str:
    try:
        return validate_schema(args.schema)
    except (TypeError, ValueError) as exc:
        raise UsageError(str(exc)) from None


def _dsn(args: argparse.Namespace) -> str:
    dsn: str | None = args.dsn or os.environ.get("PGLOCK_DSN")
    if not dsn:
        raise UsageError("no database given: pass --dsn DSN or set PGLOCK_DSN")
    return dsn


def register_install(subparsers: argparse._SubParsersAction[_Parser]) -> None:
    p = subparsers.add_parser(
        "install", help="install or upgrade the pglock schema in a database",
        description=(
            "Install or upgrade the pglock schema (lease table, fencing-token sequence and "
            "functions). Idempotent; concurrent runs are safe."
        ),
    )
    _database_args(p, "schema to install into (default: pglock)")
    p.set_defaults(func=cmd_install)


def cmd_install(args: argparse.Namespace) -> int:
    schema = _schema_arg(args)
    applied = _schema.install(_dsn(args), schema=schema)
    if applied:
        print(f"{PROG}: installed schema {schema!r}: revision(s) {', '.join(applied)}")
    else:
        print(f"{PROG}: schema {schema!r} is up to date (revision {_schema.head()})")
    return EXIT_OK


def register_status(subparsers: argparse._SubParsersAction[_Parser]) -> None:
    p = subparsers.add_parser(
        "status", help="show who holds and who waits for locks, leases and semaphores",
        description=(
            "Show the advisory locks of a database (holders and waiters, by name where pglock "
            "took them, with pid, application, client and how long), and the live leases and "
            "semaphores of the pglock schema."
        ),
        epilog=EXIT_CODES_HELP, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("names", nargs="*", metavar="NAME", help="only these lock names")
    _database_args(p, "schema of the name registry, leases and semaphores (default: pglock)")
    p.add_argument("--json", action="store_true", help="print JSON (one object per refresh)")
    p.add_argument(
        "--watch", nargs="?", type=_seconds_arg, const=2.0, default=None, metavar="SECONDS",
        help="refresh every SECONDS (default 2) until Ctrl-C",
    )
    p.add_argument(
        "-v", "--verbose", action="store_true", help="also show each session's current query"
    )
    p.set_defaults(func=cmd_status)


def _seconds_arg(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not (0.1 <= value <= 3600):
        raise argparse.ArgumentTypeError("the refresh interval must be 0.1 to 3600 seconds")
    return value


def cmd_status(args: argparse.Namespace) -> int:
    schema = _schema_arg(args)
    try:
        names = [n for _, n in normalize_names(args.names)] if args.names else None
    except (TypeError, ValueError) as exc:
        raise UsageError(str(exc)) from None
    dsn = _dsn(args)
    conninfo = make_conninfo(dsn, **connect_extra(dsn))
    with psycopg.connect(
        conninfo, autocommit=True, application_name="pglock status", client_encoding="UTF8"
    ) as conn:
        if args.watch is None:
            _print_status(args, status_snapshot(conn, names, schema))
            return EXIT_OK
        clear = not args.json and sys.stdout.isatty()
        try:
            while True:
                snap = status_snapshot(conn, names, schema)
                if clear:
                    print("\x1b[H\x1b[2J", end="")  # clear the screen, cursor home
                _print_status(args, snap)
                time.sleep(args.watch)
        except KeyboardInterrupt:
            return EXIT_OK  # Ctrl-C is how a watch ends


def _print_status(args: argparse.Namespace, snap: dict[str, Any]) -> None:
    if args.json:
        print(json.dumps(snap, default=_json_default), flush=True)
    else:
        print(render_status(snap, verbose=args.verbose), flush=True)


def _json_default(value: object) -> str:
    if isinstance(value, datetime):
        return value.isoformat()
    raise TypeError(f"not JSON serializable: {type(value).__name__}")


#: Per section beyond the advisory locks: its title, what a role without the grant may not do,
#: and the grant ({s}: the schema).
_SECTIONS = {
    "names": ("Lock names", "read the name registry {s}.lock_names", "SELECT ON {s}.lock_names"),
    "sessions": ("Sessions of other roles", "see their start, client, query", "pg_read_all_stats"),
    "leases": ("Leases", "call {s}.leases()", "EXECUTE ON FUNCTION {s}.leases(text)"),
    "semaphores": ("Semaphores", "read {s}.semaphore and {s}.semaphore_permit",
                   "SELECT ON {s}.semaphore, {s}.semaphore_permit"),
}


def _error(section: str, schema: str, role: str | None, usage: bool | None) -> dict[str, Any]:
    """The ``errors`` entry of a section not shown: the schema is missing (``role`` None) or
    the role may not read it; ``fix`` says what would show it."""
    if role is None:
        message = f"the pglock schema {schema!r} is not installed in this database (or is old)"
        fix = [f"pglock install --dsn DSN --schema {schema}"]
        return {"error": "not_installed", "message": message, "fix": fix}
    _, what, grant = _SECTIONS[section]
    fix = [f"GRANT {grant.format(s=schema)} TO {role};"]
    if usage is False and "{s}" in grant:  # objects in the schema need USAGE on it too
        fix.insert(0, f"GRANT USAGE ON SCHEMA {schema} TO {role};")
    message = f"role {role} may not {what.format(s=schema)}"
    return {"error": "permission_denied", "message": message, "fix": fix}


def status_snapshot(conn: Any, names: list[str] | None, schema: str) -> dict[str, Any]:
    """What ``pglock status`` shows, as plain data (the ``--json`` document). A section not
    installed or not readable (42501) is None with an entry in ``errors``; the advisory locks
    need no grant, so their errors propagate."""
    c = _conn.resolve(conn, "pglock status").conn
    _conn.check_usable(c)
    with _conn.utf8(c):
        header = _conn.fetch(c, _sql.status_header(schema), binary=True, alone=True)[0][0]
        return _snapshot(conn, names, schema, header)


def _snapshot(conn: Any, names: list[str] | None, schema: str, header: Any) -> dict[str, Any]:
    db, now, version, role, usage, registry = header
    locks = _inspect.advisory_locks(conn, names, schema=schema)
    doc: dict[str, Any] = {
        "database": db, "server_time": now, "server_version": version, "schema": schema,
        "schema_installed": usage is not None, "advisory_locks": [_lock_doc(lk) for lk in locks],
        "leases": None, "semaphores": None, "errors": {},
    }
    if registry is False or (registry and usage is False):
        doc["errors"]["names"] = _error("names", schema, role, usage)
    if any(lk.pid is not None and lk.backend_start is None for lk in locks):
        doc["errors"]["sessions"] = _error("sessions", schema, role, usage)
    for section, read in (
        ("leases", lambda: _lease.list_leases(conn, schema=schema)),
        ("semaphores", lambda: _inspect.semaphores(conn, schema=schema)),
    ):
        try:
            items = read()
        except SchemaNotInstalled:  # SQLSTATE 3F000, 42P01, 42883
            doc["errors"][section] = _error(section, schema, None, usage)
        except InsufficientPrivilege:  # SQLSTATE 42501
            doc["errors"][section] = _error(section, schema, role, usage)
        else:
            doc[section] = [
                dataclasses.asdict(x) for x in items if names is None or x.name in names
            ]
    return doc


def _lock_doc(lock: Any) -> dict[str, Any]:
    extra = {"label": lock.label, "held_for": lock.held_for, "waiting_for": lock.waiting_for}
    return dataclasses.asdict(lock) | extra


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return ""
    if seconds < 1:
        return f"{seconds * 1000:.0f}ms"
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{hours}h{minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d{hours:02d}h"


def _visible(text: str) -> str:
    """``text`` safe for a terminal: every character that is not printable (C0 and C1 controls,
    DEL, the ESC of ANSI sequences, line breaks, tabs, bidi and other format characters) and
    every backslash as its Python escape (``\\x1b``, ``\\n``, ``\\u202e``, ``\\\\``), so
    text from the database can neither forge a row nor change the terminal's state."""
    if text.isprintable() and "\\" not in text:
        return text
    return "".join(
        c if c.isprintable() and c != "\\" else c.encode("unicode_escape").decode() for c in text
    )


def _cut(text: str, width: int, *, raw: bool = False) -> str:
    """A cell: ``text`` made :func:`_visible` (unless ``raw``), cut to ``width`` characters."""
    text = text if raw else _visible(text)
    return text if len(text) <= width else text[: width - 3] + "..."


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    return [
        ("  " + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True))).rstrip()
        for row in [header, *rows]
    ]


def render_status(snap: dict[str, Any], *, verbose: bool = False) -> str:
    """``pglock status`` as a readable text table."""
    when, errors = snap["server_time"], snap["errors"]
    lines = [
        f"pglock status: database {snap['database']!r} "
        f"(PostgreSQL {_visible(snap['server_version'])}), "
        f"{when:%Y-%m-%d %H:%M:%S %Z}".rstrip(),
        "",
    ]
    lines += _advisory_section(snap["advisory_locks"], verbose)
    for section in ("names", "sessions"):
        if section in errors:
            lines += ["  " + line for line in _error_lines(section, errors[section])]
    for section, render in (("leases", _lease_section), ("semaphores", _semaphore_section)):
        lines.append("")
        if snap[section] is None:
            lines += _error_lines(section, errors[section])
        else:
            lines += render(snap[section])
    return "\n".join(lines)


def _error_lines(section: str, error: dict[str, Any]) -> list[str]:
    head = f"{_SECTIONS[section][0]}: not shown: {error['message']}; to show them, run:"
    return [_visible(head)] + ["    " + _visible(fix) for fix in error["fix"]]


def _advisory_row(lk: dict[str, Any], same: bool) -> tuple[list[str], bool]:
    """One table row of an advisory lock, and whether its FOR column is an upper bound."""
    client = lk["client_addr"] or ("local" if lk["backend_start"] else "")  # else: hidden
    if lk["client_addr"] and lk["client_port"]:
        client = f"{client}:{lk['client_port']}"
    bounded = False
    if lk["granted"]:
        since = _duration(lk["held_for"])
        if lk["held_since_basis"] == "session" and since:
            since, bounded = "<=" + since, True
        state = "held"
    else:
        since = _duration(lk["waiting_for"])
        state = "waiting"
        if lk["blocked_by"]:
            state += " for " + ",".join(str(p) for p in lk["blocked_by"])
    label = "" if same else _cut(lk["label"], 48)
    app = _cut(lk["application_name"] or "", 28)
    row = [label, _cut(lk["mode"], 16), state, str(lk["pid"] or "-"), app, _cut(client, 60)]
    return [*row, since], bounded


def _advisory_section(locks: list[dict[str, Any]], verbose: bool) -> list[str]:
    held = sum(1 for lk in locks if lk["granted"])
    lines = [f"Advisory locks: {held} held, {len(locks) - held} waiting"]
    if not locks:
        return lines
    rows = [  # a lock's second and later sessions leave the LOCK column empty
        _advisory_row(lk, i > 0 and lk["label"] == locks[i - 1]["label"])
        for i, lk in enumerate(locks)
    ]
    header = ["LOCK", "MODE", "STATE", "PID", "APPLICATION", "CLIENT", "FOR"]
    table = _table(header, [row for row, _ in rows])
    lines.append(table[0])
    for line, lk in zip(table[1:], locks, strict=True):
        lines.append(line)
        if verbose and lk["query"]:
            lines.append("      query: " + _cut(" ".join(lk["query"].split()), 100))
    if any(bounded for _, bounded in rows):
        lines.append(
            "  <= : at most this long (the session ran other statements since it took the "
            "lock; this is the session's age)"
        )
    if any(lk["name"] is None and lk["key"] is not None for lk in locks):
        lines.append(
            "  (a key without a name was not taken by pglock, or the name registry of "
            "'pglock install' is missing in this database)"
        )
    return lines


def _metadata_cell(metadata: Any) -> str:
    # ensure_ascii JSON is printable ASCII: escaping its own escapes would double them.
    return _cut(json.dumps(metadata), 40, raw=True) if metadata is not None else ""


def _lease_section(leases: list[dict[str, Any]]) -> list[str]:
    lines = [f"Leases: {len(leases)} live"]
    rows = [
        [_cut(le["name"], 48), _cut(le["holder"], 32), str(le["token"]),
         _duration(le["expires_in"]), _metadata_cell(le["metadata"])]
        for le in leases
    ]
    if rows:
        lines += _table(["NAME", "HOLDER", "TOKEN", "EXPIRES IN", "METADATA"], rows)
    return lines


def _semaphore_section(sems: list[dict[str, Any]]) -> list[str]:
    lines = [f"Semaphores: {len(sems)}"]
    if not sems:
        return lines
    rows: list[list[str]] = []
    for s in sems:
        label = f"{s['held']}/{s['limit']}" + (" (waiters)" if s["waiters"] else "")
        if not s["holders"]:
            rows.append([_cut(s["name"], 48), label, "", "", "", ""])
        for i, h in enumerate(s["holders"]):
            rows.append([
                "" if i else _cut(s["name"], 48), "" if i else label, _cut(h["holder"], 32),
                str(h["permits"]), _duration(h["expires_in"]), _metadata_cell(h["metadata"]),
            ])
    lines += _table(["NAME", "PERMITS", "HOLDER", "HOLDS", "EXPIRES IN", "METADATA"], rows)
    return lines


def register_demo(subparsers: argparse._SubParsersAction[_Parser]) -> None:
    p = subparsers.add_parser(
        "demo", help="watch worker processes race for jobs with pglock and without",
        description=(
            "Worker processes race for a batch of jobs, first guarded by pglock, then "
            "unguarded, and the summary counts the jobs that ran twice. Without --dsn an "
            "embedded Postgres (pip install 'pglock[embedded]') is started in a temporary "
            "directory and removed afterwards; with --dsn the demo works in a throwaway schema "
            "pglock_demo that it drops at the end."
        ),
        epilog=EXIT_CODES_HELP, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--dsn", default=None,
        help="use this server instead of an embedded one (PGLOCK_DSN is not read here)",
    )
    p.add_argument(
        "--workers", type=_count_arg(1, 64), default=4, help="worker processes (default 4)"
    )
    p.add_argument(
        "--jobs", type=_count_arg(1, 100_000), default=200, help="jobs in the batch (default 200)"
    )
    p.set_defaults(func=cmd_demo)


def _count_arg(low: int, high: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be {low} to {high}")
        return value

    return parse


def cmd_demo(args: argparse.Namespace) -> int:
    from ._demo import run_demo

    result = run_demo(args.dsn, workers=args.workers, jobs=args.jobs)
    if result.with_lock.duplicates:
        print(f"{PROG}: error: the demo saw duplicates with pglock", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


#: The subcommands, in the order ``--help`` lists them.
COMMANDS: list[Callable[[argparse._SubParsersAction[_Parser]], None]] = [
    register_install, register_status, register_demo,
]


def build_parser() -> _Parser:
    parser = _Parser(
        prog=PROG, description="pglock: distributed locks on Postgres alone.",
        epilog=EXIT_CODES_HELP, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    version = f"Python {platform.python_version()}, psycopg {psycopg.__version__}"
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__} ({version})")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for register in COMMANDS:
        register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``pglock`` command; return its exit code (see the module docstring)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], int] | None = getattr(args, "func", None)
    if func is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        return func(args)
    except UsageError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:
        print(f"{PROG}: error: {one_line(exc)}", file=sys.stderr)
        return EXIT_FAILED


__all__ = ["COMMANDS", "EXIT_FAILED", "EXIT_OK", "EXIT_USAGE", "build_parser", "main"]
