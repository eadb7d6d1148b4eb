"""The fused-MoE op and its routing: the reference against a per-token definition and against HF's
Qwen3-MoE block, the CPU and Triton backends (interpreted here, compiled under ``make gpu-check``) against
the reference, the slot alignment, and the launch checks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import pd_kernels
from pd_kernels import reference
from pd_kernels.checks import check_fused_moe_args, check_select_experts_args
from pd_kernels.triton.moe import moe_align
from tests.pd_kernels.conftest import DEVICE


def _weights(num_experts: int, hidden: int, inter: int, dtype=torch.float32, seed: int = 0):
    torch.manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * inter, hidden) / hidden ** 0.5
    w2 = torch.randn(num_experts, hidden, inter) / inter ** 0.5
    return w13.to(dtype), w2.to(dtype)


def _routed(tokens: int, num_experts: int, top_k: int, hidden: int, dtype=torch.float32, seed: int = 1):
    torch.manual_seed(seed)
    x = torch.randn(tokens, hidden).to(dtype)
    logits = torch.randn(tokens, num_experts) * 4
    weights, ids = pd_kernels.select_experts(logits, top_k, renormalize=True)
    return x, ids, weights


def _per_token(hidden, w13, w2, ids, weights):
    """The definition, one token and slot at a time."""
    hidden, w13, w2, ids, weights = (t.cpu() for t in (hidden, w13, w2, ids, weights))
    out = torch.zeros(hidden.shape, dtype=torch.float64, device="cpu")  # not the test device's default
    for t in range(hidden.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = (hidden[t].double() @ w13[e].double().t()).chunk(2)
            out[t] += float(weights[t, j]) * ((F.silu(gate) * up) @ w2[e].double().t())
    return out


@pytest.mark.parametrize("tokens, num_experts, top_k", [(1, 4, 1), (7, 8, 2), (33, 16, 4), (5, 4, 4)])
def test_reference_is_the_per_token_definition(tokens, num_experts, top_k):
    w13, w2 = _weights(num_experts, 64, 32)
    x, ids, weights = _routed(tokens, num_experts, top_k, 64)
    torch.testing.assert_close(reference.fused_moe(x, w13, w2, ids, weights).double().cpu(),
                               _per_token(x, w13, w2, ids, weights), rtol=1e-4, atol=1e-5)


BACKENDS = ["cpu", "triton"] if DEVICE == "cpu" else ["triton"]
# (tokens, experts, k, hidden, intermediate): a decode batch, k = 1 and k = E, more rows than one tile holds,
# and sizes that are no multiple of the tiles.
SHAPES = [(1, 4, 1, 64, 32), (16, 8, 2, 64, 48), (64, 16, 4, 64, 32), (130, 8, 2, 96, 40), (5, 4, 4, 64, 32)]


# The Triton interpreter computes in numpy, which has no bf16: Triton's bf16 runs compiled (make gpu-check).
CASES = [(backend, dtype) for backend in BACKENDS for dtype in (torch.float32, torch.float16, torch.bfloat16)
         if not (backend == "triton" and dtype == torch.bfloat16 and DEVICE == "cpu")]


@pytest.mark.parametrize("backend, dtype", CASES)
@pytest.mark.parametrize("tokens, num_experts, top_k, hidden, inter", SHAPES)
def test_backend_equals_the_reference(backend, dtype, tokens, num_experts, top_k, hidden, inter):
    w13, w2 = _weights(num_experts, hidden, inter, dtype)
    x, ids, weights = _routed(tokens, num_experts, top_k, hidden, dtype)
    tolerance = {"rtol": 1e-4, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 3e-2}
    torch.testing.assert_close(pd_kernels.fused_moe(x, w13, w2, ids, weights, backend=backend),
                               reference.fused_moe(x, w13, w2, ids, weights), **tolerance)


@pytest.mark.parametrize("backend", BACKENDS)
def test_experts_without_tokens_and_an_empty_batch(backend):
    w13, w2 = _weights(8, 64, 32)
    x = torch.randn(3, 64)
    ids = torch.tensor([[5, 2], [2, 5], [5, 2]])  # six experts get nothing
    weights = torch.full((3, 2), 0.5)
    torch.testing.assert_close(pd_kernels.fused_moe(x, w13, w2, ids, weights, backend=backend),
                               reference.fused_moe(x, w13, w2, ids, weights), rtol=1e-4, atol=1e-5)
    empty = pd_kernels.fused_moe(x[:0], w13, w2, ids[:0], weights[:0], backend=backend)
    assert empty.shape == (0, 64)


def test_alignment_pads_each_expert_to_the_tile_and_names_each_tiles_expert():
    ids = torch.tensor([[3, 0], [0, 3], [3, 1]])  # slots 0..5: expert 3 has 0, 3, 4; expert 0 has 1, 2; 1 has 5
    sorted_slots, block_experts = moe_align(ids, 4, 4)
    pad = 6
    assert sorted_slots.tolist()[:12] == [1, 2, pad, pad, 5, pad, pad, pad, 0, 3, 4, pad]
    assert set(sorted_slots.tolist()[12:]) <= {pad}
    assert block_experts.tolist()[:3] == [0, 1, 3] and set(block_experts.tolist()[3:]) <= {-1}


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs")
def test_the_triton_moe_replays_in_a_cuda_graph():
    """Routing, alignment and both kernels capture (no op reads the device back) and replay with new inputs."""
    w13, w2 = (t.to(DEVICE, torch.bfloat16) for t in _weights(8, 128, 64))
    x, ids, weights = (t.to(DEVICE) for t in _routed(16, 8, 2, 128))
    x = x.bfloat16()
    pd_kernels.fused_moe(x, w13, w2, ids, weights, backend="triton")  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = pd_kernels.fused_moe(x, w13, w2, ids, weights, backend="triton")
    fresh_x, fresh_ids, fresh_weights = (t.to(DEVICE) for t in _routed(16, 8, 2, 128, seed=7))
    x.copy_(fresh_x.bfloat16())
    ids.copy_(fresh_ids)
    weights.copy_(fresh_weights)
    graph.replay()
    torch.testing.assert_close(out, reference.fused_moe(x, w13, w2, ids, weights), rtol=2e-2, atol=3e-2)


def test_the_reference_equals_hf_qwen3_moe_block():
    """HF's own sparse block, eager experts, with our routing and the fused layout of its weights."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen3_moe import modeling_qwen3_moe as qwen3_moe

    config = transformers.Qwen3MoeConfig(hidden_size=64, moe_intermediate_size=48, num_experts=8,
                                         num_experts_per_tok=2, norm_topk_prob=True, experts_implementation="eager")
    assert config._experts_implementation == "eager"
    torch.manual_seed(0)
    block = qwen3_moe.Qwen3MoeSparseMoeBlock(config).eval()
    with torch.no_grad():
        for parameter in block.parameters():
            parameter.normal_(0, 0.2)
    state = block.state_dict()
    w13, w2 = _fused_weights(state, 8)
    x = torch.randn(1, 9, 64)
    with torch.no_grad():
        expected = block(x)
        expected = expected[0] if isinstance(expected, tuple) else expected
        gate_weight = state.get("gate.weight")
        weights, ids = pd_kernels.select_experts(F.linear(x[0], gate_weight), 2, renormalize=True)
        ours = reference.fused_moe(x[0], w13, w2, ids, weights)
    torch.testing.assert_close(ours, expected[0], rtol=1e-5, atol=1e-6)


