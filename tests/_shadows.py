"""A hostile ``search_path``: schemas that shadow every name pglock's statements use.

The names come from the statements themselves, so a new statement is covered without touching
the tests: every string and bytes constant of ``pglock/_sql.py`` (docstrings excluded; a bare
name there is a function statements are composed with), every one in the rest of
``pglock/**/*.py`` that reads as SQL (a SQL keyword in capitals, a ``::`` cast or
``pg_catalog.``), and ``pglock/sql/*.sql`` (comments dropped).
Tokenized, then intersected with what ``pg_catalog`` defines: identifiers before ``(`` with its
functions and aggregates, symbols (and ``IN``, ``NULLIF``, ``BETWEEN``, ``LIKE``, ``CASE x
WHEN``, ``IS DISTINCT FROM``, which compare with ``=`` and friends) with its operators, every
identifier with its types and relations, the names after ``COLLATE`` with its collations.

Two schemas, for the two ways a name can be taken over:

* ``first`` (put *before* ``pg_catalog`` in ``search_path``, which a role may do): an object
  of the same signature for every ``pg_catalog`` overload of each name (function, aggregate,
  operator), a domain for each type, a view for each relation, a collation for each collation;
* ``after`` (``pg_catalog`` first, as when it is not listed): for each overload whose
  arguments are polymorphic or reached by an implicit cast, the concrete-type variants (every
  base type for a polymorphic argument, every implicit cast source for the others), which
  match a call better than ``pg_catalog``'s candidate: ``unnest(bigint[])`` over
  ``unnest(anyarray)``, ``numeric * integer`` over ``numeric * numeric``.

Each shadow bumps the sequence ``<first>.hits`` (``nextval`` survives rollbacks and exceptions
swallowed by ``EXCEPTION WHEN OTHERS``), records its id in ``<first>.last_hit`` (see
:attr:`Shadows.what`), and returns a wrong answer: ``true`` for a boolean (a lock function
that says granted without locking, an aggregate that says all held), no rows for a set, NULL
otherwise. Casts themselves (``pg_cast``) cannot be created for built-in types without owning
them; a cast *to a type name* is shadowed through the domain of that name.

Importable from every test module as ``_shadows``.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

import pglock

#: The package whose statements are read: the one imported.
PACKAGE = Path(pglock.__file__).resolve().parent

_SQLISH = re.compile(
    r"\b(?:SELECT|WITH|FROM|WHERE|JOIN|CASE|NULL|ANY|ARRAY|EXISTS|BEGIN|COMMIT|ROLLBACK|"
    r"SAVEPOINT|SET|LISTEN|DO|INSERT|UPDATE|DELETE|VALUES|PERFORM|DECLARE|RETURN)\b|::|pg_catalog\."
)
# Placeholders (psycopg's, format()'s, str.format's, libpq's) and PL/pgSQL's #directives.
_PLACEHOLDER = re.compile(r"%(?:\(\w+\))?[a-zA-Z]|\{[^{}]*\}|\$\d+\b|#variable_conflict \w+")
_LITERAL = re.compile(r"'(?:[^']|'')*'")
# Syntax that compares through an operator looked up by name.
_IMPLIED_OPERATORS = {
    "in": "=", "nullif": "=", "distinct": "=", "when": "=", "between": ">=", "like": "~~",
    "ilike": "~~*", "similar": "~", "!=": "<>",
}
# Type keywords and the pg_catalog type each stands for (the grammar pins these).
_TYPE_KEYWORDS = {
    "bigint": "int8", "integer": "int4", "int": "int4", "smallint": "int2", "boolean": "bool",
    "real": "float4", "double": "float8", "decimal": "numeric", "char": "bpchar",
    "character": "bpchar",
}
# Types no SQL or PL/pgSQL function can take or return.
_UNUSABLE = {
    "any", "internal", "cstring", "language_handler", "fdw_handler", "table_am_handler",
    "index_am_handler", "tsm_handler", "event_trigger", "trigger", "pg_ddl_command", "unknown",
}
_ELEMENT = {"anyelement", "anynonarray", "anycompatible", "anycompatiblenonarray"}
_ARRAY = {"anyarray", "anycompatiblearray"}
_OTHER_POLYMORPHIC = {
    "anyenum", "anyrange", "anymultirange", "anycompatiblerange", "anycompatiblemultirange",
    "record",
}


def statement_texts() -> list[tuple[str, str]]:
    """The SQL text pglock sends or installs, in pieces, with where each piece is (see the
    module docstring). An f-string is one piece, ``{}`` where it interpolates."""
    texts: list[tuple[str, str]] = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text("utf-8"))
        skip = {
            id(node.body[0].value)
            for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and node.body
            and isinstance(node.body[0], ast.Expr)
            and isinstance(node.body[0].value, ast.Constant)
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.JoinedStr):
                skip |= {id(v) for v in node.values}
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.JoinedStr):
                text = "".join(
                    str(v.value) if isinstance(v, ast.Constant) else "{}" for v in node.values
                )
            elif isinstance(node, ast.Constant) and isinstance(node.value, (str, bytes)):
                value = node.value
                text = value.decode() if isinstance(value, bytes) else value
            else:
                continue
            if path.name == "_sql.py" or _SQLISH.search(text):  # _sql.py: all of it
                texts.append((f"{path.relative_to(PACKAGE.parent)}:{node.lineno}", text))
    for path in sorted((PACKAGE / "sql").glob("*.sql")):
        text = re.sub(r"--[^\n]*", "", path.read_text("utf-8"))
        texts.append((str(path.relative_to(PACKAGE.parent)), text))
    return texts


@dataclass
class Names:
    """The tokens of the statements, before they meet the catalog."""

    words: set[str] = field(default_factory=set)
    calls: set[str] = field(default_factory=set)
    symbols: set[str] = field(default_factory=set)
    collations: set[str] = field(default_factory=set)


def used_names() -> Names:
    names = Names()
    for where, text in statement_texts():
        if where.startswith("pglock/_sql.py") and re.fullmatch(r"[a-z_]\w*", text):
            text += "()"  # a function the statements are composed with
        text = _LITERAL.sub(" ", _PLACEHOLDER.sub(" ", text))
        names.collations |= {
            a or b for a, b in re.findall(r'\bCOLLATE\s+(?:"([^"]+)"|(\w+))', text, re.I)
        }
        words = [w.lower() for w in re.findall(r"[A-Za-z_]\w*", text)]
        names.words |= set(words) | {_TYPE_KEYWORDS[w] for w in words if w in _TYPE_KEYWORDS}
        names.calls |= {w.lower() for w in re.findall(r"([A-Za-z_]\w*)\s*\(", text)}
        symbols = set(re.findall(r"[-+*/<>=~!@#%^&|`?]+", text))
        names.symbols |= symbols
        implied = {*words, *symbols} & _IMPLIED_OPERATORS.keys()
        names.symbols |= {_IMPLIED_OPERATORS[t] for t in implied}
    return names


@dataclass
class Shadows:
    """The hostile schemas of one database, and what the statements use that they shadow."""

    first: str
    after: str
    #: hit id -> the shadow that bumps the counter with it
    what: dict[int, str] = field(default_factory=dict)
    #: kind -> the pg_catalog names the statements use (function, operator, type, relation,
    #: collation)
    used: dict[str, set[str]] = field(default_factory=dict)
    #: kind -> the names with at least one shadow in ``first``
    shadowed: dict[str, set[str]] = field(default_factory=dict)
    #: how many objects ``after`` holds (better-matching variants)
    variants: int = 0

    def hits(self, conn: psycopg.Connection[Any]) -> tuple[int, str | None]:
        """How many times a shadow ran so far, and which one ran last."""
        query = sql.SQL(
            "SELECT h.last_value, h.is_called, l.last_value, l.is_called"
            " FROM {}.hits h, {}.last_hit l"
        ).format(sql.Identifier(self.first), sql.Identifier(self.first))
        row = conn.execute(query).fetchone()
        assert row is not None
        count = row[0] if row[1] else 0
        return count, (self.what.get(row[2]) if row[3] else None)


def create(conn: psycopg.Connection[Any], first: str, after: str) -> Shadows:
    """Create the schemas ``first`` and ``after`` (see the module docstring) in ``conn``'s
    database, in one transaction; ``conn`` is an autocommit connection of a superuser."""
    builder = _Builder(conn, Shadows(first, after), used_names())
    ddl = builder.build()
    conn.execute("SET search_path = pg_catalog")  # catalog type names read back as such
    with conn.transaction():
        conn.execute(";\n".join(ddl))
    conn.execute("RESET search_path")
    return builder.shadows


class _Builder:
    def __init__(self, conn: psycopg.Connection[Any], shadows: Shadows, names: Names) -> None:
        self.conn, self.shadows, self.names = conn, shadows, names
        self.first = sql.Identifier(shadows.first).as_string(conn)
        self.after = sql.Identifier(shadows.after).as_string(conn)
        conn.execute("SET search_path = pg_catalog")
        self.types: dict[int, tuple[str, str, str, int, str]] = {
            row[0]: row[1:]
            for row in conn.execute(
                "SELECT t.oid, t.typname, t.typtype, t.typcategory, t.typarray,"
                " format_type(t.oid, NULL) FROM pg_type t"
                " WHERE t.typnamespace = 'pg_catalog'::regnamespace"
            )
        }
        self.implicit: dict[int, list[int]] = {}
        for source, target in conn.execute(
            "SELECT castsource, casttarget FROM pg_cast WHERE castcontext = 'i' ORDER BY 1, 2"
        ):
            if source in self.types and self._usable(source):
                self.implicit.setdefault(target, []).append(source)
        self.concrete = [
            oid for oid, (name, kind, category, array, _) in self.types.items()
            if kind == "b" and category != "A" and array != 0 and name not in _UNUSABLE
        ]

    def column(self, query: str) -> set[str]:
        return {r[0] for r in self.conn.execute(query)}

    def typname(self, oid: int) -> str:
        return self.types[oid][0]

    def typ(self, oid: int) -> str:
        return self.types[oid][4]

    def _usable(self, oid: int) -> bool:
        return self.typname(oid) not in _UNUSABLE

    def hit(self, what: str) -> str:
        n = len(self.shadows.what) + 1
        self.shadows.what[n] = what
        return f"{self.first}.hit({n})"

    def function(
        self, schema: str, name: str, args: str, result: str, what: str, *, answer: str
    ) -> str:
        return (
            f"CREATE FUNCTION {schema}.{name}({args}) RETURNS {result} LANGUAGE plpgsql"
            f" SET search_path = pg_catalog AS $x$BEGIN PERFORM {self.hit(what)}; {answer} END$x$"
        )

    def answer(self, result: int, *, returns_rows: bool = False) -> str:
        """The wrong answer of a shadow: true, nothing, or NULL."""
        if returns_rows or self.typname(result) == "void":
            return "RETURN;"
        return "RETURN true;" if self.typname(result) == "bool" else "RETURN NULL;"

    def variants(self, argtypes: list[int], result: int) -> Iterator[tuple[list[int], int]]:
        """Signatures that a call matches better than (argtypes) -> result: concrete types for
        polymorphic arguments, implicit cast sources for the others."""
        names = [self.typname(t) for t in argtypes]
        if {*names, self.typname(result)} & _OTHER_POLYMORPHIC:
            return
        if {*names} & (_ELEMENT | _ARRAY):
            for c in self.concrete:
                as_ = {**dict.fromkeys(_ELEMENT, c), **dict.fromkeys(_ARRAY, self.types[c][3])}
                yield (
                    [as_.get(n, t) for n, t in zip(names, argtypes, strict=True)],
                    as_.get(self.typname(result), result),
                )
            return
        for i, t in enumerate(argtypes):
            for source in self.implicit.get(t, []):
                yield [*argtypes[:i], source, *argtypes[i + 1 :]], result

    def build(self) -> list[str]:
        s, first, after = self.shadows, self.first, self.after
        ddl = [
            f"CREATE SCHEMA {first}",
            f"CREATE SCHEMA {after}",
            f"CREATE SEQUENCE {first}.hits",
            f"CREATE SEQUENCE {first}.last_hit",
            f"CREATE FUNCTION {first}.hit(id integer) RETURNS boolean LANGUAGE plpgsql"
            " SET search_path = pg_catalog AS $x$BEGIN"
            f" PERFORM pg_catalog.nextval('{first}.hits');"
            f" PERFORM pg_catalog.setval('{first}.last_hit', id); RETURN true; END$x$",
        ]
        ddl += self._functions()
        ddl += self._operators()
        s.used["type"] = self.names.words & {
            n for n, kind, category, _, _ in self.types.values()
            if kind in ("b", "e", "r", "m") and category != "A" and n not in _UNUSABLE
        }
        for name in sorted(s.used["type"]):
            q = sql.Identifier(name).as_string(self.conn)
            check = self.hit(f"type {name}")
            ddl.append(f"CREATE DOMAIN {first}.{q} AS pg_catalog.{q} CHECK ({check})")
        s.shadowed["type"] = set(s.used["type"])
        s.used["relation"] = self.names.words & self.column(
            "SELECT relname FROM pg_class WHERE relnamespace = 'pg_catalog'::regnamespace"
            " AND relkind IN ('r', 'v')"
        )
        for name in sorted(s.used["relation"]):
            q = sql.Identifier(name).as_string(self.conn)
            ddl.append(
                f"CREATE VIEW {first}.{q} AS SELECT * FROM pg_catalog.{q}"
                f" WHERE {self.hit('relation ' + name)}"
            )
        s.shadowed["relation"] = set(s.used["relation"])
        s.used["collation"] = self.names.collations & self.column(
            "SELECT collname FROM pg_collation WHERE collnamespace = 'pg_catalog'::regnamespace"
        )
        for name in sorted(s.used["collation"]):
            q = sql.Identifier(name).as_string(self.conn)
            # A collation runs no code: what it changes shows in pg_depend (see the tests).
            ddl.append(f'CREATE COLLATION {first}.{q} FROM pg_catalog."POSIX"')
        s.shadowed["collation"] = set(s.used["collation"])
        return ddl

    def _functions(self) -> list[str]:
        s, first, after = self.shadows, self.first, self.after
        rows = self.conn.execute(
            "SELECT p.oid, p.proname, p.prokind, p.proretset, pg_get_function_arguments(p.oid),"
            " pg_get_function_result(p.oid), p.proargtypes::oid[],"
            " coalesce(p.proallargtypes, p.proargtypes::oid[]), p.prorettype,"
            " p.provariadic <> 0, coalesce(p.proargmodes && '{o,b,t}'::\"char\"[], false),"
            " a.aggkind"
            " FROM pg_proc p LEFT JOIN pg_aggregate a ON a.aggfnoid = p.oid"
            " WHERE p.pronamespace = 'pg_catalog'::regnamespace AND p.proname = ANY(%s)"
            " ORDER BY p.oid",
            (sorted(self.names.calls),),
        ).fetchall()
        s.used["function"] = {r[1] for r in rows}
        s.shadowed["function"] = set()
        exists = {(r[1], tuple(r[6])) for r in rows}
        ddl: list[str] = []
        for (oid, name, kind, returns_set, args, result, argtypes, alltypes, ret, variadic,
             has_out, aggkind) in rows:
            if kind in ("w", "p") or not all(map(self._usable, [*alltypes, ret])):
                continue
            q = sql.Identifier(name).as_string(self.conn)
            if kind == "a":
                if aggkind != "n" or variadic or {self.typname(t) for t in [*argtypes, ret]} & (
                    _OTHER_POLYMORPHIC
                ):
                    continue
                ddl += self._aggregate(first, q, f"_agg_{oid}", list(argtypes), ret, name, "")
            else:
                ddl.append(self.function(
                    first, q, args, result, f"function {name}({args})",
                    answer=self.answer(ret, returns_rows=returns_set or has_out),
                ))
            s.shadowed["function"].add(name)
            if has_out or variadic:
                continue
            for types, vret in self.variants(list(argtypes), ret):
                if (name, tuple(types)) in exists or not all(map(self._usable, types)):
                    continue
                exists.add((name, tuple(types)))
                s.variants += 1
                if kind == "a":
                    ddl += self._aggregate(
                        after, q, f"_agg_{s.variants}", types, vret, name, " (better match)"
                    )
                    continue
                sig = ", ".join(map(self.typ, types))
                ddl.append(self.function(
                    after, q, sig, ("SETOF " if returns_set else "") + self.typ(vret),
                    f"function {name}({sig}) (better match)",
                    answer=self.answer(vret, returns_rows=returns_set),
                ))
        return ddl

    def _aggregate(
        self, schema: str, q: str, sfunc: str, argtypes: list[int], ret: int, name: str,
        note: str,
    ) -> list[str]:
        sig = ", ".join(map(self.typ, argtypes)) or "*"
        state = ", ".join([self.typ(ret), *map(self.typ, argtypes)])
        return [
            self.function(
                schema, sfunc, state, self.typ(ret), f"aggregate {name}({sig}){note}",
                answer=self.answer(ret),
            ),
            f"CREATE AGGREGATE {schema}.{q}({sig})"
            f" (SFUNC = {schema}.{sfunc}, STYPE = {self.typ(ret)})",
        ]

    def _operators(self) -> list[str]:
        s, first, after = self.shadows, self.first, self.after
        rows = self.conn.execute(
            "SELECT o.oid, o.oprname, o.oprleft, o.oprright, o.oprresult FROM pg_operator o"
            " WHERE o.oprnamespace = 'pg_catalog'::regnamespace AND o.oprname = ANY(%s)"
            " ORDER BY o.oid",
            (sorted(self.names.symbols),),
        ).fetchall()
        s.used["operator"] = {r[1] for r in rows}
        s.shadowed["operator"] = set()
        exists = {(r[1], r[2], r[3]) for r in rows}
        ddl: list[str] = []
        for oid, name, left, right, result in rows:
            if not all(self._usable(t) for t in (left, right, result) if t):
                continue
            ddl += self._operator(first, f"_op_{oid}", name, left, right, result, "")
            s.shadowed["operator"].add(name)
            args = [t for t in (left, right) if t]
            for types, vret in self.variants(args, result):
                vleft, vright = types if left else (0, *types)
                if (name, vleft, vright) in exists or not all(map(self._usable, types)):
                    continue
                exists.add((name, vleft, vright))
                s.variants += 1
                ddl += self._operator(
                    after, f"_op_{s.variants}", name, vleft, vright, vret, " (better match)"
                )
        return ddl

    def _operator(
        self, schema: str, fn: str, name: str, left: int, right: int, result: int, note: str
    ) -> list[str]:
        args = [self.typ(t) for t in (left, right) if t]
        sides = (f"LEFTARG = {self.typ(left)}, " if left else "") + f"RIGHTARG = {self.typ(right)}"
        return [
            self.function(
                schema, fn, ", ".join(args), self.typ(result),
                f"operator {name}({', '.join(args)}){note}", answer=self.answer(result),
            ),
            f"CREATE OPERATOR {schema}.{name} ({sides}, FUNCTION = {schema}.{fn})",
        ]


# --- a static check of the same texts ------------------------------------------------------------

#: Type names the grammar resolves in pg_catalog itself (keywords, not looked up by name).
_TYPE_KEYWORD_CASTS = {
    "bigint", "int", "integer", "smallint", "real", "float", "double", "decimal", "dec",
    "numeric", "boolean", "bit", "varchar", "char", "character", "time", "timestamp", "interval",
}
#: Functions the grammar calls as pg_catalog.<name> itself (extract(epoch FROM ...)).
_GRAMMAR_FUNCTIONS = {"extract", "overlay", "position", "substring", "trim", "normalize"}
_IMPLIED = re.compile(
    r"\bIN\s*\(|\bNULLIF\b|\bBETWEEN\b|\bI?LIKE\b|\bSIMILAR\b|\bDISTINCT\s+FROM\b"
    r"|\bCASE\s+(?!WHEN\b)",
    re.I,
)


@dataclass(frozen=True)
class Catalog:
    """Names pg_catalog defines, by kind."""

    functions: frozenset[str]
    operators: frozenset[str]
    types: frozenset[str]
    relations: frozenset[str]


def catalog(conn: psycopg.Connection[Any]) -> Catalog:
    def names(query: str) -> frozenset[str]:
        return frozenset(r[0] for r in conn.execute(query))

    ns = "'pg_catalog'::pg_catalog.regnamespace"
    return Catalog(
        names(f"SELECT proname::text FROM pg_catalog.pg_proc WHERE pronamespace = {ns}"),
        names(f"SELECT oprname::text FROM pg_catalog.pg_operator WHERE oprnamespace = {ns}"),
        names(f"SELECT typname::text FROM pg_catalog.pg_type WHERE typnamespace = {ns}"),
        names(f"SELECT relname::text FROM pg_catalog.pg_class WHERE relnamespace = {ns}"),
    )


def unqualified(text: str, cat: Catalog) -> list[str]:
    """What a piece of SQL text leaves to the search_path: calls of pg_catalog functions
    without a schema, operators outside ``OPERATOR(pg_catalog.x)`` (and the syntax that
    compares through ``=``: ``IN (...)``, ``NULLIF``, ``CASE x WHEN``...), casts and
    declarations with a pg_catalog type name that is not a keyword, catalog relations without
    a schema. A word alone (``"utf-8"``, ``"ShareLock"``) is no SQL."""
    if re.fullmatch(r"[\w.-]*", text):
        return []
    text = _LITERAL.sub("''", _PLACEHOLDER.sub(" ", text))
    found = [
        f"function {m[1]}"
        for m in re.finditer(r"(?<![\w.$:])([A-Za-z_]\w*)\s*\(", text)  # not bit(64) in ::bit(64)
        if m[1].lower() in cat.functions and m[1].lower() not in _GRAMMAR_FUNCTIONS
    ]
    ops = re.sub(r"OPERATOR\(pg_catalog\.[^)]+\)", " ", text)
    ops = re.sub(r"\bSET\s+(?:LOCAL\s+)?\w+\s*=", " ", ops, flags=re.I)  # SET x = v
    ops = re.sub(r"\(\s*\*\s*\)|\.\*|=>|::|:=", " ", ops)  # count(*), t.*, named args, casts
    symbols = re.findall(r"[-+*/<>=~!@#%^&|`?]+", ops)
    found += [f"operator {o}" for o in symbols if o in cat.operators]
    found += [f"operator in {m[0].strip()!r}" for m in _IMPLIED.finditer(text)]
    for m in re.finditer(r"(?:::|\bDECLARE\s+\w+)\s*(?!pg_catalog\.)([A-Za-z_]\w*)", text, re.I):
        if m[1].lower() in cat.types and m[1].lower() not in _TYPE_KEYWORD_CASTS:
            found.append(f"type {m[1]}")
    for m in re.finditer(r"\b(?:FROM|JOIN)\s+(?!pg_catalog\.)([A-Za-z_]\w*)", text, re.I):
        if m[1].lower() in cat.relations:
            found.append(f"relation {m[1]}")
    return found
