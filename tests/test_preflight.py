"""Preflight: the engine's flags against the model's header (engine/preflight.py) and the pools
against the machine (cluster/preflight.py), as pure checks; and `splitserve serve` refusing a
bad flag as a new user meets it: a real process, one line, exit 2, within seconds, before Ray."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from pathlib import Path

import pytest

from splitserve.cli import build_parser
from splitserve.cluster.placement import CPU, PoolAsk
from splitserve.cluster.preflight import machine_problems, oversubscription, threads_per_rank, worker_cpus
from splitserve.engine.config import ModelConfig
from splitserve.engine.preflight import engine_problems, model_problems, tp_problems, tp_sizes_that_fit
from splitserve.engine.problems import Check

pytestmark = pytest.mark.timeout(120)

# SmolLM2-135M's shapes: 9 heads, 3 KV heads
SMOLLM2 = ModelConfig(
    vocab_size=49152, hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3, intermediate_size=1536
)


# ---- the engine against the model ------------------------------------------------------------


def test_a_tp_size_that_does_not_divide_the_heads_names_the_sizes_that_do() -> None:
    [p] = tp_problems(SMOLLM2, {"--tensor-parallel-size": 2})
    assert p.check == Check.TENSOR_PARALLEL
    assert "--tensor-parallel-size 2 does not divide the model's 9 attention heads" in p.what
    assert p.fix == "set --tensor-parallel-size to 1 or 3"
    assert tp_sizes_that_fit(SMOLLM2) == [1, 3]
    assert tp_problems(SMOLLM2, {"--tensor-parallel-size": 3, "--decode-tensor-parallel-size": 1}) == []


def test_each_pools_size_is_checked_under_its_own_flag() -> None:
    problems = tp_problems(SMOLLM2, {"--prefill-tensor-parallel-size": 3, "--decode-tensor-parallel-size": 9})
    [p] = problems  # 9 divides the heads but not the 3 KV heads
    assert p.what.startswith("--decode-tensor-parallel-size 9 does not divide the model's 3 KV heads")
    assert p.fix == "set --decode-tensor-parallel-size to 1 or 3"


def test_a_missing_or_foreign_model_file_is_a_model_problem(tmp_path) -> None:
    config, [p] = model_problems(str(tmp_path / "no-such.gguf"))
    assert config is None and p.check == Check.MODEL
    assert "no such file or directory" in p.what and "--model" in p.fix
    notes = tmp_path / "notes.txt"
    notes.write_text("not a model")
    _, [p] = model_problems(str(notes))
    assert p.check == Check.MODEL and "not a GGUF file" in p.what
    # the TP check is not reached without a model to check against
    assert [p.check for p in engine_problems(str(notes), {"--tensor-parallel-size": 2})] == [Check.MODEL]


def test_a_hugging_face_directory_is_read_from_config_json_alone(tmp_path) -> None:
    hf = {
        "model_type": "llama",
        "vocab_size": 256,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
    }
    (tmp_path / "config.json").write_text(json.dumps(hf))  # no weights, no tokenizer: not read
    config, problems = model_problems(str(tmp_path))
    assert problems == [] and config is not None and (config.num_heads, config.num_kv_heads) == (4, 2)
    [p] = engine_problems(str(tmp_path), {"--tensor-parallel-size": 4})
    assert "4 does not divide the model's 2 KV heads" in p.what and p.fix.endswith("1 or 2")
    (tmp_path / "config.json").write_text(json.dumps({**hf, "model_type": "gpt2"}))
    _, [p] = model_problems(str(tmp_path))
    assert p.check == Check.MODEL and "'gpt2' is not supported" in p.what


def test_the_default_models_header_is_read_without_its_weights() -> None:
    config, problems = model_problems(None)
    assert problems == [] and config is not None and (config.num_heads, config.num_kv_heads) == (9, 3)


# ---- the pools against the machine -----------------------------------------------------------


def test_more_cpus_than_the_machine_has_is_one_problem_with_the_fix() -> None:
    asks = [PoolAsk("prefill", 1, {CPU: 1.0}), PoolAsk("decode", 3, {CPU: 1.0})]
    [p] = machine_problems(asks, {CPU: 2.0})
    assert p.check == Check.PLACEMENT
    assert p.what == "CPU: the pools ask for 4 (1 prefill x 1 + 3 decode x 1), the Ray cluster has 2"
    assert "--cpus-per-worker to 0.5 or less" in p.fix
    assert machine_problems([PoolAsk("decode", 2, {CPU: 1.0})], {CPU: 2.0}) == []


def test_a_resource_the_machine_lacks_is_one_line_even_when_no_node_holds_a_worker() -> None:
    [p] = machine_problems([PoolAsk("prefill", 1, {CPU: 1.0, "prefill_node": 1.0})], {CPU: 8.0})
    assert p.what.startswith("prefill_node: the pools ask for 1") and "--resources" in p.fix


def test_workers_share_a_small_machines_cores_unless_told_otherwise() -> None:
    assert worker_cpus(None, {"prefill": 1, "decode": 5}, 2.0) == 0.33
    assert worker_cpus(None, {"prefill": 1, "decode": 1}, 2.0) == 1.0
    assert worker_cpus(None, {"prefill": 1, "decode": 5}, None) == 1.0  # a joined cluster: whole CPUs
    assert worker_cpus(2.0, {"prefill": 1, "decode": 5}, 2.0) == 2.0


def test_threads_per_rank_as_torch_will_run_them_in_a_ray_actor() -> None:
    assert threads_per_rank(4, 0.33, {}) == 4  # --threads
    assert threads_per_rank(0, 0.33, {"OMP_NUM_THREADS": "3"}) == 3
    assert threads_per_rank(0, 0.33, {}) == 1  # Ray: the actor's CPUs, floored, at least one
    assert threads_per_rank(0, 2.5, {}) == 2


def test_oversubscription_names_workers_threads_and_cores() -> None:
    warning = oversubscription({"prefill": 1, "decode": 5}, {"prefill": 1, "decode": 1}, 1, 2.0)
    assert warning is not None and warning.startswith("1 prefill + 5 decode workers x 1 thread = 6 threads on 2 cores")
    assert "--decode-workers" in warning and "--threads" in warning
    assert oversubscription({"prefill": 1, "decode": 1}, {"prefill": 1, "decode": 1}, 1, 2.0) is None
    ranks = oversubscription({"prefill": 1, "decode": 1}, {"prefill": 1, "decode": 2}, 2, 4.0)
    assert ranks is not None and ranks.startswith("1 prefill + 1 decode x 2 ranks workers x 2 threads = 6 threads")


def test_serve_warns_of_oversubscription_at_start_and_starts(monkeypatch, caplog) -> None:
    import splitserve.cluster.preflight as machine
    from splitserve.cluster.serve import configure, preflight, with_tuned

    monkeypatch.setattr(machine, "machine_resources", lambda: {CPU: 2.0})
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    argv = ["serve", "--decode-workers", "5", "--threads", "0"]  # torch's own: one per CPU Ray gives
    args, _ = with_tuned(build_parser(argv).parse_args(argv))
    with caplog.at_level(logging.WARNING, logger="splitserve.cluster.serve"):
        cpus, problems = preflight(args, configure(args))
    assert problems == [] and cpus == 0.33  # said, not refused
    [record] = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert record.getMessage().startswith("1 prefill + 5 decode workers x 1 thread = 6 threads on 2 cores")


# ---- `splitserve serve` as a user runs it: refused before Ray starts --------------------------

SPLITSERVE = str(Path(sys.executable).parent / "splitserve")


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--tensor-parallel-size", "2"], "--tensor-parallel-size 2 does not divide the model's 9 attention heads"),
        (["--model", "/no/such/file"], "model /no/such/file: no such file or directory"),
        (["--cpus-per-worker", "4096"], "CPU: the pools ask for 8192 (1 prefill x 4096 + 1 decode x 4096)"),
        (["--decode-resources", '{"decode_node": 1}'], "decode_node: the pools ask for 1 (1 decode x 1)"),
    ],
    ids=["tp-does-not-divide-heads", "no-model-file", "more-cpus-than-the-machine", "resource-it-lacks"],
)
def test_serve_refuses_a_bad_flag_in_one_line_before_ray_starts(flags, says, tmp_path) -> None:
    start = time.monotonic()
    # --grpc-port 0 and no HTTP: were the checks passed by mistake, nothing here collides with a test beside
    r = subprocess.run(
        [SPLITSERVE, "serve", "--grpc-port", "0", "--http-port", "-1", *flags],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=tmp_path,
    )
    elapsed = time.monotonic() - start
    assert r.returncode == 2, r.stdout + r.stderr
    assert elapsed < 10, f"{elapsed:.1f}s"
    [line] = r.stderr.splitlines()
    assert line.startswith("splitserve serve: ") and says in line
    if "pools ask" in says:  # worded as the check against Ray's nodes words it, after Ray starts
        assert line.startswith("splitserve serve: cannot place the workers: ")
    assert "Traceback" not in r.stdout + r.stderr
    assert "starting" not in r.stdout  # neither Ray nor a pool was started


def test_serve_without_flags_runs_the_tuned_configuration_and_a_flag_overrides_it() -> None:
    from splitserve.cluster.serve import with_tuned

    args = build_parser(["serve"]).parse_args(["serve"])
    filled, tuned = with_tuned(args)
    assert filled.dtype == tuned.dtype and filled.threads == tuned.threads
    assert filled.long_prefill_token_threshold == 256 and filled.prefill_backlog_tokens == 700
    assert filled.mode == "auto" and filled.prefill_order == "shortest"
    assert filled.core_lease.startswith("/dev/shm/splitserve-cores-") == tuned.core_lease
    argv = [
        "serve",
        "--dtype",
        "float32",
        "--threads",
        "3",
        "--core-lease",
        "off",
        "--long-prefill-token-threshold",
        "0",
    ]
    given, _ = with_tuned(build_parser(argv).parse_args(argv))
    assert (given.dtype, given.threads, given.core_lease, given.long_prefill_token_threshold) == ("float32", 3, "", 0)


def test_a_disk_tier_directory_that_cannot_be_made_is_a_problem_before_anything_loads(tmp_path) -> None:
    from splitserve.engine.preflight import tier_problems

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    (problem,) = tier_problems(1 << 20, str(blocker / "tiers"))
    assert problem.check is Check.KV_TIERS and "--kv-disk-tier-dir" in problem.line()
    assert tier_problems(1 << 20, str(tmp_path / "made" / "here")) == [] and (tmp_path / "made" / "here").is_dir()
    assert tier_problems(0, str(blocker / "tiers")) == []  # the tier is off


def test_a_worker_with_a_disk_tier_it_cannot_have_exits_at_once_naming_the_flag(tmp_path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    t = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "splitserve.cli", "worker", "--role", "decode", "--insecure-no-cluster-token"]
        + ["--kv-disk-tier-mib", "16", "--kv-disk-tier-dir", str(blocker / "tiers")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr[-2000:]
    assert "--kv-disk-tier-dir" in out.stderr and "Traceback" not in out.stderr
    assert time.monotonic() - t < 60  # before the model loads
