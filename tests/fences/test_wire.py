"""The wire format alone: exact round trips, one spelling per key, strict refusals (hypothesis)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from toolguard.fences.wire import (
    FENCING_TOKEN_HEADER,
    MAX_FENCES,
    MAX_FIELD_BYTES,
    Fences,
    WireError,
    decode_fences,
    decode_text,
    encode_fences,
    encode_key,
    encode_text,
    parse_headers,
    parse_meta,
)

# Lock keys as toolguard renders them, and any other text a caller may lock.
printable = st.characters(min_codepoint=0x20, max_codepoint=0x10FFFF,
                          blacklist_categories=("Cs",), blacklist_characters="\x7f")
keys = st.text(printable, min_size=1, max_size=40)
tokens = st.integers(min_value=1, max_value=2**63 - 1)
leases = st.dictionaries(keys, tokens, min_size=1, max_size=8)
texts = st.text(printable, min_size=1, max_size=60)


def header_list(fences: Fences) -> list[tuple[bytes, bytes]]:
    return [(k.lower().encode("ascii"), v.encode("ascii")) for k, v in fences.headers().items()]


@given(leases, st.none() | texts, st.none() | texts, st.none() | texts)
def test_headers_and_meta_round_trip_exactly(lease, key, agent, intent):
    fences = Fences(tokens=lease, idempotency_key=key, agent=agent, intent_id=intent)
    assert parse_headers(header_list(fences)) == fences
    assert parse_meta(fences.meta()) == fences


@given(keys, keys)
def test_the_key_encoding_is_injective(first, second):
    if first != second:
        assert encode_key(first) != encode_key(second)
    assert "," not in encode_key(first) and "=" not in encode_key(first)


def test_known_spellings():
    assert encode_fences({"lead:L-7": 1764000000000001}) == "lead%3AL-7=1764000000000001"
    assert encode_fences({"b": 2, "a:~i1": 1}) == "a%3A~i1=1, b=2"
    assert encode_text('say "hi"\\', field="x") == '"say \\"hi\\"\\\\"'
    assert encode_text("caf\u00e9 50%", field="x") == '%"caf%c3%a9 50%25"'
    # 16-digit hybrid-clock tokens travel whole (an RFC 8941 integer stops at 15 digits)
    assert decode_fences("k=1764000000000001") == {"k": 1764000000000001}


@pytest.mark.parametrize("text, where", [
    ("", "member 1 is empty"),
    ("a=1,", "member 2 is empty"),
    ("a=1,,b=2", "member 2 is empty"),
    ("a", "expected key=token"),
    ("a=", "not an integer"),
    ("a=0", "not an integer"),
    ("a=01", "not an integer"),
    ("a=-1", "not an integer"),
    ("a=9223372036854775808", "not an integer"),
    ("a=1.5", "not an integer"),
    ("a=1 2", "not an integer"),
    ("lead:L=1", "not percent-encoded"),
    ("lead%3aL=1", "not percent-encoded"),
    ("%41=1", "one spelling"),
    ("a%2=1", "not percent-encoded"),
    ("%FF=1", "not UTF-8"),
    ("%00=1", "control character"),
    ("a=1, a=2", "appears twice"),
    ("a b=1", "not percent-encoded"),
])
def test_malformed_fencing_tokens_are_refused_saying_where(text, where):
    with pytest.raises(WireError, match=where) as raised:
        decode_fences(text)
    assert raised.value.field == FENCING_TOKEN_HEADER
    assert raised.value.reason == "invalid_fence_header"


@pytest.mark.parametrize("text", ['', '""', 'abc', '"abc', '"a"b', '"a\\b"', '"\x01"',
                                  '%"abc', '%"%C3%A9"', '%"%c3"', '%"%00"', '"caf\u00e9"'])
def test_malformed_text_fields_are_refused(text):
    with pytest.raises(WireError):
        decode_text(text, field="Idempotency-Key")


def test_limits_repeats_and_bytes_are_refused():
    many = ", ".join(f"k{i}=1" for i in range(MAX_FENCES + 1))
    with pytest.raises(WireError, match=f"more than {MAX_FENCES}"):
        decode_fences(many)
    with pytest.raises(WireError, match="longer than"):
        parse_headers([(b"idempotency-key", b'"' + b"a" * MAX_FIELD_BYTES + b'"')])
    with pytest.raises(WireError, match="more than once"):
        parse_headers([(b"fencing-token", b"a=1"), (b"Fencing-Token", b"a=1")])
    with pytest.raises(WireError, match="outside ASCII"):
        parse_headers([(b"toolguard-agent", '"\u00e9"'.encode("latin-1"))])
    with pytest.raises(WireError, match="expected a string"):
        parse_meta({"toolguard/fencing-token": {"a": 1}})


@pytest.mark.parametrize("meta, field", [
    ({"Toolguard/Fencing-Token": "a=1"}, "Toolguard/Fencing-Token"),
    ({"toolguard/fencing-token": "a=5", "toolguard/Fencing-Token": "a=1"},
     "toolguard/Fencing-Token"),
    ({"toolguard/fencing-token ": "a=1"}, "toolguard/fencing-token "),
    ({"toolguard/\uff46encing-token": "a=1"}, "toolguard/\uff46encing-token"),  # full-width f
    ({"TOOLGUARD/idempotency-key": "k#1"}, "TOOLGUARD/idempotency-key"),
    ({"toolguard/fencing-tokens": "a=1"}, "toolguard/fencing-tokens"),
    ({"toolguard/fencing-token": None}, "toolguard/fencing-token"),
    ({"toolguard/fencing-token": ["a=1"]}, "toolguard/fencing-token"),
    ({"toolguard/idempotency-key": "k\x00#1"}, "toolguard/idempotency-key"),
    ({"toolguard/idempotency-key": "k" * 9000}, "toolguard/idempotency-key"),
    ({"toolguard/agent": "\u00e9" * 5000}, "toolguard/agent"),  # 5,000 characters, 10,000 bytes
    (["toolguard/fencing-token"], "_meta"),
    ("toolguard/fencing-token=a=1", "_meta"),
])
def test_hostile_meta_is_refused_naming_the_key(meta, field):
    with pytest.raises(WireError) as raised:
        parse_meta(meta)
    assert raised.value.field == field


def test_meta_keys_outside_the_toolguard_namespace_are_left_alone():
    assert parse_meta({"progressToken": 3, "other/fencing-token": "x", "a": None}) == Fences()


def test_the_client_side_refuses_what_cannot_travel():
    with pytest.raises(WireError, match="lone surrogate"):
        encode_fences({"a\ud800": 1})
    with pytest.raises(WireError, match="integer"):
        encode_fences({"a": True})
    with pytest.raises(WireError, match="control character"):
        Fences(tokens={"a": 1}, idempotency_key="a\nb").headers()


field_names = st.sampled_from([b"fencing-token", b"idempotency-key", b"toolguard-agent",
                               b"toolguard-intent", b"Fencing-Token", b"x-other"])
raw_values = st.binary(max_size=200) | st.text(st.characters(max_codepoint=0x7F),
                                               max_size=200).map(str.encode)


@settings(max_examples=500, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(field_names, raw_values), max_size=6))
def test_the_parser_never_fails_other_than_with_wire_error(headers):
    try:
        fences = parse_headers(headers)
    except WireError as error:
        assert error.field and error.message
        return
    # whatever it accepted is what an honest client would have sent
    assert parse_headers(header_list(fences)) == fences
