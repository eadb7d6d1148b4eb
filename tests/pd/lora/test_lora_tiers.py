"""An adapter's KV in the disk tier is stored under its adapter-rooted hashes: a restarted engine serves it
again to the same adapter, and never to the base model or another adapter."""

from __future__ import annotations

import pytest

from pd import LLM, LoRARequest, SamplingParams
from pd.model.paths import resolve_model_path
from tests.lora_adapters import make_adapter
from tests.pd.tiers_common import DEVICE_BLOCKS, FIRST, HOST_BLOCKS

PARAMS = SamplingParams(max_tokens=6, temperature=0)
pytestmark = pytest.mark.slow  # two engines with their tiers, and peft's adapters built through HF


def _served(llm: LLM, lora: LoRARequest | None) -> tuple[list[int], int]:
    [out] = llm.generate([FIRST], PARAMS, lora_request=lora)
    return out.token_ids, out.num_cached_tokens


def test_a_restarted_engine_serves_an_adapters_disk_blocks_to_that_adapter_only(tmp_path, block_bytes):
    base = resolve_model_path("builtin:tiny-llama")
    a = LoRARequest("a", str(make_adapter(base, tmp_path / "a", r=4, seed=1)))
    b = LoRARequest("b", str(make_adapter(base, tmp_path / "b", r=4, seed=2)))
    options = {"num_blocks": DEVICE_BLOCKS, "host_kv_cache_bytes": HOST_BLOCKS * block_bytes,
               "disk_kv_cache_path": str(tmp_path / "disk"), "disk_kv_cache_bytes": 1 << 30, "enable_lora": True}
    first = LLM("builtin:tiny-llama", **options)
    tokens, hit = _served(first, a)
    assert hit == 0
    first.engine.tiers.flush()
    first.engine.close()
    restarted = LLM("builtin:tiny-llama", **options)
    assert _served(restarted, None)[1] == 0  # the base model never reads the adapter's blocks
    assert _served(restarted, b)[1] == 0  # nor does another adapter
    again, hit = _served(restarted, a)
    assert again == tokens and hit == 8 * 16  # the adapter's own, from disk
    restarted.engine.close()
