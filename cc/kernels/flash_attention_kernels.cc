// OpKernels of TfFlash>FlashAttention and TfFlash>FlashAttentionGrad: read attrs once, fill the
// framework-free params struct through the code the XLA lowering shares (flash_attention_params.h) and
// call the device's kernel. No math here.
#define EIGEN_USE_THREADS
#if TF_FLASH_WITH_CUDA
#define EIGEN_USE_GPU
#endif

#include <algorithm>
#include <string>
#include <type_traits>
#include <vector>

#include "tsl/platform/tensor_float_32_utils.h"
#include "cc/kernels/flash/launch.h"
#include "cc/kernels/flash/params.h"
#include "cc/kernels/flash_attention_params.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/tensor_shape.h"
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

// The forward's inputs (query .. seed) among an op's inputs: kFwdInputs or kBwdForwardInputs.
FlashInputShapes InputShapes(tf::OpKernelContext* ctx, const int (&index)[kNumFwdInputs]) {
  FlashInputShapes s;
  s.seed_name = SeedInputName(index);
  const auto fields = InputShapeFields(&s);
  for (int i = 0; i < kNumFwdInputs; ++i) *fields[i] = ctx->input(index[i]).shape();
  return s;
}

FlashInputData InputData(tf::OpKernelContext* ctx, const int (&index)[kNumFwdInputs]) {
  FlashInputData data;
  for (int i = 0; i < kNumFwdInputs; ++i) data[i] = ctx->input(index[i]).data();
  return data;
}

// Scratch from TF's allocator, kept alive by `held` until the kernel call returns (the GPU stream
// orders reuse after the queued work, as for every TF temporary).
FlashAllocate TempAllocator(tf::OpKernelContext* ctx, std::vector<tf::Tensor>* held) {
  return [ctx, held](int64_t bytes, void** ptr) {
    held->emplace_back();
    TF_RETURN_IF_ERROR(ctx->allocate_temp(tf::DT_INT8, {std::max<int64_t>(bytes, 1)}, &held->back()));
    *ptr = held->back().data();
    return tf::Status();
  };
}

// ---- Device launchers: the only device-specific code of the OpKernels ----
template <typename Device> struct Launcher;

template <> struct Launcher<CPUDevice> {
  static constexpr bool kLengthsOnHost = true;
  static constexpr bool kHasFp8 = false;
  static tf::Status ForwardFp8(tf::OpKernelContext*, const FlashFwdParams&) {
    return tf::errors::Internal("no fp8 kernels on the CPU");  // FlashAttentionFp8Op refuses first
  }

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
    return RunFlashFwdCpu(p, dtype, MakeParallelFor(ctx));
  }
  static tf::Status Backward(tf::OpKernelContext* ctx, const FlashBwdParams& p, DType dtype) {
    std::vector<tf::Tensor> held;
    return RunFlashBwdCpu(p, dtype, NumThreads(ctx), MakeParallelFor(ctx), TempAllocator(ctx, &held));
  }
};

#if TF_FLASH_WITH_CUDA
template <> struct Launcher<GPUDevice> {
  static constexpr bool kLengthsOnHost = false;
  static constexpr bool kHasFp8 = true;
  static tf::Status ForwardFp8(tf::OpKernelContext* ctx, const FlashFwdParams& p) {
    std::vector<tf::Tensor> held;
    return RunFlashFwdCudaFp8(p, Stream(ctx), TempAllocator(ctx, &held));
  }

  static void* Stream(tf::OpKernelContext* ctx) { return ctx->eigen_gpu_device().stream(); }
  static tf::Status Forward(tf::OpKernelContext* ctx, const FlashFwdParams& p, DType dtype) {
    std::vector<tf::Tensor> held;
    return RunFlashFwdCuda(p, dtype, Stream(ctx), TempAllocator(ctx, &held));
  }
  static tf::Status Backward(tf::OpKernelContext* ctx, const FlashBwdParams& p, DType dtype) {
    std::vector<tf::Tensor> held;
    return RunFlashBwdCuda(p, dtype, Stream(ctx), TempAllocator(ctx, &held));
  }
};
#endif

