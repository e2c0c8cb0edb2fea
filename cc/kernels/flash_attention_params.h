// The one place that turns the ops' attributes and input shapes into the kernels' params struct. Both
// front doors call it: the TF OpKernels (flash_attention_kernels.cc) and the XLA lowering plus its FFI
// handlers (flash_attention_xla.cc), so a shape XLA knows at compile time fails with the op's message.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <string>

#include "cc/kernels/flash/launch.h"
#include "cc/kernels/flash/params.h"
#include "tensorflow/core/framework/tensor_shape.h"
#include "tensorflow/core/platform/status.h"

namespace tensorflow {
class OpKernelConstruction;
}

namespace tf_flash {

// Every attribute the two ops share: (C++ type, name). Adding one is one line here (plus the params
// field of the same name and the REGISTER_OP attr): the OpKernels read it with GetAttr, the XLA
// lowering writes it into the custom call's FFI attributes and the FFI handlers read it back by name.
#define TF_FLASH_ATTRS(X)       \
  X(bool, causal)               \
  X(int64_t, window_left)       \
  X(int64_t, window_right)      \
  X(int64_t, block_q)           \
  X(int64_t, block_k)           \
  X(float, dropout_rate)        \
  X(float, scale)               \
  X(float, softcap)             \
  X(bool, deterministic)        \
  X(int64_t, query_offset)      \
  X(bool, bottom_right)         \
  X(int64_t, position_shift)    \
  X(int64_t, num_splits)

struct FlashAttrs {
#define TF_FLASH_ATTR_FIELD(type, name) type name{};
  TF_FLASH_ATTRS(TF_FLASH_ATTR_FIELD)
#undef TF_FLASH_ATTR_FIELD

  // Ranges, with the op's messages ("Received: ...").
  ::tensorflow::Status Validate() const;
};

// Reads and validates the attributes of a TfFlash op (OpKernel or XlaOpKernel construction).
::tensorflow::Status ReadFlashAttrs(::tensorflow::OpKernelConstruction* ctx, FlashAttrs* attrs);

// The attributes as an MLIR dictionary, the backend_config of a typed-FFI custom call.
std::string FlashAttrsToFfiDictionary(const FlashAttrs& attrs);

// The forward op's inputs: query, key, value, q_lengths, kv_lengths, attention_mask, block_mask,
// q_segment_ids, kv_segment_ids, seed. The gradient op's: d_output, query, key, value, output, lse, d_lse,
// then the forward's from q_lengths on (rng_state for seed). Where the forward's inputs sit in each:
constexpr int kNumFwdInputs = 10;
constexpr int kNumBwdInputs = 14;
constexpr int kFwdInputs[kNumFwdInputs] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9};
constexpr int kBwdForwardInputs[kNumFwdInputs] = {1, 2, 3, 7, 8, 9, 10, 11, 12, 13};
constexpr int kSeedInput = kNumFwdInputs - 1;  // seed / rng_state: kFwdInputs[kSeedInput]

// The shapes of the forward inputs (the gradient op's inputs of the same names), in kFwdInputs' order.
struct FlashInputShapes {
  ::tensorflow::TensorShape q, k, v, q_lengths, kv_lengths, attn_mask, block_mask, q_segment_ids, kv_segment_ids,
      seed;
  const char* seed_name = "seed";  // the gradient op's input is "rng_state": errors name what the user passed
};

// The seed input's name among the inputs `index` points at (kFwdInputs or kBwdForwardInputs).
inline const char* SeedInputName(const int (&index)[kNumFwdInputs]) {
  return index[kSeedInput] == kFwdInputs[kSeedInput] ? "seed" : "rng_state";
}

// The fields of `s` in kFwdInputs' order.
inline std::array<::tensorflow::TensorShape*, kNumFwdInputs> InputShapeFields(FlashInputShapes* s) {
  return {&s->q, &s->k, &s->v, &s->q_lengths, &s->kv_lengths, &s->attn_mask, &s->block_mask, &s->q_segment_ids,
          &s->kv_segment_ids, &s->seed};
}

// Validates the shapes and fills every field of the forward params that does not point at data: sizes,
// strides (contiguous [B, S, H, D]), attributes, block counts and the masks' broadcast strides. Data
// pointers are set by SetInputPointers once the buffers exist.
::tensorflow::Status FillParams(const FlashAttrs& attrs, const FlashInputShapes& shapes, FlashFwdParams* p);

// The gradient op's extra inputs: d_output and output [B, Sq, H, Dv], lse and d_lse [B, H, Sq].
::tensorflow::Status CheckGradShapes(const FlashInputShapes& shapes, const ::tensorflow::TensorShape& d_out,
                                     const ::tensorflow::TensorShape& out, const ::tensorflow::TensorShape& lse,
                                     const ::tensorflow::TensorShape& d_lse);

