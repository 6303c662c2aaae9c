"""Hostile audit contents in the terminal: escape sequences, bidi controls, rich markup and
lone surrogates are shown as visible escapes, never sent to the terminal or parsed."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from toolguard.cli import app
from toolguard.store import AuditEntry, open_store

ESC = "\x1b]0;owned\x07\x1b[2J"
CSI = "\x9b31m"
BIDI = "\u202egnp.exe"
MARKUP = "[/x][link=http://evil.example]click[/link]"
SURROGATE = "\ud800"
RAW = (ESC, CSI, "\u202e", SURROGATE, "\x07", "\x1b")


@pytest.fixture
def hostile_url(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path}/hostile.db"
    store = open_store(url, install=True)
    try:
        store.audit(AuditEntry(decision="rejected", reason=f"r{MARKUP}", tool=f"t{ESC}{MARKUP}",
                               agent=f"a{BIDI}{CSI}", keys=(f"k:{ESC}",), tokens={f"k:{ESC}": 1},
                               workflow=MARKUP, args={"x": f"{CSI}{BIDI}{SURROGATE}"},
                               detail=f"d{ESC}{MARKUP}{BIDI}"))
    finally:
        store.close()
    return url


@pytest.mark.parametrize("args", [[], ["--rejected"], ["show", "1"], ["stats"],
                                  ["stats", "--by", "hour"], ["--tool", MARKUP],
                                  ["--tool", MARKUP, "stats"]])
def test_hostile_values_are_shown_escaped(runner: CliRunner, hostile_url: str,
                                          args: list[str]) -> None:
    result = runner.invoke(app, ["audit", *args, "--url", hostile_url])
    assert result.exit_code == 0, (result.output, result.exception)
    for raw in RAW:
        assert raw not in result.output, (raw, result.output)
    if "--tool" not in args:
        assert "\\x1b" in result.output and "[/x]" in result.output
    if args[:1] == ["show"]:
        assert "\\u202e" in result.output  # (the store keeps a lone surrogate as U+FFFD)


@pytest.mark.parametrize("when", ["999999999d", "100000000d", "99999999999h"])
def test_a_time_too_far_back_is_a_usage_error(runner: CliRunner, hostile_url: str,
                                              when: str) -> None:
    result = runner.invoke(app, ["audit", "--url", hostile_url, "--since", when])
    assert result.exit_code == 2, (result.output, result.exception)
    assert "--since" in result.output and "Traceback" not in result.output


def test_an_export_path_with_markup_is_printed_as_given(runner: CliRunner, hostile_url: str,
                                                        tmp_path: Path) -> None:
    out = tmp_path / "[/x][bold]a.jsonl"
    assert runner.invoke(app, ["audit", "seal", "--url", hostile_url]).exit_code == 0
    exported = runner.invoke(app, ["audit", "export", "--url", hostile_url, "--through-seal",
                                   "1", "--out", str(out)])
    assert exported.exit_code == 0, (exported.output, exported.exception)
    for args in (["verify", "--url", hostile_url, "--export", str(out)], ["check-export", str(out)]):
        result = runner.invoke(app, ["audit", *args])
        assert result.exit_code == 0, (result.output, result.exception)
        assert "[/x][bold]a.jsonl" in result.output
