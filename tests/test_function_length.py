"""No function in the package runs past MAX_LINES lines, from its `def` line to its last: a longer one
is split into named steps that its top reads as a list. The benchmarks (bench/) and protoc's
generated modules (*_pb2*.py) are exempt."""

from __future__ import annotations

import ast
from pathlib import Path

MAX_LINES = 60
PACKAGE = Path(__file__).resolve().parents[1] / "src" / "splitserve"


def _production_modules() -> list[Path]:
    return sorted(
        p for p in PACKAGE.rglob("*.py") if p.relative_to(PACKAGE).parts[0] != "bench" and "_pb2" not in p.name
    )


def _long_functions(source: str, where: str) -> list[str]:
    """`where:line name (n lines)` for each function (nested ones and methods too) over MAX_LINES."""
    found = []
    for node in ast.walk(ast.parse(source, filename=where)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno is not None:
            length = node.end_lineno - node.lineno + 1
            if length > MAX_LINES:
                found.append(f"{where}:{node.lineno} {node.name} ({length} lines)")
    return found


def test_no_production_function_is_longer_than_max_lines():
    long = [
        f
        for path in _production_modules()
        for f in _long_functions(path.read_text(), str(path.relative_to(PACKAGE.parent)))
    ]
    assert not long, f"functions over {MAX_LINES} lines (split them into named steps):\n" + "\n".join(long)


def test_the_check_reads_the_package_but_bench_and_generated_code():
    names = {p.relative_to(PACKAGE).as_posix() for p in _production_modules()}
    assert {"engine/kernels/decode.py", "kv_transfer/receiver.py", "plan/report.py"} <= names
    assert not any(n.startswith("bench/") or "_pb2" in n for n in names)


def test_a_function_is_counted_from_its_def_line_to_its_last_decorators_aside():
    def source(body_lines: int) -> str:
        return "@decorator\nasync def f():\n" + "    x = 1\n" * body_lines

    assert _long_functions(source(MAX_LINES - 1), "m.py") == []
    assert _long_functions(source(MAX_LINES), "m.py") == [f"m.py:2 f ({MAX_LINES + 1} lines)"]
    method = "class C:\n    def g(self):\n" + "        x = 1\n" * MAX_LINES
    assert _long_functions(method, "m.py") == [f"m.py:2 g ({MAX_LINES + 1} lines)"]
