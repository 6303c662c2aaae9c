"""LangChain's own agent test suite, plain and with a middleware in every ``create_agent``.

The suite (``tests/unit_tests/agents`` of the installed ``langchain`` sdist,
fetched with pip) runs unmodified, with LangChain's ``blockbuster`` fixture
failing any blocking call in the event loop, in four ways (``suite.VARIANTS``):
plain; with a no-op tool-call middleware appended to every ``create_agent``
(the control); with ``ToolGuardMiddleware`` appended (innermost) and prepended
(outermost). Every test must end with toolguard as with the no-op middleware,
apart from ``differences.DIFFERENCES``, and the no-op middleware as plain, apart
from ``differences.ANY_MIDDLEWARE``; each listed reason must hold. Run alone
with ``-m langchain_suite``.

toolguard is configured as the suite's tests need it and as a user could: a
policy naming each agent's tools ``read_only`` for any agent, unknown tools
allowed (the tests add tools at run time, through middleware), a fixed agent
identity, no decision metadata on the answers (the tests compare whole
messages), and its default idempotency key within each test (the tests reuse
thread and call ids); see ``toolguard_agent_plugin``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from langchain_suite import differences, suite
from langchain_suite.differences import (
    NO_CALL_ID,
    NO_UNKNOWN_TOOL_CHECK,
    STRICT_ARGUMENTS,
    TOOLGUARD_ANSWERS,
    TOOLS_NODE_WITHOUT_TOOLS,
)

#: Four runs of about 1,200 and 500 tests: a minute or two idle, much longer on a loaded machine.
pytestmark = [pytest.mark.langchain_suite, pytest.mark.slow, pytest.mark.timeout(3600)]

ON_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
GUARDED = ("innermost", "outermost")


def _unavailable(message: str) -> None:
    if ON_CI:
        pytest.fail(f"{message}; CI must run LangChain's agent suite", pytrace=False)
    pytest.skip(message)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> suite.Results:
    missing = suite.missing_dependencies()
    if missing:
        _unavailable(f"LangChain's agent suite needs {', '.join(missing)}")
    try:
        found = suite.run_all(Path(tmp_path_factory.mktemp("langchain-suite")))
    except suite.SuiteUnavailable as error:
        _unavailable(str(error))
    timings = ", ".join(f"{name} {run.seconds:.1f}s" for name, run in found.runs.items())
    print(f"\nlangchain {suite.installed_version()}: fetched in {found.fetch_seconds:.1f}s; "
          f"{timings}")
    return found


@pytest.fixture(scope="module")
def runs(results: suite.Results) -> dict[str, suite.Run]:
    return results.runs


def _differing(results: suite.Results, variant: str, baseline: str, expected: set[str]) -> set[str]:
    """Tests ending otherwise than ``baseline`` in ``variant``; an unexpected one must reproduce."""
    differing = set(results.runs[variant].differing_from(results.runs[baseline]))
    flaky = results.flaky(variant, baseline, differing - expected)
    if flaky:
        print(f"\n{variant}: differed from {baseline} once, not when both re-ran it alone "
              f"(LangChain's timed checks): {sorted(flaky)}")
    return differing - flaky


def _listing(tests: set[str], run: suite.Run | None = None,
             baseline: suite.Run | None = None) -> str:
    def one(test: str) -> str:
        if run is None or baseline is None:
            return test
        entry = run.tests.get(test, {})
        return (f"{test} ({baseline.outcomes.get(test)} -> {run.outcomes.get(test)}: "
                f"{entry.get('error', '')[:200]!r}; decisions {entry.get('decisions')}; "
                f"see {run.log})")

    return "\n  ".join(["", *(one(t) for t in sorted(tests))])


def test_the_suite_ran_in_full_under_blockbuster(runs: dict[str, suite.Run]) -> None:
    plain, control = runs["plain"], runs["passthrough"]
    assert len(plain.tests) >= 1000, f"only {len(plain.tests)} tests ran; see {plain.log}"
    assert set(control.tests) == set(plain.tests), "the control ran other tests than plain"
    reached = set(control.reached())
    assert len(reached) >= 400, f"only {len(reached)} tests reached the middleware"
    for name in GUARDED:
        assert set(runs[name].tests) == reached, f"{name} ran other tests than the control reached"
    for name, run in runs.items():
        outside = sorted(test for test, entry in run.tests.items() if not entry["blockbuster"])
        assert not outside, f"{name}: tests without LangChain's blockbuster fixture: {outside[:5]}"


def test_any_middleware_differences_are_langchains_own(results: suite.Results) -> None:
    """The no-op middleware changes exactly the tests listed as LangChain's own behaviour."""
    plain, control = results.runs["plain"], results.runs["passthrough"]
    documented = differences.any_middleware()
    differing = _differing(results, "passthrough", "plain", documented)
    assert differing == documented, _listing(differing ^ documented, control, plain)
    for test in differences.any_middleware(TOOLS_NODE_WITHOUT_TOOLS):
        entry = control.tests[test]
        assert entry["agents"] and not entry["calls"], (test, entry)
    for test in differences.any_middleware(NO_UNKNOWN_TOOL_CHECK):
        assert "DID NOT RAISE" in control.tests[test].get("error", ""), control.tests[test]


