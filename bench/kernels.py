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
- ``prefill_attention``: whole causal prompts totalling 16K tokens (32 x 512,
  8 x 2048, 2 x 8192) at head dims 64, 80 and 128, heads 32/8, against SDPA's
  flash backend on the equivalent dense tensors (its own GQA, else K/V
  repeated outside the timed call); TFLOP/s of each over the causal pairs
  (``causal_attention_flops``), the ratio (goal >= 0.7x), and the max abs
  difference from SDPA's output; a shape SDPA refuses carries its error;
- ``prefill_attention_fp8``: 8 x 2048 at head dim 128 over float8_e4m3fn pages
  against the same prompts over bf16 pages;
- ``rms_norm``, ``rotary``: fused Triton against the unfused torch reference.

Attention runs through the public ``pd_kernels.unified_attention`` on one
layer's views of a pool in the engine's layout (``pd.engine.kv_layout``),
pages at random blocks. Times are medians of ``triton.testing.do_bench``
(which flushes L2 between runs). Each attention case reports its max abs
error (against the torch reference, or SDPA for prefill), since bf16 can
only be checked on CUDA. A case that fails prints its error and the others
still run. Without CUDA it prints one line saying it was skipped.
"""

from __future__ import annotations

import json

import torch

DTYPE = torch.bfloat16
HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
COPY_BYTES = 1 << 30  # far past L2: the copy streams from and to HBM
FP8_SCALE = 0.5  # randn / 0.5 stays well inside e4m3's +-448
PREFILL_HEAD_DIMS = (64, 80, 128)
PREFILL_SHAPES = ((32, 512), (8, 2048), (2, 8192))  # (prompts, tokens each): 16K tokens a batch


def _emit(**fields) -> None:
    print(json.dumps(fields), flush=True)


def _median_ms(fn, rep: int = 100) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=10, rep=rep, return_mode="median")


def causal_attention_flops(prompt_lens: list[int], num_heads: int, head_dim: int) -> int:
    """Multiply-adds x 2 of causal attention over whole prompts: query i sees keys 0..i, so a prompt of n
    has n(n + 1)/2 (query, key) pairs, each a head_dim dot product for the score and one for P @ V."""
    return sum(4 * num_heads * head_dim * n * (n + 1) // 2 for n in prompt_lens)


def _paged_batch(q_kv_lens: list[tuple[int, int]], head_dim: int = HEAD_DIM, fp8: bool = False,
                 seed: int = 0) -> dict:
    """``unified_attention``'s arguments over layer 1 of a 2-layer pool in the engine's layout, pages at
    random blocks. The same seed gives the same values; ``fp8`` stores them as float8_e4m3fn pages."""
    from pd.engine.kv_layout import kv_pool, layer_views
    from pd_kernels import fp8 as fp8_pages

    generator = torch.Generator(device="cuda").manual_seed(seed)
    pages = [-(-kv_len // BLOCK_SIZE) for _, kv_len in q_kv_lens]
    num_blocks = sum(pages)
    pool = kv_pool(num_blocks, 2, BLOCK_SIZE, KV_HEADS, head_dim, DTYPE, "cuda")
    pool.normal_(generator=generator)
    scale = 1.0
    if fp8:
        pool, scale = fp8_pages.quantize(pool, FP8_SCALE, torch.float8_e4m3fn), FP8_SCALE
    block_ids = torch.randperm(num_blocks, device="cuda", generator=generator).to(torch.int32)
    block_table = torch.zeros(len(q_kv_lens), max(pages), dtype=torch.int32, device="cuda")
    start = 0
    for i, n in enumerate(pages):
        block_table[i, :n] = block_ids[start : start + n]
        start += n
    q_lens = torch.tensor([q_len for q_len, _ in q_kv_lens], dtype=torch.int32)
    k_cache, v_cache = layer_views(pool)[1]
    return dict(
        q=torch.randn(int(q_lens.sum()), HEADS, head_dim, device="cuda", dtype=DTYPE, generator=generator),
        k_cache=k_cache,
        v_cache=v_cache,
        cu_seqlens_q=torch.cat([torch.zeros(1, dtype=torch.int32), q_lens.cumsum(0, dtype=torch.int32)]).cuda(),
        seq_lens=torch.tensor([kv_len for _, kv_len in q_kv_lens], dtype=torch.int32, device="cuda"),
        block_table=block_table,
        softmax_scale=head_dim**-0.5,
        k_scale=scale,
        v_scale=scale,
    )


def _kv_bytes(args: dict) -> int:
    """Bytes of K and V the batch must read at least once, plus q and the output."""
    kv_tokens = int(args["seq_lens"].sum())
    kv_heads, head_dim = args["k_cache"].shape[2], args["k_cache"].shape[3]
    element = args["q"].element_size()
    return 2 * kv_tokens * kv_heads * head_dim * args["k_cache"].element_size() + 2 * args["q"].numel() * element


def _max_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return (actual.float() - expected.float()).abs().max().item()


def _error(exc: Exception) -> str:
    return f"{type(exc).__name__}: {str(exc)[:300]}"


def measure_copy(num_bytes: int = COPY_BYTES) -> tuple[float, float]:
    """(median ms, GB/s) of a device-to-device copy of ``num_bytes``, counting bytes read + written."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = _median_ms(lambda: dst.copy_(src), rep=200)
    return ms, 2 * num_bytes / ms / 1e6


