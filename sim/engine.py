"""One engine replica in simulated time: the real ``LLMEngine`` with its model replaced by a cost.

``sim_engine`` builds a real ``LLMEngine`` whose runner is a
``ModelledRunner``: the engine's own step runs unchanged (the scheduler's
admission, chunked prefill, prefix-cache hits, preemption, its update and
bookkeeping), and where it would run the model, the runner says how long
the batch would take (``CostModel``) and draws the sampled tokens from a
seeded generator. The KV tiers run for real: a host tier
(``host_kv_cache_bytes``) with its pool on the meta device too, whose copies
cost ``CostModel.per_host_byte_s`` each byte in the step that copies them;
and a disk tier and a shared store (``disk_kv_cache_path``,
``shared_kv_bucket``: neither is touched) whose records and I/O are modelled
by ``sim.tiers`` in the event loop's time. Requests end at their
``max_tokens`` (``ignore_eos``), as a trace's output lengths say.
"""

from __future__ import annotations

import functools
import random
from pathlib import Path

from pd.config import EngineConfig
from pd.engine.clock import SYSTEM_CLOCK, Clock
from pd.engine.engine import LLMEngine
from pd.engine.kv_layout import kv_pool
from pd.engine.model_runner import step_threads
from pd.engine.outputs import ForwardOutput, SchedulerOutput
from pd.engine.tiers.stats import HostTierStats
from pd.model.config import ModelConfig
from pd.model.loader import resolve_dtype
from sim.clock import EventLoop
from sim.cost import CostModel, StepShape
from sim.tiers import ModelledStore, ModelledTierIO, TierModels
from transfer.base import KVTransport


class ModelledRunner:
    """``ModelRunner``'s interface, without a model: each ``execute`` records its modelled seconds."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, model_dir: Path, num_blocks: int,
                 max_model_len: int, *, cost: CostModel, seed: int, decode_cost: CostModel | None = None):
        self.dtype = resolve_dtype(config.dtype, model_config)
        # The pool's shape, on the meta device: a transport checks its geometry, and no byte exists.
        self.kv_cache = kv_pool(num_blocks, model_config.num_layers, config.block_size, model_config.num_kv_heads,
                                model_config.head_dim, self.dtype, "meta")
        self.vocab_size = model_config.vocab_size
        self.config = config
        self.cost = cost
        # Steps of few tokens on ``config.decode_threads`` (``step_threads``) cost this instead, when given.
        self.decode_cost = decode_cost
        self._tokens = random.Random(seed)
        self.last_step_seconds = 0.0
        self.last_step_threads: int | None = None  # the threads of the last step where not the engine's own
        self.num_steps = 0
        self.host_tier_stats: HostTierStats | None = None  # the engine's host tier, when it has one
        self.tier_io: ModelledTierIO | None = None  # its disk tier's and shared store's, when it has them
        self._copied_blocks = 0

    def execute(self, out: SchedulerOutput, block_tables: list[list[int]]) -> ForwardOutput:
        shape = StepShape.of(out.scheduled)
        self.last_step_threads = step_threads(self.config, shape.num_tokens)
        cost = self.decode_cost if self.last_step_threads is not None and self.decode_cost is not None else self.cost
        self.last_step_seconds = cost.step_seconds(shape) + self._host_copy_seconds()
        self.num_steps += 1
        sampled = [self._tokens.randrange(self.vocab_size) for item in out.scheduled if item.samples]
        return ForwardOutput(sampled_token_ids=sampled, logprobs=None)

    def _host_copy_seconds(self) -> float:
        """The time of the blocks the host tier copied since the last step (the scheduler's promotions, demotions)."""
        stats = self.host_tier_stats
        if stats is None:
            return 0.0
        blocks = stats.num_promoted_blocks + stats.num_demoted_blocks
        copied, self._copied_blocks = blocks - self._copied_blocks, blocks
        return copied * self.kv_cache[0].nbytes * self.cost.per_host_byte_s

    def forget(self, request_id: str) -> None:
        """Nothing is kept per request."""

    def check_health(self) -> None:
        """Nothing runs beside it."""

    def close(self) -> None:
        """Nothing runs beside it."""


def sim_engine(config: EngineConfig, cost: CostModel, seed: int = 0, *, transport: KVTransport | None = None,
               loop: EventLoop | None = None, tier_models: TierModels = TierModels(),
               shared_store: ModelledStore | None = None, decode_cost: CostModel | None = None) -> LLMEngine:
    """A real engine for ``config.model`` (its config and tokenizer are read; no weights are loaded).

    With a ``loop``, the engine's clock is the loop's (leases expire and pulls
    time out in simulated time); a ``transport`` makes it able to serve
    disaggregated requests (``sim.transport``). A disk tier or a shared store
    needs the loop: their I/O lands in it, priced by ``tier_models``;
    ``shared_store`` is the deployment's, one for every replica (a new one
    if None). The runner's ``tier_io.on_event`` is then for the replica's wake.
    """
    if config.tensor_parallel_size != 1:
        raise ValueError("the simulator models a replica as one engine on one device: set tensor_parallel_size "
                         "to 1 and give the cost model the sharded replica's step times")
    tier_io = None
    if config.disk_kv_cache_path or config.shared_kv_bucket:
        if loop is None:
            raise ValueError("a simulated disk tier or shared store lands its I/O in an event loop: pass loop")
        tier_io = ModelledTierIO(loop, tier_models, shared_store)
    clock = SYSTEM_CLOCK if loop is None else Clock(wall=loop.time, monotonic=loop.time)
    engine = LLMEngine(config, transport, make_runner=functools.partial(ModelledRunner, cost=cost, seed=seed,
                                                                  decode_cost=decode_cost),
                       clock=clock, tier_io=tier_io)
    engine.runner.host_tier_stats = engine.tiers.host_stats  # zeros that never change without a host tier
    engine.runner.tier_io = tier_io
    return engine
