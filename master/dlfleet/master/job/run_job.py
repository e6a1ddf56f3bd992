"""`dlmaster --job-config job.yaml`: validate, then run the job to its end.

Exit codes: 0 the job succeeded; 1 it failed (the reason, with the failing
rank's traceback, is printed last on stderr); 2 the job.yaml is invalid, or a
port it fixes is in use (nothing was started); 130 interrupted (^C or SIGTERM:
the nodes are stopped).

Lives in the job supervisor process (`dlmaster --job-config`).
"""

from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path

from dlfleet.api.errors import DlfleetError, InvalidArgument
from dlfleet.api.serving.ports import Endpoint, PortInUse
from dlfleet.master.job.display import DisplayLogHandler, choose_display
from dlfleet.master.job.jobconfig import load_job_config
from dlfleet.master.job.runner import JobRunner

PORT_SETTINGS = {Endpoint.GRPC: "master.port", Endpoint.HTTP: "http.port"}


def run_job_main(path: Path, log_level: str = "INFO") -> int:
    try:
        config = load_job_config(path)
    except InvalidArgument as exc:
        print(f"dlmaster: invalid job config: {exc}", file=sys.stderr)
        return 2
    display = choose_display(config.display)
    handler = DisplayLogHandler(display)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))
    logging.basicConfig(level=log_level.upper(), handlers=[handler], force=True)
    runner = JobRunner(config, display)
    try:
        result = asyncio.run(runner.run())
    except PortInUse as exc:
        display.close()
        setting = PORT_SETTINGS[exc.endpoint]
        print(
            f"dlmaster: job {config.name}: {exc} ({setting}: {exc.port} in {path}): stop what "
            f"holds it, or set another {setting} (0 picks a free one)",
            file=sys.stderr,
        )
        return 2
    except DlfleetError as exc:
        display.close()
        print(f"dlmaster: job {config.name} could not run: {exc}", file=sys.stderr)
        return 1
    display.close()
    if result.code == 0:
        print(f"dlmaster: job {config.name} succeeded: {result.reason}", flush=True)
    else:
        print(f"dlmaster: job {config.name} FAILED: {result.reason}", file=sys.stderr, flush=True)
    return result.code
