// The cpu backend's extension module: one build, every kernel of pd_kernels/cpu.

#include <torch/extension.h>

#include <vector>

void paged_decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                            const torch::Tensor& block_table, const torch::Tensor& seq_lens,
                            const torch::Tensor& token_rows, double scale, int64_t window, double softcap,
                            double k_scale, double v_scale, torch::Tensor& out);
void paged_prefill_attention(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                             const torch::Tensor& block_table, const std::vector<int64_t>& query_starts,
                             const std::vector<int64_t>& seq_lens, const std::vector<int64_t>& seqs, double scale,
                             int64_t window, double softcap, double k_scale, double v_scale, torch::Tensor& out);
void latent_decode_attention(const torch::Tensor& q, const torch::Tensor& latent_cache,
                             const torch::Tensor& block_table, const torch::Tensor& seq_lens,
                             const torch::Tensor& token_rows, double softmax_scale, double scale,
                             torch::Tensor& out);
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps);
std::vector<torch::Tensor> add_rms_norm(const torch::Tensor& x, const torch::Tensor& residual,
                                        const torch::Tensor& weight, double eps);
std::vector<torch::Tensor> rotary(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& positions,
                                  const torch::Tensor& cos_sin);
torch::Tensor silu_and_mul(const torch::Tensor& gate_up);
void store_kv(const torch::Tensor& key, const torch::Tensor& value, torch::Tensor& k_cache, torch::Tensor& v_cache,
              const torch::Tensor& slot_mapping, double k_scale, double v_scale);
torch::Tensor pack_rows_weight(const torch::Tensor& weight);
torch::Tensor linear_rows(const torch::Tensor& x, const torch::Tensor& panels, const c10::optional<torch::Tensor>& bias,
                          int64_t out_features);
torch::Tensor fused_moe_rows(const torch::Tensor& hidden, const torch::Tensor& w13, const torch::Tensor& w2,
                             const torch::Tensor& topk_ids, const torch::Tensor& topk_weights);
void lora_delta_rows(torch::Tensor& out, const torch::Tensor& x, const torch::Tensor& lora_a,
                     const torch::Tensor& lora_b, const torch::Tensor& row_slots,
                     const std::vector<int64_t>& slice_starts);
void copy_blocks(const torch::Tensor& src, const std::vector<int64_t>& src_ids, torch::Tensor& dst,
                 const std::vector<int64_t>& dst_ids);
std::vector<torch::Tensor> quantize_rows_int8(const torch::Tensor& x);
torch::Tensor scale_int32_rows(const torch::Tensor& acc, const torch::Tensor& a_scale, const torch::Tensor& w_scale,
                               const c10::optional<torch::Tensor>& bias);
torch::Tensor int8_gemm(const torch::Tensor& xq, const torch::Tensor& w);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention over a block-major pool (fp32 queries; fp32, bf16 or fp8 pages)");
  m.def("paged_prefill_attention", &paged_prefill_attention,
        "paged prefill attention over a block-major pool, online softmax (fp32 queries; fp32, bf16 or fp8 pages)");
  m.def("latent_decode_attention", &latent_decode_attention,
        "multi-head latent attention for decode rows, each latent row read once for all heads (fp32 queries; "
        "fp32, bf16 or fp8 pages)");
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dim (fp32)");
  m.def("add_rms_norm", &add_rms_norm, "residual add, then RMSNorm; returns (normed, sum) (fp32)");
  m.def("rotary", &rotary, "rotate-half rotary embedding of q and k into new tensors (fp32)");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up over [gate | up] (fp32)");
  m.def("pack_rows_weight", &pack_rows_weight, "a weight [out, in] as linear_rows's panels (fp32)");
  m.def("linear_rows", &linear_rows, "x @ weight^T + bias for a few rows of x, from pack_rows_weight's panels (fp32)");
  m.def("fused_moe_rows", &fused_moe_rows,
        "the fused MoE in one call for few tokens per expert: sorted slots, gate/up with SiLU-and-mul, "
        "down with the routed weight summed into each token (fp32)");
  m.def("lora_delta_rows", &lora_delta_rows,
        "out += each adapter row's LoRA delta (shrink, then expand per slice), rows grouped by slot (fp32)");
  m.def("copy_blocks", &copy_blocks, "dst[dst_ids[i]] = src[src_ids[i]], whole blocks, any dtype");
  m.def("quantize_rows_int8", &quantize_rows_int8, "each row as int8 and its scale absmax / 127 (fp32 in)");
  m.def("int8_gemm", &int8_gemm, "xq [M, K] @ w [N, K]^T in int32 (int8 in; exact), where torch._int_mm has no fast path");
  m.def("scale_int32_rows", &scale_int32_rows, "int32 GEMM output * a_scale[:, None] * w_scale[None, :] + bias (fp32)");
  m.def("store_kv", &store_kv, "write K/V rows into their pool slots, skipping negative slots (fp32, or quantized into fp8 pages)");
}
