"""Decode and verify steps replayed from CUDA graphs, one per batch-size bucket and query length.

A decode step launches a few hundred small kernels; on a GPU their launch
cost is most of the step at small batches. At engine start each bucket's
forward pass is captured once into a graph over static input buffers. A step
whose every sequence has one new token, and that fits a bucket, copies its
inputs into the first rows of those buffers and replays the smallest bucket
that holds it. Everything else (prefill chunks, mixed steps, larger batches)
runs eagerly. Selected on CUDA only; a CPU engine never builds one.

Rows past the step's own are padding, built so that they cannot touch
anything real:

    row:          0 .. n-1 (the step)        n .. bucket-1 (padding)
    token, pos    the step's                 0, 0
    slot          the step's                 PAD_SLOT_ID: the KV store skips it
    seq_len       the step's                 1: attends to one key of block PAD_BLOCK_ID
    block table   the step's, then PAD       PAD_BLOCK_ID

The padding rows' logits are computed and dropped. ``stage`` fills the
buffers and runs on any device, so the padding rule is tested on CPU.

With speculative decoding, verify steps whose every sequence has the same
``k + 1`` new tokens (the speculator pads drafts to one length where graphs
replay, ``pd.engine.spec.speculator``) replay graphs of their own, captured
for up to ``MAX_VERIFY_GRAPH_BATCH`` sequences: the same rule, ``k + 1`` rows
a sequence, a padding sequence ``k + 1`` rows at positions ``0 .. k`` with
``seq_len`` ``k + 1``.

With LoRA adapters (``enable_lora``) each bucket is captured twice: as it
is, for the steps whose rows use no adapter (which then cost nothing more),
and with the adapters' deltas over a static buffer of each row's slot
(``pd.model.lora``), padding rows taking ``NO_LORA``. A step with adapter
rows replays the second.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from pd.config import EngineConfig
from pd.engine.outputs import ForwardInput
from pd.model.attention import PAD_BLOCK_ID, AttentionMetadata
from pd.model.lora import LoraBuffers, LoraRows
from pd_kernels import NO_LORA, PAD_SLOT_ID

logger = logging.getLogger(__name__)

# The most sequences a verify step's graph is captured for: its logits hold k + 1 rows a sequence.
MAX_VERIFY_GRAPH_BATCH = 64


def captures_graphs(config: EngineConfig, device: torch.device, backend: str) -> bool:
    """Whether a single-rank runner captures decode graphs: ``cuda_graphs`` on, on CUDA, with Triton."""
    return config.cuda_graphs and device.type == "cuda" and backend == "triton"


def max_graph_batch(config: EngineConfig) -> int:
    """The largest decode batch a graph is captured for."""
    return min(config.max_num_seqs, config.cuda_graph_max_batch)


def graph_query_lens(config: EngineConfig) -> tuple[int, ...]:
    """The new tokens a sequence the graphs are captured for: 1, and ``k + 1`` with speculative decoding."""
    spec = config.speculative_config
    return (1,) if spec is None else (1, spec.num_speculative_tokens + 1)


def graph_buckets(config: EngineConfig) -> dict[int, list[int]]:
    """Each captured query length's batch buckets."""
    max_batch = max_graph_batch(config)
    return {q: bucket_sizes(max_batch if q == 1 else min(max_batch, MAX_VERIFY_GRAPH_BATCH))
            for q in graph_query_lens(config)}


