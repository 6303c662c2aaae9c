"""Private Redis Cluster and Sentinel groups for tests, from the ``redis-server`` binary.

    with RedisClusterGroup() as cluster:      # 3 primaries + 3 replicas, free loopback ports
        connect(cluster.url)                  # redis+cluster://127.0.0.1:p1,...
        cluster.kill(cluster.primary_of_key("tg:{k}:lock")); cluster.wait_promoted(...)

    with SentinelGroup() as group:            # a primary, 2 replicas, 3 sentinels
        connect(group.url)                    # redis+sentinel://127.0.0.1:s1,.../tgprimary
        group.stall_replication()             # replicas stop receiving the primary's writes

Every process is started here and stopped here, by PID; each dies with the test
process (``PR_SET_PDEATHSIG``) so a crashed run leaves nothing behind. The
machine's shared Redis is never touched.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
from proxy import TcpProxy
from redis.cluster import key_slot
from servers import ON_CI, REDIS_SERVER, free_port, stop_process

__all__ = [
    "RedisClusterGroup",
    "RedisNode",
    "SentinelGroup",
    "redis_cluster",
    "redis_cluster_url",
    "redis_sentinel_url",
    "require_redis_server",
    "sentinel_group",
    "shared_cluster",
]

REDIS_CLI = shutil.which("redis-cli") or "/usr/bin/redis-cli"


def require_redis_server() -> None:
    """Skip locally, fail on CI, when ``redis-server`` / ``redis-cli`` are missing."""
    for binary in (REDIS_SERVER, REDIS_CLI):
        if not os.access(binary, os.X_OK):
            message = f"{binary} not found (Debian: apt-get install redis-server)"
            if ON_CI:
                pytest.fail(f"{message}; CI must provide it", pytrace=False)
            pytest.skip(message)


def _die_with_parent() -> None:
    """In the child: SIGKILL it when the test process dies."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class RedisNode:
    """One ``redis-server`` (or sentinel) process on a free loopback port."""

    def __init__(self, name: str, root: Path, *, args: tuple[str, ...] = (),
                 sentinel_config: str | None = None) -> None:
        self.name = name
        self.port = free_port()
        self.dir = root / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.args = args
        self.sentinel_config = sentinel_config
        self.process: subprocess.Popen[bytes] | None = None
        self.log = self.dir / "redis.log"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _command(self) -> list[str]:
        common = ["--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
                  "--logfile", str(self.log), "--protected-mode", "no"]
        if self.sentinel_config is not None:
            config = self.dir / "sentinel.conf"
            if not config.exists():  # a sentinel rewrites its file; keep what it learnt
                config.write_text(self.sentinel_config)
            return [REDIS_SERVER, str(config), "--sentinel", *common]
        # No persistence; a replica's first sync starts at once (the default waits 5 s).
        return [REDIS_SERVER, *common, "--save", "", "--appendonly", "no",
                "--repl-diskless-sync-delay", "0", *self.args]

    def start(self, timeout_s: float = 10.0, *, loaded: bool = True) -> RedisNode:
        """Start the server; wait until it answers PING (with ``loaded=False``, also while it
        still reads its data back and answers ``-LOADING``)."""
        self.process = subprocess.Popen(self._command(), stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL, preexec_fn=_die_with_parent)
        deadline = time.monotonic() + timeout_s
        while not self._answers_ping(loaded):
            if self.process.poll() is not None:
                msg = f"{self.name} (port {self.port}) exited: {self.log_tail()}"
                raise RuntimeError(msg)
            if time.monotonic() > deadline:
                msg = f"{self.name} (port {self.port}) did not answer in {timeout_s}s"
                raise RuntimeError(msg)
            time.sleep(0.01)
        if not self._answered_by_us():  # another test's server took the port meanwhile
            self.process.kill()
            self.process.wait(timeout=10)
            msg = f"{self.name}: port {self.port} is another process's"
            raise RuntimeError(msg)
        return self

    def _answered_by_us(self) -> bool:
        assert self.process is not None
        with self.client() as client:
            return int(client.info("server")["process_id"]) == self.process.pid

    def _answers_ping(self, loaded: bool = True) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as sock:
                sock.sendall(b"PING\r\n")
                reply = sock.recv(16)
                return reply.startswith(b"+PONG") or (not loaded and reply.startswith(b"-LOADING"))
        except OSError:
            return False

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def client(self, **options: object) -> redis.Redis:
        """A plain client of this one node (no cluster routing)."""
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=3,
                           socket_connect_timeout=3, decode_responses=True, **options)

    def info(self, section: str) -> dict[str, object]:
        with self.client() as client:
            return dict(client.info(section))

    def kill(self) -> None:
        """SIGKILL: gone with its data, as in a crash."""
        if self.alive:
            assert self.process is not None
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=10)

    def pause(self) -> None:
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.alive:
            assert self.process is not None
            self.resume()
            stop_process(self.process)

    def log_tail(self, lines: int = 10) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def _wait(condition: object, what: str, timeout_s: float, poll_s: float = 0.05) -> None:
    deadline = time.monotonic() + timeout_s
    last: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            if condition():  # type: ignore[operator]
                return
        except (redis.RedisError, OSError) as error:
            last = error
        time.sleep(poll_s)
    msg = f"{what} not within {timeout_s}s" + (f" (last error: {last})" if last else "")
    raise AssertionError(msg)


