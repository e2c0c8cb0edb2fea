// OpKernels of TfFlash>FlashAttention and TfFlash>FlashAttentionGrad: read attrs once, validate the
// inputs, fill the framework-free params struct and call the device's kernel. No math here.
#define EIGEN_USE_THREADS
#if TF_FLASH_WITH_CUDA
#define EIGEN_USE_GPU
#endif

#include <cmath>
#include <string>

#include "cc/kernels/flash/launch.h"
#include "cc/kernels/flash/params.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/tensor_shape.h"
#include "tensorflow/core/util/determinism.h"
#include "tensorflow/core/util/work_sharder.h"

#ifndef TF_FLASH_BUILD_INFO
#define TF_FLASH_BUILD_INFO "cuda=0"
#endif

namespace tf_flash {
namespace {

namespace tf = ::tensorflow;
using CPUDevice = Eigen::ThreadPoolDevice;
#if TF_FLASH_WITH_CUDA
using GPUDevice = Eigen::GpuDevice;
#endif

template <typename T> struct DTypeOf;
template <> struct DTypeOf<float> { static constexpr DType value = DType::kFloat32; };
template <> struct DTypeOf<Eigen::half> { static constexpr DType value = DType::kFloat16; };
template <> struct DTypeOf<Eigen::bfloat16> { static constexpr DType value = DType::kBFloat16; };

constexpr int kMaxHeadDim = 256;

// The attributes both ops share, read and checked once at construction.
struct FlashAttrs {
  bool causal = false;
  int window_left = -1, window_right = -1;
  int block_q = 128, block_k = 128;
  float dropout_rate = 0.f;
  float scale = 1.f;
  float softcap = 0.f;
  bool deterministic = false;  // the backward's; tf.config.experimental.enable_op_determinism() also sets it

  explicit FlashAttrs(tf::OpKernelConstruction* ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("causal", &causal));
    int64_t left, right, bq, bk;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("window_left", &left));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("window_right", &right));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("block_q", &bq));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("block_k", &bk));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("dropout_rate", &dropout_rate));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("scale", &scale));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("softcap", &softcap));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("deterministic", &deterministic));
    OP_REQUIRES(ctx, left >= -1 && left <= INT32_MAX && right >= -1 && right <= INT32_MAX,
                tf::errors::InvalidArgument("window must be (left, right) with each side >= 0, or -1 for "
                                            "unlimited. Received: window=(", left, ", ", right, ")"));
    OP_REQUIRES(ctx, bq > 0 && bk > 0 && bq <= INT32_MAX && bk <= INT32_MAX,
                tf::errors::InvalidArgument("block_size must be positive. Received: block_size=(", bq, ", ",
                                            bk, ")"));
    OP_REQUIRES(ctx, dropout_rate >= 0.f && dropout_rate < 1.f,
                tf::errors::InvalidArgument("dropout_rate must be in [0, 1). Received: dropout_rate=",
                                            dropout_rate));
    OP_REQUIRES(ctx, std::isfinite(scale),
                tf::errors::InvalidArgument("scale must be finite. Received: scale=", scale));
    OP_REQUIRES(ctx, std::isfinite(softcap) && softcap >= 0.f,
                tf::errors::InvalidArgument("softcap must be finite and >= 0 (0 = off). Received: softcap=",
                                            softcap));
    window_left = static_cast<int>(left);
    window_right = static_cast<int>(right);
    block_q = static_cast<int>(bq);
    block_k = static_cast<int>(bk);
  }
};

// Strides of a [B, S, H, D] tensor, in elements.
void SetBshdStrides(const tf::Tensor& t, int64_t* batch, int64_t* row, int64_t* head) {
  *head = t.dim_size(3);
  *row = t.dim_size(2) * t.dim_size(3);
  *batch = t.dim_size(1) * *row;
}

