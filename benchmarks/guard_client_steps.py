"""Where a guarded call's client CPU goes, by step: the drivers timed, the rest sampled.

    python benchmarks/guard_client_steps.py [--redis-url URL] [--database-url URL]
                                            [--calls N] [--rounds R] [--rate HZ]
                                            [--quick] [--plain]

``guard_client_costs.py`` measures by removal, which says what a piece saves but
not where the rest goes; a deterministic profiler (cProfile) charges every
function call and so inflates the small ones; a sampler alone misreads the
drivers, because a thread just woken from a socket counts as running while it
waits for a core. So this script splits the calling thread's CPU in two, for the
guarded call of ``benchmarks/guard.py`` (Redis locks, PostgreSQL store, one
thread), the same write through toolguard's primitives without the guard, and the
expert's hand-written (d2), in interleaved rounds:

* **timed**: the thread's CPU (``time.thread_time``) inside psycopg's
  ``Connection.wait`` (every statement's binding, send and read, toolguard's
  ``_HotCursor`` as much as psycopg's pipeline) and inside redis-py's
  ``send_packed_command`` and ``read_response`` (the socket), for every variant
  alike;
* **sampled**: the rest of the thread's CPU, pure Python, split by py-spy's
  samples of it (taken from outside, ``--nonblocking``: the process is never
  paused), each charged to the step of its innermost known frame: the drivers'
  bookkeeping outside the socket (redis-py's command path, psycopg's cursors and
  pool), the tool body, toolguard's steps by module (the intent envelope,
  validation and policy, the fenced transaction's parameters, the audit entry
  and intent record, the store's sessions, the lock manager, lease upkeep,
  telemetry, the guard's flow), the expert's own code, the benchmark's loop.

A frame of the standard library or of pydantic (json, hashlib, uuid, a model's
``__init__``) is charged to the innermost toolguard or benchmark frame above it,
so ``json.dumps`` under ``args_hash`` counts as validation. The timing wrappers
cost each variant the same few microseconds per statement. py-spy is a
benchmark tool, not a dependency (``pip install py-spy``), and needs the right
to trace this process (root, or ptrace allowed); without it the script says so.
Always exits 0.
"""

from __future__ import annotations

import collections
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _stats import Table, fmt_ratio, fmt_s, ratio
from guard import Setup, guard_parser, open_setup
from guard_client_costs import _round, primitives

#: The variants' entry frames (py-spy's ``function (file)``): a sample belongs to the
#: variant whose entry frame its stack holds.
ENTRIES = {
    "guarded call": "Setup.guarded (",
    "primitives, no guard": "primitives.<locals>.call (",
    "expert (d2)": "Expert.d2 (",
}

#: (step, where its frames are), in the order the table prints them. A frame matches a
#: step when its file path ends with one of the suffixes (or its function starts with one
#: of the names given with a ``:``); the first step that matches, innermost frame first,
#: takes the sample.
STEPS: list[tuple[str, tuple[str, ...]]] = [
    ("redis-py outside the socket", ("/redis/", "/hiredis/")),
    ("psycopg and pool outside wait", (
        "/psycopg/", "/psycopg_c/", "/psycopg_pool/", "toolguard/runtime/postgres_pool.py",
        "toolguard/store/postgres_literals.py:_HotCursor._execute_gen")),
    ("tool body", ("benchmarks/guard.py:Setup.__post_init__.<locals>.add_score",
                   "benchmarks/guard_client_costs.py:primitives.<locals>.call")),
    ("intent envelope", ("toolguard/call/envelope.py", "toolguard/call/intent.py:Intent",
                         "toolguard/adapters/functions.py:GuardedFunction.intent",
                         "toolguard/adapters/functions.py:GuardedFunction._arguments")),
    ("validation and policy", ("toolguard/steps/validate.py", "toolguard/call/intent.py",
                               "toolguard/policies/", "toolguard/call/recording.py",
                               "toolguard/call/facts.py", "toolguard/controls/shadow.py")),
    ("transaction parameters", ("toolguard/store/postgres_sql.py",
                                "toolguard/store/postgres_literals.py",
                                "toolguard/store/storable.py")),
    ("audit entry and intent record", ("toolguard/store/records.py", "toolguard/store/flow.py",
                                       "toolguard/store/base.py")),
    ("store sessions and borrowing", ("toolguard/store/",)),
    ("lease upkeep and local holds", ("toolguard/locks/lease.py", "toolguard/locks/holds.py")),
    ("lock manager and backend", ("toolguard/locks/",)),
    ("telemetry hooks", ("toolguard/runtime/telemetry.py",)),
    ("guard flow (steps, decisions, recovery)", ("toolguard/",)),
    ("expert's own code", ("benchmarks/expert.py",)),
    ("benchmark loop", ("benchmarks/",)),
]
UNKNOWN = "other (interpreter, no known frame)"
#: The timed parts: (row, the frames whose samples they already hold).
TIMED = {
    "PostgreSQL: binding, send, read (timed)": ("Connection.wait (",),
    "Redis: socket send and read (timed)": ("AbstractConnection.send_packed_command (",
                                            "AbstractConnection.read_response ("),
}