# --- Redis Cluster --------------------------------------------------------------------------


@dataclass(frozen=True)
class ClusterNodeView:
    """One line of ``CLUSTER NODES``."""

    id: str
    port: int
    flags: frozenset[str]
    primary_id: str | None
    slots: tuple[tuple[int, int], ...]

    @property
    def is_primary(self) -> bool:
        return "master" in self.flags and "fail" not in self.flags

    def owns(self, slot: int) -> bool:
        return any(low <= slot <= high for low, high in self.slots)


def _parse_nodes(text: str) -> list[ClusterNodeView]:
    views = []
    for line in text.strip().splitlines():
        fields = line.split()
        port = int(fields[1].split("@")[0].rsplit(":", 1)[1] or 0)
        slots = []
        for part in fields[8:]:
            if part.startswith("["):  # a slot being migrated or imported
                continue
            low, _, high = part.partition("-")
            slots.append((int(low), int(high or low)))
        views.append(ClusterNodeView(id=fields[0], port=port, flags=frozenset(fields[2].split(",")),
                                     primary_id=None if fields[3] == "-" else fields[3],
                                     slots=tuple(slots)))
    return views


class RedisClusterGroup:
    """``primaries`` primaries with ``replicas`` replicas each, created with redis-cli."""

    def __init__(self, primaries: int = 3, replicas: int = 1, *, node_timeout_ms: int = 500) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="toolguard-rcluster-"))
        self.size = primaries * (1 + replicas)
        self.replicas = replicas
        self.node_timeout_ms = node_timeout_ms
        self.nodes = [RedisNode(f"n{i}", self.root) for i in range(self.size)]
        self._assign_ports()

    def _assign_ports(self) -> None:
        for node in self.nodes:
            node.port = free_port()
            node.args = ("--cluster-enabled", "yes",
                         "--cluster-config-file", str(node.dir / "nodes.conf"),
                         "--cluster-node-timeout", str(self.node_timeout_ms),
                         "--cluster-port", str(free_port()),
                         "--cluster-replica-validity-factor", "0",
                         "--cluster-allow-reads-when-down", "no")

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(n.address for n in self.nodes)

    def start(self, timeout_s: float = 30.0, attempts: int = 3) -> RedisClusterGroup:
        """Start the nodes and create the cluster; on a port taken meanwhile, try new ports."""
        for attempt in range(attempts):
            try:
                for node in self.nodes:
                    node.start()
                break
            except RuntimeError:
                for node in self.nodes:
                    node.stop()
                    (node.dir / "nodes.conf").unlink(missing_ok=True)
                if attempt == attempts - 1:
                    raise
                self._assign_ports()
        command = [REDIS_CLI, "--cluster", "create", *(n.address for n in self.nodes),
                   "--cluster-replicas", str(self.replicas), "--cluster-yes"]
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s,
                                check=False)
        if result.returncode != 0:
            msg = f"redis-cli --cluster create failed: {result.stdout[-1500:]} {result.stderr}"
            raise RuntimeError(msg)
        self.wait_ok(timeout_s)
        return self

    def live(self) -> list[RedisNode]:
        return [n for n in self.nodes if n.alive]

    def topology(self, via: RedisNode | None = None) -> list[ClusterNodeView]:
        node = via or self.live()[0]
        with node.client() as client:
            return _parse_nodes(client.execute_command("CLUSTER", "NODES"))

    def node(self, view: ClusterNodeView) -> RedisNode:
        return next(n for n in self.nodes if n.port == view.port)

    def view(self, node: RedisNode, via: RedisNode | None = None) -> ClusterNodeView:
        return next(v for v in self.topology(via) if v.port == node.port)

    def primaries(self) -> list[RedisNode]:
        return [self.node(v) for v in self.topology() if v.is_primary]

    def primary_of_slot(self, slot: int) -> RedisNode:
        return self.node(next(v for v in self.topology() if v.is_primary and v.owns(slot)))

    def primary_of_key(self, key: str) -> RedisNode:
        return self.primary_of_slot(key_slot(key.encode()))

    def replicas_of(self, primary: RedisNode) -> list[RedisNode]:
        primary_id = self.view(primary).id
        return [self.node(v) for v in self.topology() if v.primary_id == primary_id]

    def wait_ok(self, timeout_s: float = 30.0) -> None:
        """Every live node says ``cluster_state:ok`` with all slots served, and all agree
        which live node serves each slot."""

        def agreed() -> bool:
            owners = set()
            for node in self.live():
                with node.client() as client:
                    info = client.execute_command("CLUSTER", "INFO")
                state = dict(line.split(":", 1) for line in info.strip().splitlines())
                if state.get("cluster_state") != "ok" or state.get("cluster_slots_ok") != "16384":
                    return False
                views = self.topology(via=node)
                owners.add(tuple(sorted((v.port, v.slots) for v in views
                                        if v.is_primary and v.slots)))
                if any(v.port not in {n.port for n in self.live()} for v in views
                       if v.is_primary and v.slots):
                    return False
            return len(owners) == 1

        _wait(agreed, "the cluster settled", timeout_s)

    def kill(self, node: RedisNode) -> None:
        node.kill()

    def wait_promoted(self, failed: RedisNode, timeout_s: float = 30.0) -> RedisNode:
        """Wait until a replica of ``failed`` serves its slots everywhere; returns it."""
        before = self.view_from_file(failed)
        self.wait_ok(timeout_s)
        slot = before.slots[0][0]
        promoted = self.primary_of_slot(slot)
        assert promoted is not failed, "the failed primary still serves its slots"
        return promoted

    def view_from_file(self, node: RedisNode) -> ClusterNodeView:
        """``node``'s own line from its ``nodes.conf`` (readable after it died)."""
        text = (node.dir / "nodes.conf").read_text()
        lines = [line for line in text.splitlines() if "myself" in line]
        return _parse_nodes(lines[0])[0]

    # --- resharding ------------------------------------------------------------------------

    def begin_migration(self, slot: int, target: RedisNode) -> RedisNode:
        """Mark ``slot`` importing on ``target`` and migrating on its owner; returns the owner."""
        source = self.primary_of_slot(slot)
        source_id, target_id = self.view(source).id, self.view(target).id
        with target.client() as client:
            client.execute_command("CLUSTER SETSLOT", slot, "IMPORTING", source_id)
        with source.client() as client:
            client.execute_command("CLUSTER SETSLOT", slot, "MIGRATING", target_id)
        return source

    def move_keys(self, slot: int, source: RedisNode, target: RedisNode) -> int:
        """MIGRATE every key of ``slot`` from ``source`` to ``target``; returns how many."""
        moved = 0
        with source.client() as client:
            while True:
                keys = client.execute_command("CLUSTER GETKEYSINSLOT", slot, 100)
                if not keys:
                    return moved
                client.execute_command("MIGRATE", "127.0.0.1", target.port, "", 0, 5000,
                                       "REPLACE", "KEYS", *keys)
                moved += len(keys)

    def end_migration(self, slot: int, target: RedisNode) -> None:
        """Assign ``slot`` to ``target`` on every primary (the last step of a resharding)."""
        target_id = self.view(target).id
        with target.client() as client:
            client.execute_command("CLUSTER SETSLOT", slot, "NODE", target_id)
        for node in self.primaries():
            if node is not target:
                with node.client() as client:
                    client.execute_command("CLUSTER SETSLOT", slot, "NODE", target_id)

    def migrate(self, slot: int, target: RedisNode) -> int:
        """Move ``slot`` to ``target`` as ``redis-cli --cluster reshard`` does."""
        source = self.begin_migration(slot, target)
        moved = self.move_keys(slot, source, target)
        self.end_migration(slot, target)
        return moved

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> RedisClusterGroup:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()


