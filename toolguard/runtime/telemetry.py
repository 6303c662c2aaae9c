"""Traces and metrics of guarded calls, through the OpenTelemetry API (the ``otel`` extra).

Instrumentation only: toolguard depends on ``opentelemetry-api`` alone and
sends its spans and measurements to whatever providers the application set up
(``trace.set_tracer_provider``, ``metrics.set_meter_provider``, or
``use_providers`` for toolguard alone). The SDK, the exporters and a Prometheus
endpoint are the application's choice (docs/telemetry.md).

One span per guarded call, named as the GenAI semantic conventions name a tool
execution (``execute_tool {gen_ai.tool.name}``), in the caller's current trace;
child spans for the steps a user tunes (``STEPS``). Attributes come from the
conventions where they have a name (``gen_ai.*``, ``error.type``), toolguard's
own sit under ``toolguard.``. Argument values never appear: not the arguments,
not the lock keys rendered from them (their count only), not an idempotency
key rendered from them (``traceable_key``), not an error's text (its reason
code only).

What it costs: with the package missing nothing is imported and every hook is
a call on a shared null object; with the API but no provider configured, one
look at each global provider per call (``start_call``) and per fenced run, and
the same null object.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from contextvars import ContextVar
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any

from toolguard.errors import DuplicateIntent, ToolGuardError, is_control_flow

try:
    from opentelemetry import context as _context
    from opentelemetry import metrics as _metrics
    from opentelemetry import trace as _api_trace
except ImportError:  # the extra is not installed: every hook is a no-op
    _api_trace = None  # type: ignore[assignment]
#: ``opentelemetry.trace``, or ``None`` when the package is missing (the one switch every hook
#: looks at first).
_trace: Any = _api_trace

if TYPE_CHECKING:
    from opentelemetry.metrics import Counter, Histogram, MeterProvider
    from opentelemetry.trace import Span, Tracer, TracerProvider

    from toolguard.call.decision import Decision
    from toolguard.call.intent import Intent
    from toolguard.policies import Policy, ToolPolicy
    from toolguard.store.base import IntentRecord

__all__ = [
    "METRICS",
    "SPAN_AUDIT",
    "SPAN_LOCK_WAIT",
    "SPAN_ORDER_WAIT",
    "SPAN_TOOL",
    "SPAN_TRANSACTION",
    "SPAN_VALIDATE",
    "STEPS",
    "available",
    "door_refused",
    "lease_lost",
    "start_call",
    "start_fenced",
    "traceable_key",
    "use_providers",
]

#: The instrumentation scope of toolguard's tracer and meter.
SCOPE = "toolguard"

# --- names: the GenAI semantic conventions where they name a thing, ``toolguard.`` otherwise ---

OPERATION = "execute_tool"
GEN_AI_OPERATION_NAME = "gen_ai.operation.name"
GEN_AI_TOOL_NAME = "gen_ai.tool.name"
GEN_AI_TOOL_CALL_ID = "gen_ai.tool.call.id"
GEN_AI_TOOL_TYPE = "gen_ai.tool.type"
GEN_AI_AGENT_NAME = "gen_ai.agent.name"
GEN_AI_CONVERSATION_ID = "gen_ai.conversation.id"
ERROR_TYPE = "error.type"
#: The conventions' value for a name outside a known set (a tool the policy does not list).
OTHER = "_OTHER"

DECISION = "toolguard.decision"
REASON = "toolguard.reason"
KEY_COUNT = "toolguard.keys.count"
TOKENS = "toolguard.fencing_tokens"
IDEMPOTENCY_KEY = "toolguard.idempotency_key"
NODE_ATTEMPT = "toolguard.node_attempt"
ATTEMPT = "toolguard.attempt"
OUTCOME = "toolguard.outcome"
REPLAYED = "toolguard.replayed"
RESEEDED = "toolguard.reseeded"
LEASE_LOST_EVENT = "toolguard.lease.lost"

SPAN_VALIDATE = "toolguard.validate"
SPAN_ORDER_WAIT = "toolguard.order.wait"
SPAN_LOCK_WAIT = "toolguard.lock.wait"
SPAN_TRANSACTION = "toolguard.fenced_transaction"
SPAN_TOOL = "toolguard.tool"
SPAN_AUDIT = "toolguard.audit"
#: The child spans of ``execute_tool``, in the order a call meets them.
STEPS = (SPAN_VALIDATE, SPAN_ORDER_WAIT, SPAN_LOCK_WAIT, SPAN_TRANSACTION, SPAN_TOOL, SPAN_AUDIT)

METRIC_DECISIONS = "toolguard.decisions"
METRIC_LOCK_WAIT = "toolguard.lock.wait.duration"
METRIC_LOCK_HOLD = "toolguard.lock.hold.duration"
METRIC_STALE_TOKENS = "toolguard.fencing.stale_tokens"
METRIC_LEASES_LOST = "toolguard.leases.lost"
METRIC_REPLAYS = "toolguard.replays"
METRIC_ORDER_WAITS = "toolguard.order.waits"
METRIC_ORDER_WAIT = "toolguard.order.wait.duration"
METRIC_DOOR_REFUSALS = "toolguard.gateway.refused_requests"
METRIC_HOLD = "toolguard.hold.duration"
#: Every instrument: name -> (kind, unit, description).
METRICS: Mapping[str, tuple[str, str, str]] = {
    METRIC_DECISIONS: ("counter", "{decision}",
                       "Guarded calls by decision and reason code, per tool and agent"),
    METRIC_LOCK_WAIT: ("histogram", "s", "Time from asking for a call's locks to the grant "
                                         "(or the timeout)"),
    METRIC_LOCK_HOLD: ("histogram", "s", "Time a call held its locks, grant to release"),
    METRIC_STALE_TOKENS: ("counter", "{rejection}",
                          "Fenced writes the store refused for a stale fencing token"),
    METRIC_LEASES_LOST: ("counter", "{lease}", "Leases this process learned it had lost"),
    METRIC_REPLAYS: ("counter", "{call}", "Calls answered with the result recorded earlier"),
    METRIC_ORDER_WAITS: ("counter", "{wait}",
                         "Calls that waited for an earlier tool of an after: rule"),
    METRIC_ORDER_WAIT: ("histogram", "s", "Time an after: rule kept a call waiting"),
    METRIC_DOOR_REFUSALS: ("counter", "{request}",
                           "HTTP requests the gateway refused before MCP, by reason "
                           "(host, origin, credential)"),
    METRIC_HOLD: ("histogram", "s", "Time a hold: true read kept its lock for its caller, by "
                                    "how the hold ended"),
}
#: Histogram buckets in seconds: lock hand-offs take milliseconds, a contended wait seconds.
DURATION_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                      2.5, 5.0, 10.0, 30.0)


def available() -> bool:
    """True when ``opentelemetry-api`` is importable (the ``otel`` extra)."""
    return _trace is not None


# --- providers: the global ones, or toolguard's own ---------------------------------------------

_tracer_override: TracerProvider | None = None
_meter_override: MeterProvider | None = None
_tracer_cache: tuple[Any, Tracer | None] = (None, None)
_meter_cache: tuple[Any, _Instruments | None] = (None, None)

if _trace is not None:
    try:  # the API's stand-in before a meter provider is set; private, hence the fallback
        from opentelemetry.metrics._internal import _ProxyMeterProvider
        _IDLE_METERS: tuple[type, ...] = (_metrics.NoOpMeterProvider, _ProxyMeterProvider)
    except ImportError:  # pragma: no cover - a future API: its proxy instruments cost little
        _IDLE_METERS = (_metrics.NoOpMeterProvider,)
    _IDLE_TRACERS: tuple[type, ...] = (_trace.ProxyTracerProvider, _trace.NoOpTracerProvider)


def use_providers(*, tracer_provider: TracerProvider | None = None,
                  meter_provider: MeterProvider | None = None) -> None:
    """Send toolguard's spans and metrics to these providers instead of the global ones.

    For an application that keeps its providers out of the globals, or a test
    that wants its own in-memory exporters. ``None`` (the default) goes back
    to the global provider; ``trace.NoOpTracerProvider()`` turns tracing off.
    """
    if _trace is None:
        from toolguard.runtime.extras import MissingExtra

        raise MissingExtra("otel", "toolguard's telemetry", ["opentelemetry"])
    global _tracer_override, _meter_override
    _tracer_override, _meter_override = tracer_provider, meter_provider


def _tracer() -> Tracer | None:
    """toolguard's tracer, or ``None`` while no tracer provider is configured."""
    global _tracer_cache
    provider = _tracer_override or _trace.get_tracer_provider()
    cached, tracer = _tracer_cache
    if provider is cached:
        return tracer
    if isinstance(provider, _IDLE_TRACERS):
        tracer = None
    else:
        from toolguard import __version__

        tracer = provider.get_tracer(SCOPE, __version__)
    _tracer_cache = (provider, tracer)
    return tracer


