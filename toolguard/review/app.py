"""The review page as a Starlette app: the list of decisions and one page per decision.

Read-only by construction: every route is a GET, and the only store calls are
``query_audit``, ``high_waters`` and reading a stored policy version by digest.
The endpoints are plain functions, so Starlette runs them in its thread pool
and the sync store serves them as it serves the CLI. Everything shown comes
from the audit log, which holds what models sent: it goes through Jinja2's
autoescaping and nowhere else, and the page has no script at all (the CSP
forbids one).
"""

from __future__ import annotations

import mimetypes
import os
import re
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any

import jinja2
from markupsafe import Markup
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates

from toolguard.errors import ToolGuardError
from toolguard.review.chart import decisions_chart
from toolguard.review.filters import MAX_LIMIT, PARAMS, PageFilters, parse_filters
from toolguard.review.rules import PolicySource, RuleView
from toolguard.review.security import (
    LoopbackHosts,
    ReadOnly,
    SecurityHeaders,
    TokenGate,
    Unambiguous,
    check_token,
)
from toolguard.review.views import (
    decision_counts,
    meaning,
    model_message,
    pretty,
    when,
    why,
)
from toolguard.runtime.connection_errors import redacted_url as redact
from toolguard.store import AuditEntry, GuardedStore
from toolguard.store.audit_view import REASONS, arguments, unproven, visible
from toolguard.store.policy_versions import read_policy_text

__all__ = ["ATTEMPTS_LIMIT", "SCAN_LIMIT", "create_app"]

#: Entries read for the counts and the chart; beyond it the page says it looked at the newest.
SCAN_LIMIT = 20_000
ATTEMPTS_LIMIT = 200
_MAX_ID = 2**63 - 1
_ENTRY_ID = re.compile(r"[0-9]{1,19}")
#: Stored policy versions kept loaded (each is a parsed policy: a few KB).
VERSIONS_CACHED = 32


def create_app(store: GuardedStore, *,
               policy: PolicySource | str | os.PathLike[str] | None = None,
               token: str | None = None, store_label: str = "",
               allowed_hosts: Iterable[str] = ()) -> Starlette:
    """The review app over ``store`` (which the caller opens and closes).

    Without ``token`` it answers only requests addressed to a loopback name
    (plus ``allowed_hosts``); with one, every page needs it. ``policy`` (a
    ``PolicySource`` or policy paths) is compared with the version that decided, which
    the store keeps (``toolguard.store.policy_versions``) and the page shows.
    """
    if token is not None:
        check_token(token)
    # The static files' content types: Python reads the system's MIME tables on the first
    # guess, a file read that would otherwise happen inside the server's event loop.
    mimetypes.init()
    source = policy if isinstance(policy, PolicySource) or policy is None else PolicySource(policy)
    review = _Review(store, source, store_label, token_required=token is not None)
    gate = (Middleware(TokenGate, token=token) if token is not None
            else Middleware(LoopbackHosts, extra=tuple(allowed_hosts)))
    routes = [
        Route("/", review.list_page, methods=["GET"], name="list"),
        Route("/entry/{entry_id}", review.entry_page, methods=["GET"], name="entry"),
        Mount("/static", StaticFiles(packages=[("toolguard.review", "static")]), name="static"),
    ]
    return Starlette(routes=routes, middleware=[Middleware(SecurityHeaders), Middleware(Unambiguous),
                                                Middleware(ReadOnly), gate],
                     exception_handlers={ToolGuardError: review.store_error})


def _shown(value: object) -> object:
    """Every value a template prints: text from the log with its control characters, bidi
    controls and lone surrogates as visible escapes (they would reorder or hide what the page
    says, or fail to encode), before autoescaping."""
    if isinstance(value, str) and not isinstance(value, Markup):
        return visible(value, lines=True)
    return value


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.PackageLoader("toolguard.review", "templates"),
                             autoescape=True, undefined=jinja2.StrictUndefined,
                             trim_blocks=True, lstrip_blocks=True, finalize=_shown)
    env.filters.update(when=when, pretty=pretty)
    env.globals.update(why=why, meaning=meaning, unproven=unproven, arguments=arguments)
    return env