# --- Sentinel -------------------------------------------------------------------------------


class SentinelGroup:
    """A primary, ``replicas`` replicas (each fed through a ``TcpProxy`` the test can stall)
    and ``sentinels`` sentinels with a quorum of a majority."""

    SERVICE = "tgprimary"

    def __init__(self, replicas: int = 2, sentinels: int = 3, *, down_after_ms: int = 500,
                 failover_timeout_ms: int = 3000) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="toolguard-sentinel-"))
        self.primary = RedisNode("primary", self.root)
        self.proxies = [TcpProxy(("127.0.0.1", self.primary.port)) for _ in range(replicas)]
        self.replicas = [RedisNode(f"replica{i}", self.root) for i in range(replicas)]
        self.down_after_ms = down_after_ms
        self.failover_timeout_ms = failover_timeout_ms
        ids = [secrets.token_hex(20) for _ in range(sentinels)]
        self.sentinels = [RedisNode(f"sentinel{i}", self.root) for i in range(sentinels)]
        self.quorum = sentinels // 2 + 1
        for i, sentinel in enumerate(self.sentinels):
            sentinel.sentinel_config = self._sentinel_config(i, ids)

    def _sentinel_config(self, index: int, ids: list[str]) -> str:
        name = self.SERVICE
        lines = [f"sentinel myid {ids[index]}",
                 f"sentinel monitor {name} 127.0.0.1 {self.primary.port} {self.quorum}",
                 f"sentinel down-after-milliseconds {name} {self.down_after_ms}",
                 f"sentinel failover-timeout {name} {self.failover_timeout_ms}",
                 f"sentinel parallel-syncs {name} {len(self.replicas)}"]
        # Known up front, so the group is ready without waiting for the hello messages.
        lines += [f"sentinel known-replica {name} 127.0.0.1 {r.port}" for r in self.replicas]
        lines += [f"sentinel known-sentinel {name} 127.0.0.1 {s.port} {ids[i]}"
                  for i, s in enumerate(self.sentinels) if i != index]
        return "\n".join(lines) + "\n"

    @property
    def url(self) -> str:
        return ("redis+sentinel://" + ",".join(s.address for s in self.sentinels)
                + f"/{self.SERVICE}")

    def start(self, timeout_s: float = 30.0) -> SentinelGroup:
        self.primary.start()
        for proxy, replica in zip(self.proxies, self.replicas, strict=True):
            proxy.start()
            replica.args = ("--replicaof", "127.0.0.1", str(proxy.port))
            replica.start()
        _wait(lambda: all(r.info("replication").get("master_link_status") == "up"
                          for r in self.replicas), "replicas in sync", timeout_s)
        for sentinel in self.sentinels:
            sentinel.start()
        _wait(self._sentinels_ready, "sentinels ready", timeout_s)
        return self

    def _sentinels_ready(self) -> bool:
        for sentinel in self.sentinels:
            with sentinel.client() as client:
                state = client.execute_command("SENTINEL", "MASTER", self.SERVICE)
            if isinstance(state, list):
                state = dict(zip(state[::2], state[1::2], strict=True))
            if "s_down" in str(state.get("flags")) or int(state.get("num-slaves", 0)) < len(
                    self.replicas):
                return False
        return True

    def primary_port(self) -> int | None:
        """Where the sentinels (a majority of those alive) say the primary is."""
        ports = []
        for sentinel in self.sentinels:
            with contextlib.suppress(redis.RedisError, OSError), sentinel.client() as client:
                address = client.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME",
                                                 self.SERVICE)
                if address:
                    ports.append(int(address[1]))
        best = max(set(ports), key=ports.count, default=None)
        return best if best is not None and ports.count(best) >= self.quorum else None

    def node_on(self, port: int) -> RedisNode:
        return next(n for n in (self.primary, *self.replicas) if n.port == port)

    def wait_failover(self, old: RedisNode, timeout_s: float = 30.0) -> RedisNode:
        """Wait until the sentinels name a new primary and it acts as one; returns it."""
        _wait(lambda: self.primary_port() not in (None, old.port), "a failover", timeout_s)
        port = self.primary_port()
        assert port is not None
        new = self.node_on(port)
        _wait(lambda: new.info("replication").get("role") == "master", "the new primary",
              timeout_s)
        return new

    def stall_replication(self) -> None:
        """Replicas stop receiving the primary's writes (their links stay open)."""
        for proxy in self.proxies:
            proxy.stall()

    def heal_replication(self) -> None:
        for proxy in self.proxies:
            proxy.heal()

    def stop(self) -> None:
        for node in (*self.sentinels, self.primary, *self.replicas):
            node.stop()
        for proxy in self.proxies:
            with contextlib.suppress(Exception):
                proxy.close()
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> SentinelGroup:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()


