"""Every C++ kernel a CPU worker runs, built before the first request.

A kernel is built (or loaded from its cache, kernels/build.py) the first time it
is called. Left at that, the first call was a request's: the first process on a
machine compiled for about 20 s (45 s on a busy one) inside some request's
TTFT, a replacement worker could compile again while its clients waited, and a
build that failed fell back to torch with one warning in a worker's log, so a
user could run at half speed without knowing it.

`prepare` builds them all now, in the calling process: `make install` runs it
(`splitserve kernels`), `splitserve serve` and `splitserve worker` run it in
their preflight before any worker starts, and each worker runs it again before
it says it is ready, which on a machine that has built them only loads the
libraries (milliseconds). A build that fails is a `Problem` that stops the
start and says what to install, unless the operator passed
--allow-torch-fallback: then the torch path runs, knowingly.
SPLITSERVE_NO_KERNELS=1 chooses the torch path outright and is not a problem.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from splitserve.engine.kernels.build import BuildOutcome, build_root, outcome
from splitserve.engine.problems import Check, Problem

FALLBACK_FLAG = "--allow-torch-fallback"


@dataclass(frozen=True)
class KernelState:
    """One kernel after `prepare`: in use, or why not."""

    kernel: str  # linear, decode, prefill, quant
    ready: bool  # the workers of this machine will run it
    built: BuildOutcome | None  # how its library was built or loaded (None: no build was tried)
    why_not: str = ""  # "" when ready


def _kernels() -> dict[str, tuple[str, Callable[[], bool]]]:
    """kernel -> (its extension's name, a call that builds or loads it and says whether it runs here)."""
    from splitserve.engine.kernels import decode, linear, prefill, quant

    return {
        "linear": ("splitserve_linear", linear.kernel_available),
        "decode": ("splitserve_decode", lambda: decode.decode_kernels() is not None),
        "prefill": ("splitserve_prefill", prefill.prefill_kernel_available),
        "quant": ("splitserve_quant", quant.available),
    }


def prepare() -> list[KernelState]:
    """Build (or load) every CPU kernel in this process, one state each, in a fixed order."""
    from splitserve.engine.kernels.linear import DISABLE_ENV, kernels_disabled

    states = []
    for kernel, (extension, runs_here) in _kernels().items():
        ready = runs_here()
        built = outcome(extension)
        if ready:
            states.append(KernelState(kernel, True, built))
        elif kernels_disabled() and kernel != "quant":  # the quantized kernel is the weights' format, not a choice
            states.append(KernelState(kernel, False, built, f"{DISABLE_ENV} is set"))
        elif built is None:
            states.append(KernelState(kernel, False, None, "no kernels for this platform (x86-64 Linux only)"))
        elif built.error:
            states.append(KernelState(kernel, False, built, f"its build failed: {_reason(built.error)}"))
        else:
            states.append(KernelState(kernel, False, built, "no path for this CPU, or its self-test failed"))
    return states


def _reason(error: str) -> str:
    """The line of a build's output that says why it failed: the compiler's first error, else the
    last line (torch's message ends with ninja's "build stopped", which says nothing)."""
    lines = [line.strip() for line in error.splitlines() if line.strip()]
    telling = [line for line in lines if any(w in line for w in ("error:", "not found", "No such file", "fatal"))]
    return (telling or lines or ["unknown error"])[0][:300]


def problems(states: Sequence[KernelState], allow_fallback: bool) -> list[Problem]:
    """One problem naming every kernel whose build failed (the one state that keeps a start from
    going on), unless the torch path was accepted."""
    failed = [(s.kernel, s.built.error) for s in states if s.built is not None and s.built.error]
    if allow_fallback or not failed:
        return []
    names = ", ".join(kernel for kernel, _ in failed)
    return [
        Problem(
            Check.KERNELS,
            f"kernels that could not be built in {build_root()}: {names} ({_reason(failed[0][1])})",
            "install a C++ compiler and Python's headers (Debian: apt-get install g++ python3-dev), then start "
            f"again; or pass {FALLBACK_FLAG} to run torch's slower path for them knowingly",
        )
    ]


def summary(states: Sequence[KernelState]) -> str:
    """One line: which kernels are in use and whether this process compiled or loaded them."""
    ready = [s for s in states if s.ready]
    line = f"kernels ready before the first request: {' '.join(s.kernel for s in ready) or 'none'}"
    if ready:
        compiled = [s for s in ready if s.built is not None and s.built.compiled]
        seconds = sum(s.built.seconds for s in ready if s.built is not None)
        line += f" ({len(compiled)} compiled now" if compiled else " (built earlier, loaded"
        line += f", {seconds:.1f} s)"
    off = "; ".join(f"{s.kernel}: {s.why_not}" for s in states if not s.ready)
    return f"{line}; on torch: {off}" if off else line


def preflight(device: str, allow_fallback: bool, say: Callable[[str], None]) -> list[Problem]:
    """serve's and a worker's check before any worker starts: on a CPU, every kernel built (or
    loaded) now and said in one line; the problems of a failed build. A GPU's kernels are Triton's,
    compiled by Triton on the device."""
    if device.startswith("cuda"):
        return []
    states = prepare()
    say(summary(states))
    return problems(states, allow_fallback)


def add_argument(p: argparse._ActionsContainer) -> None:
    p.add_argument(
        FALLBACK_FLAG,
        action="store_true",
        help="start even if a C++ kernel cannot be built here: its work runs on torch, about half as fast "
        "(by default a failed build stops the start and says what to install)",
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`splitserve kernels`: build them now (make install runs it)."""
    add_argument(p)


def run(a: argparse.Namespace) -> int:
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    root = build_root()
    found = preflight("cpu", a.allow_torch_fallback, lambda line: print(f"splitserve: {line} [{root}]", flush=True))
    for problem in found:
        print(f"splitserve kernels: {problem.line()}", flush=True)
    return 2 if found else 0
