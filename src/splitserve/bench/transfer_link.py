"""A real throttled link on this machine: a network namespace joined to this one by a veth pair,
each end's egress shaped by `tc`'s token bucket filter (tbf) to a rate.

What the KV transfer benchmarks and the end-to-end codec test run a prefill worker behind, so
that its KV crosses a kernel network path at a link's rate (TCP's own pacing, queueing and
congestion control included), not a userspace proxy. Needs CAP_NET_ADMIN (root here); without it
`net_admin_refusal` says why, and nothing is set up.

    with ThrottledLink(gbps=1.0) as link:
        link.exec_prefix + ["python", ...]     # a process inside the namespace
        link.inner_host, link.outer_host         # its address; this namespace's end

Each link has its own names and /24 (from this process's id, the next free one), so that two
runs at once do not collide; `close` deletes the namespace, which deletes the veth pair with it.
Processes started inside must be stopped first (deleting a namespace does not end them).
"""

from __future__ import annotations

import os
import shutil
import subprocess

CAP_NET_ADMIN = 12  # its bit in /proc/self/status's CapEff
BURST = "256kb"  # tbf's bucket: a few jumbo bursts; a larger one lets short frames through unthrottled
LATENCY = "50ms"  # tbf's queue: packets waiting longer are dropped (TCP backs off, as on a real link)


class LinkError(RuntimeError):
    """A step of setting up the link failed; the message names the command and what it said."""


def net_admin_refusal(status: str | None = None) -> str | None:
    """Why this process cannot build a throttled link, or None. `status`: the text of
    /proc/self/status (read when None)."""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"needs the {' and '.join(missing)} command(s) (iproute2) to build a network namespace and shape it"
    try:
        if status is None:
            with open("/proc/self/status") as f:
                status = f.read()
        cap = next(line for line in status.splitlines() if line.startswith("CapEff:")).split()[1]
    except (OSError, StopIteration):
        return "cannot read this process's capabilities (/proc/self/status): Linux only"
    if not int(cap, 16) >> CAP_NET_ADMIN & 1:
        return "needs CAP_NET_ADMIN to create a network namespace and shape it with tc (run as root)"
    return None


def _run(*cmd: str) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if done.returncode:
        raise LinkError(f"`{' '.join(cmd)}` failed ({done.returncode}): {done.stderr.strip()}")


def _subnet_free(subnet: int) -> bool:
    done = subprocess.run(
        ["ip", "-o", "addr", "show", "to", f"10.77.{subnet}.0/24"], capture_output=True, text=True, timeout=30
    )
    return done.returncode == 0 and not done.stdout.strip()


class ThrottledLink:
    """A namespace behind a veth pair, both directions shaped to `gbps` (None: unshaped)."""

    def __init__(self, gbps: float | None) -> None:
        if gbps is not None and gbps <= 0:
            raise ValueError(f"a link's rate must be positive, got {gbps} Gb/s")
        refusal = net_admin_refusal()
        if refusal is not None:
            raise LinkError(refusal)
        tag = os.getpid() % 100_000
        self.netns = f"splitserve-{tag}"
        self.outer_dev, self.inner_dev = f"ssv{tag}a", f"ssv{tag}b"  # interface names: 15 characters at most
        subnet = next((s for s in ((tag + i) % 250 + 1 for i in range(250)) if _subnet_free(s)), None)
        if subnet is None:
            raise LinkError("no free /24 in 10.77.0.0/16 for the link")
        self.outer_host, self.inner_host = f"10.77.{subnet}.1", f"10.77.{subnet}.2"
        self.gbps = gbps
        self.exec_prefix = ["ip", "netns", "exec", self.netns]
        self._up = False
        try:
            self._set_up()
        except BaseException:
            self.close()
            raise

    def _set_up(self) -> None:
        _run("ip", "netns", "add", self.netns)
        self._up = True
        _run("ip", "link", "add", self.outer_dev, "type", "veth", "peer", "name", self.inner_dev)
        _run("ip", "link", "set", self.inner_dev, "netns", self.netns)
        _run("ip", "addr", "add", f"{self.outer_host}/24", "dev", self.outer_dev)
        _run("ip", "link", "set", self.outer_dev, "up")
        inside = self.exec_prefix
        _run(*inside, "ip", "addr", "add", f"{self.inner_host}/24", "dev", self.inner_dev)
        _run(*inside, "ip", "link", "set", self.inner_dev, "up")
        _run(*inside, "ip", "link", "set", "lo", "up")
        if self.gbps is not None:
            self.set_rate(self.gbps, first=True)

    def set_rate(self, gbps: float, first: bool = False) -> None:
        """Shape both ends to `gbps` (tbf on each end's egress), replacing the rate set before."""
        if gbps <= 0:
            raise ValueError(f"a link's rate must be positive, got {gbps} Gb/s")
        verb = "add" if first else "change"
        rate = f"{gbps * 1000:g}mbit"
        tbf = ("root", "tbf", "rate", rate, "burst", BURST, "latency", LATENCY)
        _run("tc", "qdisc", verb, "dev", self.outer_dev, *tbf)
        _run(*self.exec_prefix, "tc", "qdisc", verb, "dev", self.inner_dev, *tbf)
        self.gbps = gbps

    def close(self) -> None:
        """Delete the namespace (and with it the veth pair); safe to call twice."""
        if self._up:
            self._up = False
            subprocess.run(["ip", "netns", "del", self.netns], capture_output=True, timeout=30)
            subprocess.run(["ip", "link", "del", self.outer_dev], capture_output=True, timeout=30)  # if left

    def __enter__(self) -> ThrottledLink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
