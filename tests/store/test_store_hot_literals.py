"""The fenced write's hot path quotes its values itself: the server must read them back exactly.

``enter`` and ``finish`` fill their fixed templates with one literal per value
instead of psycopg's adapters (``toolguard.store.postgres._filled``). Whatever
a value holds (quotes, backslashes, SQL comment marks, non-ASCII text, big
integers, floats), the server reads back the same value; NUL is refused as
psycopg refuses it, and a value of another type is left to psycopg.
"""

from __future__ import annotations

import math

import psycopg
import pytest

from toolguard.store import postgres as pg

TRICKY_TEXT = [
    "", "plain", "it's", "''", "back\\slash", "\\'", "E'x'", "--comment", "/* c */", "a;b",
    "$$dollar$$", "ünïcödé ✓ 🎉", "\\x41", "%s", "%%", "line\nbreak\ttab", "'); DROP TABLE x; --",
]


@pytest.fixture
def conn(postgres_url: str):
    with psycopg.connect(postgres_url, autocommit=True) as connection:
        yield connection


def _read_back(conn: psycopg.Connection, casts: str, params: tuple[object, ...]) -> tuple:
    parts = pg._template("SELECT " + ", ".join(f"%s::{cast}" for cast in casts.split(",")))
    query = pg._filled(parts, params)
    assert query is not None
    row = conn.execute(query).fetchone()
    assert row is not None
    return tuple(row)


@pytest.mark.parametrize("text", TRICKY_TEXT)
def test_text_comes_back_exactly(conn: psycopg.Connection, text: str) -> None:
    assert _read_back(conn, "text,text", (text, None)) == (text, None)


@pytest.mark.parametrize("number", [0, 1, -1, 2**62, -(2**63), 10**16 + 7])
def test_integers_come_back_exactly(conn: psycopg.Connection, number: int) -> None:
    assert _read_back(conn, "bigint", (number,)) == (number,)


@pytest.mark.parametrize("number", [0.0, 1.5, -2.25, 1e16, 1.2345678901234567e-300, 123.456])
def test_floats_come_back_exactly(conn: psycopg.Connection, number: float) -> None:
    assert _read_back(conn, "double precision", (number,)) == (number,)


def test_booleans_come_back(conn: psycopg.Connection) -> None:
    assert _read_back(conn, "boolean,boolean", (True, False)) == (True, False)


def test_nul_is_refused_as_psycopg_refuses_it() -> None:
    with pytest.raises(psycopg.DataError, match="NUL"):
        pg._filled(pg._template("SELECT %s::text"), ("a\x00b",))


@pytest.mark.parametrize("value", [["a"], {"a": 1}, b"bytes", math.nan, math.inf])
def test_other_values_are_left_to_psycopg(value: object) -> None:
    assert pg._filled(pg._template("SELECT %s"), (value,)) is None


def test_the_hot_templates_hold_only_plain_placeholders() -> None:
    for query in (pg.ENTER_TX, pg.FINISH_TX, pg.FINISH_TX_NO_INTENT):
        assert "".join(pg._TEMPLATES[query]) == query.replace("%s", "")


def test_the_hot_path_steps_aside_when_the_session_quotes_by_other_rules(
        conn: psycopg.Connection) -> None:
    """With backslash escapes on (``standard_conforming_strings = off``), another client
    encoding, or in pipeline mode, ``_HotCursor`` leaves the query to psycopg's own quoting:
    its literals are only right for a UTF-8 session that reads backslashes as text."""
    from toolguard.store.postgres_literals import _HotCursor
    from toolguard.store.postgres_sql import ENTER_TX

    params = tuple("a\\'b" for _ in range(ENTER_TX.count("%s")))
    cursor = _HotCursor(conn)
    assert cursor._hot(ENTER_TX, params) is not None  # the default session: filled here
    conn.execute("SET standard_conforming_strings = off")
    assert cursor._hot(ENTER_TX, params) is None
    assert conn.execute("SELECT %s::text", ("a\\'b",)).fetchone() == ("a\\'b",)
    conn.execute("RESET standard_conforming_strings")
    assert cursor._hot(ENTER_TX, params) is not None
    conn.execute("SET client_encoding = 'LATIN1'")
    assert cursor._hot(ENTER_TX, params) is None
    conn.execute("RESET client_encoding")
    assert cursor._hot(ENTER_TX, params) is not None
    with conn.pipeline():
        assert cursor._hot(ENTER_TX, params) is None
