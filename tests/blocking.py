"""The blocking-call detector every test runs under: ``blockbuster``, scanning toolguard.

A call that blocks (file or socket I/O on a blocking descriptor, ``time.sleep``,
SQLite, a contended ``threading.Lock``) inside a running event loop, with one of
toolguard's frames on the stack, raises ``BlockingError``. The scan is toolguard's
package, as LangChain's own suite scans ``langchain``: the tests' own helpers and
third-party code that toolguard does not call are not its concern.

Exclusions, each a blocking call toolguard cannot avoid and that happens once:

* a module's first import (``importlib._bootstrap._find_and_load``): toolguard
  imports a backend's client library when that backend is first used, and some
  of them read their own package metadata at import (``psycopg_pool``,
  ``debtcollector`` under ``etcd3gw``). blockbuster itself lets imports ``stat``.
* psycopg reads the server's time zone from the system's tz database the first
  time a connection sees it (``psycopg._tz.get_tzinfo``, cached per process);
  under the detector psycopg would fall back to UTC and log a warning.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from blockbuster import BlockBuster, blockbuster_ctx

__all__ = ["EXCLUSIONS", "no_blocking"]

#: ``(wrapped function, file, functions)``: where blocking is allowed, and why (module text).
_FILE_READS = ("os.stat", "io.BufferedReader.read", "io.TextIOWrapper.read", "os.listdir",
               "os.path.abspath", "os.scandir")
EXCLUSIONS: tuple[tuple[str, str, frozenset[str]], ...] = (
    *((wrapped, "<frozen importlib._bootstrap>", frozenset({"_find_and_load"}))
      for wrapped in _FILE_READS),
    *((wrapped, "psycopg/_tz.py", frozenset({"get_tzinfo"})) for wrapped in _FILE_READS),
)


@contextmanager
def no_blocking() -> Iterator[BlockBuster]:
    """Fail any blocking call made in an event loop from toolguard's code (``BlockingError``)."""
    with blockbuster_ctx("toolguard") as detector:
        for wrapped, filename, functions in EXCLUSIONS:
            if wrapped in detector.functions:
                detector.functions[wrapped].can_block_in(filename, functions)
        yield detector
