"""Generate the Python code of the wire protocol from `proto/`.

The generated modules (`*_pb2.py`, `*_pb2_grpc.py` and their `.pyi` stubs) are
build outputs: never committed, never edited. `setup.py` calls `generate()` on
every build, editable installs included, and a test regenerates into a
temporary folder and compares, so a stale copy cannot pass CI.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent.parent / "proto"
API_DIR = Path("dlfleet") / "api" / "v1"


def _plugin(name: str) -> str:
    """Find a protoc plugin next to this interpreter first, then on PATH."""
    for scripts in (sysconfig.get_path("scripts"), str(Path(sys.executable).parent)):
        candidate = Path(scripts) / name
        if candidate.exists():
            return str(candidate)
    found = shutil.which(name)
    if found is None:
        raise RuntimeError(f"protoc plugin {name!r} not found: install mypy-protobuf")
    return found


def proto_files(root: Path = PROTO_ROOT) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in (root / API_DIR).glob("*.proto"))


def generate(out_dir: Path, root: Path = PROTO_ROOT) -> list[Path]:
    """Run protoc over every .proto under `root`, writing into `out_dir`."""
    args = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",
        f"-I{root}",
        f"--plugin=protoc-gen-mypy={_plugin('protoc-gen-mypy')}",
        f"--plugin=protoc-gen-mypy_grpc={_plugin('protoc-gen-mypy_grpc')}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        f"--mypy_out={out_dir}",
        f"--mypy_grpc_out={out_dir}",
        *proto_files(root),
    ]
    subprocess.run(args, check=True)
    return sorted((out_dir / API_DIR).glob("*_pb2*"))


if __name__ == "__main__":
    for path in generate(PROTO_ROOT):
        print(path.relative_to(PROTO_ROOT))
