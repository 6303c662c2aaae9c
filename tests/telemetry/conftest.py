"""Fixtures: ``otel`` (in-memory exporters toolguard reports to) and the guard suite's
``backend``/``harness`` (SQLite, and Redis + PostgreSQL).

The SDK is a dev dependency (toolguard itself needs only the API): these tests import it.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from guard.conftest import backend, harness  # noqa: F401 - the guard suite's fixtures

from telemetry.recorder import Recorder
from toolguard.runtime import telemetry


@pytest.fixture
def otel() -> Iterator[Recorder]:
    recorder = Recorder()
    telemetry.use_providers(tracer_provider=recorder.tracer_provider,
                            meter_provider=recorder.meter_provider)
    try:
        yield recorder
    finally:
        telemetry.use_providers()