@pytest.mark.parametrize("composition", GUARDED)
def test_toolguard_changes_only_the_documented_outcomes(results: suite.Results,
                                                        composition: str) -> None:
    control, guarded = results.runs["passthrough"], results.runs[composition]
    documented = differences.expected(composition)
    differing = _differing(results, composition, "passthrough", documented)
    unexpected, stale = differing - documented, documented - differing
    assert not unexpected, f"{composition}: undocumented differences:" + _listing(
        unexpected, guarded, control)
    assert not stale, f"{composition}: documented but no longer different:" + _listing(stale)


@pytest.mark.parametrize("composition", GUARDED)
def test_documented_differences_are_toolguard_refusals(runs: dict[str, suite.Run],
                                                       composition: str) -> None:
    guarded = runs[composition]
    for reason, decision in ((STRICT_ARGUMENTS, "rejected/invalid_arguments"),
                             (NO_CALL_ID, "rejected/invalid_intent"),
                             (TOOLGUARD_ANSWERS, "rejected/invalid_arguments")):
        for test in sorted(differences.expected(composition, reason)):
            assert decision in guarded.tests[test]["decisions"], (test, guarded.tests[test])


def test_innermost_sees_every_call_the_no_op_middleware_sees(runs: dict[str, suite.Run]) -> None:
    """In the same place in the middleware list, toolguard gets the same calls on the same paths."""
    control, guarded = runs["passthrough"], runs["innermost"]
    uneven = {test: (control.tests[test]["calls"], control.tests[test]["async_calls"],
                     entry["calls"], entry["async_calls"])
              for test, entry in guarded.tests.items()
              if (entry["calls"], entry["async_calls"]) != (control.tests[test]["calls"],
                                                           control.tests[test]["async_calls"])}
    assert not uneven, uneven


@pytest.mark.parametrize("composition", GUARDED)
def test_every_guarded_call_leaves_exactly_one_audit_row(runs: dict[str, suite.Run],
                                                         composition: str) -> None:
    run = runs[composition]
    uneven: dict[str, Any] = {test: entry for test, entry in run.tests.items()
                              if entry["calls"] != len(entry["decisions"])}
    assert not uneven, uneven
    total = sum(entry["calls"] for entry in run.tests.values())
    on_async = sum(entry["async_calls"] for entry in run.tests.values())
    assert total >= 200 and on_async >= 40, f"{composition}: {total} calls ({on_async} async)"
    decisions = {d for entry in run.tests.values() for d in entry["decisions"]}
    # the kinds of decision the suite's calls reach (a cancelled one may end `accepted` when
    # its commit had been sent, so `unknown/cancelled` is not required of either position)
    assert {"accepted/applied", "failed/error", "failed/tool_error", "rejected/invalid_arguments",
            "unknown/interrupted"} <= decisions, decisions


@pytest.mark.parametrize("composition", GUARDED)
def test_no_guarded_call_blocks_the_event_loop(runs: dict[str, suite.Run],
                                               composition: str) -> None:
    """Issue 20 point 3: under LangChain's blockbuster no guarded call fails on a blocking call."""
    blocked = {test: entry["blocking"] for test, entry in runs[composition].tests.items()
               if entry["blocking"]}
    assert not blocked, blocked
