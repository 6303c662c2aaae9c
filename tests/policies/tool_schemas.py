"""Tools for ``toolguard policy check --tools policies.tool_schemas:...`` in the CLI tests."""

from __future__ import annotations

from pydantic import BaseModel


class ScoreArgs(BaseModel):
    lead_id: int
    score: int


def enrich_lead(lead_id: int, source: str = "web") -> None:
    """A plain function tool."""


class FakeTool:
    """Looks like a LangChain tool: a name and an args schema."""

    name = "update_lead_score"
    args_schema = ScoreArgs


TOOLS = {"update_lead_score": ScoreArgs, "enrich_lead": enrich_lead}
TOOL_LIST = [FakeTool(), enrich_lead]
NOT_TOOLS = 42
