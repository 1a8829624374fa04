"""Every choice `serve` prints at start is what runs (issue 33). Each comes from engine/tuned.py's
table through `fill_tuned`, so a choice changed in the table changes the start line and the
configs serve builds for its pools and its router alike; `splitserve worker` and `splitserve
router` take the same table's choices for what they run. In-process: the configs are built from
parsed flags, nothing is started."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, fields, replace

import pytest

import splitserve.engine.tuned as tuned_table
from splitserve.cli import build_parser
from splitserve.cluster.pool import PoolSpec
from splitserve.cluster.serve import configure, pool_specs, router_config, with_tuned
from splitserve.engine.tuned import Tuned, detect_machine, tuned_defaults
from splitserve.router.config import RouterConfig
from splitserve.router.flags import router_config_from_args
from splitserve.workers.server import worker_config_from_args

MACHINE = tuned_defaults(detect_machine())


def parse(*argv: str) -> argparse.Namespace:
    return build_parser(list(argv)).parse_args(list(argv))


@dataclass(frozen=True)
class Served:
    """What `serve` without flags prints and builds."""

    line: str
    pools: dict[str, PoolSpec]
    router: RouterConfig

    def workers(self) -> list[PoolSpec]:
        return list(self.pools.values())


def serve_without_flags() -> Served:
    args, tuned = with_tuned(parse("serve"))
    specs = pool_specs(args, configure(args), 1.0, "cluster-token", None)
    return Served(tuned.line(), {s.role: s for s in specs}, router_config(args, specs, "cluster-token", None))


@dataclass(frozen=True)
class Change:
    """One printed choice changed in the table: the table changed, what the start line then says,
    and what serve then runs (every pool's value, as a set)."""

    table: Tuned
    says: str
    runs: Callable[[Served], set[object]]


CHANGES = {
    "dtype": Change(
        replace(MACHINE, dtype="float16"), "--dtype float16", lambda s: {p.worker.engine.dtype for p in s.workers()}
    ),
    "quantization": Change(
        replace(MACHINE, quantization="none"),
        "--quantization none",
        lambda s: {p.worker.engine.quantization for p in s.workers()},
    ),
    "prefill_workers": Change(
        replace(MACHINE, prefill_workers=3), "3 prefill + ", lambda s: {s.pools["prefill"].replicas}
    ),
    "decode_workers": Change(
        replace(MACHINE, decode_workers=2), "+ 2 decode worker(s)", lambda s: {s.pools["decode"].replicas}
    ),
    "threads": Change(replace(MACHINE, threads=5), "x 5 thread(s)", lambda s: {p.worker.threads for p in s.workers()}),
    "core_lease": Change(
        replace(MACHINE, core_lease=not MACHINE.core_lease),
        "borrow idle cores" if not MACHINE.core_lease else "no core lending",
        lambda s: {bool(p.worker.core_lease) for p in s.workers()},
    ),
    "decode_borrows": Change(
        # the line names --decode-borrows only where cores are lent
        replace(MACHINE, core_lease=True, decode_borrows=not MACHINE.decode_borrows),
        "a prefill borrows idle cores" if MACHINE.decode_borrows else "prefill and decode steps borrow idle cores",
        lambda s: {p.worker.decode_borrows for p in s.workers()},
    ),
    "long_prefill_token_threshold": Change(
        replace(MACHINE, long_prefill_token_threshold=97),
        "--long-prefill-token-threshold 97",
        lambda s: {p.worker.engine.long_prefill_token_threshold for p in s.workers()},
    ),
    "prefill_backlog_tokens": Change(
        replace(MACHINE, prefill_backlog_tokens=123),
        "--prefill-backlog-tokens 123",
        lambda s: {s.router.routing.prefill_backlog_tokens},
    ),
    "mode": Change(replace(MACHINE, mode="colocated"), "--mode colocated", lambda s: {s.router.routing.mode}),
    "prefill_order": Change(
        replace(MACHINE, prefill_order="arrival"),
        "--prefill-order arrival",
        lambda s: {p.worker.engine.prefill_order for p in s.workers()},
    ),
}


def test_every_printed_choice_has_its_change_below() -> None:
    assert set(CHANGES) == {f.name for f in fields(Tuned)} - {"block_kernel"}  # said, not chosen


def test_the_start_line_names_the_block_kernels_quant_cpp_picks_on_this_cpu() -> None:
    from splitserve.engine.kernels import quant
    from splitserve.engine.tuned import detect_machine

    if not quant.available():
        pytest.skip("the quantized kernel does not build here")
    said = detect_machine().block_kernel
    picked = {0: "scalar", 1: "AVX2"}.get(quant.best_path())
    if picked is None:
        picked = "AVX-512 BF16 tiles" if quant._ext().bf16() else "AVX-512 VNNI"
    assert said == picked
    assert f"--quantization auto ({said} kernels" in tuned_table.tuned_defaults(detect_machine()).line()


@pytest.mark.parametrize("choice", sorted(CHANGES))
def test_a_choice_changed_in_the_table_changes_the_start_line_and_what_serve_runs(
    choice: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    change = CHANGES[choice]
    before = serve_without_flags()
    assert change.says not in before.line
    monkeypatch.setattr(tuned_table, "tuned_defaults", lambda machine: change.table)
    after = serve_without_flags()
    assert change.says in after.line
    assert change.runs(after) == {getattr(change.table, choice)}
    assert change.runs(before) == {getattr(MACHINE, choice)}  # and without the change, the machine's


def test_a_worker_and_a_router_started_alone_take_the_same_tables_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    changed = replace(
        MACHINE,
        dtype="float16",
        threads=5,
        core_lease=True,
        decode_borrows=not MACHINE.decode_borrows,
        long_prefill_token_threshold=97,
        prefill_backlog_tokens=123,
        mode="colocated",
        prefill_order="arrival",
    )
    monkeypatch.setattr(tuned_table, "tuned_defaults", lambda machine: changed)
    worker = worker_config_from_args(parse("worker", "--role", "decode"))
    assert (worker.engine.dtype, worker.engine.long_prefill_token_threshold) == ("float16", 97)
    assert (worker.decode_borrows, worker.engine.prefill_order) == (changed.decode_borrows, "arrival")
    # a process alone takes no share of the machine: torch's own threads, no core lease unless given
    assert (worker.threads, worker.core_lease) == (0, "")
    routing = router_config_from_args(parse("router", "--decode", "d:1"), None).routing
    assert (routing.mode, routing.prefill_backlog_tokens) == ("colocated", 123)
    # and a flag given wins over the table
    given = parse("router", "--decode", "d:1", "--mode", "auto", "--prefill-backlog-tokens", "700")
    routing = router_config_from_args(given, None).routing
    assert (routing.mode, routing.prefill_backlog_tokens) == ("auto", 700)
