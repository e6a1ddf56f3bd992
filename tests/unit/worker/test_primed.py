"""A primed spare (`dlfleet.worker.agent.primed`): a real interpreter that
imports what the script imports, runs no line of it until told `run` on
stdin, and then runs it as `python -u script.py` would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from dlfleet.api.processes import SPARE_NAME
from dlfleet.worker.agent import primed

SCRIPT = '''\
"""The script: its own lines record what they see."""
import json
import os
import sys

import marker_module

try:
    import no_such_module_anywhere
except ImportError:
    no_such_module_anywhere = None

from marker_package import lazy_name

if __name__ == "__main__":
    seen = {
        "name": __name__,
        "argv": sys.argv,
        "path0": sys.path[0],
        "stdin": sys.stdin.read(),
        "marker": marker_module.IMPORTED_AT,
        "lazy": lazy_name.VALUE,
    }
    with open(os.environ["PRIMED_OUT"], "w") as out:
        json.dump(seen, out)
'''


def _lab(tmp_path: Path) -> tuple[Path, Path, dict[str, str]]:
    (tmp_path / "marker_module.py").write_text(
        "import os, time\nIMPORTED_AT = time.time()\n"
        "open(os.environ['PRIMED_MARKER'], 'w').write('imported')\n"
    )
    package = tmp_path / "marker_package"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "lazy_name.py").write_text("VALUE = 1\n")  # a submodule, not an attribute
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    out = tmp_path / "out.json"
    env = {
        **os.environ,
        "PRIMED_OUT": str(out),
        "PRIMED_MARKER": str(tmp_path / "marker"),
        "PYTHONPATH": os.pathsep.join(sys.path),
    }
    return script, out, env


def _wait_for(path: Path, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 60
    while not path.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)


def _start(script: Path, env: dict[str, str], cwd: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-u", "-m", primed.MODULE, str(script), "--steps", "3"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        cwd=cwd,
    )


def test_it_imports_first_and_runs_the_script_only_when_told(tmp_path: Path) -> None:
    script, out, env = _lab(tmp_path)
    proc = _start(script, env, cwd=Path("/"))
    _wait_for(tmp_path / "marker", proc)
    time.sleep(0.3)  # time to run the script, were it not waiting
    assert not out.exists(), "the script ran before the agent said run"
    assert proc.poll() is None
    assert Path(f"/proc/{proc.pid}/comm").read_text().strip() == SPARE_NAME
    told = time.time()
    output, _ = proc.communicate(primed.RUN, timeout=60)
    assert proc.returncode == 0, output.decode()
    seen = json.loads(out.read_text())
    assert seen["name"] == "__main__"
    assert seen["argv"] == [str(script), "--steps", "3"]
    assert seen["path0"] == str(tmp_path)  # the script's folder, as python sets it
    assert seen["stdin"] == ""  # nothing to read, as a worker's stdin
    assert seen["marker"] < told  # imported while it waited
    assert seen["lazy"] == 1


def test_a_closed_stdin_ends_it_without_running_the_script(tmp_path: Path) -> None:
    script, out, env = _lab(tmp_path)
    proc = _start(script, env, cwd=tmp_path)
    _wait_for(tmp_path / "marker", proc)
    output, _ = proc.communicate(b"", timeout=60)
    assert proc.returncode == 0, output.decode()
    assert not out.exists()


def test_a_module_runs_as_python_m_runs_it(tmp_path: Path) -> None:
    script, out, env = _lab(tmp_path)
    package = tmp_path / "jobs"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "train.py").write_text(script.read_text())
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p != str(tmp_path))
    proc = subprocess.Popen(
        [sys.executable, "-u", "-m", primed.MODULE, "-m", "jobs.train", "--steps", "3"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        cwd=tmp_path,  # python -m finds the package in its working folder
    )
    _wait_for(tmp_path / "marker", proc)
    output, _ = proc.communicate(primed.RUN, timeout=60)
    assert proc.returncode == 0, output.decode()
    seen = json.loads(out.read_text())
    assert seen["name"] == "__main__"
    assert seen["argv"] == [str(package / "train.py"), "--steps", "3"]


def test_only_scripts_that_may_restart_in_place_want_spares(tmp_path: Path) -> None:
    cases = {
        "from dlfleet import Checkpointer, ShardedDataLoader, elastic\n": True,
        "import dlfleet.elastic\n": True,
        "from dlfleet.integrations.lightning import DLFleetTrainer\n": True,
        "try:\n    from dlfleet.integrations import hf\nexcept ImportError:\n    hf = None\n": True,
        "from dlfleet import ShardedDataLoader\nimport torch\n": False,
        "import torch\ndef f():\n    from dlfleet import elastic\n": False,  # not at the top
        "this is not python(\n": False,
    }
    for index, (source, wanted) in enumerate(cases.items()):
        script = tmp_path / f"s{index}.py"
        script.write_text(source)
        assert primed.wants_spares(str(script), module=False) is wanted, source
    assert not primed.wants_spares(str(tmp_path / "missing.py"), module=False)
    assert not primed.wants_spares("no_such_package.train", module=True)
    assert primed.wants_spares("dlfleet.worker.agent.primed", module=True) is False
