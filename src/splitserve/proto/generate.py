"""Regenerate the Python beside the `.proto` files: `python -m splitserve.proto.generate`.

protoc writes imports as the .proto paths say (`from splitserve.v1 import ...`,
`from grpc.health.v1 import ...`); the files live inside the `splitserve.proto`
package, so every import of one of our own generated modules is rewritten to
`splitserve.proto.<path>`. The output is deterministic, and tests/test_proto.py
checks that regenerating changes nothing.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
PACKAGE = "splitserve.proto"


def proto_files(root: Path = PROTO_ROOT) -> list[Path]:
    """Every .proto under root, relative to it, sorted (so output order is stable)."""
    return sorted(p.relative_to(root) for p in root.rglob("*.proto"))


def generated_names(proto: Path) -> list[Path]:
    """The files protoc writes for one .proto (relative paths)."""
    stem = proto.with_suffix("")
    return [Path(f"{stem}_pb2.py"), Path(f"{stem}_pb2.pyi"), Path(f"{stem}_pb2_grpc.py")]


def _fix_imports(text: str, own_modules: set[str]) -> str:
    def repl(m: re.Match[str]) -> str:
        module = f"{m.group(2)}.{m.group(3)}"
        if module in own_modules:
            return f"{m.group(1)}from {PACKAGE}.{m.group(2)} import {m.group(3)}"
        return m.group(0)

    return re.sub(r"^(\s*)from ([\w.]+) import (\w+_pb2(?:_grpc)?)\b", repl, text, flags=re.M)


def generate(out_dir: Path, root: Path = PROTO_ROOT) -> list[Path]:
    """Run protoc on every .proto under root, write into out_dir, return the written paths."""
    import grpc_tools
    from grpc_tools import protoc

    protos = proto_files(root)
    out_dir.mkdir(parents=True, exist_ok=True)
    wkt = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{root}",
        f"-I{wkt}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *(str(p) for p in protos),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed")
    own = {".".join(g.with_suffix("").parts) for p in protos for g in generated_names(p)}
    written = []
    for proto in protos:
        for name in generated_names(proto):
            path = out_dir / name
            path.write_text(_fix_imports(path.read_text(), own))
            written.append(path)
        # every folder on the way must be a package for the imports above
        for parent in [out_dir / d for d in proto.parents if str(d) != "."]:
            init = parent / "__init__.py"
            if not init.exists():
                init.write_text("")
    return written


def main() -> int:
    for path in generate(PROTO_ROOT):
        print(path.relative_to(PROTO_ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