@dataclass(frozen=True, slots=True)
class _Instruments:
    """The instruments of one meter provider (made once per provider)."""

    decisions: Counter
    lock_wait: Histogram
    lock_hold: Histogram
    stale_tokens: Counter
    leases_lost: Counter
    replays: Counter
    order_waits: Counter
    order_wait: Histogram
    door_refusals: Counter
    hold: Histogram

    @classmethod
    def of(cls, provider: MeterProvider) -> _Instruments:
        from toolguard import __version__

        meter = provider.get_meter(SCOPE, __version__)
        made: dict[str, Any] = {}
        for name, (kind, unit, description) in METRICS.items():
            if kind == "counter":
                made[name] = meter.create_counter(name, unit=unit, description=description)
            else:
                made[name] = meter.create_histogram(
                    name, unit=unit, description=description,
                    explicit_bucket_boundaries_advisory=DURATION_BUCKETS_S)
        return cls(made[METRIC_DECISIONS], made[METRIC_LOCK_WAIT], made[METRIC_LOCK_HOLD],
                   made[METRIC_STALE_TOKENS], made[METRIC_LEASES_LOST], made[METRIC_REPLAYS],
                   made[METRIC_ORDER_WAITS], made[METRIC_ORDER_WAIT],
                   made[METRIC_DOOR_REFUSALS], made[METRIC_HOLD])


