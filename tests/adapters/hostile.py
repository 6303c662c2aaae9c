"""Hostile tool calls: recursive JSON and envelopes with the wrong type in every field.

The strategies draw what a model, a prompt injection or a raw ``Send`` can put
in a tool call: values nested thousands deep, integers past Python's printing
limit, long strings, NUL and lone surrogates, and in the envelope (``id``,
``name``, ``args``, ``type``) any of those in place of the expected type, or
the field left out. ``MISSING`` marks a left-out field.

A few shapes never reach a wrapper, because LangGraph or LangChain fail on
them before any ``wrap_tool_call`` runs; the strategies keep them out and the
docs list them: a call without an ``id`` or ``name`` key, a ``name`` that is
not hashable (ToolNode looks it up in a dict), and a lone call (``Send`` of one
call, ``create_agent``) whose ``type`` is not ``"tool_call"`` (ToolNode then
reads the list as messages).
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

__all__ = ["MISSING", "call", "hostile_value", "nested", "plain_input", "valid_call"]


class _Missing:
    def __repr__(self) -> str:
        return "MISSING"


#: A field left out of the call.
MISSING: Any = _Missing()


def nested(depth: int, shape: str = "list") -> Any:
    """A value ``depth`` levels deep: ``[[[...1...]]]``, ``{"k": {"k": ...}}`` or a tuple."""
    value: Any = 1
    for _ in range(depth):
        value = [value] if shape == "list" else {"k": value} if shape == "dict" else (value,)
    return value


#: Text with what stores and JSON encoders trip on.
ODD_TEXT = st.text(alphabet=st.sampled_from(["a", "Z", "\x00", "\ud800", "\udfff", "\u00e9",
                                             "\U0001f600", "{", "'", ":", "|", " "]),
                   max_size=24)
HUGE_INT = st.integers(4_300, 12_000).map(lambda digits: 10 ** digits + 7)
LONG_TEXT = st.integers(5_000, 200_000).map(lambda n: "x" * n)
DEEP = st.tuples(st.integers(100, 3_000), st.sampled_from(["list", "dict"])).map(
    lambda drawn: nested(*drawn))
SCALARS = (st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True,
                                                                  allow_infinity=True)
           | st.text(max_size=12) | ODD_TEXT | HUGE_INT)
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.text(max_size=6) | ODD_TEXT, inner, max_size=4),
                    max_leaves=10)

#: Any value, in any field.
hostile_value = JSON | DEEP | LONG_TEXT | HUGE_INT

#: What a dict key can hold in a tool-call envelope that ToolNode can look up (hashable).
HASHABLE = (st.none() | st.booleans() | st.integers() | HUGE_INT | st.floats(allow_nan=True)
            | ODD_TEXT | LONG_TEXT | st.text(max_size=10)
            | st.integers(100, 3_000).map(lambda depth: nested(depth, "tuple")))

TOOLS = ("add", "echo")


def valid_args(name: str) -> st.SearchStrategy[dict[str, Any]]:
    if name == "add":
        return st.fixed_dictionaries({"a": st.integers(-10**6, 10**6),
                                      "b": st.integers(-10**6, 10**6)})
    return st.fixed_dictionaries({"text": st.text(max_size=20)})


def _args(name: Any) -> st.SearchStrategy[Any]:
    valid = valid_args(name) if name in TOOLS else valid_args("add")
    in_fields = st.fixed_dictionaries({"a": hostile_value, "b": hostile_value})
    extra = valid.flatmap(lambda args: st.dictionaries(ODD_TEXT, hostile_value, min_size=1,
                                                       max_size=2).map(lambda x: {**x, **args}))
    return st.one_of(valid, valid, in_fields, extra, hostile_value, st.just(MISSING),
                     st.just(None), st.dictionaries(st.text(max_size=5), hostile_value,
                                                    max_size=3))


@st.composite
def call(draw: st.DrawFn, *, hashable_id: bool = False, lone: bool = False) -> dict[str, Any]:
    """One tool call: mostly well formed, with a hostile value in any field (or none)."""
    name = draw(st.sampled_from(TOOLS) | st.sampled_from(TOOLS) | HASHABLE
                | st.sampled_from(["", "drop_tables", "add\x00", "ad\ud800d", "a" * 300]))
    ids = st.text(min_size=1, max_size=16) | st.text(min_size=1, max_size=16) | st.just("") \
        | st.none() | HASHABLE
    call_id = draw(ids if hashable_id else ids | hostile_value)
    made: dict[str, Any] = {"name": name, "id": call_id}
    args = draw(_args(name))
    if args is not MISSING:
        made["args"] = args
    kind = "tool_call" if lone else draw(st.just("tool_call") | st.just("tool_call") | SCALARS
                                         | st.just(MISSING))
    if kind is not MISSING:
        made["type"] = kind
    return made


def valid_call(name: str, args: dict[str, Any], call_id: str) -> dict[str, Any]:
    return {"name": name, "args": args, "id": call_id, "type": "tool_call"}


#: What a Python caller may hand a guarded tool or function instead of arguments.
plain_input = hostile_value | st.fixed_dictionaries({"a": hostile_value, "b": hostile_value}) \
    | valid_args("add")