def bucket_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16 up to ``max_batch`` (and ``max_batch`` itself)."""
    sizes = [size for size in (1, 2, 4, 8) if size < max_batch]
    sizes += list(range(16, max_batch, 16))
    return sorted(set(sizes + [max_batch]))


@dataclass
class StaticInputs:
    """The buffers a graph reads: ``max_batch`` sequences of ``query_len`` rows each, the first ``n`` live."""

    token_ids: torch.Tensor  # int64 [max_batch * query_len]
    positions: torch.Tensor  # int64 [max_batch * query_len]
    slot_mapping: torch.Tensor  # int64 [max_batch * query_len]
    cu_seqlens_q: torch.Tensor  # int32 [max_batch + 1], 0, q, 2q, ...: query_len tokens per sequence
    seq_lens: torch.Tensor  # int32 [max_batch]
    block_table: torch.Tensor  # int32 [max_batch, max_blocks_per_seq]
    query_len: int = 1
    lora_slots: torch.Tensor | None = None  # int32 [max_batch * query_len]: each row's LoRA slot, with adapters

    @classmethod
    def allocate(cls, max_batch: int, max_blocks_per_seq: int, device: torch.device,
                 query_len: int = 1, lora: bool = False) -> StaticInputs:
        rows = max_batch * query_len
        return cls(
            token_ids=torch.zeros(rows, dtype=torch.int64, device=device),
            positions=torch.arange(query_len, dtype=torch.int64, device=device).repeat(max_batch),
            slot_mapping=torch.full((rows,), PAD_SLOT_ID, dtype=torch.int64, device=device),
            cu_seqlens_q=torch.arange(max_batch + 1, dtype=torch.int32, device=device) * query_len,
            seq_lens=torch.full((max_batch,), query_len, dtype=torch.int32, device=device),
            block_table=torch.full((max_batch, max_blocks_per_seq), PAD_BLOCK_ID, dtype=torch.int32, device=device),
            query_len=query_len,
            lora_slots=torch.full((rows,), NO_LORA, dtype=torch.int32, device=device) if lora else None,
        )

    def view(self, bucket: int, backend: str, lora_layers: Sequence[Mapping[str, LoraBuffers]] | None = None,
             ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """(token_ids, positions, attention metadata) over the first ``bucket`` sequences; with ``lora_layers``,
        each row adds its slot's delta."""
        rows = bucket * self.query_len
        attn = AttentionMetadata(
            slot_mapping=self.slot_mapping[:rows],
            cu_seqlens_q=self.cu_seqlens_q[: bucket + 1],
            seq_lens=self.seq_lens[:bucket],
            block_table=self.block_table[:bucket],
            backend=backend,
            lora=LoraRows(self.lora_slots[:rows], lora_layers) if lora_layers is not None else None,
        )
        return self.token_ids[:rows], self.positions[:rows], attn


def is_decode_only(batch: ForwardInput) -> bool:
    """Every sequence of the step has exactly one new token."""
    return batch.query_len == 1


