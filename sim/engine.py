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

With ``enable_lora``, the engine's own adapter code runs (``sim.adapters``):
its ``LoraManager`` resolves a request's adapter from the deployment's
``AdapterCatalog``, its scheduler admits at most ``max_loras`` adapters at
once, and before each step the runner gives the step's adapters slots with
the engine's ``SlotTable``, each load costing its bytes at the host link's
rate (``CostModel.per_host_byte_s``) in that step. A replica reports the
adapters in its slots (``routing_stats``).

A replica over several GPUs by expert parallelism (``expert_parallel_size``
n, attention split over the same ranks: ``tensor_parallel_size`` n) is one
engine too, as in a deployment, where rank 0 schedules for all of them: its
pool has the blocks each rank's ``kv_cache_bytes`` holds of its KV heads
(``num_pool_blocks``), and its ``CostModel`` must be priced for its ranks
(``sim.hardware.analytic_cost`` with ``ExpertParallel(n)``: the busiest
rank's step, the all-to-alls included). Its ranks are not simulated one by
one, and its KV moves between pools as one replica's (one link's bytes, not
n links in parallel).
"""

from __future__ import annotations

import dataclasses
import functools
import random
from dataclasses import dataclass
from pathlib import Path

from pd.config import EngineConfig
from pd.engine.clock import SYSTEM_CLOCK, Clock
from pd.engine.derived import num_pool_blocks
from pd.engine.engine import LLMEngine
from pd.engine.ep.control import ExpertsControl
from pd.engine.kv_budget import sized_from_device
from pd.engine.kv_layout import kv_dtype, model_pool
from pd.engine.model_runner import step_threads
from pd.engine.outputs import ForwardOutput, SchedulerOutput
from pd.engine.tiers.stats import HostTierStats
from pd.lora import AdapterId
from pd.lora.registry import LoraRegistry
from pd.lora.slot_table import SlotTable
from pd.model.config import ModelConfig, load_model_config
from pd.model.kv_scales import unit_scales
from pd.model.loader import resolve_dtype
from router.protocol import RoutingStats
from sim.adapters import NO_ADAPTERS, AdapterCatalog
from sim.clock import EventLoop
from sim.cost import CostModel, StepShape
from sim.tiers import ModelledStore, ModelledTierIO, TierModels
from transfer.base import KVTransport


@dataclass(frozen=True)
class DraftModel:
    """How a workload's drafts fare, for a simulated engine that speculates (``EngineConfig.speculative_config``).

    ``found``: the share of a request's decode steps whose lookup finds a draft
    (of the full length asked); ``acceptance``: the chance the target draws
    each draft token, given it drew the ones before. The engine's own
    ``Speculator`` decides, from its fit of the modelled step times, which
    requests verify how many (``pd.engine.spec.speculator``).
    """

    found: float = 1.0
    acceptance: float = 0.7

    def __post_init__(self) -> None:
        for name in ("found", "acceptance"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"DraftModel.{name} must be in [0, 1], got {getattr(self, name)}")


class ModelledProposer:
    """``pd.engine.spec.base.Proposer`` without tokens to look up: a draft of the length asked, ``found`` of the
    time, from a seeded stream."""

    def __init__(self, model: DraftModel, vocab_size: int, seed: int):
        self.model, self.vocab_size = model, vocab_size
        self._random = random.Random(seed)

    def propose(self, request_id: str, token_ids, k: int) -> list[int]:
        if self._random.random() >= self.model.found:
            return []
        return [self._random.randrange(self.vocab_size) for _ in range(k)]

    def finish(self, request_id: str, token_ids, num_prompt_tokens: int) -> None:
        """Nothing is kept per request."""


class ModelledRunner:
    """``ModelRunner``'s interface, without a model: each ``execute`` records its modelled seconds."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, model_dir: Path, num_blocks: int,
                 max_model_len: int, *, cost: CostModel, seed: int, decode_cost: CostModel | None = None,
                 adapters: AdapterCatalog = NO_ADAPTERS, lora: LoraRegistry | None = None):
        self.dtype = resolve_dtype(config.dtype, model_config)
        self.kv_dtype = kv_dtype(config.kv_cache_dtype, self.dtype)
        self.kv_scales = unit_scales(model_config.num_layers)  # an FP8 pool's, as a checkpoint without any
        # The pool's shape, on the meta device: a transport checks its geometry, and no byte exists.
        self.kv_cache = model_pool(model_config, num_blocks, config.block_size, model_config.num_kv_heads,
                                   self.kv_dtype, "meta")
        self.vocab_size = model_config.vocab_size
        self.config = config
        self.cost = cost
        # Steps of few tokens on ``config.decode_threads`` (``step_threads``) cost this instead, when given.
        self.decode_cost = decode_cost
        self._tokens = random.Random(seed)
        self.last_step_seconds = 0.0
        self.last_step_threads: int | None = None  # the threads of the last step where not the engine's own
        self.num_steps = 0
        self.num_fast_forwarded_steps = 0  # of ``num_steps``: those a fast-forwarded run made (``record_run``)
        self.host_tier_stats: HostTierStats | None = None  # the engine's host tier, when it has one
        self.tier_io: ModelledTierIO | None = None  # its disk tier's and shared store's, when it has them
        self.drafts: DraftModel | None = None  # with speculative decoding: how its lookups fare
        self._copied_blocks = 0
        self._block_bytes = self.kv_cache[0].nbytes  # a meta tensor's size costs a torch call: read it once
        # LoRA: the engine's slot policy, each load the catalog's bytes (``lora``, the engine's registry, as
        # ``ModelRunner`` takes it: its adapters hold no weights here).
        self.adapters = adapters
        self.lora_slots = SlotTable(config.max_loras) if config.enable_lora else None

    def execute(self, out: SchedulerOutput, block_tables: list[list[int]]) -> ForwardOutput:
        seconds, self.last_step_threads = self.price(StepShape.of(out.scheduled))
        self.last_step_seconds = seconds + self._host_copy_seconds() + self._adapter_load_seconds(out)
        self.num_steps += 1
        if self.drafts is not None and any(item.draft_token_ids for item in out.scheduled):
            sampled = [token for item in out.scheduled if item.samples for token in self._verify(item)]
        else:
            sampled = self.sample(sum(item.samples for item in out.scheduled))
        return ForwardOutput(sampled_token_ids=sampled, logprobs=None, modelled_seconds=self.last_step_seconds)

    def _verify(self, item) -> list[int]:
        """A verify group's rows (``pd.engine.spec.verify``): each draft is what the target draws with
        probability ``drafts.acceptance``, given the ones before it were; the rows after a miss are anything."""
        drafts, rows = item.draft_token_ids, []
        for draft in drafts:
            if self._tokens.random() >= self.drafts.acceptance:
                rows.append((draft + 1) % self.vocab_size)
                break
            rows.append(draft)
        return rows + self.sample(len(drafts) + 1 - len(rows))

    def price(self, shape: StepShape) -> tuple[float, int | None]:
        """A step of ``shape``: its modelled seconds, the host tier's copies left out, and its threads where
        not the engine's own (``step_threads``: ``decode_cost`` prices it then, when given)."""
        threads = step_threads(self.config, shape.num_tokens)
        cost = self.decode_cost if threads is not None and self.decode_cost is not None else self.cost
        return cost.step_seconds(shape), threads

    def sample(self, num_samples: int) -> list[int]:
        """The next ``num_samples`` token ids of this runner's one seeded stream, rows of a step in order."""
        randrange, vocab_size = self._tokens.randrange, self.vocab_size
        return [randrange(vocab_size) for _ in range(num_samples)]

    def record_run(self, seconds: list[float], threads: int | None) -> None:
        """Steps run without ``execute`` (``sim.fast_forward``; their tokens from ``sample``), counted as its.

        Their adapters were in slots all along (``holds_adapters``) and are not marked used: a run ends
        before a step of the engine's own that runs every one of them, so the slots' order comes out the same.
        """
        self.num_steps += len(seconds)
        self.num_fast_forwarded_steps += len(seconds)
        self.last_step_seconds, self.last_step_threads = seconds[-1], threads

    def _adapter_load_seconds(self, out: SchedulerOutput) -> float:
        """The step's adapters take slots (``ModelRunner._lora_slots``' policy); the time of the loads that takes.
        They come in the schedule's order, not a set's (whose order follows the process's string hashes), so
        that a run repeats exactly."""
        if self.lora_slots is None:
            return 0.0
        keys = dict.fromkeys(item.request.lora for item in out.scheduled if item.request.lora is not None)
        if not keys:
            return 0.0
        _, loads = self.lora_slots.assign(keys)
        return self.adapters.load_bytes(key for key, _ in loads) * self.cost.per_host_byte_s

    def holds_adapters(self, keys: frozenset[AdapterId]) -> bool:
        """Whether every one of ``keys`` sits in a slot (a step of them loads nothing)."""
        return not keys or (self.lora_slots is not None and keys <= set(self.lora_slots.held))

    @property
    def num_adapter_loads(self) -> int:
        """Adapters copied into slots so far."""
        return self.lora_slots.num_loads if self.lora_slots is not None else 0

    def adapter_names(self) -> tuple[str, ...]:
        """The names of the adapters in its slots, each once, in slot order."""
        if self.lora_slots is None:
            return ()
        return tuple(dict.fromkeys(key.name for key in self.lora_slots.held if key is not None))

    def _host_copy_seconds(self) -> float:
        """The time of the blocks the host tier copied since the last step (the scheduler's promotions, demotions)."""
        stats = self.host_tier_stats
        if stats is None:
            return 0.0
        blocks = stats.num_promoted_blocks + stats.num_demoted_blocks
        copied, self._copied_blocks = blocks - self._copied_blocks, blocks
        return copied * self._block_bytes * self.cost.per_host_byte_s

    def forget(self, request_id: str) -> None:
        """Nothing is kept per request."""

    # No expert placement runs (an expert-parallel replica's balance is its cost's ``balancedness``).
    experts_control = ExpertsControl(None)

    def check_health(self) -> None:
        """Nothing runs beside it."""

    def close(self) -> None:
        """Nothing runs beside it."""


