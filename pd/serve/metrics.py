"""Prometheus metrics through Ray's metrics API."""

from __future__ import annotations

from ray.util import metrics

# Seconds: from sub-millisecond decode steps to minute-long prompts.
LATENCY_BOUNDARIES = [0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60]


REPLICA_GAUGES = (
    ("kv_blocks_used", "KV blocks with a reference count above zero"),
    ("kv_blocks_free", "KV blocks free (cached or not)"),
    ("requests_running", "requests in the running batch"),
    ("requests_waiting", "requests waiting for admission"),
    ("kv_leases_pinned", "prefill leases holding blocks for a decode replica"),
    ("prefix_hit_tokens", "prompt tokens served from the prefix cache, cumulative"),
    ("prefix_hit_rate", "prefix-cache hit tokens over prompt tokens admitted"),
    ("kv_recompute_fallbacks", "remote prefills recomputed locally, cumulative"),
    ("kv_pulled_blocks", "KV blocks pulled from prefill replicas, cumulative"),
    ("kv_pulled_bytes", "KV bytes pulled from prefill replicas, cumulative"),
    ("kv_pull_seconds", "time spent in KV pulls, cumulative"),
    ("expert_balancedness", "expert parallelism: the least balanced MoE layer's mean over max tokens per rank"),
    ("expert_moves", "expert parallelism: MoE layers whose experts moved between ranks (EPLB), cumulative"),
    ("expert_move_seconds", "expert parallelism: time spent moving expert weights, cumulative"),
    ("spec_drafts", "speculative decoding: verify groups (a request's drafts verified in one step), cumulative"),
    ("spec_draft_tokens", "speculative decoding: draft tokens verified, cumulative"),
    ("spec_accepted_tokens", "speculative decoding: draft tokens accepted, cumulative"),
    ("spec_acceptance_rate", "speculative decoding: draft tokens accepted over verified, since the start"),
    ("spec_mean_accepted", "speculative decoding: draft tokens accepted per verify group, since the start"),
    ("loras_loaded", "LoRA adapters this replica serves by name"),
    ("loras_in_memory", "LoRA adapters whose weights this replica holds in host memory (max_cpu_loras)"),
    ("lora_loads", "LoRA adapters read from disk (first loads, reloads, reads after eviction), cumulative"),
)
# Per KV tier below the device pool, tagged tier=host|disk|shared.
TIER_GAUGES = (
    ("blocks", "KV blocks a lower tier holds now (host, disk, shared: this replica's share)"),
    ("capacity_blocks", "KV blocks a lower tier can hold"),
    ("hit_blocks", "prefix blocks served from the tier, cumulative"),
    ("read_bytes", "bytes read from the tier into device blocks, cumulative"),
    ("read_seconds", "time spent reading from the tier (promotions, loads), cumulative"),
    ("written_blocks", "blocks written to the tier (demoted to host, written through below), cumulative"),
    ("write_seconds", "time spent demoting to host memory, cumulative (lower tiers write off the step)"),
    ("dropped_writes", "blocks not written: gone from device and host, or past the backlog, before a write"),
    ("disabled", "1 once a write failed (a full disk): the tier takes no more writes"),
    ("deleted_blocks", "records deleted: this replica's past its share, and (shared store) any past its total, cumulative"),
)


def _gauges(prefix: str, specs, keys: tuple[str, ...], tags: dict[str, str]) -> dict[str, metrics.Gauge]:
    gauges = {name: metrics.Gauge(f"{prefix}{name}", description=desc, tag_keys=keys) for name, desc in specs}
    for gauge in gauges.values():
        gauge.set_default_tags(tags)
    return gauges