def bench_copy() -> float:
    ms, gbps = measure_copy()
    _emit(case="copy", bytes=COPY_BYTES, median_ms=ms, gbps=gbps)
    return gbps


def bench_decode(copy_gbps: float) -> None:
    """bf16 pages, then the same keys and values stored as float8_e4m3fn pages."""
    from pd_kernels import reference, unified_attention

    lens = [(1, 4096)] * 64
    args = _paged_batch(lens)
    out = torch.empty_like(args["q"])
    ms = _median_ms(lambda: unified_attention(**args, out=out), rep=200)
    gbps = _kv_bytes(args) / ms / 1e6
    _emit(
        case="decode_attention", batch=64, context=4096, heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
        dtype="bf16", median_ms=ms, gbps=gbps, copy_gbps=copy_gbps, fraction_of_copy=gbps / copy_gbps,
        max_abs_err=_max_err(out, reference.unified_attention(**args)),
    )
    fp8_args = _paged_batch(lens, fp8=True)
    fp8_ms = _median_ms(lambda: unified_attention(**fp8_args, out=out), rep=200)
    fp8_gbps = _kv_bytes(fp8_args) / fp8_ms / 1e6
    _emit(
        case="decode_attention_fp8", batch=64, context=4096, dtype="bf16", kv_dtype="float8_e4m3fn",
        median_ms=fp8_ms, bf16_pages_ms=ms, speedup_vs_bf16_pages=ms / fp8_ms, gbps=fp8_gbps,
        fraction_of_copy=fp8_gbps / copy_gbps,
        max_abs_err=_max_err(out, reference.unified_attention(**fp8_args)),
    )


def bench_decode_few_seqs(copy_gbps: float) -> None:
    from pd_kernels import reference, unified_attention
    from pd_kernels.triton import choose_num_splits
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


