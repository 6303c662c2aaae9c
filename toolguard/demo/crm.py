"""The demo's CRM: a small REST service the lead qualifier pushes every lead to.

``PUT /leads/{lead_id}`` takes the whole record as the agent read it (plus the
stage, ``enriched`` or ``qualified``, and the agent) and stores it: one record
per lead, and one row per push it applied. ``CrmService`` starts it on a free
loopback port (uvicorn, in a thread of this process) for one pipeline run.

With the guard on, the service mounts ``FenceMiddleware``: every push must
carry the lease's fences and an idempotency key, a token older than one the
CRM has seen is refused with ``409``, and a key it applied before gets the
recorded answer again. The handler writes through ``fence_of(request).tx``,
the transaction in which the fences were checked. With the guard off there is
no toolguard anywhere: the same service without the middleware applies
whatever arrives.

The CRM keeps its own store, never the agents': ``crm.db`` beside the
agents' SQLite file, or the ``toolguard_demo_crm`` schema on PostgreSQL. That
store holds its records and, with the guard on, its fences, recorded answers
and audit log (``toolguard audit --url <crm store>``). Being separate, a push
made while the agent's own store transaction is open cannot wait on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from toolguard.demo.scenario import CrmRecord
from toolguard.store.base import AuditEntry, qmark

__all__ = ["CRM_SCHEMA_PATH", "PG_SCHEMA", "CrmPush", "CrmService", "crm_store_for"]

HERE = Path(__file__).resolve().parent
CRM_SCHEMA_PATH = HERE / "crm.sql"
#: The CRM's schema when the agents' store is PostgreSQL (same database, its own tables).
PG_SCHEMA = "toolguard_demo_crm"

LEADS_TABLE = "toolguard_demo_crm_leads"
PUSHES_TABLE = "toolguard_demo_crm_pushes"

_UPSERT = (
    f"INSERT INTO {LEADS_TABLE} (pipeline, lead_id, company, email, employees, industry, "
    f"email_status, score, tier, pushes) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, 1) "
    f"ON CONFLICT (pipeline, lead_id) DO UPDATE SET company = excluded.company, "
    f"email = excluded.email, employees = excluded.employees, industry = excluded.industry, "
    f"email_status = excluded.email_status, score = excluded.score, tier = excluded.tier, "
    f"pushes = {LEADS_TABLE}.pushes + 1 RETURNING pushes")
_PUSH = (f"INSERT INTO {PUSHES_TABLE} (pipeline, lead_id, push, stage, agent, score, tier) "
         f"VALUES (%s, %s, %s, %s, %s, %s, %s)")

_START_TIMEOUT_S = 10.0
_STOP_TIMEOUT_S = 10.0


class CrmLead(BaseModel):
    """The body of ``PUT /leads/{lead_id}``: the record as the agent read it, and who sent it."""

    model_config = ConfigDict(extra="forbid", strict=True)

    stage: Literal["enriched", "qualified"]
    agent: str = Field(min_length=1, max_length=80)
    company: str = Field(max_length=200)
    email: str = Field(max_length=320)
    employees: int | None = None
    industry: str | None = Field(default=None, max_length=80)
    email_status: str | None = Field(default=None, max_length=20)
    score: int
    tier: str | None = Field(default=None, max_length=20)


@dataclass(frozen=True, slots=True)
class CrmPush:
    """One push the CRM applied (a row of ``toolguard_demo_crm_pushes``)."""

    lead_id: str
    push: int  # the record's push count after this one
    stage: str
    agent: str
    score: int
    tier: str | None


def crm_store_for(store_url: str | None, store: Any = None) -> tuple[str, dict[str, Any]]:
    """The CRM's own store beside the agents' one: ``crm.db`` in its folder, or a schema of its own.

    ``store_url`` is the agents' store URL (or None with an open ``store``).
    Returns the CRM store's URL and its options (``schema`` on PostgreSQL).
    """
    url = store_url
    if url is None and store is not None:
        if getattr(store, "dialect", None) == "postgresql":
            url = store.url
        else:
            url = f"sqlite:///{Path(store.path).absolute()}"
    if url is None:
        from toolguard.config import Settings

        url = Settings().resolved_store_url()
    if url.startswith(("postgresql:", "postgres:")):
        return url, {"schema": PG_SCHEMA}
    from toolguard.locks import sqlite_path

    return f"sqlite:///{Path(sqlite_path(url)).absolute().parent / 'crm.db'}", {}


class CrmService:
    """The demo CRM for one pipeline run, served on a free loopback port.

    >>> with CrmService("sqlite:///crm.db", pipeline="p", fenced=True) as crm:
    ...     httpx.put(f"{crm.url}/leads/L-1", json=...)   # 428 without fences

    ``fenced`` mounts ``FenceMiddleware``; ``reset`` deletes this pipeline's
    records first. ``records()``, ``pushes()`` and ``audit()`` read what the
    CRM holds (the audit rows written since it started).
    """

    def __init__(self, store_url: str, *, pipeline: str, fenced: bool,
                 store_options: Mapping[str, Any] | None = None, reset: bool = False) -> None:
        self.store_url = store_url
        self.store_options = dict(store_options or {})
        self.pipeline = pipeline
        self.fenced = fenced
        self.reset = reset
        self.url = ""
        self.store: Any = None
        self._start_id = 0
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self._socket: socket.socket | None = None

    @property
    def label(self) -> str:
        """The CRM store for people: the URL (password hidden) and its schema, if any."""
        from toolguard.runtime.connection_errors import redacted_url as redact

        schema = self.store_options.get("schema")
        return redact(self.store_url) + (f" (schema {schema})" if schema else "")

    def __enter__(self) -> CrmService:
        return self.start()

    def start(self) -> CrmService:
        """Open (and install) the CRM's store and serve the CRM; ``close()`` stops it."""
        from toolguard.store import open_store

        self.store = open_store(self.store_url, install=True, **self.store_options)
        try:
            _install_tables(self.store)
            if self.reset:
                self._run(f"DELETE FROM {PUSHES_TABLE} WHERE pipeline = %s", (self.pipeline,))
                self._run(f"DELETE FROM {LEADS_TABLE} WHERE pipeline = %s", (self.pipeline,))
            newest = self.store.query_audit(limit=1)
            self._start_id = int(newest[0].id) if newest and newest[0].id is not None else 0
            self._serve()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the server (it closes its async store) and close the sync store."""
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(_STOP_TIMEOUT_S)
            self._thread = None
        self._server = None
        if self._socket is not None:
            self._socket.close()
            self._socket = None
        if self.store is not None:
            with contextlib.suppress(Exception):
                self.store.close()
            self.store = None

    # --- the server -----------------------------------------------------------------------

    def _serve(self) -> None:
        import uvicorn

        from toolguard.store import open_async_store

        ready = threading.Event()
        service_store = open_async_store(self.store_url, **self.store_options)
        app = _app(self, service_store, ready)
        self._socket = sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))  # a free port, bound before the server starts: no race
        sock.listen(128)
        port = sock.getsockname()[1]
        # log_config=None: leave the host's logging alone (uvicorn would reconfigure it).
        config = uvicorn.Config(app, log_config=None, log_level="warning", access_log=False,
                                lifespan="on")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]},
                                        name="toolguard-demo-crm", daemon=True)
        self._thread.start()
        if not ready.wait(_START_TIMEOUT_S) or not self._thread.is_alive():
            msg = f"the demo CRM did not start on 127.0.0.1:{port}"
            raise RuntimeError(msg)
        self.url = f"http://127.0.0.1:{port}"

    # --- reading what the CRM holds ---------------------------------------------------------

    def _run(self, sql: str, params: tuple[Any, ...] = ()) -> list[Any]:
        with self.store.connection() as conn:
            cursor = conn.execute(qmark(sql) if self.store.dialect == "sqlite" else sql, params)
            return list(cursor.fetchall()) if cursor.description else []

    def records(self) -> dict[str, CrmRecord]:
        rows = self._run(f"SELECT lead_id, company, email, employees, industry, email_status, "
                         f"score, tier, pushes FROM {LEADS_TABLE} WHERE pipeline = %s "
                         f"ORDER BY lead_id", (self.pipeline,))
        return {r[0]: CrmRecord(r[0], r[1], r[2], r[3], r[4], r[5], score=int(r[6]), tier=r[7],
                                pushes=int(r[8]))
                for r in rows}

    def pushes(self) -> list[CrmPush]:
        rows = self._run(f"SELECT lead_id, push, stage, agent, score, tier FROM {PUSHES_TABLE} "
                         f"WHERE pipeline = %s ORDER BY lead_id, push", (self.pipeline,))
        return [CrmPush(r[0], int(r[1]), r[2], r[3], int(r[4]), r[5]) for r in rows]

    def audit(self) -> tuple[AuditEntry, ...]:
        """The CRM's audit rows written since this service started, oldest first."""
        return tuple(self.store.query_audit(after_id=self._start_id, limit=None,
                                            newest_first=False))

    # --- writing ----------------------------------------------------------------------------

    def _write_plain(self, lead_id: str, lead: CrmLead) -> int:
        """Guard off: the push as two plain statements, no fences, no dedupe."""
        (row,) = self._run(_UPSERT, _upsert_params(self.pipeline, lead_id, lead))
        push = int(row[0])
        self._run(_PUSH, _push_params(self.pipeline, lead_id, push, lead))
        return push


