"""Several "hosts" on one machine: network namespaces, veth links and nftables rules.

    with NetLab() as lab:                       # needs root (ip netns, nft)
        srv, a = lab.host("srv"), lab.host("a") # each a namespace on one private bridge
        redis = NsRedis(srv).start()            # agents use redis.url (10.x.y.z:6379)
        a.cut(srv.address, 6379)                # packets between a and srv's Redis dropped
        a.heal()

Every namespace, link and process is the lab's own: names carry a random tag, the
addresses are a random private /24 that exists only inside the lab's namespaces
(nothing is added to the machine's own network namespace), and ``close`` kills the
processes it started (by PID) and deletes the namespaces, also after a failure.
The test process reaches the servers through their Unix sockets (the filesystem
is shared between namespaces), so its own checks never cross a faulted link.

Latency: the kernel may lack ``sch_netem`` (``tc qdisc ... netem`` then fails with
"Specified qdisc kind is unknown"), so added latency comes from ``DelayRelay``,
a relay in the server's namespace that holds every chunk for a while in each
direction; loss comes from nftables (``numgen random``) in the agent's namespace.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import pickle
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import pytest
from pg_server import PgServer, pg_available
from servers import ON_CI, REDIS_SERVER

__all__ = [
    "DelayRelay",
    "Host",
    "NetLab",
    "NsEtcdCluster",
    "NsPostgres",
    "NsProcess",
    "NsRedis",
    "require_netns",
    "require_postgres",
]

TESTS = Path(__file__).resolve().parent
CLONE_NEWNET = 0x40000000
T = TypeVar("T")


def _need(problem: str | None) -> None:
    if problem is None:
        return
    if ON_CI:
        pytest.fail(f"{problem}; CI must provide it", pytrace=False)
    pytest.skip(problem)


def require_netns() -> None:
    """The namespace tests need root, ``ip`` and ``nft``: skip without them, except on CI."""
    if os.geteuid() != 0:
        _need("network-namespace tests need root (ip netns, veth, nft)")
    for tool in ("ip", "nft"):
        if shutil.which(tool) is None:
            _need(f"{tool} not found (Debian: apt-get install iproute2 nftables)")


def _run(argv: Sequence[str], *, stdin: str | None = None, check: bool = True) -> str:
    result = subprocess.run(list(argv), input=stdin, capture_output=True, text=True,
                            timeout=30, check=False)
    if check and result.returncode != 0:
        msg = f"{' '.join(argv)} failed ({result.returncode}): {result.stderr.strip()}"
        raise RuntimeError(msg)
    return result.stdout


def _die_with_parent() -> None:
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


_libc = ctypes.CDLL("libc.so.6", use_errno=True)


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        error = ctypes.get_errno()
        raise OSError(error, os.strerror(error))


class Host:
    """One namespace on the lab's bridge, with one address."""

    def __init__(self, lab: NetLab, role: str, namespace: str, address: str) -> None:
        self.lab = lab
        self.role = role
        self.namespace = namespace
        self.address = address
        self._rules: list[str] = []

    def argv(self, command: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.namespace, *command]

    def run(self, command: Sequence[str], **options: Any) -> str:
        return _run(self.argv(command), **options)

    def popen(self, command: Sequence[str], **options: Any) -> subprocess.Popen[bytes]:
        """Start ``command`` in this namespace (``ip netns exec`` execs it: same PID)."""
        options.setdefault("stdout", subprocess.DEVNULL)
        options.setdefault("stderr", subprocess.DEVNULL)
        process = subprocess.Popen(self.argv(command), preexec_fn=_die_with_parent, **options)
        self.lab.processes.append(process)
        return process

    # --- faults (nftables in this namespace: only this host's own traffic) ----------------

    def _apply(self) -> None:
        script = ["table inet tgfault", "delete table inet tgfault",
                  "table inet tgfault {",
                  "  chain out { type filter hook output priority 0; policy accept; }",
                  "  chain in { type filter hook input priority 0; policy accept; }", "}"]
        script += self._rules
        self.run(["nft", "-f", "-"], stdin="\n".join(script) + "\n")

    def cut(self, peer: str, port: int) -> None:
        """Drop every packet between this host and ``peer:port`` (a link that went dark)."""
        self._rules += [f"add rule inet tgfault out ip daddr {peer} tcp dport {port} drop",
                        f"add rule inet tgfault in ip saddr {peer} tcp sport {port} drop"]
        self._apply()

    def isolate(self, peers: Sequence[str]) -> None:
        """Drop every packet between this host and each of ``peers`` (a partition)."""
        for peer in peers:
            self._rules += [f"add rule inet tgfault out ip daddr {peer} drop",
                            f"add rule inet tgfault in ip saddr {peer} drop"]
        self._apply()

    def lossy(self, peer: str, port: int, percent: int) -> None:
        """Drop ``percent`` % of the packets between this host and ``peer:port``, each way."""
        self._rules += [
            f"add rule inet tgfault out ip daddr {peer} tcp dport {port} "
            f"numgen random mod 100 < {percent} drop",
            f"add rule inet tgfault in ip saddr {peer} tcp sport {port} "
            f"numgen random mod 100 < {percent} drop"]
        self._apply()

    def heal(self) -> None:
        self._rules.clear()
        self._apply()

    # --- the test process itself in this namespace ----------------------------------------

    @contextlib.contextmanager
    def inside(self) -> Iterator[None]:
        """Run the calling thread in this namespace; sockets (and threads) it creates stay
        there after the block."""
        own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        target = os.open(f"/var/run/netns/{self.namespace}", os.O_RDONLY)
        try:
            _setns(target)
            try:
                yield
            finally:
                _setns(own)
        finally:
            os.close(target)
            os.close(own)

    def call(self, function: Callable[[], T]) -> T:
        """``function()`` on a thread of its own in this namespace (threads it starts too)."""
        box: list[Any] = []

        def run() -> None:
            try:
                with self.inside():
                    box.append((True, function()))
            except BaseException as error:  # handed to the caller below
                box.append((False, error))

        thread = threading.Thread(target=run, name=f"in-{self.role}")
        thread.start()
        thread.join()
        ok, value = box[0]
        if not ok:
            raise value
        return value  # type: ignore[no-any-return]


