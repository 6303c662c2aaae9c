"""Every page's python blocks type-check with mypy: one module per page, the blocks in order.

One mypy run over all pages (``markdown.python_module`` builds each module with the
blocks at their own lines, so errors name the page's line). The checks are those a
reader's type-checked project would apply to the example code, without asking
example code for annotations:

- ``check_untyped_defs``: the bodies of unannotated example functions are checked.
  A wrong API name, a wrong argument or keyword, a wrong attribute fails.
- ``strict_optional`` off: examples read values they know are there
  (``transfer.approval.expires``, ``guard.locks.close()``) without a None check.
- ``no-redef`` off: a later section may define an earlier example's name again, as
  the page's one namespace does when tests/docs runs it.

``python fragment`` blocks are checked too, in a second module per page (the page's
runnable blocks and its fragments, in order), with the errors a deliberate fragment
cannot avoid turned off: it names the reader's own objects (``model``, ``routes``,
``url``: name-defined, used-before-def, has-type) and may ``await`` at the top level
(top-level-await, and ``async with`` outside a function, coded syntax). Imports,
attributes and calls of what it does name are checked. Only errors on fragment lines
are taken from that module; the runnable lines are the first module's.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from .markdown import ROOT, blocks, pages, python_module

# Kept between runs in this checkout (mypy adds its own .gitignore), apart from the package's
# cache: the options differ, so sharing one would make each run redo the other's work.
CACHE = ROOT / ".mypy_cache" / "docs-blocks"

CONFIG = """\
[mypy]
python_version = 3.11
mypy_path = {root}
cache_dir = {cache}
follow_imports = silent
check_untyped_defs = True
strict_optional = False
disable_error_code = no-redef

[mypy-docs_fragments.*]
disable_error_code = no-redef, name-defined, used-before-def, has-type, top-level-await, syntax

# an exporter the telemetry guide names; the application installs it, toolguard does not
[mypy-opentelemetry.exporter.otlp.*]
ignore_missing_imports = True
"""

# The checker itself: each line marked "expect" must be reported, and nothing else.
SELF_CHECK = {
    "docs_pages": '''
from toolguard import load_policy, open_stor  # expect: a wrong API name
load_policy(42)  # expect: a wrong argument type
''',
    "docs_fragments": '''
from toolguard import connect
manager = connect(lock_url)  # the reader's own lock_url: tolerated in a fragment
manager.no_such_method()  # expect: a wrong attribute
''',
}


def _module_name(page: Path) -> str:
    return re.sub(r"\W", "_", str(page.relative_to(ROOT)).removesuffix(".md"))


def test_python_blocks_type_check_with_mypy(tmp_path: Path) -> None:
    tmp_path = tmp_path.resolve()
    sources: dict[Path, tuple[Path, set[int] | None]] = {}  # module -> page, lines reported
    for package in ("docs_pages", "docs_fragments"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    for page in pages():
        runnable = python_module(page)
        if runnable is not None:
            module = tmp_path / "docs_pages" / f"{_module_name(page)}.py"
            module.write_text(runnable, encoding="utf-8")
            sources[module] = (page, None)
        fragment_lines = {block.line + offset for block in blocks(page)
                          if block.lang == "python" and block.args == ("fragment",)
                          for offset in range(len(block.text.splitlines()))}
        if fragment_lines:
            module = tmp_path / "docs_fragments" / f"{_module_name(page)}.py"
            module.write_text(python_module(page, fragments=True) or "", encoding="utf-8")
            sources[module] = (page, fragment_lines)
    expected: dict[Path, set[int]] = {}
    for package, text in SELF_CHECK.items():
        module = tmp_path / package / "_self_check.py"
        module.write_text(text, encoding="utf-8")
        expected[module] = {n for n, line in enumerate(text.splitlines(), 1) if "# expect" in line}
    config = tmp_path / "mypy.ini"
    config.write_text(CONFIG.format(root=ROOT, cache=CACHE), encoding="utf-8")

    done = subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(config),
                           "--no-error-summary", *map(str, [*sources, *expected])],
                          cwd=tmp_path, capture_output=True, text=True, timeout=280)
    assert done.returncode in (0, 1) and not done.stderr.strip(), done.stdout + done.stderr

    problems, found = [], {module: set() for module in expected}
    for line in done.stdout.splitlines():
        match = re.match(r"(.+?\.py):(\d+): (error|note): (.*)", line)
        assert match, f"unexpected mypy output: {line}"
        module, number = (tmp_path / match.group(1)).resolve(), int(match.group(2))
        if module in found:
            found[module].add(number)
            continue
        page, reported = sources[module]
        if reported is None or number in reported:
            problems.append(f"{page.relative_to(ROOT)}:{number}: {match.group(3)}: {match.group(4)}")
    assert found == expected, f"the checker no longer reports what it is for:\n{done.stdout}"
    assert not problems, (f"{len(problems)} type error(s) in the pages' python blocks "
                          f"(mypy, see this file's docstring for the checks):\n" + "\n".join(problems))
