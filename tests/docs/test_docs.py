"""Every code block of README.md and docs/*.md is executed or checked (see ``markdown.py``)."""

from __future__ import annotations

import ast
import os
import sys
from pathlib import Path

import pytest

from toolguard.policies import Policy, load_policy

from .markdown import ROOT, Block, blocks, check_cli, check_command, commands, inline_commands, pages

PAGES = pages()
IDS = [str(page.relative_to(ROOT)) for page in PAGES]


@pytest.fixture
def fresh_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh directory on the embedded SQLite default, as a reader would start."""
    for name in list(os.environ):
        if name.startswith("TOOLGUARD_"):
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(ROOT))  # `from examples... import ...` from a clone
    return tmp_path


def _code(block: Block) -> object:
    # Leading newlines make tracebacks point at the page's own line numbers.
    return compile("\n" * (block.line - 1) + block.text, str(block.page), "exec")


RUNNABLE = [page for page in PAGES if any(b.lang == "python" for b in blocks(page))]


@pytest.mark.parametrize("page", RUNNABLE, ids=[str(p.relative_to(ROOT)) for p in RUNNABLE])
def test_python_blocks_run_in_order(page: Path, fresh_dir: Path) -> None:
    namespace: dict[str, object] = {"__name__": f"docs:{page.name}"}
    ran = 0
    for block in blocks(page):
        if block.lang == "yaml" and block.args:
            (fresh_dir / block.args[0]).write_text(block.text, encoding="utf-8")
        if block.lang != "python":
            continue
        if block.args == ("fragment",):
            ast.parse(block.text, filename=block.where)  # a fragment must still be Python
            continue
        assert not block.args, f"{block.where}: unknown python block option {block.args}"
        try:
            exec(_code(block), namespace)  # the page's own example code
        except Exception as error:
            raise AssertionError(f"{block.where}: the block failed: {type(error).__name__}: "
                                 f"{error}") from error
        ran += 1
    assert ran or all(b.args == ("fragment",) for b in blocks(page) if b.lang == "python")


def _policies(page: Path, folder: Path) -> list[tuple[Block, Policy]]:
    """The page's policy blocks, each loaded (an AssertionError naming the block if one fails)."""
    policies = [b for b in blocks(page) if b.lang == "yaml" and b.text.lstrip().startswith(
        ("version:", "#")) and "version:" in b.text]
    loaded = []
    for index, block in enumerate(policies):
        path = folder / (block.args[0] if block.args else f"block{index}.yml")
        path.write_text(block.text, encoding="utf-8")
        try:
            loaded.append((block, load_policy(path)))
        except Exception as error:
            raise AssertionError(f"{block.where}: the policy does not load:\n{error}") from error
    return loaded


@pytest.mark.parametrize("page", PAGES, ids=IDS)
def test_yaml_policy_blocks_load(page: Path, tmp_path: Path) -> None:
    _policies(page, tmp_path)


@pytest.mark.parametrize("page", PAGES, ids=IDS)
def test_policy_argument_limits_fit_the_input_limits(page: Path, tmp_path: Path) -> None:
    """A constraint a guide shows can be reached: the input limits refuse nothing it allows.

    The input limits (``limits:``, ``Limits``) are checked before any constraint: a
    ``max_length: 20000`` under the default ``max_string: 4096`` reads as 20,000
    characters allowed while everything over 4,096 is refused.
    """
    found = []
    for block, policy in _policies(page, tmp_path):
        for name, tool in policy.tools.items():
            bound = tool.limits
            for path, rule in tool.args.items():
                where = f"{block.where}: tools.{name}.args.{path}"
                for kind, value, limit in (("max_length", rule.max_length, bound.max_string),
                                           ("min_length", rule.min_length, bound.max_string),
                                           ("max_items", rule.max_items, bound.max_items),
                                           ("min_items", rule.min_items, bound.max_items)):
                    if value is not None and value > limit:
                        found.append(f"{where}: {kind}: {value} is over the input limit "
                                     f"({limit}); set limits: for the tool")
                if len(path.parts) > bound.max_depth:
                    found.append(f"{where}: nested deeper than limits.max_depth ({bound.max_depth})")
    assert not found, "\n".join(found)


