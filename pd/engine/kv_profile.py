"""Measuring what a CUDA engine needs beside its KV pool, so that the pool can take the rest.

Every rank's ``ModelRunner`` runs ``fit_pool`` once its weights are in and
before its pool exists, when the pool is a share of the device
(``DeviceShare``, ``pd.engine.kv_budget``), as vLLM's profile run does:

- what the runner took from the device since it started (``free_bytes``
  before the weights, then again now): weights, buffers, workspaces;
- the peak of the largest step: ``max_num_batched_tokens`` tokens over the
  most sequences a step holds, and its sampling's largest temporary;
- the decode CUDA graphs' pool, where a single rank captures them: the
  largest bucket's step run eagerly, and the smaller buckets' logits.

The ranks then agree on the fewest blocks any has room for (each one's
figures are all-gathered over the engine's group). The arithmetic is
``kv_budget``'s; this module only runs the steps and reads torch's CUDA
allocator, and runs on CUDA only. The steps write no KV (``PAD_SLOT_ID``)
and read one scratch block (``PAD_BLOCK_ID``): their memory is a real
step's, their output noise.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from pd.engine.cuda_graphs import captures_graphs, graph_buckets
from pd.engine.kv_budget import DeviceMemory, DeviceShare, graph_reserve, kv_cache_blocks, profile_lengths
from pd.engine.kv_layout import layer_views, model_pool
from pd.model.attention import PAD_BLOCK_ID, AttentionMetadata
from pd_kernels import PAD_SLOT_ID

if TYPE_CHECKING:
    from pd.engine.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def free_bytes(device: torch.device) -> int:
    """The device's free memory now, after this process's cached but unused blocks are given back."""
    return _free_and_total(device)[0]


def profile_step(lengths: list[int], max_blocks: int, *, every_row: bool, device: torch.device,
                 backend: str) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
    """``(token_ids, positions, attn, logits_indices)`` of a step of prefills of token 0, ``lengths[i]`` tokens
    from position 0; logits for ``every_row`` (as a captured decode graph) or each sequence's last token."""
    num_tokens, num_seqs = sum(lengths), len(lengths)
    cu_seqlens = [0]
    for length in lengths:
        cu_seqlens.append(cu_seqlens[-1] + length)
    rows = range(num_tokens) if every_row else [end - 1 for end in cu_seqlens[1:]]

    def ints(values, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(list(values), dtype=dtype, device=device)

    attn = AttentionMetadata(
        slot_mapping=torch.full((num_tokens,), PAD_SLOT_ID, dtype=torch.int64, device=device),
        cu_seqlens_q=ints(cu_seqlens, torch.int32),
        seq_lens=ints(lengths, torch.int32),
        block_table=torch.full((num_seqs, max_blocks), PAD_BLOCK_ID, dtype=torch.int32, device=device),
        backend=backend,
    )
    positions = ints((p for length in lengths for p in range(length)), torch.int64)
    return torch.zeros(num_tokens, dtype=torch.int64, device=device), positions, attn, ints(rows, torch.int64)


def fit_pool(runner: ModelRunner, share: DeviceShare, free_at_start: int, max_model_len: int) -> int:
    """The blocks of each rank's pool: what ``share`` of its device leaves, the fewest of any rank.

    ``free_at_start``: ``free_bytes`` when the runner began, before its
    weights. Every rank runs this at once: the steps' collectives and the
    figures' all-gather pair them up.
    """
    try:
        block_bytes, peak, reserve = _profile(runner, max_model_len)
        free, total = _free_and_total(runner.device)  # the profile's scratch and temporaries given back
        memory = DeviceMemory(total=total, free=free, in_use=max(0, free_at_start - free), peak_activations=peak,
                              graph_reserve=reserve)
        ranks = _all_ranks(memory, runner.group, runner.device)
    except RuntimeError as exc:  # on the driver, a failed collective: what a worker reported says why
        if runner.workers is None:
            raise
        raise runner.workers.failure(exc) from exc
    min_blocks = -(-max_model_len // runner.config.block_size)
    num_blocks = kv_cache_blocks(ranks, share.utilization, block_bytes, min_blocks)
    gib = 1024**3
    logger.info("KV pool: %d blocks (%.1f GiB) from gpu_memory_utilization %s of %.1f GiB: weights and buffers "
                "%.1f GiB, activations %.1f GiB, CUDA graphs %.1f GiB; %.1f GiB free", num_blocks,
                num_blocks * block_bytes / gib, share.utilization, total / gib, memory.in_use / gib, peak / gib,
                reserve / gib, free / gib)
    return num_blocks


def _profile(runner: ModelRunner, max_model_len: int) -> tuple[int, int, int]:
    """``(block_bytes, peak_activations, graph_reserve)``: the steps run on a scratch pool of one block."""
    config, device, backend = runner.config, runner.device, runner.backend
    scratch = model_pool(runner.model_config, 1, config.block_size, runner.local_config.num_kv_heads,
                         runner.kv_dtype, device)
    views = layer_views(scratch)
    lengths = profile_lengths(config.max_num_batched_tokens, config.max_num_seqs, max_model_len)
    largest = profile_step(lengths, -(-max(lengths) // config.block_size), every_row=False, device=device,
                           backend=backend)
    peak, _ = _step_peak(runner, largest, views, sample=True)
    if not (runner.group is None and captures_graphs(config, device, backend)):
        return scratch.nbytes, peak, 0
    # Every graph's rows (a verify graph's k + 1 a sequence); the largest step is profiled as that many
    # one-token sequences: as the graphs are captured, every row's logits, the widest table.
    rows = [bucket * q for q, buckets in graph_buckets(config).items() for bucket in buckets]
    decode = profile_step([1] * max(rows), -(-max_model_len // config.block_size), every_row=True, device=device,
                          backend=backend)
    decode_peak, row_bytes = _step_peak(runner, decode, views, sample=False)
    return scratch.nbytes, peak, graph_reserve(decode_peak, row_bytes, rows)


@torch.inference_mode()
def _step_peak(runner: ModelRunner, step, views, *, sample: bool) -> tuple[int, int]:
    """The most a step holds at once beyond what was live before it, and its logits' bytes a row."""
    device = runner.device
    token_ids, positions, attn, logits_indices = step
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    logits = runner.model.forward(token_ids, positions, attn, views, logits_indices)  # [rows, vocab] fp32
    if runner.experts is not None:
        runner.experts.end_step()
    if sample:
        logits.log_softmax(dim=-1)  # the sampler's largest temporary: every row's log-probabilities
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before, logits[0].nbytes


def _free_and_total(device: torch.device) -> tuple[int, int]:
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(device)


def _all_ranks(memory: DeviceMemory, group, device: torch.device) -> list[DeviceMemory]:
    """Every rank's figures, in rank order (this rank's alone without a group)."""
    if group is None:
        return [memory]
    figures = torch.tensor([memory.total, memory.free, memory.in_use, memory.peak_activations, memory.graph_reserve],
                           dtype=torch.int64, device=device)
    return [DeviceMemory(*row) for row in group.all_gather(figures).tolist()]
