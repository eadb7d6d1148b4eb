"""GPU benchmarks of the Triton kernels: ``python -m bench.kernels``.

Prints one JSON object per line. Each case is a ratio against a peer or a
physical limit measured in the same run, since absolute times on shared
machines are noise:

- ``copy``: device-to-device copy bandwidth (read + write), the decode ceiling;
- ``decode_attention``: batch 64, context 4096, heads 32/8 x 128, bf16; GB/s
  of K/V read against ``copy`` (goal >= 0.7 on H100/H200);
- ``decode_attention_fp8``: the same batch over float8_e4m3fn pages (bf16
  queries), against the bf16 pages' time: half the bytes, so up to 2x if the
  in-register conversion keeps up with the memory;
- ``decode_attention_few_seqs``: 4 sequences of 32K, where the split-KV path
  is chosen; against the single pass forced on the same inputs;
- ``prefill_attention``: 4 whole prompts of 2048 against SDPA's flash backend
  on the equivalent dense tensors (goal >= 0.7x);
- ``rms_norm``, ``rotary``: fused Triton against the unfused torch reference.

Times are medians of ``triton.testing.do_bench`` (which flushes L2 between
runs). Each attention case also reports its max abs error against the torch
reference, since bf16 can only be checked on CUDA. Without CUDA it prints
one line saying it was skipped.
"""

from __future__ import annotations

import json

import torch

DTYPE = torch.bfloat16
HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16


def _emit(**fields) -> None:
    print(json.dumps(fields), flush=True)


