#pragma once
// The language models' device seam, in the manner of the engine's
// (engine/kernels/table.h) and the quantizers' (quant/kernels/table.h): one
// table of kernels per device, one entry per fused op that is a hand-written
// loop rather than a composition of engine ops. The ops (llm/ops/) keep
// validation, shapes, dtype rules and the gradient rule, create outputs on
// the input's device and call `llm_kernels(device).<entry>(...)`. Entries take
// raw pointers on that device, sizes and dtypes; they never see a Tensor.
//
// Element types: every entry takes f32, f64, bf16 and f16 data and
// accumulates in the "accumulation dtype" of its data: f64 for f64, f32 for
// the rest. Statistics an op saves for its backward (RMS scales, attention's
// log-sum-exp) and cos/sin tables are in the accumulation dtype.
//
// Where a new fused op goes: an entry here with its contract and its name in
// QUANTA_LLM_KERNEL_ENTRIES, its per-element math in llm/kernels/functors.h
// (shared with nvcc), one function of that name in llm/cpu/, one in
// llm/cuda/, and its line in llm/cuda/unavailable.cpp.
#include <cstdint>
#include <initializer_list>

#include "engine/device.h"
#include "engine/dtype.h"
#include "engine/kernels/entries.h"
#include "llm/kernels/gated_act.h"
#include "llm/kernels/rms_weight.h"

namespace quanta {
class Tensor;
}

namespace quanta::llm {

/** The accumulation dtype of `data`: f64 for f64, else f32. */
inline DType accumulation_dtype(DType data) { return data == DType::f64 ? DType::f64 : DType::f32; }

/** One [batch, tokens, heads, head_dim] operand: element (b, t, h, d) at
 * data + b * sb + t * st + h * sh + d elements (head_dim contiguous). Q and
 * the output have `heads` heads, K and V `kv_heads`. */
struct HeadsOperand {
  const void* data = nullptr;
  int64_t sb = 0, st = 0, sh = 0;
};

/** An additive attention mask in the accumulation dtype, broadcast to
 * [batch, heads, q_len, kv_len]: element (b, h, i, j) at
 * data + b * sb + h * sh + i * si + j * sj (a stride of 0 broadcasts);
 * -inf hides a key. data null: no mask. */
struct MaskOperand {
  const void* data = nullptr;
  int64_t sb = 0, sh = 0, si = 0, sj = 0;
};

/** One scaled dot-product attention. Query i (of q_len) sees key j (of
 * kv_len) when !causal or j <= i + kv_len - q_len (the queries are the last
 * q_len positions of the keys', as with a KV cache). Query head h reads key
 * and value head h / (heads / kv_heads) (grouped-query attention; heads is a
 * multiple of kv_heads), and with a window only the keys within it.
 * scores = scale * q.k + mask (soft-capped first when softcap is set). */
struct AttentionArgs {
  DType dtype = DType::f32;  // of q, k, v, out and the gradients
  int64_t batch = 0, heads = 0, kv_heads = 0, q_len = 0, kv_len = 0, head_dim = 0;
  double scale = 1.0;
  /** Gemma 2's soft-capping: scale * q.k becomes softcap tanh(scale q.k /
   * softcap) before the mask is added (fn::softcap_tanh); 0: none. */
  double softcap = 0.0;
  /** A sliding window (causal only): query i sees only the last `window`
   * keys up to its own position (fn::first_visible_key); 0: none. */
  int64_t window = 0;
  bool causal = false;
  HeadsOperand q, k, v;
  MaskOperand mask;
  /** [batch, q_len, heads, head_dim], contiguous. */
  void* out = nullptr;
  /** [batch, heads, q_len] in the accumulation dtype: each query's
   * log-sum-exp of its visible scores (-inf when it sees no key; its output
   * row is then 0). */
  void* lse = nullptr;
  /** f32 blocks' products may round their operands to bf16 (f32 sums):
   * MixedPrecision's (engine/precision.h), where the device has bf16
   * products. */
  bool bf16_products = false;
};

/** The language-model kernels of one device. Every entry handles zero sizes. */
struct LlmKernelTable {
  const char* device_name;

  /** RMSNorm over rows of n: r = 1 / sqrt(mean(x^2) + eps) in the
   * accumulation dtype; Llama's y = weight * (x r rounded to dtype) rounded
   * to dtype (transformers' order of roundings), Gemma's y = (1 + weight)
   * x r and OLMo 2's y = weight x r in the accumulation dtype, rounded once
   * (`how`, fn::rms_out). x, weight, y of `dtype`, contiguous; inv_rms[rows]
   * (accumulation dtype) receives r. */
  void (*rms_norm)(DType dtype, const void* x, const void* weight, int64_t rows, int64_t n,
                   double eps, RmsWeight how, void* y, void* inv_rms);
  /** Its backward, the roundings taken as identities: with g = gy * f, f the
   * weight or Gemma's 1 + weight (fn::rms_factor), gx = r g - x r^3 mean(g x) per row
   * (gx += that with accumulate_gx: the sum of x's other gradients), gw[j] =
   * sum over rows of gy x r, added in row order. gx [rows, n] and gw [n] of
   * `dtype`; either may be null (not wanted: a frozen weight, an input that
   * needs no gradient). */
  void (*rms_norm_grad)(DType dtype, const void* x, const void* weight, RmsWeight how,
                        const void* inv_rms, const void* gy, int64_t rows, int64_t n, void* gx,
                        void* gw, bool accumulate_gx);

