"""Decode steps replayed from CUDA graphs, one per batch-size bucket.

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
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from pd.config import EngineConfig
from pd.engine.outputs import ForwardInput
from pd.model.attention import PAD_BLOCK_ID, AttentionMetadata
from pd_kernels import PAD_SLOT_ID

logger = logging.getLogger(__name__)


def captures_graphs(config: EngineConfig, device: torch.device, backend: str) -> bool:
    """Whether a single-rank runner captures decode graphs: ``cuda_graphs`` on, on CUDA, with Triton."""
    return config.cuda_graphs and device.type == "cuda" and backend == "triton"


def max_graph_batch(config: EngineConfig) -> int:
    """The largest decode batch a graph is captured for."""
    return min(config.max_num_seqs, config.cuda_graph_max_batch)


def bucket_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16 up to ``max_batch`` (and ``max_batch`` itself)."""
    sizes = [size for size in (1, 2, 4, 8) if size < max_batch]
    sizes += list(range(16, max_batch, 16))
    return sorted(set(sizes + [max_batch]))


@dataclass
class StaticInputs:
    """The buffers a graph reads: ``max_batch`` rows, the first ``n`` of them live each replay."""

    token_ids: torch.Tensor  # int64 [max_batch]
    positions: torch.Tensor  # int64 [max_batch]
    slot_mapping: torch.Tensor  # int64 [max_batch]
    cu_seqlens_q: torch.Tensor  # int32 [max_batch + 1], 0, 1, 2, ...: one token per sequence
    seq_lens: torch.Tensor  # int32 [max_batch]
    block_table: torch.Tensor  # int32 [max_batch, max_blocks_per_seq]

    @classmethod
    def allocate(cls, max_batch: int, max_blocks_per_seq: int, device: torch.device) -> StaticInputs:
        def zeros(*shape, dtype):
            return torch.zeros(*shape, dtype=dtype, device=device)

        return cls(
            token_ids=zeros(max_batch, dtype=torch.int64),
            positions=zeros(max_batch, dtype=torch.int64),
            slot_mapping=torch.full((max_batch,), PAD_SLOT_ID, dtype=torch.int64, device=device),
            cu_seqlens_q=torch.arange(max_batch + 1, dtype=torch.int32, device=device),
            seq_lens=torch.ones(max_batch, dtype=torch.int32, device=device),
            block_table=torch.full((max_batch, max_blocks_per_seq), PAD_BLOCK_ID, dtype=torch.int32, device=device),
        )

    def view(self, bucket: int, backend: str) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """(token_ids, positions, attention metadata) over the first ``bucket`` rows."""
        attn = AttentionMetadata(
            slot_mapping=self.slot_mapping[:bucket],
            cu_seqlens_q=self.cu_seqlens_q[: bucket + 1],
            seq_lens=self.seq_lens[:bucket],
            block_table=self.block_table[:bucket],
            backend=backend,
        )
        return self.token_ids[:bucket], self.positions[:bucket], attn


def is_decode_only(batch: ForwardInput) -> bool:
    """Every sequence of the step has exactly one new token."""
    return batch.token_ids.shape[0] == batch.attn.seq_lens.shape[0]


class DecodeGraphs:
    """Captured decode forwards per bucket; ``run`` replays one or returns None."""

    def __init__(self, model, kv_views, backend: str, max_batch: int, max_blocks_per_seq: int,
                 device: torch.device):
        self.model = model
        self.kv_views = kv_views
        self.backend = backend
        self.buckets = bucket_sizes(max_batch)
        self.inputs = StaticInputs.allocate(max_batch, max_blocks_per_seq, device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.replays = 0

    def bucket_for(self, num_seqs: int) -> int | None:
        return next((size for size in self.buckets if size >= num_seqs), None)

    def stage(self, batch: ForwardInput, bucket: int) -> None:
        """Copy the step into the first rows of the buffers; reset the rest of the bucket to padding."""
        n = batch.token_ids.shape[0]
        inputs = self.inputs
        width = batch.attn.block_table.shape[1]
        if width > inputs.block_table.shape[1]:
            raise ValueError(f"a block table of {width} blocks is wider than the graphs' "
                             f"{inputs.block_table.shape[1]}")
        inputs.token_ids[:n].copy_(batch.token_ids)
        inputs.positions[:n].copy_(batch.positions)
        inputs.slot_mapping[:n].copy_(batch.attn.slot_mapping)
        inputs.seq_lens[:n].copy_(batch.attn.seq_lens)
        inputs.block_table[:n, :width].copy_(batch.attn.block_table)
        inputs.block_table[:n, width:].fill_(PAD_BLOCK_ID)
        inputs.token_ids[n:bucket].zero_()
        inputs.positions[n:bucket].zero_()
        inputs.slot_mapping[n:bucket].fill_(PAD_SLOT_ID)
        inputs.seq_lens[n:bucket].fill_(1)
        inputs.block_table[n:bucket].fill_(PAD_BLOCK_ID)

    def forward(self, bucket: int) -> torch.Tensor:
        """The model over the first ``bucket`` rows of the buffers, logits for every row."""
        token_ids, positions, attn = self.inputs.view(bucket, self.backend)
        every_row = torch.arange(bucket, device=token_ids.device)
        return self.model.forward(token_ids, positions, attn, self.kv_views, every_row)

    def capture(self) -> None:
        """Capture every bucket, largest first, sharing one memory pool; logged with its time."""
        started = time.monotonic()
        pool = torch.cuda.graph_pool_handle()
        for bucket in reversed(self.buckets):
            self.inputs.seq_lens[:bucket].fill_(1)
            self.inputs.slot_mapping[:bucket].fill_(PAD_SLOT_ID)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self.forward(bucket)  # compiles the Triton kernels outside the capture
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[bucket] = self.forward(bucket)
            self.graphs[bucket] = graph
        torch.cuda.synchronize()
        logger.info("captured %d decode CUDA graphs (batch %s) in %.1f s", len(self.graphs),
                    ",".join(map(str, self.buckets)), time.monotonic() - started)

    def run(self, batch: ForwardInput) -> torch.Tensor | None:
        """Logits ``[num_samples, vocab]`` for a decode-only step that fits a bucket, else None."""
        if not is_decode_only(batch):
            return None
        bucket = self.bucket_for(batch.token_ids.shape[0])
        if bucket is None or bucket not in self.graphs:
            return None
        self.stage(batch, bucket)
        self.graphs[bucket].replay()
        self.replays += 1
        return self.logits[bucket][batch.logits_indices]