class NetLab:
    """Namespaces joined by one bridge; everything removed by ``close``."""

    def __init__(self) -> None:
        self.tag = secrets.token_hex(3)
        self.prefix = f"10.{random.randint(200, 250)}.{random.randint(0, 255)}"
        self.hub = f"tg{self.tag}hub"
        self.hosts: list[Host] = []
        self.processes: list[subprocess.Popen[bytes]] = []
        self.namespaces: list[str] = []
        self.dir = Path(tempfile.mkdtemp(prefix=f"toolguard-netns-{self.tag}-"))

    def start(self) -> NetLab:
        self._add_namespace(self.hub)
        _run(["ip", "-n", self.hub, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", self.hub, "link", "set", "br0", "up"])
        return self

    def _add_namespace(self, name: str) -> None:
        _run(["ip", "netns", "add", name])
        self.namespaces.append(name)
        _run(["ip", "-n", name, "link", "set", "lo", "up"])

    def host(self, role: str) -> Host:
        """A new namespace with an address on the bridge."""
        index = len(self.hosts) + 1
        name = f"tg{self.tag}{role}"[:15]
        self._add_namespace(name)
        port = f"p{index}"
        _run(["ip", "link", "add", "name", "eth0", "netns", name, "type", "veth",
              "peer", "name", port, "netns", self.hub])
        _run(["ip", "-n", self.hub, "link", "set", port, "master", "br0", "up"])
        address = f"{self.prefix}.{index}"
        _run(["ip", "-n", name, "addr", "add", f"{address}/24", "dev", "eth0"])
        _run(["ip", "-n", name, "link", "set", "eth0", "up"])
        host = Host(self, role, name, address)
        self.hosts.append(host)
        return host

    def close(self) -> None:
        for process in reversed(self.processes):
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGCONT)
                    process.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(timeout=10)
        for name in reversed(self.namespaces):
            # Whatever still runs in a namespace of ours was started in it by us (a server
            # that daemonized, such as the postmaster): it goes with the namespace.
            for pid in _run(["ip", "netns", "pids", name], check=False).split():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            _run(["ip", "netns", "del", name], check=False)
        self.namespaces.clear()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> NetLab:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()


# --- servers inside a namespace --------------------------------------------------------------


def _wait(condition: Callable[[], bool], what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            msg = f"{what} not within {timeout_s}s"
            raise RuntimeError(msg)
        time.sleep(0.02)


class NsRedis:
    """A private ``redis-server`` in ``host``'s namespace: TCP on the host's address for
    the agents, a Unix socket for the test."""

    PORT = 6379  # the namespace's own port space: no other server there

    def __init__(self, host: Host) -> None:
        self.host = host
        self.dir = host.lab.dir / f"redis-{host.role}"
        self.dir.mkdir()
        self.socket = self.dir / "redis.sock"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://{self.host.address}:{self.PORT}/0"

    @property
    def local_url(self) -> str:
        return f"unix://{self.socket}?db=0"

    def start(self) -> NsRedis:
        self.process = self.host.popen([
            REDIS_SERVER, "--bind", self.host.address, "--port", str(self.PORT),
            "--unixsocket", str(self.socket), "--unixsocketperm", "777", "--save", "",
            "--appendonly", "no", "--dir", str(self.dir), "--protected-mode", "no"])
        _wait(self._answers, "redis-server in the namespace answering")
        return self

    def _answers(self) -> bool:
        try:
            with socket.socket(socket.AF_UNIX) as sock:
                sock.settimeout(1)
                sock.connect(str(self.socket))
                sock.sendall(b"PING\r\n")
                return sock.recv(16).startswith(b"+PONG")
        except OSError:
            return False


class NsPostgres(PgServer):
    """A private PostgreSQL in ``host``'s namespace (listening on the host's address and a
    Unix socket; trust auth for the lab's /24)."""

    PORT = 5432

    def __init__(self, host: Host) -> None:
        super().__init__(port=self.PORT)
        self.host = host

    @property
    def url(self) -> str:
        return f"postgresql://postgres@{self.host.address}:{self.PORT}/postgres"

    @property
    def local_url(self) -> str:
        return f"postgresql://postgres@/postgres?host={self.dir}&port={self.PORT}"

    def _run(self, *argv: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        command = [str(self.bin_dir / argv[0]), *argv[1:]]
        if os.geteuid() == 0:
            command = ["runuser", "-u", "postgres", "--", *command]
        result = subprocess.run(self.host.argv(command), capture_output=True, text=True,
                                timeout=timeout, check=False, cwd=self.dir)
        if result.returncode != 0:
            log = self.logfile.read_text() if self.logfile.exists() else ""
            msg = f"{' '.join(argv[:2])} failed: {result.stderr.strip()}\n{log[-2000:]}"
            raise RuntimeError(msg)
        return result

    def init(self) -> NsPostgres:
        super().init()
        with (self.data / "pg_hba.conf").open("a") as hba:
            hba.write(f"host all all {self.host.lab.prefix}.0/24 trust\n")
        return self

    def start(self) -> NsPostgres:
        if not self.initialized:
            self.init()
        options = (f"-p {self.PORT} -k {self.dir} -c listen_addresses={self.host.address} "
                   "-c fsync=off -c synchronous_commit=off -c max_connections=100")
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.logfile), "-o", options,
                  "-w", "-t", "30", "start")
        return self


def require_postgres() -> None:
    _need(pg_available())


class NsEtcdCluster:
    """One etcd member in each of ``hosts``' namespaces, on the hosts' addresses."""

    CLIENT_PORT = 2379
    PEER_PORT = 2380

    def __init__(self, hosts: Sequence[Host]) -> None:
        from etcd_server import ELECTION_MS, ETCD_BINARY, HEARTBEAT_MS

        self.hosts = list(hosts)
        self.binary = ETCD_BINARY
        self.timing = (HEARTBEAT_MS, ELECTION_MS)
        shm = Path("/dev/shm")
        root = shm if shm.is_dir() and os.access(shm, os.W_OK) else hosts[0].lab.dir
        self.root = Path(tempfile.mkdtemp(prefix="toolguard-nsetcd-", dir=root))

    def url(self, hosts: Sequence[Host] | None = None) -> str:
        """The lock URL naming the members on ``hosts`` (default: all)."""
        chosen = self.hosts if hosts is None else hosts
        return "etcd://" + ",".join(f"{h.address}:{self.CLIENT_PORT}" for h in chosen)

    def start(self, timeout_s: float = 30.0) -> NsEtcdCluster:
        initial = ",".join(f"m{i}=http://{h.address}:{self.PEER_PORT}"
                           for i, h in enumerate(self.hosts))
        token = f"tg-{secrets.token_hex(4)}"
        heartbeat_ms, election_ms = self.timing
        for i, host in enumerate(self.hosts):
            client = f"http://{host.address}:{self.CLIENT_PORT}"
            peer = f"http://{host.address}:{self.PEER_PORT}"
            log = (self.root / f"m{i}.log").open("ab")
            host.popen([self.binary, "--name", f"m{i}", "--data-dir", str(self.root / f"m{i}"),
                        "--listen-client-urls", client, "--advertise-client-urls", client,
                        "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                        "--initial-cluster", initial, "--initial-cluster-state", "new",
                        "--initial-cluster-token", token,
                        "--heartbeat-interval", str(heartbeat_ms),
                        "--election-timeout", str(election_ms),
                        "--logger", "zap", "--log-outputs", "stderr", "--log-level", "warn"],
                       stdout=log, stderr=log)
        _wait(lambda: all(self.healthy(h) for h in self.hosts), "etcd members healthy",
              timeout_s)
        return self

    def _client(self, host: Host) -> Any:
        from etcd3gw.client import Etcd3Client

        return Etcd3Client(host=host.address, port=self.CLIENT_PORT, timeout=1)

    def healthy(self, host: Host) -> bool:
        def ask() -> bool:
            import json
            import urllib.request

            url = f"http://{host.address}:{self.CLIENT_PORT}/health"
            try:
                with urllib.request.urlopen(url, timeout=1) as reply:
                    return json.loads(reply.read()).get("health") == "true"
            except (OSError, ValueError):
                return False

        return host.call(ask)

    def leader(self, timeout_s: float = 10.0) -> Host:
        """The host whose member leads right now (asked from inside each namespace)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for host in self.hosts:
                def status(host: Host = host) -> Any:
                    return self._client(host).status()

                try:
                    found = host.call(status)
                except Exception:  # a member down or cut off: ask another one
                    continue
                if int(found.get("leader", 0)) == int(found["header"]["member_id"]):
                    return host
            time.sleep(0.05)
        msg = "the etcd cluster has no leader"
        raise AssertionError(msg)

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)  # the processes are the lab's


class DelayRelay:
    """A TCP relay in ``host``'s namespace that can hold every chunk ``delay_ms`` in each
    direction (SIGUSR1 turns the delay on, SIGUSR2 off). Agents connect to ``port``."""

    PORT = 16379

    def __init__(self, host: Host, target_port: int, delay_ms: int) -> None:
        self.host = host
        self.target_port = target_port
        self.delay_ms = delay_ms
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def port(self) -> int:
        return self.PORT

    def start(self) -> DelayRelay:
        self.process = self.host.popen(
            [sys.executable, str(TESTS / "netns_relay.py"), self.host.address, str(self.PORT),
             str(self.target_port), str(self.delay_ms)])
        _wait(lambda: "LISTEN" in self.host.run(["ss", "-ltn", f"sport = :{self.PORT}"]),
              "the delay relay listening")
        return self

    def delay(self, on: bool) -> None:
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGUSR1 if on else signal.SIGUSR2)


# --- agent processes inside a namespace ------------------------------------------------------


class NsProcess:
    """An agent process in a namespace, with the face of a ``multiprocessing.Process``
    (name, pid, is_alive, join, kill) so ``FaultRun`` can stop and check it."""

    def __init__(self, host: Host, name: str, spec: dict[str, Any]) -> None:
        self.name = f"agent-{name}"
        path = host.lab.dir / f"spec-{name}.pickle"
        path.write_bytes(pickle.dumps(spec))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(TESTS.parent)])}
        self.popen = host.popen([sys.executable, str(TESTS / "netns_agent.py"), str(path)],
                                env=env, stderr=(host.lab.dir / f"{name}.err").open("wb"))
        self.pid = self.popen.pid

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    def join(self, timeout: float | None = None) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.popen.kill()
