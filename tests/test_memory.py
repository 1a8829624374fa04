"""A worker's memory, counted from the model's header before anything loads, and a start that
cannot fit refused in seconds with the arithmetic and the flags that would make it fit.

The issue's case: an 8B-shape Q4_0 GGUF under `serve` with no flags inflated the file to bfloat16
in each worker and drove a 24 GB machine down to 1.4 GB available before anyone stopped it. The
8B file here is its header and a hole (bench synthetic-gguf's sparse file: the count reads the
tensor table only).
"""

from __future__ import annotations

import math
import subprocess
import sys
import time
from dataclasses import replace

import pytest

from splitserve.bench import synthetic_gguf
from splitserve.engine import gguf_loader
from splitserve.engine.config import EngineConfig
from splitserve.engine.gguf_formats import FORMATS
from splitserve.engine.memory import (
    RUNTIME_BYTES,
    Pool,
    activation_bytes,
    fit_problems,
    kv_pool_bytes,
    read_model_file,
    worker_memory,
)
from splitserve.engine.preflight import read_model_config
from splitserve.engine.problems import Check
from tests.family_helpers.build import build, save_hf_dir

GIB = 1 << 30
TWO_POOLS = "--prefill-workers, --decode-workers"


@pytest.fixture(scope="module")
def llama8b_q4_0(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("sparse") / "llama8b-q4_0.gguf")
    synthetic_gguf.write(path, "Q4_0", synthetic_gguf.SHAPES["llama3-8b"], sparse=True)
    return path


def test_an_inflated_gguf_counts_every_element_in_the_dtype_and_a_kept_one_its_blocks(smollm2_path):
    tensors = gguf_loader.open_gguf(smollm2_path).tensors
    elements = sum(int(t.n_elements) for t in tensors)
    blocks = [t for t in tensors if int(t.tensor_type) in FORMATS and len(t.shape) == 2]
    assert blocks, "the embedded SmolLM2 holds its matrices in a block format"
    for dtype, size in (("float32", 4), ("bfloat16", 2)):
        inflated = worker_memory(read_model_file(smollm2_path), EngineConfig(dtype=dtype, quantization="none"))
        assert (inflated.private_weights, inflated.mapped_weights) == (elements * size, 0)
        kept = worker_memory(read_model_file(smollm2_path), EngineConfig(dtype=dtype, quantization="auto"))
        assert kept.mapped_weights == sum(int(t.n_bytes) for t in blocks)
        assert kept.private_weights == sum(int(t.n_elements) for t in tensors if t not in blocks) * size
        assert kept.private_weights + kept.mapped_weights < inflated.private_weights / 2


def test_a_float_checkpoint_is_its_parameters_in_the_dtype(tmp_path, smollm2_path):
    from splitserve.engine.weights import load_tokenizer

    model = build("llama")
    hf = save_hf_dir(model, str(tmp_path / "llama"), load_tokenizer(smollm2_path))
    params = sum(p.numel() for p in model.state_dict().values())
    for dtype, size in (("float32", 4), ("bfloat16", 2), ("bf16", 2), ("fp16", 2)):  # the flag's aliases too
        assert worker_memory(read_model_file(hf), EngineConfig(dtype=dtype)).private_weights == params * size


def test_the_kv_pool_is_its_blocks_of_every_layer_or_the_bytes_given(smollm2_path):
    model = read_model_config(smollm2_path)
    per_block_layer = 2 * 16 * model.num_kv_heads * model.head_dim  # K and V of 16 tokens, every KV head
    cfg = EngineConfig(dtype="bfloat16", num_blocks=100, block_size=16)
    assert kv_pool_bytes(model, cfg) == 100 * model.num_layers * per_block_layer * 2
    assert kv_pool_bytes(model, replace(cfg, dtype="float32")) == 100 * model.num_layers * per_block_layer * 4
    assert kv_pool_bytes(model, replace(cfg, kv_cache_bytes=12345)) == 12345
    assert activation_bytes(model, replace(cfg, max_num_batched_tokens=512)) > activation_bytes(model, cfg) / 2


def test_the_issue_case_is_refused_with_the_arithmetic_and_auto_fits(llama8b_q4_0):
    """serve's defaults on this kind of machine (bfloat16, one prefill and one decode worker) and
    the 8B Q4_0 file, on a machine with 22 GiB available."""
    cfg = EngineConfig(dtype="bfloat16", quantization="none")
    pools = [Pool("prefill", 1, cfg), Pool("decode", 1, cfg)]
    (problem,) = fit_problems(llama8b_q4_0, pools, 22 * GIB, RUNTIME_BYTES, TWO_POOLS)
    mem = worker_memory(read_model_file(llama8b_q4_0), cfg)
    need = 2 * mem.private + RUNTIME_BYTES
    assert problem.check == Check.MEMORY
    assert problem.what.startswith(
        f"the workers need {need / GIB:.2f} GiB of memory and this machine has 22.00 GiB available: "
        f"1 prefill worker x ({mem.private_weights / GIB:.2f} GiB weights + 4.00 GiB KV pool + "
    )
    assert mem.private_weights > 13 * GIB  # seven billion parameters in two bytes each
    auto = [Pool(p.role, 1, replace(cfg, quantization="auto")) for p in pools]
    assert fit_problems(llama8b_q4_0, auto, 22 * GIB, RUNTIME_BYTES, TWO_POOLS) == []
    kept = worker_memory(read_model_file(llama8b_q4_0), replace(cfg, quantization="auto"))
    need_auto = 2 * kept.private + kept.mapped_weights + RUNTIME_BYTES  # the file's blocks mapped once
    # no --num-blocks: the two inflated copies of the weights alone are more than the machine has
    assert problem.fix == (
        f"--quantization auto, which computes the file's blocks in place ({need_auto / GIB:.2f} GiB); "
        f"or fewer workers ({TWO_POOLS})"
    )


