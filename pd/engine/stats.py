"""``EngineStats``: an engine's counters and load, flat scalars, as replicas report them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineStats:
    num_free_blocks: int
    num_used_blocks: int
    num_cached_blocks: int
    num_running: int
    num_waiting: int
    num_waiting_tokens: int  # prompt tokens admitted or queued but not yet computed
    num_prompt_tokens: int  # prompt tokens of every request admitted, cumulative
    num_computed_prompt_tokens: int  # prompt tokens the model computed (not hit in a cache), cumulative
    num_prefix_hit_tokens: int
    num_preemptions: int
    num_pinned_leases: int
    num_leases_expired: int
    num_remote_pulls: int
    num_pulled_blocks: int
    num_pulled_bytes: int
    pull_seconds_total: float
    num_recompute_fallbacks: int
    num_quarantined_blocks: int  # blocks of given-up pulls, held until no byte can land in them
    # The host tier (``pd.engine.tiers.host``); zeros without one.
    num_demoted_blocks: int
    num_promoted_blocks: int
    num_host_cached_blocks: int
    host_capacity_blocks: int
    num_promoted_bytes: int
    promote_seconds: float
    demote_seconds: float
    # Step times (``pd.engine.step_times``), cumulative.
    prefill_seconds: float
    decode_steps: int
    decode_seconds: float
    decode_seqs: int
    decode_seqs_sq: int
    decode_seq_seconds: float
    # Expert parallelism (``pd.engine.ep``): the least balanced MoE layer's balancedness (mean over max
    # tokens per rank) over the load window as of the ranks' last sync, and the expert moves so far.
    expert_balancedness: float = 1.0
    expert_moves: int = 0
    expert_move_seconds: float = 0.0
    # The disk tier and the shared store (``pd.engine.tiers.store``); zeros without them.
    disk_written_blocks: int = 0
    disk_dropped_writes: int = 0
    disk_pending_writes: int = 0
    disk_read_blocks: int = 0
    disk_read_bytes: int = 0
    disk_read_seconds: float = 0.0
    disk_rejected_reads: int = 0
    disk_store_queries: int = 0
    disk_deleted_blocks: int = 0
    disk_collected_blocks: int = 0
    disk_blocks: int = 0
    disk_capacity_blocks: int = 0
    disk_disabled: int = 0
    shared_written_blocks: int = 0
    shared_dropped_writes: int = 0
    shared_pending_writes: int = 0
    shared_read_blocks: int = 0
    shared_read_bytes: int = 0
    shared_read_seconds: float = 0.0
    shared_rejected_reads: int = 0
    shared_store_queries: int = 0
    shared_deleted_blocks: int = 0
    shared_collected_blocks: int = 0
    shared_blocks: int = 0
    shared_capacity_blocks: int = 0
    shared_disabled: int = 0
    # Speculative decoding (``pd.engine.spec``), cumulative: verify groups, draft tokens verified, accepted.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    # LoRA adapters (``pd.lora``): names loaded, weights in host memory, reads from disk (cumulative).
    num_loras_loaded: int = 0
    num_loras_in_memory: int = 0
    num_lora_loads: int = 0
