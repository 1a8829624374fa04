"""docs/flags.md is the commands' own parsers written out (issue 33: `serve` had 55 flags, 50 of
them explained in README prose, --num-blocks and --http-port not among them)."""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path

import pytest

from splitserve.cli import FLAGS_DOC_COMMAND, REFERENCE_COMMANDS, SUBCOMMANDS, flags_reference

DOC = Path(__file__).resolve().parent.parent / "docs" / "flags.md"


def test_docs_flags_md_is_what_the_parsers_say() -> None:
    assert DOC.read_text() == flags_reference(), f"docs/flags.md differs from the parsers: run `{FLAGS_DOC_COMMAND}`"


@pytest.mark.parametrize("command", REFERENCE_COMMANDS)
def test_every_flag_of_each_command_has_its_row(command: str) -> None:
    p = argparse.ArgumentParser()
    importlib.import_module(SUBCOMMANDS[command][0]).add_arguments(p)
    section = flags_reference().split(f"\n## splitserve {command}\n")[1].split("\n## ")[0]
    flags = {s for a in p._actions for s in a.option_strings if s not in ("-h", "--help")}
    rows = {line.split("`")[1].split(" ")[0].rstrip(",") for line in section.splitlines() if line.startswith("| `-")}
    assert flags == rows
    if command == "serve":
        assert {"--num-blocks", "--http-port", "--prefill-backlog-tokens"} <= rows


def test_a_default_read_from_the_environment_is_named_never_written(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPLITSERVE_API_KEY", "sk-never-in-the-doc")
    text = flags_reference()
    assert "sk-never-in-the-doc" not in text
    assert "| `--api-key VALUE` | `$SPLITSERVE_API_KEY` |" in text
