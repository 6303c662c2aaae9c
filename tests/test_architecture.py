"""The layout in ARCHITECTURE.md holds: rooms import only what the document allows.

Read from the code's own imports (AST, every ``import`` anywhere in a module,
function bodies and ``TYPE_CHECKING`` blocks included, since those are real
dependencies too), so a change that makes the core reach for a surface fails
here, not in a review. Module-level imports must also form no circle
(importing ``a.b.c`` runs ``a`` and ``a.b`` first, so those count).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "toolguard"
DOCUMENT = ROOT / "ARCHITECTURE.md"

#: what each room may import (besides itself, ``errors`` and ``config``); the same
#: table as ARCHITECTURE.md's, which ``test_the_document_states_these_rules`` checks
ALLOWED: dict[str, set[str]] = {
    "base": {"runtime"},  # errors' safe text
    "runtime": {"call", "policies", "store"},  # telemetry's typed imports only
    "locks": {"runtime"},
    "call": {"runtime", "locks", "store"},
    "store": {"runtime", "call", "locks", "policies"},
    "policies": {"runtime", "call", "controls", "store"},
    "controls": {"runtime", "call", "locks", "store", "policies"},
    "steps": {"runtime", "call", "locks", "store", "policies", "controls"},
    "guard": {"runtime", "call", "locks", "store", "policies", "controls", "steps"},
    "open": {"runtime", "locks", "store", "policies", "steps", "guard"},
    "fences": {"runtime", "call", "locks", "store", "adapters"},
    "adapters": {"runtime", "call", "policies", "steps", "guard"},
    "gateway": {"runtime", "call", "policies", "fences", "guard"},
    "review": {"runtime", "call", "store", "policies"},
    "demo": {"runtime", "call", "locks", "store", "policies", "controls", "guard", "adapters",
             "fences"},
    "cli": {"runtime", "call", "locks", "store", "policies", "controls", "guard", "fences",
            "gateway", "review", "demo"},
    "face": {"runtime", "call", "locks", "store", "policies", "controls", "guard", "open",
             "adapters", "cli"},
}
#: rooms that never import a framework at module level (the plain path stays plain)
CORE = {"runtime", "locks", "call", "store", "policies", "controls", "steps", "guard", "open"}
FRAMEWORKS = ("langgraph", "langchain", "langchain_core", "fastmcp", "mcp", "starlette", "httpx",
              "uvicorn", "typer", "rich", "pydantic_ai", "agents", "dbos")
MAX_LINES = 800
MAX_TOP_LEVEL = 8


@dataclass(frozen=True)
class Module:
    name: str
    path: Path

    @property
    def room(self) -> str:
        return room_of(self.name)


def room_of(name: str) -> str:
    parts = name.split(".")
    if len(parts) == 1 or parts[1] in ("__init__", "__main__"):
        return "face"
    if parts[1] in ("errors", "config"):
        return "base"
    return parts[1]


def modules() -> list[Module]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found.append(Module(".".join(parts), path))
    return found


def imports(module: Module, *, module_level_only: bool) -> Iterator[str]:
    """Every module ``module`` imports, absolute, as written."""
    tree = ast.parse(module.path.read_text(encoding="utf-8"))
    package = module.name if module.path.name == "__init__.py" else module.name.rpartition(".")[0]

    def visit(body: list[ast.stmt]) -> Iterator[str]:
        for node in body:
            if module_level_only and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(
                    node.test):
                yield from visit(node.orelse)
                continue
            if isinstance(node, ast.Import):
                yield from (alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, *([node.module] if node.module else [])])
                for alias in node.names:
                    yield f"{base}.{alias.name}"
            elif module_level_only:
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                    if isinstance(node, ast.ClassDef):
                        yield from visit(node.body)
                    continue
                for field in ("body", "orelse", "finalbody"):
                    yield from visit(getattr(node, field, []) or [])
                for handler in getattr(node, "handlers", []) or []:
                    yield from visit(handler.body)
            else:
                yield from visit(list(ast.iter_child_nodes(node)))  # type: ignore[arg-type]

    yield from visit(tree.body)


def resolve(name: str, known: set[str]) -> str | None:
    """The toolguard module ``name`` lands in (``pkg.mod.Name`` -> ``pkg.mod``)."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def test_no_room_imports_what_the_document_forbids() -> None:
    every = modules()
    known = {m.name for m in every}
    problems = []
    for module in every:
        allowed = ALLOWED[module.room] | {module.room, "base"}
        for name in imports(module, module_level_only=False):
            if not name.startswith("toolguard."):
                continue
            target = resolve(name, known)
            if target is None or target == "toolguard":  # the package itself (``__version__``)
                continue
            room = room_of(target)
            if room not in allowed:
                problems.append(f"{module.name} ({module.room}) imports {target} ({room})")
    assert not problems, "\n".join(problems)


