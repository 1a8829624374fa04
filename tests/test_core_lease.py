"""Core lending between the workers of one machine (engine/core_lease.py) and the tuned
defaults that turn it on (engine/tuned.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from splitserve.engine.commands import Admit
from splitserve.engine.core_lease import CoreLease, step_threads
from splitserve.engine.tuned import Machine, tuned_defaults


def test_a_prefill_takes_every_core_no_neighbour_claims():
    assert step_threads(total_cores=2, own_cores=1, others_claimed=0, borrows=True) == 2
    assert step_threads(total_cores=8, own_cores=2, others_claimed=3, borrows=True) == 5


def test_a_prefill_never_shrinks_below_its_own_share():
    assert step_threads(total_cores=2, own_cores=1, others_claimed=2, borrows=True) == 1


def test_a_decode_step_runs_on_its_own_share_whatever_is_free():
    assert step_threads(total_cores=8, own_cores=2, others_claimed=0, borrows=False) == 2


@pytest.fixture
def lease_path(tmp_path):
    return str(tmp_path / "cores")


def test_a_neighbour_with_work_takes_its_core_back_at_the_next_step(lease_path):
    prefill = CoreLease(lease_path, total_cores=2, own_cores=1, pid=os.getpid())
    decode = CoreLease(lease_path, total_cores=2, own_cores=1, pid=os.getppid())  # another live process
    assert prefill.acquire(borrows=True) == 2  # decode idle: both cores
    assert decode.acquire(borrows=False) == 1  # decode gets work and claims its core
    assert prefill.acquire(borrows=True) == 1  # the prefill's next step gives it back
    decode.release()
    assert prefill.acquire(borrows=True) == 2
    prefill.close()
    assert os.path.exists(lease_path)  # the decode worker still holds its slot
    decode.close()
    assert not os.path.exists(lease_path)  # the last one out leaves nothing behind


def test_two_prefills_starting_at_once_do_not_both_take_every_core(lease_path):
    a = CoreLease(lease_path, total_cores=2, own_cores=1, pid=os.getpid())
    b = CoreLease(lease_path, total_cores=2, own_cores=1, pid=os.getppid())
    assert a.acquire(borrows=True) == 2
    assert b.acquire(borrows=True) == 1  # a's claim is in the file already
    a.close()
    b.close()


def test_a_dead_workers_claim_counts_for_nothing(lease_path):
    child = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from splitserve.engine.core_lease import CoreLease; "
            "CoreLease(sys.argv[1], 2, 1).acquire(borrows=True)",  # exits holding its claim of 2
            lease_path,
        ],
        check=True,
        timeout=60,
    )
    assert child.returncode == 0
    lease = CoreLease(lease_path, total_cores=2, own_cores=1)
    assert lease.acquire(borrows=True) == 2
    lease.close()


def test_a_lease_that_cannot_be_met_is_refused_with_its_numbers(lease_path):
    with pytest.raises(ValueError, match="own_cores \\(3\\) is more than the 2 cores"):
        CoreLease(lease_path, total_cores=2, own_cores=3)


def _machine(flags: set[str], cores: int = 2, device: str = "cpu") -> Machine:
    return Machine(device=device, cores=cores, cpu_flags=frozenset(flags))


def test_bfloat16_where_the_cpu_has_bf16_arithmetic_float32_where_it_has_not():
    assert tuned_defaults(_machine({"avx2", "avx512f", "avx512_bf16"})).dtype == "bfloat16"
    assert tuned_defaults(_machine({"avx2", "amx_bf16"})).dtype == "bfloat16"
    assert tuned_defaults(_machine({"avx2", "avx512f"})).dtype == "float32"
    assert tuned_defaults(_machine(set(), device="cuda")).dtype == "bfloat16"


def test_the_tuned_cpu_pair_owns_half_the_cores_each_and_lends_them():
    t = tuned_defaults(_machine({"avx2"}, cores=8))
    assert (t.prefill_workers, t.decode_workers, t.threads, t.core_lease, t.decode_borrows) == (1, 1, 4, True, True)
    assert (t.long_prefill_token_threshold, t.prefill_backlog_tokens, t.mode) == (256, 700, "auto")
    alone = tuned_defaults(_machine({"avx2"}, cores=1))
    assert not alone.core_lease and not alone.decode_borrows  # nothing to lend
    assert "--dtype float32" in t.line() and "--prefill-backlog-tokens 700" in t.line()


def test_a_gpu_keeps_torchs_own_threads_and_the_start_line_says_so():
    # serve never set a GPU worker's threads; the line said "1 thread(s)" all the same
    gpu = tuned_defaults(_machine(set(), cores=8, device="cuda"))
    assert gpu.threads == 0 and not gpu.core_lease
    assert "x torch's own threads (no core lending)" in gpu.line()


@pytest.mark.timeout(60)
def test_the_engine_loop_runs_each_prefill_step_on_the_threads_the_lease_gives(lease_path):
    import threading

    import torch

    from splitserve.engine.config import EngineConfig
    from splitserve.engine.engine import Engine, StepOutput
    from splitserve.engine.loop import EngineLoop
    from splitserve.engine.random_model import random_weights, tiny_model_config
    from splitserve.engine.sampling import SamplingParams

    cfg = tiny_model_config()
    engine = Engine(cfg, random_weights(cfg), EngineConfig(num_blocks=64, max_num_batched_tokens=64))
    neighbour = CoreLease(lease_path, total_cores=2, own_cores=1, pid=os.getppid())
    seen: list[int] = []  # each step's threads, read on the engine thread right after it
    lease = CoreLease(lease_path, total_cores=2, own_cores=1)
    loop = EngineLoop(engine, on_iteration=lambda _: seen.append(torch.get_num_threads()), core_lease=lease)
    params = SamplingParams(max_tokens=1, temperature=0.0)

    def prefill(request_id: str, first: int) -> list[int]:
        finished = threading.Event()
        seen.clear()

        def sink(out: StepOutput) -> None:
            if out.finished:
                finished.set()

        prompt = list(range(first, first + 128))  # two chunks of 64, none of them cached
        loop.submit(Admit(request_id, prompt, params), sink)
        assert finished.wait(30)
        return list(seen)

    try:
        assert prefill("neighbour-idle", 1) == [2, 2]  # both cores
        neighbour.acquire(borrows=False)  # the neighbour gets work and claims its core
        assert prefill("neighbour-busy", 200) == [1, 1]  # given back at the step boundary
    finally:
        loop.stop()
        neighbour.close()


@pytest.mark.timeout(60)
def test_decode_steps_borrow_only_when_the_loop_is_told_to(lease_path):
    import threading

    import torch

    from splitserve.engine.config import EngineConfig
    from splitserve.engine.engine import Engine, StepOutput
    from splitserve.engine.loop import EngineLoop
    from splitserve.engine.random_model import random_weights, tiny_model_config
    from splitserve.engine.sampling import SamplingParams

    cfg = tiny_model_config()
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)

    def threads_per_step(decode_borrows: bool) -> list[int]:
        engine = Engine(cfg, random_weights(cfg), EngineConfig(num_blocks=64, max_num_batched_tokens=64))
        lease = CoreLease(lease_path, total_cores=2, own_cores=1)
        seen: list[int] = []
        loop = EngineLoop(
            engine,
            on_iteration=lambda _: seen.append(torch.get_num_threads()),
            core_lease=lease,
            decode_borrows=decode_borrows,
        )
        finished = threading.Event()

        def sink(out: StepOutput) -> None:
            if out.finished:
                finished.set()

        try:
            loop.submit(Admit(f"r{decode_borrows}", list(range(1, 17)), params), sink)
            assert finished.wait(30)
        finally:
            loop.stop()
        return seen

    assert threads_per_step(decode_borrows=False) == [2, 1, 1, 1]  # the prefill step borrows, decode does not
    assert threads_per_step(decode_borrows=True) == [2, 2, 2, 2]


def test_a_prefill_worker_steps_through_larger_chunks_unless_told():
    import argparse

    from splitserve.engine.flags import engine_config_from_args
    from splitserve.workers.server import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    prefill = p.parse_args(["--role", "prefill"])
    decode = p.parse_args(["--role", "decode"])
    given = p.parse_args(["--role", "prefill", "--max-num-batched-tokens", "256"])
    assert engine_config_from_args(prefill, "prefill").max_num_batched_tokens == 2048
    assert engine_config_from_args(decode, "decode").max_num_batched_tokens == 512
    assert engine_config_from_args(given, "prefill").max_num_batched_tokens == 256


def test_a_borrowing_step_gives_a_claimed_core_back_at_its_next_layer(lease_path):
    """The decode worker's step starts while a prefill step runs on its core: the prefill gives the
    core back as its current layer ends (engine/loop.py's `give_back`, which the loop calls between
    a borrowing step's layers), not when the step ends."""
    import torch

    from splitserve.engine.config import EngineConfig
    from splitserve.engine.engine import Engine
    from splitserve.engine.loop import give_back
    from splitserve.engine.random_model import random_weights, tiny_model_config
    from splitserve.engine.sampling import SamplingParams

    cfg = tiny_model_config(num_layers=4)
    engine = Engine(cfg, random_weights(cfg, seed=1), EngineConfig(num_blocks=64))
    prefill = CoreLease(lease_path, total_cores=2, own_cores=1, pid=os.getpid())
    decode = CoreLease(lease_path, total_cores=2, own_cores=1, pid=os.getppid())  # another live process
    before = torch.get_num_threads()
    threads: list[int] = []

    def layer_ends() -> None:
        if not threads:
            decode.acquire(borrows=False)  # the neighbour's decode step begins mid-prefill
        give_back(prefill)
        threads.append(torch.get_num_threads())

    try:
        engine.add_request("p", list(range(1, 60)), SamplingParams(max_tokens=1))
        torch.set_num_threads(prefill.acquire(borrows=True))
        assert torch.get_num_threads() == 2  # decode idle: both cores
        engine.step(layer_ends)
        assert threads == [1] * cfg.num_layers  # given back after the first layer, not after the step
        assert prefill.claimed == 1
    finally:
        torch.set_num_threads(before)
        decode.close()
        prefill.close()
        engine.close()
