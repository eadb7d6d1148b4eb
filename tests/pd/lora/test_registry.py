"""The adapters an engine knows (``LoraRegistry``), the batch's room for them (``AdapterRoom``), and their slots
on the device (``LoraSlots``), on made-up adapters: no model runs."""

from __future__ import annotations

from pathlib import Path
from types import MappingProxyType

import pytest
import torch

from pd.engine.request import Request
from pd.lora import AdapterId
from pd.lora.adapter import LoraAdapter, LoraWeights
from pd.lora.admission import AdapterRoom
from pd.lora.registry import LoraRegistry, UnknownAdapter
from pd.lora.slots import LoraSlots
from pd.model.config import ModelConfig, RopeConfig
from pd.model.lora import DOWN, GATE_UP, QKV, O
from pd.model.tp import TPShard
from pd.sampling_params import SamplingParams
from router.hashing import ROOT_HASH

MODEL = ModelConfig(architecture="LlamaForCausalLM", vocab_size=64, hidden_size=16, intermediate_size=24,
                    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=4, rms_norm_eps=1e-6,
                    max_position_embeddings=64, rope=RopeConfig(theta=10000.0))
SHAPES = {"q_proj": (16, 16), "k_proj": (16, 8), "v_proj": (16, 8), "o_proj": (16, 16), "gate_proj": (16, 24),
          "up_proj": (16, 24), "down_proj": (24, 16)}  # module -> (in, out)


def fake_adapter(name: str, path, model=None, max_rank=None, *, seed: int = 0, rank: int = 4,
                 modules=tuple(SHAPES)) -> LoraAdapter:
    generator = torch.Generator().manual_seed(seed)
    weights = {(layer, m): LoraWeights(torch.randn(rank, SHAPES[m][0], generator=generator),
                                       torch.randn(SHAPES[m][1], rank, generator=generator))
               for layer in range(MODEL.num_layers) for m in modules}
    return LoraAdapter(name=name, path=Path(path), digest=f"{name}-{path}-{seed}", rank=rank,
                       modules=MappingProxyType(weights), num_bytes=0)


def registry(max_cpu_loras: int = 2) -> LoraRegistry:
    return LoraRegistry(MODEL, 16, max_cpu_loras, loader=fake_adapter)


def test_names_resolve_to_their_weights_and_reloads_keep_running_requests_on_theirs():
    reg = registry()
    old = reg.add("a", "/a")
    assert reg.resolve("a") == old and reg.resolve("a", "/a") == old
    with pytest.raises(ValueError, match="'a' is loaded from /a, not /b"):
        reg.resolve("a", "/b")
    with pytest.raises(UnknownAdapter, match="no LoRA adapter named 'z'"):
        reg.resolve("z")
    weights = reg.acquire(old)
    reg._load = lambda name, path, model, rank: fake_adapter(name, path, seed=1)  # new weights at the path
    new = reg.add("a", "/a")
    assert new != old and new.root_hash != old.root_hash != ROOT_HASH
    assert reg.weights(old) is weights  # the running request keeps its weights
    reg.release(old)
    with pytest.raises(KeyError):
        reg.weights(old)  # gone with its last user


def test_host_memory_holds_at_most_max_cpu_loras_unused_and_reloads_on_use():
    reg = registry(max_cpu_loras=2)
    keys = [reg.add(name, f"/{name}") for name in "abc"]
    assert reg.num_in_memory == 2 and reg.num_loads == 3  # "a" evicted, least recently used
    reg.acquire(keys[0])
    assert reg.num_loads == 4 and reg.num_in_memory == 2  # read again; "b" evicted in its place
    for key in keys[1:]:
        reg.acquire(key)
    assert reg.num_in_memory == 3  # all in use: none is evicted, the bound waits for a release
    for key in keys:
        reg.release(key)
    assert reg.num_in_memory == 2


def test_unloading_refuses_new_requests_and_lets_running_ones_finish():
    reg = registry()
    key = reg.add("a", "/a")
    reg.acquire(key)
    assert reg.remove("a") == 1
    with pytest.raises(UnknownAdapter):
        reg.resolve("a")
    assert reg.weights(key) is not None
    reg.release(key)
    assert reg.names() == {} and reg.num_in_memory == 0
    with pytest.raises(UnknownAdapter):
        reg.remove("a")


def _request(lora: AdapterId | None) -> Request:
    return Request("r", [1, 2, 3], SamplingParams(), lora=lora)