  /** Rotary embedding as transformers applies it (rotate_half): for x
   * [rows, heads, dim] contiguous and cos, sin [table_rows, dim / 2]
   * (accumulation dtype, first rounded to dtype; row r of x takes table row
   * r % table_rows, table_rows dividing rows: one sequence's tables shared
   * by a batch without copies), with a = x[.., d], b = x[.., d + dim/2]:
   * out[.., d] = a c - b s, out[.., d + dim/2] = b c + a s, each product and
   * the sum rounded to dtype. `inverse` rotates by -angle (the backward). */
  void (*rope)(DType dtype, bool inverse, const void* x, const void* cos, const void* sin,
               int64_t rows, int64_t table_rows, int64_t heads, int64_t dim, void* out);

  /** A gated MLP's activation, transformers' act_fn(gate) * up: out =
   * act(gate) rounded to dtype, times up, rounded to dtype, act SiLU (x / (1
   * + exp(-x))) or GELU's tanh approximation (0.5 x (1 + tanh(sqrt(2 / pi)
   * (x + 0.044715 x^3)))) in the accumulation dtype (fn::gated_out). gate,
   * up, out: n contiguous elements of dtype. One pass: act(gate) is never
   * written. */
  void (*gated_act)(DType dtype, GatedAct act, const void* gate, const void* up, int64_t n,
                    void* out);
  /** Its backward for the output gradient g (n contiguous, dtype): d_up = g
   * act(gate); d_gate = (g up, rounded to dtype) act'(gate), each rounded
   * once to dtype (the formulas of PyTorch's mul and activation backward,
   * fn::gated_grad_gate). Either output may be null (not wanted); up may be
   * null when d_gate is. One pass over the inputs. */
  void (*gated_act_grad)(DType dtype, GatedAct act, const void* gate, const void* up, const void* g,
                         int64_t n, void* d_gate, void* d_up);

  /** Attention forward (see AttentionArgs): fills a.out and a.lse. The
   * CPU's and CUDA's reference kernels keep memory linear in the lengths
   * (never a q_len x kv_len matrix); CUDA's default path holds the scores
   * of a chunk of heads within a budget (llm/kernels/attention_plan.h). */
  void (*attention)(const AttentionArgs& a);
  /** Attention backward, recomputing the scores from a.q, a.k, a.v, a.lse:
   * given grad_out [batch, q_len, heads, head_dim] contiguous and a.out,
   * writes gq [batch, q_len, heads, head_dim], gk and gv [batch, kv_len,
   * kv_heads, head_dim] (contiguous, dtype). delta [batch, heads, q_len]
   * (accumulation dtype) is scratch. Every add happens in a fixed order:
   * the same bits on every run. */
  void (*attention_grad)(const AttentionArgs& a, const void* grad_out, void* delta, void* gq,
                         void* gk, void* gv);

  /** The causal-LM loss of rows of logits [rows, vocab] (contiguous, f32
   * or f64: the loss's accumulation dtype) against targets [rows] (i64,
   * each ignore_index or in [0, vocab)): loss[r] = logsumexp(row) -
   * row[target] (fn::lm_row_loss), 0 for an ignored row. With `grad`, each
   * row is overwritten by its loss's gradient, softmax(row) less 1 at the
   * target (fn::lm_logit_grad), zeros for an ignored row. Each row is read
   * from memory once and, with grad, written once. */
  void (*lm_loss_rows)(DType dtype, void* logits, const int64_t* targets, int64_t rows,
                       int64_t vocab, int64_t ignore_index, bool grad, void* loss);
};

/** Every function entry of LlmKernelTable, in the table's order: the CPU,
 * CUDA and sim tables and the entries' declarations are made from it, as
 * the engine's are from QUANTA_KERNEL_ENTRIES. */
#define QUANTA_LLM_KERNEL_ENTRIES(X) \
  X(rms_norm)                        \
  X(rms_norm_grad)                   \
  X(rope) X(gated_act) X(gated_act_grad) X(attention) X(attention_grad) X(lm_loss_rows)
/** Declares a device's function for `entry`, with the entry's type. */
#define QUANTA_DECLARE_LLM_KERNEL(entry) QUANTA_DECLARE_ENTRY(LlmKernelTable, entry)

QUANTA_CHECK_ENTRY_LIST(LlmKernelTable, QUANTA_LLM_KERNEL_ENTRIES, 1);

/** The table of `device` (cpu, sim or cuda; on cuda without the module's
 * table, entries that throw naming the op). */
const LlmKernelTable& llm_kernels(Device device);
/** The table of the device all of `ts` live on (throws naming `op` when they
 * differ). */
const LlmKernelTable& llm_kernels_for(const char* op, std::initializer_list<const Tensor*> ts);

namespace llm_cpu {
const LlmKernelTable& table();
}
namespace llm_sim {
const LlmKernelTable& table();
}
namespace llm_cuda {
/** The CUDA module's table (quanta_llm_cuda_table_v1), or unavailable_table(). */
const LlmKernelTable& table();
const LlmKernelTable& unavailable_table();
}  // namespace llm_cuda

}  // namespace quanta::llm
