"""Each system under test as processes: start, wait until it serves, stop.

A system is one or more server processes, each the leader of its own process
group (so that stopping it also ends whatever it forked: vLLM's engine core,
a worker's compile jobs), each logging to its own file. Every wait has a
deadline; `stop` sends TERM to the group, then KILL.

- `vllm`: vLLM's OpenAI API server from its own venv, its OpenMP threads bound
  to the cores given (VLLM_CPU_OMP_THREADS_BIND).
- `llamacpp`: llama.cpp's llama-server (llama_cpp.py builds it) on the GGUF file itself,
  a thread per core given (taskset), four slots with continuous batching.
- `colocated`: one splitserve worker per core, each doing prefill and decode,
  behind one router in mode colocated.
- `disaggregated`, `auto`: a prefill and a decode worker, each owning half of
  the cores, behind a router in that mode.

With core lending (the default, as `splitserve serve` runs) every splitserve
worker may run on all the cores and shares a lease file (engine/core_lease.py):
each owns its share of threads, and a prefill step borrows the shares of the
workers that are idle. Without it each worker is pinned to its share.

The routers and vLLM's API front end run unpinned: each system's model compute
gets the same cores, the HTTP work around it floats.

The argv and environment of every process are pure functions of frozen specs,
so the tests check them without starting anything.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

SPLITSERVE_SYSTEMS = ("colocated", "disaggregated", "auto")
PEERS = ("vllm", "llamacpp")
SYSTEMS = (*PEERS, *SPLITSERVE_SYSTEMS)


class ServerError(RuntimeError):
    pass


@dataclass(frozen=True)
class SystemSpec:
    """One system to benchmark and the extra flags it runs with."""

    name: str  # one of SYSTEMS, or a variant of one: "auto:budget" (`kind`, then a label)
    # vllm: appended to the API server's argv; splitserve: to each worker's (engine flags)
    flags: tuple[str, ...] = ()
    router_flags: tuple[str, ...] = ()  # splitserve only: appended to the router's argv

    def __post_init__(self) -> None:
        if self.kind not in SYSTEMS:
            raise ValueError(f"unknown system {self.name!r}; expected one of {', '.join(SYSTEMS)} (or KIND:LABEL)")

    @property
    def kind(self) -> str:
        """The system a variant runs: two variants of one system, side by side in one run, differ
        only by the flags --system-flags gives each."""
        return system_kind(self.name)

    @property
    def is_vllm(self) -> bool:
        return self.kind == "vllm"

    @property
    def is_peer(self) -> bool:
        """Not splitserve: one server process given every core."""
        return self.kind in PEERS


def system_kind(name: str) -> str:
    """The system a name runs: auto:budget runs auto."""
    return name.partition(":")[0]


@dataclass(frozen=True)
class LaunchContext:
    """What every system is started with: the same model directory, cores and limits."""

    model_dir: str  # the HF directory both systems load (hf_export.py)
    served_model_name: str
    workdir: str  # logs and ready files
    vllm_python: str = ""  # the vLLM venv's interpreter
    dtype: str = "bfloat16"  # vLLM's --dtype: the same as splitserve's, so both compute alike
    lend_cores: bool = True  # splitserve's workers share a core lease (as splitserve serve runs them)
    cores: tuple[int, ...] | None = None  # None: nothing is pinned
    kv_cache_gib: int = 4  # vLLM's KV cache (VLLM_CPU_KVCACHE_SPACE)
    max_model_len: int = 4096
    host: str = "127.0.0.1"
    gguf: str = ""  # the GGUF file llama-server loads
    llama_server: str = ""  # its binary (llama_cpp.ensure_llama_server)
    llamacpp_slots: int = 4  # llama-server's parallel sequences (-np), its context shared among them
    # what splitserve's workers and router load ("": model_dir, the HF export vLLM loads; the GGUF
    # file for a comparison with llama.cpp on its own file, its blocks computed in place)
    splitserve_model: str = ""
    start_timeout_s: float = 600.0  # vLLM takes ~2.5 min to start on a 2-core machine
    stop_grace_s: float = 15.0


@dataclass(frozen=True)
class Placement:
    """Cores of each model-computing process of a system; None: unpinned."""

    server: tuple[int, ...] | None = None  # vllm's OpenMP threads
    workers: tuple[tuple[str, tuple[int, ...] | None], ...] = ()  # splitserve: (role, cores) per worker
    lend: bool = False  # splitserve: every worker may run on all the cores, owning `share` of them

    @property
    def share(self) -> int:
        """Each worker's own threads when the cores are lent: an equal part of them."""
        cores = self.workers[0][1] if self.workers else None
        return max(1, len(cores) // len(self.workers)) if cores else 1

    def cores_of(self, role: str) -> list[tuple[int, ...] | None]:
        return [cores for r, cores in self.workers if r == role]


def placement(system: str, cores: tuple[int, ...] | None, lend: bool = False) -> Placement:
    """vLLM gets every core. Colocated splitserve runs one worker per core, each doing prefill and
    decode behind one router: on a CPU a decode step at a few sequences gains little from a second
    thread, so two single-threaded workers serve more than one two-threaded one (ShareGPT at
    concurrency 4: TPOT p50 69 ms on one worker with two threads). A prefill/decode pair splits
    the cores in halves (one core each on a 2-core machine). Unpinned (or fewer than two cores
    for a pair): one worker per role, unpinned. `lend`: the same workers, each allowed on every core
    and owning an equal share of them, a prefill borrowing the idle ones (splitserve serve's way)."""
    pair = system in ("disaggregated", "auto")
    if cores is None or not cores or (pair and len(cores) < 2):
        if system in PEERS:
            return Placement()
        return Placement(workers=(("decode", None), ("prefill", None)) if pair else (("decode", None),))
    if system in PEERS:
        return Placement(server=cores)
    if lend:
        roles = ("decode",) * len(cores) if system == "colocated" else ("decode", "prefill")
        return Placement(workers=tuple((role, cores) for role in roles), lend=True)
    if system == "colocated":
        return Placement(workers=tuple(("decode", (c,)) for c in cores))
    half = len(cores) // 2
    return Placement(workers=(("decode", cores[half:]), ("prefill", cores[:half])))


def core_list(cores: tuple[int, ...]) -> str:
    """taskset's and vLLM's spelling: "0,1,2"."""
    return ",".join(str(c) for c in cores)


def last_flag(argv: tuple[str, ...] | list[str], flag: str) -> str | None:
    """The value of the last `flag V` / `flag=V` in argv (argparse lets the last one win)."""
    value = None
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif a.startswith(flag + "="):
            value = a.split("=", 1)[1]
    return value


# ---- argv and environment: pure ------------------------------------------------------------------


def vllm_argv(spec: SystemSpec, ctx: LaunchContext, port: int) -> list[str]:
    # `python -m`: the venv's `vllm` console script fails, the distribution is named vllm_cpu
    return [
        ctx.vllm_python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        ctx.model_dir,
        "--served-model-name",
        ctx.served_model_name,
        "--dtype",
        ctx.dtype,
        "--max-model-len",
        str(ctx.max_model_len),
        "--host",
        ctx.host,
        "--port",
        str(port),
        *spec.flags,
    ]


def llamacpp_argv(spec: SystemSpec, ctx: LaunchContext, port: int, cores: tuple[int, ...] | None) -> list[str]:
    """llama-server in its defaults but for what a comparison must fix: the file, every core given
    as a thread, --llamacpp-slots sequences at once, each with the context splitserve allows."""
    threads = len(cores) if cores is not None else len(os.sched_getaffinity(0))
    cmd = [
        ctx.llama_server,
        "--model",
        ctx.gguf,
        "--alias",
        ctx.served_model_name,
        "--host",
        ctx.host,
        "--port",
        str(port),
        "--threads",
        str(threads),
        "--threads-batch",
        str(threads),
        "--parallel",
        str(ctx.llamacpp_slots),
        "--ctx-size",
        str(ctx.llamacpp_slots * ctx.max_model_len),
        *spec.flags,
    ]
    return ["taskset", "-c", core_list(cores), *cmd] if cores is not None else cmd


def vllm_env(base: Mapping[str, str], ctx: LaunchContext, cores: tuple[int, ...] | None) -> dict[str, str]:
    env = dict(base)
    env["VLLM_CPU_KVCACHE_SPACE"] = str(ctx.kv_cache_gib)
    if cores is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = core_list(cores)
    # offline and quiet: the model is a local directory, and the run must not phone home
    env |= {"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    return env


def worker_argv(
    role: str,
    spec: SystemSpec,
    ctx: LaunchContext,
    cores: tuple[int, ...] | None,
    ready_file: str,
    lease: tuple[str, int] | None = None,
) -> list[str]:
    """`lease`: the core lease's file and this worker's share of threads (None: one thread per pinned
    core); a --threads in spec.flags comes later and wins."""
    threads = str(lease[1] if lease else len(cores) if cores is not None else 0)
    lending = ["--core-lease", lease[0], "--lease-cores", str(len(cores) if cores else 0)] if lease else []
    cmd = [
        sys.executable,
        "-m",
        "splitserve.workers",
        "--role",
        role,
        "--host",
        ctx.host,
        "--grpc-port",
        "0",
        "--kv-port",
        "0",
        "--ready-file",
        ready_file,
        "--model",
        ctx.splitserve_model or ctx.model_dir,
        "--threads",
        threads,
        *lending,
        *spec.flags,
    ]
    return ["taskset", "-c", core_list(cores), *cmd] if cores is not None else cmd


def router_argv(
    spec: SystemSpec, ctx: LaunchContext, decode: list[str], prefill: list[str], http_port: int
) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "splitserve.cli",
        "router",
        "--model",
        ctx.splitserve_model or ctx.model_dir,
        "--mode",
        spec.kind,
        "--host",
        ctx.host,
        "--grpc-port",
        "0",
        "--http-port",
        str(http_port),
        "--metrics-port",
        "0",
    ]
    for address in decode:
        cmd += ["--decode", address]
    for address in prefill:
        cmd += ["--prefill", address]
    block_size = last_flag(spec.flags, "--block-size")
    if block_size is not None:  # the router hashes prompts into the workers' blocks
        cmd += ["--block-size", block_size]
    return cmd + list(spec.router_flags)


def splitserve_env(base: Mapping[str, str], cluster_token: str) -> dict[str, str]:
    # by environment, not argv: a token on the command line is visible to every user of the machine
    return dict(base) | {"SPLITSERVE_CLUSTER_TOKEN": cluster_token}


def cores_used(spec: SystemSpec, where: Placement) -> dict[str, Any]:
    """What the system computed on: per process its pinned cores (None: unpinned) and threads."""
    procs: dict[str, dict[str, Any]] = {}
    if spec.is_peer:
        threads = len(where.server) if where.server is not None else None
        procs = {"server": {"cores": _listed(where.server), "threads": threads}}
    else:
        flag = last_flag(spec.flags, "--threads")
        for name, (_, cores) in zip(worker_names(where), where.workers, strict=True):
            own = where.share if where.lend else len(cores) if cores is not None else 0
            threads = int(flag) if flag is not None else own
            procs[name] = {"cores": _listed(cores), "threads": threads or None}
    pinned = sorted({c for p in procs.values() for c in (p["cores"] or [])})
    any_unpinned = any(p["cores"] is None for p in procs.values())
    total = len(os.sched_getaffinity(0)) if any_unpinned else len(pinned)
    return {"total": total, "pinned": not any_unpinned, "processes": procs, "lend": where.lend}


def worker_names(where: Placement) -> list[str]:
    """ "decode", "prefill"; numbered where a role has several workers ("decode0", "decode1")."""
    roles = [role for role, _ in where.workers]
    seen: dict[str, int] = {}
    names = []
    for role in roles:
        i = seen.get(role, 0)
        seen[role] = i + 1
        names.append(f"{role}{i}" if roles.count(role) > 1 else role)
    return names


def _listed(cores: tuple[int, ...] | None) -> list[int] | None:
    return list(cores) if cores is not None else None


def describe_cores(name: str, used: Mapping[str, Any]) -> str:
    """One line: `disaggregated: 2 cores: prefill core 0 (1 thread), decode core 1 (1 thread)`."""
    parts = []
    for proc, p in used["processes"].items():
        where = f"cores {core_list(tuple(p['cores']))}" if p["cores"] is not None else "unpinned"
        threads = f"{p['threads']} threads" if p["threads"] else "default threads"
        parts.append(f"{proc} {where} ({threads})")
    lent = "; a step borrows the idle cores (core lease)" if used.get("lend") else ""
    return f"{name}: {used['total']} cores: " + ", ".join(parts) + lent


# ---- processes ----------------------------------------------------------------------------------


class ServerProcess:
    """One server process, leader of its own process group, logging to a file."""

    def __init__(self, name: str, argv: list[str], env: Mapping[str, str], log_path: str) -> None:
        self.name = name
        self.argv = argv
        self.log_path = log_path
        self._log = open(log_path, "ab")
        self.proc = subprocess.Popen(
            argv,
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def check_alive(self) -> None:
        if not self.alive():
            raise ServerError(f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")

    def log_tail(self, n: int = 4000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, os.path.getsize(self.log_path) - n))
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def stop(self, grace_s: float = 15.0) -> None:
        """TERM to the group, up to grace_s for it to go, then KILL. The group is killed even when
        the leader is already gone, since what it started may not be."""
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                break
            if _wait_group_gone(self.proc, wait_s):
                break
        try:
            self.proc.wait(5.0)
        except subprocess.TimeoutExpired:
            pass
        self._log.close()


def _wait_group_gone(proc: subprocess.Popen[bytes], timeout_s: float) -> bool:
    """True once no process of the group proc leads is left (the leader reaped)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        proc.poll()  # reap the leader, else it lingers as a zombie in its group
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        time.sleep(0.05)
    return False


def free_port(host: str = "127.0.0.1") -> int:
    # Racy in principle (someone may take it before the server binds); the servers here report
    # a failed bind by exiting, which the start wait turns into an error naming the log.
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def wait_until(ready: Callable[[], bool], timeout_s: float, watched: list[ServerProcess], what: str) -> float:
    """Poll `ready` until true; raises when a watched process dies or the deadline passes.
    Returns the seconds it took."""
    start = time.monotonic()
    while not ready():
        for p in watched:
            p.check_alive()
        if time.monotonic() - start > timeout_s:
            tails = "\n".join(f"--- {p.name} ({p.log_path}):\n{p.log_tail()}" for p in watched)
            raise ServerError(f"{what}: not ready within {timeout_s:g}s\n{tails}")
        time.sleep(0.2)
    return time.monotonic() - start


def http_ok(url: str, timeout_s: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return bool(r.status == 200)
    except (urllib.error.URLError, OSError):  # refused while starting, 503 until a worker is up
        return False


@dataclass
class RunningSystem:
    spec: SystemSpec
    base_url: str
    processes: list[ServerProcess]
    cores: dict[str, Any]
    start_s: float = 0.0
    argv: dict[str, list[str]] = field(default_factory=dict)

    def check_alive(self) -> None:
        for p in self.processes:
            p.check_alive()

    def stop(self, grace_s: float = 15.0) -> None:
        # the front end first, so no request reaches a worker that is going away
        for p in reversed(self.processes):
            p.stop(grace_s)

    def __enter__(self) -> RunningSystem:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_system(spec: SystemSpec, ctx: LaunchContext) -> RunningSystem:
    """Start the system and wait until it serves (its /health answers 200)."""
    os.makedirs(ctx.workdir, exist_ok=True)
    cores = ctx.cores if ctx.cores is not None and shutil.which("taskset") else None
    where = placement(spec.kind, cores, lend=ctx.lend_cores)
    started: list[ServerProcess] = []
    t0 = time.monotonic()
    try:
        if spec.is_vllm:
            base_url = _start_vllm(spec, ctx, where, started)
        elif spec.is_peer:
            base_url = _start_llamacpp(spec, ctx, where, started)
        else:
            base_url = _start_splitserve(spec, ctx, where, started)
    except BaseException:
        for p in reversed(started):
            p.stop(ctx.stop_grace_s)
        raise
    return RunningSystem(
        spec, base_url, started, cores_used(spec, where), time.monotonic() - t0, {p.name: p.argv for p in started}
    )


def _start_vllm(spec: SystemSpec, ctx: LaunchContext, where: Placement, started: list[ServerProcess]) -> str:
    port = free_port(ctx.host)
    argv = vllm_argv(spec, ctx, port)
    server = ServerProcess("vllm", argv, vllm_env(os.environ, ctx, where.server), _log(ctx, "vllm"))
    started.append(server)
    base_url = f"http://{ctx.host}:{port}"
    wait_until(lambda: http_ok(base_url + "/health"), ctx.start_timeout_s, started, "vllm")
    return base_url


def _start_llamacpp(spec: SystemSpec, ctx: LaunchContext, where: Placement, started: list[ServerProcess]) -> str:
    if not (ctx.llama_server and ctx.gguf):
        raise ServerError("llamacpp needs the llama-server binary and a GGUF file (LaunchContext.llama_server, .gguf)")
    port = free_port(ctx.host)
    argv = llamacpp_argv(spec, ctx, port, where.server)
    server = ServerProcess("llamacpp", argv, dict(os.environ), _log(ctx, "llamacpp"))
    started.append(server)
    base_url = f"http://{ctx.host}:{port}"
    wait_until(lambda: http_ok(base_url + "/health"), ctx.start_timeout_s, started, "llamacpp")
    return base_url


def _start_splitserve(spec: SystemSpec, ctx: LaunchContext, where: Placement, started: list[ServerProcess]) -> str:
    env = splitserve_env(os.environ, secrets.token_urlsafe(24))  # a fresh control-plane credential per system
    ready: dict[str, tuple[str, str]] = {}  # worker name -> (role, ready file)
    lease = (f"/dev/shm/splitserve-peer-{spec.kind}-{secrets.token_hex(4)}", where.share) if where.lend else None
    for name, (role, cores) in zip(worker_names(where), where.workers, strict=True):
        path = os.path.join(ctx.workdir, f"{spec.name}-{name}.ready")
        if os.path.exists(path):
            os.remove(path)
        ready[name] = (role, path)
        argv = worker_argv(role, spec, ctx, cores, path, lease)
        started.append(ServerProcess(f"{spec.name}-{name}", argv, env, _log(ctx, f"{spec.name}-{name}")))
    wait_until(
        lambda: all(os.path.exists(f) for _, f in ready.values()), ctx.start_timeout_s, started, f"{spec.name} workers"
    )
    decode = [_read_ready(f) for role, f in ready.values() if role == "decode"]
    prefill = [_read_ready(f) for role, f in ready.values() if role == "prefill"]
    port = free_port(ctx.host)
    argv = router_argv(spec, ctx, decode, prefill, port)
    started.append(ServerProcess(f"{spec.name}-router", argv, env, _log(ctx, f"{spec.name}-router")))
    base_url = f"http://{ctx.host}:{port}"
    wait_until(lambda: http_ok(base_url + "/health"), ctx.start_timeout_s, started, f"{spec.name} router")
    return base_url


def _read_ready(path: str) -> str:
    """The gRPC address from a worker's ready file ("grpc_address kv_endpoint")."""
    with open(path, encoding="utf-8") as f:
        return f.read().split()[0]


def _log(ctx: LaunchContext, name: str) -> str:
    return os.path.join(ctx.workdir, f"{name}.log")
