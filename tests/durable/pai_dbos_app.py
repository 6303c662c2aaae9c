"""A PydanticAI agent with DBOS durability whose guarded tool commits before the process dies.

``python pai_dbos_app.py crash|recover <workflow id>`` (environment as for
``dbos_app.py``). The model (``FunctionModel``, each request a DBOS step)
calls ``charge``; the guarded tool commits; in ``crash`` mode the process
dies in the next model request, before DBOS recorded it. ``recover`` lets DBOS
recover the workflow: the first model step's recorded answer brings the same
tool call again, in a run whose ids DBOS derived from the workflow.
"""

from __future__ import annotations

import asyncio
import os
import sys

from dbos import DBOS, DBOSConfig, SetWorkflowID
from pydantic_ai import Agent
from pydantic_ai.durable_exec.dbos import DBOSDurability
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
from pydantic_ai.models.function import AgentInfo, FunctionModel
from pydantic_ai.toolsets import FunctionToolset

from toolguard import ToolGuard, connect, current, open_store
from toolguard.adapters.pydantic_ai import GuardedToolset
from toolguard.policies import Policy

mode, workflow_id = sys.argv[1], sys.argv[2]
config: DBOSConfig = {"name": "toolguard-pai-dbos-test",
                      "system_database_url": os.environ["TG_DBOS_DB"]}
DBOS(config=config)

store = open_store(os.environ["TG_STORE_URL"], schema=os.environ["TG_STORE_SCHEMA"])
policy = Policy.from_dict({"version": 1, "tools": {"charge": {"locks": ["order:{order_id}"]}}})
guard = ToolGuard(policy, locks=connect(os.environ["TG_LOCK_URL"],
                                        prefix=os.environ["TG_LOCK_PREFIX"]), store=store)
tools: FunctionToolset[None] = FunctionToolset()


@tools.tool_plain
def charge(order_id: str, amount: int) -> str:
    """Charge the order."""
    current().tx.execute("INSERT INTO payment (order_id, amount) VALUES (%s, %s)",
                         (order_id, amount))
    return f"charged {amount} for {order_id}"


def respond(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    if len(messages) == 1:
        return ModelResponse(parts=[ToolCallPart("charge", {"order_id": workflow_id, "amount": 42},
                                                 tool_call_id="call_charge")])
    if mode == "crash":
        os._exit(17)  # the tool committed; this model step is not recorded
    return ModelResponse(parts=[TextPart("paid")])


agent = Agent(FunctionModel(respond), name="billing", capabilities=[DBOSDurability()],
              toolsets=[GuardedToolset(tools, guard=guard, agent="billing")])


@DBOS.workflow()
async def pay(prompt: str) -> str:
    return (await agent.run(prompt)).output


async def main() -> None:
    if mode == "crash":
        with SetWorkflowID(workflow_id):
            await pay("pay the order")
        sys.exit(3)  # never reached
    handle = await DBOS.retrieve_workflow_async(workflow_id)
    print(await handle.get_result())


DBOS.launch()
asyncio.run(main())
DBOS.destroy()
