"""The lead-qualifier demo behind ``toolguard demo`` (see ``lead_qualifier``)."""

from toolguard.demo.lead_qualifier import (
    LEADS,
    POLICY_PATH,
    SCHEMA_PATH,
    CrmRecord,
    CrmReport,
    DemoEvent,
    Finding,
    LeadRecord,
    Report,
    demo_tools,
    expected_crm_records,
    expected_records,
    run_pipeline,
)

__all__ = [
    "LEADS",
    "POLICY_PATH",
    "SCHEMA_PATH",
    "CrmRecord",
    "CrmReport",
    "DemoEvent",
    "Finding",
    "LeadRecord",
    "Report",
    "demo_tools",
    "expected_crm_records",
    "expected_records",
    "run_pipeline",
]
