"""Worker processes for the serving benchmarks: start, pin, wait, kill.

A `LocalCluster` is one decode and one prefill worker, each a real process
(`python -m splitserve.workers`) pinned to its own CPU core with `taskset`, in
its own process group so that killing it leaves nothing behind. Every wait has
a deadline; `close` always ends both groups (TERM, then KILL), and any
`CoreLoad` (the ITL benchmark's control: the same prefills in a plain engine,
no serving) started through it.

    with LocalCluster(WorkerArgs(...), cores=(0, 1)) as cluster:
        cluster.decode.grpc_address, cluster.prefill.grpc_address
        cluster.pin(decode_core=1, prefill_core=0)   # swap, all threads
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from splitserve.measure.hw import process_cpu_seconds


class ClusterError(RuntimeError):
    pass


@dataclass(frozen=True)
class WorkerArgs:
    """The flags both workers get, so that both run the same engine."""

    model: str | None = None
    dtype: str = "float32"
    threads: int = 1
    num_blocks: int = 1024
    max_num_batched_tokens: int = 512
    kv_transport: str = "tcp"
    speculative: str = ""  # --speculative (""; the tuned default)

    def flags(self) -> list[str]:
        # no cluster token: both workers listen on loopback, their only caller the benchmark's router
        f = [
            "--dtype",
            self.dtype,
            "--threads",
            str(self.threads),
            "--num-blocks",
            str(self.num_blocks),
            "--max-num-batched-tokens",
            str(self.max_num_batched_tokens),
            "--kv-transport",
            self.kv_transport,
            "--insecure-no-cluster-token",
        ]
        f += ["--speculative", self.speculative] if self.speculative else []
        return f + (["--model", self.model] if self.model else [])


class WorkerProcess:
    def __init__(self, role: str, core: int | None, args: WorkerArgs, workdir: str) -> None:
        self.role = role
        self.core = core
        self.ready_file = os.path.join(workdir, f"{role}.ready")
        self.log_path = os.path.join(workdir, f"{role}.log")
        self.grpc_address = ""
        self.kv_endpoint = ""
        cmd = [
            sys.executable,
            "-m",
            "splitserve.workers",
            "--role",
            role,
            "--grpc-port",
            "0",
            "--kv-port",
            "0",
            "--ready-file",
            self.ready_file,
            *args.flags(),
        ]
        if core is not None:
            cmd = ["taskset", "-c", str(core), *cmd]
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def poll_ready(self) -> bool:
        """True once the ready file is there; raises if the process died first."""
        if os.path.exists(self.ready_file):
            with open(self.ready_file) as f:
                parts = f.read().split()
            self.grpc_address, self.kv_endpoint = parts[0], parts[1]
            return True
        if self.proc.poll() is not None:
            raise ClusterError(
                f"{self.role} worker exited with {self.proc.returncode} before it was ready:\n{self.log_tail()}"
            )
        return False

    def log_tail(self, n: int = 4000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return f.read()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def cpu_seconds(self) -> float | None:
        """User plus system CPU time the worker has used so far (Linux /proc; None elsewhere)."""
        return process_cpu_seconds(self.proc.pid)

    def pin(self, core: int) -> None:
        """Move every thread of the worker to `core` (threads made later inherit it)."""
        subprocess.run(
            ["taskset", "-a", "-p", "-c", str(core), str(self.proc.pid)],
            check=True,
            stdout=subprocess.DEVNULL,
            timeout=10,
        )
        self.core = core

    def kill(self, grace_s: float = 5.0) -> None:
        if self.proc.poll() is None:
            for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(wait_s)
                    break
                except subprocess.TimeoutExpired:
                    continue
        else:  # the leader is gone; anything it started in its group goes too
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self._log.close()


# The control of the ITL benchmark: the prefill worker's work without the serving.
# The same engine, model, dtype, threads and chunk as the workers, prefilling
# `batch` fresh prompts of `prompt_len` tokens over and over (prefix cache off),
# with no gRPC, no router and no KV transfer.
_CORE_LOAD = """
import os, sys, torch
ready, model, dtype, threads, chunk, prompt_len, batch = sys.argv[1:8]
threads, chunk, prompt_len, batch = int(threads), int(chunk), int(prompt_len), int(batch)
torch.set_num_threads(threads)
from splitserve.engine.config import EngineConfig
from splitserve.engine.engine import Engine
from splitserve.engine.sampling import SamplingParams
blocks = batch * (prompt_len // 16 + 2) + 16
cfg = EngineConfig(dtype=dtype, max_num_batched_tokens=chunk, num_blocks=blocks, enable_prefix_caching=False)
engine, _ = Engine.from_path(model or None, cfg, progress=False)
vocab = min(engine.model_cfg.vocab_size, 32000)
g = torch.Generator().manual_seed(0)
params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
open(ready + ".tmp", "w").close()
os.replace(ready + ".tmp", ready)
while True:
    prompts = [torch.randint(vocab // 8, vocab, (prompt_len,), generator=g).tolist() for _ in range(batch)]
    engine.generate(prompts, params)
"""


class CoreLoad:
    """A process doing the prefill worker's compute with no serving at all, for a control measurement."""

    def __init__(self, core: int | None, workdir: str, args: WorkerArgs, prompt_len: int, batch: int) -> None:
        self.ready_file = os.path.join(workdir, f"load-{time.monotonic_ns()}.ready")
        cmd = [
            sys.executable,
            "-c",
            _CORE_LOAD,
            self.ready_file,
            args.model or "",
            args.dtype,
            str(args.threads),
            str(args.max_num_batched_tokens),
            str(prompt_len),
            str(batch),
        ]
        if core is not None:
            cmd = ["taskset", "-c", str(core), *cmd]
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
        )

    def poll_ready(self) -> bool:
        if os.path.exists(self.ready_file):
            return True
        if self.proc.poll() is not None:
            err = self.proc.stderr.read().decode()[-2000:] if self.proc.stderr is not None else ""
            raise ClusterError(f"core load exited with {self.proc.returncode}: {err}")
        return False

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            pass
        if self.proc.stderr is not None:
            self.proc.stderr.close()


def usable_cores() -> list[int]:
    return sorted(os.sched_getaffinity(0))


class LocalCluster:
    """One decode and one prefill worker process; `cores=None` leaves them unpinned."""

    def __init__(self, args: WorkerArgs, cores: tuple[int, int] | None, start_timeout_s: float = 180.0) -> None:
        if cores is not None and shutil.which("taskset") is None:
            cores = None
        self.cores = cores
        self.args = args
        self._tmp = tempfile.TemporaryDirectory(prefix="splitserve-bench-")
        self.workers: list[WorkerProcess] = []
        self.loads: list[CoreLoad] = []
        try:
            self.decode = self._start("decode", cores[0] if cores else None, args)
            self.prefill = self._start("prefill", cores[1] if cores else None, args)
            self._wait_ready(start_timeout_s)
        except BaseException:
            self.close()
            raise

    def _start(self, role: str, core: int | None, args: WorkerArgs) -> WorkerProcess:
        w = WorkerProcess(role, core, args, self._tmp.name)
        self.workers.append(w)
        return w

    def _wait_ready(self, timeout_s: float) -> None:
        end = time.monotonic() + timeout_s
        pending = list(self.workers)
        while pending:
            pending = [w for w in pending if not w.poll_ready()]
            if pending and time.monotonic() > end:
                tails = "\n".join(f"--- {w.role} log:\n{w.log_tail()}" for w in pending)
                raise ClusterError(f"workers not ready within {timeout_s:g}s: {[w.role for w in pending]}\n{tails}")
            time.sleep(0.05)

    def pin(self, decode_core: int, prefill_core: int) -> None:
        if self.cores is None:
            return
        self.decode.pin(decode_core)
        self.prefill.pin(prefill_core)

    def core_load(self, core: int | None, prompt_len: int, batch: int) -> CoreLoad:
        """Start a prefill-without-serving process (killed by `close` at the latest); poll it ready, kill it
        when done."""
        load = CoreLoad(core if self.cores is not None else None, self._tmp.name, self.args, prompt_len, batch)
        self.loads.append(load)
        return load

    def check_alive(self) -> None:
        for w in self.workers:
            if w.proc.poll() is not None:
                raise ClusterError(f"{w.role} worker exited with {w.proc.returncode}:\n{w.log_tail()}")

    def close(self) -> None:
        for load in self.loads:
            load.kill()
        for w in self.workers:
            w.kill()
        self._tmp.cleanup()

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
