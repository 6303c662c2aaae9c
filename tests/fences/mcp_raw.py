"""Raw JSON-RPC over streamable HTTP: bytes the polite clients would never send.

``RawMcp`` opens a session (initialize, initialized) with httpx and then posts
any bytes as a request on it, returning the parsed JSON-RPC answer (a JSON
response or the first SSE ``data:`` event).
"""

from __future__ import annotations

import json
from typing import Any

import httpx

PROTOCOL = "2025-06-18"
ACCEPT = "application/json, text/event-stream"


class RawMcp:
    def __init__(self, url: str, *, timeout_s: float = 30.0) -> None:
        self.url = url + "/mcp"
        self.http = httpx.Client(timeout=timeout_s)
        self.headers = {"accept": ACCEPT, "content-type": "application/json",
                        "mcp-protocol-version": PROTOCOL}
        self.next_id = 1
        init = self.post(json.dumps({
            "jsonrpc": "2.0", "id": 0, "method": "initialize",
            "params": {"protocolVersion": PROTOCOL, "capabilities": {},
                       "clientInfo": {"name": "raw", "version": "1"}}}).encode())
        assert "result" in init, init
        self.http.post(self.url, headers=self.headers,
                       content=b'{"jsonrpc":"2.0","method":"notifications/initialized"}')

    def post(self, body: bytes) -> dict[str, Any]:
        response = self.http.post(self.url, headers=self.headers, content=body)
        session = response.headers.get("mcp-session-id")
        if session:
            self.headers["mcp-session-id"] = session
        self.last_size = len(response.content)
        return parse_answer(response)

    def call(self, params_json: str) -> dict[str, Any]:
        """A ``tools/call`` whose ``params`` is the raw JSON text ``params_json``."""
        self.next_id += 1
        body = f'{{"jsonrpc":"2.0","id":{self.next_id},"method":"tools/call","params":{params_json}}}'
        return self.post(body.encode("utf-8", "surrogatepass"))

    def close(self) -> None:
        self.http.close()


def parse_answer(response: httpx.Response) -> dict[str, Any]:
    kind = response.headers.get("content-type", "")
    if kind.startswith("text/event-stream"):
        for line in response.text.splitlines():
            if line.startswith("data:") and line[5:].strip():
                answer: dict[str, Any] = json.loads(line[5:])
                return answer
        return {"status": response.status_code, "text": response.text[:500]}
    try:
        parsed = json.loads(response.content) if response.content else {}
    except ValueError:
        return {"status": response.status_code, "text": response.text[:500]}
    return parsed if isinstance(parsed, dict) else {"status": response.status_code,
                                                    "json": parsed}
