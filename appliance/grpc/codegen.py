"""The generated code of the gRPC API, made from its proto (`just proto`): the messages
(`inference_pb2.py`, and `.pyi` by grpcio-tools' --pyi_out), the stub and servicer
(`inference_pb2_grpc.py`, typed by mypy-protobuf's `.pyi`). The generated files are
committed; a test regenerates them and compares, so they never drift from the proto.

Only for development: grpcio-tools and mypy-protobuf come with the `dev` extra, pinned,
since a new version of either writes different code.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the proto is named by its repository path
PROTO = Path("appliance/grpc/proto/kovenlab/edge/v1/inference.proto")
OUTPUTS = (
    "inference_pb2.py",
    "inference_pb2.pyi",
    "inference_pb2_grpc.py",
    "inference_pb2_grpc.pyi",
)


def generate(out: Path) -> dict[str, bytes]:
    """Generate into ``out`` (the repository's layout under it); each output's bytes."""
    from grpc_tools import protoc  # noqa: PLC0415 - a dev tool, imported only here

    plugin = Path(sys.executable).with_name("protoc-gen-mypy_grpc")
    found = str(plugin) if plugin.is_file() else shutil.which("protoc-gen-mypy_grpc")
    if found is None:
        raise RuntimeError("protoc-gen-mypy_grpc is missing: install the dev extra")
    args = [
        "grpc_tools.protoc",
        f"-I{ROOT}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        f"--plugin=protoc-gen-mypy_grpc={found}",
        f"--mypy_grpc_out={out}",
        str(ROOT / PROTO),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {PROTO}")
    folder = out / PROTO.parent
    return {name: (folder / name).read_bytes() for name in OUTPUTS}


def current() -> dict[str, bytes]:
    """What the proto generates now, made in a temporary folder."""
    with tempfile.TemporaryDirectory() as tmp:
        return generate(Path(tmp))


def main() -> None:
    folder = ROOT / PROTO.parent
    for name, data in current().items():
        (folder / name).write_bytes(data)
        print(f"wrote {PROTO.parent / name}")  # noqa: T201 - a development command


if __name__ == "__main__":
    main()