// A rank-4 bool mask whose every dim is 1 (broadcast) or the full size; shape [0,0,0,0] = absent.
tf::Status SetBroadcastMask(const tf::Tensor& mask, const char* name, const int64_t (&full)[4],
                            BroadcastBoolMask* out) {
  if (mask.dims() != 4) {
    return tf::errors::InvalidArgument(name, " must have rank 4 (after broadcasting). Received: ", name,
                                       " with shape ", mask.shape().DebugString());
  }
  if (mask.NumElements() == 0 && mask.dim_size(0) == 0) return tf::Status();  // absent
  int64_t strides[4];
  int64_t stride = 1;
  for (int axis = 3; axis >= 0; --axis) {
    const int64_t size = mask.dim_size(axis);
    if (size != 1 && size != full[axis]) {
      return tf::errors::InvalidArgument(name, " must be broadcastable to [", full[0], ", ", full[1], ", ",
                                         full[2], ", ", full[3], "]. Received: ", name, " with shape ",
                                         mask.shape().DebugString());
    }
    strides[axis] = size == 1 ? 0 : stride;
    stride *= size;
  }
  out->data = mask.flat<bool>().data();
  out->batch_stride = strides[0];
  out->head_stride = strides[1];
  out->row_stride = strides[2];
  out->col_stride = strides[3];
  return tf::Status();
}

tf::Status CheckLengths(const tf::Tensor& lengths, const char* name, int64_t batch, int64_t seqlen,
                        bool values_on_host) {
  if (lengths.dims() != 1 || (lengths.dim_size(0) != 0 && lengths.dim_size(0) != batch)) {
    return tf::errors::InvalidArgument(name, " must have shape [batch] = [", batch,
                                       "] (or [0] for none). Received: ", name, " with shape ",
                                       lengths.shape().DebugString());
  }
  if (!values_on_host) return tf::Status();  // the GPU kernels clamp to [0, seqlen]
  const auto values = lengths.flat<int32_t>();
  for (int64_t b = 0; b < values.size(); ++b) {
    if (values(b) < 0 || values(b) > seqlen) {
      return tf::errors::InvalidArgument(name, "[", b, "] must be in [0, ", seqlen, "]. Received: ", name,
                                         "[", b, "]=", values(b));
    }
  }
  return tf::Status();
}

