"""Per-step attention metadata, built once by the model runner and passed down."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pd.model.lora import LoraRows

# Block-table padding: any valid id works, since attention masks keys by seq_len.
PAD_BLOCK_ID = 0


@dataclass(frozen=True)
class AttentionMetadata:
    """Where this step's tokens go in the paged KV pool and what they attend to.

    A flat varlen batch of ``num_seqs`` sequences and ``num_tokens`` tokens:

        tokens:        | s0 q0 q1 q2 | s1 q0 | s2 q0 q1 |
        cu_seqlens_q:  0             3       4          6
        seq_lens:      KV length of each sequence including this step's tokens
    """

    slot_mapping: torch.Tensor  # int64 [num_tokens]
    cu_seqlens_q: torch.Tensor  # int32 [num_seqs + 1]
    seq_lens: torch.Tensor  # int32 [num_seqs]
    block_table: torch.Tensor  # int32 [num_seqs, max_blocks_per_seq]
    backend: str  # "torch" or "triton"
    lora: LoraRows | None = None  # the step's adapters, where a row has one (pd.model.lora)
