"""DBOS Transact as an optional peer of the guarded call (never a dependency of toolguard).

    .venv/bin/pip install dbos==3.4.0     # only for the benchmark

DBOS Transact is a durable-execution library on PostgreSQL. The peer is what
its documentation prescribes for an exactly-once database mutation: a workflow
started under the call id (``SetWorkflowID``) whose one step is a datasource
transaction (``SQLAlchemyDatasource.transaction``, READ COMMITTED, as
toolguard's fenced transaction) doing the same read-modify-write; DBOS records
the step's output in the same transaction, so a call id runs once and a retry
returns the recorded result. No lock, fencing token or audit row: it is a
point of comparison, not a reference with the same guarantees.

It runs on the same PostgreSQL server, in a database of its own (default
``bench_dbos``, created if missing), in schemas of the run's own (its table,
the datasource's checkpoints, DBOS's system tables), dropped at the end.
``check()`` proves exactly-once: the table's sum equals the calls, one
successful workflow and one recorded step output (``operation_outputs``) per
call, and re-running a few call ids returns their recorded results without
writing again.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
from typing import Any
from urllib.parse import quote

import psycopg
from psycopg import conninfo, sql

INSTALL = "pip install dbos==3.4.0 (into the benchmark's venv only; never a dependency)"


def available() -> str | None:
    """None when DBOS can be imported, else why not."""
    try:
        import dbos  # noqa: F401
    except Exception as error:  # ImportError, or a broken install
        return f"{type(error).__name__}: {error}"
    return None


def database_url(url: str, name: str, *, scheme: str = "postgresql") -> str:
    """``url`` (a URL or a conninfo string) as a URL to database ``name``."""
    params = conninfo.conninfo_to_dict(url)
    user = quote(str(params.get("user", "postgres")), safe="")
    password = f":{quote(str(params['password']), safe='')}" if params.get("password") else ""
    host = params.get("host", "127.0.0.1")
    port = params.get("port", "5432")
    return f"{scheme}://{user}{password}@{host}:{port}/{quote(name, safe='')}"


class DbosPeer:
    """A launched DBOS with one workflow; ``call(lead)`` runs it under a fresh call id."""

    def __init__(self, server_url: str, run: str, *, database: str = "bench_dbos",
                 pool_size: int = 12) -> None:
        self.url = database_url(server_url, database)
        self.schema = f"tg_bench_{run}"
        self.ds_schema = f"{self.schema}_dbos"
        self.sys_schema = f"{self.schema}_dbos_sys"
        self.dbos_class: Any = None
        self.ds: Any = None
        try:
            self._start(server_url, run, database, pool_size)
        except BaseException:
            self.close()
            raise

    def _start(self, server_url: str, run: str, database: str, pool_size: int) -> None:
        import sqlalchemy as sa
        from dbos import DBOS, DBOSConfig, SetWorkflowID, SQLAlchemyDatasource

        with psycopg.connect(server_url, autocommit=True) as conn:
            if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s",
                            (database,)).fetchone() is None:
                conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(database)))
        with psycopg.connect(self.url, autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(self.schema)))
            table = sql.Identifier(self.schema, "lead")
            conn.execute(sql.SQL("CREATE TABLE {} (id text PRIMARY KEY, score bigint NOT NULL)")
                         .format(table))
            conn.execute(sql.SQL("INSERT INTO {} SELECT 'lead-' || i, 0 "
                                 "FROM generate_series(0, 999) i").format(table))
        for name in ("dbos", "sqlalchemy"):
            logging.getLogger(name).setLevel(logging.WARNING)
        engine = {"pool_size": pool_size, "max_overflow": 0}
        self.ds = SQLAlchemyDatasource.create(database_url(server_url, database,
                                                           scheme="postgresql+psycopg"),
                                              schema=self.ds_schema,
                                              engine_kwargs=engine)
        update = sa.text(f'UPDATE "{self.schema}".lead SET score = score + :delta '
                         "WHERE id = :lead RETURNING score")
        ds = self.ds

        @ds.transaction(isolation_level="READ COMMITTED", name=f"add_score_step_{run}")
        def add_score_step(lead_id: str, delta: int) -> int:
            return int(ds.sql_session().execute(update, {"delta": delta, "lead": lead_id})
                       .scalar_one())

        @DBOS.workflow(name=f"add_score_{run}")
        def add_score(lead_id: str, delta: int) -> int:
            return add_score_step(lead_id, delta)

        config: DBOSConfig = {
            "name": f"tgbench-{run}", "system_database_url": self.url,
            "dbos_system_schema": self.sys_schema, "sys_db_pool_size": pool_size + 8,
            "log_level": "WARNING"}
        self.dbos_class = DBOS
        DBOS(config=config)
        DBOS.launch()
        self.workflow = add_score
        self.set_id = SetWorkflowID
        self.run = run
        self._ids = itertools.count()
        self._count = threading.Lock()
        self.calls = 0
        #: (call id, lead, result) of the first calls: ``check`` runs them again.
        self._first: list[tuple[str, str, int]] = []

    def call(self, lead: str) -> int:
        call_id = f"{self.run}-dbos-{next(self._ids)}"
        with self.set_id(call_id):
            result = self.workflow(lead, 1)
        with self._count:
            self.calls += 1
            if len(self._first) < 5:
                self._first.append((call_id, lead, result))
        return result

    def check(self) -> list[str]:
        """What does not hold after the run (empty: exactly once per call id)."""
        problems = []
        with psycopg.connect(self.url, autocommit=True) as conn:
            def one(query: sql.Composable) -> Any:
                return conn.execute(query).fetchone()[0]

            total = one(sql.SQL("SELECT coalesce(sum(score), 0) FROM {}")
                        .format(sql.Identifier(self.schema, "lead")))
            done = one(sql.SQL("SELECT count(*) FILTER (WHERE status = 'SUCCESS') FROM {}")
                       .format(sql.Identifier(self.sys_schema, "workflow_status")))
            # A finished workflow's step outputs are in DBOS's system tables (its datasource
            # checkpoints are deleted when the workflow completes).
            steps = one(sql.SQL("SELECT count(*) FROM {}")
                        .format(sql.Identifier(self.sys_schema, "operation_outputs")))
            if not int(total) == done == steps == self.calls:
                problems.append(f"{self.calls} calls, table sum {int(total)}, {done} successful "
                                f"workflows, {steps} recorded step outputs")
            differ = 0
            for call_id, lead, result in self._first:
                with self.set_id(call_id):
                    differ += self.workflow(lead, 1) != result
            again = one(sql.SQL("SELECT coalesce(sum(score), 0) FROM {}")
                        .format(sql.Identifier(self.schema, "lead")))
            if again != total or differ:
                problems.append(f"re-running {len(self._first)} call ids: table sum "
                                f"{int(total)} -> {int(again)}, {differ} other results")
        return problems

    def close(self) -> None:
        if self.dbos_class is not None:
            with contextlib.suppress(Exception):
                self.dbos_class.destroy(destroy_registry=True)
        if self.ds is not None:
            with contextlib.suppress(Exception):
                self.ds.engine.dispose()
        with contextlib.suppress(Exception), psycopg.connect(self.url, autocommit=True) as conn:
            for schema in (self.schema, self.ds_schema, self.sys_schema):
                conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE")
                             .format(sql.Identifier(schema)))