// Validates q/k/v, lengths, masks and seed, and fills everything of the forward params but the outputs.
tf::Status FillParams(const FlashAttrs& attrs, const tf::Tensor& q, const tf::Tensor& k, const tf::Tensor& v,
                      const tf::Tensor& q_lengths, const tf::Tensor& kv_lengths, const tf::Tensor& attn_mask,
                      const tf::Tensor& block_mask, const tf::Tensor& seed, bool lengths_on_host,
                      FlashFwdParams* p) {
  for (const auto& [name, t] : {std::pair<const char*, const tf::Tensor*>{"query", &q}, {"key", &k},
                                {"value", &v}}) {
    if (t->dims() != 4) {
      return tf::errors::InvalidArgument(name, " must have rank 4 [batch, seq, heads, dim]. Received: ", name,
                                         " with shape ", t->shape().DebugString());
    }
  }
  if (k.dim_size(0) != q.dim_size(0) || v.dim_size(0) != q.dim_size(0)) {
    return tf::errors::InvalidArgument("query, key and value must have the same batch size. Received: query ",
                                       q.shape().DebugString(), ", key ", k.shape().DebugString(), ", value ",
                                       v.shape().DebugString());
  }
  if (k.dim_size(1) != v.dim_size(1) || k.dim_size(2) != v.dim_size(2)) {
    return tf::errors::InvalidArgument("key and value must have the same sequence length and heads. Received: "
                                       "key ", k.shape().DebugString(), ", value ", v.shape().DebugString());
  }
  if (k.dim_size(3) != q.dim_size(3)) {
    return tf::errors::InvalidArgument("query and key must have the same head dim. Received: query ",
                                       q.shape().DebugString(), ", key ", k.shape().DebugString());
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
    if (size > INT32_MAX) {
      return tf::errors::InvalidArgument(name, " must be below 2^31. Received: ", size);
    }
  }
  if (seed.dims() != 1 || seed.dim_size(0) != 2) {
    return tf::errors::InvalidArgument("seed must be an int64 tensor of shape [2]. Received: seed with shape ",
                                       seed.shape().DebugString());
  }
  const int64_t batch = q.dim_size(0), seqlen_q = q.dim_size(1), seqlen_k = k.dim_size(1);
  TF_RETURN_IF_ERROR(CheckLengths(q_lengths, "q_lengths", batch, seqlen_q, lengths_on_host));
  TF_RETURN_IF_ERROR(CheckLengths(kv_lengths, "kv_lengths", batch, seqlen_k, lengths_on_host));

  p->batch = static_cast<int>(batch);
  p->seqlen_q = static_cast<int>(seqlen_q);
  p->seqlen_k = static_cast<int>(seqlen_k);
  p->num_heads = static_cast<int>(heads);
  p->num_heads_kv = static_cast<int>(heads_kv);
  p->head_dim = static_cast<int>(q.dim_size(3));
  p->head_dim_v = static_cast<int>(v.dim_size(3));
  p->scale = attrs.scale;
  p->softcap = attrs.softcap;
  p->causal = attrs.causal;
  p->window_left = attrs.window_left;
  p->window_right = attrs.window_right;
  p->block_q = attrs.block_q;
  p->block_k = attrs.block_k;
  p->num_q_blocks = static_cast<int>((seqlen_q + attrs.block_q - 1) / attrs.block_q);
  p->num_k_blocks = static_cast<int>((seqlen_k + attrs.block_k - 1) / attrs.block_k);
  p->dropout_rate = attrs.dropout_rate;
  const auto seed_values = seed.flat<int64_t>();
  p->seed = static_cast<uint64_t>(seed_values(0));
  p->seed_offset = static_cast<uint64_t>(seed_values(1));

  p->q = q.data();
  p->k = k.data();
  p->v = v.data();
  SetBshdStrides(q, &p->q_batch_stride, &p->q_row_stride, &p->q_head_stride);
  SetBshdStrides(k, &p->k_batch_stride, &p->k_row_stride, &p->k_head_stride);
  SetBshdStrides(v, &p->v_batch_stride, &p->v_row_stride, &p->v_head_stride);
  p->o_head_stride = p->head_dim_v;
  p->o_row_stride = heads * p->head_dim_v;
  p->o_batch_stride = seqlen_q * p->o_row_stride;
  p->q_lengths = q_lengths.NumElements() ? q_lengths.flat<int32_t>().data() : nullptr;
  p->kv_lengths = kv_lengths.NumElements() ? kv_lengths.flat<int32_t>().data() : nullptr;
  TF_RETURN_IF_ERROR(SetBroadcastMask(attn_mask, "attention_mask", {batch, heads, seqlen_q, seqlen_k},
                                      &p->attn_mask));
  TF_RETURN_IF_ERROR(SetBroadcastMask(block_mask, "block_mask",
                                      {batch, heads, p->num_q_blocks, p->num_k_blocks}, &p->block_mask));
  return tf::Status();
}

tf::Status AllocateScratch(tf::OpKernelContext* ctx, int64_t bytes, tf::Tensor* scratch, FlashBwdParams* p) {
  TF_RETURN_IF_ERROR(ctx->allocate_temp(tf::DT_FLOAT, {(bytes + 3) / 4}, scratch));
  p->scratch = scratch->flat<float>().data();
  return tf::Status();
}

// ---- Device launchers: the only device-specific code of the OpKernels ----
template <typename Device> struct Launcher;