def test_a_batch_admits_at_most_max_loras_adapters():
    a, b, c = (AdapterId(n, n) for n in "abc")
    room = AdapterRoom(2, [_request(a), _request(None)])
    assert room.fits(_request(b)) and room.fits(_request(None)) and room.fits(_request(a))
    room.admitted(_request(b))
    assert not room.fits(_request(c)) and room.fits(_request(a)) and room.fits(_request(None))


def test_slots_load_adapters_between_steps_least_recently_used_first():
    slots = LoraSlots(MODEL, max_loras=2, max_rank=8, dtype=torch.float32, device=torch.device("cpu"))
    adapters = {n: fake_adapter(n, f"/{n}", seed=i) for i, n in enumerate("abc")}
    key = {n: AdapterId(n, adapters[n].digest) for n in "abc"}
    first = slots.assign([(key["a"], adapters["a"]), (key["b"], adapters["b"])])
    assert sorted(first.values()) == [0, 1] and slots.num_slot_loads == 2
    slots.assign([(key["b"], adapters["b"])])
    third = slots.assign([(key["c"], adapters["c"]), (key["b"], adapters["b"])])
    assert third[key["c"]] == first[key["a"]] and slots.num_slot_loads == 3  # "a" was least recently used
    with pytest.raises(RuntimeError, match="3 LoRA adapters, more than max_loras 2"):
        slots.assign([(key[n], adapters[n]) for n in "abc"])


def _delta(slots: LoraSlots, layer: int, projection: str, slot: int, x: torch.Tensor) -> torch.Tensor:
    """What slot ``slot`` adds to ``projection``'s output for rows ``x`` (the reference kernel's sum)."""
    buffers = slots.layers[layer][projection]
    out = torch.zeros(x.shape[0], buffers.b.shape[1])
    rank = slots.max_rank
    for index, start in enumerate(buffers.slice_starts):
        stop = buffers.slice_starts[index + 1] if index + 1 < len(buffers.slice_starts) else out.shape[1]
        t = x @ buffers.a[slot, index * rank:(index + 1) * rank].T
        out[:, start:stop] = t @ buffers.b[slot, start:stop].T
    return out


def test_a_slot_adds_each_modules_delta_and_tensor_parallel_ranks_add_up_to_it():
    """Whole, a slot's fused q|k|v delta is [x·Aqᵀ·Bqᵀ | x·Akᵀ·Bkᵀ | x·Avᵀ·Bvᵀ]; over two ranks the
    column-parallel deltas concatenate and the row-parallel ones (o, down) sum to it."""
    adapter = fake_adapter("a", "/a", rank=3)
    key = AdapterId("a", adapter.digest)
    x = torch.randn(5, 16)
    whole = LoraSlots(MODEL, 1, 4, torch.float32, torch.device("cpu"))
    whole.assign([(key, adapter)])
    expected = torch.cat([x @ adapter.modules[1, m].a.T @ adapter.modules[1, m].b.T
                          for m in ("q_proj", "k_proj", "v_proj")], dim=1)
    torch.testing.assert_close(_delta(whole, 1, QKV, 0, x), expected)
    ranks = [LoraSlots(MODEL, 1, 4, torch.float32, torch.device("cpu"), TPShard(rank, 2)) for rank in range(2)]
    for slots in ranks:
        slots.assign([(key, adapter)])
    for projection in (QKV, GATE_UP):  # each rank holds half of every slice's output columns
        full = _delta(whole, 0, projection, 0, x)
        parts = [_delta(slots, 0, projection, 0, x) for slots in ranks]
        starts = whole.layers[0][projection].slice_starts
        local = ranks[0].layers[0][projection].slice_starts
        for index in range(len(starts)):
            end = starts[index + 1] if index + 1 < len(starts) else full.shape[1]
            size = (end - starts[index]) // 2
            got = torch.cat([p[:, local[index]:local[index] + size] for p in parts], dim=1)
            torch.testing.assert_close(got, full[:, starts[index]:end])
    for projection, in_features in ((O, 16), (DOWN, 24)):
        x_in = torch.randn(5, in_features)
        full = _delta(whole, 0, projection, 0, x_in)
        halves = x_in.chunk(2, dim=1)
        torch.testing.assert_close(sum(_delta(slots, 0, projection, 0, h) for slots, h in zip(ranks, halves)), full)
