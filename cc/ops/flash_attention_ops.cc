// Op definitions only: signatures and shape functions. Kernels live in cc/kernels/.
//
// Optional inputs are passed as empty tensors (q_lengths/kv_lengths of shape [0], masks of shape
// [0, 0, 0, 0], segment ids of shape [0, 0]) so that one graph signature serves every combination and SavedModels stay stable.
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace tf_flash {
namespace {

using ::tensorflow::Status;
using ::tensorflow::shape_inference::DimensionHandle;
using ::tensorflow::shape_inference::InferenceContext;
using ::tensorflow::shape_inference::ShapeHandle;

// q [B, Sq, H, D], k [B, Sk, Hkv, D], v [B, Sk, Hkv, Dv] -> out [B, Sq, H, Dv], lse [B, H, Sq].
Status FlashAttentionShape(InferenceContext* c) {
  ShapeHandle q, k, v;
  TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 4, &q));
  TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 4, &k));
  TF_RETURN_IF_ERROR(c->WithRank(c->input(2), 4, &v));
  DimensionHandle batch, seqlen_k, heads_kv, head_dim;
  TF_RETURN_IF_ERROR(c->Merge(c->Dim(q, 0), c->Dim(k, 0), &batch));
  TF_RETURN_IF_ERROR(c->Merge(batch, c->Dim(v, 0), &batch));
  TF_RETURN_IF_ERROR(c->Merge(c->Dim(k, 1), c->Dim(v, 1), &seqlen_k));
  TF_RETURN_IF_ERROR(c->Merge(c->Dim(k, 2), c->Dim(v, 2), &heads_kv));
  TF_RETURN_IF_ERROR(c->Merge(c->Dim(q, 3), c->Dim(k, 3), &head_dim));
  ShapeHandle lengths;
  TF_RETURN_IF_ERROR(c->WithRank(c->input(3), 1, &lengths));
  TF_RETURN_IF_ERROR(c->WithRank(c->input(4), 1, &lengths));
  ShapeHandle mask;
  TF_RETURN_IF_ERROR(c->WithRank(c->input(5), 4, &mask));
  TF_RETURN_IF_ERROR(c->WithRank(c->input(6), 4, &mask));
  ShapeHandle segment_ids;
  TF_RETURN_IF_ERROR(c->WithRank(c->input(7), 2, &segment_ids));
  TF_RETURN_IF_ERROR(c->WithRank(c->input(8), 2, &segment_ids));
  ShapeHandle seed;
  TF_RETURN_IF_ERROR(c->WithRank(c->input(9), 1, &seed));
  DimensionHandle unused;
  TF_RETURN_IF_ERROR(c->WithValue(c->Dim(seed, 0), 2, &unused));
  c->set_output(0, c->MakeShape({batch, c->Dim(q, 1), c->Dim(q, 2), c->Dim(v, 3)}));
  c->set_output(1, c->MakeShape({batch, c->Dim(q, 2), c->Dim(q, 1)}));
  c->set_output(2, c->Vector(2));
  return Status();
}

Status FlashAttentionGradShape(InferenceContext* c) {
  // Inputs: d_output, query, key, value, output, lse, d_lse, q_lengths, kv_lengths, attention_mask,
  // block_mask, q_segment_ids, kv_segment_ids, rng_state. Gradients have the shapes of query, key, value.
  for (int i = 0; i < 5; ++i) {
    ShapeHandle unused;
    TF_RETURN_IF_ERROR(c->WithRank(c->input(i), 4, &unused));
  }
  ShapeHandle merged;
  TF_RETURN_IF_ERROR(c->Merge(c->input(0), c->input(4), &merged));
  c->set_output(0, c->input(1));
  c->set_output(1, c->input(2));
  c->set_output(2, c->input(3));
  return Status();
}

}  // namespace

#define TF_FLASH_COMMON_ATTRS        \
  Attr("T: {float, half, bfloat16}") \
      .TF_FLASH_SHARED_ATTRS

// The attributes of every attention op, the gradient and the fp8 forward too (TF_FLASH_ATTRS reads them).
#define TF_FLASH_SHARED_ATTRS                                 \
  Attr("causal: bool = false")                                \
      .Attr("window_left: int = -1")                          \
      .Attr("window_right: int = -1")                         \
      .Attr("block_q: int = 128")                             \
      .Attr("block_k: int = 128")                             \
      .Attr("dropout_rate: float = 0.0")                      \
      .Attr("scale: float")                                   \
      .Attr("softcap: float = 0.0")                           \
      .Attr("deterministic: bool = false")                    \
      .Attr("query_offset: int = 0")                          \
      .Attr("bottom_right: bool = false")                     \
      .Attr("position_shift: int = 0")                        \
      .Attr("num_splits: int = 1")

// The inputs of the forward ops, in the order the kernels read them (flash_attention_params.h: kFwdInputs), query,
// key and value of type QKV ("T", or fp8's own).
#define TF_FLASH_FORWARD_INPUTS(QKV)      \
  Input("query: " QKV)                    \
      .Input("key: " QKV)                 \
      .Input("value: " QKV)               \
      .Input("q_lengths: int32")          \
      .Input("kv_lengths: int32")         \
      .Input("attention_mask: bool")      \
      .Input("block_mask: bool")          \
      .Input("q_segment_ids: int32")      \
      .Input("kv_segment_ids: int32")     \
      .Input("seed: int64")

