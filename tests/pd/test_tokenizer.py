import json
import random

import pytest

from pd.model.builtin import BOS_TOKEN, CHAT_TEMPLATE, EOT_TOKEN, build_tokenizer
from pd.model.tokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer, Tokenizer

MULTIBYTE_TEXT = "héllo 世界 🙂 naïve café — done"


def _write_checkpoint_tokenizer(path, **config):
    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer.json").write_text(build_tokenizer(1024).to_str(), encoding="utf-8")
    (path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    _write_checkpoint_tokenizer(path, bos_token=BOS_TOKEN, eos_token=EOT_TOKEN, chat_template=CHAT_TEMPLATE)
    return Tokenizer.from_dir(path)


def test_from_dir_without_tokenizer_json_is_none(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert Tokenizer.from_dir(tmp_path) is None


def test_encode_adds_bos_only_with_special_tokens(tokenizer):
    with_bos = tokenizer.encode("hello world")
    without = tokenizer.encode("hello world", add_special_tokens=False)
    assert with_bos == [tokenizer.bos_token_id, *without]
    assert tokenizer.decode(with_bos) == "hello world"
    assert tokenizer.decode(with_bos, skip_special_tokens=False) == BOS_TOKEN + "hello world"


def test_encode_decode_round_trip_multibyte(tokenizer):
    ids = tokenizer.encode(MULTIBYTE_TEXT, add_special_tokens=False)
    assert tokenizer.decode(ids) == MULTIBYTE_TEXT


def test_special_token_ids_and_vocab_size(tokenizer):
    assert tokenizer.vocab_size == 1024
    assert tokenizer.bos_token_id == 1019
    assert tokenizer.eos_token_id == 1023
    assert tokenizer.encode(EOT_TOKEN, add_special_tokens=False) == [tokenizer.eos_token_id]


def test_token_strings_blank_special_and_padding_ids(tokenizer):
    strings = tokenizer.token_strings(1030)
    assert len(strings) == 1030 and strings[1019:] == [""] * 11  # five special tokens, six padding ids
    [hello] = tokenizer.encode("hello", add_special_tokens=False)[:1]
    assert strings[hello] and tokenizer.decode([hello]).startswith(strings[hello][:1])
    assert tokenizer.token_strings(10) == strings[:10]


def test_decoder_specs_flatten_the_decoder(tokenizer, tmp_path):
    assert [step["type"] for step in tokenizer.decoder_specs()] == ["ByteLevel"]
    spec = json.loads(build_tokenizer(1024).to_str())
    spec["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "}, {"type": "ByteFallback"},
        {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    steps = Tokenizer.from_dir(tmp_path).decoder_specs()
    assert [step["type"] for step in steps] == ["Replace", "ByteFallback", "Fuse", "Strip"]


def test_special_tokens_as_added_token_dicts(tmp_path):
    path = _write_checkpoint_tokenizer(
        tmp_path, bos_token={"content": BOS_TOKEN, "special": True}, eos_token={"content": EOT_TOKEN}
    )
    tokenizer = Tokenizer.from_dir(path)
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (1019, 1023)


def test_missing_or_unknown_special_tokens_are_none(tmp_path):
    tokenizer = Tokenizer.from_dir(_write_checkpoint_tokenizer(tmp_path, eos_token="<not-a-token>"))
    assert tokenizer.bos_token_id is None
    assert tokenizer.eos_token_id is None


def test_special_tokens_map_fallback(tmp_path):
    path = _write_checkpoint_tokenizer(tmp_path, bos_token=BOS_TOKEN)
    (path / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<x>", "eos_token": EOT_TOKEN}))
    tokenizer = Tokenizer.from_dir(path)
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (1019, 1023)


def test_chat_template_renders_llama3_layout(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Hi! "}]
    assert tokenizer.apply_chat_template(messages) == (
        "<|begin_of_text|>"
        "<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi!<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=False).endswith("Hi!<|eot_id|>")


def test_chat_template_raise_exception_becomes_value_error(tokenizer):
    with pytest.raises(ValueError, match="unknown role tool"):
        tokenizer.apply_chat_template([{"role": "tool", "content": "x"}])


def test_chat_template_is_sandboxed(tmp_path):
    path = _write_checkpoint_tokenizer(tmp_path, chat_template="{{ messages.append(1) }}")
    with pytest.raises(ValueError, match="chat template failed"):
        Tokenizer.from_dir(path).apply_chat_template([])


def test_no_chat_template_is_a_clear_error(tmp_path):
    tokenizer = Tokenizer.from_dir(_write_checkpoint_tokenizer(tmp_path))
    with pytest.raises(ValueError, match="no chat template"):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])


def test_chat_template_file_trims_blocks_like_hf(tmp_path):
    path = _write_checkpoint_tokenizer(tmp_path, bos_token=BOS_TOKEN, chat_template="ignored")
    (path / "chat_template.jinja").write_text(
        "{{ bos_token }}\n"
        "{% for message in messages %}\n"
        "    {% if message.role == 'user' %}\n"
        "[{{ message.content }}]\n"
        "    {% endif %}\n"
        "{% endfor %}\n"
        "{% if add_generation_prompt %}>{% endif %}"
    )
    rendered = Tokenizer.from_dir(path).apply_chat_template([{"role": "user", "content": "a"}])
    assert rendered == f"{BOS_TOKEN}\n[a]\n>"


def test_chat_template_list_form_picks_default(tmp_path):
    templates = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "chat"}]
    tokenizer = Tokenizer.from_dir(_write_checkpoint_tokenizer(tmp_path, chat_template=templates))
    assert tokenizer.apply_chat_template([]) == "chat"


def _stream(tokenizer, prompt_ids, generated_ids):
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids)
    deltas = [detokenizer.add([token_id]) for token_id in generated_ids]
    deltas.append(detokenizer.flush())
    assert detokenizer.text == "".join(deltas)
    return deltas


def test_detokenizer_holds_back_split_characters(tokenizer):
    generated_ids = tokenizer.encode(MULTIBYTE_TEXT, add_special_tokens=False)
    # The byte-level tokens split the multi-byte characters.
    assert len(generated_ids) > len(MULTIBYTE_TEXT.encode()) // 2
    deltas = _stream(tokenizer, tokenizer.encode("Say:"), generated_ids)
    assert "".join(deltas) == MULTIBYTE_TEXT
    assert not any(REPLACEMENT_CHAR in delta for delta in deltas)
    assert deltas[-1] == ""  # nothing was left to flush


def test_detokenizer_emits_character_once_complete(tokenizer):
    detokenizer = IncrementalDetokenizer(tokenizer, [tokenizer.bos_token_id])
    # "世" is three byte tokens.
    byte_ids = tokenizer.encode("世", add_special_tokens=False)
    assert len(byte_ids) == 3
    assert [detokenizer.add([token_id]) for token_id in byte_ids] == ["", "", "世"]
    assert detokenizer.add(tokenizer.encode(" ok", add_special_tokens=False)) == " ok"
    assert detokenizer.text == "世 ok"


def test_detokenizer_keeps_leading_space_after_prompt(tokenizer):
    prompt_ids = tokenizer.encode("The quick brown")
    generated_ids = tokenizer.encode(" fox jumps", add_special_tokens=False)
    assert "".join(_stream(tokenizer, prompt_ids, generated_ids)) == " fox jumps"


@pytest.mark.parametrize("seed", range(5))
def test_detokenizer_matches_decode_on_random_ids(tokenizer, seed):
    rng = random.Random(seed)
    prompt_ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(12))]
    generated_ids = [rng.randrange(tokenizer.vocab_size) for _ in range(200)]
    # Random byte tokens make invalid UTF-8; a few steps may emit several tokens at once.
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids)
    deltas, i = [], 0
    while i < len(generated_ids):
        step = rng.randrange(1, 4)
        deltas.append(detokenizer.add(generated_ids[i : i + step]))
        i += step
    deltas.append(detokenizer.flush())
    assert "".join(deltas) == tokenizer.decode(generated_ids)
    assert detokenizer.text == tokenizer.decode(generated_ids)


def test_detokenizer_prompt_ending_inside_a_character(tokenizer):
    snowman_ids = tokenizer.encode("☃", add_special_tokens=False)
    prompt_ids = tokenizer.encode("x") + snowman_ids[:1]
    generated_ids = snowman_ids[1:] + tokenizer.encode("!", add_special_tokens=False)
    deltas = _stream(tokenizer, prompt_ids, generated_ids)
    assert "".join(deltas) == tokenizer.decode(generated_ids)