def _sdpa_flash(args: dict, num_prompts: int, prompt_len: int):
    """SDPA's flash backend on ``args``' prompts as dense ``[prompts, heads, len, head_dim]`` tensors: (the
    call to time, how it takes GQA). Native GQA where this torch's flash has it, else K/V repeated here."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    head_dim = args["q"].shape[-1]
    q = args["q"].view(num_prompts, prompt_len, HEADS, head_dim).transpose(1, 2).contiguous()
    pages = args["block_table"].long()  # [prompts, prompt_len / BLOCK_SIZE]

    def dense(cache: torch.Tensor) -> torch.Tensor:  # [prompts, kv_heads, prompt_len, head_dim]
        return cache[pages].flatten(1, 2)[:, :prompt_len].transpose(1, 2).contiguous()

    k, v = dense(args["k_cache"]), dense(args["v_cache"])
    scale = args["softmax_scale"]

    def native():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)

    try:
        native()
        return native, "native"
    except RuntimeError:
        group = HEADS // KV_HEADS
        k_all, v_all = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)

        def repeated():
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q, k_all, v_all, is_causal=True, scale=scale)

        return repeated, "repeated"


def bench_prefill_case(head_dim: int, num_prompts: int, prompt_len: int) -> None:
    from pd_kernels import unified_attention

    record = dict(case="prefill_attention", head_dim=head_dim, batch=num_prompts, prompt_len=prompt_len,
                  heads=HEADS, kv_heads=KV_HEADS, dtype="bf16")
    args = _paged_batch([(prompt_len, prompt_len)] * num_prompts, head_dim)
    flops = causal_attention_flops([prompt_len] * num_prompts, HEADS, head_dim)
    out = torch.empty_like(args["q"])
    ms = _median_ms(lambda: unified_attention(**args, out=out))
    record.update(median_ms=ms, tflops=flops / ms / 1e9)
    try:
        sdpa, gqa = _sdpa_flash(args, num_prompts, prompt_len)
        expected = sdpa().transpose(1, 2).reshape(out.shape)
        sdpa_ms = _median_ms(sdpa)
    except RuntimeError as exc:
        _emit(**record, sdpa_error=_error(exc))
        return
    _emit(**record, sdpa_flash_ms=sdpa_ms, sdpa_tflops=flops / sdpa_ms / 1e9, sdpa_gqa=gqa,
          speed_vs_sdpa_flash=sdpa_ms / ms, max_abs_err_vs_sdpa=_max_err(out, expected))


def bench_prefill_fp8() -> None:
    """8 prompts of 2048 over FP8 pages against the same values over bf16 pages."""
    from pd_kernels import reference, unified_attention

    num_prompts, prompt_len = 8, 2048
    lens = [(prompt_len, prompt_len)] * num_prompts
    args, fp8_args = _paged_batch(lens), _paged_batch(lens, fp8=True)
    out = torch.empty_like(args["q"])
    bf16_ms = _median_ms(lambda: unified_attention(**args, out=out))
    ms = _median_ms(lambda: unified_attention(**fp8_args, out=out))
    flops = causal_attention_flops([prompt_len] * num_prompts, HEADS, HEAD_DIM)
    _emit(case="prefill_attention_fp8", batch=num_prompts, prompt_len=prompt_len, head_dim=HEAD_DIM, dtype="bf16",
          kv_dtype="float8_e4m3fn", median_ms=ms, bf16_pages_ms=bf16_ms, speedup_vs_bf16_pages=bf16_ms / ms,
          tflops=flops / ms / 1e9, max_abs_err=_max_err(out, reference.unified_attention(**fp8_args)))


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


def _run(case: str, fn, *args, **fields) -> None:
    """One case; its failure is its line (named by ``case`` and ``fields``), and the next case still runs."""
    try:
        fn(*args)
    except Exception as exc:  # noqa: BLE001 - a benchmark's failure is its result
        _emit(case=case, **fields, error=_error(exc))
    torch.cuda.empty_cache()


def main() -> None:
    if not torch.cuda.is_available():
        _emit(case="skipped", reason="no CUDA device")
        return
    _emit(case="device", name=torch.cuda.get_device_name())
    copy_gbps = bench_copy()
    _run("decode_attention", bench_decode, copy_gbps)
    _run("decode_attention_few_seqs", bench_decode_few_seqs, copy_gbps)
    for head_dim in PREFILL_HEAD_DIMS:
        for num_prompts, prompt_len in PREFILL_SHAPES:
            _run("prefill_attention", bench_prefill_case, head_dim, num_prompts, prompt_len, head_dim=head_dim,
                 batch=num_prompts, prompt_len=prompt_len)
    _run("prefill_attention_fp8", bench_prefill_fp8)
    _run("rms_norm", bench_rms_norm)
    _run("rotary", bench_rotary)


if __name__ == "__main__":
    main()
