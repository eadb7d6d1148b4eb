"""What a step leaves on the device for the host, and its one read.

A step's draws (``Sampler.draw``) and the log-probabilities its requests
asked for stay on the device as ``DeviceSamples``. On CUDA their copies to
pinned host buffers are queued at once, behind the step's sampling, with an
event after them; ``read`` waits for that event alone. That wait is the
step's only device-to-host sync, and, queued before the next step's
forward, it does not wait for that forward: with async scheduling
(``pd.engine.overlap``) the engine reads step N while step N+1 runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pd.engine.logprobs import PromptLogprob, TopLogprobs
from pd.engine.outputs import ForwardOutput
from pd.engine.request import Request
from pd.engine.structured import GrammarMask

NON_FINITE = "the model produced non-finite logits (NaN or inf) for this request"
UNDRAWABLE = ("sampling failed: no token is left with a finite probability once the logits are masked by the "
              "grammar, divided by the temperature (too low for their size) and cut by top-k and top-p")


def score_targets(logits: torch.Tensor, target_ids: torch.Tensor,
                  k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """On the device: each target token's log-probability under its row of ``logits [rows, vocab]``
    (fp32 ``[rows]``), and the top ``k`` of each row (ids int64 and log-probabilities ``[rows, k]``)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, target_ids[:, None]).squeeze(1)
    top_values, top_ids = torch.topk(logprobs, k, dim=-1)
    return chosen, top_ids, top_values


@dataclass(frozen=True)
class PromptScores:
    """Prompt rows' scores on the device, for ``prompt_rows`` (each request and its rows, in order)."""

    prompt_rows: list[tuple[Request, int]]
    chosen: torch.Tensor  # fp32 [num_prompt_rows]: each row's target token's log-probability
    top_ids: torch.Tensor  # int64 [num_prompt_rows, k]
    top_logprobs: torch.Tensor  # fp32 [num_prompt_rows, k]


def prompt_scores(logits: torch.Tensor, target_ids: torch.Tensor, prompt_rows: list[tuple[Request, int]]) -> PromptScores:
    """The prompt rows' ``logits [num_prompt_rows, vocab]`` scored against ``target_ids``, on the device."""
    k = max(request.sampling_params.prompt_logprobs for request, _ in prompt_rows)
    return PromptScores(prompt_rows, *score_targets(logits, target_ids, k))


@dataclass
class DeviceSamples:
    """One step's sampled rows (one per request in ``requests``), still on the device.

    ``draw_errors``: rows whose draw raised on the host (known at once).
    ``top_ids``/``top_logprobs`` hold the widest ``k`` any row asked for.
    """

    requests: list[Request]
    token_ids: torch.Tensor  # int64 [num_samples]
    usable: torch.Tensor  # bool [num_samples]: the row's raw logits are finite
    draw_errors: dict[int, str] = field(default_factory=dict)
    logprobs: torch.Tensor | None = None  # fp32 [num_samples], when any row asked for logprobs
    top_ids: torch.Tensor | None = None  # int64 [num_samples, k]
    top_logprobs: torch.Tensor | None = None  # fp32 [num_samples, k]
    prompt: PromptScores | None = None
    # bool [num_samples], when rows were drawn together (``Sampler.draw``): False where a row had no
    # distribution left to draw from.
    drawable: torch.Tensor | None = None
    _host: list[torch.Tensor] = field(default_factory=list)
    _copied: torch.cuda.Event | None = None

    def __post_init__(self) -> None:
        self.row_of = {request: row for row, request in enumerate(self.requests)}
        tensors = [self.token_ids, self.usable, self.logprobs, self.top_ids, self.top_logprobs]
        if self.prompt is not None:
            tensors += [self.prompt.chosen, self.prompt.top_ids, self.prompt.top_logprobs]
        tensors = [t for t in tensors if t is not None] + ([self.drawable] if self.drawable is not None else [])
        if not self.token_ids.is_cuda:
            self._host = tensors
            return
        for tensor in tensors:  # pinned, so each copy is queued now and returns at once
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            host.copy_(tensor, non_blocking=True)
            self._host.append(host)
        self._copied = torch.cuda.Event()
        self._copied.record()

    def read(self) -> ForwardOutput:
        """Wait for the copies (the step's one sync), then the rows as the scheduler takes them."""
        if self._copied is not None:
            self._copied.synchronize()
        values = iter([tensor.tolist() for tensor in self._host])
        token_ids, usable = next(values), next(values)
        errors = {row: NON_FINITE for row, ok in enumerate(usable) if not ok}
        errors.update((row, error) for row, error in self.draw_errors.items() if row not in errors)
        sampled = [None if row in errors else token for row, token in enumerate(token_ids)]
        logprobs = next(values) if self.logprobs is not None else None
        tops = None
        if self.top_ids is not None:
            ids, top_values = next(values), next(values)
            tops = [None if (k := request.sampling_params.logprobs) is None else
                    TopLogprobs(tuple(ids[row][:k]), tuple(top_values[row][:k]))
                    for row, request in enumerate(self.requests)]
        scores = _prompt_logprobs(self.prompt, *(next(values) for _ in range(3))) if self.prompt else {}
        if self.drawable is not None:
            for row, ok in enumerate(next(values)):
                if not ok and row not in errors:
                    errors[row] = UNDRAWABLE
                    sampled[row] = None
        return ForwardOutput(sampled_token_ids=sampled, logprobs=logprobs, errors=errors, top_logprobs=tops,
                             prompt_logprobs=scores)


def _prompt_logprobs(prompt: PromptScores, chosen: list[float], top_ids: list[list[int]],
                     top_values: list[list[float]]) -> dict[str, list[PromptLogprob]]:
    """Each prompt row's score, split by request (rows are in ``prompt.prompt_rows`` order)."""
    out, start = {}, 0
    for request, num_rows in prompt.prompt_rows:
        want = request.sampling_params.prompt_logprobs
        out[request.request_id] = [
            PromptLogprob(chosen[row], TopLogprobs(tuple(top_ids[row][:want]), tuple(top_values[row][:want])))
            for row in range(start, start + num_rows)
        ]
        start += num_rows
    return out


@dataclass(frozen=True)
class LaunchedStep:
    """A step on the device (``ModelRunner.launch``): what ``ModelRunner.collect`` reads and finishes."""

    samples: DeviceSamples
    mask: GrammarMask | None = None  # its grammar rows' masks, advanced past their tokens at the read
