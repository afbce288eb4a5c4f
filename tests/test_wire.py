"""The checked-in gRPC code in vault/wire/ is what protos/ generates: a stale copy fails here."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GENERATED = ("pinvault_pb2.py", "pinvault_pb2.pyi", "pinvault_pb2_grpc.py", "pinvault_pb2_grpc.pyi")


def test_generated_code_matches_the_proto(tmp_path: Path) -> None:
    plugin = shutil.which("protoc-gen-mypy", path=str(Path(sys.executable).parent))
    grpc_plugin = shutil.which("protoc-gen-mypy_grpc", path=str(Path(sys.executable).parent))
    assert plugin and grpc_plugin, "mypy-protobuf is part of the dev environment (uv sync)"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{ROOT / 'protos'}",
            f"--python_out={tmp_path}",
            f"--grpc_python_out={tmp_path}",
            f"--mypy_out={tmp_path}",
            f"--mypy_grpc_out={tmp_path}",
            f"--plugin=protoc-gen-mypy={plugin}",
            f"--plugin=protoc-gen-mypy_grpc={grpc_plugin}",
            str(ROOT / "protos" / "vault" / "wire" / "pinvault.proto"),
        ],
        check=True,
        capture_output=True,
    )
    for name in GENERATED:
        fresh = (tmp_path / "vault" / "wire" / name).read_text()
        checked_in = (ROOT / "vault" / "wire" / name).read_text()
        assert fresh == checked_in, f"vault/wire/{name} is stale: run scripts/gen-protos"
