"""The code blocks of README.md, docs/*.md and examples/*/README.md, and how each is checked.

The convention every page follows:

- ```` ```python ```` blocks run, in order, in one namespace per file, in a fresh
  temporary directory, on the embedded SQLite default (no ``TOOLGUARD_*``
  variable set). ```` ```python fragment ```` marks a deliberate fragment: it
  must parse, and is not run. Both kinds are type-checked with mypy, each
  page's blocks as one module (``python_module``; see test_docs_types.py).
- ```` ```yaml ```` blocks that start a policy (``version:``) must load as one. A
  file name after ``yaml`` (```` ```yaml policy.yml ````) also writes the block
  to that file in the directory the python blocks run in, so they can load it.
- ```` ```bash ```` blocks: every command must be one this repository has:
  ``toolguard`` sub-commands and options (checked against the real CLI),
  extras in ``pip install`` lines, files, modules and pytest markers.
  Inline code that starts with ``toolguard `` is checked the same way.
"""

from __future__ import annotations

import re
import shlex
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from markdown_it import MarkdownIt

ROOT = Path(__file__).resolve().parents[2]


def pages() -> list[Path]:
    """README.md, the guides, and each example's README."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
            *sorted((ROOT / "examples").glob("*/README.md"))]


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # 1-based line of the block's first code line
    lang: str
    args: tuple[str, ...]
    text: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    out = []
    for token in MarkdownIt().parse(page.read_text(encoding="utf-8")):
        if token.type != "fence" or token.map is None:
            continue
        lang, *args = token.info.split() or [""]
        out.append(Block(page, token.map[0] + 2, lang, tuple(args), token.content))
    return out


def python_module(page: Path, *, fragments: bool = False) -> str | None:
    """The page's ```` ```python ```` blocks as one module, in order, each at its own line
    of the page (a checker's line numbers are the page's); with ``fragments`` the
    ```` ```python fragment ```` blocks too. None when the page has no such block."""
    chosen = [b for b in blocks(page) if b.lang == "python"
              and (not b.args or (fragments and b.args == ("fragment",)))]
    if not chosen:
        return None
    lines = [""] * len(page.read_text(encoding="utf-8").splitlines())
    for block in chosen:
        for offset, line in enumerate(block.text.splitlines()):
            lines[block.line - 1 + offset] = line
    return "\n".join(lines) + "\n"


def inline_commands(page: Path) -> Iterator[tuple[int, str]]:
    """``toolguard ...`` in inline code (the command table), with its line."""
    for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
        for code in re.findall(r"`(toolguard [^`]+)`", line):
            yield number, code


# --- shell commands -------------------------------------------------------------------


def commands(text: str) -> Iterator[list[str]]:
    """Each simple command of a shell block, as words (comments, ``\\``-continuations and
    ``NAME=value`` prefixes handled; ``&&``, ``||``, ``;`` and ``|`` split commands)."""
    joined = re.sub(r"\\\n", " ", text)
    for line in joined.splitlines():
        words = shlex.split(line, comments=True)
        current: list[str] = []
        for word in [*words, "&&"]:
            if word in ("&&", "||", ";", "|"):
                if current:
                    yield current
                current = []
            else:
                current.append(word)


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def check_command(words: list[str]) -> list[str]:
    """What is wrong with one command (empty when it names only real things)."""
    problems: list[str] = []
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        problems += _check_variable(words.pop(0).split("=", 1)[0])
    if not words:
        return problems
    program, rest = words[0], words[1:]
    if Path(program).name == "toolguard":
        return problems + check_cli(rest)
    if program == "bash" and rest:
        return problems + ([] if (ROOT / rest[0]).is_file() else [f"no file {rest[0]}"])
    if program == "python3" and rest[:2] == ["-m", "venv"]:
        return problems
    if Path(program).name in ("pip", "pip3") or (Path(program).name.startswith("python")
                                                and rest[:2] == ["-m", "pip"]):
        return problems + _check_pip(rest[2:] if rest[:2] == ["-m", "pip"] else rest)
    if Path(program).name.startswith("python") and rest[:1] == ["-m"] and len(rest) > 1:
        return problems + _check_module(rest[1], rest[2:])
    if Path(program).name == "mypy":  # configured in pyproject.toml; paths, if any, must exist
        return problems + _missing_paths(rest)
    if Path(program).name == "ruff":
        if rest[:1] != ["check"]:
            return [*problems, f"unexpected ruff command {rest!r} (ruff check PATH...)"]
        return problems + _missing_paths(rest[1:])
    return [*problems, f"unknown command {program!r}: teach tests/docs/markdown.py about it"]


_SETTINGS_VARIABLES = {"TOOLGUARD_LOCK_URL", "TOOLGUARD_REDIS_URL", "TOOLGUARD_DATABASE_URL",
                       "TOOLGUARD_HOME", "TOOLGUARD_TTL_MS", "TOOLGUARD_WAIT_TIMEOUT_S",
                       "TOOLGUARD_TEST_DATABASE_URL", "TOOLGUARD_TEST_REDIS_URL", "CI"}


def _check_variable(name: str) -> list[str]:
    return [] if name in _SETTINGS_VARIABLES else [f"unknown variable {name}"]


def _missing_paths(args: list[str]) -> list[str]:
    return [f"no file or directory {a}" for a in args
            if not a.startswith("-") and not (ROOT / a).exists()]


def _check_pip(args: list[str]) -> list[str]:
    if not args or args[0] != "install":
        return [f"unexpected pip command {args!r}"]
    project = pyproject()["project"]
    extras = set(project["optional-dependencies"])
    problems = []
    for spec in (a for a in args[1:] if not a.startswith("-")):
        match = re.fullmatch(r"([^\[\]]+)(?:\[([^\]]*)\])?", spec)
        if match is None:
            problems.append(f"cannot read the requirement {spec!r}")
            continue
        name, wanted = match.group(1), match.group(2)
        if name not in (".", project["name"]):
            problems.append(f"{name!r} is not this project (install {project['name']!r} or '.')")
        for extra in (wanted or "").split(","):
            if extra and extra not in extras:
                problems.append(f"no extra [{extra}] in pyproject.toml")
    return problems


def _check_module(module: str, args: list[str]) -> list[str]:
    if module == "pytest":
        markers = {m.split(":")[0] for m in pyproject()["tool"]["pytest"]["ini_options"]["markers"]}
        chosen = [args[i + 1] for i, a in enumerate(args[:-1]) if a == "-m"]
        # A marker expression ("cluster or netns", "not slow"): every name in it must exist.
        names = {word for m in chosen for word in m.replace("(", " ").replace(")", " ").split()
                 if word not in ("and", "or", "not")}
        return [f"no pytest marker {m!r}" for m in sorted(names) if m not in markers]
    if module == "toolguard":
        return check_cli(args)
    path = ROOT / Path(*module.split("."))
    return [] if (path / "__main__.py").is_file() else [f"no runnable module {module}"]


def check_cli(args: list[str]) -> list[str]:
    """The sub-commands exist and every option is one they take (checked on the real CLI)."""
    import typer

    from toolguard.cli import app

    # typer's click (vendored or not): groups have .commands, options have .opts.
    command: Any = typer.main.get_command(app)
    options = _options(command)
    index = 0
    while _is_group(command) and index < len(args) and not args[index].startswith("-"):
        sub = command.commands.get(args[index])
        if sub is None:
            return [f"toolguard {' '.join(args[:index + 1])}: no such command"]
        command, index = sub, index + 1
        options |= _options(command)
    if _is_group(command) and not command.invoke_without_command and index == len(args):
        return [f"toolguard {' '.join(args)}: needs a sub-command"]
    own = args[index:args.index("--")] if "--" in args[index:] else args[index:]  # then another program's
    return [f"toolguard {' '.join(args)}: no option {word.split('=')[0]}"
            for word in own if word.startswith("-") and word.split("=")[0] not in options]


def _is_group(command: Any) -> bool:
    return isinstance(getattr(command, "commands", None), dict)


def _options(command: Any) -> set[str]:
    names = {"--help"}
    for param in command.params:
        if getattr(param, "param_type_name", "") == "option":
            names.update(param.opts)
            names.update(param.secondary_opts)
    return names
