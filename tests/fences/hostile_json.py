"""Hypothesis strategies for hostile JSON *text*: what a raw sender can put on the wire.

The text is built directly (not by ``json.dumps``), so it can hold what no Python dict
can: the same key twice in one object. Values: deep nesting, integers of thousands of
digits, long strings, NUL and other control characters, lone surrogates (as ``\\ud800``
escapes), and the wrong JSON type where a string or an object belongs.
"""

from __future__ import annotations

import json

from hypothesis import strategies as st

from toolguard.fences.wire import META_KEYS

META_NAMES = sorted(META_KEYS.values())

#: Text that breaks some rule of a fence field or of any store.
nasty_text = st.sampled_from([
    "", " ", "\x00", "a\x00b", "\x1b[31m", "\ud800", "x\udfffy", "\ufeff", "\u202e", "é",
    "lead%3Ax=1", "lead:x=1", "lead%3Ax=0", "lead%3Ax=99999999999999999999", "a=1,a=2",
    "k#1", '"quoted"', "\\", "%", "x" * 9000, "\U0001f600" * 3000,
])


def string_json(value: str) -> str:
    """A JSON string literal; lone surrogates travel as ``\\uXXXX`` escapes."""
    return json.dumps(value, ensure_ascii=True)


scalar_json = st.one_of(
    st.just("null"), st.just("true"), st.just("false"),
    st.integers(-10**6, 10**6).map(str),
    st.integers(300, 6000).map(lambda digits: "9" * digits),  # past int()'s 4300 digits
    st.sampled_from(["1e999", "-0", "0.1", "1E+2"]),
    st.one_of(nasty_text, st.text(max_size=40)).map(string_json),
    st.integers(1000, 20_000).map(lambda n: string_json("y" * n)),
)


def deep_json(depth: int, opener: str = "[") -> str:
    closer = "]" if opener == "[" else "}"
    if opener == "{":
        return '{"a":' * depth + "1" + "}" * depth
    return opener * depth + closer * depth


nested_json = st.one_of(
    st.integers(50, 5000).map(deep_json),
    st.integers(50, 5000).map(lambda d: deep_json(d, "{")),
)


def object_json(pairs: list[tuple[str, str]]) -> str:
    return "{" + ",".join(f"{string_json(key)}:{value}" for key, value in pairs) + "}"


any_json = st.recursive(
    st.one_of(scalar_json, nested_json),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4).map(lambda items: "[" + ",".join(items) + "]"),
        st.lists(st.tuples(st.one_of(st.text(max_size=8), nasty_text), inner),
                 max_size=4).map(object_json),
        # the same key twice in one object
        st.tuples(st.text(max_size=8), inner, inner).map(
            lambda t: object_json([(t[0], t[1]), (t[0], t[2])])),
    ),
    max_leaves=6,
)


@st.composite
def meta_json(draw: st.DrawFn, lead: str) -> str:
    """A ``_meta``: mostly an object of fence fields (valid, hostile, repeated, wrong
    types), sometimes not an object at all."""
    if draw(st.integers(0, 9)) == 0:
        return draw(any_json)
    pairs: list[tuple[str, str]] = []
    valid = {"toolguard/fencing-token": f"lead%3A{lead}=3", "toolguard/idempotency-key": f"{lead}#1",
             "toolguard/agent": "a", "toolguard/intent": "c",
             # a claim's shape (a service in unsigned mode does not verify it)
             "toolguard/fencing-claim": "tgf1.hs256.k1.e30.AAAA"}
    for name in META_NAMES:
        kind = draw(st.sampled_from(["valid", "valid", "absent", "nasty", "any"]))
        if kind == "valid":
            pairs.append((name, string_json(valid[name])))
        elif kind == "nasty":
            pairs.append((name, string_json(draw(nasty_text))))
        elif kind == "any":
            pairs.append((name, draw(any_json)))
    if pairs and draw(st.booleans()):  # a repeat of one of them
        name, _ = draw(st.sampled_from(pairs))
        pairs.append((name, string_json(draw(st.one_of(nasty_text, st.just(valid[name]))))))
    if draw(st.booleans()):  # a look-alike key, or one outside the namespace
        pairs.append((draw(st.sampled_from(["Toolguard/Fencing-Token", "toolguard/fencing-token ",
                                            "toolguard/other", "progressToken", "x"])),
                      draw(any_json)))
    return object_json(draw(st.permutations(pairs)))