def _median_ms(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def _paged_batch(q_kv_lens: list[tuple[int, int]], seed: int = 0) -> dict:
    """Attention inputs over a 2-layer block-major pool, pages at random blocks, layer 1's strided views."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    pages = [-(-kv_len // BLOCK_SIZE) for _, kv_len in q_kv_lens]
    num_blocks = sum(pages)
    pool = torch.randn(num_blocks, 2, 2, BLOCK_SIZE, KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE, generator=generator)
    block_ids = torch.randperm(num_blocks, device="cuda", generator=generator).to(torch.int32)
    block_table = torch.zeros(len(q_kv_lens), max(pages), dtype=torch.int32, device="cuda")
    start = 0
    for i, n in enumerate(pages):
        block_table[i, :n] = block_ids[start : start + n]
        start += n
    q_lens = torch.tensor([q_len for q_len, _ in q_kv_lens], dtype=torch.int32)
    num_tokens = int(q_lens.sum())
    return dict(
        q=torch.randn(num_tokens, HEADS, HEAD_DIM, device="cuda", dtype=DTYPE, generator=generator),
        k_cache=pool[:, 1, 0],
        v_cache=pool[:, 1, 1],
        cu_seqlens_q=torch.cat([torch.zeros(1, dtype=torch.int32), q_lens.cumsum(0, dtype=torch.int32)]).cuda(),
        seq_lens=torch.tensor([kv_len for _, kv_len in q_kv_lens], dtype=torch.int32, device="cuda"),
        block_table=block_table,
        softmax_scale=HEAD_DIM**-0.5,
    )


def _kv_bytes(args: dict) -> int:
    """Bytes of K and V the batch must read at least once, plus q and the output."""
    kv_tokens = int(args["seq_lens"].sum())
    element = args["q"].element_size()
    return 2 * kv_tokens * KV_HEADS * HEAD_DIM * args["k_cache"].element_size() + 2 * args["q"].numel() * element


def _max_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return (actual.float() - expected.float()).abs().max().item()


def bench_copy() -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = _median_ms(lambda: dst.copy_(src))
    gbps = 2 * src.numel() / ms / 1e6  # read + write
    _emit(case="copy", bytes=src.numel(), median_ms=ms, gbps=gbps)
    return gbps


def bench_decode(copy_gbps: float) -> None:
    """bf16 pages, then the same keys and values stored as float8_e4m3fn pages."""
    from pd_kernels import fp8, reference
    from pd_kernels.triton import unified_attention

    args = _paged_batch([(1, 4096)] * 64)
    out = torch.empty_like(args["q"])
    ms = _median_ms(lambda: unified_attention(**args, out=out))
    gbps = _kv_bytes(args) / ms / 1e6
    _emit(
        case="decode_attention", batch=64, context=4096, heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
        dtype="bf16", median_ms=ms, gbps=gbps, copy_gbps=copy_gbps, fraction_of_copy=gbps / copy_gbps,
        max_abs_err=_max_err(out, reference.unified_attention(**args)),
    )
    scales = {"k_scale": 0.5, "v_scale": 0.5}  # randn / 0.5 stays well inside e4m3's +-448
    fp8_args = dict(args, k_cache=fp8.quantize(args["k_cache"], scales["k_scale"], torch.float8_e4m3fn),
                    v_cache=fp8.quantize(args["v_cache"], scales["v_scale"], torch.float8_e4m3fn))
    fp8_ms = _median_ms(lambda: unified_attention(**fp8_args, **scales, out=out))
    fp8_gbps = _kv_bytes(fp8_args) / fp8_ms / 1e6
    _emit(
        case="decode_attention_fp8", batch=64, context=4096, dtype="bf16", kv_dtype="float8_e4m3fn",
        median_ms=fp8_ms, bf16_pages_ms=ms, speedup_vs_bf16_pages=ms / fp8_ms, gbps=fp8_gbps,
        fraction_of_copy=fp8_gbps / copy_gbps,
        max_abs_err=_max_err(out, reference.unified_attention(**fp8_args, **scales)),
    )


def bench_decode_few_seqs(copy_gbps: float) -> None:
    from pd_kernels import reference
    from pd_kernels.triton import choose_num_splits, unified_attention
    from pd_kernels.triton.launch import device_sm_count
    from pd_kernels.triton.paged_attention import choose_tiles, launch_paged_attention

    num_seqs, context = 4, 32768
    args = _paged_batch([(1, context)] * num_seqs)
    num_splits = choose_num_splits(num_seqs, num_seqs, KV_HEADS, args["block_table"].shape[1] * BLOCK_SIZE,
                                   device_sm_count(args["q"].device))
    out = torch.empty_like(args["q"])
    ms = _median_ms(lambda: unified_attention(**args, out=out))
    single = torch.empty_like(args["q"])
    tiles = choose_tiles(args["q"], HEADS // KV_HEADS, decode_only=True)
    positional = [args[name] for name in ("q", "k_cache", "v_cache", "cu_seqlens_q", "seq_lens", "block_table")]
    single_ms = _median_ms(
        lambda: launch_paged_attention(*positional, args["softmax_scale"], None, None, single, tiles)
    )
    gbps = _kv_bytes(args) / ms / 1e6
    _emit(
        case="decode_attention_few_seqs", batch=num_seqs, context=context, dtype="bf16", num_splits=num_splits,
        median_ms=ms, single_pass_ms=single_ms, speedup_vs_single_pass=single_ms / ms, gbps=gbps,
        fraction_of_copy=gbps / copy_gbps, max_abs_err=_max_err(out, reference.unified_attention(**args)),
    )


def bench_prefill() -> None:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from pd_kernels import reference
    from pd_kernels.triton import unified_attention

    num_seqs, prompt_len = 4, 2048
    args = _paged_batch([(prompt_len, prompt_len)] * num_seqs)
    out = torch.empty_like(args["q"])
    ms = _median_ms(lambda: unified_attention(**args, out=out))

    # The same prompts as dense [batch, heads, len, head_dim] tensors, K/V repeated per query head.
    q = args["q"].view(num_seqs, prompt_len, HEADS, HEAD_DIM).transpose(1, 2).contiguous()
    pages = args["block_table"].long()  # [num_seqs, prompt_len / BLOCK_SIZE]

    def dense(cache: torch.Tensor) -> torch.Tensor:
        kv = cache[pages].flatten(1, 2)  # [num_seqs, prompt_len, kv_heads, head_dim]
        return kv.transpose(1, 2).repeat_interleave(HEADS // KV_HEADS, dim=1).contiguous()

    k, v = dense(args["k_cache"]), dense(args["v_cache"])
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        sdpa_ms = _median_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=args["softmax_scale"]))
    flops = 4 * num_seqs * HEADS * prompt_len * prompt_len * HEAD_DIM / 2  # causal: half the score matrix
    _emit(
        case="prefill_attention", batch=num_seqs, prompt_len=prompt_len, dtype="bf16", median_ms=ms,
        sdpa_flash_ms=sdpa_ms, speed_vs_sdpa_flash=sdpa_ms / ms, tflops=flops / ms / 1e9,
        max_abs_err=_max_err(out, reference.unified_attention(**args)),
    )


def bench_rms_norm() -> None:
    from pd_kernels import reference
    from pd_kernels.triton import rms_norm

    x = torch.randn(8192, 4096, device="cuda", dtype=DTYPE)
    residual = torch.randn_like(x)
    weight = torch.randn(4096, device="cuda", dtype=DTYPE)
    fused_ms = _median_ms(lambda: rms_norm(x, weight, 1e-6, residual))
    torch_ms = _median_ms(lambda: reference.rms_norm(x, weight, 1e-6, residual))
    gbps = 4 * x.numel() * x.element_size() / fused_ms / 1e6  # read x, residual; write normed, sum
    _emit(case="rms_norm", tokens=8192, hidden=4096, dtype="bf16", median_ms=fused_ms, torch_ms=torch_ms,
          speedup_vs_torch=torch_ms / fused_ms, gbps=gbps)


def bench_rotary() -> None:
    from pd_kernels import reference
    from pd_kernels.triton import rotary_embedding

    num_tokens, max_positions = 8192, 8192
    q = torch.randn(num_tokens, HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    k = torch.randn(num_tokens, KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    positions = torch.randint(0, max_positions, (num_tokens,), device="cuda")
    inv_freq = 1.0 / (500000 ** (torch.arange(0, HEAD_DIM, 2, device="cuda") / HEAD_DIM))
    angles = torch.arange(max_positions, device="cuda").unsqueeze(1) * inv_freq
    cos_sin_cache = torch.cat((angles.cos(), angles.sin()), dim=-1)
    fused_ms = _median_ms(lambda: rotary_embedding(q, k, positions, cos_sin_cache))
    torch_ms = _median_ms(lambda: reference.rotary_embedding(q, k, positions, cos_sin_cache))
    _emit(case="rotary", tokens=num_tokens, heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype="bf16",
          median_ms=fused_ms, torch_ms=torch_ms, speedup_vs_torch=torch_ms / fused_ms)


def main() -> None:
    if not torch.cuda.is_available():
        _emit(case="skipped", reason="no CUDA device")
        return
    _emit(case="device", name=torch.cuda.get_device_name())
    copy_gbps = bench_copy()
    bench_decode(copy_gbps)
    bench_decode_few_seqs(copy_gbps)
    bench_prefill()
    bench_rms_norm()
    bench_rotary()


if __name__ == "__main__":
    main()