// Output shapes of the forward: [B, Sq, H, Dv] and lse [B, H, Sq].
::tensorflow::TensorShape OutputShape(const FlashInputShapes& shapes);
::tensorflow::TensorShape LseShape(const FlashInputShapes& shapes);

// Points the params at the input buffers (data[kFwdInputs order], seed excluded); empty lengths, masks and
// segment ids (the ops' "absent") become nullptr.
using FlashInputData = std::array<const void*, kNumFwdInputs>;
void SetInputPointers(const FlashInputShapes& shapes, const FlashInputData& data, FlashFwdParams* p);

// The fp8 forward op's descale inputs (q_descale, k_descale, v_descale): each a scalar (or one element, rank <= 1)
// or [batch, kv heads], all three the same; sets p's descale strides (the pointers are the caller's).
::tensorflow::Status CheckDescaleShapes(const FlashFwdParams& p, const ::tensorflow::TensorShape& q_descale,
                                       const ::tensorflow::TensorShape& k_descale,
                                       const ::tensorflow::TensorShape& v_descale, FlashFwdParams* out);

// The fp8 forward's refusal where it has no kernel (the CPU): `where` names the device, or XLA's platform.
::tensorflow::Status Fp8NeedsHopperGpu(const std::string& where);

// Lengths in [0, seqlen]: checked where their values are on the host (CPU); the GPU kernels clamp.
::tensorflow::Status CheckLengthValues(const FlashFwdParams& p);

// ---- Running the kernels, shared by the OpKernels and the FFI handlers ----
// Scratch and staging memory come from the caller's allocator (TF's allocate_temp, XLA's scratch
// allocator, or the heap on the host); it stays valid until the launch's work has finished.
using FlashAllocate = std::function<::tensorflow::Status(int64_t bytes, void** ptr)>;

::tensorflow::Status RunFlashFwdCpu(const FlashFwdParams& p, DType dtype, const ParallelFor& parallel_for);
::tensorflow::Status RunFlashBwdCpu(const FlashBwdParams& p, DType dtype, int num_threads,
                                    const ParallelFor& parallel_for, const FlashAllocate& allocate);

// Whether RunFlashFwdCuda allocates scratch memory for a call with these (validated) inputs. One that allocates
// none can be recorded into a CUDA graph, which keeps no allocation made while it records.
bool FlashFwdCudaNeedsScratch(const FlashInputShapes& s, DType dtype);
// Bytes of split-KV's workspace (FlashFwdParams::num_splits; 0 without a split) for these params on the GPU: the
// runs' outputs in the 16-bit dtype the kernels compute in, at the head dim they run after staging. The XLA
// lowering sizes its workspace result by it and RunFlashFwdCuda its allocation, so the two agree.
int64_t FlashFwdCudaSplitWorkspaceBytes(const FlashFwdParams& p);
// The XLA lowering's workspace result (one buffer, so that the call needs no scratch memory): split-KV's runs
// (FlashFwdCudaSplitWorkspaceBytes), then, each 256-byte aligned, the Hopper forward's packed attn_mask for a
// call with a mask (flash_fwd_cuda_mask_workspace_bytes) and an fp8 forward's V^T
// (flash_fwd_cuda_value_transpose_bytes); those two in CUDA builds only. bytes 0: no result.
struct FlashFwdCudaWorkspace {
  int64_t split_bytes = 0, mask_offset = 0, mask_bytes = 0, transpose_offset = 0, transpose_bytes = 0, bytes = 0;
};
FlashFwdCudaWorkspace FlashFwdCudaWorkspaceLayout(const FlashFwdParams& p, const FlashInputShapes& s, DType dtype);

#if TF_FLASH_WITH_CUDA
// On `stream` (a cudaStream_t), no host synchronization. float32 and head dims that are not multiples
// of 8 are staged through float16 / zero-padded copies (see the .cc).
::tensorflow::Status RunFlashFwdCuda(const FlashFwdParams& p, DType dtype, void* stream,
                                     const FlashAllocate& allocate);
::tensorflow::Status RunFlashBwdCuda(const FlashBwdParams& p, DType dtype, void* stream,
                                     const FlashAllocate& allocate);
// fp8 (e4m3) inputs with p's descales set (the Hopper forward only; check_supported's message otherwise).
::tensorflow::Status RunFlashFwdCudaFp8(const FlashFwdParams& p, void* stream, const FlashAllocate& allocate);
#endif

}  // namespace tf_flash
