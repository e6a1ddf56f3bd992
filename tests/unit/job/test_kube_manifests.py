"""What the kubernetes platform and deploy/ declare for the master's HTTP
endpoint: its Service names the port and carries Prometheus's scrape
annotations where the endpoint is reachable, and deploy/'s master Pod exposes
the ports the example job.yaml serves on. (Against a real API server:
tests/kube.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from dlfleet.master.job.jobconfig import JobConfig, parse_job_config
from dlfleet.master.job.platform.kubernetes import master_service

DEPLOY = Path(__file__).resolve().parents[3] / "deploy"


def kube_config(tmp_path: Path, **fields: Any) -> JobConfig:
    return parse_job_config(
        {"name": "demo", "command": "train.py", "platform": "kubernetes",
         "kubernetes": {"image": "x"}, **fields},
        base_dir=tmp_path,
    )  # fmt: skip


def test_a_reachable_endpoint_gets_a_service_port_and_scrape_annotations(tmp_path: Path) -> None:
    config = kube_config(tmp_path, http={"host": "0.0.0.0", "port": 8080})
    service = master_service(config, "demo-master", "ns", 50051, None)
    assert service["spec"]["ports"] == [
        {"name": "grpc", "port": 50051},
        {"name": "http", "port": 8080},
    ]
    assert service["metadata"]["annotations"] == {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": "8080",
        "prometheus.io/path": "/metrics",
        "prometheus.io/scheme": "http",
    }
    assert service["spec"]["selector"] == {"dlfleet.io/job": "demo", "dlfleet.io/role": "master"}


def test_a_tls_master_is_scraped_over_https(tmp_path: Path) -> None:
    (tmp_path / "m.crt").write_text("")
    (tmp_path / "m.key").write_text("")
    config = kube_config(
        tmp_path,
        http={"host": "0.0.0.0", "port": 8443},
        tls={"cert_file": "m.crt", "key_file": "m.key"},
    )
    annotations = master_service(config, "demo-master", "ns", 50051, None)["metadata"]
    assert annotations["annotations"]["prometheus.io/scheme"] == "https"


def test_an_endpoint_on_the_pods_loopback_or_none_is_not_announced(tmp_path: Path) -> None:
    for http in ({}, {"http": None}):
        service = master_service(kube_config(tmp_path, **http), "demo-master", "ns", 50051, None)
        assert "annotations" not in service["metadata"]
        assert service["spec"]["ports"] == [{"name": "grpc", "port": 50051}]


def test_the_example_masters_pod_exposes_the_ports_its_job_yaml_serves_on() -> None:
    job_yaml = yaml.safe_load((DEPLOY / "overlays" / "example" / "job.yaml").read_text())
    job_yaml.pop("token_file")  # a mounted Secret, absent here
    config = parse_job_config(job_yaml, base_dir=Path("/"))
    (job,) = [
        doc
        for doc in yaml.safe_load_all((DEPLOY / "base" / "master-job.yaml").read_text())
        if doc and doc["kind"] == "Job"
    ]
    (container,) = job["spec"]["template"]["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert config.http is not None and config.http.beyond_loopback()
    assert ports == {"grpc": config.master.port, "http": config.http.port}
    service = master_service(config, "example-master", "ns", config.master.port, None)
    assert service["metadata"]["annotations"]["prometheus.io/port"] == str(ports["http"])
