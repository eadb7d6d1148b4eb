"""GGUF checkpoints: every supported quant type and architecture loads and matches HF reading the same file."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pd import LLM, SamplingParams
from pd.model import gguf_convert
from pd.model.paths import resolve_model_path
from pd.model.tokenizer import Tokenizer
from tests.gguf_files import QUANT_TYPES, make_hf_model, write_gguf
from tests.reference import teacher_forced_divergence

PROMPT = list(range(3, 43))
NEW_TOKENS = 8


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PD_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(scope="session")
def hf_dirs(tmp_path_factory):
    made = {}

    def get(kind: str):
        if kind not in made:
            made[kind] = make_hf_model(kind, tmp_path_factory.mktemp(f"gguf-hf-{kind}"))
        return made[kind]

    return get


@pytest.fixture(scope="session")
def gguf_file(hf_dirs, tmp_path_factory):
    made = {}

    def get(kind: str, type_name: str):
        if (kind, type_name) not in made:
            folder = tmp_path_factory.mktemp(f"gguf-{kind}-{type_name}")
            made[kind, type_name] = write_gguf(hf_dirs(kind), folder / f"{kind}-{type_name}.gguf", type_name)
        return made[kind, type_name]

    return get


def hf_from_gguf(path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                             dtype=torch.float32).eval()


def assert_greedy_matches(ours: list[int], model, prompt: list[int]) -> None:
    divergence = teacher_forced_divergence(ours, model, prompt)
    assert divergence is None, divergence


@pytest.mark.parametrize("type_name", QUANT_TYPES)
def test_each_quant_type_matches_hf_reading_the_same_file(type_name, gguf_file):
    path = gguf_file("llama", type_name)
    llm = LLM(str(path), num_blocks=16)
    [out] = llm.generate([PROMPT], SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True))
    assert len(out.token_ids) == NEW_TOKENS
    assert_greedy_matches(out.token_ids, hf_from_gguf(path), PROMPT)


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
def test_qwen_files_match_hf(kind, gguf_file):
    path = gguf_file(kind, "Q8_0")
    [out] = LLM(str(path), num_blocks=16).generate([PROMPT], SamplingParams(max_tokens=NEW_TOKENS, temperature=0,
                                                                            ignore_eos=True))
    assert_greedy_matches(out.token_ids, hf_from_gguf(path), PROMPT)


@pytest.mark.parametrize("kind, original", [("llama3", 8192), ("llama3_short", 64)])
def test_llama_3_1_rope_scaling_is_read_back_from_its_rope_freqs(kind, original, gguf_file, hf_dirs, hf_model):
    import json

    path = gguf_file(kind, "F32")
    config = json.loads((resolve_model_path(str(path)) / "config.json").read_text())
    assert config["rope_scaling"] == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": original,
                                      "rope_theta": 500000.0}
    [out] = LLM(str(path), num_blocks=16).generate([PROMPT], SamplingParams(max_tokens=NEW_TOKENS, temperature=0,
                                                                            ignore_eos=True))
    assert_greedy_matches(out.token_ids, hf_model(hf_dirs(kind)), PROMPT)  # HF from the original checkpoint


@pytest.mark.integration  # a worker process per rank
def test_the_same_file_loads_unchanged_on_two_tensor_parallel_ranks(gguf_file):
    path = gguf_file("llama", "Q4_K")
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    [single] = LLM(str(path), num_blocks=16).generate([PROMPT], params)
    with LLM(str(path), num_blocks=16, tensor_parallel_size=2) as llm:
        [sharded] = llm.generate([PROMPT], params)
    assert sharded.token_ids == single.token_ids


def test_dequantized_weights_are_hfs_and_the_rotary_rows_are_unpermuted(gguf_file, hf_dirs):
    from safetensors.torch import load_file

    path = gguf_file("llama", "F32")
    converted = load_file(str(resolve_model_path(str(path)) / "model.safetensors"))
    original = load_file(str(hf_dirs("llama") / "model.safetensors"))
    assert set(converted) == set(original)
    for name, tensor in original.items():
        assert torch.equal(converted[name], tensor), name
    q8 = load_file(str(resolve_model_path(str(gguf_file("llama", "Q8_0"))) / "model.safetensors"))
    q = original["model.layers.0.self_attn.q_proj.weight"]
    assert q8["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float32
    torch.testing.assert_close(q8["model.layers.0.self_attn.q_proj.weight"], q, atol=q.abs().max() / 100, rtol=0)


def test_the_tokenizer_and_chat_template_come_from_the_metadata(gguf_file):
    from pd.model.builtin import build_tokenizer

    tokenizer = Tokenizer.from_dir(resolve_model_path(str(gguf_file("llama", "Q8_0"))))
    reference = build_tokenizer(512)
    for text in ["The quick brown fox jumps.", "  spaces\tand\nnewlines ", "digits 12345 and ünïcode"]:
        assert tokenizer.encode(text, add_special_tokens=False) == reference.encode(text, add_special_tokens=False).ids
        assert tokenizer.encode(text)[0] == tokenizer.bos_token_id  # add_bos_token
    assert tokenizer.eos_token == "<|eot_id|>"
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert rendered.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    ids = tokenizer.encode(rendered, add_special_tokens=False)
    assert tokenizer.decode(ids, skip_special_tokens=False) == rendered


def test_a_directory_holding_one_gguf_is_that_file_and_the_conversion_is_cached(gguf_file, tmp_path, monkeypatch):
    path = gguf_file("llama", "Q4_0")
    first = resolve_model_path(str(path))
    assert resolve_model_path(str(path.parent)) == first
    monkeypatch.setattr(gguf_convert, "convert", lambda *args: pytest.fail("converted again"))
    assert resolve_model_path(str(path)) == first
    (path.parent / "second.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match="holds 2 GGUF files"):
        resolve_model_path(str(path.parent))
    (path.parent / "second.gguf").unlink()


def _rewrite(source, out, edit):
    """A copy of a GGUF file with ``edit(writer_kwargs)`` applied: arch, a metadata field or a tensor type."""
    import gguf

    reader = gguf.GGUFReader(str(source))
    arch = edit.get("arch", reader.fields["general.architecture"].contents())
    writer = gguf.GGUFWriter(str(out), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = edit.get(key, field.contents())
        if key.startswith(("llama.", "qwen")) and arch != reader.fields["general.architecture"].contents():
            key = arch + key[key.index("."):]
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            writer.add_array(key, value)
        else:
            writer.add_key_value(key, value, kind)
    for tensor in reader.tensors:
        data, raw = np.asarray(tensor.data), tensor.tensor_type
        if tensor.name in edit.get("tensors", {}):
            raw = edit["tensors"][tensor.name]
            size, type_size = gguf.GGML_QUANT_SIZES[raw]
            data = np.zeros((int(tensor.shape[1]), int(tensor.shape[0]) // size * type_size), dtype=np.uint8)
        writer.add_tensor(tensor.name, data, raw_dtype=None if raw.name in ("F32", "F16") else raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@pytest.mark.parametrize("edit, message", [
    ({"arch": "gptneox"}, "architecture 'gptneox', which is not supported"),
    ({"tokenizer.ggml.model": "llama"}, "a 'llama' tokenizer; only byte-level BPE"),
    ({"tokenizer.ggml.pre": "chameleon"}, "pre-tokenizer 'chameleon', which is not supported"),
])
def test_an_unsupported_architecture_or_tokenizer_is_refused_by_name(edit, message, gguf_file, tmp_path):
    bad = _rewrite(gguf_file("llama", "F32"), tmp_path / "bad.gguf", edit)
    with pytest.raises(ValueError, match=message):
        resolve_model_path(str(bad))
    assert not list((tmp_path / "cache" / "models").glob("gguf-bad-*"))  # nothing half-written is left


def test_an_unsupported_quant_type_is_refused_by_name(gguf_file, tmp_path):
    import gguf

    bad = _rewrite(gguf_file("llama", "F32"), tmp_path / "iq.gguf",
                   {"tensors": {"blk.0.ffn_up.weight": gguf.GGMLQuantizationType.IQ4_NL}})
    with pytest.raises(ValueError, match="'blk.0.ffn_up.weight' is of type IQ4_NL, which is not supported"):
        LLM(str(bad), num_blocks=8)


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    (tmp_path / "model.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="cannot read GGUF file"):
        resolve_model_path(str(tmp_path / "model.gguf"))
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="is not a .gguf file"):
        resolve_model_path(str(tmp_path / "weights.bin"))


def test_a_copy_of_the_same_file_elsewhere_shares_its_conversion(gguf_file, tmp_path, monkeypatch):
    import shutil

    path = gguf_file("llama", "Q4_1")
    first = resolve_model_path(str(path))
    copy = tmp_path / "elsewhere" / path.name
    copy.parent.mkdir()
    shutil.copy(path, copy)  # a new path and modification time, as in another venv
    monkeypatch.setattr(gguf_convert, "convert", lambda *args: pytest.fail("converted again"))
    assert resolve_model_path(str(copy)) == first
    copy.write_bytes(copy.read_bytes()[:-4] + b"\0\0\0\1")  # other contents: another conversion
    with pytest.raises(pytest.fail.Exception, match="converted again"):
        resolve_model_path(str(copy))