template <> struct Launcher<CPUDevice> {
  static constexpr bool kLengthsOnHost = true;

  static ParallelFor MakeParallelFor(tf::OpKernelContext* ctx) {
    auto* workers = ctx->device()->tensorflow_cpu_worker_threads()->workers;
    return [workers](int64_t total, int64_t cost, const std::function<void(int64_t, int64_t)>& work) {
      workers->ParallelFor(total, cost, work);
    };
  }
  static int NumThreads(tf::OpKernelContext* ctx) {
    return ctx->device()->tensorflow_cpu_worker_threads()->workers->NumThreads();
  }
  static tf::Status Forward(tf::OpKernelContext* ctx, const FlashFwdParams& p, DType dtype) {
    flash_fwd_cpu(p, dtype, MakeParallelFor(ctx));
    return tf::Status();
  }
  static tf::Status Backward(tf::OpKernelContext* ctx, const FlashBwdParams& params, DType dtype) {
    FlashBwdParams p = params;
    tf::Tensor scratch;
    TF_RETURN_IF_ERROR(AllocateScratch(ctx, flash_bwd_cpu_scratch_bytes(p, NumThreads(ctx)), &scratch, &p));
    flash_bwd_cpu(p, dtype, NumThreads(ctx), MakeParallelFor(ctx));
    return tf::Status();
  }
};

#if TF_FLASH_WITH_CUDA
// The CUDA kernels take float16/bfloat16 with head dims that are multiples of 8. Other inputs are staged:
// float32 is computed on float16 tensor-core operands with float32 accumulation (the 10-bit mantissa of
// the TF32 that TF itself uses for float32 matmuls on Ampere and later; values must fit float16's range),
// and head dims are zero-padded to a multiple of 8 (padding changes no score and is cropped away).
struct Staging {
  bool needed;
  DType compute;
  int head_dim, head_dim_v;
};

int RoundUp8(int x) { return (x + 7) / 8 * 8; }