class _Review:
    """The endpoints, sharing the store, the policy and the templates."""

    def __init__(self, store: GuardedStore, policy: PolicySource | None, store_label: str,
                 *, token_required: bool) -> None:
        self.store = store
        self.policy = policy
        self._versions: dict[str, PolicySource] = {}
        self.templates = Jinja2Templates(env=_environment())
        self.common = {"store_label": store_label,
                       "policy_label": policy.label if policy else "",
                       "token_required": token_required}

    def render(self, request: Request, name: str, status: int = 200, **context: object) -> Response:
        context = {**self.common, "root": request.scope.get("root_path", ""), **context}
        return self.templates.TemplateResponse(request, name, context, status_code=status)

    def list_page(self, request: Request) -> Response:
        page = parse_filters({k: request.query_params.getlist(k) for k in request.query_params})
        overview = self.store.query_audit(**page.without_decision().query(), limit=SCAN_LIMIT)
        shown = [e for e in overview if not page.decisions or e.decision in page.decisions]
        entries = self.store.query_audit(**page.filters.query(), limit=page.limit + 1)
        more, entries = len(entries) > page.limit, entries[:page.limit]
        since, until = page.filters.since, page.filters.until
        chart = decisions_chart(shown, start=since,
                                end=until or (datetime.now(UTC) if since else None))
        return self.render(
            request, "list.html", status=400 if page.errors else 200, page=page, entries=entries,
            more=more, counts=decision_counts(overview), total=len(overview),
            scan_capped=len(overview) >= SCAN_LIMIT, scan_limit=SCAN_LIMIT, chart=chart,
            heading=_heading(page), chips=_chips(page), suggestions=_suggestions(overview),
            clear_url=page.url(**dict.fromkeys(PARAMS[1:])),
            more_url=page.url(limit=str(min(page.limit * 2, MAX_LIMIT))))

    def entry_page(self, request: Request) -> Response:
        text: str = request.path_params["entry_id"]
        entry_id = int(text) if _ENTRY_ID.fullmatch(text) else 0  # 19 digits at most: no bignum
        found = (self.store.query_audit(after_id=entry_id - 1, limit=1, newest_first=False)
                 if 0 < entry_id <= _MAX_ID else [])
        if not found or found[0].id != entry_id:
            shown = text if len(text) <= 40 else text[:40] + "…"
            return self.render(request, "error.html", status=404, title="No such entry",
                               message=f"There is no audit entry #{shown} in this store.")
        entry = found[0]
        attempts: list[AuditEntry] = []
        if entry.idempotency_key:
            attempts = self.store.query_audit(idempotency_key=entry.idempotency_key,
                                              limit=ATTEMPTS_LIMIT, newest_first=False)
        high = self.store.high_waters(entry.keys) if entry.keys else {}
        return self.render(
            request, "entry.html", entry=entry, attempts=attempts, attempts_limit=ATTEMPTS_LIMIT,
            high=high, model=model_message(entry), **self.rules(entry),
            back=parse_filters({}).url(), page=parse_filters({"decision": ["all"]}))

    def deciding(self, digest: str | None) -> PolicySource | None:
        """The policy version ``digest`` as the store keeps it (None: not kept, or not intact)."""
        if not digest:
            return None
        found = self._versions.get(digest)
        if found is not None:
            return found
        try:
            text = read_policy_text(self.store, digest)
        except ToolGuardError:  # a store without the table (schema before 7): nothing kept
            return None
        found = PolicySource.stored(text) if text is not None else None
        if found is not None:
            if len(self._versions) >= VERSIONS_CACHED:
                self._versions.pop(next(iter(self._versions)))
            self._versions[digest] = found
        return found

    def rules(self, entry: AuditEntry) -> dict[str, Any]:
        """The deciding rule (from the stored version) and, with ``--policy``, the file's."""
        deciding = self.deciding(entry.policy_version)
        rule: RuleView | None = deciding.rule_for(entry) if deciding else None
        on_disk = self.policy
        same = on_disk is not None and deciding is not None and on_disk.digest == deciding.digest
        disk_rule = on_disk.rule_for(entry) if on_disk is not None and not same else None
        return {"rule": rule, "version": entry.policy_version, "version_kept": deciding is not None,
                "disk_rule": disk_rule, "disk_same": same,
                "disk_digest": on_disk.digest if on_disk is not None else None}

    def store_error(self, request: Request, error: Exception) -> Response:
        return self.render(request, "error.html", status=503, title="The store did not answer",
                           message=redact(f"{getattr(error, 'reason', 'error')}: {error}"))


def _heading(page: PageFilters) -> str:
    chosen = page.decisions
    if not chosen:
        return "All decisions"
    names = {"rejected": "Rejected intents", "failed": "Failed calls", "unknown":
             "Calls with an unknown outcome", "replayed": "Replayed intents",
             "accepted": "Accepted intents"}
    if len(chosen) == 1:
        return names.get(chosen[0], chosen[0])
    return "Decisions: " + ", ".join(chosen)


def _chips(page: PageFilters) -> list[tuple[str, str, str]]:
    """(name, value, the URL without it) for every active filter but the decision."""
    chips = []
    for name in ("tool", "agent", "reason", "key", "workflow", "since", "until"):
        values = page.values.get(name, ())
        for value in values:
            rest = [v for v in values if v != value]
            chips.append((name, value, page.url(**{name: rest})))
    return chips


def _suggestions(entries: list[AuditEntry]) -> dict[str, list[str]]:
    """Values seen in the log, offered by the form's inputs (HTML datalists, no script)."""
    tools = sorted({e.tool for e in entries if e.tool})[:200]
    agents = sorted({e.agent for e in entries if e.agent})[:200]
    reasons = sorted({e.reason for e in entries} | set(REASONS))[:200]
    keys = sorted({k for e in entries for k in e.keys})[:200]
    return {"tools": tools, "agents": agents, "reasons": reasons, "keys": keys}
