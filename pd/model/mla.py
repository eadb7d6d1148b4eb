"""Multi-head latent attention (DeepSeek-V2/V3): the latent is the KV.

Each token's KV is one row of the pool, ``[c_kv | k_pe]``: the normalised
latent (``kv_lora_rank`` values) and the rotated key shared by all heads
(``qk_rope_head_dim``), whatever the head count. Per head, keys and values are
linear in the latent (``kv_b_proj`` = ``[W_UK_h; W_UV_h]`` for each head h):

    k_h = [W_UK_h c | k_pe]        v_h = W_UV_h c

so attention runs two ways, equal in exact arithmetic:

- **decode (absorbed)**: ``q_h · k_h = (W_UK_hᵀ q_nope_h) · c + q_pe · k_pe``, so
  each head's query moves into the latent space and every head attends over
  the same latent rows (MQA of width ``kv_lora_rank + rope``,
  ``pd_kernels.latent_attention``); the output ``Σ p c`` goes back out
  through ``W_UV_h``. A step reads each latent page once for all heads.
- **prefill (decompressed)**: the sequences' latent rows are expanded to per-head
  K and V into a scratch pool and ``pd_kernels.unified_attention`` runs causal
  attention over it, the cached context included. A prompt's FLOPs are then
  the plain attention's, where absorption would multiply them by
  ``(kv_lora_rank + rope) / qk_head_dim`` per query-key pair.

A sequence with one query token this step takes the absorbed path, any other
the decompressed one. ``W_UK`` and ``W_UV`` are ``kv_b_proj``'s rows, held once
(``[heads, nope, rank]`` and ``[heads, v, rank]``) and read by both paths.

Tensor parallelism splits the heads (``q_b_proj``/``q_proj``, ``kv_b_proj``
rows, ``o_proj`` columns); the latent projection is replicated, so every rank
computes and stores the same latent (the pool's one "head").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import pd_kernels
from pd.model.attention import AttentionMetadata
from pd.model.config import ModelConfig
from pd.model.linear import Linear
from pd.model.mla_context import CONTEXT_CHUNK_TOKENS, chunked_context_attention
from pd.model.rope import softmax_scale
from pd_kernels import fp8

# DeepSeek's q_a_layernorm and kv_a_layernorm take HF RMSNorm's default epsilon, not the config's.
LATENT_NORM_EPS = 1e-6


@dataclass
class MlaWeights:
    # hidden -> [q_a (q_lora_rank) or q (heads * qk_head_dim) | c_kv (kv_lora_rank) | k_pe (rope)]: the
    # low-rank query (or a rank's heads of the full-rank one) and the latent, in one GEMM.
    qkv_a_proj: Linear
    q_a_norm: torch.Tensor | None  # [q_lora_rank]; None without a low-rank query
    q_b_proj: Linear | None  # q_lora_rank -> heads * qk_head_dim
    kv_a_norm: torch.Tensor  # [kv_lora_rank]
    w_uk: torch.Tensor  # [heads, qk_nope_head_dim, kv_lora_rank]: kv_b_proj's key rows
    w_uv: torch.Tensor  # [heads, v_head_dim, kv_lora_rank]: kv_b_proj's value rows
    o_proj: Linear  # heads * v_head_dim -> hidden (row-parallel)
    o_bias: torch.Tensor | None

    @property
    def input_proj(self) -> Linear:
        """The layer's first GEMM on the hidden rows (whether it pads rows decides the batch's rows)."""
        return self.qkv_a_proj


@dataclass
class _Prefills:
    """The step's sequences of several query tokens, as the decompressed path runs them."""

    rows: torch.Tensor  # int64 [tokens]: their rows of the batch
    cu_seqlens_q: torch.Tensor  # int32 [seqs + 1]
    seq_lens: torch.Tensor  # int32 [seqs]
    block_ids: torch.Tensor  # int64 [blocks]: the pool blocks their contexts hold, sequence after sequence
    block_table: torch.Tensor  # int32 [seqs, max blocks]: each sequence's blocks in the scratch pool
    # The same on the host: each sequence's first row in ``rows`` (and the end), its length, its blocks.
    host_cu: list[int]
    host_seq_lens: list[int]
    host_num_blocks: list[int]


