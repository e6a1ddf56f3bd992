"""The failure diagnosis rule table: each shipped rule on a failure of its
kind (texts as torch, NCCL, gloo and Python print them), the order between
rules, every failure getting a verdict, and bad tables refused by name."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dlfleet.api.diagnosis import (
    Action,
    Category,
    FailureFacts,
    RuleError,
    default_table,
    diagnose,
    exception_name,
    load_table,
    parse_rules,
    restart_only_table,
    rule_to_json,
)

TRACEBACK = """Traceback (most recent call last):
  File "/job/train.py", line 40, in <module>
    main()
  File "/job/train.py", line 31, in main
    {line}
{error}"""


def traceback(error: str, line: str = "step(batch)") -> str:
    return TRACEBACK.format(line=line, error=error)


CASES: list[tuple[str, FailureFacts, str, Category, Action]] = [
    (
        "the master's restart-loop breaker gave up",
        FailureFacts(exit_code=1, message="restart loop: ...", restart_loop=True),
        "restart-loop",
        Category.USER_ERROR,
        Action.FAIL_JOB,
    ),
    (
        "watchdog",
        FailureFacts(exit_code=-1, message="hung: no training step for 6.0s", hung=True),
        "hang-watchdog",
        Category.HUNG,
        Action.RESTART,
    ),
    (
        "oom killer",
        FailureFacts(exit_code=-9, signal="SIGKILL", oom_killed=True),
        "host-out-of-memory",
        Category.OUT_OF_MEMORY,
        Action.RELAUNCH_NODE_WITH_MORE_MEMORY,
    ),
    (
        "ecc",
        FailureFacts(
            exit_code=1,
            traceback=traceback("RuntimeError: CUDA error: uncorrectable ECC error encountered"),
        ),
        "gpu-hardware",
        Category.HARDWARE,
        Action.REPLACE_NODE,
    ),
    (
        "xid in stderr, error file about something else",
        FailureFacts(
            exit_code=1,
            message="RuntimeError: NCCL communicator was aborted",
            stderr_tail="NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.",
        ),
        "gpu-hardware",
        Category.HARDWARE,
        Action.REPLACE_NODE,
    ),
    (
        "cuda oom",
        FailureFacts(
            exit_code=1,
            traceback=traceback(
                "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB."
            ),
        ),
        "gpu-out-of-memory",
        Category.OUT_OF_MEMORY,
        Action.RESTART,
    ),
    (
        "gloo peer gone",
        FailureFacts(
            exit_code=1,
            stderr_tail="[rank1]: RuntimeError: [../third_party/gloo/gloo/transport/tcp/"
            "pair.cc:534] Read error [127.0.0.1]:45112: Connection reset by peer",
        ),
        "network",
        Category.NETWORK,
        Action.RESTART,
    ),
    (
        "network before the first step is still the network",
        FailureFacts(
            exit_code=1,
            traceback=traceback(
                "torch.distributed.DistNetworkError: The client socket has failed to "
                "connect to [node-1]:29500 (errno: 111 - Connection refused)."
            ),
        ),
        "network",
        Category.NETWORK,
        Action.RESTART,
    ),
    (
        "nccl timeout",
        FailureFacts(
            exit_code=-6,
            signal="SIGABRT",
            stderr_tail="[rank0]:[E ProcessGroupNCCL.cpp:616] [Rank 0] Watchdog caught "
            "collective operation timeout: WorkNCCL(SeqNum=120, OpType=ALLREDUCE)",
        ),
        "network",
        Category.NETWORK,
        Action.RESTART,
    ),
    (
        "gloo recv timeout",
        FailureFacts(
            exit_code=1,
            traceback=traceback(
                "RuntimeError: [../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] "
                "Timed out waiting 30000ms for recv operation to complete"
            ),
        ),
        "network",
        Category.NETWORK,
        Action.RESTART,
    ),
    (
        "import error",
        FailureFacts(
            exit_code=1,
            traceback=traceback("ModuleNotFoundError: No module named 'transformerz'"),
        ),
        "import-or-syntax-error",
        Category.USER_ERROR,
        Action.FAIL_JOB,
    ),
    (
        "a lazy import fails late",
        FailureFacts(exit_code=1, traceback=traceback("ImportError: cannot import name 'x'")),
        "import-or-syntax-error",
        Category.USER_ERROR,
        Action.FAIL_JOB,
    ),
    (
        "the same exception as last time",
        FailureFacts(
            exit_code=1,
            traceback=traceback("KeyError: 'label'"),
            previous_exception="KeyError: 'label'",
        ),
        "same-error-again",
        Category.USER_ERROR,
        Action.FAIL_JOB,
    ),
    (
        "an exception mid-training, the first time",
        FailureFacts(exit_code=1, traceback=traceback("KeyError: 'label'")),
        "anything-else",
        Category.UNKNOWN,
        Action.RESTART,
    ),
    (
        "another exception than last time",
        FailureFacts(
            exit_code=1,
            traceback=traceback("KeyError: 'image'"),
            previous_exception="KeyError: 'label'",
        ),
        "anything-else",
        Category.UNKNOWN,
        Action.RESTART,
    ),
    (
        "every local rank raised the same exception",
        FailureFacts(
            exit_code=1,
            traceback=traceback("ValueError: shapes (8,3) and (4,) not aligned"),
            steps=40,
            ranks=2,
            ranks_alike=2,
        ),
        "same-error-on-every-rank",
        Category.USER_ERROR,
        Action.FAIL_JOB,
    ),
    (
        "one rank of two raised: the machine's or the code's, not known yet",
        FailureFacts(
            exit_code=1,
            traceback=traceback("ValueError: shapes (8,3) and (4,) not aligned"),
            steps=40,
            ranks=2,
            ranks_alike=1,
        ),
        "anything-else",
        Category.UNKNOWN,
        Action.RESTART,
    ),
    (
        "a single rank is not every rank",
        FailureFacts(exit_code=1, traceback=traceback("KeyError: 'x'"), steps=40),
        "anything-else",
        Category.UNKNOWN,
        Action.RESTART,
    ),
    (
        "an exception before the first step finished",
        FailureFacts(exit_code=1, traceback=traceback("KeyError: 'label'"), steps=1),
        "error-before-first-step",
        Category.USER_ERROR,
        Action.FAIL_JOB,
    ),
    (
        "an exception before any step",
        FailureFacts(exit_code=1, traceback=traceback("FileNotFoundError: data.bin"), steps=0),
        "error-before-first-step",
        Category.USER_ERROR,
        Action.FAIL_JOB,
    ),
    (
        "steps not reported: before the first step is not known",
        FailureFacts(exit_code=1, traceback=traceback("KeyError: 'label'"), steps=None),
        "anything-else",
        Category.UNKNOWN,
        Action.RESTART,
    ),
    (
        "network errors before the first step are the network's",
        FailureFacts(
            exit_code=1,
            traceback=traceback("RuntimeError: Connection reset by peer"),
            steps=0,
            ranks=2,
            ranks_alike=2,
        ),
        "network",
        Category.NETWORK,
        Action.RESTART,
    ),
    (
        "the round ended under a loader before its first step: not the script's fault",
        FailureFacts(
            exit_code=1,
            traceback=traceback(
                "dlfleet.api.errors.StaleError: round 3 is over (the world is round 4)"
            ),
            steps=0,
            previous_exception="dlfleet.api.errors.StaleError: round 3 is over",
        ),
        "master-unavailable-or-round-ended",
        Category.NETWORK,
        Action.RESTART,
    ),
    (
        "killed before the first step is a kill",
        FailureFacts(exit_code=-9, signal="SIGKILL", steps=0),
        "killed",
        Category.KILLED,
        Action.RESTART,
    ),
    (
        "terminated",
        FailureFacts(exit_code=-15, signal="SIGTERM"),
        "preempted",
        Category.PREEMPTED,
        Action.RESTART,
    ),
    (
        "killed, not by the OOM killer",
        FailureFacts(exit_code=-9, signal="SIGKILL"),
        "killed",
        Category.KILLED,
        Action.RESTART,
    ),
    (
        "a segfault",
        FailureFacts(exit_code=-11, signal="SIGSEGV"),
        "anything-else",
        Category.UNKNOWN,
        Action.RESTART,
    ),
]


@pytest.mark.parametrize(
    ("facts", "rule", "category", "action"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_the_shipped_rules_classify_failures_by_their_cause(
    facts: FailureFacts, rule: str, category: Category, action: Action
) -> None:
    verdict = diagnose(facts)
    assert (verdict.rule, verdict.category, verdict.action) == (rule, category, action)


def test_every_shipped_rule_is_reached_by_some_case() -> None:
    reached = {diagnose(case[1]).rule for case in CASES}
    assert reached == {rule.name for rule in default_table().rules}


@given(
    exit_code=st.integers(-64, 255),
    signal=st.sampled_from(["", "SIGKILL", "SIGTERM", "SIGSEGV", "SIGABRT", "SIGBUS"]),
    text=st.text(max_size=200),
    flags=st.tuples(st.booleans(), st.booleans()),
    previous=st.text(max_size=40),
    steps=st.none() | st.integers(0, 5),
    ranks=st.tuples(st.integers(1, 4), st.integers(0, 4)),
)
def test_every_failure_gets_exactly_one_verdict_of_the_table(
    exit_code: int,
    signal: str,
    text: str,
    flags: tuple[bool, bool],
    previous: str,
    steps: int | None,
    ranks: tuple[int, int],
) -> None:
    facts = FailureFacts(
        exit_code=exit_code,
        signal=signal,
        message=text,
        stderr_tail=text[::-1],
        oom_killed=flags[0],
        hung=flags[1],
        previous_exception=previous,
        steps=steps,
        ranks=ranks[0],
        ranks_alike=min(ranks),
    )
    verdict = diagnose(facts)
    assert verdict.rule in {rule.name for rule in default_table().rules}


def test_a_jobs_rules_are_tried_first() -> None:
    extra = parse_rules(
        [
            {
                "name": "flaky-nfs",
                "category": "hardware",
                "action": "replace_node",
                "when": {"text": ["Stale file handle"]},
            }
        ]
    )
    table = default_table().with_rules_first(extra)
    facts = FailureFacts(exit_code=1, traceback=traceback("OSError: [Errno 116] Stale file handle"))
    assert diagnose(facts).rule == "anything-else"
    assert diagnose(facts, table).rule == "flaky-nfs"
    assert diagnose(facts, table).action is Action.REPLACE_NODE


def test_diagnosis_off_restarts_whatever_happened() -> None:
    facts = FailureFacts(exit_code=1, traceback=traceback("RuntimeError: uncorrectable ECC error"))
    assert diagnose(facts, restart_only_table()).action is Action.RESTART


def test_rules_survive_their_json_form() -> None:
    table = default_table()
    again = load_table(
        {"version": 1, "rules": [rule_to_json(rule) for rule in table.rules]}, source="copy"
    )
    for case in CASES:
        assert diagnose(case[1], again) == diagnose(case[1], table)


@pytest.mark.parametrize(
    ("rules", "complaint"),
    [
        ([{"name": "x", "category": "cosmic_rays", "action": "restart"}], "category 'cosmic_rays'"),
        ([{"name": "x", "category": "hardware", "action": "reboot"}], "action 'reboot'"),
        ([{"name": "x", "category": "hardware", "action": "restart", "when": {"txt": []}}], "txt"),
        (
            [{"name": "x", "category": "hardware", "action": "restart", "when": {"text": ["("]}}],
            "(",
        ),
        ([{"name": "Bad Name", "category": "hardware", "action": "restart"}], "Bad Name"),
        (
            [{"name": "x", "category": "hardware", "action": "restart", "when": {"hung": "yes"}}],
            "hung",
        ),
        (
            [
                {
                    "name": "x",
                    "category": "hardware",
                    "action": "restart",
                    "when": {"signal": ["KILL"]},
                }
            ],
            "KILL",
        ),
        ([{"name": "x", "category": "network", "action": "restart"}] * 2, "repeated"),
        ("not a list", "list"),
    ],
)
def test_a_bad_rule_is_refused_naming_what_is_wrong(rules: Any, complaint: str) -> None:
    with pytest.raises(RuleError, match=r"job\.yaml diagnosis") as caught:
        parse_rules(rules, source="job.yaml diagnosis")
    assert complaint in str(caught.value)


def test_a_table_must_end_with_a_catch_all_and_have_its_version() -> None:
    rule = {"name": "x", "category": "network", "action": "restart", "when": {"hung": True}}
    with pytest.raises(RuleError, match="last rule must match anything"):
        load_table({"version": 1, "rules": [rule]})
    with pytest.raises(RuleError, match="version 2"):
        load_table({"version": 2, "rules": [rule]})


@pytest.mark.parametrize(
    ("text", "name"),
    [
        (traceback("ValueError: bad"), "ValueError"),
        ("[rank3]: torch.OutOfMemoryError: CUDA out of memory", "OutOfMemoryError"),
        ("KeyboardInterrupt", "KeyboardInterrupt"),
        ("UserWarning: this is only a warning", ""),
        ("all fine", ""),
    ],
)
def test_the_exception_is_read_as_python_prints_it(text: str, name: str) -> None:
    assert exception_name(text) == name
