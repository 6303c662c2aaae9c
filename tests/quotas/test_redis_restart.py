"""Redis quotas: a server that loses its data (restarted empty) fails closed, then recovers;
a key prefix that would split a call's counters across Cluster slots is refused.

Counting again from zero would admit up to one more whole budget per window;
instead every charge is refused until its window has passed since the loss,
when the counts the server forgot would have expired anyway.
"""

from __future__ import annotations

import time

import pytest
from servers import RedisServer, private_redis  # noqa: F401  (fixture)

from quotas.envs import facts, rule
from toolguard.controls.quotas import Quotas, quota_backend
from toolguard.errors import BackendUnavailable, BudgetExceeded, ConfigurationError


def _admit_after_restart(quotas: Quotas, tool_rule, call) -> BackendUnavailable:
    """The first admission after the restart may meet the dropped connection: try once more."""
    for _ in range(3):
        try:
            quotas.admit(tool_rule, call)
        except BackendUnavailable as error:
            if "lost its counters" in error.message:
                return error
            continue
        pytest.fail("an admission on a server that lost its counters was counted")
    pytest.fail("the server never answered after its restart")


def test_a_quota_server_restarted_empty_refuses_until_its_windows_passed(
        private_redis: RedisServer) -> None:  # noqa: F811
    window = 2.0
    budget = rule([{"budget": 100, "arg": "amount", "window": f"{window:g}s"}])
    backend = quota_backend(private_redis.url, prefix="tgq-restart")
    quotas = Quotas(backend)
    try:
        quotas.admit(budget, facts(amount=80))
        private_redis.restart()  # the 80 is forgotten, and may still be in its window
        lost = _admit_after_restart(quotas, budget, facts(amount=80))
        assert "refused for" in lost.message
        # the loss is kept on the server: a process that starts now is refused as well
        fresh = quota_backend(private_redis.url, prefix="tgq-restart")
        try:
            with pytest.raises(BackendUnavailable, match="lost its counters"):
                Quotas(fresh).admit(budget, facts(amount=80))
        finally:
            fresh.close()
        time.sleep(window + 0.1)  # every window running at the loss has passed
        quotas.admit(budget, facts(amount=80))
        with pytest.raises(BudgetExceeded):  # and counting is exact again
            quotas.admit(budget, facts(amount=80))
    finally:
        backend.close()


@pytest.mark.parametrize("prefix", ["", "a}b", "{x}", "tg q", "x" * 65])
def test_a_prefix_that_breaks_the_hash_tag_is_a_configuration_error(redis_url: str,
                                                                     prefix: str) -> None:
    with pytest.raises(ConfigurationError, match="hash tag"):
        quota_backend(redis_url, prefix=prefix)
