"""Engine configuration: frozen dataclasses, validated on construction, no I/O.

These are the one source of the engine's fields, defaults and choices: the
serving layer's pydantic model for the YAML edge is generated from
``EngineConfig`` (``pd.config.app``).

The package is the config layer: ``pd.config.app`` is the serving app's
schema (``AppArgs``, pydantic, the YAML edge) and ``pd.config.autoscaling``
its planner settings. Neither imports Ray at module level, so the simulator
reads the same schema the app validates.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pd.engine.spec.config import SpeculativeConfig

# The dtypes a KV pool and weights may have; "auto" takes the checkpoint's.
DTYPE_NAMES = ("float32", "bfloat16", "float16")
DTYPES = ("auto", *DTYPE_NAMES)
Dtype = Literal[DTYPES]
# The KV pool's element type: "auto" is the model's dtype; FP8 stores each layer's K and V scaled
# (pd_kernels.fp8), half the bytes of bf16.
KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2")
KvCacheDtype = Literal[KV_CACHE_DTYPES]
# pd_kernels.BACKENDS, spelled out: the config layer (which the ingress imports) loads no torch, and
# importing pd_kernels would (tests/test_layering.py checks the two agree).
ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton")
AttentionBackend = Literal[ATTENTION_BACKENDS]
# How a CPU engine stores its dense layers (pd.model.linear): "auto" measures both forms at start.
LINEAR_FORMS = ("auto", "onednn", "dense")
# The sliding window of expert loads is a ring of this many partial sums (pd.engine.ep.load).
EPLB_WINDOW_BUCKETS = 8
LinearForm = Literal[LINEAR_FORMS]
# The largest LoRA rank an engine may be configured for (vLLM's bound).
MAX_LORA_RANK = 512
# The KV pool of an engine off CUDA that names neither num_blocks nor kv_cache_bytes.
DEFAULT_KV_CACHE_BYTES = 2 * 1024**3


@dataclass(frozen=True)
class EngineConfig:
    """What a user asks of one engine.

    ``num_blocks`` fixes the KV pool size; otherwise it is derived from
    ``kv_cache_bytes``; without either, a CUDA engine's pool takes what
    ``gpu_memory_utilization`` of its device leaves once the model is loaded
    and profiled (``pd.engine.kv_budget``), and any other's
    ``DEFAULT_KV_CACHE_BYTES``. ``max_model_len`` defaults to the model's
    ``max_position_embeddings``.
    """

    # A built-in name, a checkpoint directory, a .gguf file (or a directory of one), or a hub id "org/name"
    # (pd.model.paths); ``revision`` is a hub id's branch, tag or commit.
    model: str = "builtin:tiny-llama"
    revision: str | None = None
    dtype: Dtype = "float32"
    device: str = "cpu"
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_bytes: int | None = None
    # CUDA only, without num_blocks or kv_cache_bytes: the share of the device's memory this engine (each
    # rank) may take for its weights, activations, CUDA graphs and KV pool; the pool gets what is left.
    gpu_memory_utilization: float = 0.9
    kv_cache_dtype: KvCacheDtype = "auto"
    # FP8 KV only: a JSON file of each layer's k_scale and v_scale (python -m pd.kv_calibrate
    # writes one). None: the checkpoint's scale tensors where it has them, else 1.0 (pd.model.kv_scales).
    kv_cache_scales: str | None = None
    # A host-memory tier behind the KV pool (``pd.engine.tiers.host``): evicted prefix blocks are
    # copied there and loaded back on a hit. 0: none, an evicted block is gone.
    host_kv_cache_bytes: int = 0
    # A disk tier under the host tier (``pd.engine.tiers.store``): computed blocks are written through
    # to block files under this path (NIXL POSIX) and read back on a hit, also after a restart. Writes
    # stop (a metric and a log line) when the filesystem's free space falls under the minimum.
    disk_kv_cache_path: str | None = None
    disk_kv_cache_bytes: int = 0
    disk_kv_min_free_bytes: int = 1024**3
    # The deployment's shared store: an S3 bucket every replica reads and writes (NIXL OBJ), at
    # the endpoint given (None: AWS). Credentials come from the AWS_* environment variables.
    # ``shared_kv_bytes`` bounds what this replica's writes take there; past it they are deleted.
    # ``shared_kv_total_bytes`` bounds the whole store's blocks of this model, whoever wrote them:
    # past it, a replica deletes the oldest (a replica that stopped leaves its writes behind).
    # 0: no such bound, so give the bucket a lifecycle rule.
    shared_kv_bucket: str | None = None
    shared_kv_endpoint: str | None = None
    shared_kv_bytes: int = 0
    shared_kv_total_bytes: int = 0
    # Blocks each of those tiers may have in flight to it; more are not written (bounds its bandwidth).
    kv_tier_write_slots: int = 32
    max_num_batched_tokens: int = 2048
    # Stall-free batching (pd.engine.step_budget): while decodes run, a prompt chunk is cut so that the
    # step's time, as the engine's step cost fit predicts it, stays within this many seconds (each
    # stream's inter-token gap); None: max_num_batched_tokens alone bounds a step.
    itl_target_s: float | None = None
    # Priority bands (pd.engine.step_budget): a step whose prompt chunks are all less urgent than priority 0
    # keeps its predicted time within this many seconds, so that an urgent prompt arriving meanwhile waits at
    # most about this long for the step in flight; None: such a step is not limited.
    low_priority_step_s: float | None = None
    max_num_seqs: int = 256
    max_model_len: int | None = None
    attention_backend: AttentionBackend = "auto"
    # CPU dense layers: oneDNN-packed weights, or plain transposed ones multiplied by the default BLAS
    # ("dense"); "auto" times both on the model's fused gate/up layer at start and keeps the faster.
    linear_form: LinearForm = "auto"
    # CPU compute threads (torch intra-op); None leaves the process's setting. A Serve
    # replica resolves None from the CPUs Ray assigned it (see pd.serve.engine_server).
    num_threads: int | None = None
    # CPU threads for a step of at most pd.engine.model_runner.DECODE_STEP_TOKENS (8) tokens, a small
    # batch's decode step; None: num_threads. Such a step is a hundred short parallel regions, each
    # waiting for every thread, so on cores shared with other processes fewer threads can finish it
    # sooner. A Serve replica sets it to the CPUs Ray assigned it, rounded down (pd.serve.engine_server).
    decode_threads: int | None = None
    # CUDA only: replay decode steps of up to this many sequences from CUDA graphs captured at start.
    cuda_graphs: bool = True
    cuda_graph_max_batch: int = 256
    # Async scheduling (pd.engine.overlap): step N+1 is scheduled and launched while step N runs on the
    # device, and N's sampled tokens are read after that, so the host's work hides behind the device's.
    # "auto": on where the device is CUDA. One rank only (tensor_parallel_size and expert_parallel_size 1).
    # Outputs are the synchronous engine's; a step after one with structured-output rows, or that may
    # preempt or starts KV pulls, waits for the step before as the synchronous engine does.
    async_scheduling: bool | Literal["auto"] = False
    seed: int = 0
    # Ranks the model is sharded over (Megatron-style, see pd.model.tp): this process is rank 0 and
    # starts the others (pd.engine.tp.driver). Each rank's pool holds its KV heads for ``num_blocks``
    # blocks: ``kv_cache_bytes`` is per rank, and ``gpu_memory_utilization`` a share of each rank's device
    # (every rank takes the fewest blocks any has room for). A collective that takes longer than the
    # timeout (a rank died or hangs) fails the step.
    tensor_parallel_size: int = 1
    tensor_parallel_timeout_s: float = 60.0
    # Ranks a mixture-of-experts model's experts are spread over (expert parallelism, pd.engine.ep):
    # each rank holds (num_experts + num_redundant_experts) / expert_parallel_size of them, and a
    # token's pairs reach their experts as expert_dispatch says. Attention runs on the same ranks,
    # split over them (tensor_parallel_size equal to it) or whole on each (tensor_parallel_size 1).
    expert_parallel_size: int = 1
    # Replicas beyond one per expert, given to the busiest experts by EPLB (pd.engine.ep.placement).
    num_redundant_experts: int = 0
    # How an MoE block reaches the experts on other ranks (pd.engine.ep.dispatch): "all_reduce" runs
    # each (token, expert) pair on the rank holding its expert, from the row that rank already has
    # (every rank holds every token's row, attention being split and all-reduced or whole on each),
    # after one all-gather of the routing; "all_to_all" sends each pair's row to its expert's rank and
    # back, two more collectives and twice the bytes before the block's all-reduce.
    expert_dispatch: Literal["all_to_all", "all_reduce"] = "all_reduce"
    # Steps between rebalances of the expert placement, from each expert's load over the last
    # eplb_window_steps steps; 0: only on demand (LLMEngine.experts.rebalance).
    eplb_interval_steps: int = 0
    eplb_window_steps: int = 1024
    # The most experts a rebalance moves between ranks before one step (0: a whole layer), so that a
    # step waits for at most that many experts' bytes; a layer runs on its old placement until done.
    eplb_moves_per_step: int = 1
    # Prefill role: how long a finished prompt's blocks stay pinned for a decode replica.
    kv_lease_s: float = 30.0
    # Decode role: how long a pull may take before the prompt is recomputed locally.
    kv_read_timeout_s: float = 10.0
    # Speculative decoding (``pd.engine.spec``): a dict as vLLM's speculative_config, or None. Decode steps
    # verify the drafts a lookup proposes; outputs are the non-speculative engine's. Synchronous steps only.
    speculative_config: SpeculativeConfig | None = None
    # LoRA adapters (``pd.lora``), as vLLM's fields: ``max_loras`` adapters running at once (a step's slots),
    # ranks up to ``max_lora_rank``, ``max_cpu_loras`` adapters' weights in host memory (None: max_loras);
    # ``lora_modules`` name -> peft directory, loaded at start.
    enable_lora: bool = False
    max_loras: int = 4
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_modules: dict[str, str] | None = None

    def _check_lora(self) -> None:
        if self.lora_modules and not self.enable_lora:
            raise ValueError(f"lora_modules {sorted(self.lora_modules)} needs enable_lora: true")
        for name in ("max_loras", "max_lora_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_lora_rank > MAX_LORA_RANK:
            raise ValueError(f"max_lora_rank must be <= {MAX_LORA_RANK}, got {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras}): "
                             "an adapter on the device is also held in host memory")
        for name, path in (self.lora_modules or {}).items():
            if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
                raise ValueError(f"lora_modules maps adapter names to peft directories, got {name!r}: {path!r}")

    @property
    def cpu_loras(self) -> int:
        """Adapters whose weights host memory holds: ``max_cpu_loras``, or ``max_loras``."""
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras

    def _check_lower_tiers(self) -> None:
        for tier, where, size in (("disk", "disk_kv_cache_path", "disk_kv_cache_bytes"),
                                  ("shared", "shared_kv_bucket", "shared_kv_bytes")):
            if bool(getattr(self, where)) != bool(getattr(self, size)):
                raise ValueError(f"the {tier} KV tier needs both {where} and {size} (> 0), "
                                 f"got {getattr(self, where)!r} and {getattr(self, size)}")
            if getattr(self, where) and not self.host_kv_cache_bytes:
                raise ValueError(f"the {tier} KV tier loads through host memory: set host_kv_cache_bytes too")
        if self.shared_kv_total_bytes and not self.shared_kv_bucket:
            raise ValueError("shared_kv_total_bytes bounds the shared store: set shared_kv_bucket and shared_kv_bytes too")
        if 0 < self.shared_kv_total_bytes < self.shared_kv_bytes:
            raise ValueError(f"shared_kv_total_bytes {self.shared_kv_total_bytes} is the whole store's bound: it cannot be "
                             f"below one replica's shared_kv_bytes {self.shared_kv_bytes}")
        if self.kv_tier_write_slots < 1:
            raise ValueError(f"kv_tier_write_slots must be >= 1, got {self.kv_tier_write_slots}")

    @property
    def num_ranks(self) -> int:
        """The replica's ranks: its tensor-parallel or expert-parallel size, whichever is larger."""
        return max(self.tensor_parallel_size, self.expert_parallel_size)

    def _check_expert_parallel(self) -> None:
        ep, tp = self.expert_parallel_size, self.tensor_parallel_size
        if ep < 1:
            raise ValueError(f"expert_parallel_size must be >= 1, got {ep}")
        if ep > 1 and tp not in (1, ep):
            raise ValueError(f"expert_parallel_size {ep} with tensor_parallel_size {tp}: attention runs on the "
                             f"expert-parallel ranks, split over all of them (tensor_parallel_size {ep}) or whole on "
                             "each (tensor_parallel_size 1)")
        if self.expert_dispatch not in ("all_to_all", "all_reduce"):
            raise ValueError(f"expert_dispatch must be all_to_all or all_reduce, got {self.expert_dispatch!r}")
        if self.num_redundant_experts < 0:
            raise ValueError(f"num_redundant_experts must be >= 0, got {self.num_redundant_experts}")
        if self.num_redundant_experts and ep == 1:
            raise ValueError(f"num_redundant_experts {self.num_redundant_experts} needs expert_parallel_size > 1: "
                             "redundant replicas balance load between ranks")
        if self.eplb_interval_steps < 0:
            raise ValueError(f"eplb_interval_steps must be >= 0 (0: on demand only), got {self.eplb_interval_steps}")
        if self.eplb_moves_per_step < 0:
            raise ValueError(f"eplb_moves_per_step must be >= 0 (0: a whole layer), got {self.eplb_moves_per_step}")
        if self.eplb_window_steps < EPLB_WINDOW_BUCKETS or self.eplb_window_steps % EPLB_WINDOW_BUCKETS:
            raise ValueError(f"eplb_window_steps must be a positive multiple of {EPLB_WINDOW_BUCKETS}, "
                             f"got {self.eplb_window_steps}")

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.kv_cache_scales is not None and self.kv_cache_dtype == "auto":
            raise ValueError(f"kv_cache_scales {self.kv_cache_scales!r} applies to an FP8 KV cache: set kv_cache_dtype "
                             "to fp8_e4m3 or fp8_e5m2")
        if self.async_scheduling not in (True, False, "auto") or type(self.async_scheduling) not in (bool, str):
            raise ValueError(f"async_scheduling must be true, false or \"auto\", got {self.async_scheduling!r}")
        if self.linear_form not in LINEAR_FORMS:
            raise ValueError(f"linear_form must be one of {LINEAR_FORMS}, got {self.linear_form!r}")
        for name in ("block_size", "max_num_batched_tokens", "max_num_seqs", "cuda_graph_max_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("host_kv_cache_bytes", "disk_kv_cache_bytes", "disk_kv_min_free_bytes", "shared_kv_bytes",
                     "shared_kv_total_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        self._check_lower_tiers()
        self._check_lora()
        object.__setattr__(self, "speculative_config", SpeculativeConfig.of(self.speculative_config))
        if self.speculative_config is not None and self.async_scheduling is True:
            raise ValueError("speculative_config runs with synchronous steps: set async_scheduling to false or "
                             "\"auto\" (a verify step's accepted tokens decide the next step's inputs)")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        self._check_expert_parallel()
        if self.num_ranks > 1 and self.host_kv_cache_bytes:
            raise ValueError("the KV tiers (host_kv_cache_bytes and below) do not run with tensor_parallel_size or "
                             "expert_parallel_size > 1 yet: set one or the other")
        for name in ("kv_lease_s", "kv_read_timeout_s", "tensor_parallel_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.itl_target_s is not None and not self.itl_target_s > 0:
            raise ValueError(f"itl_target_s must be > 0 seconds or None, got {self.itl_target_s}")
        if self.low_priority_step_s is not None and not self.low_priority_step_s > 0:
            raise ValueError(f"low_priority_step_s must be > 0 seconds or None, got {self.low_priority_step_s}")
        for name in ("num_blocks", "kv_cache_bytes", "max_model_len", "num_threads", "decode_threads"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 or None, got {value}")


@dataclass(frozen=True)
class SchedulerConfig:
    """The limits the scheduler enforces, resolved against the loaded model."""

    block_size: int
    num_blocks: int
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    max_loras: int = 0  # LoRA adapters running at once (``EngineConfig.max_loras``); 0: no adapters