class ReplicaMetrics:
    """Per-replica engine state: KV blocks, requests and KV tiers."""

    def __init__(self, role: str, replica_id: str):
        tags = {"role": role, "replica": replica_id}
        keys = ("role", "replica")
        self._gauges = _gauges("pd_", REPLICA_GAUGES, keys, tags)
        self._tier_gauges = _gauges("pd_kv_tier_", TIER_GAUGES, (*keys, "tier"), tags)
        self.queue = metrics.Histogram(
            "pd_queue_seconds", description="time from arrival on the engine to first admission",
            boundaries=LATENCY_BOUNDARIES, tag_keys=keys,
        )
        self.queue.set_default_tags(tags)
        self._expert_load = metrics.Gauge("pd_expert_load", description="tokens routed to each expert over the "
                                          "load window, all MoE layers (expert parallelism)",
                                          tag_keys=(*keys, "expert"))
        self._expert_load.set_default_tags(tags)

    def record_state(self, stats) -> None:
        values = {
            "kv_blocks_used": stats.num_used_blocks,
            "kv_blocks_free": stats.num_free_blocks,
            "requests_running": stats.num_running,
            "requests_waiting": stats.num_waiting,
            "kv_leases_pinned": stats.num_pinned_leases,
            "prefix_hit_tokens": stats.num_prefix_hit_tokens,
            "prefix_hit_rate": stats.num_prefix_hit_tokens / max(1, stats.num_prompt_tokens),
            "kv_recompute_fallbacks": stats.num_recompute_fallbacks,
            "kv_pulled_blocks": stats.num_pulled_blocks,
            "kv_pulled_bytes": stats.num_pulled_bytes,
            "kv_pull_seconds": stats.pull_seconds_total,
            "expert_balancedness": stats.expert_balancedness,
            "expert_moves": stats.expert_moves,
            "expert_move_seconds": stats.expert_move_seconds,
            "spec_drafts": stats.spec_num_drafts,
            "spec_draft_tokens": stats.spec_num_draft_tokens,
            "spec_accepted_tokens": stats.spec_num_accepted_tokens,
            "spec_acceptance_rate": stats.spec_num_accepted_tokens / max(1, stats.spec_num_draft_tokens),
            "spec_mean_accepted": stats.spec_num_accepted_tokens / max(1, stats.spec_num_drafts),
            "loras_loaded": stats.num_loras_loaded,
            "loras_in_memory": stats.num_loras_in_memory,
            "lora_loads": stats.num_lora_loads,
        }
        for name, value in values.items():
            self._gauges[name].set(value)
        for (name, tier), value in tier_values(stats).items():
            self._tier_gauges[name].set(value, tags={"tier": tier})


    def record_experts(self, expert_stats: dict) -> None:
        """Each expert's tokens over the window, summed over the MoE layers (``LLMEngine.expert_stats``)."""
        loads = expert_stats.get("expert_load")
        if loads:
            for expert, tokens in enumerate(map(sum, zip(*loads.values()))):
                self._expert_load.set(tokens, tags={"expert": str(expert)})


def tier_values(stats) -> dict[tuple[str, str], float]:
    """The KV tiers' gauges, ``(name, tier) -> value``, from ``EngineStats``; empty without tiers."""
    if not stats.host_capacity_blocks:
        return {}
    values = {
        ("blocks", "host"): stats.num_host_cached_blocks,
        ("capacity_blocks", "host"): stats.host_capacity_blocks,
        ("hit_blocks", "host"): stats.num_promoted_blocks - stats.disk_read_blocks - stats.shared_read_blocks,
        ("read_bytes", "host"): stats.num_promoted_bytes,
        ("read_seconds", "host"): stats.promote_seconds,
        ("written_blocks", "host"): stats.num_demoted_blocks,
        ("write_seconds", "host"): stats.demote_seconds,
    }
    for tier in ("disk", "shared"):
        if not getattr(stats, f"{tier}_capacity_blocks"):
            continue
        values.update({
            ("capacity_blocks", tier): getattr(stats, f"{tier}_capacity_blocks"),
            ("blocks", tier): getattr(stats, f"{tier}_blocks"),
            ("hit_blocks", tier): getattr(stats, f"{tier}_read_blocks"),
            ("read_bytes", tier): getattr(stats, f"{tier}_read_bytes"),
            ("read_seconds", tier): getattr(stats, f"{tier}_read_seconds"),
            ("written_blocks", tier): getattr(stats, f"{tier}_written_blocks"),
            ("dropped_writes", tier): getattr(stats, f"{tier}_dropped_writes"),
            ("disabled", tier): getattr(stats, f"{tier}_disabled"),
            ("deleted_blocks", tier): getattr(stats, f"{tier}_deleted_blocks") + getattr(stats, f"{tier}_collected_blocks"),
        })
    return values


class RequestMetrics:
    """Ingress-side latencies and routing counts."""

    def __init__(self, model: str):
        keys = ("model",)
        tags = {"model": model}

        def histogram(name: str, description: str) -> metrics.Histogram:
            h = metrics.Histogram(name, description=description, boundaries=LATENCY_BOUNDARIES, tag_keys=keys)
            h.set_default_tags(tags)
            return h

        self.ttft = histogram("pd_ttft_seconds", "time to first token")
        self.itl = histogram("pd_inter_token_seconds", "time between streamed tokens")
        self.e2e = histogram("pd_e2e_seconds", "request latency, end to end")
        self.prefill = histogram("pd_prefill_seconds", "remote prefill call time")
        self.decode = histogram("pd_decode_seconds", "decode time after the first token")
        self.prefill_path = metrics.Counter(
            "pd_prefill_path_total", description="requests by where their prompt KV came from",
            tag_keys=("model", "path"),
        )
        self.prefill_path.set_default_tags(tags)
        self.prefill_retries = metrics.Counter(
            "pd_prefill_retries_total", description="prefill calls retried on another replica", tag_keys=keys
        )
        self.prefill_retries.set_default_tags(tags)
        self.migrations = metrics.Counter(
            "pd_stream_migrations_total", description="streams continued on another decode replica after "
            "theirs was lost", tag_keys=keys,
        )
        self.migrations.set_default_tags(tags)
        self.lora_requests = metrics.Counter(
            "pd_lora_requests_total", description="requests (each choice one) run under each LoRA adapter",
            tag_keys=("model", "adapter"),
        )
        self.lora_requests.set_default_tags(tags)
