import hashlib
import json
import multiprocessing

import pytest
import safetensors.torch
import tokenizers
import torch

from pd.model import builtin
from pd.model.builtin import (
    BOS_TOKEN,
    BUILTIN_MODELS,
    EOT_TOKEN,
    SPECIAL_TOKENS,
    cache_dir,
    tokenizer_training_text,
)
from pd.model.paths import resolve_model_path
from pd.model.tokenizer import Tokenizer

MODEL = "builtin:tiny-llama"
FILE_NAMES = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}
NUM_CONCURRENT_PROCESSES = 3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PD_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        return resolve_model_path(MODEL)


def _file_hashes(path):
    return {entry.name: hashlib.sha256(entry.read_bytes()).hexdigest() for entry in sorted(path.iterdir())}


def _read_json(path):
    return json.loads(path.read_text())


def test_model_lives_in_versioned_cache_dir(model_dir, tmp_path, monkeypatch):
    assert model_dir.name == "tiny-llama-v1"
    assert model_dir.parent.name == "models"
    assert {entry.name for entry in model_dir.iterdir()} == FILE_NAMES
    assert not [entry.name for entry in model_dir.parent.iterdir() if ".tmp-" in entry.name]

    monkeypatch.delenv("PD_CACHE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache_dir() == tmp_path / ".cache" / "pd"


def test_existing_model_is_not_regenerated(model_dir, monkeypatch):
    monkeypatch.setenv("PD_CACHE_DIR", str(model_dir.parent.parent))
    monkeypatch.setattr(builtin, "write_checkpoint", lambda spec, out_dir: pytest.fail("regenerated"))
    assert resolve_model_path(MODEL) == model_dir


def test_unknown_builtin_lists_known_names(tmp_path, monkeypatch):
    monkeypatch.setenv("PD_CACHE_DIR", str(tmp_path))
    with pytest.raises(ValueError, match="builtin:tiny-llama") as error:
        resolve_model_path("builtin:huge-llama")
    assert "builtin:huge-llama" in str(error.value)
    assert not (tmp_path / "models").exists()


def test_plain_paths(tmp_path):
    assert resolve_model_path(str(tmp_path)) == tmp_path
    missing = tmp_path / "no-such-model"
    with pytest.raises(ValueError, match="does not exist") as error:
        resolve_model_path(str(missing))
    assert str(missing) in str(error.value)


def test_failed_generation_leaves_nothing_behind(tmp_path, monkeypatch):
    def write_then_fail(spec, out_dir):
        (out_dir / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    monkeypatch.setenv("PD_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(builtin, "write_checkpoint", write_then_fail)
    with pytest.raises(RuntimeError, match="disk full"):
        resolve_model_path(MODEL)
    assert [entry.name for entry in (tmp_path / "models").iterdir()] == ["tiny-llama.lock"]


def test_config_json(model_dir):
    config = _read_json(model_dir / "config.json")
    tokenizer = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["model_type"] == "llama"
    assert config["vocab_size"] == tokenizer.get_vocab_size(with_added_tokens=True) == 1024
    assert config["bos_token_id"] == tokenizer.token_to_id(BOS_TOKEN)
    assert config["eos_token_id"] == tokenizer.token_to_id(EOT_TOKEN)
    assert config["tie_word_embeddings"] is True
    assert (config["hidden_size"], config["intermediate_size"], config["head_dim"]) == (256, 768, 32)
    assert (config["num_hidden_layers"], config["num_attention_heads"], config["num_key_value_heads"]) == (8, 8, 2)
    assert config["torch_dtype"] == "float32"
    generation_config = _read_json(model_dir / "generation_config.json")
    assert generation_config["eos_token_id"] == config["eos_token_id"]


def test_weights(model_dir):
    spec = BUILTIN_MODELS["tiny-llama"]
    weights = safetensors.torch.load_file(str(model_dir / "model.safetensors"))
    layer_names = [
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm",
    ]  # fmt: skip
    expected_names = {"model.embed_tokens.weight", "model.norm.weight"} | {
        f"model.layers.{i}.{name}.weight" for i in range(spec.num_layers) for name in layer_names
    }
    assert set(weights) == expected_names
    assert all(tensor.dtype == torch.float32 for tensor in weights.values())
    assert weights["model.layers.3.self_attn.k_proj.weight"].shape == (64, 256)
    assert weights["model.layers.3.mlp.down_proj.weight"].shape == (256, 768)
    assert 6_000_000 < sum(tensor.numel() for tensor in weights.values()) < 6_500_000
    assert torch.equal(weights["model.norm.weight"], torch.ones(256))
    q_proj = weights["model.layers.0.self_attn.q_proj.weight"]
    assert abs(q_proj.std().item() - 0.15) < 0.005
    assert abs(q_proj.mean().item()) < 0.005
    # Each tensor gets its own draw.
    assert not torch.equal(q_proj, weights["model.layers.1.self_attn.q_proj.weight"])


def test_tokenizer_files(model_dir):
    raw = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    vocab = raw.get_vocab(with_added_tokens=False)
    byte_symbols = tokenizers.pre_tokenizers.ByteLevel.alphabet()
    assert all(symbol in vocab and vocab[symbol] < 256 for symbol in byte_symbols)
    assert [raw.id_to_token(1019 + i) for i in range(len(SPECIAL_TOKENS))] == list(SPECIAL_TOKENS)
    # The learned merges compress the text they were learned from.
    text = tokenizer_training_text()
    assert len(raw.encode(text).ids) < len(text.encode()) / 3

    tokenizer = Tokenizer.from_dir(model_dir)
    assert tokenizer.eos_token_id == raw.token_to_id(EOT_TOKEN)
    ids = tokenizer.encode("Hello world! ünïcode 🙂")
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids) == "Hello world! ünïcode 🙂"
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hello!"}])
    assert prompt == (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHello!<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    assert prompt_ids.count(tokenizer.bos_token_id) == 1
    assert prompt_ids.count(tokenizer.eos_token_id) == 1


def test_tokenizer_corpus_is_the_one_tiny_llama_v1_was_learned_from():
    # A changed corpus (an edit, or line endings rewritten on checkout) changes
    # the tokenizer: bump the model's version and this digest together.
    assert BUILTIN_MODELS["tiny-llama"].version == 1
    digest = hashlib.sha256(tokenizer_training_text().encode()).hexdigest()
    assert digest == "f564683557b07f645dc6a69c5e5cd34107f70b7865069ff78246f4f38ec3d175"


def test_loads_in_transformers(model_dir):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig.from_pretrained(model_dir)
    assert config.tie_word_embeddings is True
    model, info = transformers.AutoModelForCausalLM.from_pretrained(model_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    weights = safetensors.torch.load_file(str(model_dir / "model.safetensors"))
    assert torch.equal(model.model.embed_tokens.weight, weights["model.embed_tokens.weight"])
    input_ids = torch.tensor([Tokenizer.from_dir(model_dir).encode("The quick brown fox")])
    with torch.no_grad():
        logits = model(input_ids).logits  # [1, num_tokens, vocab_size]
    assert logits.shape == (1, input_ids.shape[1], 1024)
    assert torch.isfinite(logits).all()


def test_generation_is_byte_identical(model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("PD_CACHE_DIR", str(tmp_path))
    other_dir = resolve_model_path(MODEL)
    assert other_dir != model_dir
    assert _file_hashes(other_dir) == _file_hashes(model_dir)


def _resolve_after_barrier(barrier, results):
    barrier.wait()
    results.put(str(resolve_model_path(MODEL)))


@pytest.mark.integration  # spawns processes
def test_concurrent_processes_share_one_generation(model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("PD_CACHE_DIR", str(tmp_path))
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(NUM_CONCURRENT_PROCESSES)
    results = context.Queue()
    processes = [
        context.Process(target=_resolve_after_barrier, args=(barrier, results))
        for _ in range(NUM_CONCURRENT_PROCESSES)
    ]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout=120)
        assert process.exitcode == 0
    paths = {results.get(timeout=5) for _ in processes}
    assert paths == {str(tmp_path / "models" / "tiny-llama-v1")}
    assert sorted(entry.name for entry in (tmp_path / "models").iterdir()) == ["tiny-llama-v1", "tiny-llama.lock"]
    # Generated in other processes, yet identical to this process's files.
    assert _file_hashes(tmp_path / "models" / "tiny-llama-v1") == _file_hashes(model_dir)
