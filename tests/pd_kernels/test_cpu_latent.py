"""The ``cpu`` backend's multi-head latent attention (``latent_decode.cpp``) against the torch reference,
over latent pools poisoned with NaN wherever a sequence must not read."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

import pd_kernels
import pd_kernels.cpu
from pd_kernels import reference

NUM_LAYERS = 2
LAYER = 1
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
PAGES = [torch.float32, torch.bfloat16, *FP8]
names = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}

# (q_len, kv_len) per sequence: ragged decodes, one of a single key, lengths on and off the block size.
DECODE = [(1, 523), (1, 1), (1, 37), (1, 16), (1, 300)]
# Prefill chunks (the reference's rows) among decodes.
MIXED = [(1, 300), (5, 18), (40, 40), (1, 1), (3, 97)]


@dataclass
class LatentBatch:
    q: torch.Tensor  # [num_tokens, num_heads, latent_dim]
    pool: torch.Tensor  # fp32, [num_blocks, NUM_LAYERS, block_size, latent_dim] or token-major (layers inner)
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    live: torch.Tensor  # bool [num_blocks, block_size]: slots holding some sequence's rows
    token_major: bool

    def cache(self, dtype: torch.dtype, poisoned: bool = False) -> torch.Tensor:
        """This layer's ``[num_blocks, block_size, 1, latent_dim]`` view of the pool as ``dtype``; poisoned:
        NaN in every slot but the live ones of this layer (FP8's NaN code in FP8 pools)."""
        pool = self.pool
        if poisoned:
            layer = pool[:, :, LAYER] if self.token_major else pool[:, LAYER]
            kept = torch.where(self.live[..., None], layer, float("nan"))
            pool = torch.full_like(pool, float("nan"))
            (pool[:, :, LAYER] if self.token_major else pool[:, LAYER]).copy_(kept)
        pool = pool.to(dtype)
        return (pool[:, :, LAYER] if self.token_major else pool[:, LAYER]).unsqueeze(2)

    def args(self, cache: torch.Tensor, q: torch.Tensor | None = None) -> tuple:
        return (self.q if q is None else q, cache, self.cu_seqlens_q, self.seq_lens, self.block_table)


def make_latent_batch(q_kv_lens, num_heads: int, latent_dim: int, block_size: int, seed: int = 0,
                      token_major: bool = False) -> LatentBatch:
    """Sequence i has ``q_len, kv_len = q_kv_lens[i]``, its pages at random blocks of a pool shared by two
    layers; padding entries of the table point at random blocks."""
    generator = torch.Generator().manual_seed(seed)
    num_pages = [-(-kv_len // block_size) for _, kv_len in q_kv_lens]
    num_blocks = sum(num_pages) + 3
    shape = (num_blocks, block_size, NUM_LAYERS, latent_dim) if token_major else (num_blocks, NUM_LAYERS, block_size,
                                                                                   latent_dim)
    pool = torch.randn(shape, generator=generator)
    table = torch.randint(0, num_blocks, (len(q_kv_lens), max(num_pages)), generator=generator, dtype=torch.int32)
    block_ids = torch.randperm(num_blocks, generator=generator).to(torch.int32)
    live = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    start = 0
    for i, ((_, kv_len), pages) in enumerate(zip(q_kv_lens, num_pages)):
        table[i, :pages] = block_ids[start:start + pages]
        start += pages
        positions = torch.arange(kv_len)
        live[table[i, positions // block_size].long(), positions % block_size] = True
    q_lens = [q_len for q_len, _ in q_kv_lens]
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(q_lens).cumsum(0)
    q = torch.randn(sum(q_lens), num_heads, latent_dim, generator=generator)
    lens = torch.tensor([kv_len for _, kv_len in q_kv_lens], dtype=torch.int32)
    return LatentBatch(q, pool, cu, lens, table, live, token_major)


def fp8_scale(dtype: torch.dtype) -> float:
    return 0.05 if dtype in FP8 else 1.0


def tolerance(dtype: torch.dtype) -> float:
    return 1e-4 * 4 if dtype in FP8 else 1e-4  # test_fp8_kv's: 1e-4 times its value scale times 4


@pytest.fixture
def two_threads():
    """Two compute threads, whatever this host has: a long context then splits over them."""
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(saved)


# num_heads, latent_dim (kv_lora_rank + rope), v_dim, block_size, token-major pool (rows not latent_dim apart)
SHAPES = [
    (1, 80, 64, 16, False),
    (16, 80, 64, 32, True),
    (128, 160, 128, 16, False),
    (16, 160, 128, 32, False),
    (16, 576, 512, 16, True),  # DeepSeek-V3's
    (128, 576, 512, 32, False),
]


@pytest.mark.parametrize("dtype", PAGES, ids=names.get)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"h{s[0]}-d{s[1]}-v{s[2]}-b{s[3]}{'-tm' if s[4] else ''}")
def test_decodes_match_the_reference_and_read_only_live_rows(shape, dtype):
    heads, latent_dim, v_dim, block_size, token_major = shape
    batch = make_latent_batch(DECODE, heads, latent_dim, block_size, token_major=token_major)
    scale, softmax_scale = fp8_scale(dtype), latent_dim**-0.5
    # fp32 queries over every page type (the public entry ties unquantized pages to q's dtype: bf16
    # pages with bf16 queries are tested below), against the reference on the same pages.
    expected = reference.latent_attention(*batch.args(batch.cache(dtype)), softmax_scale, v_dim=v_dim, scale=scale)
    actual = pd_kernels.cpu.latent_attention(*batch.args(batch.cache(dtype, poisoned=True)), softmax_scale,
                                             v_dim=v_dim, scale=scale)
    assert actual.shape == (len(DECODE), heads, v_dim) and not actual.isnan().any()
    assert (actual - expected).abs().max().item() <= tolerance(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn], ids=names.get)
def test_a_mixed_batch_takes_the_reference_for_its_prefill_rows_into_a_strided_out(dtype):
    batch = make_latent_batch(MIXED, 16, 160, 16)
    scale = fp8_scale(dtype)
    expected = reference.latent_attention(*batch.args(batch.cache(dtype)), 0.1, v_dim=128, scale=scale)
    # out: rows of a wider buffer (stride(1) is not v_dim), NaN until written.
    buffer = torch.full((batch.q.shape[0], 16, 144), float("nan"))
    out = buffer[..., :128]
    result = pd_kernels.latent_attention(*batch.args(batch.cache(dtype, poisoned=True)), 0.1, v_dim=128, out=out,
                                         scale=scale, backend="cpu")
    assert result is out and not out.isnan().any() and buffer[..., 128:].isnan().all()
    assert (out - expected).abs().max().item() <= tolerance(dtype)


@pytest.mark.parametrize("batch_lens", [[(1, 5000)], [(1, 3001), (1, 7)]], ids=["batch1", "batch2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e5m2], ids=names.get)
def test_a_long_context_split_over_the_threads_merges_as_one(two_threads, batch_lens, dtype):
    batch = make_latent_batch(batch_lens, 16, 576, 16)
    scale = fp8_scale(dtype)
    expected = reference.latent_attention(*batch.args(batch.cache(dtype)), 576**-0.5, v_dim=512, scale=scale)
    actual = pd_kernels.cpu.latent_attention(*batch.args(batch.cache(dtype, poisoned=True)), 576**-0.5, v_dim=512,
                                             scale=scale)
    assert not actual.isnan().any()
    assert (actual - expected).abs().max().item() <= tolerance(dtype)


def test_bf16_queries_over_bf16_pages_run_in_fp32_as_the_reference_does():
    batch = make_latent_batch(MIXED, 16, 576, 32)
    q = batch.q.bfloat16()
    expected = reference.latent_attention(*batch.args(batch.cache(torch.bfloat16), q), 0.05, v_dim=512)
    actual = pd_kernels.latent_attention(*batch.args(batch.cache(torch.bfloat16, poisoned=True), q), 0.05, v_dim=512,
                                         backend="cpu")
    assert actual.dtype == torch.bfloat16 and not actual.isnan().any()
    torch.testing.assert_close(actual.float(), expected.float(), atol=1e-2, rtol=1e-2)
    out = torch.full_like(expected, float("nan"))
    assert pd_kernels.latent_attention(*batch.args(batch.cache(torch.bfloat16), q), 0.05, v_dim=512, out=out,
                                       backend="cpu") is out
    torch.testing.assert_close(out.float(), expected.float(), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("lens", [DECODE, [(1, 5000), (1, 40)]], ids=["whole", "split"])
def test_a_nan_stays_in_its_sequence(two_threads, lens):
    batch = make_latent_batch(lens, 16, 160, 16)
    q = batch.q.clone()
    q[1, 3] = float("nan")  # one head of the second sequence: that head's output only
    # A NaN value in the first sequence's middle key (in a middle split of a split context): every head
    # of that sequence attends to it.
    key = lens[0][1] // 2
    batch.pool = batch.pool.clone()
    batch.pool[batch.block_table[0, key // 16].long(), LAYER, key % 16, 100] = float("nan")
    out = pd_kernels.latent_attention(*batch.args(batch.cache(torch.float32), q), 0.1, v_dim=128, backend="cpu")
    assert out[0].isnan().all()
    assert out[1, 3].isnan().all() and not out[1, [0, 1, 2, *range(4, 16)]].isnan().any()
    assert not out[2:].isnan().any()


def test_widths_off_the_vector_lanes_and_fp16_pages_take_the_reference():
    batch = make_latent_batch(DECODE, 4, 72, 16)
    cache = batch.cache(torch.float32)
    expected = reference.latent_attention(*batch.args(cache), 0.1, v_dim=56)
    assert torch.equal(pd_kernels.latent_attention(*batch.args(cache), 0.1, v_dim=56, backend="cpu"), expected)
    batch = make_latent_batch(DECODE, 4, 80, 16)
    q, cache = batch.q.half(), batch.cache(torch.float16)
    expected = reference.latent_attention(*batch.args(cache, q), 0.1, v_dim=64)
    assert torch.equal(pd_kernels.latent_attention(*batch.args(cache, q), 0.1, v_dim=64, backend="cpu"), expected)


def test_the_kernel_refuses_what_it_cannot_read():
    batch = make_latent_batch(DECODE, 4, 80, 16)
    cache = batch.cache(torch.float32)
    rows, out = batch.cu_seqlens_q[:-1].long(), torch.empty(len(DECODE), 4, 64)
    kernel = pd_kernels.cpu.build().latent_decode_attention
    with pytest.raises(RuntimeError, match="multiples of 16"):
        kernel(batch.q, cache, batch.block_table, batch.seq_lens, rows, 0.1, 1.0, torch.empty(len(DECODE), 4, 40))
    with pytest.raises(RuntimeError, match="not read here"):
        kernel(batch.q, cache.half(), batch.block_table, batch.seq_lens, rows, 0.1, 1.0, out)
    with pytest.raises(RuntimeError, match="int64 token_rows"):
        kernel(batch.q, cache, batch.block_table, batch.seq_lens, rows.int(), 0.1, 1.0, out)
    with pytest.raises(ValueError, match="CPU tensors"):
        pd_kernels.cpu.latent_attention(batch.q.to("meta"), cache, batch.cu_seqlens_q, batch.seq_lens,
                                        batch.block_table, 0.1, v_dim=64)