def _instruments() -> _Instruments | None:
    """toolguard's instruments, or ``None`` while no meter provider is configured."""
    global _meter_cache
    provider = _meter_override or _metrics.get_meter_provider()
    cached, instruments = _meter_cache
    if provider is cached:
        return instruments
    instruments = None if isinstance(provider, _IDLE_METERS) else _Instruments.of(provider)
    _meter_cache = (provider, instruments)
    return instruments


# --- what may be recorded ---------------------------------------------------------------------


def _error_type(error: BaseException) -> str:
    """``error.type``: toolguard's reason code, else the exception's qualified class name."""
    if isinstance(error, ToolGuardError):
        return error.reason
    kind = type(error)
    return kind.__qualname__ if kind.__module__ == "builtins" else \
        f"{kind.__module__}.{kind.__qualname__}"


def traceable_key(rule: ToolPolicy, policy: Policy, key: str | None) -> str | None:
    """The idempotency key as a span may show it: only a key made from the envelope.

    The default key (thread, node path, call id) holds no argument; a policy
    template or a key function may render arguments into it, so such a key is
    left out, as the lock keys are.
    """
    if rule.idempotency_key is not None or policy.key_fn is not None:
        return None
    return key


def _known_tool(intent: Intent, tools: Mapping[str, Any]) -> str | None:
    """The tool's name if the policy lists it (a bounded set), else ``None``."""
    name = intent.tool
    return name if intent.problem is None and name in tools else None


# --- spans ------------------------------------------------------------------------------------


_NO_STEP: AbstractContextManager[None] = nullcontext()


class _Step:
    """A child span, current while its block runs; an exception sets ``error.type`` only."""

    __slots__ = ("_attributes", "_name", "_span", "_token", "_tracer")

    def __init__(self, tracer: Tracer, name: str, attributes: Mapping[str, Any] | None) -> None:
        self._tracer = tracer
        self._name = name
        self._attributes = attributes
        self._span: Span | None = None
        self._token: Any = None

    def __enter__(self) -> Span:
        span = self._span = self._tracer.start_span(self._name, attributes=self._attributes)
        self._token = _context.attach(_trace.set_span_in_context(span))
        return span

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        span = self._span
        assert span is not None
        try:
            if error is not None:
                _mark_error(span, error)
        finally:
            _context.detach(self._token)
            span.end()


def _mark_error(span: Span, error: BaseException) -> None:
    """An exception out of a step: its reason code, never its text (it may hold values)."""
    if isinstance(error, DuplicateIntent):  # a replay is an answer, not a failure
        span.set_attribute(REPLAYED, True)
        return
    if is_control_flow(error):  # cancellation, an interrupt: the outcome is unknown, not wrong
        span.set_attribute(OUTCOME, "unknown")
        return
    span.set_attribute(ERROR_TYPE, _error_type(error))
    span.set_status(_trace.StatusCode.ERROR)


