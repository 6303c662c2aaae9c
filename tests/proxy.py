"""A loopback TCP proxy that fault tests control: cut, stall and heal client connections.

    proxy = TcpProxy(("127.0.0.1", server_port)).start()
    url = f"redis://127.0.0.1:{proxy.port}/0"      # clients connect through it
    proxy.cut()     # every connection reset at once; new ones are reset on arrival
    proxy.stall()   # connections stay open, but no byte moves in either direction
    proxy.heal()    # back to forwarding (bytes held during a stall flow on)
    proxy.close()

One accept thread, and two pump threads per connection (one per direction):
small and obvious rather than fast. Only loopback addresses are accepted.
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
import struct
import threading
from collections.abc import Iterator

__all__ = ["TcpProxy"]

_POLL_S = 0.05
_CHUNK = 64 * 1024


def _loopback(host: str) -> None:
    if not ipaddress.ip_address(socket.gethostbyname(host)).is_loopback:
        msg = f"the test proxy only talks to loopback addresses, not {host!r}"
        raise ValueError(msg)


def _reset(sock: socket.socket) -> None:
    """Close with RST (SO_LINGER 0): the peer sees the connection reset, as on a cut link."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.close()


class _Link:
    """One client connection and its upstream connection."""

    def __init__(self, client: socket.socket, upstream: socket.socket) -> None:
        self.client = client
        self.upstream = upstream
        self.closed = threading.Event()
        self._lock = threading.Lock()
        self._half_closed = 0

    def half_close(self) -> bool:
        """One direction ended in an orderly way; True once both have (then close quietly)."""
        with self._lock:
            self._half_closed += 1
            done = self._half_closed >= 2 and not self.closed.is_set()
            if done:
                self.closed.set()
        if done:
            for sock in (self.client, self.upstream):
                with contextlib.suppress(OSError):
                    sock.close()
        return done

    def reset(self) -> None:
        with self._lock:
            if self.closed.is_set():
                return
            self.closed.set()
        for sock in (self.client, self.upstream):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # wakes a pump blocked in recv
            _reset(sock)


class TcpProxy:
    """Forward ``127.0.0.1:<port>`` to ``upstream``; ``cut``/``stall``/``heal`` on demand."""

    def __init__(self, upstream: tuple[str, int], *, port: int = 0) -> None:
        _loopback(upstream[0])
        self.upstream = upstream
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", port))
        self._listener.listen(128)
        self._listener.settimeout(_POLL_S)
        self.port: int = self._listener.getsockname()[1]
        self._links: set[_Link] = set()
        self._lock = threading.Lock()
        self._flowing = threading.Event()  # clear while stalled
        self._flowing.set()
        self._replies = threading.Event()  # clear while replies (server to client) are held
        self._replies.set()
        self._cut = False
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        #: How many client connections were accepted / refused (reset on arrival while cut).
        self.accepted = 0
        self.refused = 0

    @property
    def address(self) -> tuple[str, int]:
        return ("127.0.0.1", self.port)

    @property
    def state(self) -> str:
        if self._cut:
            return "cut"
        if not self._flowing.is_set():
            return "stalled"
        return "flowing" if self._replies.is_set() else "replies stalled"

    def start(self) -> TcpProxy:
        self._thread = threading.Thread(target=self._accept_loop, name=f"proxy-{self.port}",
                                        daemon=True)
        self._thread.start()
        return self

    # --- faults ------------------------------------------------------------------------------

    def cut(self) -> int:
        """Reset every open connection; reset new ones on arrival until ``heal()``.

        Returns how many connections were cut.
        """
        with self._lock:
            self._cut = True
            links, self._links = list(self._links), set()
        self._flowing.set()  # pumps parked by a stall must see the reset, not wait on
        self._replies.set()
        for link in links:
            link.reset()
        return len(links)

    def stall(self, *, replies_only: bool = False) -> None:
        """Stop moving bytes; connections (old and new) stay open.

        With ``replies_only`` requests still reach the server but its replies are held:
        a COMMIT then lands while the client cannot learn that it did.
        """
        with self._lock:
            if replies_only:
                self._replies.clear()
            else:
                self._flowing.clear()

    def heal(self) -> None:
        """Forward again: accept new connections, release the bytes held by a stall."""
        with self._lock:
            self._cut = False
            self._flowing.set()
            self._replies.set()

    def connections(self) -> int:
        with self._lock:
            return len(self._links)

    # --- plumbing -----------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        while not self._stopped.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # the listener was closed
            with self._lock:
                refuse = self._cut
            if refuse:
                self.refused += 1
                _reset(client)
                continue
            self.accepted += 1
            threading.Thread(target=self._open, args=(client,), daemon=True,
                             name=f"proxy-{self.port}-open").start()

    def _open(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection(self.upstream, timeout=5)
        except OSError:
            _reset(client)  # the server is down: the client sees a reset, as without a proxy
            return
        client.settimeout(None)
        upstream.settimeout(None)
        for sock in (client, upstream):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        link = _Link(client, upstream)
        with self._lock:
            if self._cut or self._stopped.is_set():
                link.reset()
                return
            self._links.add(link)
        for source, target, gates in ((client, upstream, (self._flowing,)),
                                      (upstream, client, (self._flowing, self._replies))):
            threading.Thread(target=self._pump, args=(link, source, target, gates), daemon=True,
                             name=f"proxy-{self.port}-pump").start()

    def _pump(self, link: _Link, source: socket.socket, target: socket.socket,
              gates: tuple[threading.Event, ...]) -> None:
        try:
            while not link.closed.is_set():
                data = source.recv(_CHUNK)
                if not data:  # orderly close by one side: pass it on, keep the other way open
                    with contextlib.suppress(OSError):
                        target.shutdown(socket.SHUT_WR)
                    if link.half_close():
                        with self._lock:
                            self._links.discard(link)
                    return
                for gate in gates:
                    while not gate.wait(_POLL_S):  # stalled: hold the bytes
                        if link.closed.is_set():
                            return
                if link.closed.is_set():
                    return
                target.sendall(data)
        except OSError:
            pass
        self._drop(link)

    def _drop(self, link: _Link) -> None:
        with self._lock:
            self._links.discard(link)
        link.reset()

    def close(self) -> None:
        """Stop accepting and reset every connection."""
        self._stopped.set()
        with contextlib.suppress(OSError):
            self._listener.close()
        self.cut()
        if self._thread is not None:
            self._thread.join(timeout=2)

    def __enter__(self) -> TcpProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"TcpProxy(127.0.0.1:{self.port} -> {self.upstream[0]}:{self.upstream[1]}, {self.state})"


@contextlib.contextmanager
def proxied(port: int, host: str = "127.0.0.1") -> Iterator[TcpProxy]:
    """A started proxy to ``host:port``, closed on exit."""
    proxy = TcpProxy((host, port)).start()
    try:
        yield proxy
    finally:
        proxy.close()