class DecodeGraphs:
    """Captured forwards per (query length, bucket); ``run`` replays one or returns None.

    ``query_lens``: 1 (decode) and, with speculative decoding, ``k + 1``
    (verify steps of ``k`` drafts a sequence), captured up to
    ``MAX_VERIFY_GRAPH_BATCH`` sequences.
    """

    def __init__(self, model, kv_views, backend: str, max_batch: int, max_blocks_per_seq: int,
                 device: torch.device, query_lens: tuple[int, ...] = (1,),
                 lora_layers: Sequence[Mapping[str, LoraBuffers]] | None = None):
        self.model = model
        self.lora_layers = lora_layers  # the adapters' slots, when the engine serves LoRA
        self.kv_views = kv_views
        self.backend = backend
        self.buckets_of = {q: bucket_sizes(max_batch if q == 1 else min(max_batch, MAX_VERIFY_GRAPH_BATCH))
                           for q in query_lens}  # as graph_buckets says
        self.buckets = self.buckets_of[1]
        self.inputs_of = {q: StaticInputs.allocate(buckets[-1], max_blocks_per_seq, device, q, lora_layers is not None)
                          for q, buckets in self.buckets_of.items()}
        self.inputs = self.inputs_of[1]
        # Keyed by (query length, bucket, whether rows add LoRA deltas).
        self.graphs: dict[tuple[int, int, bool], torch.cuda.CUDAGraph] = {}
        self.logits: dict[tuple[int, int, bool], torch.Tensor] = {}
        self.replays = 0

    def bucket_for(self, num_seqs: int, query_len: int = 1) -> int | None:
        return next((size for size in self.buckets_of.get(query_len, ()) if size >= num_seqs), None)

    def stage(self, batch: ForwardInput, bucket: int, query_len: int = 1) -> None:
        """Copy the step into the first rows of the buffers; reset the rest of the bucket to padding."""
        inputs = self.inputs_of[query_len]
        n = batch.token_ids.shape[0]  # rows: the step's sequences times query_len
        num_seqs = batch.attn.seq_lens.shape[0]
        width = batch.attn.block_table.shape[1]
        if width > inputs.block_table.shape[1]:
            raise ValueError(f"a block table of {width} blocks is wider than the graphs' "
                             f"{inputs.block_table.shape[1]}")
        rows = bucket * query_len
        inputs.token_ids[:n].copy_(batch.token_ids)
        inputs.positions[:n].copy_(batch.positions)
        inputs.slot_mapping[:n].copy_(batch.attn.slot_mapping)
        inputs.seq_lens[:num_seqs].copy_(batch.attn.seq_lens)
        inputs.block_table[:num_seqs, :width].copy_(batch.attn.block_table)
        inputs.block_table[:num_seqs, width:].fill_(PAD_BLOCK_ID)
        inputs.token_ids[n:rows].zero_()
        padding = inputs.positions[n:rows]
        padding.copy_(torch.arange(query_len, device=padding.device).repeat(bucket - num_seqs))
        inputs.slot_mapping[n:rows].fill_(PAD_SLOT_ID)
        inputs.seq_lens[num_seqs:bucket].fill_(query_len)
        inputs.block_table[num_seqs:bucket].fill_(PAD_BLOCK_ID)
        if inputs.lora_slots is not None:
            if batch.attn.lora is not None:
                inputs.lora_slots[:n].copy_(batch.attn.lora.row_slots[:n])
            else:
                inputs.lora_slots[:n].fill_(NO_LORA)
            inputs.lora_slots[n:rows].fill_(NO_LORA)

    def forward(self, bucket: int, query_len: int = 1, lora: bool = False) -> torch.Tensor:
        """The model over the first ``bucket`` sequences of the buffers, logits for every row; ``lora``: with
        each row's adapter delta."""
        token_ids, positions, attn = self.inputs_of[query_len].view(bucket, self.backend,
                                                                    self.lora_layers if lora else None)
        every_row = torch.arange(token_ids.shape[0], device=token_ids.device)
        return self.model.forward(token_ids, positions, attn, self.kv_views, every_row)

    def capture(self) -> None:
        """Capture every bucket of every query length, largest first, sharing one memory pool; logged."""
        started = time.monotonic()
        pool = torch.cuda.graph_pool_handle()
        for query_len, buckets in sorted(self.buckets_of.items(), key=lambda item: -item[1][-1] * item[0]):
            inputs = self.inputs_of[query_len]
            for bucket in reversed(buckets):
                inputs.seq_lens[:bucket].fill_(query_len)
                inputs.slot_mapping[:bucket * query_len].fill_(PAD_SLOT_ID)
                for lora in (False, True) if self.lora_layers is not None else (False,):
                    stream = torch.cuda.Stream()
                    stream.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(stream):
                        self.forward(bucket, query_len, lora)  # compiles the Triton kernels outside the capture
                    torch.cuda.current_stream().wait_stream(stream)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        self.logits[query_len, bucket, lora] = self.forward(bucket, query_len, lora)
                    self.graphs[query_len, bucket, lora] = graph
        torch.cuda.synchronize()
        logger.info("captured %d CUDA graphs (query lengths %s; batch %s) in %.1f s", len(self.graphs),
                    ",".join(map(str, self.buckets_of)), ",".join(map(str, self.buckets)), time.monotonic() - started)

    def run(self, batch: ForwardInput) -> torch.Tensor | None:
        """Logits ``[num_samples, vocab]`` for a step of one query length a sequence that fits a bucket, else None."""
        query_len = batch.query_len
        if query_len is None:
            return None
        bucket = self.bucket_for(batch.attn.seq_lens.shape[0], query_len)
        key = (query_len, bucket, batch.attn.lora is not None)
        if bucket is None or key not in self.graphs:
            return None
        self.stage(batch, bucket, query_len)
        self.graphs[key].replay()
        self.replays += 1
        return self.logits[key][batch.logits_indices]