Staging PlanStaging(const FlashFwdParams& p, DType dtype) {
  const DType compute = dtype == DType::kFloat32 ? DType::kFloat16 : dtype;
  const int d = RoundUp8(p.head_dim), dv = RoundUp8(p.head_dim_v);
  return {compute != dtype || d != p.head_dim || dv != p.head_dim_v, compute, d, dv};
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

template <> struct Launcher<GPUDevice> {
  static constexpr bool kLengthsOnHost = false;

  static tf::Status Check(const FlashFwdParams& p, DType dtype, bool backward) {
    const std::string reason = flash_cuda_unsupported(p, dtype, backward);
    if (!reason.empty()) return tf::errors::InvalidArgument("tf_flash GPU kernel: ", reason);
    return tf::Status();
  }
  static tf::Status Status(int error) {
    if (error == 0) return tf::Status();
    return tf::errors::Internal("tf_flash CUDA kernel failed: ", flash_cuda_error_string(error));
  }
  static void* Stream(tf::OpKernelContext* ctx) { return ctx->eigen_gpu_device().stream(); }

  // A staged copy of `rows` rows: allocated from TF, filled from `src` when given.
  static tf::Status Stage(tf::OpKernelContext* ctx, const void* src, DType src_type, int src_dim, int64_t rows,
                          DType dst_type, int dst_dim, tf::Tensor* staged, void** dst) {
    TF_RETURN_IF_ERROR(ctx->allocate_temp(dst_type == DType::kFloat16 ? tf::DT_HALF : tf::DT_BFLOAT16,
                                          {rows * dst_dim}, staged));
    *dst = staged->data();
    if (src == nullptr) return tf::Status();
    return Status(flash_cuda_stage_rows(src, src_type, src_dim, *dst, dst_type, dst_dim, rows, Stream(ctx)));
  }
  static tf::Status Unstage(tf::OpKernelContext* ctx, const void* src, DType src_type, int src_dim, int64_t rows,
                            void* dst, DType dst_type, int dst_dim) {
    return Status(flash_cuda_stage_rows(src, src_type, src_dim, dst, dst_type, dst_dim, rows, Stream(ctx)));
  }

  static tf::Status Forward(tf::OpKernelContext* ctx, const FlashFwdParams& in, DType dtype) {
    const Staging st = PlanStaging(in, dtype);
    if (!st.needed) {
      TF_RETURN_IF_ERROR(Check(in, dtype, /*backward=*/false));
      return Status(flash_fwd_cuda(in, dtype, Stream(ctx)));
    }
    FlashFwdParams p = in;
    p.head_dim = st.head_dim;
    p.head_dim_v = st.head_dim_v;
    SetContiguousStrides(&p);
    TF_RETURN_IF_ERROR(Check(p, st.compute, /*backward=*/false));
    const int64_t q_rows = int64_t{p.batch} * p.seqlen_q * p.num_heads;
    const int64_t kv_rows = int64_t{p.batch} * p.seqlen_k * p.num_heads_kv;
    tf::Tensor q, k, v, out;
    void *q_ptr, *k_ptr, *v_ptr;
    TF_RETURN_IF_ERROR(Stage(ctx, in.q, dtype, in.head_dim, q_rows, st.compute, p.head_dim, &q, &q_ptr));
    TF_RETURN_IF_ERROR(Stage(ctx, in.k, dtype, in.head_dim, kv_rows, st.compute, p.head_dim, &k, &k_ptr));
    TF_RETURN_IF_ERROR(Stage(ctx, in.v, dtype, in.head_dim_v, kv_rows, st.compute, p.head_dim_v, &v, &v_ptr));
    TF_RETURN_IF_ERROR(Stage(ctx, nullptr, dtype, 0, q_rows, st.compute, p.head_dim_v, &out, &p.out));
    p.q = q_ptr;
    p.k = k_ptr;
    p.v = v_ptr;
    TF_RETURN_IF_ERROR(Status(flash_fwd_cuda(p, st.compute, Stream(ctx))));
    return Unstage(ctx, p.out, st.compute, p.head_dim_v, q_rows, in.out, dtype, in.head_dim_v);
  }

  static tf::Status Backward(tf::OpKernelContext* ctx, const FlashBwdParams& in, DType dtype) {
    const Staging st = PlanStaging(in, dtype);
    tf::Tensor scratch;
    if (!st.needed) {
      TF_RETURN_IF_ERROR(Check(in, dtype, /*backward=*/true));
      FlashBwdParams p = in;
      TF_RETURN_IF_ERROR(AllocateScratch(ctx, flash_bwd_cuda_scratch_bytes(p), &scratch, &p));
      return Status(flash_bwd_cuda(p, dtype, Stream(ctx)));
    }
    FlashBwdParams p = in;
    p.head_dim = st.head_dim;
    p.head_dim_v = st.head_dim_v;
    SetContiguousStrides(&p);
    TF_RETURN_IF_ERROR(Check(p, st.compute, /*backward=*/true));
    const int64_t q_rows = int64_t{p.batch} * p.seqlen_q * p.num_heads;
    const int64_t kv_rows = int64_t{p.batch} * p.seqlen_k * p.num_heads_kv;
    const DType c = st.compute;
    tf::Tensor q, k, v, out, d_out, d_q, d_k, d_v;
    void *q_ptr, *k_ptr, *v_ptr, *out_ptr, *d_out_ptr;
    TF_RETURN_IF_ERROR(Stage(ctx, in.q, dtype, in.head_dim, q_rows, c, p.head_dim, &q, &q_ptr));
    TF_RETURN_IF_ERROR(Stage(ctx, in.k, dtype, in.head_dim, kv_rows, c, p.head_dim, &k, &k_ptr));
    TF_RETURN_IF_ERROR(Stage(ctx, in.v, dtype, in.head_dim_v, kv_rows, c, p.head_dim_v, &v, &v_ptr));
    TF_RETURN_IF_ERROR(Stage(ctx, in.out, dtype, in.head_dim_v, q_rows, c, p.head_dim_v, &out, &out_ptr));
    TF_RETURN_IF_ERROR(Stage(ctx, in.d_out, dtype, in.head_dim_v, q_rows, c, p.head_dim_v, &d_out, &d_out_ptr));
    TF_RETURN_IF_ERROR(Stage(ctx, nullptr, dtype, 0, q_rows, c, p.head_dim, &d_q, &p.d_q));
    TF_RETURN_IF_ERROR(Stage(ctx, nullptr, dtype, 0, kv_rows, c, p.head_dim, &d_k, &p.d_k));
    TF_RETURN_IF_ERROR(Stage(ctx, nullptr, dtype, 0, kv_rows, c, p.head_dim_v, &d_v, &p.d_v));
    p.q = q_ptr;
    p.k = k_ptr;
    p.v = v_ptr;
    p.out = out_ptr;
    p.d_out = d_out_ptr;
    TF_RETURN_IF_ERROR(AllocateScratch(ctx, flash_bwd_cuda_scratch_bytes(p), &scratch, &p));
    TF_RETURN_IF_ERROR(Status(flash_bwd_cuda(p, c, Stream(ctx))));
    TF_RETURN_IF_ERROR(Unstage(ctx, p.d_q, c, p.head_dim, q_rows, in.d_q, dtype, in.head_dim));
    TF_RETURN_IF_ERROR(Unstage(ctx, p.d_k, c, p.head_dim, kv_rows, in.d_k, dtype, in.head_dim));
    return Unstage(ctx, p.d_v, c, p.head_dim_v, kv_rows, in.d_v, dtype, in.head_dim_v);
  }
};
#endif

template <typename Device, typename T>
class FlashAttentionOp : public tf::OpKernel {
 public:
  explicit FlashAttentionOp(tf::OpKernelConstruction* ctx) : tf::OpKernel(ctx), attrs_(ctx) {}

  void Compute(tf::OpKernelContext* ctx) override {
    const tf::Tensor& q = ctx->input(0);
    const tf::Tensor& k = ctx->input(1);
    const tf::Tensor& v = ctx->input(2);
    FlashFwdParams p;
    OP_REQUIRES_OK(ctx, FillParams(attrs_, q, k, v, ctx->input(3), ctx->input(4), ctx->input(5), ctx->input(6),
                                   ctx->input(7), Launcher<Device>::kLengthsOnHost, &p));
    tf::Tensor* out = nullptr;
    tf::Tensor* lse = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(
                            0, {q.dim_size(0), q.dim_size(1), q.dim_size(2), v.dim_size(3)}, &out));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, {q.dim_size(0), q.dim_size(2), q.dim_size(1)}, &lse));
    ctx->set_output(2, ctx->input(7));  // the RNG state is the seed itself: the mask is philox(seed, position)
    if (out->NumElements() == 0 && lse->NumElements() == 0) return;
    p.out = out->data();
    p.lse = lse->flat<float>().data();
    OP_REQUIRES_OK(ctx, Launcher<Device>::Forward(ctx, p, DTypeOf<T>::value));
  }

 private:
  FlashAttrs attrs_;
};