// The steps both forward ops take once their params hold the attributes and shapes: the inputs' pointers, the
// lengths checked where the kernel reads them on the host, the seed, and the three outputs. *empty: the outputs
// have no elements, so there is nothing to launch.
tf::Status PrepareForward(tf::OpKernelContext* ctx, const FlashInputShapes& shapes, bool lengths_on_host,
                          FlashFwdParams* p, bool* empty) {
  SetInputPointers(shapes, InputData(ctx, kFwdInputs), p);
  if (lengths_on_host) TF_RETURN_IF_ERROR(CheckLengthValues(*p));
  const tf::Tensor& seed = ctx->input(kFwdInputs[kSeedInput]);
  p->seed = static_cast<uint64_t>(seed.flat<int64_t>()(0));
  p->seed_offset = static_cast<uint64_t>(seed.flat<int64_t>()(1));
  tf::Tensor* out = nullptr;
  tf::Tensor* lse = nullptr;
  TF_RETURN_IF_ERROR(ctx->allocate_output(0, OutputShape(shapes), &out));
  TF_RETURN_IF_ERROR(ctx->allocate_output(1, LseShape(shapes), &lse));
  ctx->set_output(2, seed);  // the RNG state is the seed itself: the mask is philox(seed, position)
  *empty = out->NumElements() == 0 && lse->NumElements() == 0;
  p->out = out->data();
  p->lse = lse->flat<float>().data();
  return tf::Status();
}

template <typename Device, typename T>
class FlashAttentionOp : public tf::OpKernel {
 public:
  explicit FlashAttentionOp(tf::OpKernelConstruction* ctx) : tf::OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ReadFlashAttrs(ctx, &attrs_));
  }

  void Compute(tf::OpKernelContext* ctx) override {
    const FlashInputShapes shapes = InputShapes(ctx, kFwdInputs);
    FlashFwdParams p;
    OP_REQUIRES_OK(ctx, FillParams(attrs_, shapes, &p));
    bool empty = false;
    OP_REQUIRES_OK(ctx, PrepareForward(ctx, shapes, Launcher<Device>::kLengthsOnHost, &p, &empty));
    if (empty) return;
    OP_REQUIRES_OK(ctx, Launcher<Device>::Forward(ctx, p, DTypeOf<T>::value));
  }

 private:
  FlashAttrs attrs_;
};

template <typename Device, typename T>
class FlashAttentionGradOp : public tf::OpKernel {
 public:
  explicit FlashAttentionGradOp(tf::OpKernelConstruction* ctx) : tf::OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ReadFlashAttrs(ctx, &attrs_));
  }

  void Compute(tf::OpKernelContext* ctx) override {
    const FlashInputShapes shapes = InputShapes(ctx, kBwdForwardInputs);
    FlashBwdParams p;
    OP_REQUIRES_OK(ctx, FillParams(attrs_, shapes, &p));
    const tf::Tensor& d_out = ctx->input(0);
    const tf::Tensor& out = ctx->input(4);
    const tf::Tensor& lse = ctx->input(5);
    const tf::Tensor& d_lse = ctx->input(6);
    OP_REQUIRES_OK(ctx, CheckGradShapes(shapes, d_out.shape(), out.shape(), lse.shape(), d_lse.shape()));
    SetInputPointers(shapes, InputData(ctx, kBwdForwardInputs), &p);
    if (Launcher<Device>::kLengthsOnHost) OP_REQUIRES_OK(ctx, CheckLengthValues(p));
    const tf::Tensor& rng_state = ctx->input(kBwdForwardInputs[kSeedInput]);
    p.seed = static_cast<uint64_t>(rng_state.flat<int64_t>()(0));
    p.seed_offset = static_cast<uint64_t>(rng_state.flat<int64_t>()(1));
    tf::Tensor *d_q = nullptr, *d_k = nullptr, *d_v = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, shapes.q, &d_q));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, shapes.k, &d_k));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, shapes.v, &d_v));
    if (shapes.q.num_elements() == 0 && shapes.k.num_elements() == 0 && shapes.v.num_elements() == 0) return;
    p.out = const_cast<void*>(static_cast<const void*>(out.data()));
    p.lse = const_cast<float*>(lse.flat<float>().data());
    p.d_out = d_out.data();
    p.d_lse = d_lse.flat<float>().data();
    p.d_q = d_q->data();
    p.d_k = d_k->data();
    p.d_v = d_v->data();
    OP_REQUIRES_OK(ctx, Launcher<Device>::Backward(ctx, p, DTypeOf<T>::value));
  }

 private:
  FlashAttrs attrs_;
};

