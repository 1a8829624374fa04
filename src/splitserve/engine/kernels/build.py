"""JIT build of the C++ kernels in this folder, at first use.

`load_extension` compiles one source file with torch.utils.cpp_extension and
imports it; the result is cached on disk, so only the first process on a
machine pays the compile (about 20 s). The build directory is
$TORCH_EXTENSIONS_DIR or ~/.cache/splitserve/kernels, one subfolder per
extension, torch version and Python version: an extension built against one
torch must never be loaded by another.

One build of a folder at a time on a machine: an `fcntl.flock` taken around
torch's build (`_build_turn`). The kernel releases it the moment its holder
exits, however it exits, so a build killed midway holds nobody up: the next
process takes the turn at once, removes the lock file torch's own baton left
behind (which no live build can own while the flock is held) and says so. A
process that finds the turn taken says whose it is and waits for it, rather
than loading a library that is not written yet.

A build that fails is not an error for the caller: it gets None and one
warning, and runs the plain torch path instead. What each build in this
process came to is kept (`outcome`), so that a preflight (kernels/prebuild.py)
can say what it built and refuse to start on a failed one.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import platform
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

_HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class BuildOutcome:
    """How one extension's load went in this process."""

    name: str
    folder: Path
    compiled: bool  # compiled now (else its library was already on disk and only loaded)
    seconds: float
    error: str = ""  # why it could not be built or loaded ("" when it was)


# extension name -> its outcome in this process: written once per name, under that kernel's Once
_OUTCOMES: dict[str, BuildOutcome] = {}


def outcome(name: str) -> BuildOutcome | None:
    """What loading extension `name` came to in this process (None: not tried yet)."""
    return _OUTCOMES.get(name)


def build_root() -> Path:
    env = os.environ.get("TORCH_EXTENSIONS_DIR")
    return Path(env) if env else Path.home() / ".cache" / "splitserve" / "kernels"


def build_dir(name: str, source: Path | None = None) -> Path:
    """One folder per (kernel, torch, Python, source text, torch's install). The source's hash is
    in the name because ninja decides by file times alone: a checkout whose older source is newer
    on disk (a fresh clone) would otherwise load a binary built from other code. Torch's install
    (its venv) is in it because the build's command names torch's headers by path: two venvs
    sharing one folder would rebuild each other's library at every start."""
    py = f"py{sys.version_info.major}{sys.version_info.minor}"
    tag = ""
    if source is not None:
        key = source.read_bytes() + os.path.dirname(torch.__file__).encode()
        tag = f"-{hashlib.sha256(key).hexdigest()[:12]}"
    return build_root() / f"{name}-torch{torch.__version__}-{py}{tag}".replace("+", "_")


def _ensure_ninja_on_path() -> None:
    """torch builds with ninja from PATH; the `ninja` wheel puts it beside the venv's python."""
    if shutil.which("ninja"):
        return
    candidates = [Path(sys.executable).parent]
    try:
        import ninja

        candidates.insert(0, Path(ninja.BIN_DIR))
    except (ImportError, AttributeError):
        pass
    for folder in candidates:
        if (folder / "ninja").exists():
            os.environ["PATH"] = f"{folder}{os.pathsep}{os.environ.get('PATH', '')}"
            return


def _staged(folder: Path, source: Path) -> Path:
    """The source, copied once into its build folder (whose name holds the text's hash) and built
    from there: ninja keys its build on the source's path and time, so two checkouts of the same
    text (a fresh clone beside a working tree) built from where they lie would rebuild each
    other's library on every start, each under the turn. Called inside the turn."""
    staged = folder / source.name
    if not staged.exists():
        partial = staged.with_suffix(".partial")
        shutil.copyfile(source, partial)
        partial.replace(staged)
    return staged


@contextlib.contextmanager
def _build_turn(folder: Path, name: str) -> Iterator[None]:
    """This process's turn to build (or load) `folder`'s extension; see the module's docstring."""
    path = folder / "splitserve-build.lock"
    with open(path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "another process"
            log.info("kernel %s: waiting for its build by %s to end (%s)", name, holder, path)
            fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()}")
        f.flush()
        baton = folder / "lock"
        if baton.exists():
            log.warning("kernel %s: a build was killed midway; removing the lock it left (%s)", name, baton)
            baton.unlink(missing_ok=True)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def load_extension(name: str, source: str | Path, fallback: str = "torch's F.linear") -> ModuleType | None:
    """Compile (if needed) and import `source` (a file in this folder, or a path) as module `name`.

    Returns None, after one warning naming `fallback` (what the caller runs
    instead), when the platform is not x86-64 Linux or the compile or import fails.
    """
    if sys.platform != "linux" or platform.machine().lower() not in ("x86_64", "amd64"):
        log.warning(
            "splitserve kernels need x86-64 Linux (this is %s %s); using %s", sys.platform, platform.machine(), fallback
        )
        return None
    folder = build_dir(name, _HERE / source)
    started = time.perf_counter()
    compiled = True  # until the load says whether it wrote the library
    try:
        from torch.utils import cpp_extension

        folder.mkdir(parents=True, exist_ok=True)
        _ensure_ninja_on_path()
        with _build_turn(folder, name):
            library = folder / f"{name}.so"
            before = library.stat().st_mtime_ns if library.exists() else None
            module = cpp_extension.load(
                name=name,
                sources=[str(_staged(folder, _HERE / source))],  # an absolute `source` stays as it is
                # The ISA-specific code is selected with `#pragma GCC target` inside
                # the source, so the binary is the same on every x86-64 machine and
                # no -march=native result can leak between hosts sharing a home.
                extra_cflags=["-O3", "-fopenmp", "-DNDEBUG"],
                # -fopenmp links libgomp.so.1, which resolves to the copy torch
                # already loaded: one OpenMP runtime, one thread pool.
                extra_ldflags=["-fopenmp"],
                build_directory=str(folder),
                verbose=False,
            )
            compiled = before is None or library.stat().st_mtime_ns != before
    except Exception as exc:  # a compiler, ninja or loader failure of any kind
        detail = str(exc).strip()
        log.warning("could not build kernel %s in %s; using %s. %s", name, folder, fallback, detail[-2000:])
        _OUTCOMES[name] = BuildOutcome(name, folder, compiled, time.perf_counter() - started, detail or repr(exc))
        return None
    elapsed = time.perf_counter() - started
    _OUTCOMES[name] = BuildOutcome(name, folder, compiled, elapsed)
    if compiled:
        log.info("built kernel %s in %.1f s (%s)", name, elapsed, folder)
    return module


def passes_self_test(what: str, self_test: Callable[[], bool], fallback: str) -> bool:
    """A freshly built binary's check against torch before it computes anything real: False, after one
    warning naming `fallback`, when it disagrees or raises (a binary that does not even take our
    arguments is no better than a wrong one)."""
    try:
        ok = self_test()
    except Exception as e:
        log.warning("%s failed its self-test (%s); using %s", what, e, fallback)
        return False
    if not ok:
        log.warning("%s disagrees with torch on its self-test; using %s", what, fallback)
    return ok
