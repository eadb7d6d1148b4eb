"""The model runner's step input: flat host lists, one copy to the device, typed views."""

from __future__ import annotations

import pytest
import torch

from pd.config import EngineConfig
from pd.engine.host_copy import copy_to_device
from pd.engine.model_runner import ModelRunner
from pd.engine.outputs import ScheduledRequest, SchedulerOutput
from pd.engine.request import Request
from pd.model.attention import PAD_BLOCK_ID
from pd.model.config import load_model_config
from pd.sampling_params import SamplingParams
from pd_kernels.checks import check_attention_args, check_triton_attention_args

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]


@pytest.mark.parametrize("device", DEVICES)
def test_copy_to_device_gives_each_list_its_dtype_contiguous(device):
    int64s, int32s = copy_to_device([[1, 2, 3], [], [2**40]], [[0, 3], [7, 8, 9, 10]], torch.device(device))
    assert [t.tolist() for t in int64s] == [[1, 2, 3], [], [2**40]]
    assert [t.tolist() for t in int32s] == [[0, 3], [7, 8, 9, 10]]
    assert all(t.dtype == torch.int64 for t in int64s) and all(t.dtype == torch.int32 for t in int32s)
    assert all(t.is_contiguous() and t.device.type == device for t in int64s + int32s)


@pytest.mark.parametrize("device", DEVICES)
def test_prepare_flattens_a_prefill_chunk_and_a_decode(checkpoint, device):
    model_dir = checkpoint("llama")
    config = EngineConfig(model=str(model_dir), device=device, block_size=4)
    runner = ModelRunner(config, load_model_config(model_dir), model_dir, num_blocks=16, max_model_len=64)
    prefill = Request("prefill", list(range(100, 110)), SamplingParams())
    prefill.num_computed_tokens = 4  # a second chunk: tokens 4..8 of 10
    decode = Request("decode", [5, 6, 7], SamplingParams())
    decode.num_computed_tokens = 2
    out = SchedulerOutput([ScheduledRequest(prefill, 5, samples=False), ScheduledRequest(decode, 1, samples=True)])
    batch = runner.prepare(out, [[3, 9, 4], [11]])

    assert batch.token_ids.tolist() == [104, 105, 106, 107, 108, 7]
    assert batch.positions.tolist() == [4, 5, 6, 7, 8, 2]
    # Position p lives in block p // 4 of its table, at offset p % 4.
    assert batch.attn.slot_mapping.tolist() == [36, 37, 38, 39, 16, 46]
    assert batch.attn.cu_seqlens_q.tolist() == [0, 5, 6]
    assert batch.attn.seq_lens.tolist() == [9, 3]
    assert batch.attn.block_table.tolist() == [[3, 9, 4], [11, PAD_BLOCK_ID, PAD_BLOCK_ID]]
    assert batch.logits_indices.tolist() == [5]
    assert batch.sampling_requests == [decode]
    for name in ("token_ids", "positions", "logits_indices"):
        assert getattr(batch, name).dtype == torch.int64
    assert batch.attn.slot_mapping.dtype == torch.int64
    # The views pass the kernels' own launch checks.
    q = torch.zeros(6, 4, 32, device=device)
    k_cache, v_cache = runner.kv_views[0]
    check_attention_args(q, k_cache, v_cache, batch.attn.cu_seqlens_q, batch.attn.seq_lens, batch.attn.block_table,
                         None, None, None)
    check_triton_attention_args(q, batch.attn.block_table, None)
