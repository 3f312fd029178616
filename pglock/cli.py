"""The ``pglock`` command (also ``python -m pglock``).

Subcommands:

``pglock install --dsn DSN [--schema S]``
    Install or upgrade the pglock schema (lease table, token sequence, functions). Idempotent
    and safe to run concurrently. ``--dsn`` defaults to the ``PGLOCK_DSN`` environment variable.

Exit codes:

* ``0``: success (also when the schema was already up to date);
* ``1``: the operation failed (server unreachable, permission denied, SQL error);
* ``2``: bad usage (unknown option, missing DSN, invalid schema name);
* ``130``: interrupted (Ctrl-C).

Errors are printed as one line on stderr, ``pglock: error: ...``, never as a traceback.

Each subcommand is a ``register_<name>(subparsers)`` function that adds its parser and sets
``func`` (taking the parsed arguments, returning the exit code); :data:`COMMANDS` lists them.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130

PROG = "pglock"


class UsageError(Exception):
    """Bad usage found after parsing (exit code 2)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # One line, not argparse's usage block.
        self.exit(EXIT_USAGE, f"{PROG}: error: {message} (see '{self.prog} --help')\n")


def one_line(exc: BaseException) -> str:
    """An exception as one readable line."""
    text = " ".join(str(exc).split())
    return text or type(exc).__name__


# --- install -----------------------------------------------------------------------------------


def register_install(subparsers: argparse._SubParsersAction[_Parser]) -> None:
    p = subparsers.add_parser(
        "install",
        help="install or upgrade the pglock schema in a database",
        description=(
            "Install or upgrade the pglock schema (lease table, fencing-token sequence and "
            "functions). Idempotent; concurrent runs are safe."
        ),
    )
    p.add_argument(
        "--dsn",
        default=None,
        help="libpq connection string or URL (default: $PGLOCK_DSN)",
    )
    p.add_argument(
        "--schema",
        default=None,
        help="schema to install into (default: pglock)",
    )
    p.set_defaults(func=cmd_install)


def cmd_install(args: argparse.Namespace) -> int:
    from . import _schema

    schema = _schema.DEFAULT_SCHEMA if args.schema is None else args.schema
    try:
        _schema.validate_schema(schema)
    except (TypeError, ValueError) as exc:
        raise UsageError(str(exc)) from None
    dsn = args.dsn or os.environ.get("PGLOCK_DSN")
    if not dsn:
        raise UsageError("no database given: pass --dsn DSN or set PGLOCK_DSN")
    applied = _schema.install(dsn, schema=schema)
    if applied:
        print(f"{PROG}: installed schema {schema!r}: revision(s) {', '.join(applied)}")
    else:
        print(f"{PROG}: schema {schema!r} is up to date (revision {_schema.head()})")
    return EXIT_OK


#: The subcommands, in the order ``--help`` lists them.
COMMANDS: list[Callable[[argparse._SubParsersAction[_Parser]], None]] = [register_install]


def build_parser() -> _Parser:
    from . import __version__

    parser = _Parser(
        prog=PROG,
        description="pglock: distributed locks on Postgres alone.",
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
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
