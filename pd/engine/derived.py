"""What an engine derives from its configuration and model before its first step: the pool's size, how
tensor-parallel ranks make their transports, and the KV layout's fingerprint that transfers check."""

from __future__ import annotations

import os

import torch

from pd.config import EngineConfig
from pd.engine.ep.dispatch import check_ep
from pd.engine.kv_budget import DeviceShare, pool_size
from pd.engine.kv_layout import BLOCK_LAYOUT, kv_block_bytes, kv_dtype
from pd.model import kv_scales
from pd.model.config import ModelConfig
from pd.model.loader import resolve_dtype
from pd.model.tp import check_tp
from pd_kernels.fp8 import is_fp8
from transfer.base import KVTransport
from transfer.wire import LayoutFingerprint, TransportKind


def num_pool_blocks(config: EngineConfig, model: ModelConfig, transport: KVTransport | None) -> int | DeviceShare:
    """The pool's blocks (per rank: each holds its heads), or the share of each rank's device the runner fills
    once its weights are in (``pd.engine.kv_budget``), after the checks a tensor- or expert-parallel split needs."""
    check_tp(model, config.tensor_parallel_size, experts=config.expert_parallel_size == 1)
    check_ep(model, config.expert_parallel_size, config.num_redundant_experts)
    if config.num_ranks > 1 and transport is not None and transport.kind is not TransportKind.NIXL:
        raise ValueError(f"the {transport.kind.value} transport moves whole blocks to one rank only; "
                         "tensor_parallel_size or expert_parallel_size > 1 needs the nixl transport")
    pool_dtype = kv_dtype(config.kv_cache_dtype, resolve_dtype(config.dtype, model))
    return pool_size(config, kv_block_bytes(model, config.block_size, pool_dtype, config.tensor_parallel_size))


def worker_transport(transport: KVTransport, engine_id: str) -> dict:
    """How ranks 1..N-1 make transports like rank 0's: its kind, this engine's id, the UCX settings."""
    return {"transport": transport.kind.value, "engine_id": engine_id,
            "transport_env": {k: v for k, v in os.environ.items() if k.startswith("UCX_")}}


def layout_fingerprint(config: EngineConfig, model: ModelConfig, dtype: torch.dtype,
                       scales: tuple[tuple[float, float], ...]) -> LayoutFingerprint:
    """What a peer's KV must match, field for field, before any byte of it moves: ``dtype`` is the pool's,
    and an FP8 pool's per-layer ``scales`` are named by their digest."""
    return LayoutFingerprint(
        model=config.model,
        dtype=str(dtype).removeprefix("torch."),
        kv_scales=kv_scales.digest(scales) if is_fp8(dtype) else "",
        num_layers=model.num_layers,
        num_kv_heads=model.num_kv_heads,
        head_dim=model.kv_head_dim,
        kv_planes=model.kv_planes,
        block_size=config.block_size,
        block_layout=BLOCK_LAYOUT,
        tensor_parallel_size=config.tensor_parallel_size,
    )
