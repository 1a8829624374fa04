"""Tensor parallelism inside one engine (engine/parallel/): N ranks, each with its
shard of the heads, the MLP and the KV cache, compute what one process computes.
Greedy tokens are identical and logits agree to fp32 rounding (the all-reduce
sums the o and down projections in another order), through chunked prefill,
batched decode and prefix-cache hits; sizes that do not divide the model are
refused by name; a rank that dies fails the engine loudly; a worker started with
--tensor-parallel-size serves requests and leaves no rank behind when it stops, and
disaggregated prefill and decode between TP sizes give the single process's tokens."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from splitserve.engine.config import EngineConfig, ModelConfig
from splitserve.engine.connector import NullConnector
from splitserve.engine.engine import Engine
from splitserve.engine.kv_cache import KVLayout
from splitserve.engine.parallel.step import StepInputs
from splitserve.engine.quant.weight import floats
from splitserve.engine.random_model import random_weights, tiny_model_config
from splitserve.engine.sampling import SamplingParams
from splitserve.engine.sequence import Sequence as Seq
from splitserve.router.config import RoutingConfig

pytestmark = pytest.mark.timeout(300)

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
TOL = 1e-4  # fp32 logits and KV, relative and absolute: the ranks' partial sums add up in another order


@contextmanager
def engine(cfg: ModelConfig, weights: dict[str, torch.Tensor], tp: int, **engine_cfg: Any) -> Iterator[Engine]:
    """An engine of `tp` ranks, closed (its ranks stopped) whatever the test does."""
    e = Engine(cfg, weights, EngineConfig(tensor_parallel_size=tp, **engine_cfg))
    try:
        yield e
    finally:
        e.close()


def generate_recording_logits(
    e: Engine, prompts: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy tokens, and the logits of every step, in step order (a step's, in batch order: one
    pass or two, as the runner ran it)."""
    logits: list[torch.Tensor] = []
    forward = e.runner._forward_apart

    def recording(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, list[int]]:
        out = forward(*args, **kwargs)
        logits.append(out[0].clone())
        return out

    monkeypatch.setattr(e.runner, "_forward_apart", recording)
    return e.generate(prompts, GREEDY), logits


def prompts_with_shared_prefixes(vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    system = torch.randint(0, vocab, (40,), generator=g).tolist()
    out = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (1, 9, 70)]
    return out + [system + torch.randint(0, vocab, (n,), generator=g).tolist() for n in (0, 6, 23)]


def assert_logits_close(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want), "the two engines ran different steps"
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        try:
            torch.testing.assert_close(g, w, rtol=TOL, atol=TOL)
        except AssertionError as e:
            raise AssertionError(f"logits of step {step}: {e}") from None


# ---- a tiny random model, TP 2 against TP 1 ---------------------------------------------------------


