"""`splitserve bench start`: what a user's `splitserve serve --model FILE`, with no other flag, does
with a large file on this machine: it serves it, or refuses it in seconds.

    splitserve bench start FILE [FILE ...] [--refuse FILE] [--results FILE]

Each FILE is served as a user starts it (`splitserve serve --model FILE`, the tuned defaults: a
prefill and a decode worker), while the machine's memory is sampled every quarter second: the
serving processes' proportional resident bytes (the sum of their PSS, so the file's pages that
both workers map count once) and the machine's MemAvailable. Once `/health` answers 200, one chat
completion of 16 tokens is sent and timed, and the cluster is stopped with SIGINT, as a user
stops it. A `--refuse` file is started the same way and must exit on its own: the seconds it took
and the last lines it printed (the arithmetic) are what it shows.

The files are written by `splitserve bench synthetic-gguf` (Llama 3 8B in Q4_K_M and Q8_0, the 70B
shape sparse: its header and a hole, all the memory check reads).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from splitserve.bench.results_file import with_results
from splitserve.measure.hw import machine_line

PORT = 8000  # `serve`'s default --http-port: the user gives no flag
MAX_TOKENS = 16


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("files", nargs="*", help="GGUF files to serve with no flag")
    p.add_argument("--refuse", action="append", default=[], help="a file whose start must be refused")
    p.add_argument("--start-timeout", type=float, default=900.0, help="seconds for a file to serve")
    p.add_argument("--results", default=None, help="also write the output here, under a header line")


def run(args: argparse.Namespace) -> int:
    return with_results(args.results, lambda: _run(args))


def _run(args: argparse.Namespace) -> int:
    print(f"# {machine_line()}")
    print(f"# MemTotal {_meminfo('MemTotal') / 2**30:.1f} GiB, MemAvailable {_meminfo('MemAvailable') / 2**30:.1f} GiB")
    ok = True
    for path in args.files:
        ok &= _serve(path, args.start_timeout)
    for path in args.refuse:
        ok &= _refused(path)
    return 0 if ok else 1


def _serve(path: str, timeout: float) -> bool:
    size = os.path.getsize(path)
    print(f"\n## splitserve serve --model {path}   ({size / 1e9:.2f} GB file, no other flag)")
    log = Path(f"/tmp/splitserve-bench-start-{os.getpid()}.log")
    before = _meminfo("MemAvailable")
    start = time.monotonic()
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "splitserve.cli", "serve", "--model", path],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    sampler = _Sampler(proc.pid)
    sampler.start()
    served = False
    try:
        ready = _wait_ready(proc, start + timeout)
        if ready is None:
            print(f"not serving after {time.monotonic() - start:.0f} s (exit code {proc.poll()})")
        else:
            print(f"serving after {ready - start:.1f} s")
            served = _one_request()
    finally:
        _stop(proc)
        sampler.stop()
    print(
        f"memory: the serving processes' PSS peaked at {sampler.peak_pss / 2**30:.2f} GiB; MemAvailable fell from "
        f"{before / 2**30:.1f} to {sampler.min_available / 2**30:.1f} GiB at its lowest"
    )
    for line in _lines(log):
        if "--quantization" in line or "memory" in line.lower():
            print(f"  said: {line[:300]}")
    log.unlink(missing_ok=True)
    return served


def _refused(path: str) -> bool:
    size = os.path.getsize(path)
    print(f"\n## splitserve serve --model {path}   (its header says {_tensor_gib(path):.1f} GiB of tensors; "
          f"{size / 1e9:.1f} GB on disk, no other flag)")  # fmt: skip
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "splitserve.cli", "serve", "--model", path],
        capture_output=True,
        text=True,
        timeout=120,
    )
    took = time.monotonic() - start
    print(f"exit code {done.returncode} after {took:.1f} s; its last lines:")
    for line in (done.stdout + done.stderr).strip().splitlines()[-8:]:
        print(f"  {line[:1500]}")
    return done.returncode != 0


def _tensor_gib(path: str) -> float:
    from splitserve.engine.gguf_loader import open_gguf

    return sum(int(t.n_bytes) for t in open_gguf(path).tensors) / 2**30


def _wait_ready(proc: subprocess.Popen[bytes], deadline: float) -> float | None:
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/health", timeout=2) as r:
                if r.status == 200:
                    return time.monotonic()
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)  # polling a server's readiness, not standing in for synchronisation
    return None


def _one_request() -> bool:
    body = {
        "model": "default",
        "messages": [{"role": "user", "content": "Name three rivers in Europe."}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    models = json.load(urllib.request.urlopen(f"http://127.0.0.1:{PORT}/v1/models", timeout=30))
    body["model"] = models["data"][0]["id"]
    req = urllib.request.Request(
        f"http://127.0.0.1:{PORT}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    t = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            answer = json.load(r)
    except urllib.error.HTTPError as e:
        print(f"request: HTTP {e.code}: {e.read()[:300]!r}")
        return False
    took = time.monotonic() - t
    tokens = answer["usage"]["completion_tokens"]
    print(f"request: {answer['usage']['prompt_tokens']}-token prompt, {tokens} tokens in {took:.1f} s (HTTP 200)")
    return bool(tokens == MAX_TOKENS)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


class _Sampler:
    """The process tree's summed PSS and the machine's MemAvailable, every quarter second."""

    def __init__(self, root: int) -> None:
        self.root = root
        self.peak_pss = 0
        self.min_available = _meminfo("MemAvailable")
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._done.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._done.wait(0.25):
            self.peak_pss = max(self.peak_pss, sum(_pss(p) for p in _tree(self.root)))
            self.min_available = min(self.min_available, _meminfo("MemAvailable"))


def _tree(root: int) -> list[int]:
    """`root` and its descendants (Ray's processes included: the session starts them)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                ppid = int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def _pss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _meminfo(key: str) -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _lines(path: Path) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()
    except OSError:
        return []
