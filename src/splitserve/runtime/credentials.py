"""Secrets on the command line: the router's API key and the control plane's
cluster token, each taken from a flag, a file or the environment.

A value given as a flag is visible to every user of the machine (`ps`, /proc),
so each secret also has a `-file` flag, which reads it from a file instead
(a Docker or Kubernetes secret mount, a 0600 file), and an environment variable.
"""

from __future__ import annotations

import argparse
import os


def read_secret_file(path: str) -> str:
    """The file's text without one trailing newline (what `echo` and editors add);
    an empty or unreadable file is an error (argparse names the flag with it)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise argparse.ArgumentTypeError(f"cannot read {path!r}: {reason}") from None
    if text.endswith("\n"):
        text = text[:-2] if text.endswith("\r\n") else text[:-1]
    if not text:
        raise argparse.ArgumentTypeError(f"{path!r} is empty")
    return text


def add_secret_argument(p: argparse._ActionsContainer, flag: str, env: str, what: str) -> None:
    """`flag` VALUE and `flag`-file PATH, one or the other, both into the same attribute;
    neither given: $`env`, or None."""
    dest = flag.lstrip("-").replace("-", "_")
    group = p.add_mutually_exclusive_group()
    group.add_argument(
        flag,
        dest=dest,
        default=os.environ.get(env) or None,
        metavar="VALUE",
        help=f"{what} (default: ${env}); a value given here is visible to every user of the machine in ps: "
        f"prefer {flag}-file or ${env}",
    )
    group.add_argument(
        f"{flag}-file",
        dest=dest,
        default=argparse.SUPPRESS,  # the first flag's default stands
        type=read_secret_file,
        metavar="PATH",
        help=f"read the value of {flag} from this file (one trailing newline is dropped)",
    )