// TfFlash>FlashAttentionFp8: fp8 (e4m3) inputs, OutT (bfloat16 or half) output, on the Hopper forward only. On the
// CPU (and in a library without CUDA) it fails with the reason: the CPU has no fp8 kernels.
template <typename Device, typename OutT>
class FlashAttentionFp8Op : public tf::OpKernel {
 public:
  explicit FlashAttentionFp8Op(tf::OpKernelConstruction* ctx) : tf::OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ReadFlashAttrs(ctx, &attrs_));
  }

  void Compute(tf::OpKernelContext* ctx) override {
    const FlashInputShapes shapes = InputShapes(ctx, kFwdInputs);
    FlashFwdParams p;
    OP_REQUIRES_OK(ctx, FillParams(attrs_, shapes, &p));
    constexpr int kDescale = kNumFwdInputs;  // q_descale, k_descale, v_descale follow the forward's inputs
    const tf::Tensor& q_descale = ctx->input(kDescale);
    const tf::Tensor& k_descale = ctx->input(kDescale + 1);
    const tf::Tensor& v_descale = ctx->input(kDescale + 2);
    OP_REQUIRES_OK(ctx, CheckDescaleShapes(p, q_descale.shape(), k_descale.shape(), v_descale.shape(), &p));
    if (!Launcher<Device>::kHasFp8) {
      ctx->CtxFailure(Fp8NeedsHopperGpu(ctx->device()->name()));
      return;
    }
    p.q_descale = q_descale.flat<float>().data();
    p.k_descale = k_descale.flat<float>().data();
    p.v_descale = v_descale.flat<float>().data();
    p.out_float16 = std::is_same_v<OutT, Eigen::half>;
    bool empty = false;
    OP_REQUIRES_OK(ctx, PrepareForward(ctx, shapes, /*lengths_on_host=*/false, &p, &empty));
    if (empty) return;
    OP_REQUIRES_OK(ctx, Launcher<Device>::ForwardFp8(ctx, p));
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
    // The CPU kernels' instruction-set path, chosen once per process at run time.
    std::string text = std::string(TF_FLASH_BUILD_INFO ";cpu_isa=") + flash_cpu_isa_name();
#if TF_FLASH_WITH_CUDA
    // What float32 inputs run on now, as TF's TF32 switch says: float16 operands scaled to float32's range
    // (TF32-grade), or the full-float32 kernels.
    text += std::string(";gpu_float32_compute=") +
            (::tsl::tensor_float_32_execution_enabled() ? "float16_scaled" : "float32");
#endif
    info->scalar<tf::tstring>()() = text;
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

// fp8 on the CPU: the kernel that says FP8 needs a Hopper GPU.
#define TF_FLASH_REGISTER_FP8_CPU(OutT)                                                                      \
  REGISTER_KERNEL_BUILDER(                                                                                   \
      Name("TfFlash>FlashAttentionFp8").Device(tf::DEVICE_CPU).TypeConstraint<OutT>("output_dtype"),         \
      FlashAttentionFp8Op<CPUDevice, OutT>);
TF_FLASH_REGISTER_FP8_CPU(Eigen::bfloat16)
TF_FLASH_REGISTER_FP8_CPU(Eigen::half)
#undef TF_FLASH_REGISTER_FP8_CPU
#if TF_FLASH_WITH_CUDA
// The seed is read on the host (unused: fp8 takes no dropout, but the op keeps FlashAttention's inputs); the
// descales, lengths and masks stay on the device.
#define TF_FLASH_REGISTER_FP8(OutT)                                                                          \
  REGISTER_KERNEL_BUILDER(Name("TfFlash>FlashAttentionFp8")                                                  \
                              .Device(tf::DEVICE_GPU)                                                        \
                              .TypeConstraint<OutT>("output_dtype")                                          \
                              .HostMemory("seed")                                                            \
                              .HostMemory("rng_state"),                                                      \
                          FlashAttentionFp8Op<GPUDevice, OutT>);
TF_FLASH_REGISTER_FP8(Eigen::bfloat16)
TF_FLASH_REGISTER_FP8(Eigen::half)
#endif
#undef TF_FLASH_REGISTER_FP8

REGISTER_KERNEL_BUILDER(Name("TfFlash>BuildInfo").Device(tf::DEVICE_CPU), BuildInfoOp);

class KernelCountsOp : public tf::OpKernel {
 public:
  using tf::OpKernel::OpKernel;
  void Compute(tf::OpKernelContext* ctx) override {
    tf::Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, {6}, &out));
    auto counts = out->vec<int64_t>();
#if TF_FLASH_WITH_CUDA
    const CudaKernelCounts c = flash_cuda_kernel_counts();
    counts(0) = c.forward_sm80, counts(1) = c.forward_sm90, counts(2) = c.backward_sm80, counts(3) = c.backward_sm90;
    counts(4) = c.forward_float32, counts(5) = c.backward_float32;
#else
    counts.setZero();
#endif
  }
};
REGISTER_KERNEL_BUILDER(Name("TfFlash>KernelCounts").Device(tf::DEVICE_CPU), KernelCountsOp);

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