class Call:
    """The telemetry of one guarded call: its ``execute_tool`` span and its decision count.

    Use as a context manager around the whole call (the span is current inside
    it, so the steps and whatever the tool itself traces nest under it); mark
    each step with ``step(name)``, report the decision once with ``decided``.
    ``start_call`` returns ``NO_CALL`` when nothing listens.
    """

    __slots__ = ("_agent", "_current", "_decided", "_instruments", "_span", "_token", "_tool",
                 "_tracer")

    def __init__(self, tracer: Tracer | None, instruments: _Instruments | None, intent: Intent,
                 tools: Mapping[str, Any]) -> None:
        self._tracer = tracer
        self._instruments = instruments
        # Envelope text as an attribute: bounded, NUL and lone surrogates escaped.
        from toolguard.call.recording import storable_text as _text

        known = _known_tool(intent, tools)
        self._tool = known or OTHER
        agent = intent.agent if intent.problem is None else None
        self._agent = _text(agent) if agent else OTHER
        self._decided = False
        self._token: Any = None
        self._current: object = None
        self._span: Span | None = None
        if tracer is not None:
            attributes: dict[str, Any] = {GEN_AI_OPERATION_NAME: OPERATION,
                                          GEN_AI_TOOL_TYPE: "function",
                                          NODE_ATTEMPT: intent.node_attempt}
            name = _text(intent.tool)
            if name:
                attributes[GEN_AI_TOOL_NAME] = name
            call_id = _text(intent.call_id) if intent.call_id else None
            if call_id:
                attributes[GEN_AI_TOOL_CALL_ID] = call_id
            if agent:
                attributes[GEN_AI_AGENT_NAME] = self._agent
            thread = _text(intent.workflow.thread_id) if intent.workflow.thread_id else None
            if thread:
                attributes[GEN_AI_CONVERSATION_ID] = thread
            span_name = f"{OPERATION} {known}" if known else OPERATION
            self._span = tracer.start_span(span_name, kind=_trace.SpanKind.INTERNAL,
                                           attributes=attributes)

    def __enter__(self) -> Call:
        self._current = _CURRENT.set(self)
        if self._span is not None:
            self._token = _context.attach(_trace.set_span_in_context(self._span))
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        span = self._span
        try:
            if span is not None:
                try:
                    if error is not None and not self._decided:
                        _mark_error(span, error)
                finally:
                    _context.detach(self._token)
                    span.end()
        finally:
            _CURRENT.reset(self._current)  # type: ignore[arg-type]

    def leased(self, tokens: Mapping[str, int]) -> None:
        """The call's lease was granted with ``tokens`` (shown in key order, without the keys)."""
        if self._span is not None:
            self._span.set_attribute(TOKENS, _sorted_tokens(tokens.items()))

    @property
    def listening(self) -> bool:
        """True when a tracer or a meter provider takes what this call reports."""
        return self._tracer is not None or self._instruments is not None

    def step(self, name: str, attributes: Mapping[str, Any] | None = None
             ) -> AbstractContextManager[Any]:
        """A child span around one step of the call (``STEPS``)."""
        if self._tracer is None:
            return _NO_STEP
        return _Step(self._tracer, name, attributes)

    def prepared(self, keys: Sequence[str], idempotency_key: str | None) -> None:
        """What validation settled: how many keys (never the keys), the traceable key."""
        span = self._span
        if span is None:
            return
        span.set_attribute(KEY_COUNT, len(keys))
        if idempotency_key:
            span.set_attribute(IDEMPOTENCY_KEY, idempotency_key)

    def order_waited(self, seconds: float, outcome: str) -> None:
        """An ``after:`` rule held the call back ``seconds``; ``outcome``: satisfied/out_of_order."""
        instruments = self._instruments
        if instruments is not None:
            attributes = {GEN_AI_TOOL_NAME: self._tool, OUTCOME: outcome}
            instruments.order_waits.add(1, attributes)
            instruments.order_wait.record(seconds, attributes)

    def decided(self, decision: Decision) -> Decision:
        """Record ``decision`` (once per call) on the span and in ``toolguard.decisions``."""
        if self._decided:
            return decision
        self._decided = True
        span = self._span
        if span is not None:
            attributes: dict[str, Any] = {DECISION: decision.kind, REASON: decision.reason,
                                          KEY_COUNT: len(decision.keys)}
            if decision.kind in ("rejected", "failed"):
                attributes[ERROR_TYPE] = decision.reason
                span.set_status(_trace.StatusCode.ERROR)
            span.set_attributes(attributes)
        if self._instruments is not None:
            self._instruments.decisions.add(1, {GEN_AI_TOOL_NAME: self._tool,
                                                GEN_AI_AGENT_NAME: self._agent,
                                                DECISION: decision.kind, REASON: decision.reason})
        return decision


