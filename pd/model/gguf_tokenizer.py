"""A GGUF file's tokenizer: byte-level BPE rebuilt from its ``tokenizer.ggml.*`` metadata.

The vocabulary, merges and token types come from the file; how text is split into words before BPE
(``tokenizer.ggml.pre``) is llama.cpp's rule for that name (llama-vocab.cpp), which a GGUF names but
does not carry.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type).
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4

# llama.cpp's pre-tokenizer splits by ``tokenizer.ggml.pre`` (llama-vocab.cpp), for the vocabularies served
# here. ``None``: GPT-2's own regex (the ByteLevel pre-tokenizer's), preceded by single digits where given.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


@dataclass(frozen=True)
class PreTokenizer:
    split: str | None = None  # a regex splitting words (isolated), else GPT-2's
    single_digits: bool = False  # digits are split one by one first


PRE_TOKENIZERS = {
    "default": PreTokenizer(),
    "gpt-2": PreTokenizer(),
    "smollm": PreTokenizer(single_digits=True),
    "starcoder": PreTokenizer(single_digits=True),
    "llama3": PreTokenizer(_LLAMA3_SPLIT),
    "llama-v3": PreTokenizer(_LLAMA3_SPLIT),
    "llama-bpe": PreTokenizer(_LLAMA3_SPLIT),
    "smaug-bpe": PreTokenizer(_LLAMA3_SPLIT),
    "qwen2": PreTokenizer(_QWEN2_SPLIT),
    "deepseek-r1-qwen": PreTokenizer(_QWEN2_SPLIT),
}


def gguf_tokenizer(meta, path: Path):
    """The byte-level BPE tokenizer a GGUF file's metadata (``pd.model.gguf``'s reader) describes, and its
    ``tokenizer_config.json``; an unsupported tokenizer or pre-tokenizer is refused by name."""
    import tokenizers
    from tokenizers import Regex, decoders, models, pre_tokenizers, processors

    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"GGUF file {path.name} has a {kind!r} tokenizer; only byte-level BPE ('gpt2': Llama 3, "
                         f"Qwen, SmolLM) is supported")
    pre_name = meta.get("tokenizer.ggml.pre", "default")
    if pre_name not in PRE_TOKENIZERS:
        raise ValueError(f"GGUF file {path.name} has pre-tokenizer {pre_name!r}, which is not supported; "
                         f"supported: {', '.join(sorted(PRE_TOKENIZERS))}")
    pre = PRE_TOKENIZERS[pre_name]
    tokens = list(meta.get("tokenizer.ggml.tokens"))
    merges = [tuple(merge.split(" ", 1)) for merge in meta.get("tokenizer.ggml.merges", [])]
    token_types = list(meta.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    vocab = {token: index for index, token in enumerate(tokens)}
    tokenizer = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    steps = []
    if pre.single_digits:
        steps.append(pre_tokenizers.Digits(individual_digits=True))
    if pre.split is not None:
        steps += [pre_tokenizers.Split(Regex(pre.split), behavior="isolated"),
                  pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    else:
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(steps) if len(steps) > 1 else steps[0]
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([tokenizers.AddedToken(token, special=True, normalized=False)
                                  for token, kind in zip(tokens, token_types) if kind == _TOKEN_CONTROL])
    tokenizer.add_tokens([tokenizers.AddedToken(token, special=False, normalized=False)
                          for token, kind in zip(tokens, token_types) if kind == _TOKEN_USER_DEFINED])

    def token(key: str) -> str | None:
        index = meta.get(f"tokenizer.ggml.{key}")
        return tokens[index] if index is not None and 0 <= index < len(tokens) else None

    bos = token("bos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token", False) and bos is not None:
        bos_id = vocab[bos]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos}:1 $B:1", special_tokens=[(bos, bos_id)])
    config = {
        "bos_token": bos,
        "eos_token": token("eos_token_id"),
        "unk_token": token("unknown_token_id"),
        "pad_token": token("padding_token_id"),
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "clean_up_tokenization_spaces": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    template = meta.get("tokenizer.chat_template")
    if template is not None:
        config["chat_template"] = template
    return tokenizer, {key: value for key, value in config.items() if value is not None}
