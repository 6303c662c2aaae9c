"""What every ``toolguard`` command shares: exit codes, error handling, stores, times."""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NoReturn

import typer
from rich.console import Console
from rich.markup import escape

from toolguard.cli.db import (
    BackendRefused,
    SchemaOption,
    TimeoutOption,
    UrlOption,
    open_cli_store,
    redact,
    resolve_store_url,
)
from toolguard.errors import (
    BackendUnavailable,
    ConfigurationError,
    PolicyError,
    PolicyProblems,
    ToolGuardError,
)
from toolguard.store.audit_view import parse_moment

__all__ = [
    "EXIT_CODES_HELP",
    "EXIT_FAILED",
    "EXIT_OK",
    "EXIT_REFUSED",
    "EXIT_UNREACHABLE",
    "EXIT_USAGE",
    "SchemaOption",
    "TimeoutOption",
    "UrlOption",
    "console",
    "fail",
    "failures",
    "invocation",
    "open_cli_store",
    "parse_moment",
    "redact",
    "resolve_store_url",
]

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3
EXIT_REFUSED = 4

EXIT_CODES_HELP = """\b
Exit codes:
  0  ok
  1  a check or verification failed
  2  usage error: a bad option, argument, file or URL
  3  a backend (lock server or store) cannot be reached
  4  the backend refused (permissions, a broken schema)"""

#: Width for output that is not a terminal (a pipe, a file, a CI log): wide enough that
#: tables keep whole words and free text is never broken, as rich would at 80 columns.
PIPE_WIDTH = 160


def console(stderr: bool = False) -> Console:
    """A console that never highlights numbers, and never wraps text going to a pipe or a file.

    On a terminal rich fits the window; elsewhere it would assume 80 columns and
    wrap (or cut) words, so lines are left whole and tables get ``PIPE_WIDTH``
    (``COLUMNS`` still wins when set).
    """
    stream = sys.stderr if stderr else sys.stdout
    piped = not stream.isatty() and not os.environ.get("COLUMNS")
    return Console(stderr=stderr, highlight=False, soft_wrap=piped,
                   width=PIPE_WIDTH if piped else None)


def fail(message: str, code: int) -> NoReturn:
    """One line on stderr, then exit with ``code``; never a traceback."""
    console(stderr=True).print(f"[bold red]error:[/] {escape(message)}", markup=True, soft_wrap=True)
    raise typer.Exit(code)


@contextmanager
def failures(where: str = "") -> Iterator[None]:
    """Expected failures become one line on stderr and the documented exit code."""
    prefix = f"{where}: " if where else ""
    try:
        yield
    except (typer.Exit, typer.Abort, KeyboardInterrupt):
        raise
    except PolicyProblems as error:  # every problem, one line each, so all are fixed at once
        err = console(stderr=True)
        for problem in error.problems:
            err.print(f"[bold red]error:[/] {escape(f'{prefix}{problem}')}", markup=True,
                      soft_wrap=True)
        raise typer.Exit(EXIT_USAGE) from None
    except (ConfigurationError, PolicyError) as error:
        fail(f"{prefix}{error}", EXIT_USAGE)
    except BackendUnavailable as error:
        fail(f"{prefix}cannot reach the backend: {error}", EXIT_UNREACHABLE)
    except BackendRefused as error:
        fail(f"{prefix}{error}", EXIT_REFUSED)
    except ToolGuardError as error:
        if error.reason == "schema_not_installed":
            fail(f"{prefix}{error}", EXIT_FAILED)
        fail(f"{prefix}{error.reason}: {error}", EXIT_REFUSED)
    except OSError as error:  # a file we could not read or write
        fail(f"{prefix}{error}", EXIT_USAGE)
    except Exception as error:  # a driver error we do not map: still no traceback
        fail(f"{prefix}{type(error).__name__}: {str(error).strip()}", EXIT_REFUSED)


def invocation() -> str:
    """How to run toolguard again, as this process was started, for "Next:" hints.

    After the quick start ``toolguard`` is ``.venv/bin/toolguard``, not on PATH:
    a hint that says plain ``toolguard`` would fail. Plain ``toolguard`` is used
    only when that is what PATH finds (or when this is not the console script).
    """
    argv0 = sys.argv[0] if sys.argv else ""
    path = Path(argv0)
    if path.name == "__main__.py" and path.parent.name == "toolguard":
        return f"{shlex.quote(sys.executable)} -m toolguard"
    if path.name != "toolguard":
        return "toolguard"
    found = shutil.which("toolguard")
    if found and Path(found).resolve() == path.resolve():
        return "toolguard"
    return shlex.quote(argv0)


