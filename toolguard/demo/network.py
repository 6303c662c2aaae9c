"""The network between the agents and the demo CRM, with the two faults the scenario injects.

- ``CRM_LOST_ANSWER`` (the router on ``L-102``): the CRM applies the push, then
  the connection drops before its answer arrives. The agent cannot tell whether
  the push landed, so it sends it again.
- ``CRM_DELAYED`` (the enricher on ``L-103``): the push gets stuck in the
  network and the connection drops before the CRM has seen it. The agent sends
  it again; the stuck copy reaches the CRM only after the other pushes of that
  lead (the agent's own retry and the router's) have landed, long after anyone
  was waiting for its answer.

Both happen in both pipelines, on the first push of that agent and lead that
goes over the wire (a second run replays every push from the agents' store
and sends nothing). The stuck copy is released by what the CRM has answered,
never by a sleep, so every run tells the same story.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

import httpx

from toolguard.demo.harness import CALL, DemoEvent
from toolguard.demo.scenario import CRM_DELAYED, CRM_LOST_ANSWER, STAGES

__all__ = ["CrmNetwork", "LateCopy"]

_PATH_PREFIX = "/leads/"
_RELEASE_TIMEOUT_S = 10.0
#: What the stuck copy waits for before it arrives: a landed push of its lead in each stage.
_NEWER = tuple(STAGES.values())


@dataclass(frozen=True, slots=True)
class LateCopy:
    """What the CRM answered the push that was stuck in the network."""

    lead_id: str
    agent: str
    status: int  # 0: it could not be delivered at all
    reason: str | None  # the problem's toolguard reason when the CRM refused it
    detail: str
    replayed: bool = False  # the CRM answered with a recorded response (Idempotent-Replayed)

    @property
    def landed(self) -> bool:
        """The CRM applied it (a replay applies nothing)."""
        return 0 < self.status < 400 and not self.replayed


class CrmNetwork(httpx.BaseTransport):
    """An httpx transport to the CRM that loses one answer and holds one request back."""

    def __init__(self, notify: Callable[[DemoEvent], None],
                 inner: httpx.BaseTransport | None = None) -> None:
        self.inner = inner or httpx.HTTPTransport()
        self.notify = notify
        self.lost_answers = 0
        self.late_copy: LateCopy | None = None
        self._landed: Counter[tuple[str, str]] = Counter()  # (lead, stage): 2xx answers
        self._cond = threading.Condition()
        self._finished = False
        self._faulted: set[tuple[str, str]] = set()
        self._courier: threading.Thread | None = None

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        push = _push_of(request)
        fault = self._fault(push)
        if fault == "delayed":
            assert push is not None
            self._hold(request, *push)
            msg = "connection reset by peer before the CRM answered"
            raise httpx.ReadError(msg, request=request)
        response = self.inner.handle_request(request)
        response.read()
        if push is not None and response.status_code < 400:
            with self._cond:
                self._landed[(push[1], push[2])] += 1
                if fault == "lost":
                    self.lost_answers += 1
                self._cond.notify_all()
        if fault == "lost":
            assert push is not None
            self.notify(DemoEvent("network", push[1], agent=push[0],
                                  detail=f"the CRM applied the {push[2]} push (HTTP "
                                         f"{response.status_code}), then the connection dropped: "
                                         f"the answer is lost"))
            msg = "connection reset by peer: the CRM's answer was lost"
            raise httpx.ReadError(msg, request=request)
        return response

    def _fault(self, push: tuple[str, str, str] | None) -> str | None:
        if push is None:
            return None
        agent, lead_id, _ = push
        for name, target in (("lost", CRM_LOST_ANSWER), ("delayed", CRM_DELAYED)):
            if (agent, lead_id) == target:
                with self._cond:
                    if target in self._faulted:
                        return None
                    self._faulted.add(target)
                return name
        return None

    def _hold(self, request: httpx.Request, agent: str, lead_id: str, stage: str) -> None:
        copy = (request.method, str(request.url), list(request.headers.raw), bytes(request.content))
        self.notify(DemoEvent("network", lead_id, agent=agent,
                              detail=f"the {stage} push is stuck in the network; the connection "
                                     f"dropped before the CRM saw it"))
        self._courier = threading.Thread(target=self._deliver, args=(copy, agent, lead_id),
                                         name="toolguard-demo-late-copy", daemon=True)
        self._courier.start()

    def _deliver(self, copy: tuple[str, str, list[Any], bytes], agent: str, lead_id: str) -> None:
        """Send the stuck copy once the other pushes of its lead have landed (or the run is over)."""
        with self._cond:
            self._cond.wait_for(lambda: self._finished or all(
                self._landed[(lead_id, stage)] for stage in _NEWER), _RELEASE_TIMEOUT_S)
        method, url, headers, content = copy
        try:
            response = self.inner.handle_request(httpx.Request(method, url, headers=headers,
                                                               content=content))
            response.read()
        except httpx.HTTPError as error:
            self.late_copy = LateCopy(lead_id, agent, 0, None, f"not delivered: {error}")
            return
        reason = _problem_reason(response)
        replayed = response.headers.get("idempotent-replayed") == "true"
        detail = f"HTTP {response.status_code}" + (f" {reason}" if reason else "")
        self.late_copy = LateCopy(lead_id, agent, response.status_code, reason, detail, replayed)
        verdict = ("refused it" if response.status_code >= 400 else
                   "answered with its recorded response" if replayed else
                   "applied it, over the pushes that landed before it")
        self.notify(DemoEvent("late", lead_id, agent=agent,
                              detail=f"the stuck push reached the CRM at last: {detail}; the CRM "
                                     f"{verdict}"))

    def finish(self) -> None:
        """The run is over: deliver a copy still held back, and wait until it has been answered."""
        with self._cond:
            self._finished = True
            self._cond.notify_all()
        if self._courier is not None:
            self._courier.join(_RELEASE_TIMEOUT_S)

    def close(self) -> None:
        self.finish()
        self.inner.close()


def _push_of(request: httpx.Request) -> tuple[str, str, str] | None:
    """``(agent, lead, stage)`` of a CRM push sent by a demo tool, else None."""
    call = CALL.get()
    path = request.url.path
    if call is None or request.method != "PUT" or not path.startswith(_PATH_PREFIX):
        return None
    try:
        stage = json.loads(request.content).get("stage")
    except (ValueError, AttributeError):
        return None
    return call.agent, unquote(path[len(_PATH_PREFIX):]), str(stage)


def _problem_reason(response: httpx.Response) -> str | None:
    if not response.headers.get("content-type", "").startswith("application/problem+json"):
        return None
    with contextlib.suppress(ValueError, AttributeError):
        reason: str | None = json.loads(response.content).get("reason")
        return reason
    return None
