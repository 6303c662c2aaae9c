"""The lead-qualifier example: parallel LangGraph agents on the same leads, with and without toolguard.

    >>> from examples.lead_qualifier import run_pipeline
    >>> off = run_pipeline(guarded=False)            # lost updates, double-applied retries...
    >>> on = run_pipeline(guarded=True)              # the records the scenario expects
    >>> off.correct, on.correct, on.stale_rejections[0].reason
    (False, True, 'stale_fencing_token')
    >>> on.crm.late_copy.status, on.crm.decisions()["replayed"]   # the CRM's own decisions
    (409, 1)

The pipeline itself lives in the installed package (``toolguard.demo.lead_qualifier``,
the CRM it pushes to in ``toolguard.demo.crm``), so ``toolguard demo`` works after
``pip install`` without this folder; here are its policy and SQL (kept identical to
the package's copies by a test) and a runnable entry point:
``python -m examples.lead_qualifier`` from the repository root.
Edit ``policy.yml`` here and run it again to see what each rule buys.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from toolguard.demo.lead_qualifier import (
    AGENTS,
    LEADS,
    CrmRecord,
    CrmReport,
    DemoEvent,
    Finding,
    LeadRecord,
    PlannedCall,
    Report,
    ScriptedAgentModel,
    expected_crm_records,
    expected_records,
)
from toolguard.demo.lead_qualifier import run_pipeline as _run_pipeline

__all__ = [
    "AGENTS",
    "LEADS",
    "POLICY_PATH",
    "SCHEMA_PATH",
    "CrmRecord",
    "CrmReport",
    "DemoEvent",
    "Finding",
    "LeadRecord",
    "PlannedCall",
    "Report",
    "ScriptedAgentModel",
    "expected_crm_records",
    "expected_records",
    "run_pipeline",
]

HERE = Path(__file__).resolve().parent
POLICY_PATH = HERE / "policy.yml"
SCHEMA_PATH = HERE / "schema.sql"


def run_pipeline(guarded: bool, lock_url: str | None = None, store_url: str | None = None,
                 **options: Any) -> Report:
    """Run the six leads through the four agents once, with this folder's policy and SQL.

    ``lock_url``/``store_url`` default to the settings (``TOOLGUARD_REDIS_URL``,
    ``TOOLGUARD_DATABASE_URL``, else the embedded SQLite files under ``./.toolguard``;
    the CRM's store beside them). Other options go to
    ``toolguard.demo.lead_qualifier.run_pipeline`` (open ``store=``/``locks=`` objects,
    ``store_options``, ``lock_options``, ``crm_store_url``, ``crm_store_options``,
    ``pipeline``, ``on_event``...).
    """
    options.setdefault("policy_path", POLICY_PATH)
    options.setdefault("schema_path", SCHEMA_PATH)
    return _run_pipeline(guarded=guarded, lock_url=lock_url, store_url=store_url, **options)
