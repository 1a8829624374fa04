"""llama.cpp's `llama-server` as a peer: built from the sources that the llama-cpp-python source
package vendors (pip downloads it from PyPI, the only registry this machine reaches), with cmake,
once per version, cached under ~/.cache/splitserve/peer/llama.cpp/<version>; a later run reuses it.

The build is llama.cpp's own Release build for the CPU it runs on (GGML_NATIVE: the compiler's
-march=native, so its kernels take every instruction set the CPU has, as a user's build does);
`BuildInfo.line()` states the version, the compiler, the flags and the CPU's flags for a report's
header. On two cores the build takes twenty to thirty minutes.
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
DEFAULT_ROOT = Path.home() / ".cache" / "splitserve" / "peer" / "llama.cpp"
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=ON",
)


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
    from splitserve.measure.hw import cpu_flags

    root.mkdir(parents=True, exist_ok=True)
    log = root / "build.log"
    spec = f"{PACKAGE}=={version}" if version else PACKAGE
    cached = sorted(root.glob("*/build-info.json"))
    if version:
        cached = [p for p in cached if p.parent.name == version]
    if cached:
        info = BuildInfo(**{**json.loads(cached[-1].read_text()), "cmake_flags": CMAKE_FLAGS})
        if os.path.exists(info.binary):
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
    _run(["cmake", "-S", str(src), "-B", str(build), *CMAKE_FLAGS], log)
    _run(["cmake", "--build", str(build), "--target", "llama-server", "-j", str(jobs or os.cpu_count() or 1)], log)
    binary = build / "bin" / "llama-server"
    if not binary.exists():
        raise BuildError(f"the build left no {binary}; see {log}")
    info = BuildInfo(str(binary), got, _compiler(), CMAKE_FLAGS, cpu_flags())
    (where / "build-info.json").write_text(json.dumps({k: v for k, v in asdict(info).items() if k != "cmake_flags"}))
    return info
