"""One placeholder style for a tool's SQL on every store: psycopg's ``%s``.

``tx.execute(sql, params)`` takes the same SQL on SQLite and PostgreSQL, so a
tool developed on the embedded store runs unchanged on PostgreSQL:

* ``%s`` (and ``%b``, ``%t``) is a positional placeholder, ``%(name)s`` a named
  one; SQLite gets ``?`` and ``:name``;
* ``%%`` is a literal percent sign, also inside a quoted string
  (``LIKE 'Ada%%'``), as psycopg reads it;
* what psycopg refuses or misreads is refused on both stores, with the
  position: a lone ``%`` (``LIKE 'Ada%'`` would work on SQLite and fail on
  PostgreSQL) and a placeholder inside a quoted string, identifier or comment
  (psycopg would fill it with a parameter: ``'%s'`` silently takes one).

A mistake raises ``ConfigurationError``: the tool's SQL is wrong, no retry
fixes it. Statements without parameters (``params=None``) are sent as written
on both stores, as psycopg does. Pure; the parse of each distinct statement
is cached.
"""

from __future__ import annotations

import functools
import re

from toolguard.errors import ConfigurationError

__all__ = ["check_placeholders"]

_NAMED = re.compile(r"%\((\w+)\)s")
#: Where a quoted part of a statement ends: a quote (doubled quotes stay inside).
_CLOSERS = {"'": "'", '"': '"'}
_DOLLAR = re.compile(r"\$(?:[A-Za-z_][A-Za-z0-9_]*)?\$")


def _refuse(sql: str, at: int, why: str) -> ConfigurationError:
    shown = sql[max(at - 20, 0):at + 20].replace("\n", " ")
    msg = (f"tx.execute: {why} at character {at + 1} (near {shown!r}); write placeholders as %s "
           f"or %(name)s outside quotes, and a literal percent sign as %%, on every store")
    return ConfigurationError(msg)


def _percent(sql: str, at: int, quoted: bool) -> tuple[str, int]:
    """What the ``%`` at ``at`` is on SQLite, and the index after it (or a refusal)."""
    following = sql[at + 1:at + 2]
    if following == "%":
        return "%", at + 2
    named = _NAMED.match(sql, at)
    if following in ("s", "b", "t") or named is not None:
        if quoted:
            raise _refuse(sql, at, "a placeholder inside a quoted string, identifier or comment")
        if named is not None:
            return f":{named.group(1)}", named.end()
        return "?", at + 2
    raise _refuse(sql, at, "a lone % (psycopg refuses it)")


def _quoted_end(sql: str, start: int) -> int:
    """The index after the quoted part that starts at ``start`` (the statement's end if open)."""
    char = sql[start]
    if char in _CLOSERS:
        escapes = char == "'" and start > 0 and sql[start - 1] in "eE"  # PostgreSQL E'...\''
        index = start + 1
        while index < len(sql):
            here = sql[index]
            if escapes and here == "\\":
                index += 2
                continue
            if here == char:
                if sql[index + 1:index + 2] == char:  # '' inside '...'
                    index += 2
                    continue
                return index + 1
            index += 1
        return len(sql)
    if sql.startswith("--", start):
        end = sql.find("\n", start)
        return len(sql) if end < 0 else end + 1
    if sql.startswith("/*", start):
        end = sql.find("*/", start + 2)
        return len(sql) if end < 0 else end + 2
    tag = _DOLLAR.match(sql, start)
    assert tag is not None
    end = sql.find(tag.group(0), tag.end())
    return len(sql) if end < 0 else end + len(tag.group(0))


def _opens_quote(sql: str, index: int) -> bool:
    char = sql[index]
    if char in _CLOSERS or sql.startswith(("--", "/*"), index):
        return True
    return char == "$" and _DOLLAR.match(sql, index) is not None and (
        index == 0 or not (sql[index - 1].isalnum() or sql[index - 1] == "_"))


@functools.lru_cache(maxsize=2048)
def _sqlite_text(sql: str) -> str:
    out: list[str] = []
    index, length = 0, len(sql)
    while index < length:
        char = sql[index]
        if char == "%":
            text, index = _percent(sql, index, quoted=False)
            out.append(text)
        elif _opens_quote(sql, index):
            end = _quoted_end(sql, index)
            part, at = [], index
            while at < end:
                if sql[at] == "%":
                    text, at = _percent(sql, at, quoted=True)
                    part.append(text)
                else:
                    part.append(sql[at])
                    at += 1
            out.append("".join(part))
            index = end
        else:
            nxt = min((p for p in (sql.find(c, index) for c in "%'\"-/$") if p >= 0),
                      default=length)
            if nxt == index:  # a '-', '/' or '$' that opens nothing
                out.append(char)
                index += 1
            else:
                out.append(sql[index:nxt])
                index = nxt
    return "".join(out)


def check_placeholders(sql: str) -> None:
    """Raise ``ConfigurationError`` where ``sql`` (run with parameters) is not portable.

    ``tx.execute`` calls it on both stores; SQLite's ``?`` comes from
    ``toolguard.store.base.qmark`` afterwards (the SQL it gets is then the same).
    """
    _sqlite_text(sql)
