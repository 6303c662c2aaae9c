"""A fenced upstream (``FenceToolMiddleware``) behind the gateway checks the forwarded fences itself."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from toolguard.fences import generate_signing_key
from toolguard.fences.keys import write_signing_key
from toolguard.fences.scope import scoped_key
from toolguard.store import open_store

from .conftest import HERE, audit_rows, free_port, http_session

#: Each test starts real processes (the gateway, its upstream): slow on a loaded machine.
pytestmark = pytest.mark.timeout(900)

TESTS = HERE.parent


#: the gateway's signing key and the one a signed upstream trusts
GATEWAY_KEY = generate_signing_key("gw1")


@pytest.fixture
def fenced_service(tmp_path: Path) -> Iterator[tuple[str, str]]:
    """The fences tests' MCP service (its own SQLite store), on uvicorn."""
    yield from _mcp_service(tmp_path, "fences.service_app:create_mcp_app", {})


@pytest.fixture
def signed_service(tmp_path: Path) -> Iterator[tuple[str, str]]:
    """The same service in signed mode: audience ``crm``, trusting only ``GATEWAY_KEY``."""
    yield from _mcp_service(tmp_path, "fences.claims_service:create_mcp_app", {
        "FENCES_AUDIENCE": "crm", "TOOLGUARD_FENCE_VERIFY_KEYS": GATEWAY_KEY.public().text()})


def _mcp_service(tmp_path: Path, factory: str, extra: dict[str, str]) -> Iterator[tuple[str, str]]:
    store_url = f"sqlite:///{tmp_path}/service.db"
    port = free_port()
    env = {**os.environ, "PYTHONPATH": f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "FENCES_STORE_URL": store_url, "FENCES_SCHEMA": "", **extra}
    process = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "--factory", factory,
         "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/mcp"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, "the fenced service exited"
            try:
                httpx.get(url, timeout=1.0)
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline, "the fenced service did not start"
                time.sleep(0.2)
        yield url, store_url
    finally:
        process.terminate()
        process.wait(timeout=20)


def test_the_gateway_forwards_the_lease_s_fences_and_the_upstream_checks_them(
        tmp_path: Path, fenced_service, start_gateway) -> None:
    url, store_url = fenced_service
    gateway = start_gateway("--token", "alice:" + "a" * 24, "--upstream", url, upstream=[],
                            policy=HERE / "fenced_policy.yml")
    key = {"toolguard/idempotency-key": "f-1"}

    async def run():
        async with http_session(gateway.url, "a" * 24) as session:
            first = await session.call_tool("set_score", {"lead_id": "L1", "score": 40}, meta=key)
            again = await session.call_tool("set_score", {"lead_id": "L1", "score": 40}, meta=key)
            forged = await session.call_tool(
                "set_score", {"lead_id": "L1", "score": 1},
                meta={"toolguard/fencing-token": "lead%3AL1=999999999999999999"})
            return first, again, forged

    first, again, forged = asyncio.run(run())
    assert not first.is_error, first.content
    assert first.structured_content["writes"] == 1
    assert (again.meta or {})["toolguard/replayed"] is True
    assert forged.is_error and (forged.meta or {})["toolguard/reason"] == "invalid_intent"
    rows = audit_rows(tmp_path)
    token = rows[0].tokens["lead:L1"]
    with open_store(store_url) as service:
        assert service.high_water("lead:L1") == token  # the gateway's lease fenced the write
        served = service.query_audit(newest_first=False, limit=None)
    assert [(r.decision, r.agent) for r in served] == [("accepted", "alice")]  # once, as alice
    # the upstream keeps its answer under the key scoped to itself and the agent
    assert served[0].idempotency_key == scoped_key("thread:mcp-key%3Aalice//f-1#1",
                                                   audience=None, agent="alice")