@pytest.mark.parametrize("page", PAGES, ids=IDS)
def test_shell_commands_exist(page: Path) -> None:
    problems = []
    for block in blocks(page):
        if block.lang not in ("bash", "sh", "shell"):
            continue
        for words in commands(block.text):
            problems += [f"{block.where}: {p}" for p in check_command(words)]
    for line, code in inline_commands(page):
        words = code.split()
        problems += [f"{page.name}:{line}: {p}" for p in check_cli(words[1:])]
    assert not problems, "\n".join(problems)


def test_every_block_has_a_known_kind() -> None:
    for page in PAGES:
        for block in blocks(page):
            assert block.lang in ("python", "yaml", "bash", "text", "sql"), (
                f"{block.where}: ```{block.lang}``` is neither run nor checked; use python, "
                f"python fragment, yaml, bash, sql or text")


def test_the_readme_test_command_is_what_ci_runs() -> None:
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    readme_commands = [" ".join(words) for b in blocks(ROOT / "README.md") if b.lang == "bash"
                       for words in commands(b.text)]
    assert ci == ".venv/bin/python -m pytest"
    assert ci in readme_commands


def test_checks_catch_what_they_are_for() -> None:
    """The checker itself: a wrong option, command, extra or marker is reported."""
    assert check_cli(["audit", "show", "7", "--csv"]) == []
    assert check_cli(["audit", "--rejected"]) == []
    assert check_cli(["policy", "check", "x.yml", "--tools", "m:T"]) == []
    assert check_cli(["audit", "show", "7", "--xml"]) != []
    assert check_cli(["audti"]) != []
    assert check_command(["pip", "install", "toolguard-fenced[nope]"]) != []
    assert check_command(["pip", "install", "toolguard"]) != []
    assert check_command([sys.executable, "-m", "pytest", "-m", "nope"]) != []
    assert check_command(["TOOLGUARD_REDIS_URLS=x", "toolguard", "demo"]) != []
    assert check_command(["curl", "x"]) != []
    assert check_command([".venv/bin/mypy"]) == []
    assert check_command([".venv/bin/ruff", "check", "toolguard", "tests"]) == []
    assert check_command([".venv/bin/ruff", "check", "toolgaurd"]) != []
    assert check_command([".venv/bin/ruff", "format"]) != []


@pytest.mark.parametrize("page", PAGES, ids=IDS)
def test_relative_links_point_at_files(page: Path) -> None:
    import re

    text = page.read_text(encoding="utf-8")
    missing = []
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if "://" in target or target.startswith("mailto:"):
            continue
        if not (page.parent / target).exists():
            missing.append(target)
    assert not missing, f"{page.name}: links to missing files: {missing}"


def test_the_readme_links_every_guide() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for guide in sorted((ROOT / "docs").glob("*.md")):
        assert f"(docs/{guide.name})" in readme, f"README.md does not link docs/{guide.name}"


def test_the_readme_is_a_landing_page_with_a_short_first_example() -> None:
    """The first example needs the guard, an adapter and the identity, in under 15 lines of
    Python (it took about 25 and five toolguard names); the README stays about 300 lines, the
    long sections living in docs/."""
    readme = ROOT / "README.md"
    first = next(b for b in blocks(readme) if b.lang == "python" and not b.args)
    lines = first.text.strip().splitlines()
    assert len(lines) < 15, f"{first.where}: {len(lines)} lines"
    assert "open_guard(" in first.text and "agent=" in first.text
    assert len(readme.read_text(encoding="utf-8").splitlines()) <= 310