REGISTER_OP("TfFlash>FlashAttention")
    .TF_FLASH_FORWARD_INPUTS("T")
    .Output("output: T")
    .Output("lse: float")
    .Output("rng_state: int64")
    .TF_FLASH_COMMON_ATTRS
    .SetShapeFn(FlashAttentionShape)
    .Doc(R"doc(
Exact attention in tiles with an online softmax (FlashAttention). Layout [batch, seq, heads, dim].
Empty q_lengths/kv_lengths ([0]), masks ([0,0,0,0]) and segment ids ([0,0]) mean "absent". Query i
sees key j only where q_segment_ids[b, i] == kv_segment_ids[b, j] (packed documents). rng_state is the Philox
(seed, offset) the dropout mask was drawn from; the gradient op regenerates the mask from it.
query_offset: row i of the query is row i + query_offset of the attention for causal, window and
dropout (lengths and masks stay in the query's rows).
bottom_right: causal and window aligned to the bottom right: row i of entry b is position
i + kv_lengths[b] - Sq (the queries are the last Sq positions of the entry's keys).
position_shift: 2^position_shift consecutive query rows share one position for causal and window (the
decode path's query heads packed into one tile): row i is position i >> position_shift, and Sq rows are
Sq >> position_shift positions. Only with lengths of keys, a key mask ([B or 1, 1, 1, Sk] attention_mask),
causal, window, scale and softcap.
num_splits: split-KV, a request: the visible key tiles of each query tile run in num_splits parts (thread
blocks of their own on the GPU), merged by their lse; the same attention up to the rounding of the parts'
outputs. Kernels that cannot split (block_mask, segment ids or dropout on the GPU) run the call whole. The
gradient ignores it.
)doc");

REGISTER_OP("TfFlash>FlashAttentionGrad")
    .Input("d_output: T")
    .Input("query: T")
    .Input("key: T")
    .Input("value: T")
    .Input("output: T")
    .Input("lse: float")
    .Input("d_lse: float")
    .Input("q_lengths: int32")
    .Input("kv_lengths: int32")
    .Input("attention_mask: bool")
    .Input("block_mask: bool")
    .Input("q_segment_ids: int32")
    .Input("kv_segment_ids: int32")
    .Input("rng_state: int64")
    .Output("d_query: T")
    .Output("d_key: T")
    .Output("d_value: T")
    .TF_FLASH_COMMON_ATTRS
    .SetShapeFn(FlashAttentionGradShape)
    .Doc(R"doc(
Recomputing backward of FlashAttention: probabilities are rebuilt tile by tile from lse. d_lse is the
gradient flowing into lse (zeros when lse is unused); it folds into D = rowsum(dO * O) - d_lse.
)doc");

// A separate op rather than float8 in FlashAttention's T: T is also the output's dtype there and the gradient op's,
// and fp8 inputs give a 16-bit output, take three more inputs (the descales) and have no gradient. Inputs 0-9 are
// FlashAttention's (TF_FLASH_FORWARD_INPUTS), so the kernels read them by the same indices.
REGISTER_OP("TfFlash>FlashAttentionFp8")
    .TF_FLASH_FORWARD_INPUTS("float8_e4m3fn")
    .Input("q_descale: float")
    .Input("k_descale: float")
    .Input("v_descale: float")
    .Output("output: output_dtype")
    .Output("lse: float")
    .Output("rng_state: int64")
    .Attr("output_dtype: {bfloat16, half} = DT_BFLOAT16")
    .TF_FLASH_SHARED_ATTRS
    .SetShapeFn([](InferenceContext* c) {
      TF_RETURN_IF_ERROR(FlashAttentionShape(c));
      for (int i = 10; i < 13; ++i) {
        ShapeHandle unused;
        TF_RETURN_IF_ERROR(c->WithRankAtMost(c->input(i), 2, &unused));
      }
      return Status();
    })
    .Doc(R"doc(
FlashAttention's forward on float8_e4m3fn query, key and value (Hopper GPUs only; no gradient). The attention is
that of the dequantized inputs q * q_descale, k * k_descale, v * v_descale: q_descale, k_descale and v_descale are
float32 scalars (per tensor) or [batch, kv_heads], all three alike. output is output_dtype (bfloat16 or half), lse
float32. Every other input and attribute is FlashAttention's; dropout_rate must be 0.
)doc");

REGISTER_OP("TfFlash>BuildInfo")
    .Output("info: string")
    .SetShapeFn(::tensorflow::shape_inference::ScalarShape)
    .Doc("What the library was compiled with, as 'key=value;...' (cuda=0/1, cuda_archs=...).");

REGISTER_OP("TfFlash>KernelCounts")
    .Output("counts: int64")
    .SetIsStateful()  // the value changes between calls: never constant-folded or cached
    .SetShapeFn([](::tensorflow::shape_inference::InferenceContext* c) {
      c->set_output(0, c->Vector(6));
      return Status();
    })
    .Doc("CUDA kernel launches of this process by family: [forward sm_80, forward sm_90 (Hopper), backward sm_80, "
         "backward sm_90, forward float32, backward float32 (full float32: TF32 off)]; zeros in a CPU-only "
         "library.");

}  // namespace tf_flash
