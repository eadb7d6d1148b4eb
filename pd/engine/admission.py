"""What a request must satisfy before the engine takes it, and what it starts with.

Each check raises ``ValueError`` naming the field, before the engine holds
anything for the request. A request may arrive with part of its output
generated elsewhere: a first token sampled by a prefill replica, or a stream
moved here mid-way; its grammar then starts past those tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pd.sampling_params import SamplingParams, StructuredOutput
from transfer.wire import KVHandle

if TYPE_CHECKING:
    from pd.engine.structured import GrammarCompiler, RequestGrammar


def max_model_len(configured: int | None, max_position_embeddings: int) -> int:
    """The longest sequence the engine admits: the config's, at most the model's positions; theirs by default."""
    if configured is not None and configured > max_position_embeddings:
        raise ValueError(
            f"max_model_len {configured} exceeds the model's max_position_embeddings {max_position_embeddings}"
        )
    return configured or max_position_embeddings


def check_request(prompt_token_ids: list[int], params: SamplingParams, *, max_model_len: int, vocab_size: int,
                  block_size: int, num_blocks: int) -> None:
    """Raise ``ValueError`` if a pool of ``num_blocks`` blocks cannot serve this prompt and ``params``."""
    _check_lengths(prompt_token_ids, params, max_model_len)
    _check_token_ids(prompt_token_ids, vocab_size)
    _check_blocks(len(prompt_token_ids), params, max_model_len, block_size, num_blocks)


def _check_lengths(prompt_token_ids: list[int], params: SamplingParams, max_model_len: int) -> None:
    if not prompt_token_ids:
        raise ValueError("prompt is empty: prompt_token_ids must hold at least one token")
    if len(prompt_token_ids) >= max_model_len:
        raise ValueError(
            f"prompt has {len(prompt_token_ids)} tokens; it must be shorter than max_model_len {max_model_len}"
        )
    if params.max_tokens > max_model_len:
        raise ValueError(f"max_tokens {params.max_tokens} exceeds max_model_len {max_model_len}")


def _check_token_ids(prompt_token_ids: list[int], vocab: int) -> None:
    if set(map(type, prompt_token_ids)) == {int} and 0 <= min(prompt_token_ids) and max(prompt_token_ids) < vocab:
        bad = []  # the common case, checked at C speed
    else:
        bad = [t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab]
    if bad:
        raise ValueError(f"prompt_token_ids holds ids outside the vocabulary [0, {vocab}): {bad[:5]}")


def _check_blocks(prompt_len: int, params: SamplingParams, max_model_len: int, block_size: int,
                  num_blocks: int) -> None:
    total = min(prompt_len + params.max_tokens, max_model_len)
    blocks = -(-total // block_size)
    if blocks > num_blocks:
        raise ValueError(
            f"request needs {blocks} KV blocks (prompt + max_tokens = {total} tokens) but the pool has "
            f"{num_blocks}; raise num_blocks or lower max_tokens"
        )


def check_num_generated(num_generated: int, prompt_len: int) -> None:
    """``num_generated`` counts prompt tokens: the prompt's last ones."""
    if not 0 <= num_generated <= prompt_len:
        raise ValueError(f"num_generated {num_generated} is not in [0, {prompt_len}] (the prompt's length)")


# The priorities a request may have: vLLM's field is any integer; this bound keeps it an integer a wire carries.
PRIORITY_BOUND = 2**31


def check_priority(priority: int) -> int:
    """``priority`` (lower is more urgent), an integer within ``±PRIORITY_BOUND``."""
    if isinstance(priority, bool) or not isinstance(priority, int) or not -PRIORITY_BOUND < priority < PRIORITY_BOUND:
        raise ValueError(f"priority must be an integer within ±2**31 (lower is more urgent), got {priority!r}")
    return priority


def first_token(remote_kv: KVHandle | None, first_token_id: int | None, vocab_size: int) -> int | None:
    """The request's first output token, sampled elsewhere: the handle's, checked against ``first_token_id``."""
    if remote_kv is not None:
        if first_token_id is not None and first_token_id != remote_kv.first_token_id:
            raise ValueError(f"first_token_id {first_token_id} disagrees with the kv_handle's")
        first_token_id = remote_kv.first_token_id
    if first_token_id is not None and not 0 <= first_token_id < vocab_size:
        raise ValueError(f"first_token_id {first_token_id} is outside the vocabulary")
    return first_token_id


def start_grammar(compiler: GrammarCompiler, constraint: StructuredOutput, generated: list[int],
                  first_token_id: int | None) -> RequestGrammar:
    """The request's matcher, past every token it has before admission."""
    grammar = compiler.start(constraint)
    grammar.replay(generated)
    if grammar.is_terminated:
        raise ValueError("structured output: the generated tokens already complete the grammar; "
                         "nothing is left to generate")
    if first_token_id is not None:
        grammar.replay([first_token_id], first_index=len(generated))
    return grammar