def sim_engine(config: EngineConfig, cost: CostModel, seed: int = 0, *, transport: KVTransport | None = None,
               loop: EventLoop | None = None, tier_models: TierModels = TierModels(),
               shared_store: ModelledStore | None = None, decode_cost: CostModel | None = None,
               drafts: DraftModel | None = None, adapters: AdapterCatalog = NO_ADAPTERS) -> LLMEngine:
    """A real engine for ``config.model`` (its config and tokenizer are read; no weights are loaded).

    With a ``loop``, the engine's clock is the loop's (leases expire and pulls
    time out in simulated time); a ``transport`` makes it able to serve
    disaggregated requests (``sim.transport``). A disk tier or a shared store
    needs the loop: their I/O lands in it, priced by ``tier_models``;
    ``shared_store`` is the deployment's, one for every replica (a new one
    if None). The runner's ``tier_io.on_event`` is then for the replica's wake.
    With ``enable_lora``, requests may name the adapters of ``adapters``.
    """
    config = one_engine(config, cost)
    tier_io = None
    if config.disk_kv_cache_path or config.shared_kv_bucket:
        if loop is None:
            raise ValueError("a simulated disk tier or shared store lands its I/O in an event loop: pass loop")
        tier_io = ModelledTierIO(loop, tier_models, shared_store)
    clock = SYSTEM_CLOCK if loop is None else Clock(wall=loop.time, monotonic=loop.time)
    engine = LLMEngine(config, transport, make_runner=functools.partial(ModelledRunner, cost=cost, seed=seed,
                                                                  decode_cost=decode_cost, adapters=adapters),
                       clock=clock, tier_io=tier_io, lora_loader=adapters.load)
    if engine.lora is not None:
        adapters.serve(engine)
    engine.runner.host_tier_stats = engine.tiers.host_stats  # zeros that never change without a host tier
    engine.runner.tier_io = tier_io
    if engine.speculator is not None:  # the real speculator plans; its lookups and their fate are modelled
        engine.runner.drafts = drafts or DraftModel()
        engine.speculator.proposer = ModelledProposer(engine.runner.drafts, engine.model_config.vocab_size, seed)
    return engine