@dataclass
class MlaStep:
    """Per-step state, built once (``MlaAttention.prepare``) and read by every layer."""

    out: torch.Tensor  # [rows, heads, v_head_dim]: every layer's attention output; padding rows zero
    decode_rows: torch.Tensor | None  # int64: the absorbed path's rows; None: every row is one
    decode_cu: torch.Tensor | None  # the absorbed sequences' metadata, where not the whole batch's
    decode_seq_lens: torch.Tensor | None
    decode_block_table: torch.Tensor | None
    prefills: _Prefills | None


class MlaAttention:
    """A rank's multi-head latent attention: ``config`` is the rank's (its heads)."""

    def __init__(self, config: ModelConfig, cos_sin_cache: torch.Tensor, kv_scales: tuple[tuple[float, float], ...]):
        self.config = config
        self.mla = config.mla
        self.cos_sin_cache = cos_sin_cache  # [max_positions, qk_rope_head_dim] fp32
        self.kv_scales = kv_scales  # an FP8 pool reads with each layer's k_scale (its one plane)
        self.softmax_scale = softmax_scale(config.rope, self.mla.qk_head_dim)
        # The decompressed path's head width: K's and V's, zero-padded to one width the kernels take.
        self.scratch_dim = -(-max(self.mla.qk_head_dim, self.mla.v_head_dim) // 8) * 8
        self.context_chunk = CONTEXT_CHUNK_TOKENS  # past it, prefill contexts expand a chunk at a time

    def prepare(self, attn: AttentionMetadata, rows: int, num_tokens: int, dtype: torch.dtype,
                device: torch.device, block_size: int) -> MlaStep:
        """The step's output buffer and its split into absorbed rows and decompressed sequences. A step of
        decodes only (as many tokens as sequences) is known from shapes alone, so a CUDA graph captures
        it; a mixed step reads its query lengths once."""
        out = (torch.zeros if rows != num_tokens else torch.empty)(
            rows, self.config.num_heads, self.mla.v_head_dim, dtype=dtype, device=device)
        num_seqs = attn.seq_lens.shape[0]
        if num_tokens == num_seqs:  # every sequence has one query token: all absorbed, known without a sync
            return MlaStep(out, None, None, None, None, None)
        cu = attn.cu_seqlens_q.tolist()
        q_lens = [cu[i + 1] - cu[i] for i in range(num_seqs)]
        decodes = [i for i, n in enumerate(q_lens) if n == 1]
        prefills = [i for i, n in enumerate(q_lens) if n > 1]
        step = MlaStep(out, None, None, None, None, self._prefills(attn, cu, prefills, block_size, device))
        if decodes:
            ids = torch.tensor(decodes, dtype=torch.int64, device=device)
            step.decode_rows = attn.cu_seqlens_q[:-1].long()[ids]
            step.decode_cu = torch.arange(len(decodes) + 1, dtype=torch.int32, device=device)
            step.decode_seq_lens = attn.seq_lens[ids]
            step.decode_block_table = attn.block_table[ids]
        else:
            step.decode_rows = torch.empty(0, dtype=torch.int64, device=device)
        return step

    @staticmethod
    def _prefills(attn: AttentionMetadata, cu: list[int], seq_ids: list[int], block_size: int,
                  device: torch.device) -> _Prefills | None:
        if not seq_ids:
            return None
        lens = attn.seq_lens.tolist()
        rows, q_cu, blocks, tables = [], [0], [], []
        for i in seq_ids:
            rows.extend(range(cu[i], cu[i + 1]))
            q_cu.append(q_cu[-1] + cu[i + 1] - cu[i])
            num_blocks = -(-lens[i] // block_size)
            tables.append(list(range(len(blocks), len(blocks) + num_blocks)))
            blocks.extend(attn.block_table[i, :num_blocks].tolist())
        width = max(len(t) for t in tables)
        table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device)
        return _Prefills(
            rows=torch.tensor(rows, dtype=torch.int64, device=device),
            cu_seqlens_q=torch.tensor(q_cu, dtype=torch.int32, device=device),
            seq_lens=torch.tensor([lens[i] for i in seq_ids], dtype=torch.int32, device=device),
            block_ids=torch.tensor(blocks, dtype=torch.int64, device=device), block_table=table,
            host_cu=q_cu, host_seq_lens=[lens[i] for i in seq_ids], host_num_blocks=[len(t) for t in tables])

    def forward(
        self,
        layer: int,
        weights: MlaWeights,
        hidden: torch.Tensor,  # [rows, hidden]: the batch's num_tokens rows, then padding
        positions: torch.Tensor,
        attn: AttentionMetadata,
        kv_cache: tuple[torch.Tensor, ...],  # (latent,) [num_blocks, block_size, 1, latent_dim]
        num_tokens: int,
        step: MlaStep,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The layer's row-parallel output (a rank's partial sum) and the bias to add after the reduce."""
        m, heads = self.mla, self.config.num_heads
        q_nope, q_pe, latent = self._project(weights, hidden, positions, num_tokens, attn.backend)
        (cache,) = kv_cache
        scale = self.kv_scales[layer][0]
        pd_kernels.store_latent(latent, cache, attn.slot_mapping, scale=scale)
        if step.decode_rows is None:
            self._absorbed(weights, q_nope, q_pe, cache, attn.cu_seqlens_q, attn.seq_lens, attn.block_table,
                           scale, attn.backend, step.out[:num_tokens])
        elif step.decode_rows.numel():
            rows = step.decode_rows
            part = torch.empty(rows.shape[0], heads, m.v_head_dim, dtype=step.out.dtype, device=step.out.device)
            self._absorbed(weights, q_nope[rows], q_pe[rows], cache, step.decode_cu, step.decode_seq_lens,
                           step.decode_block_table, scale, attn.backend, part)
            step.out[rows] = part
        if step.prefills is not None:
            step.out[step.prefills.rows] = self._decompressed(weights, q_nope, q_pe, cache, step.prefills, scale,
                                                              attn.backend)
        return weights.o_proj(step.out.view(hidden.shape[0], heads * m.v_head_dim)), weights.o_bias

    def _project(self, weights: MlaWeights, hidden: torch.Tensor, positions: torch.Tensor, num_tokens: int,
                 backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(q_nope [T, heads, nope], q_pe [T, heads, rope] rotated, latent [T, kv_lora_rank + rope])``."""
        m, heads = self.mla, self.config.num_heads
        q_width = m.q_lora_rank if m.q_lora_rank is not None else heads * m.qk_head_dim
        q, c_kv, k_pe = weights.qkv_a_proj(hidden)[:num_tokens].split([q_width, m.kv_lora_rank, m.qk_rope_head_dim],
                                                                     dim=-1)
        if weights.q_b_proj is not None:
            q = weights.q_b_proj(pd_kernels.rms_norm(q.contiguous(), weights.q_a_norm, LATENT_NORM_EPS,
                                                     backend=backend))
        q_nope, q_pe = q.reshape(num_tokens, heads, m.qk_head_dim).split([m.qk_nope_head_dim, m.qk_rope_head_dim],
                                                                         dim=-1)
        c_kv = pd_kernels.rms_norm(c_kv.contiguous(), weights.kv_a_norm, LATENT_NORM_EPS, backend=backend)
        k_pe = k_pe.reshape(num_tokens, 1, m.qk_rope_head_dim).contiguous()
        q_pe, k_pe = pd_kernels.rotary_embedding(q_pe.contiguous(), k_pe, positions[:num_tokens], self.cos_sin_cache,
                                                 backend=backend)
        return q_nope, q_pe, torch.cat([c_kv, k_pe.reshape(num_tokens, m.qk_rope_head_dim)], dim=-1)

    def _absorbed(self, weights: MlaWeights, q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
                  cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor, scale: float,
                  backend: str, out: torch.Tensor) -> None:
        """One query token per sequence: MQA over the latent rows, in and out through ``W_UK`` and ``W_UV``."""
        q_latent = torch.bmm(q_nope.transpose(0, 1), weights.w_uk).transpose(0, 1)  # [T, heads, kv_lora_rank]
        q = torch.cat([q_latent, q_pe], dim=-1)  # [T, heads, latent_dim]
        o_latent = pd_kernels.latent_attention(q, cache, cu_seqlens_q, seq_lens, block_table, self.softmax_scale,
                                               v_dim=self.mla.kv_lora_rank, scale=scale, backend=backend)
        out.copy_(torch.bmm(o_latent.transpose(0, 1), weights.w_uv.transpose(1, 2)).transpose(0, 1))

    def _decompressed(self, weights: MlaWeights, q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
                      prefills: _Prefills, scale: float, backend: str) -> torch.Tensor:
        """Prefill chunks: their contexts' latents expanded to per-head K and V in a scratch pool, then causal
        paged attention over it; contexts past ``CONTEXT_CHUNK_TOKENS`` in all are expanded a chunk at a time
        instead (``pd.model.mla_context``). Returns ``[their rows, heads, v_head_dim]``."""
        m, heads, width = self.mla, self.config.num_heads, self.scratch_dim
        pages = cache[prefills.block_ids]  # [blocks, block_size, 1, latent_dim]
        pages = fp8.dequantize(pages, scale).to(q_nope.dtype) if fp8.is_fp8(cache.dtype) else pages
        num_blocks, block_size = pages.shape[0], pages.shape[1]
        rows = pages.reshape(num_blocks * block_size, m.latent_dim)
        if rows.shape[0] > self.context_chunk:
            return self._chunked(weights, q_nope, q_pe, rows, prefills, block_size)
        c_kv, k_pe = rows.split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        k = rows.new_zeros(num_blocks * block_size, heads, width)
        v = rows.new_zeros(num_blocks * block_size, heads, width)
        k[:, :, :m.qk_nope_head_dim] = (c_kv @ weights.w_uk.reshape(-1, m.kv_lora_rank).T).view(-1, heads,
                                                                                              m.qk_nope_head_dim)
        k[:, :, m.qk_nope_head_dim:m.qk_head_dim] = k_pe[:, None, :]
        v[:, :, :m.v_head_dim] = (c_kv @ weights.w_uv.reshape(-1, m.kv_lora_rank).T).view(-1, heads, m.v_head_dim)
        q = q_nope.new_zeros(prefills.rows.shape[0], heads, width)
        q[:, :, :m.qk_nope_head_dim] = q_nope[prefills.rows]
        q[:, :, m.qk_nope_head_dim:m.qk_head_dim] = q_pe[prefills.rows]
        shape = (num_blocks, block_size, heads, width)
        out = pd_kernels.unified_attention(q, k.view(shape), v.view(shape), prefills.cu_seqlens_q, prefills.seq_lens,
                                           prefills.block_table, self.softmax_scale, backend=backend)
        return out[:, :, :m.v_head_dim]

    def _chunked(self, weights: MlaWeights, q_nope: torch.Tensor, q_pe: torch.Tensor, rows: torch.Tensor,
                 prefills: _Prefills, block_size: int) -> torch.Tensor:
        """Each sequence's queries over its context, expanded ``context_chunk`` tokens at a time."""
        parts, first_row = [], 0
        for i, seq_len in enumerate(prefills.host_seq_lens):
            start, end = prefills.host_cu[i], prefills.host_cu[i + 1]
            batch_rows = prefills.rows[start:end]
            q = torch.cat([q_nope[batch_rows], q_pe[batch_rows]], dim=-1)
            positions = torch.arange(seq_len - (end - start), seq_len, device=q.device)
            context = rows[first_row:first_row + seq_len]
            parts.append(chunked_context_attention(q, positions, context, weights.w_uk, weights.w_uv,
                                                   self.softmax_scale, self.context_chunk))
            first_row += prefills.host_num_blocks[i] * block_size
        return torch.cat(parts).to(q_nope.dtype)