def test_the_core_imports_no_framework_at_module_level() -> None:
    problems = [f"{m.name} imports {name}" for m in modules() if m.room in CORE
                for name in imports(m, module_level_only=True)
                if name.split(".")[0] in FRAMEWORKS]
    assert not problems, "\n".join(problems)


def test_module_level_imports_form_no_circle() -> None:
    every = modules()
    known = {m.name for m in every}
    graph: dict[str, set[str]] = {}
    for module in every:
        edges = set()
        for name in imports(module, module_level_only=True):
            target = resolve(name, known) if name.startswith("toolguard") else None
            if target is None or target == module.name:
                continue
            edges.add(target)
            parent = target.rpartition(".")[0]
            while parent:  # importing a.b.c runs a and a.b first
                if not module.name.startswith(parent + "."):
                    edges.add(parent)
                parent = parent.rpartition(".")[0]
        graph[module.name] = edges
    circles = strongly_connected(graph)
    assert not circles, "\n".join(" <-> ".join(sorted(c)) for c in circles)


def strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's components of more than one module (iterative: no recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []
    counter = 0
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in graph:
                    continue
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(component)
    return found


def test_no_module_is_over_the_line_limit() -> None:
    long = {str(m.path.relative_to(ROOT)): n for m in modules()
            if (n := len(m.path.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert not long, long


def test_the_top_level_holds_only_the_public_face() -> None:
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL, top


def test_the_document_states_these_rules() -> None:
    """ARCHITECTURE.md's table of rooms says what ``ALLOWED`` says, room by room."""
    text = DOCUMENT.read_text(encoding="utf-8")
    rows = dict(re.findall(r"^\| `(\w+)` \| [^|]+ \| ([^|]*) \|$", text, flags=re.M))
    assert set(rows) == set(ALLOWED), sorted(set(rows) ^ set(ALLOWED))
    for room, allowed in ALLOWED.items():
        stated = set(re.findall(r"`(\w+)`", rows[room]))
        assert stated == allowed, (room, sorted(stated ^ allowed))
    for room in sorted({m.room for m in modules()}):
        assert room in rows, f"{room} is not in ARCHITECTURE.md's table"


def test_the_checks_catch_what_they_are_for() -> None:
    """The checker itself: a circle and a relative import are found."""
    assert strongly_connected({"a": {"b"}, "b": {"a"}, "c": set()}) == [{"a", "b"}]
    assert room_of("toolguard.store.base") == "store"
    assert room_of("toolguard") == "face" and room_of("toolguard.errors") == "base"


@pytest.fixture(autouse=True)
def _document_exists() -> None:
    assert DOCUMENT.exists(), "ARCHITECTURE.md is missing"


#: Where code that imports toolguard lives in this repository, besides the package itself.
IMPORTERS = ("tests", "examples", "benchmarks", "docs")


def _imported_toolguard_modules() -> Iterator[tuple[str, str, tuple[str, ...]]]:
    """(where, module, names) for every ``toolguard...`` module imported in IMPORTERS' code
    and the docs' python blocks, with the names ``from module import`` takes from it."""
    sources: list[tuple[str, str]] = []
    for folder in IMPORTERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            sources.append((str(path.relative_to(ROOT)), path.read_text(encoding="utf-8")))
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = page.read_text(encoding="utf-8")
        for index, block in enumerate(re.findall(r"```python[^\n]*\n(.*?)```", text, flags=re.S)):
            sources.append((f"{page.relative_to(ROOT)} block {index + 1}", block))
    for where, source in sources:
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found = [(alias.name, ()) for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found = [(node.module, tuple(a.name for a in node.names if a.name != "*"))]
            else:
                continue
            for module, names in found:
                if module == "toolguard" or module.startswith("toolguard."):
                    yield f"{where}:{node.lineno}", module, names


def test_no_old_module_path_is_served_or_imported() -> None:
    """Modules live where ARCHITECTURE.md puts them, under one name each: no finder serves
    old paths (``toolguard.intent``), and nothing in this repository imports one."""
    import importlib
    import importlib.util
    import subprocess
    import sys

    probe = ("import sys, toolguard, importlib.util\n"
             "assert not [f for f in sys.meta_path if type(f).__module__.startswith('toolguard')]\n"
             "assert importlib.util.find_spec('toolguard.intent') is None\n"
             "try:\n    import toolguard.intent\nexcept ModuleNotFoundError:\n    pass\n"
             "else:\n    raise AssertionError('toolguard.intent was served')\n")
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True,
                          check=False, timeout=120)
    assert done.returncode == 0, done.stderr
    missing = set()
    for where, module, names in _imported_toolguard_modules():
        if importlib.util.find_spec(module) is None:
            missing.add(f"{where}: no module {module}")
            continue
        loaded = importlib.import_module(module)
        missing.update(f"{where}: {module} has no {name}" for name in names
                       if not hasattr(loaded, name)
                       and importlib.util.find_spec(f"{module}.{name}") is None)
    assert not missing, sorted(missing)
