"""Worker addresses given to `splitserve router`: one host:port per flag, a bad one
refused at once (exit code 2, one line on stderr) instead of a router that waits
for a worker that can never answer."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from splitserve.router.addresses import BadAddress, parse_worker_address, parse_worker_addresses


@pytest.mark.parametrize("address", ["10.0.0.5:7001", "decode-0:7001", "localhost:1", "[::1]:7001", "h:65535"])
def test_a_host_and_port_is_taken_as_given(address: str) -> None:
    assert parse_worker_address(address) == address


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("A,B", "is a list, not one address: repeat the flag instead (--decode A --decode B)"),
        ("a:1,b:2", "(--decode a:1 --decode b:2)"),
        ("decode-0", "has no port"),
        (":7001", "has no port"),
        ("h:", "has no valid port"),
        ("h:http", "has no valid port"),
        ("h:0", "has no valid port"),
        ("h:70000", "has no valid port"),
        ("http://h:7001", "is a URL"),
        ("::1:7001", "an IPv6 address goes in brackets"),
        ("[]:7001", "has an empty host"),
        ("", "is empty or has spaces"),
        (" h:1", "is empty or has spaces"),
        ("h :1", "is empty or has spaces"),
    ],
)
def test_a_bad_address_is_refused_naming_the_problem_and_the_fix(text: str, says: str) -> None:
    with pytest.raises(BadAddress) as e:
        parse_worker_address(text)
    message = str(e.value)
    assert says in message and repr(text) in message and "\n" not in message
    assert message.startswith("--decode ")


def test_each_value_of_a_repeated_flag_is_checked_and_named_by_its_flag() -> None:
    assert parse_worker_addresses(["a:1", "b:2"], "--prefill") == ["a:1", "b:2"]
    with pytest.raises(BadAddress, match="^--prefill 'b' has no port"):
        parse_worker_addresses(["a:1", "b"], "--prefill")


@pytest.mark.timeout(30)
def test_the_router_command_refuses_a_comma_list_at_once_with_one_line() -> None:
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "splitserve.cli", "router", "--decode", "A,B", "--http-port", "-1"],
        capture_output=True,
        text=True,
        timeout=20,
    )
    took = time.monotonic() - start
    assert proc.returncode == 2, proc.stderr
    assert took < 10
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert "'A,B'" in lines[0] and "--decode A --decode B" in lines[0]
    assert "Traceback" not in proc.stderr and proc.stdout == ""