def _upsert_params(pipeline: str, lead_id: str, lead: CrmLead) -> tuple[Any, ...]:
    return (pipeline, lead_id, lead.company, lead.email, lead.employees, lead.industry,
            lead.email_status, lead.score, lead.tier)


def _push_params(pipeline: str, lead_id: str, push: int, lead: CrmLead) -> tuple[Any, ...]:
    return (pipeline, lead_id, push, lead.stage, lead.agent, lead.score, lead.tier)


def _install_tables(store: Any) -> None:
    """Create the CRM's tables (``crm.sql``) through its store's own connection."""
    script = "\n".join(line for line in CRM_SCHEMA_PATH.read_text(encoding="utf-8").splitlines()
                       if not line.lstrip().startswith("--"))
    with store.connection() as conn:
        for statement in (s.strip() for s in script.split(";")):
            if statement:
                conn.execute(statement)


def _app(service: CrmService, service_store: Any, ready: threading.Event) -> Any:
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from toolguard.fences import FenceMiddleware, fence_of
    from toolguard.policies.templates import escape_value

    async def put_lead(request: Request) -> JSONResponse:
        lead_id = request.path_params["lead_id"]
        try:
            lead = CrmLead.model_validate_json(await request.body())
        except ValidationError as error:
            return JSONResponse({"error": "invalid lead", "detail": error.errors(
                include_url=False, include_context=False, include_input=False)}, status_code=422)
        if service.fenced:
            fence = fence_of(request)  # the fences were checked and advanced in this transaction
            fence.require(f"lead:{escape_value(lead_id)}")  # and they cover the lead it writes
            tx = fence.tx
            row = await (await tx.execute(_UPSERT, _upsert_params(service.pipeline, lead_id,
                                                                  lead))).fetchone()
            push = int(row[0])
            await tx.execute(_PUSH, _push_params(service.pipeline, lead_id, push, lead))
        else:
            push = await asyncio.to_thread(service._write_plain, lead_id, lead)
        return JSONResponse({"lead_id": lead_id, "stage": lead.stage, "push": push,
                             "score": lead.score, "tier": lead.tier})

    @contextlib.asynccontextmanager
    async def lifespan(_app: Any) -> AsyncIterator[None]:
        ready.set()
        try:
            yield
        finally:
            await service_store.close()

    middleware = [Middleware(FenceMiddleware, store=service_store)] if service.fenced else []
    return Starlette(routes=[Route("/leads/{lead_id}", put_lead, methods=["PUT"])],
                     middleware=middleware, lifespan=lifespan)