def routing_stats(engine: LLMEngine, after_seq: int | None = None) -> RoutingStats:
    """``engine.routing_stats``: what a replica reports, the adapters in its runner's slots among it."""
    return engine.routing_stats(after_seq=after_seq)


def one_engine(config: EngineConfig, cost: CostModel) -> EngineConfig:
    """The one engine that simulates a replica of ``config``: itself on one device; an expert-parallel
    replica's rank 0 with the blocks every rank's pool holds (each its heads), its cost priced for its ranks."""
    if sized_from_device(config):
        raise ValueError(f"engine on {config.device} sizes its KV pool from the device's memory "
                         "(gpu_memory_utilization), which the simulator has none of: give engine.kv_cache_bytes "
                         "or num_blocks (sim.hardware.kv_cache_bytes is what a GPU leaves after the weights)")
    ranks = config.num_ranks
    if ranks == 1:
        return config
    if config.tensor_parallel_size != ranks or config.expert_parallel_size != ranks:
        raise ValueError(f"the simulator prices a replica over several devices only as expert parallelism with "
                         f"attention split over the same ranks: tensor_parallel_size {config.tensor_parallel_size} "
                         f"and expert_parallel_size {config.expert_parallel_size} must be equal")
    priced = cost.experts.num_ranks if cost.experts is not None else 1
    if priced != ranks or cost.collectives is None:
        raise ValueError(f"a replica of {ranks} expert-parallel ranks needs a cost priced for them "
                         f"(sim.hardware.analytic_cost with ExpertParallel({ranks})), got one for {priced}")
    blocks = config.num_blocks or num_pool_blocks(config, load_model_config(config.model), None)
    return dataclasses.replace(config, tensor_parallel_size=1, expert_parallel_size=1, num_redundant_experts=0,
                               num_blocks=blocks)
