"""LangGraph's own prebuilt test suite, plain and with toolguard in every ToolNode.

The suite (the ``tests/`` of the installed ``langgraph-prebuilt`` sdist, fetched
with pip) runs unmodified in six ways (``suite.VARIANTS``): plain, with a no-op
wrapper (the control), with toolguard outermost and innermost (its defaults),
and both again with toolguard's two deliberate differences turned off. Every
test must end as it does plain, apart from ``differences.DIFFERENCES`` (and
``BARE_DIFFERENCES`` in the runs without the deliberate differences), and each
listed reason must hold. Run alone with ``-m langgraph_suite``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from langgraph_suite import differences, suite
from langgraph_suite.differences import (
    ANY_WRAPPER,
    NO_WORKFLOW_IDENTITY,
    OUTSIDE_POLICY,
    OUTSIDE_POLICY_BELOW,
    TOOLGUARD_ANSWERS,
)

pytestmark = [pytest.mark.langgraph_suite, pytest.mark.slow]

ON_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
GUARDED = ("outermost", "innermost", "bare-outermost", "bare-innermost")


def _unavailable(message: str) -> None:
    if ON_CI:
        pytest.fail(f"{message}; CI must run LangGraph's suite", pytrace=False)
    pytest.skip(message)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> suite.Results:
    missing = suite.missing_dependencies()
    if missing:
        _unavailable(f"the prebuilt suite needs {', '.join(missing)}")
    try:
        found = suite.run_all(Path(tmp_path_factory.mktemp("langgraph-suite")))
    except suite.SuiteUnavailable as error:
        _unavailable(str(error))
    timings = ", ".join(f"{name} {run.seconds:.1f}s" for name, run in found.runs.items())
    print(f"\nlanggraph-prebuilt {suite.installed_version()}: fetched in "
          f"{found.fetch_seconds:.1f}s; {timings}")
    return found


@pytest.fixture(scope="module")
def runs(results: suite.Results) -> dict[str, suite.Run]:
    return results.runs


def _differing(results: suite.Results, variant: str, expected: set[str]) -> set[str]:
    """Tests ending otherwise than plain in ``variant``; an unexpected one must reproduce."""
    differing = set(results.runs[variant].differing_from(results.runs["plain"]))
    flaky = results.flaky(variant, differing - expected)
    if flaky:
        print(f"\n{variant}: differed once, not when re-run alone (LangGraph timing): {sorted(flaky)}")
    return differing - flaky


def _listing(tests: set[str], run: suite.Run | None = None,
             plain: suite.Run | None = None) -> str:
    def one(test: str) -> str:
        if run is None or plain is None:
            return test
        return f"{test} ({plain.outcomes.get(test)} -> {run.outcomes.get(test)}; see {run.log})"

    return "\n  ".join(["", *(one(t) for t in sorted(tests))])


def test_plain_suite_ran_in_full(runs: dict[str, suite.Run]) -> None:
    plain = runs["plain"]
    assert len(plain.tests) >= 250, f"only {len(plain.tests)} tests ran; see {plain.log}"
    for name, run in runs.items():
        assert set(run.tests) == set(plain.tests), f"{name} ran other tests than plain"


@pytest.mark.parametrize("composition", ["outermost", "innermost"])
def test_toolguard_changes_only_the_documented_outcomes(results: suite.Results,
                                                        composition: str) -> None:
    plain, guarded = results.runs["plain"], results.runs[composition]
    documented = differences.expected(composition)
    differing = _differing(results, composition, documented)
    unexpected, stale = differing - documented, documented - differing
    assert not unexpected, f"{composition}: undocumented differences:" + _listing(
        unexpected, guarded, plain)
    assert not stale, f"{composition}: documented but no longer different:" + _listing(stale)


def test_any_wrapper_differences_are_langgraphs_own(results: suite.Results) -> None:
    """The no-op wrapper fails exactly the tests listed as LangGraph's own wrapper semantics."""
    control = _differing(results, "passthrough", differences.expected("outermost", ANY_WRAPPER))
    for composition in ("outermost", "innermost"):
        assert control == differences.expected(composition, ANY_WRAPPER), _listing(control)


@pytest.mark.parametrize("composition", ["outermost", "innermost"])
def test_without_its_deliberate_differences_toolguard_is_a_no_op_wrapper(
        results: suite.Results, composition: str) -> None:
    """Metadata off and unknown tools allowed: the same outcomes as the no-op wrapper, apart
    from the calls that have no workflow identity to make an unfenced call exactly-once and
    the calls toolguard refuses (which it answers itself, whatever the settings)."""
    plain, bare = results.runs["plain"], results.runs[f"bare-{composition}"]
    documented = differences.expected(composition, ANY_WRAPPER) | differences.expected_bare(
        composition)
    differing = _differing(results, f"bare-{composition}", documented)
    assert differing == documented, _listing(differing ^ documented, bare, plain)


@pytest.mark.parametrize("composition", ["outermost", "innermost"])
def test_bare_differences_are_unfenced_calls_without_a_workflow_identity(
        runs: dict[str, suite.Run], composition: str) -> None:
    bare = runs[f"bare-{composition}"]
    listed = differences.expected_bare(composition, NO_WORKFLOW_IDENTITY)
    assert listed
    for test in sorted(listed):
        decisions = bare.tests[test]["decisions"]
        assert "rejected/missing_idempotency_key" in decisions, (test, decisions)


@pytest.mark.parametrize("composition", ["outermost", "innermost"])
def test_outside_policy_differences_are_unknown_tool_refusals(runs: dict[str, suite.Run],
                                                              composition: str) -> None:
    guarded = runs[composition]
    listed = differences.expected(composition, OUTSIDE_POLICY) \
        | differences.expected(composition, OUTSIDE_POLICY_BELOW)
    assert listed
    for test in sorted(listed):
        decisions = guarded.tests[test]["decisions"]
        assert "rejected/unknown_tool" in decisions, (test, decisions)


@pytest.mark.parametrize("variant", GUARDED)
def test_toolguard_answers_differences_are_invalid_arguments_it_refused(
        runs: dict[str, suite.Run], variant: str) -> None:
    """The calls toolguard now answers itself were refused as invalid arguments, in every run."""
    composition = variant.removeprefix("bare-")
    listed = (differences.expected_bare(composition, TOOLGUARD_ANSWERS) if variant.startswith(
        "bare-") else differences.expected(composition, TOOLGUARD_ANSWERS))
    assert listed
    for test in sorted(listed):
        decisions = runs[variant].tests[test]["decisions"]
        assert "rejected/invalid_arguments" in decisions, (test, decisions)


@pytest.mark.parametrize("variant", GUARDED)
def test_every_guarded_call_leaves_exactly_one_audit_row(runs: dict[str, suite.Run],
                                                         variant: str) -> None:
    run = runs[variant]
    uneven: dict[str, Any] = {test: entry for test, entry in run.tests.items()
                              if entry["calls"] != len(entry["decisions"])}
    assert not uneven, uneven
    total = sum(entry["calls"] for entry in run.tests.values())
    assert total >= 300, f"{variant}: only {total} guarded calls; see {run.log}"
    decisions = {d for entry in run.tests.values() for d in entry["decisions"]}
    assert {"accepted/applied", "failed/error", "failed/tool_error", "rejected/invalid_arguments",
            "unknown/interrupted"} <= decisions, decisions
