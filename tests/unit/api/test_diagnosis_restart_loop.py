"""The rule table's restart-loop rule: the master's breaker gave up, so the
job fails with its diagnosis; no agent's own failure ever matches it."""

from __future__ import annotations

import pytest

from dlfleet.api.diagnosis import Action, Category, FailureFacts, RuleError, diagnose, parse_rules


def test_a_broken_restart_loop_fails_the_job_as_a_user_error() -> None:
    verdict = diagnose(FailureFacts(exit_code=1, message="boom", restart_loop=True))
    assert (verdict.rule, verdict.category, verdict.action) == (
        "restart-loop",
        Category.USER_ERROR,
        Action.FAIL_JOB,
    )


def test_a_worker_failure_the_agent_sees_never_matches_the_restart_loop_rule() -> None:
    verdict = diagnose(FailureFacts(exit_code=1, hung=True, message="hung"))
    assert verdict.rule == "hang-watchdog"


def test_a_job_rule_may_ask_for_restart_loop_and_it_must_be_a_boolean() -> None:
    (rule,) = parse_rules(
        [
            {
                "name": "loop",
                "category": "unknown",
                "action": "fail_job",
                "when": {"restart_loop": True},
            }
        ]
    )
    assert rule.when.restart_loop is True
    with pytest.raises(RuleError, match="restart_loop"):
        parse_rules(
            [{"name": "x", "category": "unknown", "action": "restart", "when": {"restart_loop": 1}}]
        )
