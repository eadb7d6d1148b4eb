"""Attention tile sizes on the GPU at hand: ``python -m bench.attention_tiles [--quick]``.

The tile choices in ``pd_kernels.triton`` (``prefill_tiles``, ``gpu_tiles``) were taken from this sweep on
an H200; on another GPU, run it and compare. Prints one JSON line per (case, tiles):

- ``prefill``: the prefill kernel over 4 prompts of 2,048 tokens (heads 32/8, bf16 pages), at head dims 64,
  80 and 128, against SDPA's flash backend on the same tensors laid out dense (``ratio``: SDPA's time over
  ours, so above 1 is faster), with TFLOP/s counted over the causal half;
- ``decode_fp8``: the decode kernel at batch 64 x 4,096 over float8_e4m3fn pages (bf16 queries), against the
  same kernel over bf16 pages at its default tiles (``ratio``: bf16's time over FP8's).

Each line carries the max abs error against the torch reference, so a fast wrong tile shows. Times are
medians of ``triton.testing.do_bench``. Without CUDA it prints one line saying it was skipped.
"""

from __future__ import annotations

import argparse
import json

import torch

HEADS, KV_HEADS, BLOCK_SIZE = 32, 8, 16


def _emit(**fields) -> None:
    print(json.dumps(fields), flush=True)


