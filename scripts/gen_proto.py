#!/usr/bin/env python3
"""Regenerate every ``*_pb2.py`` from the ``.proto`` files under ``src/tensorwire/**/_proto/``.

Run with ``make proto``. The generated modules are committed so users need no grpcio-tools.

Post-processing: protoc's Python output calls ``ValidateProtobufRuntimeVersion`` with the generator's version,
which makes the module refuse to import on an older protobuf runtime (GPU images often ship one). The builder
API the generated code uses has been stable since protobuf 4.21, so the check is dropped. gRPC service stubs
are not generated either: tensorwire registers its methods through grpc's generic handlers, which keeps it free
of the ``GRPC_GENERATED_VERSION`` check in ``*_pb2_grpc.py``.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"

_VALIDATE = re.compile(r"^_runtime_version\.ValidateProtobufRuntimeVersion\((?:.|\n)*?\)\n", re.MULTILINE)
_IMPORT = re.compile(r"^from google\.protobuf import runtime_version as _runtime_version\n", re.MULTILINE)


def main() -> int:
    from grpc_tools import protoc  # dev dependency only

    include = Path(protoc.__file__).parent / "_proto"
    protos = sorted(SRC.glob("tensorwire/**/_proto/*.proto"))
    if not protos:
        print("no .proto files found", file=sys.stderr)
        return 1
    for proto in protos:
        rel = proto.relative_to(SRC)
        rc = protoc.main(["protoc", f"-I{SRC}", f"-I{include}", f"--python_out={SRC}", f"--pyi_out={SRC}", str(rel)])
        if rc != 0:
            print(f"protoc failed on {rel}", file=sys.stderr)
            return rc
        out = proto.with_name(proto.stem + "_pb2.py")
        text = _IMPORT.sub("", _VALIDATE.sub("", out.read_text()))
        out.write_text(text)
        print(f"generated {out.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