template <typename Device, typename T>
class FlashAttentionGradOp : public tf::OpKernel {
 public:
  explicit FlashAttentionGradOp(tf::OpKernelConstruction* ctx) : tf::OpKernel(ctx), attrs_(ctx) {}

  void Compute(tf::OpKernelContext* ctx) override {
    const tf::Tensor& d_out = ctx->input(0);
    const tf::Tensor& q = ctx->input(1);
    const tf::Tensor& k = ctx->input(2);
    const tf::Tensor& v = ctx->input(3);
    const tf::Tensor& out = ctx->input(4);
    const tf::Tensor& lse = ctx->input(5);
    const tf::Tensor& d_lse = ctx->input(6);
    FlashBwdParams p;
    OP_REQUIRES_OK(ctx, FillParams(attrs_, q, k, v, ctx->input(7), ctx->input(8), ctx->input(9), ctx->input(10),
                                   ctx->input(11), Launcher<Device>::kLengthsOnHost, &p));
    const tf::TensorShape out_shape({q.dim_size(0), q.dim_size(1), q.dim_size(2), v.dim_size(3)});
    const tf::TensorShape lse_shape({q.dim_size(0), q.dim_size(2), q.dim_size(1)});
    OP_REQUIRES(ctx, d_out.shape() == out_shape && out.shape() == out_shape,
                tf::errors::InvalidArgument("d_output and output must have shape ", out_shape.DebugString(),
                                            ". Received: d_output ", d_out.shape().DebugString(), ", output ",
                                            out.shape().DebugString()));
    OP_REQUIRES(ctx, lse.shape() == lse_shape && d_lse.shape() == lse_shape,
                tf::errors::InvalidArgument("lse and d_lse must have shape ", lse_shape.DebugString(),
                                            ". Received: lse ", lse.shape().DebugString(), ", d_lse ",
                                            d_lse.shape().DebugString()));
    tf::Tensor *d_q = nullptr, *d_k = nullptr, *d_v = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, q.shape(), &d_q));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, k.shape(), &d_k));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, v.shape(), &d_v));
    if (q.NumElements() == 0 && k.NumElements() == 0 && v.NumElements() == 0) return;
    p.out = const_cast<void*>(static_cast<const void*>(out.data()));
    p.lse = const_cast<float*>(lse.flat<float>().data());
    p.d_out = d_out.data();
    p.d_lse = d_lse.flat<float>().data();
    p.d_q = d_q->data();
    p.d_k = d_k->data();
    p.d_v = d_v->data();
    p.deterministic = attrs_.deterministic || tf::OpDeterminismRequired();
    OP_REQUIRES_OK(ctx, Launcher<Device>::Backward(ctx, p, DTypeOf<T>::value));
  }

 private:
  FlashAttrs attrs_;
};