def _median_ms(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")


def paged_inputs(q_lens: list[int], kv_lens: list[int], head_dim: int, kv_dtype: torch.dtype, seed: int = 0) -> dict:
    """A batch over one layer of a block-major pool at random blocks (the engine's layout)."""
    from pd.engine.kv_layout import layer_views

    generator = torch.Generator(device="cuda").manual_seed(seed)
    pages = [-(-n // BLOCK_SIZE) for n in kv_lens]
    pool = torch.randn(sum(pages), KV_HEADS, 1, 2, BLOCK_SIZE, head_dim, device="cuda", generator=generator)
    pool = pool.to(kv_dtype)
    block_ids = torch.randperm(sum(pages), device="cuda", generator=generator).to(torch.int32)
    table = torch.zeros(len(kv_lens), max(pages), dtype=torch.int32, device="cuda")
    start = 0
    for i, n in enumerate(pages):
        table[i, :n] = block_ids[start : start + n]
        start += n
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32, device="cuda")
    cu[1:] = torch.tensor(q_lens, device="cuda").cumsum(0)
    k_cache, v_cache = layer_views(pool)[0]
    q = torch.randn(sum(q_lens), HEADS, head_dim, device="cuda", dtype=torch.bfloat16, generator=generator)
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, cu_seqlens_q=cu,
                seq_lens=torch.tensor(kv_lens, dtype=torch.int32, device="cuda"), block_table=table)


def _args(batch: dict) -> tuple:
    return (batch["q"], batch["k_cache"], batch["v_cache"], batch["cu_seqlens_q"], batch["seq_lens"],
            batch["block_table"])


def sweep_prefill(head_dims: tuple[int, ...], configs: list[tuple[int, int, int, int] | None],
                  kv_dtype: torch.dtype = torch.bfloat16) -> None:
    """``configs``: (rows, keys, warps, stages), or None for the tiles the launcher takes."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from pd_kernels import reference
    from pd_kernels.triton.paged_attention import NO_REGISTER_CAP, TileConfig
    from pd_kernels.triton.prefill_attention import choose_prefill_tiles, launch_prefill_attention

    num_prompts, length = 4, 2048
    for head_dim in head_dims:
        batch = paged_inputs([length] * num_prompts, [length] * num_prompts, head_dim, kv_dtype)
        scale = head_dim**-0.5
        expected = reference.unified_attention(*_args(batch), scale)
        q = batch["q"].view(num_prompts, length, HEADS, head_dim).transpose(1, 2)
        k, v = (cache[batch["block_table"].long()].flatten(1, 2)[:, :length].transpose(1, 2).to(torch.bfloat16)
                .repeat_interleave(HEADS // KV_HEADS, dim=1) for cache in (batch["k_cache"], batch["v_cache"]))
        flops = 4 * num_prompts * HEADS * head_dim * length * (length + 1) / 2
        try:
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                sdpa_ms = _median_ms(lambda: torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, is_causal=True, scale=scale))
        except RuntimeError as exc:
            sdpa_ms = None
            _emit(case="prefill_sdpa", head_dim=head_dim, error=str(exc)[:200])
        for config in configs:
            if config is None:
                tiles = choose_prefill_tiles(batch["q"], HEADS // KV_HEADS)
            else:
                block_m, tile, warps, stages = config
                tiles = TileConfig(block_m, block_m // (HEADS // KV_HEADS), tile, warps, stages, NO_REGISTER_CAP)
            out = torch.empty_like(batch["q"])
            record = dict(case="prefill", head_dim=head_dim, kv_dtype=str(kv_dtype).removeprefix("torch."),
                          tokens=num_prompts * length, block_m=tiles.block_m, tile=tiles.tile,
                          num_warps=tiles.num_warps, num_stages=tiles.num_stages, default=config is None)
            try:
                def run(tiles=tiles, out=out):
                    launch_prefill_attention(*_args(batch), scale, None, None, out, tiles)
                run()
                error = (out.float() - expected).abs().max().item()
                ms = _median_ms(run)
            except Exception as exc:  # noqa: BLE001 - a tile that does not compile is this line's result
                _emit(**record, error=f"{type(exc).__name__}: {str(exc)[:200]}")
                continue
            _emit(**record, median_ms=ms, tflops=flops / ms / 1e9, sdpa_ms=sdpa_ms,
                  sdpa_tflops=flops / sdpa_ms / 1e9 if sdpa_ms else None,
                  ratio=sdpa_ms / ms if sdpa_ms else None, max_abs_err=error)


def sweep_decode_fp8(configs: list[tuple[int, int, int]]) -> None:
    from pd_kernels import reference
    from pd_kernels.triton.paged_attention import TileConfig, gpu_tiles, launch_paged_attention

    batch_size, context, head_dim = 64, 4096, 128
    group = HEADS // KV_HEADS
    native = paged_inputs([1] * batch_size, [context] * batch_size, head_dim, torch.bfloat16)
    fp8 = paged_inputs([1] * batch_size, [context] * batch_size, head_dim, torch.float8_e4m3fn)  # same values
    expected = reference.unified_attention(*_args(fp8), head_dim**-0.5)
    default = gpu_tiles(2, head_dim, group, decode_only=True)
    out = torch.empty_like(native["q"])
    bf16_ms = _median_ms(lambda: launch_paged_attention(*_args(native), head_dim**-0.5, None, None, out, default))
    kv_bytes = 2 * batch_size * context * KV_HEADS * head_dim
    for tile, warps, stages in configs:
        tiles = TileConfig(default.block_m, default.block_q, tile, warps, stages, default.max_registers)
        record = dict(case="decode_fp8", batch=batch_size, context=context, tile=tile, num_warps=warps,
                      num_stages=stages, bf16_ms=bf16_ms, bf16_gbps=2 * kv_bytes / bf16_ms / 1e6)
        try:
            def run(tiles=tiles):
                launch_paged_attention(*_args(fp8), head_dim**-0.5, None, None, out, tiles)
            run()
            error = (out.float() - expected).abs().max().item()
            ms = _median_ms(run)
        except Exception as exc:  # noqa: BLE001 - a tile that does not compile is this line's result
            _emit(**record, error=f"{type(exc).__name__}: {str(exc)[:200]}")
            continue
        _emit(**record, median_ms=ms, gbps=kv_bytes / ms / 1e6, ratio=bf16_ms / ms, max_abs_err=error)


PREFILL_CONFIGS = [(128, 64, 8, 3), (128, 64, 8, 2), (128, 64, 4, 3), (128, 128, 8, 2), (128, 128, 8, 3),
                   (128, 32, 4, 4), (64, 64, 4, 3), (256, 64, 8, 2)]
DECODE_FP8_CONFIGS = [(64, 4, 3), (128, 4, 3), (128, 4, 2), (128, 4, 4), (256, 4, 3), (128, 8, 3), (256, 8, 2)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the default tiles and two others of each case")
    parser.add_argument("--cases", default="decode_fp8,prefill",
                        help="comma-separated: decode_fp8, prefill, prefill_default (the launcher's tiles, bf16 and "
                             "FP8 pages)")
    args = parser.parse_args()
    cases = set(args.cases.split(","))
    if not torch.cuda.is_available():
        _emit(case="skipped", reason="no CUDA device")
        return
    _emit(case="device", name=torch.cuda.get_device_name())
    prefill = PREFILL_CONFIGS[:3] if args.quick else PREFILL_CONFIGS
    decode = DECODE_FP8_CONFIGS[:3] if args.quick else DECODE_FP8_CONFIGS
    if "decode_fp8" in cases:
        sweep_decode_fp8(decode)
    if "prefill" in cases:
        sweep_prefill((128, 64, 80), prefill)
    if "prefill_default" in cases:
        sweep_prefill((128, 64, 80), [None])
        sweep_prefill((128, 64), [None], torch.float8_e4m3fn)


if __name__ == "__main__":
    main()
