"""Key templates: parsing, escaping and the promise that distinct tuples never share a key."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from toolguard.errors import InvalidArguments
from toolguard.policies import KeyTemplate, escape_text, escape_value
from toolguard.policies.templates import ESCAPED_ALPHABET, MAX_VALUE_CHARS

HOSTILE = ["a:b", "a", "b:c", "b", "c", "*", "{x}", "{", "}", "../", "..", "/", "\x00", "%", "%41",
           "A", "~i1", "1", "", " ", "\u0430", "\uff41", "\u00e9", "e\u0301", "\u200b", "lead:1", "~",
           "%7E", "\ud800"]


def test_escape_keeps_safe_characters_and_encodes_the_rest() -> None:
    assert escape_text("Lead_42-x") == "Lead_42-x"
    assert escape_text("a:b") == "a%3Ab"
    assert escape_text("../x") == "%2E%2E%2Fx"
    assert escape_text("{*}%\x00") == "%7B%2A%7D%25%00"
    assert escape_text("\u0430") == "%D0%B0"  # Cyrillic a: not the Latin a
    assert escape_text("\u00e9") != escape_text("e\u0301")  # composed vs decomposed: not normalized


def test_scalars_are_type_tagged() -> None:
    assert escape_value("1") == "1"
    assert escape_value(1) == "~i1"
    assert escape_value(-7) == "~i-7"
    assert escape_value(True) == "~t"
    assert escape_value(False) == "~f"
    assert escape_value(1.5) == "~d1%2E5"
    assert len({escape_value(v) for v in ("1", 1, True, 1.0)}) == 4


def test_long_values_are_hashed_so_every_key_fits_an_index() -> None:
    """A 4,096-character id (within the default limits) made a key PostgreSQL cannot index."""
    template = KeyTemplate.parse("lead:{id}")
    (long_key,) = template.render({"id": "x" * 4_096})
    (other,) = template.render({"id": "x" * 4_095 + "y"})
    (number,) = template.render({"id": 10 ** 300})
    assert long_key.startswith("lead:~h") and len(long_key) == len("lead:~h") + 64
    assert other != long_key and number.startswith("lead:~h") and number != long_key
    (short,) = template.render({"id": "x" * (MAX_VALUE_CHARS - 1)})
    assert short == "lead:" + "x" * (MAX_VALUE_CHARS - 1)  # short values are unchanged
    assert escape_value("\u00e9" * 200).startswith("~h")  # 1,200 escaped characters


@pytest.mark.parametrize("value", [None, [1], {"a": 1}, b"x"])
def test_non_scalars_cannot_be_keys(value: object) -> None:
    with pytest.raises(TypeError):
        escape_value(value)


def test_nan_cannot_be_a_key() -> None:
    with pytest.raises(ValueError):
        escape_value(float("nan"))


def test_render_basic_and_list_expansion() -> None:
    assert KeyTemplate.parse("lead:{lead_id}").render({"lead_id": "L1"}) == ("lead:L1",)
    assert KeyTemplate.parse("account:{from_id}").render({"from_id": 7}) == ("account:~i7",)
    tags = KeyTemplate.parse("lead:{lead_ids[*]}")
    assert tags.render({"lead_ids": ["b", "a", "b", 3]}) == ("lead:a", "lead:b", "lead:~i3")
    assert tags.render({"lead_ids": []}) == ()
    nested = KeyTemplate.parse("sku:{order.items[*].sku}/{order.id}")
    assert nested.render({"order": {"id": 1, "items": [{"sku": "x"}, {"sku": "y"}]}}) == (
        "sku:x/~i1", "sku:y/~i1")
    assert KeyTemplate.parse("global").render({}) == ("global",)
    assert KeyTemplate.parse("x:{ a }").render({"a": "v"}) == ("x:v",)


@pytest.mark.parametrize(("args", "expected"), [
    ({}, "args.lead_id: the lock key 'lead:{lead_id}' needs a value, got nothing"),
    ({"lead_id": None}, "args.lead_id: the lock key 'lead:{lead_id}' needs a value, got null"),
    ({"lead_id": {"x": 1}}, "args.lead_id: lock key 'lead:{lead_id}': a key needs a string, "
                            "number or boolean, got an object"),
    ({"lead_id": [1]}, "args.lead_id: lock key 'lead:{lead_id}': a key needs a string, number "
                       "or boolean, got a list"),
])
def test_render_refuses_missing_and_non_scalars(args: dict[str, Any], expected: str) -> None:
    with pytest.raises(InvalidArguments) as caught:
        KeyTemplate.parse("lead:{lead_id}").render(args)
    assert caught.value.message == expected


def test_render_refuses_null_list_element() -> None:
    with pytest.raises(InvalidArguments, match=r"args\.ids\[1\]: .* got null"):
        KeyTemplate.parse("lead:{ids[*]}").render({"ids": ["a", None]})


@pytest.mark.parametrize(("text", "problem"), [
    ("", "cannot be empty"),
    ("lead:{id", "unclosed '{'"),
    ("lead:{a{b}}", "unclosed '{'"),
    ("lead:id}", "unmatched '}'"),
    ("lead:{}", "invalid field path ''"),
    ("lead:{a..b}", "invalid field path"),
    ("lead:{a[0]}", "invalid field path"),
    ("lead {id}", "character ' '"),
    ("lead%{id}", "character '%'"),
    ("lead*", "character '*'"),
    ("l\u00e9:{id}", "character '\u00e9'"),
    ("x:{a}{b}", "need a separator"),
    ("x:{a}b{c}", "need a separator"),
    ("x:{a}~{c}", "need a separator"),
    ("x:{a[*]}:{b[*]}", "only one [*]"),
    ("x:{a[*].b[*]}", "only one [*]"),
])
def test_bad_templates(text: str, problem: str) -> None:
    with pytest.raises(ValueError) as caught:
        KeyTemplate.parse(text)
    assert problem in str(caught.value)


def test_skeleton() -> None:
    assert KeyTemplate.parse("lead:{lead_id}").skeleton == KeyTemplate.parse("lead:{id}").skeleton
    assert KeyTemplate.parse("a:{x}/{y}").skeleton == "a:{}/{}"
    assert KeyTemplate.parse("a:{x[*]}").expands and not KeyTemplate.parse("a:{x}").expands


# --- the property: distinct argument tuples never share a key -----------------------

scalars = st.one_of(st.sampled_from(HOSTILE), st.text(max_size=8), st.integers(-10**6, 10**6),
                    st.booleans(), st.sampled_from([0, 1, -1, 1.0, 0.5, -0.5, 1e300]))
TEMPLATES = ["t:{a}:{b}:{c}", "{a}/{b}.{c}", "x{a}:{b}:{c}y", "{a}::{b}/{c}", "p:{a}@{b}#{c}:s"]


@settings(max_examples=400, deadline=None)
@given(template=st.sampled_from(TEMPLATES), first=st.tuples(scalars, scalars, scalars),
       second=st.tuples(scalars, scalars, scalars))
def test_distinct_tuples_render_distinct_keys(template: str, first: tuple[Any, ...],
                                              second: tuple[Any, ...]) -> None:
    parsed = KeyTemplate.parse(template)
    (key1,) = parsed.render(dict(zip("abc", first, strict=True)))
    (key2,) = parsed.render(dict(zip("abc", second, strict=True)))
    same = all(type(x) is type(y) and x == y for x, y in zip(first, second, strict=True))
    assert (key1 == key2) == same, (first, second, key1)


@settings(max_examples=300, deadline=None)
@given(first=st.lists(scalars, min_size=1, max_size=4), second=st.lists(scalars, min_size=1, max_size=4))
def test_list_expansion_keys_are_the_set_of_element_keys(first: list[Any], second: list[Any]) -> None:
    parsed = KeyTemplate.parse("lead:{ids[*]}")
    keys1, keys2 = set(parsed.render({"ids": first})), set(parsed.render({"ids": second}))
    tagged1 = {(type(v), v) for v in first}
    tagged2 = {(type(v), v) for v in second}
    assert (keys1 == keys2) == (tagged1 == tagged2)


@given(st.one_of(st.text(), st.integers(), st.booleans(), st.floats(allow_nan=False, allow_infinity=False)))
def test_escaped_values_use_the_small_alphabet(value: object) -> None:
    assert set(escape_value(value)) <= ESCAPED_ALPHABET