def _fused_weights(state: dict, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's block weights in the fused layout, whether its version holds experts fused or one module each."""
    if "experts.gate_up_proj" in state:  # transformers 5 holds them fused: [E, 2I, H] and [E, H, I], as we do
        gate_up, down = state["experts.gate_up_proj"], state["experts.down_proj"]
        assert gate_up.shape == (num_experts, 96, 64) and down.shape == (num_experts, 64, 48)
        return gate_up, down
    w13 = torch.stack([torch.cat([state[f"experts.{e}.gate_proj.weight"], state[f"experts.{e}.up_proj.weight"]])
                       for e in range(num_experts)])
    w2 = torch.stack([state[f"experts.{e}.down_proj.weight"] for e in range(num_experts)])
    return w13, w2


def test_select_experts_renormalises_only_when_asked():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    probs = torch.softmax(logits, -1)
    weights, ids = reference.select_experts(logits, 2, renormalize=False)
    assert ids.tolist() == [[0, 1]]
    torch.testing.assert_close(weights, probs[:, :2])
    weights, _ = reference.select_experts(logits, 2, renormalize=True)
    torch.testing.assert_close(weights, probs[:, :2] / probs[:, :2].sum())


def test_select_experts_routes_in_fp32_and_breaks_ties_as_torch_topk():
    logits = torch.tensor([[1.0, 3.0, 3.0, 3.0]], dtype=torch.bfloat16)
    weights, ids = reference.select_experts(logits, 2, renormalize=False)
    assert weights.dtype == torch.float32
    assert ids.tolist() == torch.topk(torch.softmax(logits.float(), -1), 2).indices.tolist()


@pytest.mark.parametrize("change, named", [
    (lambda a: {**a, "hidden": a["hidden"][None]}, "hidden"),
    (lambda a: {**a, "w13": a["w13"][:, :-1]}, "w13"),
    (lambda a: {**a, "w2": a["w2"][:1]}, "w2"),
    (lambda a: {**a, "topk_ids": a["topk_ids"].float()}, "topk_ids"),
    *([(lambda a: {**a, "topk_ids": a["topk_ids"] + 8}, "topk_ids")] if DEVICE == "cpu" else []),  # CPU only
    (lambda a: {**a, "topk_weights": a["topk_weights"][:1]}, "topk_ids"),
    (lambda a: {**a, "w13": a["w13"].double()}, "w13"),
])
def test_bad_launches_name_the_argument(change, named):
    w13, w2 = _weights(8, 64, 32)
    x, ids, weights = _routed(4, 8, 2, 64)
    args = change({"hidden": x, "w13": w13, "w2": w2, "topk_ids": ids, "topk_weights": weights})
    with pytest.raises(ValueError, match=f"^{named}"):
        check_fused_moe_args(**args)


def test_top_k_beyond_the_experts_is_refused():
    with pytest.raises(ValueError, match="top_k"):
        check_select_experts_args(torch.zeros(2, 4), 5)


# The one-call C++ path (pd_kernels/cpu/moe.cpp) and the GEMM path of the cpu backend, each forced: slot groups
# of 1 to 4 rows and more than one group per expert, odd intermediate sizes (a lone last gate/up pair), hidden
# sizes that are no multiple of a vector (partial loads) nor of the 4 output features of a group.
ROWS_SHAPES = [(1, 8, 2, 64, 32), (3, 4, 4, 33, 17), (16, 8, 2, 1024, 48), (37, 16, 4, 70, 31), (130, 4, 2, 96, 40)]


@pytest.mark.skipif(DEVICE != "cpu", reason="the cpu backend's paths")
@pytest.mark.parametrize("path", ["rows", "grouped"])
@pytest.mark.parametrize("tokens, num_experts, top_k, hidden, inter", ROWS_SHAPES)
def test_each_cpu_path_equals_the_reference(monkeypatch, path, tokens, num_experts, top_k, hidden, inter):
    from pd_kernels.cpu import moe

    monkeypatch.setattr(moe, "MAX_SLOTS_PER_EXPERT", 10**9 if path == "rows" else 0)
    w13, w2 = _weights(num_experts, hidden, inter)
    x, ids, weights = _routed(tokens, num_experts, top_k, hidden)
    assert moe.use_rows_kernel(x, w13, w2, ids) == (path == "rows")
    got = moe.fused_moe(x, w13, w2, ids, weights)
    torch.testing.assert_close(got, reference.fused_moe(x, w13, w2, ids, weights), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got.double(), _per_token(x, w13, w2, ids, weights), rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(DEVICE != "cpu", reason="the cpu backend's paths")
def test_the_cpp_path_takes_int32_ids_and_half_precision_weights_of_the_routing():
    from pd_kernels.cpu import moe

    w13, w2 = _weights(8, 64, 32)
    x, ids, weights = _routed(5, 8, 2, 64)
    assert moe.use_rows_kernel(x, w13, w2, ids)
    expected = reference.fused_moe(x, w13, w2, ids, weights)
    torch.testing.assert_close(moe.fused_moe(x, w13, w2, ids.int(), weights.bfloat16().float()),
                               reference.fused_moe(x, w13, w2, ids, weights.bfloat16().float()), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(moe.fused_moe(x, w13, w2, ids, weights), expected, rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(DEVICE != "cpu", reason="the cpu backend's paths")
def test_the_cpp_path_keeps_a_nan_in_its_token_and_refuses_bad_ids():
    import pd_kernels.cpu

    w13, w2 = _weights(4, 64, 32)
    x, ids, weights = _routed(3, 4, 2, 64)
    x[1, 7] = float("nan")
    got = pd_kernels.cpu.moe.fused_moe(x, w13, w2, ids, weights)
    assert got[1].isnan().all() and not got[[0, 2]].isnan().any()
    with pytest.raises(RuntimeError, match="expert id 4 out of"):
        pd_kernels.cpu.build().fused_moe_rows(x, w13, w2, torch.full((3, 2), 4), weights)


@pytest.mark.skipif(DEVICE != "cpu", reason="the cpu backend's paths")
def test_the_grouped_path_runs_oneDNN_on_bucketed_row_counts(monkeypatch):
    """Every expert's GEMMs see ``padded_rows`` counts (oneDNN keeps a kernel per shape), and the padding
    rows change nothing."""
    from pd_kernels.cpu import moe
    from pd_kernels.onednn import padded_rows

    if moe.linear_pointwise is None:
        pytest.skip("no oneDNN in this torch")
    seen = []
    gemm = moe._onednn_gemm
    monkeypatch.setattr(moe, "_onednn_gemm", lambda x, w: seen.append(x.shape[0]) or gemm(x, w))
    w13, w2 = _weights(3, 64, 32)
    x, ids, weights = _routed(300, 3, 2, 64)  # about 200 slots an expert
    got = moe.fused_moe_grouped(x, w13, w2, ids, weights)
    torch.testing.assert_close(got, reference.fused_moe(x, w13, w2, ids, weights), rtol=1e-4, atol=1e-5)
    counts = torch.bincount(ids.reshape(-1), minlength=3).tolist()
    assert sorted(seen) == sorted(2 * [padded_rows(c) for c in counts if c])
    assert any(padded_rows(c) != c for c in counts)


def test_strided_weights_and_other_dtypes_take_the_grouped_path():
    from pd_kernels.cpu import moe

    w13, w2 = _weights(4, 64, 32)
    x, ids, _ = _routed(3, 4, 2, 64)
    assert not moe.use_rows_kernel(x, w13.transpose(1, 2).contiguous().transpose(1, 2), w2, ids)
    assert not moe.use_rows_kernel(x.bfloat16(), w13.bfloat16(), w2.bfloat16(), ids)


@pytest.mark.integration  # a child pytest
@pytest.mark.skipif(DEVICE != "cpu" or "PD_TEST_MOE_ISA" in os.environ, reason="the parent, on CPU")
def test_the_avx2_build_passes_the_moe_kernel_tests():
    """An AVX-512 host runs the AVX2 build (2 rows per slot group, 8 lanes) under ``ATEN_CPU_CAPABILITY=avx2``,
    read at start, so in a child pytest; an AVX2 host runs its own build there."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX512", "AVX2"):
        pytest.skip("no AVX2 path on this host")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "PD_TEST_MOE_ISA": "AVX2"}
    child = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__,
                            "-k", "cpu_path or cpp_path or child_runs"], cwd=Path(__file__).resolve().parents[2],
                           env=env, capture_output=True, text=True, timeout=900)
    assert child.returncode == 0, child.stdout[-6000:] + child.stderr[-2000:]
    assert " passed" in child.stdout and "skipped" not in child.stdout.splitlines()[-1], child.stdout[-2000:]


@pytest.mark.skipif("PD_TEST_MOE_ISA" not in os.environ, reason="runs in the AVX2 child only")
def test_the_child_runs_the_avx2_build():
    import pd_kernels.cpu

    assert pd_kernels.cpu.isa() == os.environ["PD_TEST_MOE_ISA"]
    assert pd_kernels.cpu.build().__name__ == f"pd_cpu_kernels_{os.environ['PD_TEST_MOE_ISA'].lower()}"
