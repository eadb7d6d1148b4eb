"""A request's state as the engine sees it: token ids in, token ids out."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pd.engine.logprobs import PromptLogprob
from pd.lora import AdapterId
from pd.sampling_params import SamplingParams
from router.hashing import ROOT_HASH
from transfer.wire import KVHandle

if TYPE_CHECKING:
    from pd.engine.structured import RequestGrammar


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    # Admitted on a decode replica; its prompt KV is being pulled from a prefill replica.
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"
    RUNNING = "running"
    FINISHED = "finished"


class KVSource(enum.Enum):
    """Where a request's prompt KV came from."""

    LOCAL = "local"  # computed by this engine
    REMOTE = "remote"  # pulled from a prefill replica
    RECOMPUTE = "recompute"  # a pull was planned but failed, so it was computed here


class FinishReason(enum.Enum):
    STOP = "stop"  # EOS or a stop token
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"
    ERROR = "error"  # this request alone failed (say, its logits were not finite); the error says why


def finish_reason(
    params: SamplingParams, token_id: int, num_output_tokens: int, num_tokens: int, max_model_len: int,
    eos_token_ids: tuple[int, ...],
) -> FinishReason | None:
    """Whether sampling ``token_id`` ends a request, and why.

    ``num_output_tokens`` and ``num_tokens`` count it already. The scheduler
    and the ingress (for a remote prefill's first token) both decide with this.
    """
    if params.stop_token_ids and token_id in params.stop_token_ids:
        return FinishReason.STOP
    if not params.ignore_eos and token_id in eos_token_ids:
        return FinishReason.STOP
    if num_output_tokens >= params.max_tokens or num_tokens >= max_model_len:
        return FinishReason.LENGTH
    return None


@dataclass(eq=False)
class Request:
    """One generation request.

    ``num_computed_tokens`` catches up with ``num_tokens``: a prefill is a
    request far behind, a decode is one exactly one token behind (the token it
    sampled last). Preemption resets it to zero.

    A step launched and not yet updated holds ``num_inflight_tokens`` of the
    request's tokens, and ``num_unread_tokens`` (0 or 1) is the token it samples
    there, on the device until the step's one read (``pd.engine.overlap``;
    both are 0 between synchronous steps):

        | computed         | in flight          | to schedule    | unread |
        0                  num_computed_tokens  num_scheduled    num_tokens   num_tokens_with_unread
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache on first admission
    num_preemptions: int = 0
    # What this engine measured of the request (``EngineTimings``): its first token out, and its KV pull.
    first_token_time: float | None = None
    pull_seconds: float = 0.0
    num_pulled_bytes: int = 0
    num_pulled_blocks: int = 0
    num_pull_descriptors: int = 0
    num_prompt_chunks: int = 0  # steps that computed part of its prompt
    pull_error: str = ""  # why its KV pull failed (the prompt was recomputed here)
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    # The prompt's scores so far (see pd.engine.logprobs), when the request asks for them.
    prompt_logprobs: list[PromptLogprob] = field(default_factory=list)
    prompt_logprobs_reported: bool = False
    # Chained hashes of the full blocks of ``token_ids`` (see router.hashing).
    block_hashes: list[bytes] = field(default_factory=list)
    # Prefill role: on finishing, keep the blocks pinned under a lease for a decode replica.
    pin_kv: bool = False
    # Decode role: the prompt's KV lives on a prefill replica; pull it instead of computing it.
    remote_kv: KVHandle | None = None
    kv_source: KVSource = KVSource.LOCAL
    # Structured output: the matcher of ``sampling_params.structured``, set by the engine at
    # admission and dropped when the request ends. The scheduler never reads it.
    grammar: RequestGrammar | None = None
    num_inflight_tokens: int = 0
    num_unread_tokens: int = 0
    # Speculative decoding (``pd.engine.spec``): draft tokens verified for it, and those accepted.
    num_spec_draft_tokens: int = 0
    num_spec_accepted_tokens: int = 0
    # vLLM's scheduling priority: lower is more urgent (``pd.engine.priority``).
    priority: int = 0
    # The LoRA adapter it runs under (``pd.lora``); None: the base model.
    lora: AdapterId | None = None
    # Steps it waited for a device slot for its adapter while others were admitted (``Scheduler``).
    num_lora_waits: int = 0

    def __post_init__(self) -> None:
        self.token_ids: list[int] = list(self.prompt_token_ids)

    @property
    def queue_seconds(self) -> float:
        """Time from arrival to first admission (so far, if not yet admitted)."""
        return (self.first_scheduled_time or time.monotonic()) - self.arrival_time

    @property
    def hash_root(self) -> bytes:
        """The parent of its first block's hash: its adapter's, so that no other adapter shares its KV."""
        return ROOT_HASH if self.lora is None else self.lora.root_hash

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_scheduled_tokens(self) -> int:
        """Tokens computed, or being computed by the step in flight."""
        return self.num_computed_tokens + self.num_inflight_tokens

    @property
    def num_tokens_with_unread(self) -> int:
        """Tokens, counting the one the step in flight samples for it."""
        return len(self.token_ids) + self.num_unread_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_prompt_logprobs_missing(self) -> int:
        """Prompt tokens still to score: 0 unless the request asks for prompt logprobs."""
        if self.sampling_params.prompt_logprobs is None:
            return 0
        return self.num_prompt_tokens - 1 - len(self.prompt_logprobs)

    def prompt_positions_to_score(self, start: int, end: int) -> range:
        """The positions in ``[start, end)`` whose logits score a prompt token not yet scored.

        Position ``p`` scores token ``p + 1``; the request has scored the first
        ``len(self.prompt_logprobs)`` (position 0 onwards), and a preempted one
        recomputes positions it has already scored.
        """
        if self.num_prompt_logprobs_missing <= 0:
            return range(0)
        return range(max(start, len(self.prompt_logprobs)), min(end, self.num_prompt_tokens - 1))

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_output(self, token_id: int, logprob: float | None) -> None:
        self.token_ids.append(token_id)
        self.output_token_ids.append(token_id)
        if logprob is not None:
            self.output_logprobs.append(logprob)
