"""Regenerate the vault wire's Python gRPC code from proto/tierkv/v1/vault.proto with grpcio-tools.

    python scripts/gen_proto.py            # rewrite tierkv/wire/_pb/ in place
    python scripts/gen_proto.py --out DIR  # write the same tree under DIR (the staleness test)

The proto is mapped onto the virtual path tierkv/wire/_pb/ so that the generated modules import
each other as `tierkv.wire._pb.*` without any post-processing.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROTO = REPO / "proto" / "tierkv" / "v1" / "vault.proto"
PACKAGE_DIR = Path("tierkv") / "wire" / "_pb"
GENERATED = ("vault_pb2.py", "vault_pb2.pyi", "vault_pb2_grpc.py")


def generate(out_root: Path) -> list[Path]:
    """Write the generated modules under `out_root`/tierkv/wire/_pb and return their paths."""
    from grpc_tools import protoc

    (out_root / PACKAGE_DIR).mkdir(parents=True, exist_ok=True)
    args = [
        "protoc",
        f"-I{PACKAGE_DIR.as_posix()}={PROTO.parent}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        (PACKAGE_DIR / PROTO.name).as_posix(),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {PROTO}")
    return [out_root / PACKAGE_DIR / name for name in GENERATED]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=REPO, help="root to write tierkv/wire/_pb under"
    )
    for path in generate(parser.parse_args().out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
