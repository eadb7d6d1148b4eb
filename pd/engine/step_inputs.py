"""A step's inputs: the schedule flattened into host lists every rank runs, and copied to the device.

``flatten`` turns a ``SchedulerOutput`` and the requests' block tables into
``StepLists`` (tokens, positions, slots, the varlen batch's metadata, the rows
that sample or score a prompt) and the ``DriverRows`` only the driver reads;
``to_device`` copies the lists in one transfer and builds the
``ForwardInput`` with its ``AttentionMetadata``.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from pd.engine.host_copy import copy_to_device
from pd.engine.outputs import ForwardInput, SchedulerOutput
from pd.engine.readback import DeviceSamples
from pd.engine.request import Request
from pd.engine.tp.driver import StepLists
from pd.lora import AdapterId
from pd.model.attention import PAD_BLOCK_ID, AttentionMetadata
from pd.model.lora import LoraBuffers, LoraRows
from pd_kernels import NO_LORA


def flatten(out: SchedulerOutput, block_tables: list[list[int]], block_size: int,
        previous: DeviceSamples | None = None,
        lora_slots: Mapping[AdapterId, int] | None = None) -> tuple[StepLists, DriverRows]:
    """The schedule as flat host lists (what every rank runs), and the rows only the driver reads.

    A request's chunk starts after the step in flight's (``Request.num_scheduled_tokens``); a chunk
    ending in the token that step samples takes it from ``previous``, that step's draws, on the device.
    ``lora_slots``: the slot of each adapter the step's requests run under (``pd.lora.slots``).
    """
    bs = block_size
    token_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    cu_seqlens = [0]
    seq_lens: list[int] = []
    logits_indices: list[int] = []
    rows = DriverRows()
    prompt_indices: list[int] = []
    lora_rows: list[int] | None = [] if lora_slots else None
    for item, blocks in zip(out.scheduled, block_tables):
        request = item.request
        start = request.num_scheduled_tokens
        end = start + item.num_new_tokens
        if lora_rows is not None:
            lora_rows.extend([NO_LORA if request.lora is None else lora_slots[request.lora]] * (end - start))
        drafts = item.draft_token_ids  # after the request's last token, in this chunk's tail
        token_ids.extend(request.token_ids[start:end - len(drafts)])
        token_ids.extend(drafts)
        if request.num_tokens < end - len(drafts):  # its last token is the one the step in flight samples
            if previous is None or request not in previous.row_of:
                raise ValueError(f"request {request.request_id}: its token at {request.num_tokens} is "
                                 "unread, and the step in flight does not sample it")
            rows.unread_at.append(len(token_ids))
            rows.unread_rows.append(previous.row_of[request])
            token_ids.append(0)  # overwritten on the device (``to_device``)
        positions.extend(range(start, end))
        slots.extend([blocks[start // bs] * bs + start % bs] if end - start == 1 else  # a decode's one token
                     (blocks[p // bs] * bs + p % bs for p in range(start, end)))
        cu_seqlens.append(len(token_ids))
        seq_lens.append(end)
        if item.samples:
            if drafts:  # a verify group: the last token's row, then one per draft (pd.engine.spec.verify)
                rows.groups[len(rows.sampling_requests)] = drafts
            for offset in range(len(drafts), -1, -1):
                logits_indices.append(len(token_ids) - 1 - offset)
                rows.sampling_requests.append(request)
                rows.sample_offsets.append(len(drafts) - offset)
        scored = request.sampling_params.prompt_logprobs is not None and request.prompt_positions_to_score(start, end)
        if scored:
            offset = len(token_ids) - end  # the flat index of position 0
            prompt_indices.extend(offset + p for p in scored)
            rows.prompt_targets.extend(request.token_ids[p + 1] for p in scored)
            rows.prompt_rows.append((request, len(scored)))
    max_blocks = max(len(b) for b in block_tables)
    table = list(itertools.chain.from_iterable(b + [PAD_BLOCK_ID] * (max_blocks - len(b)) for b in block_tables))
    rows.previous_token_ids = previous.token_ids if rows.unread_at else None
    return StepLists(token_ids, positions, slots, logits_indices + prompt_indices, cu_seqlens, seq_lens, table,
                     max_blocks, lora_rows), rows

def to_device(step: StepLists, rows: DriverRows, device: torch.device, backend: str,
              lora_layers: Sequence[Mapping[str, LoraBuffers]] | None = None) -> ForwardInput:
    """Copy the step's lists to the device in one transfer; the unread tokens come from the step before's
    draws, device to device. ``lora_layers``: the adapters' slots, which ``step.lora_rows`` index."""
    with_lora = step.lora_rows is not None
    int64s, int32s = copy_to_device(
        [step.token_ids, step.positions, step.slots, step.logits_indices, rows.prompt_targets, rows.unread_at,
         rows.unread_rows],
        [step.cu_seqlens, step.seq_lens, step.block_table, *([step.lora_rows] if with_lora else [])], device)
    token_ids_t, positions_t, slots_t, logits_indices_t, prompt_targets_t, unread_at_t, unread_rows_t = int64s
    cu_seqlens_t, seq_lens_t, table_t = int32s[:3]
    if rows.previous_token_ids is not None:
        token_ids_t.index_copy_(0, unread_at_t, rows.previous_token_ids.index_select(0, unread_rows_t))
    attn = AttentionMetadata(
        slot_mapping=slots_t,
        cu_seqlens_q=cu_seqlens_t,
        seq_lens=seq_lens_t,
        block_table=table_t.view(len(step.seq_lens), step.max_blocks),
        backend=backend,
        lora=LoraRows(int32s[3], lora_layers) if with_lora else None,
    )
    return ForwardInput(
        token_ids=token_ids_t,
        positions=positions_t,
        attn=attn,
        logits_indices=logits_indices_t,
        sampling_requests=rows.sampling_requests,
        sample_offsets=rows.sample_offsets if rows.groups else None,
        groups=rows.groups,
        prompt_rows=rows.prompt_rows,
        prompt_targets=prompt_targets_t if rows.prompt_rows else None,
        query_len=uniform_query_len(step.cu_seqlens),
    )


def uniform_query_len(cu_seqlens: list[int]) -> int | None:
    """The new tokens of each sequence when every one has as many (what a CUDA graph replays), else None."""
    if len(cu_seqlens) < 2:
        return None
    first = cu_seqlens[1] - cu_seqlens[0]
    if cu_seqlens[-1] != first * (len(cu_seqlens) - 1):
        return None
    return first if all(b - a == first for a, b in zip(cu_seqlens, cu_seqlens[1:])) else None


@dataclass
class DriverRows:
    """What of a step only the driver reads: the rows it samples and the prompt rows it scores."""

    sampling_requests: list[Request] = field(default_factory=list)
    # Per sampled row, how many tokens after its request's last it samples (0 but in a verify group),
    # and each verify group's first row with its drafts.
    sample_offsets: list[int] = field(default_factory=list)
    groups: dict[int, tuple[int, ...]] = field(default_factory=dict)
    prompt_rows: list[tuple[Request, int]] = field(default_factory=list)
    prompt_targets: list[int] = field(default_factory=list)
    # Flat indices of tokens the step in flight samples, their rows in its draws, and those draws.
    unread_at: list[int] = field(default_factory=list)
    unread_rows: list[int] = field(default_factory=list)
    previous_token_ids: torch.Tensor | None = None  # int64 [previous step's num_samples], on the device