@pytest.mark.parametrize("attention_bias", [False, True], ids=["llama", "qwen2-bias"])
def test_tp2_equals_tp1_through_chunks_batches_and_prefix_hits(
    attention_bias: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = tiny_model_config(num_layers=3, num_heads=4, num_kv_heads=2, attention_bias=attention_bias)
    weights = random_weights(cfg, seed=5)
    prompts = prompts_with_shared_prefixes(cfg.vocab_size)
    # chunks of 32 tokens: the 70-token prompt and the shared prefix prefill over several steps,
    # and all six decode in one batch
    engine_cfg = dict(num_blocks=128, block_size=16, max_num_batched_tokens=32)
    results = {}
    for tp in (1, 2):
        with engine(cfg, weights, tp, **engine_cfg) as e:
            first = generate_recording_logits(e, prompts, monkeypatch)
            assert e.blocks.stats.hits > 0  # the shared system prompt came from the prefix cache
            again = e.generate(prompts, GREEDY)  # mostly cached now
            assert e.blocks.num_free_blocks == 128
            results[tp] = (first, again, e.layout, [tuple(s.shape) for s in e.kv_cache.shards])
    (tokens1, logits1), again1, _, _ = results[1]
    (tokens2, logits2), again2, layout2, shapes2 = results[2]
    assert tokens2 == tokens1
    assert again2 == again1 == tokens1
    assert_logits_close(logits2, logits1)
    assert layout2.tp_size == 2 and layout2.num_kv_heads == 2
    assert shapes2 == [(3, 129, 2, 16, 1, cfg.head_dim)] * 2  # one KV head per rank


class ShardRecorder(NullConnector):
    """A prefill-role hook that reads, as each layer lands, the new tokens' K/V in every rank's shard."""

    wants_layers = True

    def __init__(self) -> None:
        self.engine: Engine | None = None
        self.unwritten: list[tuple[int, int]] = []  # (layer, rank) whose shard lacked a new token's K/V
        self.calls = 0

    def on_layer_done(self, layer: int, seqs: Sequence[Seq], counts: Sequence[int]) -> None:
        assert self.engine is not None
        self.calls += 1
        bs = self.engine.cfg.block_size
        for rank, shard in enumerate(self.engine.kv_cache.shards):
            for seq, n in zip(seqs, counts, strict=True):
                for p in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
                    kv = shard[layer, seq.block_table[p // bs], :, p % bs]
                    if not bool((kv != 0).any(dim=-1).all()):
                        self.unwritten.append((layer, rank))


def test_layer_hook_runs_once_every_rank_has_written_the_layer() -> None:
    """The KV sender reads every rank's shard when a layer is done; under TP that means
    after the ranks' writes, and the shards side by side are one process's cache."""
    cfg = tiny_model_config(num_layers=2, num_heads=4, num_kv_heads=2)
    weights = random_weights(cfg, seed=9)
    prompts = prompts_with_shared_prefixes(cfg.vocab_size, seed=2)[:3]
    engine_cfg = dict(num_blocks=64, max_num_batched_tokens=32, enable_prefix_caching=False)
    with engine(cfg, weights, 1, **engine_cfg) as e1:
        e1.generate(prompts, GREEDY)
        whole = e1.kv_cache.tensor.clone()
    with engine(cfg, weights, 2, **engine_cfg) as e2:
        recorder = ShardRecorder()
        recorder.engine = e2
        e2.connect(recorder)
        e2.generate(prompts, GREEDY)
        assert recorder.calls > 0 and recorder.unwritten == []
        side_by_side = torch.cat(e2.kv_cache.shards, dim=4)  # rank r holds KV heads layout.rank_heads(r)
    torch.testing.assert_close(side_by_side, whole, rtol=TOL, atol=TOL)


# ---- refusals and failures ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("shape", "tp", "message"),
    [
        (dict(num_heads=4, num_kv_heads=2), 3, "does not divide the model's 4 attention heads"),
        (dict(num_heads=4, num_kv_heads=1), 2, "does not divide the model's 1 KV heads"),
        (dict(num_heads=4, num_kv_heads=4, intermediate_size=130), 4, "does not divide the model's 130 intermediate"),
    ],
)
def test_a_size_that_does_not_divide_the_model_is_refused(shape: dict[str, int], tp: int, message: str) -> None:
    cfg = tiny_model_config(**shape)
    with pytest.raises(ValueError, match=message):
        Engine(cfg, random_weights(cfg), EngineConfig(num_blocks=16, tensor_parallel_size=tp))


def test_a_size_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size must be positive, got 0"):
        EngineConfig(tensor_parallel_size=0)


def test_a_cache_larger_than_the_shared_memory_is_refused(tmp_path: Path) -> None:
    from splitserve.engine.kv_cache import check_shared_memory

    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    check_shared_memory(free // 2, str(tmp_path))
    with pytest.raises(ValueError, match=f"shared memory .*; {tmp_path} has \\d+ MiB free: lower --num-blocks"):
        check_shared_memory(free + 2**30, str(tmp_path))


@pytest.mark.timeout(120)
def test_a_rank_that_dies_fails_the_next_step_loudly() -> None:
    cfg = tiny_model_config()
    with engine(cfg, random_weights(cfg), 2, num_blocks=32) as e:
        assert e.generate([[1, 2, 3]], GREEDY)  # the group works
        assert e.tp_group is not None
        rank1 = e.tp_group.ranks[0].process
        rank1.kill()
        rank1.join(10)
        with pytest.raises(RuntimeError, match=r"rank 1 \(pid \d+\) exited with code -9"):
            e.generate([[4, 5, 6]], GREEDY)
        with pytest.raises(RuntimeError, match="tensor-parallel group unusable"):  # and stays failed
            e.generate([[7]], GREEDY)


@pytest.mark.timeout(120)
def test_a_rank_that_fails_to_start_fails_the_engine_with_its_reason() -> None:
    cfg = tiny_model_config()
    weights = random_weights(cfg)
    del weights["model.norm.weight"]
    with pytest.raises(RuntimeError, match=r"rank 1 \(pid \d+\) exited with code 1: ValueError: weights lack tensor"):
        Engine(cfg, weights, EngineConfig(num_blocks=16, tensor_parallel_size=2))
    with engine(cfg, random_weights(cfg), 2, num_blocks=16) as e:  # nothing of the failed start is left
        assert e.generate([[1, 2]], GREEDY)


@pytest.mark.timeout(120)
def test_close_stops_every_rank() -> None:
    cfg = tiny_model_config(num_heads=4, num_kv_heads=4)
    e = Engine(cfg, random_weights(cfg), EngineConfig(num_blocks=16, tensor_parallel_size=4))
    assert e.tp_group is not None
    processes = [r.process for r in e.tp_group.ranks]
    assert len(processes) == 3 and all(p.is_alive() for p in processes)
    e.close()
    assert [p.exitcode for p in processes] == [0, 0, 0]  # stopped, not killed
    e.close()  # a second close is harmless


CUDA_PAIR = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs (NCCL)"
)


@pytest.mark.gpu
@CUDA_PAIR
def test_tp2_on_cuda_gives_the_tp1_tokens() -> None:
    """NCCL, one GPU a rank, the KV shards shared with the ranks over CUDA IPC; fp32."""
    cfg = tiny_model_config(num_layers=3, num_heads=4, num_kv_heads=2)
    weights = random_weights(cfg, seed=5)
    prompts = prompts_with_shared_prefixes(cfg.vocab_size)
    engine_cfg = dict(device="cuda:0", dtype="float32", num_blocks=128, max_num_batched_tokens=32)
    with engine(cfg, weights, 1, **engine_cfg) as e:
        want = e.generate(prompts, GREEDY)
    with engine(cfg, weights, 2, **engine_cfg) as e:
        assert [str(s.device) for s in e.kv_cache.shards] == ["cuda:0", "cuda:1"]
        assert e.generate(prompts, GREEDY) == want
        assert e.blocks.num_free_blocks == 128


@pytest.mark.gpu
@CUDA_PAIR
def test_tp2_on_cuda_bf16_runs_and_frees_every_block() -> None:
    """bf16 decode on the Triton kernels per shard where triton is installed. Not compared with
    TP 1: each rank's partial sums are rounded to bf16 before the all-reduce adds them."""
    cfg = tiny_model_config(num_layers=3, num_heads=4, num_kv_heads=2)
    prompts = prompts_with_shared_prefixes(cfg.vocab_size)
    engine_cfg = dict(device="cuda:0", dtype="bfloat16", num_blocks=128, max_num_batched_tokens=32)
    with engine(cfg, random_weights(cfg, seed=5), 2, **engine_cfg) as e:
        outs = e.generate(prompts, GREEDY)
        assert all(len(o) == GREEDY.max_tokens for o in outs)
        assert e.blocks.num_free_blocks == 128


# ---- the wire: step messages and the layout a worker reports ---------------------------------------------


def test_step_inputs_round_trip_without_logits_rows() -> None:
    step = StepInputs([5, 6, 7], [0, 1, 9], [3, 3, 8], [0, 1, 9], [[3], [8, 2]], [2, 10], [2, 1], [1, 2], False)
    back = StepInputs.decode(step.encode())
    assert back.block_tables == [[3, 0], [8, 2]]  # padded to the widest table, as the tensors are
    assert (back.input_ids, back.positions) == ([5, 6, 7], [0, 1, 9])
    assert (back.slot_blocks, back.slot_offsets) == ([3, 3, 8], [0, 1, 9])
    assert (back.context_lens, back.query_lens, back.logits_rows, back.is_decode) == ([2, 10], [2, 1], [], False)
    with pytest.raises(ValueError, match="for 3 tokens and 2 sequences"):
        StepInputs.decode(step.encode()[:-8])


def test_layout_carries_tp_size_over_grpc() -> None:
    from splitserve.proto.convert import layout_from_proto, layout_to_proto

    layout = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype="bf16", tp_size=3)
    assert layout_from_proto(layout_to_proto(layout)) == layout
    older_peer = layout_to_proto(layout)
    older_peer.ClearField("tp_size")
    assert layout_from_proto(older_peer).tp_size == 1


# ---- SmolLM2-135M: 9 heads, 3 KV heads, so TP 3 --------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2() -> Any:
    from splitserve.engine.weights import load_model

    return load_model(None, torch.float32, progress=False)


@pytest.mark.timeout(600)
def test_smollm2_tp3_equals_tp1(smollm2: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from splitserve.router.engine_tokenizer import EngineTokenizer

    tok = EngineTokenizer(smollm2.tokenizer)
    prompts = [
        tok.encode_chat([("user", "What is the capital of France? Answer in one sentence.")]),
        tok.encode_chat([("user", "Write a haiku about the sea.")]),
    ]
    results = {}
    for tp in (1, 3):
        with engine(smollm2.config, smollm2.weights, tp, num_blocks=64, max_num_batched_tokens=32) as e:
            results[tp] = generate_recording_logits(e, prompts, monkeypatch)
    assert results[3][0] == results[1][0]
    assert_logits_close(results[3][1], results[1][1])


# ---- a worker process with --tensor-parallel-size 2 ---------------------------------------------------


def write_tiny_hf_dir(directory: Path) -> None:
    """A tiny random Llama (4 heads, 2 KV heads) with SmolLM2's tokenizer, as a Hugging Face directory."""
    from safetensors.torch import save_file

    from splitserve.engine.weights import load_tokenizer

    hf = dict(
        model_type="llama",
        vocab_size=49152,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
    )
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(hf))
    weights = random_weights(ModelConfig.from_hf(hf), seed=3)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(directory / "model.safetensors"))
    load_tokenizer(None).save(directory)


