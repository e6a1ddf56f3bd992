"""TLS on the master's port: a master serving TLS answers clients that verify
it, and nobody else; `dlmaster --job-config` with `tls:` runs a whole job over
TLS (nodes, workers and `dlmaster status` all verify the certificate)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import TOKEN, JobProcess, LoopThread, make_cert

from dlfleet.api.client import MasterClient, RetryPolicy
from dlfleet.api.errors import Unavailable
from dlfleet.api.v1 import shards_pb2

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command"),
]


@pytest.fixture
def tls_master(tmp_path: Path, loop_thread: LoopThread) -> Iterator[tuple[int, bytes]]:
    from dlfleet.api.serving.tls import load_tls_pair
    from dlfleet.master.service.rpc import system_clock
    from dlfleet.master.service.server import MasterServer
    from dlfleet.master.service.state import MasterSettings, MasterState
    from dlfleet.master.store.sql import open_store

    cert, key = make_cert(tmp_path, "master")
    state = MasterState.recover(
        open_store(f"sqlite:///{tmp_path / 'state.db'}"), MasterSettings(), system_clock()
    )
    server = MasterServer(state, token=TOKEN, tls=load_tls_pair(cert, key))
    port = loop_thread.run(server.start())
    yield port, cert.read_bytes()
    loop_thread.run(server.stop(0))
    state.close()


SPEC = shards_pb2.DatasetSpec(name="d", size=10, batch_size=2, epochs=1)
QUICK = RetryPolicy(attempts=2, max_backoff_s=0.1, total_budget_s=2)


def test_a_client_that_verifies_the_certificate_is_served(tls_master: tuple[int, bytes]) -> None:
    port, ca = tls_master
    with MasterClient(f"127.0.0.1:{port}", token=TOKEN, tls_ca=ca) as client:
        assert client.register_dataset(SPEC).created
        # The session path (grpc.aio on the client's loop) verifies too.
        with client.lease_session() as session:
            response = session.lease("d", node_id="n#1", rank=0)
        assert response.WhichOneof("outcome") == "shard"


def test_plaintext_and_unknown_certificates_are_refused(
    tls_master: tuple[int, bytes], tmp_path: Path
) -> None:
    port, _ = tls_master
    with (
        MasterClient(f"127.0.0.1:{port}", token=TOKEN, retry=QUICK, timeout_s=2) as plain,
        pytest.raises(Unavailable),
    ):
        plain.register_dataset(SPEC)
    other, _ = make_cert(tmp_path, "impostor")
    with (
        MasterClient(
            f"127.0.0.1:{port}", token=TOKEN, retry=QUICK, timeout_s=2, tls_ca=other.read_bytes()
        ) as wrong,
        pytest.raises(Unavailable),
    ):
        wrong.register_dataset(SPEC)


def test_the_ca_can_come_from_the_environment(
    tls_master: tuple[int, bytes], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    port, ca = tls_master
    (tmp_path / "ca.pem").write_bytes(ca)
    monkeypatch.setenv("DLFLEET_TLS_CA", str(tmp_path / "ca.pem"))
    with MasterClient(f"127.0.0.1:{port}", token=TOKEN) as client:
        assert client.register_dataset(SPEC).created


def test_a_whole_job_runs_over_tls(tmp_path: Path) -> None:
    cert, key = make_cert(tmp_path, "master")
    (tmp_path / "hello.py").write_text(
        "import os, time\n"
        "from dlfleet.api.client import MasterClient\n"
        "c = MasterClient(os.environ['DLFLEET_MASTER'], token=os.environ['DLFLEET_TOKEN'])\n"
        "print('state', c.rendezvous_state().round, flush=True)\n"
    )
    config = {
        "name": "tls-job",
        "command": "hello.py",
        "nodes": {"min": 2, "max": 2},
        "display": "plain",
        "rendezvous": {"last_call_timeout_s": 0.2},
        "tls": {"cert_file": str(cert), "key_file": str(key)},
    }
    job = JobProcess(tmp_path, config).start()
    code, out, err = job.finish(timeout=60)
    assert code == 0, err
    assert out.count("state 1") == 2  # both workers reached the master over TLS


def test_dlmaster_refuses_half_a_tls_pair(tmp_path: Path) -> None:
    cert, _ = make_cert(tmp_path, "master")
    done = subprocess.run(
        [sys.executable, "-m", "dlfleet.master", "--token", "t", "--tls-cert", str(cert)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 2 and "--tls-cert and --tls-key go together" in done.stderr
    (tmp_path / "job.yaml").write_text(
        json.dumps({"name": "x", "command": "job.yaml", "tls": {"cert_file": str(cert)}})
    )
    done = subprocess.run(
        [sys.executable, "-m", "dlfleet.master", "--job-config", str(tmp_path / "job.yaml")],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 2 and "tls.key_file: required" in done.stderr