def test_the_num_blocks_it_names_fit_and_one_more_block_per_worker_does_not(smollm2_path):
    cfg = EngineConfig(dtype="float32", quantization="auto", num_blocks=20000)
    pools = [Pool("prefill", 1, cfg), Pool("decode", 2, cfg)]
    available = 6 * GIB
    (problem,) = fit_problems(smollm2_path, pools, available, RUNTIME_BYTES, TWO_POOLS)
    named = int(problem.fix.split("--num-blocks ")[1].split()[0])
    assert 64 <= named < 20000
    fits = [p._replace(engine=replace(cfg, num_blocks=named)) for p in pools]
    assert fit_problems(smollm2_path, fits, available, RUNTIME_BYTES, TWO_POOLS) == []
    over = [p._replace(engine=replace(cfg, num_blocks=named + math.ceil(0.01 * named))) for p in pools]
    assert fit_problems(smollm2_path, over, available, RUNTIME_BYTES, TWO_POOLS) != []
    assert "--quantization auto" not in problem.fix  # it runs so already


def test_a_file_larger_than_the_machine_is_refused_naming_the_file_not_fewer_workers(tmp_path):
    """A 70B shape's Q4_K_M blocks (38.7 GiB) on a 22 GiB machine: no worker count, block count or
    quantization fits it, so the fix names the file's own size."""
    path = str(tmp_path / "llama70b.gguf")
    synthetic_gguf.write(path, "Q4_K_M", synthetic_gguf.SHAPES["llama3-70b"], sparse=True)
    cfg = EngineConfig(dtype="bfloat16", quantization="auto")
    pools = [Pool("prefill", 1, cfg), Pool("decode", 1, cfg)]
    (problem,) = fit_problems(path, pools, 22 * GIB, RUNTIME_BYTES, TWO_POOLS)
    mem = worker_memory(read_model_file(path), cfg)
    assert mem.mapped_weights > 38 * GIB
    assert "fewer workers" not in problem.fix and "--num-blocks" not in problem.fix
    weights = mem.private_weights + mem.mapped_weights
    assert (
        problem.fix
        == f"a smaller file (its weights alone take {weights / GIB:.2f} GiB), or run on a machine with more memory"
    )


def test_nothing_is_refused_on_a_gpu_or_where_the_machine_does_not_say(llama8b_q4_0):
    cfg = EngineConfig(dtype="bfloat16")
    assert fit_problems(llama8b_q4_0, [Pool("decode", 4, replace(cfg, device="cuda"))], GIB, 0, TWO_POOLS) == []
    assert fit_problems(llama8b_q4_0, [Pool("decode", 4, cfg)], 0, 0, TWO_POOLS) == []


def run_cli(*argv: str, timeout: float = 120) -> tuple[int, str, float]:
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "splitserve.cli", *argv], capture_output=True, text=True, timeout=timeout)
    return p.returncode, p.stdout + p.stderr, time.monotonic() - t0


@pytest.mark.e2e
@pytest.mark.timeout(180)
def test_serve_refuses_pools_that_cannot_fit_before_ray_starts(llama8b_q4_0):
    """Sixteen decode workers of the 8B file inflated to bfloat16 need over 200 GiB: refused by the
    serve process itself, with no Ray started and no weight read."""
    rc, out, seconds = run_cli(
        "serve", "--model", llama8b_q4_0, "--quantization", "none", "--decode-workers", "16", "--cpus-per-worker", "0.1"
    )
    assert rc == 2, out[-3000:]
    assert "the workers need " in out and "16 decode workers x (" in out, out[-3000:]
    assert "--quantization auto, which computes the file's blocks in place" in out
    assert seconds < 60, seconds


@pytest.mark.e2e
@pytest.mark.timeout(180)
def test_a_worker_refuses_a_kv_pool_the_machine_cannot_hold(smollm2_path):
    rc, out, _ = run_cli("worker", "--role", "decode", "--insecure-no-cluster-token", "--num-blocks", "100000000")
    assert rc == 2, out[-3000:]
    assert "splitserve worker: the worker needs " in out and "1 decode worker x (" in out
    assert "--num-blocks " in out.split("GiB available: ")[1]
    assert "listening" not in out


def test_a_checkpoint_the_count_cannot_read_is_a_problem_said_not_raised(tmp_path, smollm2_path):
    """The shape checks read config.json alone; an unknown quantization method is found when the count
    reads the checkpoint's scheme, and said as the model's problem (it was a traceback at start)."""
    import json

    from splitserve.engine.weights import load_tokenizer

    hf = save_hf_dir(build("llama"), str(tmp_path / "llama"), load_tokenizer(smollm2_path))
    config = json.loads((tmp_path / "llama" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bogus"}
    (tmp_path / "llama" / "config.json").write_text(json.dumps(config))
    (problem,) = fit_problems(hf, [Pool("decode", 1, EngineConfig())], 1 << 40, 0, "")
    assert problem.check == Check.MODEL
    assert "quantization method 'bogus' is not supported" in problem.what
