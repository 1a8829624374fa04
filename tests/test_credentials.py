"""Secrets off the command line (credentials.py) and the worker's refusal to run
without a cluster token (workers/common/auth.py, `splitserve worker`)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from splitserve.cli import build_parser
from splitserve.router.flags import router_config_from_args
from splitserve.workers.common.auth import cluster_token_refusal, is_loopback
from splitserve.workers.server import run as run_worker


def parse(*argv: str) -> argparse.Namespace:
    return build_parser(list(argv)).parse_args(list(argv))


def secret_file(tmp_path: Path, text: str) -> str:
    path = tmp_path / "secret"
    path.write_text(text)
    path.chmod(0o600)
    return str(path)


@pytest.fixture(autouse=True)
def no_secrets_in_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPLITSERVE_API_KEY", raising=False)
    monkeypatch.delenv("SPLITSERVE_CLUSTER_TOKEN", raising=False)


@pytest.mark.parametrize("text", ["s3cret", "s3cret\n", "s3cret\r\n"])
def test_a_secret_file_is_read_without_its_trailing_newline(tmp_path: Path, text: str) -> None:
    path = secret_file(tmp_path, text)
    a = parse("router", "--decode", "d:1", "--api-key-file", path, "--cluster-token-file", path)
    assert (a.api_key, a.cluster_token) == ("s3cret", "s3cret")
    cfg = router_config_from_args(a, a.cluster_token)
    assert cfg.listeners.api_key == "s3cret" and cfg.listeners.auth_metadata == (("x-splitserve-token", "s3cret"),)
    assert parse("worker", "--role", "decode", "--cluster-token-file", path).cluster_token == "s3cret"


def test_only_one_trailing_newline_is_dropped(tmp_path: Path) -> None:
    a = parse("router", "--decode", "d:1", "--api-key-file", secret_file(tmp_path, " k \n\n"))
    assert a.api_key == " k \n"


@pytest.mark.parametrize("text", ["", "\n"])
def test_an_empty_secret_file_is_refused_naming_the_flag(
    tmp_path: Path, text: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        parse("worker", "--role", "decode", "--cluster-token-file", secret_file(tmp_path, text))
    assert e.value.code == 2
    assert "argument --cluster-token-file:" in capsys.readouterr().err


def test_an_unreadable_secret_file_is_refused_naming_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for path in (str(tmp_path / "missing"), str(tmp_path)):
        with pytest.raises(SystemExit) as e:
            parse("router", "--decode", "d:1", "--api-key-file", path)
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert "argument --api-key-file: cannot read" in err and path in err


def test_a_value_and_a_file_for_one_secret_are_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        parse("router", "--decode", "d:1", "--api-key", "k", "--api-key-file", secret_file(tmp_path, "k"))


def test_the_environment_is_the_default_and_a_file_overrides_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SPLITSERVE_CLUSTER_TOKEN", "from-env")
    monkeypatch.setenv("SPLITSERVE_API_KEY", "key-from-env")
    assert parse("worker", "--role", "decode").cluster_token == "from-env"
    assert parse("router", "--decode", "d:1").api_key == "key-from-env"
    path = secret_file(tmp_path, "from-file")
    assert parse("worker", "--role", "decode", "--cluster-token-file", path).cluster_token == "from-file"


def test_the_flags_help_warns_that_ps_shows_a_value(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["router", "--help"], ["worker", "--help"]):
        with pytest.raises(SystemExit):
            parse(*argv)
        help_text = " ".join(capsys.readouterr().out.split())
        assert "visible to every user of the machine in ps" in help_text


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.8.0.3", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("::", False),
        ("10.0.0.5", False),
        ("decode", False),
        ("auto", False),
    ],
)
def test_loopback_hosts(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_a_worker_needs_a_token_or_the_insecure_flag_on_loopback() -> None:
    assert cluster_token_refusal("t", insecure=False, host="0.0.0.0") is None
    assert cluster_token_refusal(None, insecure=True, host="127.0.0.1") is None
    missing = cluster_token_refusal(None, insecure=False, host="127.0.0.1")
    assert missing is not None
    assert all(name in missing for name in ("--cluster-token", "--cluster-token-file", "$SPLITSERVE_CLUSTER_TOKEN"))
    assert cluster_token_refusal("", insecure=False, host="127.0.0.1") == missing
    public = cluster_token_refusal(None, insecure=True, host="0.0.0.0")
    assert public is not None and "loopback" in public


@pytest.mark.parametrize(
    "argv",
    [
        ("--role", "decode"),
        ("--role", "prefill", "--host", "0.0.0.0", "--insecure-no-cluster-token"),
        ("--role", "decode", "--host", "10.0.0.5", "--insecure-no-cluster-token"),
    ],
)
def test_the_worker_command_refuses_to_start_without_a_token(
    argv: tuple[str, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_worker(parse("worker", *argv)) == 2  # before it loads anything
    err = capsys.readouterr().err
    assert err.startswith("splitserve worker: ") and err.count("\n") == 1
    assert all(name in err for name in ("--cluster-token", "--cluster-token-file", "$SPLITSERVE_CLUSTER_TOKEN"))


def test_an_empty_token_in_the_environment_counts_as_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPLITSERVE_CLUSTER_TOKEN", "")
    assert run_worker(parse("worker", "--role", "decode")) == 2
