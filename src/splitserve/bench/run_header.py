"""What a results file (bench/results/*.txt) says about its run, read from the lines it
starts with: the exact command, the code it ran at, the date, the machine and the CPU's
flags, for the report's summary.

The format a run writes now is `results_file.header_line`'s ("$ COMMAND   # at CODE,
DATE, N CPU cores (CPU; flags FLAGS), load average ..."); the files keep the formats of
their day too ("# COMMAND   [code CODE; DATE UTC; CPU flags: FLAGS]", a "machine: ..."
line after the command, or only "# at CODE"). What a file does not say is None.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# the command line and the lines a bench prints before its figures (its settings, the machine)
HEADER_LINES = 4

_CODE = re.compile(r"(?:\bat|\[code|\bcode) ([0-9a-f]{7,40}(?: \+ uncommitted [^,;\]]+)?)")
_DATE = re.compile(r"\b(\d{4}-\d{2}-\d{2})[T ](\d{2}:\d{2})")
_FLAGS = re.compile(r"\bflags:? ([a-z0-9_]+(?: [a-z0-9_]+)*)")
# "2 CPU cores (AMD EPYC; flags ...)", "2 shared CPU cores (AMD EPYC), no GPU", "2 CPU cores (flags ...)"
_CORES = re.compile(r"(\d+ (?:shared )?CPU cores)(?: \((?!flags)(.*?)(?:;|\)(?:,|$)))?")
_MACHINE_LINE = re.compile(r"^#? ?machine: (.*?)(?:;|, load average|$)", re.M)


@dataclass(frozen=True)
class RunHeader:
    command: str
    code: str | None
    date: str | None  # "YYYY-MM-DD HH:MM", UTC
    machine: str | None
    flags: str | None


def read_header(text: str) -> RunHeader:
    lines = text.splitlines()[:HEADER_LINES] or [""]
    first, head = lines[0], "\n".join(lines)
    code, flags = _CODE.search(head), _FLAGS.search(first) or _FLAGS.search(head)
    date = _DATE.search(head)
    return RunHeader(
        command=_command(first),
        code=code.group(1) if code else None,
        date=f"{date.group(1)} {date.group(2)}" if date else None,
        machine=_machine(first, head),
        flags=flags.group(1) if flags else None,
    )


def _command(first: str) -> str:
    """The command as the run recorded it: the first line without its prompt, and without the
    comment where that says only where and when it ran ("# at CODE, ...", "[code ...]"); a comment
    that says what a script ran stays ("bash bench/device.sh   # python3 -m splitserve.cli ...")."""
    command = re.sub(r"^[$#] ", "", first)
    return re.split(r"\s{2,}# at |\s{2,}\[|, at [0-9a-f]{7}", command, maxsplit=1)[0].strip()


def _machine(first: str, head: str) -> str | None:
    cores = _CORES.search(first)
    if cores:
        return f"{cores.group(1)}, {cores.group(2)}" if cores.group(2) else cores.group(1)
    line = _MACHINE_LINE.search(head)
    return line.group(1).strip() if line else None