class Clock:
    """The calling thread's CPU inside the timed functions, per row of ``TIMED``."""

    def __init__(self) -> None:
        self.spent = dict.fromkeys(TIMED, 0.0)
        self._depth = 0

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """psycopg's ``Connection.wait`` and redis-py's socket calls, timed, in the block."""
        import psycopg
        from redis.connection import AbstractConnection

        pg, rd = list(TIMED)
        targets = [(psycopg.Connection, "wait", pg),
                   (AbstractConnection, "send_packed_command", rd),
                   (AbstractConnection, "read_response", rd)]
        originals = [(owner, name, getattr(owner, name)) for owner, name, _ in targets]
        for (owner, name, row), (_, _, original) in zip(targets, originals, strict=True):
            setattr(owner, name, self._timing(original, row))
        try:
            yield
        finally:
            for owner, name, original in originals:
                setattr(owner, name, original)

    def _timing(self, original: Callable[..., Any], row: str) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if self._depth:  # nested (a reconnect inside a send): the outer call times it
                return original(*args, **kwargs)
            self._depth += 1
            started = time.thread_time()
            try:
                return original(*args, **kwargs)
            finally:
                self.spent[row] += time.thread_time() - started
                self._depth -= 1
        return timed


def step_of(frame: str) -> str | None:
    """The step of one py-spy frame ``function (path)``, or None (stdlib, pydantic...)."""
    function, _, rest = frame.partition(" (")
    path = rest.rstrip(")")
    for step, places in STEPS:
        for place in places:
            where, _, name = place.partition(":")
            if (where in path if where.endswith("/") else path.endswith(where)) and (
                    not name or function.startswith(name)):
                return step
    return None


def charge(stacks: dict[str, int]) -> dict[str, collections.Counter[str]]:
    """Per variant, the samples of each step outside the timed calls (``stacks``: py-spy's
    raw lines, counted)."""
    samples: dict[str, collections.Counter[str]] = {name: collections.Counter()
                                                     for name in ENTRIES}
    for stack, count in stacks.items():
        frames = stack.split(";")
        variant = next((name for name, entry in ENTRIES.items()
                        if any(frame.startswith(entry) for frame in frames)), None)
        if variant is None or any(frame.startswith(timed) for frame in frames
                                  for names in TIMED.values() for timed in names):
            continue  # another process's, or inside a timed call: its CPU is measured
        step = next((found for found in map(step_of, reversed(frames)) if found), UNKNOWN)
        samples[variant][step] += count
    return samples


def read_raw(path: Path) -> dict[str, int]:
    """py-spy's raw (collapsed) output: one ``frame;frame;... count`` per line."""
    stacks: dict[str, int] = collections.Counter()
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            stacks[stack] += int(count)
    return stacks


def py_spy() -> str | None:
    """The py-spy executable: on PATH, else beside this interpreter; None if neither."""
    beside = Path(sys.executable).with_name("py-spy")
    return shutil.which("py-spy") or (str(beside) if beside.exists() else None)


