"""Regenerate scaler/externalscaler_pb2{,_grpc}.py{,i} from proto/externalscaler.proto.

The proto directory is mapped to the import path ``scaler/`` so the generated gRPC module imports
``from scaler import externalscaler_pb2`` (a package import) without any text rewriting. The output
depends only on the proto file and the pinned grpcio-tools version, so a test can regenerate into
a temporary directory and compare byte for byte.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = REPO_ROOT / "proto"
PROTO_NAME = "externalscaler.proto"
GENERATED_NAMES = ("externalscaler_pb2.py", "externalscaler_pb2_grpc.py", "externalscaler_pb2.pyi")


def generate(out_dir: Path, proto_dir: Path = PROTO_DIR) -> list[Path]:
    """Write the generated stubs into ``out_dir`` (the directory standing for package ``scaler``)."""
    from grpc_tools import protoc  # build-time dependency only

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as staging:
        args = [
            "grpc_tools.protoc",
            f"-Iscaler={proto_dir}",
            f"--python_out={staging}",
            f"--pyi_out={staging}",
            f"--grpc_python_out={staging}",
            f"scaler/{PROTO_NAME}",
        ]
        if protoc.main(args) != 0:
            raise RuntimeError("protoc failed on " + str(proto_dir / PROTO_NAME))
        written = []
        for name in GENERATED_NAMES:
            target = out_dir / name
            shutil.copyfile(Path(staging) / "scaler" / name, target)
            written.append(target)
    return written


def main() -> int:
    for path in generate(REPO_ROOT / "scaler"):
        print(path.relative_to(REPO_ROOT))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