# --- fixtures -------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def shared_cluster() -> Iterator[RedisClusterGroup]:
    """A private cluster shared by the session's non-destructive tests (they use unique keys)."""
    require_redis_server()
    with RedisClusterGroup() as cluster:
        yield cluster


@pytest.fixture(scope="session")
def redis_cluster_url(shared_cluster: RedisClusterGroup) -> str:
    """The shared cluster's URL (the contract suite, the doctor)."""
    return shared_cluster.url


def started_sentinel_group(attempts: int = 3) -> SentinelGroup:
    """A started ``SentinelGroup``; on a port another test took meanwhile, new ports."""
    for attempt in range(attempts):
        group = SentinelGroup()
        try:
            return group.start()
        except RuntimeError:
            group.stop()
            if attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


@pytest.fixture(scope="session")
def redis_sentinel_url() -> Iterator[str]:
    """A private Sentinel group shared by the session's non-destructive tests."""
    require_redis_server()
    group = started_sentinel_group()
    try:
        yield group.url
    finally:
        group.stop()


@pytest.fixture
def redis_cluster() -> Iterator[RedisClusterGroup]:
    """A private cluster per test, for scenarios that kill nodes or move slots."""
    require_redis_server()
    with RedisClusterGroup() as cluster:
        yield cluster


@pytest.fixture
def sentinel_group() -> Iterator[SentinelGroup]:
    """A private Sentinel group per test, for scenarios that fail the primary over."""
    require_redis_server()
    group = started_sentinel_group()
    try:
        yield group
    finally:
        group.stop()
