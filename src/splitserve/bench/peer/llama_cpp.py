"""llama.cpp's `llama-server` as a peer: built from the sources that the llama-cpp-python source
package vendors (pip downloads it from PyPI, the only registry this machine reaches), with cmake,
once per version, cached under ~/.cache/splitserve/peer/llama.cpp/<version>; a later run reuses it.

The build is llama.cpp's own Release build for the CPU it runs on: each of its instruction-set
options (AVX2, FMA, F16C, AVX-512 and its VNNI, VBMI and BF16 extensions) on where the CPU's flags
list it, as -march=native would, but AMX off: a virtual machine may list amx_* and still trap the
tile instructions (this project's 2-core VM: llama-server died with SIGILL in its AMX Q4_1 kernel),
and splitserve's own kernels do not use AMX either. `BuildInfo.line()` states the version, the
compiler, the flags and the CPU's flags for a report's header. On two cores the build takes twenty
to thirty minutes.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import tarfile
from dataclasses import asdict, dataclass
from pathlib import Path

PACKAGE = "llama-cpp-python"
TARGETS = ("llama-server", "llama-quantize")  # the peer, and the tool that writes its quantized files
DEFAULT_ROOT = Path.home() / ".cache" / "splitserve" / "peer" / "llama.cpp"
BASE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=OFF",
    "-DGGML_AMX_TILE=OFF",
    "-DGGML_AMX_INT8=OFF",
    "-DGGML_AMX_BF16=OFF",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=ON",
)
# llama.cpp's option for each CPU flag it can use
ISA_OPTIONS = (
    ("avx", "GGML_AVX"),
    ("avx2", "GGML_AVX2"),
    ("fma", "GGML_FMA"),
    ("f16c", "GGML_F16C"),
    ("bmi2", "GGML_BMI2"),
    ("avx512f", "GGML_AVX512"),
    ("avx512vbmi", "GGML_AVX512_VBMI"),
    ("avx512_vnni", "GGML_AVX512_VNNI"),
    ("avx512_bf16", "GGML_AVX512_BF16"),
)


def cmake_flags(cpu_flags: set[str]) -> tuple[str, ...]:
    """The build's cmake options on a CPU with `cpu_flags` (/proc/cpuinfo's names)."""
    return BASE_FLAGS + tuple(f"-D{option}={'ON' if flag in cpu_flags else 'OFF'}" for flag, option in ISA_OPTIONS)


class BuildError(RuntimeError):
    pass


@dataclass(frozen=True)
class BuildInfo:
    binary: str
    version: str  # the llama-cpp-python release whose vendored llama.cpp was built
    compiler: str
    cmake_flags: tuple[str, ...]
    cpu_flags: str

    def line(self) -> str:
        return (
            f"llama.cpp vendored by {PACKAGE} {self.version}, {self.compiler}, cmake {' '.join(self.cmake_flags)}; "
            f"CPU flags {self.cpu_flags}"
        )


def _run(argv: list[str], log: Path, cwd: Path | None = None) -> None:
    with open(log, "ab") as f:
        f.write(f"$ {' '.join(argv)}\n".encode())
        f.flush()
        rc = subprocess.run(argv, cwd=cwd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL).returncode
    if rc != 0:
        raise BuildError(f"{' '.join(argv[:3])} ... exited with {rc}; see {log}")


def _compiler() -> str:
    cxx = shutil.which("c++") or shutil.which("g++") or "c++"
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=False).stdout
    except OSError:
        return cxx
    return out.splitlines()[0] if out else cxx


def ensure_llama_server(root: Path = DEFAULT_ROOT, version: str = "", jobs: int = 0) -> BuildInfo:
    """llama-server built from the newest (or `version`'s) llama-cpp-python sdist; cached by version."""
    from splitserve.engine.tuned import cpu_flags as flag_set
    from splitserve.measure.hw import cpu_flags

    flags = cmake_flags(set(flag_set()))
    root.mkdir(parents=True, exist_ok=True)
    log = root / "build.log"
    spec = f"{PACKAGE}=={version}" if version else PACKAGE
    cached = sorted(root.glob("*/build-info.json"))
    if version:
        cached = [p for p in cached if p.parent.name == version]
    for path in reversed(cached):  # a build for this CPU's options, still there
        info = BuildInfo(**{**json.loads(path.read_text())})
        info = BuildInfo(info.binary, info.version, info.compiler, tuple(info.cmake_flags), info.cpu_flags)
        if info.cmake_flags == flags and all(os.path.exists(_tool(info, t)) for t in TARGETS):
            return info
    downloads = root / "sdist"
    downloads.mkdir(exist_ok=True)
    if not list(downloads.glob("llama_cpp_python-*.tar.gz")) or version:
        pip = [sys.executable, "-m", "pip", "download", spec, "--no-binary", ":all:", "--no-deps", "-d", str(downloads)]
        _run(pip, log)
    tars = sorted(glob.glob(str(downloads / f"llama_cpp_python-{version or '*'}.tar.gz")))
    if not tars:
        raise BuildError(f"pip found no source package of {spec}")
    tar = Path(tars[-1])
    got = tar.name.removeprefix("llama_cpp_python-").removesuffix(".tar.gz")
    where = root / got
    src = where / f"llama_cpp_python-{got}" / "vendor" / "llama.cpp"
    if not src.exists():
        with tarfile.open(tar) as t:
            t.extractall(where, filter="data")
    build = src / "build"
    _run(["cmake", "-S", str(src), "-B", str(build), *flags], log)
    _run(["cmake", "--build", str(build), "--target", *TARGETS, "-j", str(jobs or os.cpu_count() or 1)], log)
    binary = build / "bin" / "llama-server"
    if not binary.exists():
        raise BuildError(f"the build left no {binary}; see {log}")
    info = BuildInfo(str(binary), got, _compiler(), flags, cpu_flags())
    (where / "build-info.json").write_text(json.dumps(asdict(info)))
    return info


def _tool(info: BuildInfo, name: str) -> str:
    """One of the build's programs (TARGETS), beside its llama-server."""
    return os.path.join(os.path.dirname(info.binary), name)


def requantize(source: str, fmt: str, out: Path, info: BuildInfo) -> Path:
    """`source` (a GGUF file) rewritten by llama.cpp's own llama-quantize in `fmt` (Q8_0, Q4_K_M,
    ...): the file a llama.cpp user would make, with its fallbacks (a K-quant needs rows of 256
    columns; SmolLM2's 576 fall back to Q5_0 and Q8_0). Kept at `out`; a later call reuses it."""
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    part = out.with_suffix(".part")
    _run([_tool(info, "llama-quantize"), "--allow-requantize", source, str(part), fmt], out.with_suffix(".log"))
    part.rename(out)
    return out
