"""The test proxy itself: it forwards, and cut / stall / heal do what the scenarios assume."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator

import pytest
from proxy import TcpProxy

pytestmark = pytest.mark.fault


@pytest.fixture
def echo() -> Iterator[int]:
    """A loopback echo server; yields its port."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.1)
    stop = threading.Event()

    def serve(conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            while data := conn.recv(4096):
                conn.sendall(data)

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    stop.set()
    thread.join(2)
    server.close()


def roundtrip(sock: socket.socket, payload: bytes = b"ping") -> bytes:
    sock.sendall(payload)
    return sock.recv(4096)


def broken(sock: socket.socket) -> bool:
    """True if a round trip on ``sock`` fails (reset, or EOF)."""
    try:
        return not roundtrip(sock)
    except OSError:
        return True


def refused(address: tuple[str, int]) -> bool:
    """True if a new connection is reset on arrival (maybe already during the connect)."""
    try:
        with socket.create_connection(address, timeout=2) as sock:
            return broken(sock)
    except OSError:
        return True


@pytest.mark.timeout(30)
def test_forwards_and_cuts(echo: int) -> None:
    with TcpProxy(("127.0.0.1", echo)) as proxy:
        with socket.create_connection(proxy.address, timeout=2) as sock:
            assert roundtrip(sock) == b"ping"
            assert proxy.cut() == 1
            assert broken(sock)
        assert proxy.state == "cut"
        assert refused(proxy.address)
        proxy.heal()
        with socket.create_connection(proxy.address, timeout=2) as sock:
            assert roundtrip(sock) == b"ping"
        assert proxy.refused >= 1


@pytest.mark.timeout(30)
def test_stall_holds_bytes_until_heal(echo: int) -> None:
    with TcpProxy(("127.0.0.1", echo)) as proxy, \
            socket.create_connection(proxy.address, timeout=0.3) as sock:
        assert roundtrip(sock) == b"ping"
        proxy.stall()
        with pytest.raises(TimeoutError):
            roundtrip(sock, b"held")
        assert proxy.connections() == 1  # still open
        proxy.heal()
        sock.settimeout(2)
        assert sock.recv(4096) == b"held"


@pytest.mark.timeout(30)
def test_replies_only_stall_delivers_requests() -> None:
    """Requests reach the server while its replies are held (a COMMIT lands unacknowledged)."""
    seen: list[bytes] = []
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = server.accept()
        with conn:
            data = conn.recv(4096)
            seen.append(data)
            conn.sendall(b"ok:" + data)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    with TcpProxy(("127.0.0.1", server.getsockname()[1])) as proxy, \
            socket.create_connection(proxy.address, timeout=0.5) as sock:
        proxy.stall(replies_only=True)
        sock.sendall(b"commit")
        with pytest.raises(TimeoutError):
            sock.recv(4096)
        thread.join(2)
        assert seen == [b"commit"]
        proxy.heal()
        sock.settimeout(2)
        assert sock.recv(4096) == b"ok:commit"
    server.close()


def test_only_loopback() -> None:
    with pytest.raises(ValueError, match="loopback"):
        TcpProxy(("8.8.8.8", 53))
