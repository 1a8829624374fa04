"""The CUDA path: eager decode against CUDA-graph replay (same tokens), CUDA
against the CPU, and decode on the Triton kernels (engine/kernels/triton_decode.py,
captured in the graphs) against the torch code, in one split and split-K.
Skipped cleanly where there is no GPU."""

from __future__ import annotations

import pytest
import torch

from splitserve.engine.config import EngineConfig
from splitserve.engine.engine import Engine
from splitserve.engine.model import DecoderModel
from splitserve.engine.random_model import random_weights, tiny_model_config
from splitserve.engine.sampling import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

CFG = tiny_model_config(num_layers=3, max_position=512)
WEIGHTS = random_weights(CFG, seed=9)
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, CFG.vocab_size, (n,), generator=g).tolist() for n in (1, 17, 40, 100, 5, 64, 3)]


def run(device: str, dtype: str, graphs: bool) -> list[list[int]]:
    cfg = EngineConfig(device=device, dtype=dtype, num_blocks=256, max_num_batched_tokens=64, use_cuda_graphs=graphs)
    return Engine(CFG, WEIGHTS, cfg).generate(prompts(), GREEDY)


def test_cuda_graph_replay_gives_the_eager_tokens():
    assert run("cuda", "float32", graphs=True) == run("cuda", "float32", graphs=False)


def test_cuda_fp32_matches_cpu_fp32():
    assert run("cuda", "float32", graphs=True) == run("cpu", "float32", graphs=False)


def test_cuda_bf16_runs_and_frees_every_block():
    cfg = EngineConfig(device="cuda", dtype="bfloat16", num_blocks=256, max_num_batched_tokens=64)
    engine = Engine(CFG, WEIGHTS, cfg)
    outs = engine.generate(prompts(), GREEDY)
    assert all(len(o) == GREEDY.max_tokens for o in outs)
    assert engine.blocks.num_free_blocks == 256
    assert engine.runner.graphs is not None and engine.runner.graphs.graphs  # decode ran from graphs


@pytest.mark.parametrize("split", [False, True], ids=["one-split", "split-k"])
def test_triton_decode_kernels_give_the_torch_tokens_under_graphs(monkeypatch, split):
    pytest.importorskip("triton")
    import splitserve.engine.kernels.triton_decode as td

    if td.triton_decode_kernels() is None:
        pytest.skip(f"{td.DISABLE_ENV} is set")
    if split:  # every context past one attention tile split across programs
        monkeypatch.setattr(td, "SPLIT_MIN_TOKENS", 1)
        monkeypatch.setattr(td, "SPLIT_TARGET_PROGRAMS", 10**6)
    steps: list[int] = []
    real = td.TritonDecodeKernels.step

    def counted(self, *a, **kw):
        steps.append(1)
        return real(self, *a, **kw)

    monkeypatch.setattr(td.TritonDecodeKernels, "step", counted)
    ours = run("cuda", "float32", graphs=True)
    assert steps  # the captured decode steps ran on the kernels
    monkeypatch.setattr(DecoderModel, "_decode_kernels", lambda self, kv_cache, meta: None)
    assert ours == run("cuda", "float32", graphs=True)
