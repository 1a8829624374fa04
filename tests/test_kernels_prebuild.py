"""The C++ kernels built before the first request (engine/kernels/prebuild.py): by `splitserve
kernels` (make install), by serve's and a worker's preflight; a failed build stops the start and
says what to install unless the torch path is accepted; a second process on the machine loads
what the first built, and one that arrives during a build waits for it instead of falling back."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from splitserve.engine.kernels.build import BuildOutcome
from splitserve.engine.kernels.prebuild import KernelState, problems, summary
from splitserve.engine.problems import Check

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(os.environ.get("SPLITSERVE_NO_KERNELS", "") not in ("", "0"), reason="kernels disabled"),
]

SPLITSERVE = [sys.executable, "-m", "splitserve.cli"]
NO_COMPILER = "/nonexistent/c++"

# one kernel's build in a process of its own: its outcome, as `name compiled seconds error`
_BUILD_ONE = """
import logging
logging.basicConfig(level=logging.INFO)
from splitserve.engine.kernels.build import load_extension, outcome
load_extension("splitserve_prefill", "prefill.cpp")
o = outcome("splitserve_prefill")
print("outcome", o.compiled, round(o.seconds, 1), repr(o.error[-200:]), flush=True)
"""


def _env(extensions: Path, **more: str) -> dict[str, str]:
    return {**os.environ, "TORCH_EXTENSIONS_DIR": str(extensions), "PYTHONPATH": "src", **more}


def _run(args: list[str], env: dict[str, str], timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout)


def test_a_failed_build_stops_the_start_and_says_what_to_install(tmp_path: Path) -> None:
    env = _env(tmp_path, CXX=NO_COMPILER)
    refused = _run([*SPLITSERVE, "kernels"], env)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    said = refused.stdout
    assert "linear, decode, prefill, quant" in said and NO_COMPILER in said
    assert "apt-get install g++ python3-dev" in said and "--allow-torch-fallback" in said
    accepted = _run([*SPLITSERVE, "kernels", "--allow-torch-fallback"], env)
    assert accepted.returncode == 0, accepted.stdout + accepted.stderr
    assert "kernels ready before the first request: none; on torch: linear: its build failed" in accepted.stdout


def test_serve_refuses_before_ray_starts_when_a_kernel_cannot_be_built(tmp_path: Path) -> None:
    refused = _run([*SPLITSERVE, "serve", "--insecure-internal"], _env(tmp_path, CXX=NO_COMPILER))
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "splitserve serve: kernels that could not be built" in refused.stderr
    assert "apt-get install g++" in refused.stderr
    assert "ray" not in refused.stdout.lower()  # refused in the preflight: nothing was started


def test_a_new_process_on_a_machine_that_built_them_loads_and_never_compiles() -> None:
    """The replacement worker's case: the session built the kernels (conftest), a new process loads."""
    env = {**os.environ, "PYTHONPATH": "src"}
    done = _run([*SPLITSERVE, "kernels"], env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "kernels ready before the first request: linear decode" in done.stdout
    assert "(built earlier, loaded" in done.stdout, done.stdout


def _held_compiler(tmp_path: Path) -> tuple[Path, Path]:
    """A C++ compiler that holds each compile until the test creates `go`: a build the test can
    catch midway, on any machine's speed."""
    go = tmp_path / "go"
    cxx = tmp_path / "held-c++"
    # at most two minutes: a test that fails midway leaves no compiler waiting forever
    wait = f"i=0; while [ ! -e {go} ] && [ $i -lt 2400 ]; do sleep 0.05; i=$((i+1)); done"
    hold = f'case " $* " in *" -c "*) {wait};; esac'
    cxx.write_text(f'#!/bin/sh\n{hold}\nexec c++ "$@"\n')
    cxx.chmod(0o755)
    return cxx, go


def _building(tmp_path: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    """A process inside its build of the prefill kernel, held at the compile."""
    build = subprocess.Popen([sys.executable, "-c", _BUILD_ONE], env=env, stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob("ext/splitserve_prefill-*/*.o.d")) and not list(tmp_path.glob("ext/*/lock")):
        assert time.monotonic() < deadline and build.poll() is None, "the build never reached its compile"
        time.sleep(0.02)  # polls for torch's baton: it exists only while a build runs
    return build


def test_a_second_build_waits_for_the_first_and_loads_what_it_wrote(tmp_path: Path) -> None:
    cxx, go = _held_compiler(tmp_path)
    env = _env(tmp_path / "ext", CXX=str(cxx))
    first = _building(tmp_path, env)
    second = subprocess.Popen(
        [sys.executable, "-c", _BUILD_ONE], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert second.stderr is not None
    waiting = ""
    while "waiting for its build by pid" not in waiting:
        waiting = second.stderr.readline()
        assert waiting, "the second build ended without waiting"
    go.touch()
    first_out, _ = first.communicate(timeout=240)
    second_out, _ = second.communicate(timeout=240)
    assert first_out.split()[:2] == ["outcome", "True"], first_out  # the first compiled
    assert second_out.split()[:2] == ["outcome", "False"], second_out  # the second loaded it, no fallback
    assert second_out.split()[3] == "''"


def test_a_start_after_a_build_killed_midway_proceeds_at_once_and_says_so(tmp_path: Path) -> None:
    cxx, go = _held_compiler(tmp_path)
    env = _env(tmp_path / "ext", CXX=str(cxx))
    killed = _building(tmp_path, env)
    killed.send_signal(signal.SIGKILL)
    killed.wait(timeout=30)
    go.touch()
    t = time.monotonic()
    after = _run([sys.executable, "-c", _BUILD_ONE], env)
    assert after.stdout.split()[:2] == ["outcome", "True"], after.stdout + after.stderr
    assert "a build was killed midway" in after.stderr
    assert time.monotonic() - t < 120  # its own build's time: no waiting out a stale lock


def _state(kernel: str, error: str = "", compiled: bool = True) -> KernelState:
    built = BuildOutcome(f"splitserve_{kernel}", Path("/k"), compiled, 2.0, error)
    return KernelState(kernel, not error, built, f"its build failed: {error}" if error else "")


def test_problems_name_every_failed_kernel_once_and_none_when_accepted() -> None:
    states = [_state("linear"), _state("decode", "x\n/usr/bin/c++: error: bad flag\nninja: build stopped")]
    found = problems(states, allow_fallback=False)
    assert [p.check for p in found] == [Check.KERNELS]
    assert "decode (/usr/bin/c++: error: bad flag)" in found[0].what and "linear" not in found[0].what
    assert problems(states, allow_fallback=True) == []
    assert problems([_state("linear")], allow_fallback=False) == []


def test_the_summary_says_compiled_or_loaded() -> None:
    both = summary([_state("linear"), _state("decode", compiled=False)])
    assert both.endswith("linear decode (1 compiled now, 4.0 s)")
    assert "(built earlier, loaded, 2.0 s)" in summary([_state("linear", compiled=False)])
