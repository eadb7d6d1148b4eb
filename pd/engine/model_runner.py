"""Owns the model and the KV pool; turns a schedule into a forward pass and samples."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from pathlib import Path

import torch

import pd_kernels
from pd.config import EngineConfig
from pd.engine.cuda_graphs import DecodeGraphs, captures_graphs, graph_query_lens, max_graph_batch
from pd.engine.ep.control import ExpertsControl
from pd.engine.ep.dispatch import ExpertParallel, check_ep
from pd.engine.ep.schedule import EplbSchedule
from pd.engine.kv_budget import DeviceShare
from pd.engine.kv_layout import kv_dtype, layer_views, model_pool
from pd.engine.kv_profile import fit_pool, free_bytes
from pd.engine.outputs import ForwardInput, ForwardOutput, SchedulerOutput
from pd.engine.readback import LaunchedStep, prompt_scores
from pd.engine.sampler import Sampler
from pd.engine.step_inputs import DriverRows, flatten, to_device
from pd.engine.structured import GrammarMask
from pd.engine.tp.driver import Launcher, LoraLoad, StepLists, TPWorkers, start_driver
from pd.engine.tp.group import TPGroup
from pd.lora import AdapterId
from pd.lora.adapter import LoraAdapter, load_adapter
from pd.lora.registry import LoraRegistry
from pd.lora.slots import LoraSlots
from pd.model import kv_scales
from pd.model.config import ModelConfig
from pd.model.linear import choose_form
from pd.model.llama import CausalLM
from pd.model.loader import load_weights, resolve_dtype
from pd.model.rope import cos_sin_cache
from pd.model.tp import SINGLE, TPShard

logger = logging.getLogger(__name__)


# A step of at most this many tokens computes on ``EngineConfig.decode_threads``.
DECODE_STEP_TOKENS = 8


# The warm-up's prefill length: past pd.model.linear.FEW_ROWS, so both forms of the dense layers run.
WARM_UP_TOKENS = 16


def step_threads(config: EngineConfig, num_tokens: int) -> int | None:
    """The CPU threads a step of ``num_tokens`` computes on when not the engine's own: ``decode_threads``
    for a step of at most ``DECODE_STEP_TOKENS``; None otherwise. The simulator prices steps by it."""
    if config.decode_threads is not None and num_tokens <= DECODE_STEP_TOKENS:
        return config.decode_threads
    return None


class ModelRunner:
    """The model and its KV pool, one step at a time.

    With ``tensor_parallel_size`` > 1 this is rank 0, the driver: it starts the
    other ranks through ``launcher`` (local processes unless given; see
    ``pd.engine.tp.driver``), sends them each step's inputs and samples from
    the logits gathered to it. A worker builds its own rank with ``group``.
    """

    def _choose_linear_form(self, config: EngineConfig, model_config: ModelConfig) -> str:
        """``linear_form: auto`` made concrete: the faster form on this host for the MLP's fused gate/up layer."""
        gate_up_rows = 2 * model_config.intermediate_size // config.tensor_parallel_size
        started = time.perf_counter()
        choice = choose_form("auto", self.device, self.dtype, gate_up_rows, model_config.hidden_size,
                             few_rows=self.backend == "cpu")
        if choice.dense_over_onednn:
            logger.info("dense layers: the %s form (dense over oneDNN time: %s; measured in %.2f s)", choice.form,
                        ", ".join(f"{rows} rows {r}" for rows, r in choice.dense_over_onednn.items()),
                        time.perf_counter() - started)
        return choice.form

    def __init__(self, config: EngineConfig, model_config: ModelConfig, model_dir: Path, num_blocks: int | DeviceShare,
                 max_model_len: int, *, launcher: Launcher | None = None, group: TPGroup | None = None,
                 device: torch.device | None = None, worker_transport: dict | None = None,
                 lora: LoraRegistry | None = None):
        self.config = config
        self.model_config = model_config
        self.device = device or torch.device(config.device)
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.dtype = resolve_dtype(config.dtype, model_config)
        self.kv_dtype = kv_dtype(config.kv_cache_dtype, self.dtype)  # the pool's: the model's, or FP8
        self.kv_scales, self.kv_scales_source = kv_scales.for_pool(model_dir, model_config.num_layers, config)
        self.block_size = config.block_size
        self.backend = pd_kernels.resolve_backend(config.attention_backend, self.device)
        if config.linear_form == "auto":  # resolved here, so every rank takes the driver's choice
            config = self.config = dataclasses.replace(config, linear_form=self._choose_linear_form(config, model_config))
        self.linear_form = config.linear_form
        check_ep(model_config, config.expert_parallel_size, config.num_redundant_experts)
        self.workers: TPWorkers | None = None
        if config.num_ranks > 1 and group is None:
            group, self.workers = start_driver(config, model_dir, num_blocks, max_model_len, launcher, self.device,
                                               worker_transport)
        self.group = group
        free_at_start = free_bytes(self.device) if isinstance(num_blocks, DeviceShare) else 0  # before the weights
        tp = config.tensor_parallel_size
        # Attention (and the dense layers) split over the ranks, or whole on each expert-parallel rank.
        shard = TPShard(group.rank, tp) if tp > 1 else SINGLE
        self.experts: ExpertParallel | None = None
        try:
            self.local_config = shard.local_config(model_config, experts=config.expert_parallel_size == 1)
            held, schedule = self._start_experts(config, model_config, group)
            # The cpu backend's few-row kernel takes decode steps' dense layers (pd.model.linear).
            weights = load_weights(model_dir, model_config, self.dtype, self.device, shard, self.linear_form,
                                   few_rows=self.backend == "cpu", experts=held)
            self.weight_bytes = weights.num_bytes
            self._start_lora(config, model_config, shard, lora)
            rope = cos_sin_cache(model_config.rope, model_config.head_dim, max_model_len).to(self.device)
            self.model = CausalLM(self.local_config, weights, rope, group if tp > 1 else None, self.experts,
                                  kv_scales=self.kv_scales)
            self.experts_control = ExpertsControl(self.experts, lambda layer: self.model.weights.layers[layer].moe,
                                                  config.eplb_moves_per_step, schedule, self.workers)
            if isinstance(num_blocks, DeviceShare):  # the weights are in: the pool takes what the share leaves
                num_blocks = fit_pool(self, num_blocks, free_at_start, max_model_len)
            # Block-major, heads outermost in a block (pd.engine.kv_layout). A tensor-parallel rank's pool
            # holds its own KV heads; block ids are the same on every rank.
            self.kv_cache = model_pool(model_config, num_blocks, config.block_size, self.local_config.num_kv_heads,
                                       self.kv_dtype, self.device)
            if self.workers is not None:
                self.workers.wait_ready()
        except BaseException:
            self.close()
            raise
        # Per-layer strided views [num_blocks, block_size, num_kv_heads, head_dim].
        self.kv_views = layer_views(self.kv_cache)
        self.sampler = Sampler(config.seed, self.device)
        self.graphs = self._decode_graphs(max_model_len) if group is None else None

    def _start_experts(self, config: EngineConfig, model_config: ModelConfig, group: TPGroup | None):
        """Expert parallelism's parts of this rank: ``(its experts of the first MoE layer, when the ranks sync and
        move experts: the driver's)``; ``(None, None)`` without it."""
        if config.expert_parallel_size == 1:
            return None, None
        self.experts = ExpertParallel.for_model(group, model_config, config, self.device)
        schedule = EplbSchedule(self.experts.moe_layers, config.eplb_interval_steps) \
            if self.workers is not None else None
        return self.experts.held(self.experts.moe_layers[0]), schedule

    def _start_lora(self, config: EngineConfig, model_config: ModelConfig, shard: TPShard,
                    registry: LoraRegistry | None) -> None:
        """LoRA adapters' slots (``pd.lora.slots``), on the device before the pool takes what is left; the
        driver's ``registry`` says what to load (a worker rank is told, ``load_lora_slot``)."""
        self.lora_registry = registry
        self.lora_slots = LoraSlots(model_config, config.max_loras, config.max_lora_rank, self.dtype, self.device,
                                    shard) if config.enable_lora else None
        self._rank_adapters: dict[tuple[str, str], LoraAdapter] = {}  # a worker rank's adapters read

    def _decode_graphs(self, max_model_len: int) -> DecodeGraphs | None:
        """Decode steps replayed from CUDA graphs captured now (CUDA and Triton, one rank); None elsewhere."""
        config = self.config
        if not captures_graphs(config, self.device, self.backend):
            return None
        graphs = DecodeGraphs(self.model, self.kv_views, self.backend, max_batch=max_graph_batch(config),
                              max_blocks_per_seq=-(-max_model_len // config.block_size), device=self.device,
                              query_lens=graph_query_lens(config),
                              lora_layers=self.lora_slots.layers if self.lora_slots is not None else None)
        graphs.capture()
        return graphs

    @torch.inference_mode()
    def warm_up(self) -> None:
        """One prefill step and one decode step over the first blocks of the empty pool, on every rank.

        Run before the engine takes requests, so that whatever the first step pays once (loading the
        kernels, oneDNN's and the allocator's first calls) is paid at start, not by a request. The blocks
        it writes are free and hold nothing yet; their next owner overwrites each slot before reading it.
        """
        bs = self.block_size
        num_tokens = max(1, min(WARM_UP_TOKENS, self.kv_cache.shape[0] * bs - 1))
        blocks = list(range(-(-(num_tokens + 1) // bs)))
        for start, end in ((0, num_tokens), (num_tokens, num_tokens + 1)):
            positions = list(range(start, end))
            slots = [blocks[p // bs] * bs + p % bs for p in positions]
            step = StepLists(token_ids=[0] * len(positions), positions=positions, slots=slots,
                             logits_indices=[len(positions) - 1], cu_seqlens=[0, len(positions)], seq_lens=[end],
                             block_table=blocks, max_blocks=len(blocks))
            if self.workers is not None:
                self.workers.send(step)
            batch = to_device(step, DriverRows(), self.device, self.backend)
            with self._step_threads(len(positions)):
                self._forward(batch)

    def forget(self, request_id: str) -> None:
        """A request ended: drop what sampling kept for it."""
        self.sampler.forget(request_id)

    def ranks(self) -> list[dict[str, int]]:
        """Each rank's process and the bytes of weights it holds (one entry without tensor parallelism)."""
        ranks = [{"rank": 0, "pid": os.getpid(), "weight_bytes": self.weight_bytes}]
        if self.workers is not None:
            ranks += [{"rank": r.rank, "pid": r.pid, "weight_bytes": r.weight_bytes}
                      for r in sorted(self.workers.ready.values(), key=lambda r: r.rank)]
        return ranks

    def rank_transport_metadata(self) -> list[bytes]:
        """Ranks 1..N-1's KV transports' metadata (``worker_transport``), in rank order."""
        if self.workers is None:
            return []
        return [self.workers.ready[rank].transport_metadata for rank in sorted(self.workers.ready)]

    def check_health(self) -> None:
        """Raise ``TPWorkerError`` if a tensor-parallel worker died, even while no step runs."""
        if self.workers is not None:
            self.workers.check_alive()

    def close(self) -> None:
        """Stop the tensor-parallel workers (if any) and leave the group."""
        if self.workers is not None:
            self.workers.close()
            self.workers = None
        if self.group is not None:
            self.group.close()

    def prepare(self, out: SchedulerOutput, block_tables: list[list[int]]) -> ForwardInput:
        """Flatten the schedule into host lists, then copy them all to the device in one transfer."""
        return to_device(*flatten(out, block_tables, self.block_size, None, self._lora_slots(out)), self.device,
                         self.backend, self.lora_slots.layers if self.lora_slots is not None else None)

    @torch.inference_mode()
    def forward(self, step: StepLists) -> torch.Tensor:
        """A worker rank's part of a step: the forward pass, its collectives and its KV writes."""
        batch = to_device(step, DriverRows(), self.device, self.backend,
                          self.lora_slots.layers if self.lora_slots is not None else None)
        logits = self.model.forward(batch.token_ids, batch.positions, batch.attn, self.kv_views,
                                    batch.logits_indices)
        if self.experts is not None:
            self.experts.end_step()
        return logits

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, block_tables: list[list[int]]) -> ForwardOutput:
        """Run the step and read what it sampled: ``launch``, then ``collect``."""
        return self.collect(self.launch(out, block_tables))

    @property
    def can_launch_ahead(self) -> bool:
        """Whether a step may launch before the one in flight is read (async scheduling): one rank only, as
        the other ranks would need the unread tokens sent."""
        return self.workers is None

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput, block_tables: list[list[int]],
               previous: LaunchedStep | None = None) -> LaunchedStep:
        """Queue the step's forward and sampling on the device, and the copy back of what it sampled.

        ``previous``: the step in flight, not yet read; rows ending in a token it samples take it from there.
        Nothing here waits for the device (on CUDA: ``bench.step_syncs``).
        """
        step, rows = flatten(out, block_tables, self.block_size, previous.samples if previous is not None else None,
                             self._lora_slots(out))
        self.experts_control.before_step()
        if self.workers is not None:
            self.workers.send(step)
        batch = to_device(step, rows, self.device, self.backend,
                          self.lora_slots.layers if self.lora_slots is not None else None)
        # Masks are filled before the forward pass, not beside it on a worker thread: with the
        # forward using every core, the overlap measured slower (bench.engine's structured case).
        mask = GrammarMask.for_rows([r.grammar for r in batch.sampling_requests], self.model_config.vocab_size,
                                    batch.groups)
        if mask is not None:
            mask.fill()
        logits = self.graphs.run(batch) if self.graphs is not None else None
        if logits is None:
            with self._step_threads(len(batch.token_ids)):
                logits = self._forward(batch)
        num_samples = len(batch.sampling_requests)
        scores = prompt_scores(logits[num_samples:], batch.prompt_targets, batch.prompt_rows) \
            if batch.prompt_rows else None
        samples = self.sampler.draw(logits[:num_samples], batch.sampling_requests, mask, scores, batch.sample_offsets)
        return LaunchedStep(samples, mask)

    def _lora_slots(self, out: SchedulerOutput) -> dict[AdapterId, int] | None:
        """The slot of each adapter the step's requests run under, loading those not held; None when none
        has one (the step adds no delta)."""
        if self.lora_slots is None:
            return None
        keys = dict.fromkeys(item.request.lora for item in out.scheduled if item.request.lora is not None)
        if not keys:
            return None
        return self.lora_slots.assign(((key, self.lora_registry.weights(key)) for key in keys),
                                      self._tell_ranks if self.workers is not None else None)

    def adapter_names(self) -> tuple[str, ...]:
        """The names of the adapters in its slots, each once, in slot order (what its replica reports)."""
        if self.lora_slots is None:
            return ()
        return tuple(dict.fromkeys(key.name for key in self.lora_slots.table.held if key is not None))

    def _tell_ranks(self, slot: int, key: AdapterId) -> None:
        """Have every worker rank load its shard of ``key`` into ``slot`` before the step."""
        load = LoraLoad(slot, key.name, self.lora_registry.path_of(key), key.digest)
        for rank in range(1, self.config.tensor_parallel_size):
            self.workers.send_to(rank, load)

    def load_lora_slot(self, slot: int, name: str, path: str, digest: str) -> None:
        """A worker rank: load its shard of adapter ``name`` (the weights of ``digest``) into ``slot``. The
        last ``max_cpu_loras`` adapters read are kept."""
        adapter = self._rank_adapters.pop((name, digest), None)
        if adapter is None:
            adapter = load_adapter(name, path, self.model_config, self.config.max_lora_rank)
            if adapter.digest != digest:
                raise ValueError(f"LoRA adapter {name!r} at {path} changed since the driver loaded it")
        self._rank_adapters[name, digest] = adapter
        while len(self._rank_adapters) > self.config.cpu_loras:
            del self._rank_adapters[next(iter(self._rank_adapters))]
        self.lora_slots.load(slot, adapter)

    @staticmethod
    def collect(launched: LaunchedStep) -> ForwardOutput:
        """Read a launched step's samples (its one wait for the device), its grammars fed their tokens."""
        forward = launched.samples.read()
        return forward if launched.mask is None else advance_grammars(launched.mask, forward)

    @contextlib.contextmanager
    def _step_threads(self, num_tokens: int):
        """The step's compute threads: ``decode_threads`` for a step of few tokens on one CPU rank."""
        threads = step_threads(self.config, num_tokens)
        if (threads is None or self.device.type != "cpu" or self.workers is not None
                or threads == torch.get_num_threads()):
            yield
            return
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            yield
        finally:
            torch.set_num_threads(previous)

    def _forward(self, batch: ForwardInput) -> torch.Tensor:
        if self.workers is None:
            return self.model.forward(batch.token_ids, batch.positions, batch.attn, self.kv_views,
                                      batch.logits_indices)
        try:
            logits = self.model.forward(batch.token_ids, batch.positions, batch.attn, self.kv_views,
                                        batch.logits_indices)
        except RuntimeError as exc:
            raise self.workers.failure(exc) from exc
        if self.experts is not None:
            self.experts.end_step()
        return logits


def advance_grammars(mask: GrammarMask, forward: ForwardOutput) -> ForwardOutput:
    """Feed each grammar row its sampled token: a rejected token fails its row, a finished grammar stops it."""
    errors, stop_rows = mask.accept(forward.sampled_token_ids, forward.errors)
    if errors:
        sampled = [None if row in errors else token for row, token in enumerate(forward.sampled_token_ids)]
        forward = dataclasses.replace(forward, sampled_token_ids=sampled, errors=forward.errors | errors)
    if stop_rows:
        forward = dataclasses.replace(forward, stop_rows=forward.stop_rows | stop_rows)
    return forward
