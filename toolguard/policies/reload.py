"""Hot reload: a running guard picks up a changed policy without a restart.

``PolicyWatcher`` holds the current ``Policy`` and replaces it when its files
change (checked every ``poll_s``) or on ``SIGHUP``. A new policy is validated
fully (and against the tools' schemas, when given) before it replaces the old
one in a single reference assignment: a reader sees the old policy or the new
one, never a mix. A broken file keeps the old policy and logs every problem
with file:line; so does a file caught half-written (its size or time changed
while it was read, or during ``settle_s`` before).

The guard reads ``watcher.current`` once per call and uses that one snapshot
for every step of the call (phase 2: ``ToolGuard(policy=watcher)``).

Write policy files atomically (write a temporary file, then rename it over
the old one): an editor that saves in place is caught by the settle check,
but a write slower than ``settle_s`` could still be read half-done.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from types import FrameType
from typing import Any, Self

from toolguard.call.intent import IdempotencyKeyFn
from toolguard.errors import ConfigurationError, PolicyProblems
from toolguard.policies.loader import PathLike, load_policy, policy_files
from toolguard.policies.model import Policy

__all__ = ["PolicyWatcher"]

log = logging.getLogger("toolguard.policy")

Signature = tuple[tuple[str, int, int, int, int], ...]
SchemaSource = Mapping[str, Any] | Callable[[], Mapping[str, Any]]
SwapHook = Callable[[Policy, Policy], None]


def _signature(paths: PathLike | Iterable[PathLike]) -> Signature | None:
    """(file, mtime_ns, ctime_ns, size, inode) of every policy file; None if they cannot be listed."""
    try:
        files = policy_files(paths)
    except PolicyProblems:
        return None
    out = []
    for file in files:
        try:
            info = file.stat()
        except OSError:
            return None
        out.append((str(file), info.st_mtime_ns, info.st_ctime_ns, info.st_size, info.st_ino))
    return tuple(out)


class PolicyWatcher:
    """The current policy of a running process, reloaded when its files change.

    Building it loads the policy once and raises ``PolicyProblems`` if it is
    broken (a process must not start on a broken policy); after that, a broken
    file only logs and keeps what runs.
    """

    def __init__(self, paths: PathLike | Iterable[PathLike], *, schemas: SchemaSource | None = None,
                 key_fn: IdempotencyKeyFn | None = None, poll_s: float = 1.0,
                 settle_s: float = 0.2, on_swap: SwapHook | None = None,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        if poll_s <= 0 or settle_s < 0:
            msg = f"poll_s must be > 0 and settle_s >= 0, got {poll_s!r}, {settle_s!r}"
            raise ConfigurationError(msg)
        self.paths = paths if isinstance(paths, str | os.PathLike) else list(paths)
        self.schemas = schemas
        self.key_fn = key_fn
        self.poll_s = poll_s
        self.settle_s = settle_s
        self.on_swap = on_swap
        self._sleep = sleep
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._hup = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._signature = _signature(self.paths)
        self._gone = False  # the files could not be listed at the last look (reported)
        self._policy = self._load()
        self.loaded_at = time.time()
        self.swaps = 0
        self.failures = 0

    # --- reading ------------------------------------------------------------------------

    @property
    def current(self) -> Policy:
        """The policy in force: read it once per call and keep that snapshot for the call."""
        return self._policy

    @property
    def digest(self) -> str:
        return self._policy.digest

    # --- reloading -------------------------------------------------------------------------

    def _load(self) -> Policy:
        policy = load_policy(self.paths, key_fn=self.key_fn)
        schemas = self.schemas() if callable(self.schemas) else self.schemas
        if schemas:
            policy.check_against(schemas)
        return policy

    def check(self) -> bool:
        """Reload if the files changed since the last look; True if the policy was replaced."""
        seen = _signature(self.paths)
        if seen == self._signature and (seen is not None or self._gone):
            return False  # unchanged (or still missing, which was reported once)
        if self.settle_s:
            self._sleep(self.settle_s)
            if _signature(self.paths) != seen:
                return False  # still being written: look again next round
        return self.reload(expected=seen)

    def reload(self, *, expected: Signature | None = None) -> bool:
        """Load the files now; swap if they are valid and differ. True if the policy was replaced."""
        with self._lock:
            before = expected if expected is not None else _signature(self.paths)
            try:
                policy = self._load()
            except PolicyProblems as error:
                self._failed(error.problems, before)
                return False
            except (OSError, UnicodeDecodeError) as error:
                self._failed([f"cannot read the policy: {error}"], before)
                return False
            if _signature(self.paths) != before:
                log.info("policy files changed while they were read; reading them again")
                return False  # the next round reads the finished files
            self._signature = before
            self._gone = False
            old = self._policy
            if policy.digest == old.digest:
                return False
            self._policy = policy  # one reference assignment: readers see old or new, never a mix
            self.loaded_at = time.time()
            self.swaps += 1
        log.warning("policy reloaded: %s -> %s (%d tools)", old.digest[:12], policy.digest[:12],
                    len(policy.tools))
        if self.on_swap is not None:
            try:
                self.on_swap(old, policy)
            except Exception:
                log.exception("the policy swap hook failed (the new policy is in force)")
        return True

    def _failed(self, problems: Iterable[object], seen: Signature | None) -> None:
        self.failures += 1
        self._signature = seen  # do not retry the same broken files every round
        self._gone = seen is None  # nor report missing ones again until they are back
        listed = list(problems)
        log.error("policy reload failed, keeping %s: %d problem%s", self._policy.digest[:12],
                  len(listed), "" if len(listed) == 1 else "s")
        for problem in listed:
            log.error("%s", problem)

    # --- watching ------------------------------------------------------------------------

    def start(self) -> Self:
        """Check the files every ``poll_s`` (and at once on SIGHUP) in a daemon thread."""
        if self._thread is None or not self._thread.is_alive():
            self._stopping.clear()
            self._thread = threading.Thread(target=self._run, name="toolguard-policy-watcher",
                                            daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=max(5.0, self.settle_s * 2))
            self._thread = None

    def _run(self) -> None:
        while not self._stopping.is_set():
            self._wake.wait(self.poll_s)
            self._wake.clear()
            if self._stopping.is_set():
                return
            try:
                if self._hup.is_set():
                    self._hup.clear()
                    self.reload()
                else:
                    self.check()
            except Exception:  # never let the watcher die: the old policy stays in force
                log.exception("policy watcher: unexpected error")

    def install_sighup(self) -> None:
        """Reload on SIGHUP. Only the main thread may install signal handlers (Python's rule).

        The handler only wakes the watcher thread (started here if needed): loading
        YAML inside a signal handler could interrupt the main thread anywhere.
        """
        if threading.current_thread() is not threading.main_thread():
            msg = "install_sighup() must be called from the main thread (Python signal handlers)"
            raise ConfigurationError(msg)
        if not hasattr(signal, "SIGHUP"):
            msg = "this platform has no SIGHUP; use check() or the polling thread"
            raise ConfigurationError(msg)
        previous = signal.getsignal(signal.SIGHUP)

        def on_hup(number: int, frame: FrameType | None) -> None:
            self._hup.set()
            self._wake.set()
            if callable(previous):  # SIG_IGN and SIG_DFL are ints, not callables
                previous(number, frame)

        signal.signal(signal.SIGHUP, on_hup)
        self.start()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

