"""How the master and the controller find the Kubernetes API (`connect`):
a kubeconfig named wins, then $KUBECONFIG, then the Pod's own credentials;
a failure is one line naming which and why, not a traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from dlfleet.api.errors import DlfleetError
from dlfleet.master.job.platform.kubernetes import connect

KUBECONFIG = """apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "https://10.9.8.7:6443"}}]
users: [{name: u, user: {token: abc}}]
contexts: [{name: x, context: {cluster: c, user: u}}]
current-context: x
"""


def test_kubeconfig_env_wins_over_the_pods_own_credentials(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "config"
    path.write_text(KUBECONFIG)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    monkeypatch.setenv("KUBECONFIG", str(path))
    api = connect(None)
    assert api.configuration.host == "https://10.9.8.7:6443"


def test_a_pod_without_its_token_is_told_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    monkeypatch.delenv("KUBECONFIG", raising=False)
    with pytest.raises(DlfleetError, match="service account mount its token"):
        connect(None)


def test_a_missing_kubeconfig_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(DlfleetError, match=f"kubeconfig {missing}"):
        connect(str(missing))


def test_dlmaster_operator_without_credentials_says_so_in_one_line(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "dlfleet.master", "operator", "--image", "m:1",
         "--kubeconfig", str(tmp_path / "nope")],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("dlmaster operator: cannot reach the Kubernetes API")
    assert "Traceback" not in done.stderr