def rank_pids(parent: int) -> list[int]:
    """The tensor-parallel ranks among `parent`'s children (spawned interpreters running spawn_main,
    not multiprocessing's resource tracker)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue  # exited meanwhile
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == parent and b"spawn_main" in cmdline:
            pids.append(int(entry))
    return pids


def running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.e2e
@pytest.mark.timeout(300)
@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_worker_with_tp2_serves_and_leaves_no_rank_behind(tmp_path: Path, stop: signal.Signals) -> None:
    """SIGTERM: the worker's shutdown stops its rank; SIGKILL (a crash): the rank sees its
    parent gone and exits by itself."""
    from splitserve.engine.weights import load_model
    from splitserve.proto.splitserve.v1 import generate_pb2 as pb
    from splitserve.workers.launch import spawn_worker
    from tests.e2e_helpers.cluster import FLAGS, with_router

    model_dir = tmp_path / "tiny"
    write_tiny_hf_dir(model_dir)
    loaded = load_model(str(model_dir), torch.float32, progress=False)
    prompt = list(range(100, 140))
    with engine(loaded.config, floats(loaded.weights), 1, num_blocks=64) as e:
        want = e.generate([prompt], GREEDY)[0]

    worker = spawn_worker("decode", "--model", str(model_dir), "--tensor-parallel-size", "2", *FLAGS)
    ranks: list[int] = []
    try:
        ranks = rank_pids(worker.proc.pid)
        assert len(ranks) == 1, worker.log()

        async def body(stub: Any, router: Any) -> list[int]:
            req = pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=prompt),
                sampling=pb.SamplingParams(temperature=0, max_tokens=GREEDY.max_tokens, ignore_eos=True),
            )
            return [t async for r in stub.Generate(req, timeout=120) for t in r.token_ids]

        got = asyncio.run(with_router([worker], [], loaded.tokenizer, body, routing=RoutingConfig(mode="colocated")))
        assert got == want
        os.kill(worker.proc.pid, stop)  # the worker alone, not its process group
        assert worker.proc.wait(60) == (0 if stop == signal.SIGTERM else -stop), worker.log()
        deadline = time.monotonic() + 30
        while any(running(p) for p in ranks):
            assert time.monotonic() < deadline, f"rank(s) {[p for p in ranks if running(p)]} outlived the worker"
            time.sleep(0.1)
    finally:
        worker.stop()
        for pid in filter(running, ranks):  # a failed test leaves no orphan either
            os.kill(pid, signal.SIGKILL)


def test_bench_tp_reports_both_sizes(capsys: pytest.CaptureFixture[str]) -> None:
    from splitserve.bench.tensor_parallel import main

    threads = torch.get_num_threads()
    assert main(["--tp", "2", "--tiny", "--reps", "1", "--steps", "2", "--batch", "2", "--prompt-len", "16"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines[-2:]] == ["TP 1", "TP 2"]
    assert torch.get_num_threads() == threads  # the group gave back the threads it took


@pytest.mark.e2e
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(1, 2), (2, 1), (2, 2)])
def test_disaggregated_between_tensor_parallel_sizes_gives_the_single_process_tokens(
    tmp_path: Path, prefill_tp: int, decode_tp: int
) -> None:
    """The prefill worker's layer hook reads every rank's shard once the layer is written, and
    the KV transfer re-shards heads between the two sizes (kv_transfer/)."""
    from splitserve.engine.weights import load_model
    from splitserve.proto.splitserve.v1 import generate_pb2 as pb
    from splitserve.workers.launch import spawn_worker
    from tests.e2e_helpers.cluster import FLAGS, wait_all_blocks_free, with_router

    model_dir = tmp_path / "tiny"
    write_tiny_hf_dir(model_dir)
    loaded = load_model(str(model_dir), torch.float32, progress=False)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, loaded.config.vocab_size, (n,), generator=g).tolist() for n in (20, 75, 130)]
    with engine(loaded.config, floats(loaded.weights), 1, num_blocks=64) as e:
        want = e.generate(prompts, GREEDY)

    prefill = spawn_worker("prefill", "--model", str(model_dir), "--tensor-parallel-size", str(prefill_tp), *FLAGS)
    try:
        decode = spawn_worker("decode", "--model", str(model_dir), "--tensor-parallel-size", str(decode_tp), *FLAGS)
    except BaseException:
        prefill.stop()
        raise
    try:

        async def one(stub: Any, ids: list[int]) -> list[int]:
            req = pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=ids),
                sampling=pb.SamplingParams(temperature=0, max_tokens=GREEDY.max_tokens, ignore_eos=True),
            )
            return [t async for r in stub.Generate(req, timeout=120) for t in r.token_ids]

        async def body(stub: Any, router: Any) -> list[list[int]]:
            return list(await asyncio.gather(*(one(stub, p) for p in prompts)))

        got = asyncio.run(
            with_router([decode], [prefill], loaded.tokenizer, body, routing=RoutingConfig(mode="disaggregated"))
        )
        assert got == want
        wait_all_blocks_free([prefill, decode])
    finally:
        decode.stop()
        prefill.stop()