class BuildInfoOp : public tf::OpKernel {
 public:
  using tf::OpKernel::OpKernel;
  void Compute(tf::OpKernelContext* ctx) override {
    tf::Tensor* info = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, {}, &info));
#if TF_FLASH_WITH_CUDA
    info->scalar<tf::tstring>()() = TF_FLASH_BUILD_INFO ";gpu_float32_compute=float16";
#else
    info->scalar<tf::tstring>()() = TF_FLASH_BUILD_INFO;
#endif
  }
};

#define TF_FLASH_REGISTER_CPU(T)                                                                      \
  REGISTER_KERNEL_BUILDER(Name("TfFlash>FlashAttention").Device(tf::DEVICE_CPU).TypeConstraint<T>("T"), \
                          FlashAttentionOp<CPUDevice, T>);                                            \
  REGISTER_KERNEL_BUILDER(                                                                            \
      Name("TfFlash>FlashAttentionGrad").Device(tf::DEVICE_CPU).TypeConstraint<T>("T"),               \
      FlashAttentionGradOp<CPUDevice, T>);
TF_FLASH_REGISTER_CPU(float)
TF_FLASH_REGISTER_CPU(Eigen::half)
TF_FLASH_REGISTER_CPU(Eigen::bfloat16)
#undef TF_FLASH_REGISTER_CPU

REGISTER_KERNEL_BUILDER(Name("TfFlash>BuildInfo").Device(tf::DEVICE_CPU), BuildInfoOp);

#if TF_FLASH_WITH_CUDA
// The seed is read on the host into the params; lengths and masks stay on the device.
#define TF_FLASH_REGISTER_GPU(T)                                                                \
  REGISTER_KERNEL_BUILDER(Name("TfFlash>FlashAttention")                                        \
                              .Device(tf::DEVICE_GPU)                                           \
                              .TypeConstraint<T>("T")                                           \
                              .HostMemory("seed")                                               \
                              .HostMemory("rng_state"),                                         \
                          FlashAttentionOp<GPUDevice, T>);                                      \
  REGISTER_KERNEL_BUILDER(Name("TfFlash>FlashAttentionGrad")                                    \
                              .Device(tf::DEVICE_GPU)                                           \
                              .TypeConstraint<T>("T")                                           \
                              .HostMemory("rng_state"),                                         \
                          FlashAttentionGradOp<GPUDevice, T>);
TF_FLASH_REGISTER_GPU(float)
TF_FLASH_REGISTER_GPU(Eigen::half)
TF_FLASH_REGISTER_GPU(Eigen::bfloat16)
#undef TF_FLASH_REGISTER_GPU
#endif

}  // namespace
}  // namespace tf_flash