def test_a_fenced_upstream_refuses_the_gateway_s_stale_lease_itself(
        tmp_path: Path, fenced_service, start_gateway) -> None:
    """A newer holder wrote past the gateway's lock service: the upstream refuses the gateway."""
    from fastmcp import Client
    from mcp.shared.exceptions import MCPError

    from toolguard.fences.wire import Fences

    url, store_url = fenced_service
    gateway = start_gateway("--token", "alice:" + "a" * 24, "--upstream", url, upstream=[],
                            policy=HERE / "fenced_policy.yml")

    async def run():
        newer = Fences(tokens={"lead:L2": 9 * 10**17}, idempotency_key="newer#1", agent="other",
                       intent_id="n-1").meta()
        async with Client(url) as direct:
            await direct.call_tool("set_score", {"lead_id": "L2", "score": 99}, meta=newer)
        async with http_session(gateway.url, "a" * 24) as session:
            try:
                await session.call_tool("set_score", {"lead_id": "L2", "score": 1})
            except MCPError as error:
                return error
        return None

    refused = asyncio.run(run())
    assert refused is not None, "the upstream's refusal passes through as its JSON-RPC error"
    assert "stale" in str(refused).lower()
    (row,) = audit_rows(tmp_path)
    assert (row.decision, row.reason) == ("failed", "upstream_error")
    with open_store(store_url) as service:
        assert service.high_water("lead:L2") == 9 * 10**17  # the stale write changed nothing


def test_a_signed_upstream_takes_the_gateway_s_signed_fences_and_refuses_unsigned_ones(
        tmp_path: Path, signed_service, start_gateway) -> None:
    """``--sign-for`` signs the forwarded fences from the gateway's lease; without it a signed
    upstream refuses the call (``claim_missing``) and its fence stays where it was."""
    from mcp.shared.exceptions import MCPError

    url, store_url = signed_service
    key_file = write_signing_key(GATEWAY_KEY, tmp_path / "gateway.key")
    signing = start_gateway("--token", "alice:" + "a" * 24, "--upstream", url,
                            "--sign-for", "crm", "--signing-key", str(key_file), upstream=[],
                            policy=HERE / "fenced_policy.yml")
    unsigned = start_gateway("--token", "alice:" + "a" * 24, "--upstream", url, upstream=[],
                             policy=HERE / "fenced_policy.yml")

    async def run():
        async with http_session(signing.url, "a" * 24) as session:
            signed = await session.call_tool("set_score", {"lead_id": "L3", "score": 7})
        async with http_session(unsigned.url, "a" * 24) as session:
            try:
                await session.call_tool("set_score", {"lead_id": "L4", "score": 8})
            except MCPError as error:
                return signed, error
        return signed, None

    signed, refused = asyncio.run(run())
    assert not signed.is_error, signed.content
    assert signed.structured_content["signed_by"] == ["gw1"]
    assert refused is not None and "claim" in str(refused).lower(), refused
    with open_store(store_url) as service:
        assert service.high_water("lead:L3") > 0
        assert service.high_water("lead:L4") in (None, 0)  # the unsigned call changed nothing
        served = service.query_audit(newest_first=False, limit=None)
    assert [(r.decision, r.reason) for r in served if r.decision != "accepted"] == [
        ("rejected", "claim_missing")]


def test_a_signing_key_that_cannot_be_read_stops_the_gateway_before_it_starts(
        tmp_path: Path) -> None:
    from .conftest import clean_env, toolguard

    loose = tmp_path / "loose.key"
    write_signing_key(GATEWAY_KEY, loose).chmod(0o644)
    for extra, says in ((["--signing-key", str(loose)], "chmod 600"),
                        (["--signing-key", str(tmp_path / "missing.key")], "missing.key"),
                        ([], "TOOLGUARD_FENCE_SIGNING_KEY")):
        done = subprocess.run(
            [*toolguard("mcp", "proxy", "--policy", str(HERE / "fenced_policy.yml"),
                        "--agent", "alice", "--sign-for", "crm", *extra),
             "--", sys.executable, "-c", "pass"],
            cwd=tmp_path, env=clean_env(tmp_path), capture_output=True, text=True, timeout=120)
        assert done.returncode == 2, (extra, done.stdout, done.stderr)
        assert says in done.stderr and "Traceback" not in done.stderr, (extra, done.stderr)
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr
