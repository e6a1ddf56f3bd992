"""A WorkerGroup runs real worker processes: they see torchrun's environment,
their failures are reported with exit code, signal and `@record` traceback,
stop() ends whole process groups (SIGKILL after the timeout), and
redirects/tee write the round's log files."""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dlfleet.api.processes import die_with_parent
from dlfleet.worker.agent import workers as workers_module
from dlfleet.worker.agent.config import AgentConfig, StreamSpec
from dlfleet.worker.agent.env import RoundAssignment, worker_environments
from dlfleet.worker.agent.workers import (
    ALIKE_GRACE_S,
    GroupState,
    GroupStatus,
    WorkerGroup,
    WorkerStartError,
    attempt_log_dir,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(30)]

ROUND = 7


def script(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "worker.py"
    path.write_text(textwrap.dedent(body))
    return path


def config(path: Path | str, nproc: int = 2, **kw: object) -> AgentConfig:
    return AgentConfig(
        training_script=str(path),
        master="127.0.0.1:50051",
        token="t",
        nproc_per_node=nproc,
        role="trainer",
        run_id="run-1",
        max_restarts=3,
        **kw,  # type: ignore[arg-type]
    )


def environments(cfg: AgentConfig, log_dir: Path) -> list[dict[str, str]]:
    """This node is group rank 1 of (1, nproc, 2) processes."""
    nproc = cfg.nproc_per_node
    assignment = RoundAssignment(ROUND, 1, 3, 3 + nproc, nproc, 1, "127.0.0.1", 29555)
    return worker_environments(
        cfg,
        assignment,
        restart_count=1,
        error_file_dir=attempt_log_dir(log_dir, ROUND),
        master_address=cfg.master,
        agent_environ=os.environ,
        extra={"DLFLEET_NODE_ID": "node#1"},
    )


@pytest.fixture
def group() -> Iterator[WorkerGroup]:
    g = WorkerGroup(console_stdout=io.BytesIO(), console_stderr=io.BytesIO())
    yield g
    g.stop(timeout_s=1.0)


def start(group: WorkerGroup, cfg: AgentConfig, log_dir: Path) -> list[dict[str, str]]:
    envs = environments(cfg, log_dir)
    group.start(cfg, envs, log_dir, ROUND)
    return envs


def until(group: WorkerGroup, done: GroupStatus, timeout_s: float = 15.0) -> GroupState:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = group.poll()
        if state.status is done:
            return state
        time.sleep(0.02)
    raise AssertionError(f"still {group.poll()} after {timeout_s}s")


def wait_for_file(path: Path, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)


def test_each_worker_sees_exactly_the_computed_torchrun_environment(
    group: WorkerGroup, tmp_path: Path
) -> None:
    path = script(
        tmp_path,
        """
        import json, os, sys
        with open(os.path.join(sys.argv[1], os.environ["LOCAL_RANK"] + ".json"), "w") as f:
            json.dump({"env": dict(os.environ), "argv": sys.argv[1:]}, f)
        """,
    )
    cfg = config(path, training_script_args=(str(tmp_path), "--lr", "0.1"))
    envs = start(group, cfg, tmp_path / "logs")
    state = until(group, GroupStatus.SUCCEEDED)
    assert state.exit_codes == (0, 0) and state.failure is None
    for local_rank, expected in enumerate(envs):
        seen = json.loads((tmp_path / f"{local_rank}.json").read_text())
        assert seen["argv"] == [str(tmp_path), "--lr", "0.1"]
        assert {k: seen["env"].get(k) for k in expected} == expected
        assert seen["env"]["RANK"] == str(1 + local_rank)  # after group rank 0's one process
        assert seen["env"]["WORLD_SIZE"] == "5"
        assert seen["env"]["GROUP_RANK"] == "1"
        assert seen["env"]["DLFLEET_ROUND"] == str(ROUND)
        assert seen["env"]["DLFLEET_NODE_ID"] == "node#1"
        assert "PATH" in seen["env"]  # the agent's own environment is inherited
    assert group.stop(timeout_s=1.0).status is GroupStatus.SUCCEEDED


def test_a_failing_worker_is_reported_and_stop_ends_the_others(
    group: WorkerGroup, tmp_path: Path
) -> None:
    path = script(
        tmp_path,
        """
        import os, sys, time
        if os.environ["LOCAL_RANK"] == "1":
            sys.exit(3)
        time.sleep(60)
        """,
    )
    start(group, config(path), tmp_path)
    state = until(group, GroupStatus.FAILED)
    assert state.failure is not None
    assert (state.failure.local_rank, state.failure.exit_code) == (1, 3)
    assert state.failure.signal_name is None
    assert state.failure.message == "exited with code 3"
    assert state.exit_codes == (None, 3)

    began = time.monotonic()
    stopped = group.stop(timeout_s=5.0)
    assert time.monotonic() - began < 3.0  # SIGTERM was enough
    assert stopped.status is GroupStatus.FAILED
    assert stopped.failure == state.failure  # the first failure stays the first
    assert stopped.exit_codes == (-signal.SIGTERM, 3)


def test_a_worker_killed_by_a_signal_reports_the_signal(group: WorkerGroup, tmp_path: Path) -> None:
    path = script(tmp_path, "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n")
    start(group, config(path, nproc=1), tmp_path)
    failure = until(group, GroupStatus.FAILED).failure
    assert failure is not None
    assert (failure.exit_code, failure.signal_name) == (-9, "SIGKILL")
    assert failure.message == "killed by SIGKILL"
    assert failure.pid == group.pids[0]


def test_a_sigkill_while_the_oom_kill_count_rose_is_reported_as_out_of_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kernel is stood in for: the cgroup's oom_kill counter reads 3 when
    the group starts and 4 after the worker died of SIGKILL (what the OOM
    killer leaves behind); the worker SIGKILLs itself."""
    counts = iter([3, 4])
    monkeypatch.setattr(workers_module, "oom_kill_count", lambda: next(counts))
    group = WorkerGroup()
    path = script(tmp_path, "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n")
    start(group, config(path, nproc=1), tmp_path)
    failure = until(group, GroupStatus.FAILED).failure
    group.stop(timeout_s=1.0)
    assert failure is not None
    assert failure.message == "killed by SIGKILL (out of memory: the kernel's OOM killer)"


def test_a_recorded_exception_is_read_back_from_the_error_file(
    group: WorkerGroup, tmp_path: Path
) -> None:
    path = script(
        tmp_path,
        """
        from torch.distributed.elastic.multiprocessing.errors import record

        @record
        def train_step():
            raise ValueError("bad shard 17")

        train_step()
        """,
    )
    envs = start(group, config(path, nproc=1), tmp_path / "logs")
    failure = until(group, GroupStatus.FAILED).failure
    assert failure is not None
    assert failure.exit_code == 1
    assert failure.message == "ValueError: bad shard 17"
    assert failure.traceback is not None and "train_step" in failure.traceback
    assert "bad shard 17" in failure.traceback
    assert failure.timestamp is not None and abs(failure.timestamp - time.time()) < 120
    assert failure.error_file == envs[0]["TORCHELASTIC_ERROR_FILE"]


def test_a_stale_error_file_of_an_earlier_attempt_is_not_reported(
    group: WorkerGroup, tmp_path: Path
) -> None:
    cfg = config(script(tmp_path, "import sys\nsys.exit(5)\n"), nproc=1)
    stale = Path(environments(cfg, tmp_path)[0]["TORCHELASTIC_ERROR_FILE"])
    stale.parent.mkdir(parents=True)
    stale.write_text(json.dumps({"message": "old news", "timestamp": 1}))
    start(group, cfg, tmp_path)
    failure = until(group, GroupStatus.FAILED).failure
    assert failure is not None
    assert (failure.message, failure.error_file) == ("exited with code 5", None)


def test_a_worker_that_ignores_sigterm_is_killed_after_the_timeout(
    group: WorkerGroup, tmp_path: Path
) -> None:
    ready = tmp_path / "ready"
    path = script(
        tmp_path,
        f"""
        import signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        open({str(ready)!r}, "w").close()
        time.sleep(60)
        """,
    )
    start(group, config(path, nproc=1), tmp_path)
    wait_for_file(ready)
    began = time.monotonic()
    state = group.stop(timeout_s=0.5)
    took = time.monotonic() - began
    assert 0.5 <= took < 3.0
    assert state.status is GroupStatus.STOPPED and state.failure is None
    assert state.exit_codes == (-signal.SIGKILL,)
    assert group.stop(timeout_s=10.0) is state  # idempotent, and at once
    assert group.poll() is state


def test_stop_ends_the_workers_own_children_too(group: WorkerGroup, tmp_path: Path) -> None:
    child_pid = tmp_path / "child.pid"
    path = script(
        tmp_path,
        f"""
        import subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        with open({str(child_pid)!r} + ".tmp", "w") as f:
            f.write(str(child.pid))
        import os; os.rename({str(child_pid)!r} + ".tmp", {str(child_pid)!r})
        time.sleep(60)
        """,
    )
    start(group, config(path, nproc=1), tmp_path)
    wait_for_file(child_pid)
    pid = int(child_pid.read_text())
    began = time.monotonic()
    group.stop(timeout_s=5.0)
    assert time.monotonic() - began < 2.0  # a zombie awaiting init is not waited for
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        state = "gone"
    assert state in ("gone", "Z", "X")  # dead: reaped, or a zombie awaiting init


def test_redirects_write_the_rounds_log_files(group: WorkerGroup, tmp_path: Path) -> None:
    path = script(
        tmp_path,
        """
        import os, sys
        print("out of", os.environ["LOCAL_RANK"])
        print("err of", os.environ["LOCAL_RANK"], file=sys.stderr)
        """,
    )
    logs = tmp_path / "logs"
    start(group, config(path, redirects=StreamSpec.parse("0:3,1:1")), logs)
    until(group, GroupStatus.SUCCEEDED)
    group.stop(timeout_s=1.0)
    rank0, rank1 = logs / str(ROUND) / "0", logs / str(ROUND) / "1"
    assert (rank0 / "stdout.log").read_text() == "out of 0\n"
    assert (rank0 / "stderr.log").read_text() == "err of 0\n"
    assert (rank1 / "stdout.log").read_text() == "out of 1\n"
    assert not (rank1 / "stderr.log").exists()


def test_tee_writes_the_log_and_echoes_prefixed_lines(tmp_path: Path) -> None:
    path = script(tmp_path, "import os\nprint('hello from', os.environ['LOCAL_RANK'])\n")
    console = io.BytesIO()
    group = WorkerGroup(console_stdout=console, console_stderr=io.BytesIO())
    start(group, config(path, tee=StreamSpec.parse("1")), tmp_path / "logs")
    until(group, GroupStatus.SUCCEEDED)
    group.stop(timeout_s=1.0)
    lines = sorted(console.getvalue().decode().splitlines())
    assert lines == ["[trainer0]:hello from 0", "[trainer1]:hello from 1"]
    log = tmp_path / "logs" / str(ROUND) / "1" / "stdout.log"
    assert log.read_text() == "hello from 1\n"


def test_a_worker_that_exits_without_an_exception_reports_the_end_of_its_stderr_log(
    group: WorkerGroup, tmp_path: Path
) -> None:
    path = script(
        tmp_path,
        "import sys\nprint('CUDA driver version is insufficient', file=sys.stderr)\nsys.exit(1)\n",
    )
    start(group, config(path, nproc=1, redirects=StreamSpec.parse("2")), tmp_path)
    failure = until(group, GroupStatus.FAILED).failure
    assert failure is not None
    assert failure.message.startswith("exited with code 1; stderr ends with:\n")
    assert "CUDA driver version is insufficient" in failure.message
    assert failure.error_file is None


def test_an_exception_of_a_script_without_record_is_read_back_from_an_error_file(
    group: WorkerGroup, tmp_path: Path
) -> None:
    """Lightning and HF scripts never use @record; the workers' sitecustomize
    writes their error file, with neither --redirects nor --tee."""
    path = script(
        tmp_path,
        """
        import sys
        def train_step():
            raise ValueError("bad shard 17")
        train_step()
        """,
    )
    envs = start(group, config(path, nproc=1), tmp_path / "logs")
    failure = until(group, GroupStatus.FAILED).failure
    assert failure is not None
    assert failure.exit_code == 1
    assert failure.message == "ValueError: bad shard 17"
    assert failure.traceback is not None and "train_step" in failure.traceback
    assert failure.traceback.rstrip().endswith("ValueError: bad shard 17")
    assert failure.timestamp is not None and abs(failure.timestamp - time.time()) < 120
    assert failure.error_file == envs[0]["TORCHELASTIC_ERROR_FILE"]


def test_an_import_crash_is_read_back_from_an_error_file(
    group: WorkerGroup, tmp_path: Path
) -> None:
    path = script(tmp_path, "import missing_module_for_dlfleet_test\n")
    start(group, config(path, nproc=1, redirects=StreamSpec.parse("2")), tmp_path)
    failure = until(group, GroupStatus.FAILED).failure
    assert failure is not None
    assert failure.message == (
        "ModuleNotFoundError: No module named 'missing_module_for_dlfleet_test'"
    )
    assert "ModuleNotFoundError" in failure.stderr_tail  # the log has it too


def test_an_exception_the_script_replaced_the_excepthook_of_is_still_recorded(
    group: WorkerGroup, tmp_path: Path
) -> None:
    """As rich's tracebacks do: Python keeps the exception it printed."""
    path = script(
        tmp_path,
        """
        import sys
        sys.excepthook = lambda kind, value, tb: print("oops:", value, file=sys.stderr)
        raise KeyError("label")
        """,
    )
    start(group, config(path, nproc=1), tmp_path)
    failure = until(group, GroupStatus.FAILED).failure
    assert failure is not None
    assert failure.message == "KeyError: 'label'"


def test_a_failing_subprocess_of_the_script_does_not_speak_for_its_rank(
    group: WorkerGroup, tmp_path: Path
) -> None:
    path = script(
        tmp_path,
        """
        import subprocess, sys
        probe = subprocess.run([sys.executable, "-c", "import apex_for_dlfleet_test"])
        sys.exit(4 if probe.returncode else 0)
        """,
    )
    start(group, config(path, nproc=1), tmp_path)
    failure = until(group, GroupStatus.FAILED).failure
    assert failure is not None
    assert (failure.message, failure.error_file) == ("exited with code 4", None)


def test_the_sitecustomize_the_workers_hook_hides_still_runs(
    group: WorkerGroup, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import os\nos.environ['SITE_RAN'] = 'yes'\n")
    monkeypatch.setenv("PYTHONPATH", str(site))
    path = script(tmp_path, "import os\nraise RuntimeError(os.environ.get('SITE_RAN', 'no'))\n")
    start(group, config(path, nproc=1), tmp_path)
    failure = until(group, GroupStatus.FAILED).failure
    assert failure is not None
    assert failure.message == "RuntimeError: yes"


def test_a_module_runs_with_dash_m(group: WorkerGroup, tmp_path: Path) -> None:
    (tmp_path / "dlfleet_test_mod.py").write_text(
        "import sys\nsys.exit(0 if sys.argv[1:] == ['a'] else 9)\n"
    )
    cfg = config("dlfleet_test_mod", nproc=1, module=True, training_script_args=("a",))
    envs = environments(cfg, tmp_path)
    envs[0]["PYTHONPATH"] = str(tmp_path)
    group.start(cfg, envs, tmp_path, ROUND)
    assert until(group, GroupStatus.SUCCEEDED).exit_codes == (0,)


def test_no_python_runs_an_executable_and_a_missing_one_cannot_start(tmp_path: Path) -> None:
    ok = WorkerGroup()
    start(ok, config("true", nproc=2, no_python=True), tmp_path)
    assert until(ok, GroupStatus.SUCCEEDED).exit_codes == (0, 0)
    ok.stop(timeout_s=1.0)

    missing = WorkerGroup()
    with pytest.raises(WorkerStartError, match="cannot start local rank 0"):
        start(missing, config(str(tmp_path / "nope"), nproc=1, no_python=True), tmp_path)
    assert missing.stop(timeout_s=1.0) == GroupState(GroupStatus.STOPPED, ())


def test_a_group_starts_once(group: WorkerGroup, tmp_path: Path) -> None:
    cfg = config(sys.executable, nproc=1, no_python=True, training_script_args=("-c", "pass"))
    start(group, cfg, tmp_path)
    with pytest.raises(RuntimeError, match="started once"):
        start(group, cfg, tmp_path)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_CHILD_SUBREAPER is Linux")
def test_an_agent_that_adopts_orphans_reaps_them_and_does_not_wait(tmp_path: Path) -> None:
    """As a container's PID 1 (here: a child subreaper) the agent inherits the
    zombies of its workers' children; stop() reaps them instead of waiting
    out its timeout for a group that only zombies keep alive."""
    worker = script(
        tmp_path,
        f"""
        import os, subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        with open({str(tmp_path / "pid.tmp")!r}, "w") as f:
            f.write(str(child.pid))
        os.rename({str(tmp_path / "pid.tmp")!r}, {str(tmp_path / "pid")!r})
        time.sleep(60)
        """,
    )
    agent = tmp_path / "agent.py"
    agent.write_text(
        textwrap.dedent(
            f"""
            import ctypes, os, time
            from pathlib import Path
            from dlfleet.worker.agent.config import AgentConfig
            from dlfleet.worker.agent.workers import WorkerGroup

            assert ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0  # subreaper
            group = WorkerGroup()
            config = AgentConfig(training_script={str(worker)!r}, master="h:1", token="t")
            group.start(config, [{{}}], Path({str(tmp_path)!r}), 1)
            pid_file = Path({str(tmp_path / "pid")!r})
            while not pid_file.exists():
                time.sleep(0.01)
            orphan = int(pid_file.read_text())
            began = time.monotonic()
            group.stop(timeout_s=10.0)
            print(round(time.monotonic() - began, 3), os.path.exists(f"/proc/{{orphan}}"))
            """
        )
    )
    done = subprocess.run(
        [sys.executable, str(agent)], capture_output=True, text=True, timeout=20, check=True
    )
    took, orphan_exists = done.stdout.split()
    assert float(took) < 2.0
    assert orphan_exists == "False"  # reaped, not left a zombie


def test_the_first_failure_stays_reported_when_others_fail_after_it(
    group: WorkerGroup, tmp_path: Path
) -> None:
    path = script(
        tmp_path,
        """
        import os, sys, time
        if os.environ["LOCAL_RANK"] == "0":
            time.sleep(0.5)
            sys.exit(4)
        sys.exit(3)
        """,
    )
    start(group, config(path), tmp_path)
    first = until(group, GroupStatus.FAILED).failure
    deadline = time.monotonic() + 10
    while group.poll().exit_codes[0] is None and time.monotonic() < deadline:
        time.sleep(0.02)
    later = group.poll()
    assert later.exit_codes == (4, 3)
    assert first is not None and later.failure == first and first.local_rank == 1


def test_a_tee_whose_console_is_gone_still_drains_the_worker(tmp_path: Path) -> None:
    path = script(tmp_path, "for _ in range(4000):\n    print('y' * 99)\n")  # 400 kB > a pipe
    console = io.BytesIO()
    console.close()
    group = WorkerGroup(console_stdout=console)
    start(group, config(path, nproc=1, tee=StreamSpec.parse("1")), tmp_path / "logs")
    until(group, GroupStatus.SUCCEEDED)
    group.stop(timeout_s=1.0)
    log = tmp_path / "logs" / str(ROUND) / "0" / "stdout.log"
    assert log.read_text() == ("y" * 99 + "\n") * 4000


def _running(pid: int) -> bool:
    """Whether `pid` still runs. A killed orphan is reaped by whoever adopted it
    (init, or a subreaper that may be slow to reap): a zombie counts as dead."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal is Linux")
def test_workers_die_with_a_sigkilled_agent(tmp_path: Path) -> None:
    """No orphan keeps training in a stale round after its agent is killed."""
    agent_code = (
        "import sys, time; from pathlib import Path\n"
        "from dlfleet.worker.agent.config import AgentConfig\n"
        "from dlfleet.worker.agent.workers import WorkerGroup\n"
        "cfg = AgentConfig(training_script='-c', training_script_args=('import time; "
        "time.sleep(60)',), master='127.0.0.1:1', token='t', nproc_per_node=1)\n"
        "g = WorkerGroup(); g.start(cfg, [{}], Path(sys.argv[1]), 1)\n"
        "print(g.pids[0], flush=True); time.sleep(60)\n"
    )
    agent = subprocess.Popen(
        [sys.executable, "-c", agent_code, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    assert agent.stdout is not None
    worker_pid = int(agent.stdout.readline())
    os.kill(worker_pid, 0)  # alive
    agent.kill()
    agent.wait(10)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if not _running(worker_pid):
            return
        time.sleep(0.05)
    os.kill(worker_pid, 9)
    raise AssertionError("the worker outlived its agent")


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs util-linux's setpriv")
def test_a_worker_whose_agent_died_before_the_signal_was_armed_never_starts(
    tmp_path: Path,
) -> None:
    """The window between fork and setpriv's prctl: the guard sees a parent
    other than the agent and exits before the training script runs."""
    marker = tmp_path / "ran"
    command = die_with_parent([sys.executable, "-c", f"open({str(marker)!r}, 'w')"])
    agent_pid = str(os.getpid())
    assert agent_pid in command
    command[command.index(agent_pid)] = "1"  # as if adopted by init
    assert subprocess.run(command, check=False).returncode == 137
    assert not marker.exists()
    command[command.index("1")] = agent_pid  # the agent is the parent: runs
    assert subprocess.run(command, check=False).returncode == 0
    assert marker.exists()


def test_ranks_that_raise_alike_are_counted_after_a_short_wait(
    group: WorkerGroup, tmp_path: Path
) -> None:
    """Rank 1 raises at once, rank 0 the same exception 0.1 s later: the
    group holds the failure back for the others (up to ALIKE_GRACE_S), so
    the report says both ranks failed alike: the code, not the machine.
    (The exception is read from the stderr logs: redirected here.)"""
    path = script(
        tmp_path,
        """
        import os, time
        if os.environ["LOCAL_RANK"] == "0":
            time.sleep(0.1)
        raise ValueError("shapes (8,3) and (4,) not aligned")
        """,
    )
    start(group, config(path, redirects=StreamSpec.parse("2")), tmp_path)
    state = until(group, GroupStatus.FAILED)
    assert state.failure is not None and state.failure.ranks_alike == 2
    assert "ValueError: shapes (8,3) and (4,) not aligned" in state.failure.message


def test_a_rank_raising_alone_is_reported_after_the_short_wait(
    group: WorkerGroup, tmp_path: Path
) -> None:
    path = script(
        tmp_path,
        """
        import os, time
        if os.environ["LOCAL_RANK"] == "1":
            raise KeyError("label")
        time.sleep(60)
        """,
    )
    start(group, config(path, redirects=StreamSpec.parse("2")), tmp_path)
    while group.poll().exit_codes[1] is None:
        time.sleep(0.01)
    exited = time.monotonic()
    state = until(group, GroupStatus.FAILED)
    waited = time.monotonic() - exited
    assert state.failure is not None and state.failure.ranks_alike == 1
    assert state.exit_codes == (None, 1)
    assert ALIKE_GRACE_S - 0.05 <= waited < ALIKE_GRACE_S + 1.0