@contextlib.contextmanager
def sampled(spy: str, rate: int, out: Path) -> Iterator[None]:
    """``spy`` (py-spy) records this process at ``rate`` Hz into ``out`` while the block runs."""
    process = subprocess.Popen(
        [spy, "record", "--pid", str(os.getpid()), "--rate", str(rate), "--format", "raw",
         "--full-filenames", "--nolineno", "--nonblocking", "--output", str(out)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    time.sleep(1.0)  # attached (py-spy reads the interpreter's state first)
    if process.poll() is not None:
        error = process.stderr.read().decode(errors="replace") if process.stderr else ""
        msg = f"py-spy could not sample this process: {error.strip() or process.returncode}"
        raise RuntimeError(msg)
    try:
        yield
    finally:
        process.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
        process.wait(timeout=60)


def main(argv: list[str] | None = None) -> int:
    parser = guard_parser(__doc__)
    parser.add_argument("--calls", type=int, default=None,
                        help="calls per variant per round (default 500, --quick 100)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="interleaved rounds (default 12, --quick 2)")
    parser.add_argument("--rate", type=int, default=1000, help="py-spy samples per second")
    args = parser.parse_args(argv)
    calls = args.calls if args.calls is not None else (100 if args.quick else 500)
    rounds = args.rounds if args.rounds is not None else (2 if args.quick else 12)
    spy = py_spy()
    if spy is None:
        print("py-spy is not installed (pip install py-spy): nothing to sample with")
        return 0
    setup = open_setup(args.database_url, args.redis_url)
    if setup is None:
        return 0
    try:
        run(setup, spy, calls, rounds, args.rate, plain=args.plain)
    except RuntimeError as error:
        print(error)
    finally:
        setup.close()
    return 0


def run(setup: Setup, spy: str, calls: int, rounds: int, rate: int, *,
        plain: bool) -> None:
    impls: dict[str, Callable[[str], None]] = {
        "guarded call": setup.guarded, "primitives, no guard": primitives(setup),
        "expert (d2)": setup.expert.d2}
    for number in range(1_000):  # warm-up: pooled connections, caches, prepared statements
        for call in impls.values():
            call(f"lead-{number % 1000}")
    cpu = dict.fromkeys(impls, 0.0)
    clocks = {name: Clock() for name in impls}
    order = list(impls)
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "samples.txt"
        with sampled(spy, rate, out):
            for number in range(rounds):
                for name in order[number % len(order):] + order[:number % len(order)]:
                    with clocks[name].installed():
                        cpu[name] += _round(impls[name], calls, number)[0] / rounds
        samples = charge(read_raw(out))
    made = rounds * calls
    print(f"where a guarded call's client CPU goes (Redis locks, PostgreSQL store, one thread); "
          f"python {sys.version.split()[0]}; {rounds} rounds of {calls} calls per variant, "
          f"py-spy at {rate} Hz")
    steps = [step for step, _ in STEPS] + [UNKNOWN]
    spent: dict[str, dict[str, float]] = {}
    for name in impls:
        timed = {row: value / made for row, value in clocks[name].spent.items()}
        rest = cpu[name] - sum(timed.values())
        total = sum(samples[name].values())
        spent[name] = {**timed, **{step: rest * samples[name][step] / total if total else 0.0
                                   for step in steps}}
    table = Table("client CPU per call by step (us): the drivers' I/O timed, the rest split by "
                  "py-spy's samples of it",
                  ["step", *impls, "guarded - (d2)"], plain=plain)
    for row in [*TIMED, *steps]:
        if row == steps[0]:
            table.add_section()
        if any(round(spent[name][row] * 1e6) for name in impls):
            table.add_row(row, *(f"{spent[name][row] * 1e6:.0f}" for name in impls),
                          f"{(spent['guarded call'][row] - spent['expert (d2)'][row]) * 1e6:+.0f}")
    table.add_section()
    table.add_row("CPU per call (thread_time)", *(f"{cpu[name] * 1e6:.0f}" for name in impls),
                  f"{(cpu['guarded call'] - cpu['expert (d2)']) * 1e6:+.0f}")
    table.add_row("samples of the rest", *(f"{sum(samples[name].values()):,}" for name in impls),
                  "")
    table.print()
    drivers = [*TIMED, "redis-py outside the socket", "psycopg and pool outside wait",
               "tool body"]
    for name in impls:
        own = cpu[name] - sum(spent[name][row] for row in drivers)
        print(f"{name}: {fmt_s(cpu[name])} of client CPU ({fmt_ratio(ratio(cpu[name], cpu['expert (d2)']))}"
              f" of (d2)'s); drivers and tool body {fmt_s(cpu[name] - own)}, its own code {fmt_s(own)}")


if __name__ == "__main__":
    raise SystemExit(main())
