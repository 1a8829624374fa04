"""The TCP sockets of processes, read from /proc as `ss -tnp` would list them (no tool needed)."""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path
from typing import NamedTuple

LISTEN = "0A"  # the kernel's state code


class Socket(NamedTuple):
    address: str  # local
    port: int  # local
    remote_port: int
    state: str  # the kernel's hex code: LISTEN is 0A, ESTABLISHED 01
    pid: int


def _port(column: str) -> int:
    return int(column.split(":")[1], 16)


def tcp_sockets(pids: list[int]) -> list[Socket]:
    """Every TCP socket these processes hold (IPv4 and IPv6)."""
    owner: dict[str, int] = {}
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    owner[target[8:-1]] = pid
        except OSError:  # gone, or not ours to read
            continue
    found = []
    for table, width in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            local, remote, state, inode = cols[1], cols[2], cols[3], cols[9]
            if inode not in owner:
                continue
            raw = bytes.fromhex(local.split(":")[0])
            # the kernel writes each 32-bit word of the address in host (little-endian) order
            raw = b"".join(raw[i : i + 4][::-1] for i in range(0, width, 4))
            found.append(Socket(str(ipaddress.ip_address(raw)), _port(local), _port(remote), state, owner[inode]))
    return found


def listening_sockets(pids: list[int]) -> list[tuple[str, int, int]]:
    """The sockets these processes listen on, as (address, port, pid)."""
    return [(s.address, s.port, s.pid) for s in tcp_sockets(pids) if s.state == LISTEN]
