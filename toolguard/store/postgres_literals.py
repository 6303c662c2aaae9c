"""The hot path's client-side binding on PostgreSQL: ``_HotCursor`` and the literals it writes.

``enter`` and ``finish`` send a fixed template whose parameters are plain values (text,
integers, floats, None), with client-side binding. psycopg's ``ClientCursor`` quotes
each value through its adapters (one dumper lookup and call per value) and counts the
merged text for statement preparation (never useful: the values differ every time).
``_HotCursor`` fills these templates itself: each value still becomes one quoted
literal (``_literal``), never formatted into SQL by hand, and a value of another type,
or a connection whose literals follow other rules, takes ``ClientCursor``'s own path.

Apart from the session that uses it because it reaches into psycopg's cursor
internals (``_execute_gen``, ``_start_query``): the one place to look when psycopg
changes, and the quoting rules can be tested without a server.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, cast

import psycopg
from psycopg import generators

from toolguard.store.postgres_sql import (
    ENTER_CHECK_TX,
    ENTER_TX,
    FINISH_OBSERVE_TX,
    FINISH_OBSERVE_TX_NO_INTENT,
    FINISH_TX,
    FINISH_TX_NO_INTENT,
)


def _template(query: str) -> tuple[str, ...]:
    """``query`` split at its ``%s`` placeholders (it must hold no other ``%``)."""
    parts = tuple(query.split("%s"))
    if any("%" in part for part in parts):
        msg = f"a hot-path template takes only %s placeholders: {query!r}"
        raise AssertionError(msg)
    return parts


_TEMPLATES = {query: _template(query) for query in (
    ENTER_TX, FINISH_TX, FINISH_TX_NO_INTENT, ENTER_CHECK_TX, FINISH_OBSERVE_TX,
    FINISH_OBSERVE_TX_NO_INTENT)}
_NUL_TEXT = "PostgreSQL text fields cannot contain NUL (0x00) bytes"
#: The server's names of UTF-8 as ``client_encoding`` reports it.
_UTF8 = frozenset({b"UTF8", b"UNICODE"})


def _literal(value: Any) -> str | None:
    """One SQL literal for ``value`` (standard_conforming_strings on), or None if ``value``
    is not of a type this path quotes."""
    kind = type(value)
    if isinstance(value, str) and kind is str:
        if "\x00" in value:
            raise psycopg.DataError(_NUL_TEXT)
        return "'" + value.replace("'", "''") + "'"
    if value is None:
        return "NULL"
    if kind is int:
        return f"'{value:d}'"
    if kind is float and math.isfinite(value):
        return f"'{value!r}'"
    if kind is bool:
        return "true" if value else "false"
    return None


def _filled(parts: tuple[str, ...], params: Sequence[Any]) -> bytes | None:
    """``parts`` joined by the literals of ``params`` (UTF-8); None if a value needs
    psycopg's own quoting."""
    if len(params) != len(parts) - 1:
        return None
    chunks = [parts[0]]
    append = chunks.append
    for value, tail in zip(params, parts[1:], strict=True):
        if type(value) is str:  # the usual value: inline, the rest through _literal
            if "\x00" in value:
                raise psycopg.DataError(_NUL_TEXT)
            append("'" + value.replace("'", "''") + "'")
        elif value is None:
            append("NULL")
        else:
            quoted = _literal(value)
            if quoted is None:
                return None
            append(quoted)
        append(tail)
    try:
        return "".join(chunks).encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: psycopg's own path says what is wrong
        return None


class _HotCursor(psycopg.ClientCursor[Any]):
    """A ``ClientCursor`` that fills the hot-path templates with ``_literal`` and sends them
    as one simple query, past the prepared-statement bookkeeping (never prepared: the
    merged text differs on every call). Anything else is ``ClientCursor``'s own path."""

    def _execute_gen(self, query: Any, params: Any = None, *, prepare: bool | None = None,
                     binary: bool | None = None) -> Any:
        built = self._hot(query, params)
        if built is None:
            return (yield from super()._execute_gen(query, params, prepare=prepare,
                                                    binary=binary))
        yield from self._start_query(query)
        pgconn = self._pgconn
        pgconn.send_query(built)
        results = yield from generators.execute(pgconn)
        self._check_results(results)
        self._set_results(results)
        self._last_query = query
        return None

    def _hot(self, query: Any, params: Any) -> bytes | None:
        parts = _TEMPLATES.get(query) if type(query) is str and params is not None else None
        pgconn = self._pgconn
        # The session's own settings, as libpq last heard them (not ``conn.info``, which
        # builds an object and looks the codec up on every call).
        if parts is None or self._conn._pipeline is not None or (
                pgconn.parameter_status(b"standard_conforming_strings") != b"on"
                or pgconn.parameter_status(b"client_encoding") not in _UTF8):
            return None
        return _filled(parts, params)


def _hot_cursor(conn: psycopg.Connection[Any], slot: str) -> _HotCursor:
    """The connection's own ``_HotCursor`` for one template (``slot``), made once.

    One per template: a cursor keeps its adapters while it runs the same query
    object again, which saves building them on every call.
    """
    cursor = conn.__dict__.get(slot)
    if cursor is None:
        cursor = conn.__dict__[slot] = _HotCursor(conn)
    return cast(_HotCursor, cursor)
