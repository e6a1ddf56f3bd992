"""A rank's presence in its node's image folder: held while its writer is
open, gone when its process ends however it ends (SIGKILL included), unknown
where it never wrote."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from dlfleet.worker.checkpoint.image import ImageWriter
from dlfleet.worker.checkpoint.presence import Presence, RankState, presence_path, rank_state


def test_presence_follows_an_open_writer(tmp_path: Path) -> None:
    assert rank_state(tmp_path, 1) is RankState.UNKNOWN
    with ImageWriter(tmp_path, rank=1, presence=True):
        assert rank_state(tmp_path, 1) is RankState.ALIVE
        assert rank_state(tmp_path, 1) is RankState.ALIVE  # a probe leaves no lock behind
    assert rank_state(tmp_path, 1) is RankState.GONE
    with ImageWriter(tmp_path, rank=2):
        assert rank_state(tmp_path, 2) is RankState.UNKNOWN  # not asked to say it lives


def test_a_probe_from_the_holding_process_sees_it_alive(tmp_path: Path) -> None:
    held = Presence(tmp_path, 0)
    try:
        assert rank_state(tmp_path, 0) is RankState.ALIVE
    finally:
        held.close()
    assert rank_state(tmp_path, 0) is RankState.GONE


def test_a_killed_process_leaves_its_rank_gone(tmp_path: Path) -> None:
    holder = textwrap.dedent(
        f"""
        import sys, time
        from pathlib import Path
        from dlfleet.worker.checkpoint.presence import Presence
        Presence(Path({str(tmp_path)!r}), 3)
        print("held", flush=True)
        time.sleep(60)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", holder], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        assert rank_state(tmp_path, 3) is RankState.ALIVE
    finally:
        proc.kill()
        proc.wait()
    assert rank_state(tmp_path, 3) is RankState.GONE
    assert presence_path(tmp_path, 3).exists()  # the file stays; only the lock went
