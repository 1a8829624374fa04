"""The mocker's runner: prices a scheduled batch with the cost model and waits that long.

It stands where engine/model_runner.py's `ModelRunner` stands (`Engine.runner`)
and answers the same call, `run(batch, on_layer_done) -> Sampled`, so that
everything around it (the scheduler's batches, chunked prefill, preemption, the
prefix cache, the KV connector's layer hooks) is the engine's own. A step's time
is `plan/costs.py`'s `mixed_step_s` for what the batch holds: the prefill chunks'
new tokens after their cached ones, and the decode rows over their contexts. A
batch that streams its KV (a prefill worker's) hears each layer's hook at that
layer's share of the step, as the forward pass would call it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from splitserve.bench.mocker.tokens import mocker_token, prompt_key
from splitserve.engine.model_runner import BatchLayerHook
from splitserve.engine.scheduler import Sampled, ScheduledBatch
from splitserve.engine.sequence import Sequence
from splitserve.plan.costs import CostModel, mixed_step_s


def step_seconds(costs: CostModel, batch: ScheduledBatch) -> float:
    """The modelled time of one engine step over `batch`: its prefill chunks (their new tokens, after
    the token-weighted mean of what each had computed) and its decode rows (one token each)."""
    prefill = cached = decode = context = 0
    for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
        if n == 1 and seq.num_computed_tokens >= seq.num_prompt_tokens:
            decode += 1
            context += seq.num_computed_tokens + 1
        else:
            prefill += n
            cached += seq.num_computed_tokens * n
    return mixed_step_s(costs, prefill, cached // prefill if prefill else 0, decode, context)


class ModelledRunner:
    def __init__(
        self,
        costs: CostModel,
        num_layers: int,
        clock: Callable[[], float] = time.perf_counter,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.costs = costs
        self.num_layers = num_layers
        self.clock = clock
        self.sleep = sleep
        self.eos_token_ids: tuple[int, ...] = ()  # the engine sets it; a mocker never samples one
        self.busy_s = 0.0  # modelled seconds of the steps run so far

    def run(self, batch: ScheduledBatch, on_layer_done: BatchLayerHook | None = None) -> Sampled:
        step_s = step_seconds(self.costs, batch)
        start = self.clock()
        if on_layer_done is not None:
            for layer in range(self.num_layers):
                self._until(start + step_s * (layer + 1) / self.num_layers)
                on_layer_done(layer, batch.seqs, batch.num_new_tokens)
        else:
            self._until(start + step_s)
        self.busy_s += step_s
        return _draws(batch)

    def _until(self, deadline: float) -> None:
        left = deadline - self.clock()
        if left > 0:
            self.sleep(left)


def _draws(batch: ScheduledBatch) -> Sampled:
    """A token for each sequence whose step ends at its last token (and for each fork of a fresh
    n > 1 request at its first), from `tokens.mocker_token`."""
    indices: list[int] = []
    tokens: list[int] = []
    samples: list[int] = []
    for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens, strict=True)):
        if seq.num_computed_tokens + n != len(seq):
            continue
        key, position = _key(seq), seq.num_output_tokens
        for k in (seq.sample_index, *seq.fork_indices):
            indices.append(i)
            tokens.append(mocker_token(key, position, k))
            samples.append(k)
    return Sampled(indices, tokens, [None] * len(tokens), samples)


def _key(seq: Sequence) -> int:
    ids, n = seq.token_ids, seq.num_prompt_tokens
    return prompt_key(ids[0], ids[n - 1], n)
