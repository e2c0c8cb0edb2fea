// Attributes and shapes -> FlashFwdParams/FlashBwdParams, and the kernels' runners (staging on the GPU),
// shared by the TF OpKernels and the XLA FFI handlers.
#include "cc/kernels/flash_attention_params.h"

#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "cc/kernels/flash/mask.h"
#include "cc/kernels/flash/split_kv.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/util/determinism.h"
#include "tsl/platform/tensor_float_32_utils.h"

namespace tf_flash {

namespace tf = ::tensorflow;

namespace {
constexpr int kMaxHeadDim = 256;
// Split-KV parts per query tile: more than enough for one wave of any GPU at batch 1.
constexpr int64_t kMaxSplits = 1024;

// One `name = value : type` entry of the MLIR attribute dictionary XLA parses for a typed-FFI call.
void AppendFfiAttr(std::string* out, const char* name, bool value) {
  *out += std::string(name) + (value ? " = true" : " = false");
}
void AppendFfiAttr(std::string* out, const char* name, int64_t value) {
  *out += std::string(name) + " = " + std::to_string(value) + " : i64";
}
void AppendFfiAttr(std::string* out, const char* name, float value) {
  char text[64];
  // %.9g round-trips every finite float32 exactly (Validate() rejects non-finite values).
  std::snprintf(text, sizeof(text), "%.9g", value);
  std::string number(text);
  if (number.find_first_of(".eE") == std::string::npos) number += ".0";  // MLIR needs a float literal
  *out += std::string(name) + " = " + number + " : f32";
}

// Strides of a contiguous [B, S, H, D] tensor, in elements.
void SetBshdStrides(const tf::TensorShape& t, int64_t* batch, int64_t* row, int64_t* head) {
  *head = t.dim_size(3);
  *row = t.dim_size(2) * t.dim_size(3);
  *batch = t.dim_size(1) * *row;
}

// Only the ops' own "absent" marker, shape [0, 0, 0, 0]: a user's mask of shape [0, H, Sq, Sk] for a batch
// that is not empty is an error, not a missing mask.
bool IsAbsentMask(const tf::TensorShape& mask) {
  return mask.dims() == 4 && mask.dim_size(0) == 0 && mask.dim_size(1) == 0 && mask.dim_size(2) == 0 &&
         mask.dim_size(3) == 0;
}

// A rank-4 bool mask whose every dim is 1 (broadcast) or the full size; shape [0,0,0,0] = absent.
tf::Status SetBroadcastMaskStrides(const tf::TensorShape& mask, const char* name, const int64_t (&full)[4],
                                   BroadcastBoolMask* out) {
  if (mask.dims() != 4) {
    return tf::errors::InvalidArgument(name, " must have rank 4 (after broadcasting). Received: ", name,
                                       " with shape ", mask.DebugString());
  }
  *out = BroadcastBoolMask();
  if (IsAbsentMask(mask)) return tf::Status();
  int64_t strides[4];
  int64_t stride = 1;
  for (int axis = 3; axis >= 0; --axis) {
    const int64_t size = mask.dim_size(axis);
    if (size != 1 && size != full[axis]) {
      return tf::errors::InvalidArgument(name, " must be broadcastable to [", full[0], ", ", full[1], ", ",
                                         full[2], ", ", full[3], "]. Received: ", name, " with shape ",
                                         mask.DebugString());
    }
    strides[axis] = size == 1 ? 0 : stride;
    stride *= size;
  }
  out->batch_stride = strides[0];
  out->head_stride = strides[1];
  out->row_stride = strides[2];
  out->col_stride = strides[3];
  return tf::Status();
}

// The ops' "absent" segment ids: shape [0, 0].
bool IsAbsentSegmentIds(const tf::TensorShape& ids) {
  return ids.dims() == 2 && ids.dim_size(0) == 0 && ids.dim_size(1) == 0;
}

// q_segment_ids [B, Sq] and kv_segment_ids [B, Sk], both present or both absent.
tf::Status CheckSegmentIdsShapes(const tf::TensorShape& q_ids, const tf::TensorShape& kv_ids, int64_t batch,
                                 int64_t seqlen_q, int64_t seqlen_k) {
  if (IsAbsentSegmentIds(q_ids) && IsAbsentSegmentIds(kv_ids)) return tf::Status();
  for (const auto& [name, ids, seqlen] : {std::tuple<const char*, const tf::TensorShape*, int64_t>{
                                              "q_segment_ids", &q_ids, seqlen_q},
                                          {"kv_segment_ids", &kv_ids, seqlen_k}}) {
    if (ids->dims() != 2 || ids->dim_size(0) != batch || ids->dim_size(1) != seqlen) {
      return tf::errors::InvalidArgument(name, " must have shape [batch, seq] = [", batch, ", ", seqlen,
                                         "] (both segment ids given, or neither). Received: ", name, " with shape ",
                                         ids->DebugString());
    }
  }
  return tf::Status();
}

tf::Status CheckLengthsShape(const tf::TensorShape& lengths, const char* name, int64_t batch) {
  if (lengths.dims() != 1 || (lengths.dim_size(0) != 0 && lengths.dim_size(0) != batch)) {
    return tf::errors::InvalidArgument(name, " must have shape [batch] = [", batch, "] (or [0] for none). Received: ",
                                       name, " with shape ", lengths.DebugString());
  }
  return tf::Status();
}

tf::Status CheckLengthValues(const int32_t* values, const char* name, int batch, int seqlen) {
  if (values == nullptr) return tf::Status();
  for (int b = 0; b < batch; ++b) {
    if (values[b] < 0 || values[b] > seqlen) {
      return tf::errors::InvalidArgument(name, "[", b, "] must be in [0, ", seqlen, "]. Received: ", name, "[", b,
                                         "]=", values[b]);
    }
  }
  return tf::Status();
}
}  // namespace

tf::Status FlashAttrs::Validate() const {
  if (window_left < -1 || window_left > INT32_MAX || window_right < -1 || window_right > INT32_MAX) {
    return tf::errors::InvalidArgument("window must be (left, right) with each side >= 0, or -1 for unlimited. "
                                       "Received: window=(", window_left, ", ", window_right, ")");
  }
  if (block_q <= 0 || block_k <= 0 || block_q > INT32_MAX || block_k > INT32_MAX) {
    return tf::errors::InvalidArgument("block_size must be positive. Received: block_size=(", block_q, ", ", block_k,
                                       ")");
  }
  if (!(dropout_rate >= 0.f && dropout_rate < 1.f)) {
    return tf::errors::InvalidArgument("dropout_rate must be in [0, 1). Received: dropout_rate=", dropout_rate);
  }
  if (!(std::isfinite(scale) && scale >= 0.f)) {
    return tf::errors::InvalidArgument("scale must be finite and >= 0. Received: scale=", scale);
  }
  if (!(std::isfinite(softcap) && softcap >= 0.f)) {
    return tf::errors::InvalidArgument("softcap must be finite and >= 0 (0 = off). Received: softcap=", softcap);
  }
  // Positions row + query_offset + window stay far from int64's end (mask.h).
  if (query_offset < 0 || query_offset > INT32_MAX) {
    return tf::errors::InvalidArgument("query_offset must be in [0, 2^31). Received: query_offset=", query_offset);
  }
  if (dropout_rate > 0.f && query_offset % 16 != 0) {
    return tf::errors::InvalidArgument("query_offset must be a multiple of 16 with dropout (dropout draws rows in "
                                       "blocks of 16). Received: query_offset=", query_offset,
                                       ", dropout_rate=", dropout_rate);
  }
  if (position_shift < 0 || position_shift > 30) {
    return tf::errors::InvalidArgument("position_shift must be in [0, 30]. Received: position_shift=", position_shift);
  }
  if (num_splits < 1 || num_splits > kMaxSplits) {
    return tf::errors::InvalidArgument("num_splits must be in [1, ", kMaxSplits, "]. Received: num_splits=",
                                       num_splits);
  }
  if (position_shift > 0 && dropout_rate > 0.f) {
    return tf::errors::InvalidArgument("position_shift > 0 takes no dropout (dropout draws by row). Received: "
                                       "position_shift=", position_shift, ", dropout_rate=", dropout_rate);
  }
  return tf::Status();
}

tf::Status ReadFlashAttrs(tf::OpKernelConstruction* ctx, FlashAttrs* attrs) {
#define TF_FLASH_GET_ATTR(type, name) TF_RETURN_IF_ERROR(ctx->GetAttr(#name, &attrs->name));
  TF_FLASH_ATTRS(TF_FLASH_GET_ATTR)
#undef TF_FLASH_GET_ATTR
  return attrs->Validate();
}

std::string FlashAttrsToFfiDictionary(const FlashAttrs& attrs) {
  std::string out = "{";
#define TF_FLASH_FFI_ATTR(type, name) \
  if (out.size() > 1) out += ", ";    \
  AppendFfiAttr(&out, #name, attrs.name);
  TF_FLASH_ATTRS(TF_FLASH_FFI_ATTR)
#undef TF_FLASH_FFI_ATTR
  return out + "}";
}

tf::TensorShape OutputShape(const FlashInputShapes& s) {
  return tf::TensorShape({s.q.dim_size(0), s.q.dim_size(1), s.q.dim_size(2), s.v.dim_size(3)});
}

tf::TensorShape LseShape(const FlashInputShapes& s) {
  return tf::TensorShape({s.q.dim_size(0), s.q.dim_size(2), s.q.dim_size(1)});
}

tf::Status FillParams(const FlashAttrs& attrs, const FlashInputShapes& s, FlashFwdParams* p) {
  const tf::TensorShape &q = s.q, &k = s.k, &v = s.v;
  for (const auto& [name, t] : {std::pair<const char*, const tf::TensorShape*>{"query", &q}, {"key", &k},
                                {"value", &v}}) {
    if (t->dims() != 4) {
      return tf::errors::InvalidArgument(name, " must have rank 4 [batch, seq, heads, dim]. Received: ", name,
                                         " with shape ", t->DebugString());
    }
  }
  if (k.dim_size(0) != q.dim_size(0) || v.dim_size(0) != q.dim_size(0)) {
    return tf::errors::InvalidArgument("query, key and value must have the same batch size. Received: query ",
                                       q.DebugString(), ", key ", k.DebugString(), ", value ", v.DebugString());
  }
  if (k.dim_size(1) != v.dim_size(1) || k.dim_size(2) != v.dim_size(2)) {
    return tf::errors::InvalidArgument("key and value must have the same sequence length and heads. Received: "
                                       "key ", k.DebugString(), ", value ", v.DebugString());
  }
  if (k.dim_size(3) != q.dim_size(3)) {
    return tf::errors::InvalidArgument("query and key must have the same head dim. Received: query ",
                                       q.DebugString(), ", key ", k.DebugString());
  }
  const int64_t heads = q.dim_size(2), heads_kv = k.dim_size(2);
  if (heads_kv == 0 || heads % heads_kv != 0) {
    return tf::errors::InvalidArgument("the number of key/value heads must divide the number of query heads. "
                                       "Received: query heads=", heads, ", key heads=", heads_kv);
  }
  for (const auto& [name, dim] : {std::pair<const char*, int64_t>{"query/key head dim", q.dim_size(3)},
                                  {"value head dim", v.dim_size(3)}}) {
    if (dim < 1 || dim > kMaxHeadDim) {
      return tf::errors::InvalidArgument(name, " must be in [1, ", kMaxHeadDim, "]. Received: ", dim);
    }
  }
  for (const auto& [name, size] : {std::pair<const char*, int64_t>{"query batch", q.dim_size(0)},
                                   {"query length", q.dim_size(1)}, {"key length", k.dim_size(1)},
                                   {"query heads", heads}}) {
    if (size > INT32_MAX) return tf::errors::InvalidArgument(name, " must be below 2^31. Received: ", size);
  }
  if (s.seed.dims() != 1 || s.seed.dim_size(0) != 2) {
    return tf::errors::InvalidArgument(s.seed_name, " must be an int64 tensor of shape [2]. Received: ", s.seed_name,
                                       " with shape ", s.seed.DebugString());
  }
  const int64_t batch = q.dim_size(0), seqlen_q = q.dim_size(1), seqlen_k = k.dim_size(1);
  TF_RETURN_IF_ERROR(CheckLengthsShape(s.q_lengths, "q_lengths", batch));
  TF_RETURN_IF_ERROR(CheckLengthsShape(s.kv_lengths, "kv_lengths", batch));
  TF_RETURN_IF_ERROR(CheckSegmentIdsShapes(s.q_segment_ids, s.kv_segment_ids, batch, seqlen_q, seqlen_k));
  if (attrs.position_shift > 0) {  // params.h: what is read by row cannot follow packed positions
    if (seqlen_q % (int64_t{1} << attrs.position_shift) != 0) {
      return tf::errors::InvalidArgument("2^position_shift must divide the query length. Received: position_shift=",
                                         attrs.position_shift, ", query ", q.DebugString());
    }
    // A key mask ([B|1, 1, 1, Sk]) is one row for all rows and heads: the packed rows read it as they are.
    const bool key_mask = s.attn_mask.dims() == 4 && s.attn_mask.dim_size(1) == 1 && s.attn_mask.dim_size(2) == 1;
    if (s.q_lengths.num_elements() != 0 || !(IsAbsentMask(s.attn_mask) || key_mask) || !IsAbsentMask(s.block_mask) ||
        !IsAbsentSegmentIds(s.q_segment_ids) || !IsAbsentSegmentIds(s.kv_segment_ids)) {
      return tf::errors::InvalidArgument("position_shift > 0 takes no q_lengths, block_mask, segment ids or "
                                         "attention_mask but a key mask ([batch or 1, 1, 1, keys]). Received: "
                                         "position_shift=", attrs.position_shift, ", attention_mask ",
                                         s.attn_mask.DebugString());
    }
  }

  // Attributes land in the params fields of the same names.
#define TF_FLASH_SET_PARAM(type, name) p->name = static_cast<decltype(p->name)>(attrs.name);
  TF_FLASH_ATTRS(TF_FLASH_SET_PARAM)
#undef TF_FLASH_SET_PARAM
  // TF's contract: under tf.config.experimental.enable_op_determinism() every op is deterministic.
  p->deterministic = p->deterministic || ::tensorflow::OpDeterminismRequired();
  p->allow_tf32 = ::tsl::tensor_float_32_execution_enabled();
  p->batch = static_cast<int>(batch);
  p->seqlen_q = static_cast<int>(seqlen_q);
  p->seqlen_k = static_cast<int>(seqlen_k);
  p->num_heads = static_cast<int>(heads);
  p->num_heads_kv = static_cast<int>(heads_kv);
  p->head_dim = static_cast<int>(q.dim_size(3));
  p->head_dim_v = static_cast<int>(v.dim_size(3));
  p->num_q_blocks = static_cast<int>((seqlen_q + attrs.block_q - 1) / attrs.block_q);
  p->num_k_blocks = static_cast<int>((seqlen_k + attrs.block_k - 1) / attrs.block_k);
  SetBshdStrides(q, &p->q_batch_stride, &p->q_row_stride, &p->q_head_stride);
  SetBshdStrides(k, &p->k_batch_stride, &p->k_row_stride, &p->k_head_stride);
  SetBshdStrides(v, &p->v_batch_stride, &p->v_row_stride, &p->v_head_stride);
  SetBshdStrides(OutputShape(s), &p->o_batch_stride, &p->o_row_stride, &p->o_head_stride);
  TF_RETURN_IF_ERROR(SetBroadcastMaskStrides(s.attn_mask, "attention_mask", {batch, heads, seqlen_q, seqlen_k},
                                             &p->attn_mask));
  TF_RETURN_IF_ERROR(SetBroadcastMaskStrides(s.block_mask, "block_mask",
                                             {batch, heads, p->num_q_blocks, p->num_k_blocks}, &p->block_mask));
  return tf::Status();
}

tf::Status CheckGradShapes(const FlashInputShapes& s, const tf::TensorShape& d_out, const tf::TensorShape& out,
                           const tf::TensorShape& lse, const tf::TensorShape& d_lse) {
  const tf::TensorShape out_shape = OutputShape(s), lse_shape = LseShape(s);
  if (d_out != out_shape || out != out_shape) {
    return tf::errors::InvalidArgument("d_output and output must have shape ", out_shape.DebugString(),
                                       ". Received: d_output ", d_out.DebugString(), ", output ", out.DebugString());
  }
  if (lse != lse_shape || d_lse != lse_shape) {
    return tf::errors::InvalidArgument("lse and d_lse must have shape ", lse_shape.DebugString(), ". Received: lse ",
                                       lse.DebugString(), ", d_lse ", d_lse.DebugString());
  }
  return tf::Status();
}

void SetInputPointers(const FlashInputShapes& s, const FlashInputData& data, FlashFwdParams* p) {
  p->q = data[0];
  p->k = data[1];
  p->v = data[2];
  p->q_lengths = s.q_lengths.num_elements() ? static_cast<const int32_t*>(data[3]) : nullptr;
  p->kv_lengths = s.kv_lengths.num_elements() ? static_cast<const int32_t*>(data[4]) : nullptr;
  p->attn_mask.data = IsAbsentMask(s.attn_mask) ? nullptr : static_cast<const bool*>(data[5]);
  p->block_mask.data = IsAbsentMask(s.block_mask) ? nullptr : static_cast<const bool*>(data[6]);
  const bool segments = !IsAbsentSegmentIds(s.q_segment_ids);
  p->q_segment_ids = segments ? static_cast<const int32_t*>(data[7]) : nullptr;
  p->kv_segment_ids = segments ? static_cast<const int32_t*>(data[8]) : nullptr;
}

tf::Status CheckLengthValues(const FlashFwdParams& p) {
  TF_RETURN_IF_ERROR(CheckLengthValues(p.q_lengths, "q_lengths", p.batch, p.seqlen_q));
  return CheckLengthValues(p.kv_lengths, "kv_lengths", p.batch, p.seqlen_k);
}

// ---- CPU ----
namespace {
// The bounds of the segment ids (launch.h) in `bounds`, pointed at by the params.
void SetSegmentBoundsCpu(FlashFwdParams* p, std::vector<int32_t>* bounds) {
  if (!has_segments(*p)) return;
  bounds->resize(segment_bounds_elements(p->batch, p->seqlen_q) + segment_bounds_elements(p->batch, p->seqlen_k));
  int32_t* kv_bounds = bounds->data() + segment_bounds_elements(p->batch, p->seqlen_q);
  segment_bounds_cpu(p->q_segment_ids, p->batch, p->seqlen_q, bounds->data());
  segment_bounds_cpu(p->kv_segment_ids, p->batch, p->seqlen_k, kv_bounds);
  p->q_segment_bounds = bounds->data();
  p->kv_segment_bounds = kv_bounds;
}
}  // namespace

tf::Status RunFlashFwdCpu(const FlashFwdParams& params, DType dtype, const ParallelFor& parallel_for) {
  FlashFwdParams p = params;
  std::vector<int32_t> bounds;
  SetSegmentBoundsCpu(&p, &bounds);
  flash_fwd_cpu(p, dtype, parallel_for);
  return tf::Status();
}

tf::Status RunFlashBwdCpu(const FlashBwdParams& params, DType dtype, int num_threads,
                          const ParallelFor& parallel_for, const FlashAllocate& allocate) {
  FlashBwdParams p = params;
  std::vector<int32_t> bounds;
  SetSegmentBoundsCpu(&p, &bounds);
  void* scratch = nullptr;
  TF_RETURN_IF_ERROR(allocate(flash_bwd_cpu_scratch_bytes(p, num_threads), &scratch));
  p.scratch = static_cast<float*>(scratch);
  flash_bwd_cpu(p, dtype, num_threads, parallel_for);
  return tf::Status();
}

tf::Status CheckDescaleShapes(const FlashFwdParams& p, const tf::TensorShape& q_descale,
                              const tf::TensorShape& k_descale, const tf::TensorShape& v_descale,
                              FlashFwdParams* out) {
  const tf::TensorShape per_head({p.batch, p.num_heads_kv});
  auto kind = [&](const tf::TensorShape& s) {
    if (s.dims() <= 1 && s.num_elements() == 1) return 1;  // per tensor
    if (s == per_head) return 2;
    return 0;
  };
  const int q = kind(q_descale), k = kind(k_descale), v = kind(v_descale);
  const std::string received = "Received: q_descale.shape=" + q_descale.DebugString() + ", k_descale.shape=" +
                               k_descale.DebugString() + ", v_descale.shape=" + v_descale.DebugString();
  if (q == 0 || k == 0 || v == 0)
    return tf::errors::InvalidArgument("q_descale, k_descale and v_descale must each be a float32 scalar (per tensor) "
                                       "or [batch, kv_heads] = ", per_head.DebugString(), ". ", received);
  if (q != k || q != v)
    return tf::errors::InvalidArgument("q_descale, k_descale and v_descale must all be per tensor or all per "
                                       "[batch, kv_heads]. ", received);
  out->descale_batch_stride = q == 2 ? p.num_heads_kv : 0;
  out->descale_head_stride = q == 2 ? 1 : 0;
  return tf::Status();
}

tf::Status Fp8NeedsHopperGpu(const std::string& where) {
  return tf::errors::InvalidArgument(
      "FP8 (float8_e4m3fn) attention needs a Hopper GPU (sm_90): the CPU has no FP8 kernels. Run it under a GPU "
      "device, or dequantize the inputs to bfloat16 (received query.dtype=float8_e4m3fn on ", where, ")");
}

// ---- CUDA ----
namespace {
// The tensor-core kernels take float16/bfloat16 with head dims that are multiples of 8. Other inputs are
// staged: float32 with TF32 allowed is computed on float16 operands with float32 accumulation (the 10-bit
// mantissa of the TF32 that TF itself uses for float32 matmuls on Ampere and later; float32's range by the
// powers of two of a StagePlan), and head dims are zero-padded to a multiple of 8 (padding changes no score
// and is cropped away). float32 with TF32 off runs the full-float32 kernels, unstaged.
int RoundUp8(int x) { return (x + 7) / 8 * 8; }
}  // namespace

int64_t FlashFwdCudaSplitWorkspaceBytes(const FlashFwdParams& p) {
  FlashFwdParams run = p;
  run.head_dim_v = RoundUp8(p.head_dim_v);  // the head dim the kernels run at (RunStaged)
  return SplitWorkspace(run, /*element_bytes=*/2).bytes;
}

FlashFwdCudaWorkspace FlashFwdCudaWorkspaceLayout(const FlashFwdParams& p, const FlashInputShapes& s, DType dtype) {
  const auto aligned = [](int64_t bytes) { return (bytes + 255) / 256 * 256; };
  FlashFwdCudaWorkspace w;
  w.split_bytes = FlashFwdCudaSplitWorkspaceBytes(p);
  w.bytes = w.split_bytes;
#if TF_FLASH_WITH_CUDA
  if (!IsAbsentMask(s.attn_mask) && dtype != DType::kFloat32) {
    w.mask_offset = aligned(w.bytes);
    w.mask_bytes = flash_fwd_cuda_mask_workspace_bytes(p);
    w.bytes = w.mask_offset + w.mask_bytes;
  }
  w.transpose_bytes = flash_fwd_cuda_value_transpose_bytes(p, dtype);
  if (w.transpose_bytes > 0) {
    w.transpose_offset = aligned(w.bytes);
    w.bytes = w.transpose_offset + w.transpose_bytes;
  }
#endif
  return w;
}

bool FlashFwdCudaNeedsScratch(const FlashInputShapes& s, DType dtype) {
  // RunFlashFwdCuda's allocations: RunStaged's copies (float32; head dims off multiples of 8) and the segment
  // bounds. (The packed attn_mask, fp8's V^T and split-KV's runs live in the workspace result.)
  return dtype == DType::kFloat32 || s.q.dim_size(3) % 8 != 0 || s.v.dim_size(3) % 8 != 0 ||
         !IsAbsentSegmentIds(s.q_segment_ids);
}

#if TF_FLASH_WITH_CUDA
namespace {
int64_t ElementBytes(DType t) { return t == DType::kFloat32 ? 4 : 2; }

tf::Status CudaStatus(int error) {
  if (error == 0) return tf::Status();
  return tf::errors::Internal("tf_flash CUDA kernel failed: ", flash_cuda_error_string(error));
}

tf::Status CheckCudaSupport(const FlashFwdParams& p, DType dtype, bool backward) {
  const std::string reason = cuda::check_supported(p, dtype, backward ? Direction::kBackward : Direction::kForward);
  if (!reason.empty()) return tf::errors::InvalidArgument("tf_flash GPU kernel: ", reason);
  return tf::Status();
}

// The bounds of the segment ids (launch.h), computed on `stream` into memory from `allocate`.
tf::Status SetSegmentBoundsCuda(FlashFwdParams* p, void* stream, const FlashAllocate& allocate) {
  if (!has_segments(*p)) return tf::Status();
  const int64_t q_elements = segment_bounds_elements(p->batch, p->seqlen_q);
  void* bounds = nullptr;
  TF_RETURN_IF_ERROR(allocate((q_elements + segment_bounds_elements(p->batch, p->seqlen_k)) * 4, &bounds));
  int32_t* q_bounds = static_cast<int32_t*>(bounds);
  TF_RETURN_IF_ERROR(CudaStatus(flash_cuda_segment_bounds(p->q_segment_ids, p->batch, p->seqlen_q, q_bounds, stream)));
  TF_RETURN_IF_ERROR(CudaStatus(
      flash_cuda_segment_bounds(p->kv_segment_ids, p->batch, p->seqlen_k, q_bounds + q_elements, stream)));
  p->q_segment_bounds = q_bounds;
  p->kv_segment_bounds = q_bounds + q_elements;
  return tf::Status();
}

// Strides of contiguous [B, S, H, D] staged copies.
void SetContiguousStrides(FlashFwdParams* p) {
  p->q_head_stride = p->head_dim;
  p->q_row_stride = int64_t{p->num_heads} * p->head_dim;
  p->q_batch_stride = p->seqlen_q * p->q_row_stride;
  p->k_head_stride = p->head_dim;
  p->k_row_stride = int64_t{p->num_heads_kv} * p->head_dim;
  p->k_batch_stride = p->seqlen_k * p->k_row_stride;
  p->v_head_stride = p->head_dim_v;
  p->v_row_stride = int64_t{p->num_heads_kv} * p->head_dim_v;
  p->v_batch_stride = p->seqlen_k * p->v_row_stride;
  p->o_head_stride = p->head_dim_v;
  p->o_row_stride = int64_t{p->num_heads} * p->head_dim_v;
  p->o_batch_stride = p->seqlen_q * p->o_row_stride;
}

// One tensor of a launch: the params field that points at it (an input or an output of the kernel).
template <typename Params>
struct Staged {
  bool is_input;
  const void* Params::*const_field;  // inputs declared const void* (q, k, v, d_out)
  void* Params::*field;              // outputs, and the backward's input `out` (declared void*)
  bool value_dims;                   // rows of head_dim_v (v, out, d_out, d_v) rather than head_dim
  bool kv_rows;                      // B*Sk*Hkv rows (k, v, d_k, d_v) rather than B*Sq*H
  StageRole role;                    // its power of two when float32 is staged (launch.h)
};

// Runs `launch(params, compute dtype)` on the kernels' native layout: when the inputs need staging,
// copies the inputs into float16/bfloat16 rows of a padded head dim, points the params at the copies,
// launches, then copies the outputs back. float32 goes to float16 by the powers of two of a StagePlan
// the device fills first (float32's range, launch.h). One plan for forward and backward; all on `stream`.
// float32 with TF's TF32 switch off is not staged: the full-float32 kernels read it in place.
template <typename Params, typename Launch>
tf::Status RunStaged(const Params& in, DType dtype, bool backward, void* stream, const FlashAllocate& allocate,
                     std::initializer_list<Staged<Params>> tensors, const Launch& launch) {
  if (dtype == DType::kFloat32 && !in.allow_tf32) {
    TF_RETURN_IF_ERROR(CheckCudaSupport(in, dtype, backward));
    return launch(in, dtype);
  }
  const DType compute = dtype == DType::kFloat32 ? DType::kFloat16 : dtype;
  const int d = RoundUp8(in.head_dim), dv = RoundUp8(in.head_dim_v);
  if (compute == dtype && d == in.head_dim && dv == in.head_dim_v) {
    TF_RETURN_IF_ERROR(CheckCudaSupport(in, dtype, backward));
    return launch(in, dtype);
  }
  Params p = in;
  p.head_dim = d;
  p.head_dim_v = dv;
  SetContiguousStrides(&p);
  TF_RETURN_IF_ERROR(CheckCudaSupport(p, compute, backward));
  const int64_t q_rows = int64_t{p.batch} * p.seqlen_q * p.num_heads;
  const int64_t kv_rows = int64_t{p.batch} * p.seqlen_k * p.num_heads_kv;
  StagePlan* plan = nullptr;
  if (dtype == DType::kFloat32) {
    void* bytes = nullptr;
    TF_RETURN_IF_ERROR(allocate(sizeof(StagePlan), &bytes));
    plan = static_cast<StagePlan*>(bytes);
    StageInputs inputs{{in.q, in.k, in.v, nullptr, nullptr},
                       {q_rows * in.head_dim, kv_rows * in.head_dim, kv_rows * in.head_dim_v, 0, 0}};
    const int64_t lse_rows = int64_t{p.batch} * p.num_heads * p.seqlen_q;
    if constexpr (std::is_same_v<Params, FlashBwdParams>) {
      inputs.data[3] = in.d_out, inputs.size[3] = q_rows * in.head_dim_v;
      inputs.data[4] = in.d_lse, inputs.size[4] = lse_rows;
    }
    TF_RETURN_IF_ERROR(CudaStatus(flash_cuda_stage_plan(inputs, plan, stream)));
    p.scale_exponent_device = &plan->scale_exponent;
    if constexpr (std::is_same_v<Params, FlashBwdParams>) {
      if (in.d_lse != nullptr) {  // d_lse enters D beside rowsum(dO O): scaled as dP is (launch.h)
        void* staged = nullptr;
        TF_RETURN_IF_ERROR(allocate(lse_rows * sizeof(float), &staged));
        TF_RETURN_IF_ERROR(CudaStatus(flash_cuda_stage_rows(in.d_lse, dtype, 1, staged, dtype, 1, lse_rows, plan,
                                                            StageRole::kLseGrad, stream)));
        p.d_lse = static_cast<const float*>(staged);
      }
    }
  }
  struct Unstage {
    const void* staged;
    void* original;
    int staged_dim, original_dim;
    int64_t rows;
    StageRole role;
  };
  std::vector<Unstage> outputs;
  for (const Staged<Params>& t : tensors) {
    const int64_t rows = t.kv_rows ? kv_rows : q_rows;
    const int original_dim = t.value_dims ? in.head_dim_v : in.head_dim;
    const int staged_dim = t.value_dims ? dv : d;
    void* staged = nullptr;
    TF_RETURN_IF_ERROR(allocate(rows * staged_dim * ElementBytes(compute), &staged));
    if (t.is_input) {
      const void* original = t.const_field ? in.*t.const_field : in.*t.field;
      TF_RETURN_IF_ERROR(CudaStatus(flash_cuda_stage_rows(original, dtype, original_dim, staged, compute, staged_dim,
                                                          rows, plan, t.role, stream)));
    } else {
      outputs.push_back({staged, in.*t.field, staged_dim, original_dim, rows, t.role});
    }
    if (t.const_field) {
      p.*t.const_field = staged;
    } else {
      p.*t.field = staged;
    }
  }
  TF_RETURN_IF_ERROR(launch(p, compute));
  for (const Unstage& u : outputs) {
    TF_RETURN_IF_ERROR(CudaStatus(flash_cuda_stage_rows(u.staged, compute, u.staged_dim, u.original, dtype,
                                                        u.original_dim, u.rows, plan, u.role, stream)));
  }
  return tf::Status();
}

// The forward's launch once its inputs are what the kernels take (`compute`): segment bounds, then the packed
// attn_mask, fp8's V^T and split-KV's runs (in a 16-bit dtype), unless the XLA lowering's workspace result holds
// them (FlashFwdCudaWorkspaceLayout).
tf::Status LaunchForwardCuda(const FlashFwdParams& params, DType compute, void* stream,
                             const FlashAllocate& allocate) {
  FlashFwdParams launch = params;
  TF_RETURN_IF_ERROR(SetSegmentBoundsCuda(&launch, stream, allocate));
  const int64_t mask_bytes = flash_fwd_cuda_workspace_bytes(launch, compute);
  if (mask_bytes > 0 && launch.mask_workspace == nullptr) {
    TF_RETURN_IF_ERROR(allocate(mask_bytes, &launch.mask_workspace));
  }
  const int64_t transpose_bytes = flash_fwd_cuda_value_transpose_bytes(launch, compute);
  if (transpose_bytes > 0 && launch.value_transposed == nullptr) {
    TF_RETURN_IF_ERROR(allocate(transpose_bytes, &launch.value_transposed));
  }
  if (launch.num_splits > 1 && launch.split_workspace == nullptr && compute != DType::kFloat32) {
    TF_RETURN_IF_ERROR(allocate(FlashFwdCudaSplitWorkspaceBytes(launch), &launch.split_workspace));
  }
  return CudaStatus(flash_fwd_cuda(launch, compute, stream));
}
}  // namespace

tf::Status RunFlashFwdCuda(const FlashFwdParams& p, DType dtype, void* stream, const FlashAllocate& allocate) {
  using S = Staged<FlashFwdParams>;
  using P = FlashFwdParams;
  return RunStaged(p, dtype, /*backward=*/false, stream, allocate,
                   {S{true, &P::q, nullptr, false, false, StageRole::kQuery},
                    S{true, &P::k, nullptr, false, true, StageRole::kKey},
                    S{true, &P::v, nullptr, true, true, StageRole::kValue},
                    S{false, nullptr, &P::out, true, false, StageRole::kOutput}},
                   [&](const FlashFwdParams& params, DType compute) {
                     return LaunchForwardCuda(params, compute, stream, allocate);
                   });
}

tf::Status RunFlashFwdCudaFp8(const FlashFwdParams& p, void* stream, const FlashAllocate& allocate) {
  // Never staged: fp8 rows are the kernel's as they come (check_supported asks for 16-byte rows).
  TF_RETURN_IF_ERROR(CheckCudaSupport(p, DType::kFloat8E4M3, /*backward=*/false));
  return LaunchForwardCuda(p, DType::kFloat8E4M3, stream, allocate);
}

tf::Status RunFlashBwdCuda(const FlashBwdParams& p, DType dtype, void* stream, const FlashAllocate& allocate) {
  using S = Staged<FlashBwdParams>;
  using P = FlashBwdParams;
  return RunStaged(p, dtype, /*backward=*/true, stream, allocate,
                   {S{true, &P::q, nullptr, false, false, StageRole::kQuery},
                    S{true, &P::k, nullptr, false, true, StageRole::kKey},
                    S{true, &P::v, nullptr, true, true, StageRole::kValue},
                    S{true, nullptr, &P::out, true, false, StageRole::kValue},  // O meets dO in D: scaled as V
                    S{true, &P::d_out, nullptr, true, false, StageRole::kOutGrad},
                    S{false, nullptr, &P::d_q, false, false, StageRole::kQueryGrad},
                    S{false, nullptr, &P::d_k, false, true, StageRole::kKeyGrad},
                    S{false, nullptr, &P::d_v, true, true, StageRole::kValueGrad}},
                   [&](const FlashBwdParams& params, DType compute) {
                     FlashBwdParams launch = params;
                     TF_RETURN_IF_ERROR(SetSegmentBoundsCuda(&launch, stream, allocate));
                     void* scratch = nullptr;
                     TF_RETURN_IF_ERROR(allocate(flash_bwd_cuda_scratch_bytes(launch, compute), &scratch));
                     launch.scratch = static_cast<float*>(scratch);
                     return CudaStatus(flash_bwd_cuda(launch, compute, stream));
                   });
}
#endif  // TF_FLASH_WITH_CUDA

}  // namespace tf_flash
