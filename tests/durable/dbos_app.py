"""A DBOS workflow whose step makes a guarded call; run as its own process by the tests.

``python dbos_app.py crash|recover <workflow id>``, configured by environment
variables (``TG_DBOS_DB``: DBOS's system database; ``TG_STORE_URL`` and
``TG_STORE_SCHEMA``: toolguard's store; ``TG_LOCK_URL`` and ``TG_LOCK_PREFIX``).
``crash`` starts the workflow and dies (``os._exit``) right after the guarded
call returned: its transaction committed, and DBOS has not recorded the step.
``recover`` launches DBOS, which recovers the pending workflow, waits for its
result and prints it.
"""

from __future__ import annotations

import os
import sys

from dbos import DBOS, DBOSConfig, SetWorkflowID

from toolguard import ToolGuard, connect, current, guarded, open_store
from toolguard.policies import Policy

mode, workflow_id = sys.argv[1], sys.argv[2]
config: DBOSConfig = {"name": "toolguard-dbos-test", "system_database_url": os.environ["TG_DBOS_DB"]}
DBOS(config=config)

store = open_store(os.environ["TG_STORE_URL"], schema=os.environ["TG_STORE_SCHEMA"])
policy = Policy.from_dict({"version": 1, "tools": {"charge": {"locks": ["order:{order_id}"]}}})
guard = ToolGuard(policy, locks=connect(os.environ["TG_LOCK_URL"],
                                        prefix=os.environ["TG_LOCK_PREFIX"]), store=store)


@guarded(guard, agent="billing")
def charge(order_id: str, amount: int) -> str:
    current().tx.execute("INSERT INTO payment (order_id, amount) VALUES (%s, %s)",
                         (order_id, amount))
    return f"charged {amount} for {order_id}"


@DBOS.step()
def charge_step(order_id: str) -> str:
    answer = charge(order_id=order_id, amount=42)
    if mode == "crash":
        os._exit(17)  # committed; the step's result is not recorded
    return answer


@DBOS.workflow()
def order_workflow(order_id: str) -> str:
    return charge_step(order_id)


DBOS.launch()
if mode == "crash":
    with SetWorkflowID(workflow_id):
        order_workflow(workflow_id)
    sys.exit(3)  # never reached
print(DBOS.retrieve_workflow(workflow_id).get_result())
DBOS.destroy()
