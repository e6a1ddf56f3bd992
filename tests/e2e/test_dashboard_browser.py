"""The master's dashboard in a real browser (headless Chromium, driven by
playwright) on a real job: the quickstart's train.py on two local nodes,
started by `dlmaster --job-config`. The browser logs in through the login
link, sees both nodes training and a dataset's progress bar advance; then a
training process is SIGKILLed and its failure shows on the page's timeline,
and the goodput bar shows the time its restart cost beside the training.
A screenshot of the page is kept (the test's tmp_path and test-output/ at the
checkout's root) for a person to look at.

The browser is the system's chromium (scripts/setup.sh installs Debian's),
never one that playwright downloads."""

from __future__ import annotations

import os
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from harness import JobProcess, missing, worker_of

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "examples" / "quickstart"
SCREENSHOT_DIR = ROOT / "test-output"
TOKEN = "dashboard-test-token"
# Enough records that the job is still training when the test ends (it is
# stopped then): a couple of thousand steps of 2 x 8 records.
RECORDS = 60_000
PAGE_TIMEOUT_MS = 60_000


def chromium() -> str:
    """The system's chromium; skip without one, except in CI (it must run there)."""
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        missing("no chromium on PATH (scripts/setup.sh installs Debian's where apt-get can)")
    return path


@pytest.fixture
def job(tmp_path: Path) -> Iterator[JobProcess]:
    config: dict[str, Any] = yaml.safe_load((QUICKSTART / "job.yaml").read_text())
    config.update(
        command=str(QUICKSTART / config["command"]),
        args=["--epochs", "2", "--size", str(RECORDS), "--batch-size", "8"],
        workdir=str(tmp_path / "work"),
        display="off",
        token=TOKEN,
        heartbeat={"interval_s": 0.5, "timeout_s": 10.0},
        brain={"mode": "off"},
    )
    process = JobProcess(tmp_path, config).start()
    yield process
    process.kill()


def test_the_dashboard_shows_nodes_progress_and_a_killed_worker(
    job: JobProcess, tmp_path: Path
) -> None:
    executable = chromium()
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright (the dev extra)")
    started = time.monotonic()
    job.wait_for(lambda: job.status()["http_url"], "the master's HTTP endpoint", timeout=60)
    url = str(job.status()["http_url"])

    with sync_api.sync_playwright() as playwright:
        # Root in a container has no user namespaces for chromium's sandbox.
        browser = playwright.chromium.launch(executable_path=executable, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1440, "height": 1000})
            errors: list[str] = []
            page.on("pageerror", lambda error: errors.append(str(error)))
            page.set_default_timeout(PAGE_TIMEOUT_MS)
            page.goto(f"{url}/login?token={TOKEN}")
            assert page.url == f"{url}/"  # the cookie is set; the token is out of the address
            assert TOKEN not in page.content()

            # Both nodes train, in one round.
            page.wait_for_selector('.node[data-state="training"] >> nth=1')
            names = page.eval_on_selector_all(".node", "ns => ns.map(n => n.dataset.node)")
            assert sorted(names) == ["node-0", "node-1"]
            bar = '[data-dataset] [role="progressbar"]'
            page.wait_for_function(
                f"() => Number(document.querySelector('{bar}')?.getAttribute('aria-valuenow')) > 0"
            )
            first = int(page.get_attribute(bar, "aria-valuenow") or 0)
            page.wait_for_function(
                f"() => Number(document.querySelector('{bar}').getAttribute('aria-valuenow'))"
                f" > {first}"
            )
            assert int(page.get_attribute(bar, "aria-valuenow") or 0) > first

            # A training process dies: the page's timeline says so.
            node = next(n for n in job.status()["nodes"] if n["name"] == "node-1")
            os.kill(worker_of(int(node["pid"])), signal.SIGKILL)
            failed = page.wait_for_selector('#timeline [data-kind="worker_failed"]')
            assert failed is not None and "SIGKILL" in failed.inner_text()
            assert "SIGKILL" in page.inner_text("#failure")
            # ... and the job goes on in a new round with both nodes.
            seq = int(failed.get_attribute("data-seq") or 0)
            page.wait_for_function(
                "() => [...document.querySelectorAll('#timeline [data-kind=\"round_formed\"]')]"
                f".some(e => Number(e.dataset.seq) > {seq})"
            )
            page.wait_for_function(
                "() => [...document.querySelectorAll('.node[data-state=\"training\"]')]"
                ".filter(n => Number(n.dataset.samplesPerSecond) > 0).length === 2"
            )
            # The goodput bar: training, and the time the restart cost.
            page.wait_for_selector(
                '#goodput-bar rect[data-cause="restart"], '
                '#goodput-bar rect[data-cause="re_rendezvous"]'
            )
            assert page.query_selector('#goodput-bar rect[data-cause="productive"]') is not None
            ratio = float(page.get_attribute(".goodput", "data-ratio") or 0)
            assert 0 < ratio < 1
            page.wait_for_timeout(2000)  # a few more points on the charts

            shot = tmp_path / "dashboard.png"
            page.screenshot(path=str(shot), full_page=True)
            assert errors == [], errors  # the page's script never failed
        finally:
            browser.close()
    SCREENSHOT_DIR.mkdir(exist_ok=True)
    kept = SCREENSHOT_DIR / "dashboard.png"
    shutil.copyfile(shot, kept)
    print(f"dashboard screenshot: {kept} ({time.monotonic() - started:.0f}s)")
