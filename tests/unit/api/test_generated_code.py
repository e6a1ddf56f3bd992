"""The wire code in use is exactly what protoc generates from proto/ now: a
stale copy (a .proto edited without a rebuild) fails here."""

from __future__ import annotations

import sys
from pathlib import Path

import dlfleet.api.v1

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "tools"))

import protogen  # noqa: E402


def test_generated_modules_match_a_fresh_protoc_run(tmp_path: Path) -> None:
    fresh = protogen.generate(tmp_path)
    assert fresh, "protoc generated nothing"
    installed = Path(dlfleet.api.v1.__file__).parent
    for path in fresh:
        current = installed / path.name
        assert current.exists(), f"{path.name} is missing: rebuild with scripts/setup.sh"
        assert current.read_text() == path.read_text(), (
            f"{path.name} is stale against proto/: rebuild with scripts/setup.sh"
        )


def test_every_service_has_typed_stubs() -> None:
    installed = Path(dlfleet.api.v1.__file__).parent
    for proto in protogen.proto_files():
        stem = Path(proto).stem
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_pb2_grpc.pyi"):
            assert (installed / f"{stem}{suffix}").exists(), f"{stem}{suffix} not generated"