class _NoCall(Call):
    """The call when nothing listens: every hook does nothing."""

    __slots__ = ()

    def __init__(self) -> None:
        self._tracer = None
        self._instruments = None
        self._span = None
        self._current = None

    def __enter__(self) -> Call:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def step(self, name: str, attributes: Mapping[str, Any] | None = None
             ) -> AbstractContextManager[Any]:
        return _NO_STEP

    def prepared(self, keys: Sequence[str], idempotency_key: str | None) -> None:
        return None

    def leased(self, tokens: Mapping[str, int]) -> None:
        return None

    def order_waited(self, seconds: float, outcome: str) -> None:
        return None

    def decided(self, decision: Decision) -> Decision:
        return decision


class _Unobserved(_NoCall):
    """A call while no provider is configured: current, so ``run_fenced`` need not look again."""

    __slots__ = ()

    def __enter__(self) -> Call:
        self._current = _CURRENT.set(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _CURRENT.reset(self._current)  # type: ignore[arg-type]


#: The shared call of every guarded call while the package is missing.
NO_CALL: Call = _NoCall()
#: The guarded call running in this context (a traced or measured one): ``run_fenced`` reports
#: its lease to it and uses its tracer and instruments instead of looking up the providers again.
_CURRENT: ContextVar[Call | None] = ContextVar("toolguard_telemetry_call", default=None)


def start_call(intent: Intent, tools: Mapping[str, Any]) -> Call:
    """The telemetry of one guarded call; ``tools``: the policy's tools (names it may show).

    Without the extra, the shared ``NO_CALL``; without a configured provider, a
    call whose hooks do nothing either (``listening`` is false).
    """
    if _trace is None:
        return NO_CALL
    tracer, instruments = _tracer(), _instruments()
    if tracer is None and instruments is None:
        return _Unobserved()
    return Call(tracer, instruments, intent, tools)


# --- the lock and the fenced transaction (toolguard.store.recovery) ------------------------------


class Fenced:
    """The telemetry of one ``run_fenced``: lock wait and hold, the transaction, its answers."""

    __slots__ = ("_call", "_instruments", "_tool", "_tracer")

    def __init__(self, tracer: Tracer | None, instruments: _Instruments | None,
                 tool: str | None, call: Call | None = None) -> None:
        self._tracer = tracer
        self._instruments = instruments
        self._tool = tool
        self._call = call

    def _attributes(self, **more: Any) -> dict[str, Any]:
        attributes = {GEN_AI_TOOL_NAME: self._tool} if self._tool else {}
        attributes.update(more)
        return attributes

    def acquire(self, acquire: Callable[[], Any], keys: Sequence[str], attempt: int) -> Any:
        """Run ``acquire()`` (the lock wait) under its span; measure the wait."""
        started = time.monotonic()
        outcome = "error"
        try:
            with self._step(SPAN_LOCK_WAIT, {KEY_COUNT: len(keys), ATTEMPT: attempt}):
                lease = acquire()
            outcome = "acquired"
            self._leased(lease)
            return lease
        except ToolGuardError as error:
            outcome = error.reason
            raise
        finally:
            self._waited(started, outcome)

    async def aacquire(self, acquire: Callable[[], Any], keys: Sequence[str], attempt: int) -> Any:
        """The asyncio twin of ``acquire``; ``acquire()`` returns an awaitable."""
        started = time.monotonic()
        outcome = "error"
        try:
            with self._step(SPAN_LOCK_WAIT, {KEY_COUNT: len(keys), ATTEMPT: attempt}):
                lease = await acquire()
            outcome = "acquired"
            self._leased(lease)
            return lease
        except ToolGuardError as error:
            outcome = error.reason
            raise
        finally:
            self._waited(started, outcome)

    def _leased(self, lease: Any) -> None:
        if self._call is not None:
            self._call.leased(lease.tokens)

    def _waited(self, started: float, outcome: str) -> None:
        if self._instruments is not None:
            self._instruments.lock_wait.record(time.monotonic() - started,
                                               self._attributes(**{OUTCOME: outcome}))

    def transaction(self, lease: Any, attempt: int) -> AbstractContextManager[Any]:
        """The span of the fenced transaction under ``lease`` (tokens, a loss as an event)."""
        if self._tracer is None:
            return _NO_STEP
        step = _Step(self._tracer, SPAN_TRANSACTION,
                     {TOKENS: _sorted_tokens(lease.tokens.items()), ATTEMPT: attempt})
        return _WatchedStep(step, lease)

    def released(self, held_since: float) -> None:
        """The lease was released ``time.monotonic() - held_since`` seconds after its grant."""
        if self._instruments is not None:
            self._instruments.lock_hold.record(time.monotonic() - held_since, self._attributes())

    def replayed(self) -> None:
        if self._instruments is not None:
            self._instruments.replays.add(1, self._attributes())

    def stale(self, reseeded: bool) -> None:
        """The store refused a stale token; ``reseeded``: the lock server had regressed (retried)."""
        if self._instruments is not None:
            self._instruments.stale_tokens.add(1, self._attributes(**{RESEEDED: reseeded}))

    def _step(self, name: str, attributes: Mapping[str, Any]) -> AbstractContextManager[Any]:
        return _NO_STEP if self._tracer is None else _Step(self._tracer, name, attributes)


class _WatchedStep:
    """The transaction's span, with an event if the lease is lost while it is open."""

    __slots__ = ("_lease", "_step")

    def __init__(self, step: _Step, lease: Any) -> None:
        self._step = step
        self._lease = lease

    def __enter__(self) -> Span:
        span = self._step.__enter__()

        def lost(_lease: Any) -> None:
            if span.is_recording():  # not once the span ended (the lease outlived it)
                span.add_event(LEASE_LOST_EVENT)

        on_lost = getattr(self._lease, "on_lost", None)
        if on_lost is not None:
            on_lost(lost)
        return span

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self._step.__exit__(kind, error, traceback)


class _NoFenced(Fenced):
    __slots__ = ()

    def acquire(self, acquire: Callable[[], Any], keys: Sequence[str], attempt: int) -> Any:
        return acquire()

    async def aacquire(self, acquire: Callable[[], Any], keys: Sequence[str], attempt: int) -> Any:
        return await acquire()

    def transaction(self, lease: Any, attempt: int) -> AbstractContextManager[Any]:
        return _NO_STEP

    def released(self, held_since: float) -> None:
        return None

    def replayed(self) -> None:
        return None

    def stale(self, reseeded: bool) -> None:
        return None


NO_FENCED: Fenced = _NoFenced(None, None, None)


def start_fenced(intent: IntentRecord | None) -> Fenced:
    """The telemetry of one ``run_fenced`` of ``intent`` (``NO_FENCED`` when nothing listens)."""
    if _trace is None:
        return NO_FENCED
    tool = intent.tool if intent is not None else None
    call = _CURRENT.get()
    if call is not None:  # inside a guarded call: its providers, looked up once per call
        if not call.listening:
            return NO_FENCED
        return Fenced(call._tracer, call._instruments, tool, call)
    tracer, instruments = _tracer(), _instruments()
    if tracer is None and instruments is None:
        return NO_FENCED
    return Fenced(tracer, instruments, tool)


# --- leases (toolguard.locks.lease) ---------------------------------------------------------


def lease_lost(reason: str) -> None:
    """Count a lease this process learned it lost; ``reason``: ``lease_lost`` / ``not_owned``."""
    if _trace is None:
        return
    instruments = _instruments()
    if instruments is not None:
        instruments.leases_lost.add(1, {REASON: reason})


# --- the gateway's HTTP door (toolguard.gateway.door) ------------------------------------------


def door_refused(reason: str) -> None:
    """Count one HTTP request the gateway refused before MCP (``host``, ``origin``, ``credential``)."""
    if _trace is None:
        return
    instruments = _instruments()
    if instruments is not None:
        instruments.door_refusals.add(1, {REASON: reason})


# --- holds (toolguard.steps.holds) --------------------------------------------------------------


def hold_ended(seconds: float, tool: str, reason: str) -> None:
    """Record how long a hold lasted; ``reason`` is how it ended (a bounded set: ``written``,
    ``released``, ``max_hold_s``, ``hold_deadlock``, ``lease_lost``, ``cancelled``)."""
    if _trace is None:
        return
    instruments = _instruments()
    if instruments is not None:
        instruments.hold.record(seconds, {GEN_AI_TOOL_NAME: tool, REASON: reason})


def _sorted_tokens(tokens: Iterable[tuple[str, int]]) -> list[int]:
    """The fencing tokens in key order, without the keys (they are rendered from arguments)."""
    return [int(t) for _, t in sorted(tokens)]
