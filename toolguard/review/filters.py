"""The page's filters: query parameters in, ``AuditFilters`` (the CLI's too) out.

The page shows rejected intents unless asked otherwise (``?decision=all``
shows everything); every other filter means what the same ``toolguard audit``
option means, times included (``since=2h``, ``until=2025-01-31``).

Every link on the page carries the filters, so their size bounds the page's:
at most ``MAX_VALUES_PER_FILTER`` values of one filter, ``MAX_VALUES`` in all
and ``MAX_QUERY_BYTES`` of them URL-encoded; what is beyond is left out and
reported. ``values`` holds only what was applied (the chips and the links show
nothing the page rejected); ``typed`` keeps what was typed, for the form.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from urllib.parse import quote_plus, urlencode

from toolguard.store.audit_view import DECISIONS, AuditFilters, parse_moment

__all__ = ["DEFAULT_DECISION", "DEFAULT_LIMIT", "MAX_LIMIT", "MAX_QUERY_BYTES", "MAX_VALUES",
           "MAX_VALUES_PER_FILTER", "PARAMS", "PageFilters", "parse_filters"]

DEFAULT_DECISION = "rejected"
DEFAULT_LIMIT = 100
MAX_LIMIT = 5000
#: Query parameters the page understands, in the order its links write them.
PARAMS = ("decision", "tool", "agent", "reason", "key", "workflow", "since", "until", "limit")
_MULTI = ("decision", "tool", "agent", "reason")
_MAX_VALUE = 1000
#: Values of one repeatable filter (tool, agent, reason, decision) the page applies.
MAX_VALUES_PER_FILTER = 16
#: Values of every filter together.
MAX_VALUES = 32
#: The applied values, URL-encoded: every link on the page repeats them.
MAX_QUERY_BYTES = 2048
#: The times a filter may name: the chart draws buckets in between, from Unix time.
_EARLIEST = datetime(1970, 1, 1, tzinfo=UTC)
_LATEST = datetime(9999, 1, 1, tzinfo=UTC)


@dataclass(frozen=True, slots=True)
class PageFilters:
    """What the visitor asked for: the store filters, as typed, and what was wrong with them."""

    filters: AuditFilters
    #: The applied values, to build links and chips (``decision`` may hold "all").
    values: Mapping[str, tuple[str, ...]]
    limit: int = DEFAULT_LIMIT
    errors: tuple[str, ...] = ()
    #: The first value of each filter as typed (applied or not), to refill the form.
    typed: Mapping[str, str] | None = None

    @property
    def decisions(self) -> tuple[str, ...]:
        """The decisions shown; () for all of them."""
        return self.filters.decision

    def without_decision(self) -> AuditFilters:
        """The same filters over every decision (for the counts per decision)."""
        return replace(self.filters, decision=())

    def value(self, name: str) -> str:
        """The first value of ``name`` as typed ("" if none), for the form."""
        if self.typed is not None:
            return self.typed.get(name, "")
        return next(iter(self.values.get(name, ())), "")

    def url(self, path: str = "/", /, **changes: str | Sequence[str] | None) -> str:
        """``path`` with these filters, some changed (None drops one), as a query string."""
        values: dict[str, tuple[str, ...]] = {k: tuple(v) for k, v in self.values.items()}
        for name, value in changes.items():
            if value is None:
                values.pop(name, None)
            else:
                values[name] = (value,) if isinstance(value, str) else tuple(value)
        pairs = [(name, item) for name in PARAMS for item in values.get(name, ()) if item != ""]
        return f"{path}?{urlencode(pairs)}" if pairs else path


def parse_filters(query: Mapping[str, Sequence[str]]) -> PageFilters:
    """Read the query parameters; a bad value is reported in ``errors`` and left out."""
    values: dict[str, tuple[str, ...]] = {}
    errors: list[str] = []
    typed: dict[str, str] = {}
    budget, room = MAX_VALUES, MAX_QUERY_BYTES
    for name in PARAMS:
        given = query.get(name, ())
        typed[name] = next((item.strip() for item in given if item.strip()), "")[:_MAX_VALUE]
        # one pass over what the server parsed (its request size bounds it); a value twice is one
        raw = list(dict.fromkeys(v for v in (item.strip()[:_MAX_VALUE] for item in given) if v))
        if name not in _MULTI:
            raw = raw[:1]
        kept: list[str] = []
        for item in raw[:MAX_VALUES_PER_FILTER]:
            size = len(name) + 2 + len(quote_plus(item))
            if budget == 0 or size > room:
                break
            kept.append(item)
            budget, room = budget - 1, room - size
        if len(raw) > len(kept):
            errors.append(f"{name}: {len(raw) - len(kept)} values left out (at most "
                          f"{MAX_VALUES_PER_FILTER} per filter, {MAX_VALUES} and "
                          f"{MAX_QUERY_BYTES} bytes in all)")
        values[name] = tuple(kept)
    for name in PARAMS:
        # No store keeps a NUL in a text column it is asked to match (PostgreSQL refuses one).
        if any("\x00" in item for item in values[name]):
            errors.append(f"{name}: a value with a NUL character matches nothing")
            values[name] = tuple(item for item in values[name] if "\x00" not in item)

    if "decision" not in query:
        decisions: tuple[str, ...] = (DEFAULT_DECISION,)
        values["decision"] = decisions
    elif "all" in values["decision"] or not values["decision"]:
        decisions = ()
        values["decision"] = ("all",)
    else:
        decisions = tuple(dict.fromkeys(d.lower() for d in values["decision"]))
        wrong = [d for d in decisions if d not in DECISIONS]
        if wrong:
            errors.append(f"decision {wrong[0][:80]!r} is not one of {', '.join(DECISIONS)} "
                          f"(or all)")
            decisions = tuple(d for d in decisions if d in DECISIONS) or (DEFAULT_DECISION,)
        values["decision"] = decisions

    moments: dict[str, datetime | None] = {"since": None, "until": None}
    for name in moments:
        if values[name]:
            value = values[name][0]
            shown = value[:80]
            values[name] = ()  # applied only once it parses
            try:
                moment = parse_moment(value)
            except ValueError as error:
                errors.append(f"{name}: {str(error)[:200]}")
                continue
            except OverflowError:
                errors.append(f"{name}: {shown!r} is too far back")
                continue
            if not _EARLIEST <= moment < _LATEST:
                errors.append(f"{name}: {shown!r} is outside the years 1970 to 9998")
                continue
            moments[name] = moment
            values[name] = (value,)
    since, until = moments["since"], moments["until"]
    if since and until and since >= until:
        errors.append("since is not before until: nothing can match")

    limit = DEFAULT_LIMIT
    if values["limit"]:
        try:
            limit = int(values["limit"][0])
            if not 1 <= limit <= MAX_LIMIT:
                raise ValueError
        except ValueError:
            errors.append(f"limit must be a whole number from 1 to {MAX_LIMIT}")
            limit = DEFAULT_LIMIT
            values["limit"] = ()

    filters = AuditFilters(decision=decisions, reason=values["reason"], tool=values["tool"],
                           agent=values["agent"], key=_one(values["key"]),
                           workflow=_one(values["workflow"]), since=since, until=until)
    return PageFilters(filters=filters, values=values, limit=limit, errors=tuple(errors),
                       typed=typed)


def _one(items: tuple[str, ...]) -> str | None:
    return items[0] if items else None

