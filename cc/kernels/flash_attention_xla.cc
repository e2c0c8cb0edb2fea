// The XLA front door of TfFlash>FlashAttention, TfFlash>FlashAttentionGrad and TfFlash>FlashAttentionFp8.
//
// Under tf.function(jit_compile=True) (and Keras' jit_compile), TF lowers each op with the XlaOpKernels
// below: they validate the shapes XLA knows at compile time with the ops' own messages (FillParams) and
// emit one typed-FFI custom call whose attributes are the ops' attributes. At run time XLA calls our FFI
// handlers, which fill the same params struct and run the same kernels as the OpKernels: the CPU kernels
// on platform "Host" (XLA's intra-op thread pool), the CUDA kernels on platform "CUDA" (XLA's stream and
// scratch allocator). XLA never sees the attention as dense math, so the [Sq, Sk] scores never exist.
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "cc/kernels/flash/launch.h"
#include "cc/kernels/flash/params.h"
#include "cc/kernels/flash_attention_params.h"
#include "tensorflow/compiler/tf2xla/xla_op_kernel.h"
#include "tensorflow/compiler/tf2xla/xla_op_registry.h"
#include "tensorflow/core/framework/kernel_def.pb.h"
#include "tensorflow/core/framework/node_def.pb.h"
#include "tensorflow/core/framework/node_def_builder.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "xla/ffi/api/c_api.h"
#include "xla/ffi/api/ffi.h"
#include "xla/hlo/builder/xla_builder.h"
#include "xla/shape_util.h"

#if TF_FLASH_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

// The FFI API of the running TensorFlow (exported by libtensorflow_framework.so.2): handlers must be
// registered in the registry its XLA looks up, not in a copy of our own.
extern "C" const XLA_FFI_Api* XLA_FFI_GetApi();

namespace tf_flash {
namespace {

namespace tf = ::tensorflow;
namespace ffi = ::xla::ffi;

constexpr char kFwdTarget[] = "tf_flash_attention_fwd";
// The forward of a call that needs no scratch memory (FlashFwdCudaNeedsScratch): its CUDA handler is marked
// command-buffer compatible, so that XLA records it into its CUDA graphs with the fusions around it. A decode
// step is one graph launch then, where the handler's own launch would split the graph in three (launches are
// most of a short cache's step).
constexpr char kFwdGraphTarget[] = "tf_flash_attention_fwd_graph";
constexpr char kBwdTarget[] = "tf_flash_attention_bwd";
// The fp8 forward: the forward's operands and the three descales; V^T, split-KV's runs and a packed attn_mask in a
// workspace result as the 16-bit forward's, and likewise a target of its own for the calls that need no scratch.
constexpr char kFwdFp8Target[] = "tf_flash_attention_fwd_fp8";
constexpr char kFwdFp8GraphTarget[] = "tf_flash_attention_fwd_fp8_graph";
constexpr int kNumFp8Inputs = kNumFwdInputs + 3;  // q_descale, k_descale, v_descale follow the forward's inputs

FlashInputShapes ShapesAt(const std::vector<tf::TensorShape>& shapes, const int (&index)[kNumFwdInputs]) {
  FlashInputShapes s;
  s.seed_name = SeedInputName(index);
  const auto fields = InputShapeFields(&s);
  for (int i = 0; i < kNumFwdInputs; ++i) *fields[i] = shapes[index[i]];
  return s;
}

// ---- Compile time: the XLA kernels ----

xla::Shape RowMajor(xla::PrimitiveType type, const tf::TensorShape& shape) {
  return xla::ShapeUtil::MakeShapeWithDescendingLayout(type, shape.dim_sizes());
}

// One typed-FFI custom call over all the op's inputs, in row-major layout (the kernels' strides).
xla::XlaOp EmitFlashCall(tf::XlaOpKernelContext* ctx, const char* target, int num_inputs,
                         const std::vector<xla::Shape>& results, const FlashAttrs& attrs) {
  std::vector<xla::XlaOp> operands;
  std::vector<xla::Shape> operand_shapes;
  for (int i = 0; i < num_inputs; ++i) {
    operands.push_back(ctx->Input(i));
    operand_shapes.push_back(RowMajor(ctx->input_xla_type(i), ctx->InputShape(i)));
  }
  return xla::CustomCallWithLayout(ctx->builder(), target, operands, xla::ShapeUtil::MakeTupleShape(results),
                                   operand_shapes, FlashAttrsToFfiDictionary(attrs), /*has_side_effect=*/false,
                                   /*output_operand_aliasing=*/{}, /*literal=*/nullptr,
                                   xla::CustomCallSchedule::SCHEDULE_NONE,
                                   xla::CustomCallApiVersion::API_VERSION_TYPED_FFI);
}

// The kernels take static shapes. XLA gives an operand a dynamic (bounded) dimension when its size
// depends on run-time values, e.g. a tf.cond choosing between an absent mask ([0, 0, 0, 0]) and a
// present one: say which input, instead of XLA's generic custom-call error.
tf::Status InputShapes(tf::XlaOpKernelContext* ctx, const char* const* names, int num_inputs,
                       std::vector<tf::TensorShape>* shapes) {
  for (int i = 0; i < num_inputs; ++i) {
    absl::StatusOr<xla::Shape> shape = ctx->InputXlaShape(i);
    TF_RETURN_IF_ERROR(shape.status());
    if (shape->is_dynamic()) {
      return tf::errors::InvalidArgument("tf_flash under XLA needs static shapes. Received: ", names[i],
                                         " with the dynamic shape ", shape->ToString(),
                                         " (its size depends on run-time values, e.g. a tf.cond between "
                                         "tensors of different shapes)");
    }
    shapes->push_back(ctx->InputShape(i));
  }
  return tf::Status();
}

constexpr const char* kFwdInputNames[kNumFwdInputs] = {
    "query", "key", "value", "q_lengths", "kv_lengths", "attention_mask", "block_mask", "q_segment_ids",
    "kv_segment_ids", "seed"};
constexpr const char* kFp8InputNames[kNumFp8Inputs] = {
    "query", "key", "value", "q_lengths", "kv_lengths", "attention_mask", "block_mask", "q_segment_ids",
    "kv_segment_ids", "seed", "q_descale", "k_descale", "v_descale"};
constexpr const char* kBwdInputNames[kNumBwdInputs] = {
    "d_output",  "query",      "key",            "value",      "output", "lse", "d_lse",
    "q_lengths", "kv_lengths", "attention_mask", "block_mask", "q_segment_ids", "kv_segment_ids", "rng_state"};

// A forward op's compile-time checks, as its OpKernel makes them: static shapes of its `num_inputs` inputs (`all`),
// the forward's among them (`shapes`) and the params they give.
tf::Status CheckForwardInputs(tf::XlaOpKernelContext* ctx, const FlashAttrs& attrs, const char* const* names,
                              int num_inputs, std::vector<tf::TensorShape>* all, FlashInputShapes* shapes,
                              FlashFwdParams* p) {
  TF_RETURN_IF_ERROR(InputShapes(ctx, names, num_inputs, all));
  *shapes = ShapesAt(*all, kFwdInputs);
  return FillParams(attrs, *shapes, p);
}

// A forward op's outputs from its call: output, lse, and rng_state, the seed itself, as in the OpKernel.
void SetForwardOutputs(tf::XlaOpKernelContext* ctx, const xla::XlaOp& call) {
  ctx->SetOutput(0, xla::GetTupleElement(call, 0));
  ctx->SetOutput(1, xla::GetTupleElement(call, 1));
  ctx->SetOutput(2, ctx->Input(kFwdInputs[kSeedInput]));
}

// A forward call (16-bit or fp8) with results output (output_type), lse and, where the call wants one, its
// workspace: split-KV's runs, the packed attn_mask and fp8's V^T in a result that XLA allocates with the call's
// other buffers, so that a call without other scratch (`target`: the graph one) stays in XLA's CUDA graphs, where
// its handler's host work is recorded once instead of running every step. (The CPU kernel keeps its own.)
xla::XlaOp EmitForwardCall(tf::XlaOpKernelContext* ctx, const FlashAttrs& attrs, const FlashFwdParams& p,
                           const FlashInputShapes& shapes, DType dtype, xla::PrimitiveType output_type, int num_args,
                           const char* target) {
  std::vector<xla::Shape> results = {RowMajor(output_type, OutputShape(shapes)), RowMajor(xla::F32, LseShape(shapes))};
  const int64_t workspace_bytes = FlashFwdCudaWorkspaceLayout(p, shapes, dtype).bytes;
  if (workspace_bytes > 0) results.push_back(xla::ShapeUtil::MakeShape(xla::U8, {workspace_bytes}));
  return EmitFlashCall(ctx, target, num_args, results, attrs);
}

class FlashAttentionXlaOp : public tf::XlaOpKernel {
 public:
  explicit FlashAttentionXlaOp(tf::OpKernelConstruction* ctx) : tf::XlaOpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ReadFlashAttrs(ctx, &attrs_));
  }

  void Compile(tf::XlaOpKernelContext* ctx) override {
    std::vector<tf::TensorShape> all;
    FlashInputShapes shapes;
    FlashFwdParams p;
    OP_REQUIRES_OK(ctx, CheckForwardInputs(ctx, attrs_, kFwdInputNames, kNumFwdInputs, &all, &shapes, &p));
    const tf::DataType type = ctx->input_type(0);
    const DType dtype = type == tf::DT_FLOAT  ? DType::kFloat32
                        : type == tf::DT_HALF ? DType::kFloat16
                                              : DType::kBFloat16;  // kFlashTypes
    const xla::XlaOp call =
        EmitForwardCall(ctx, attrs_, p, shapes, dtype, ctx->input_xla_type(0), kNumFwdInputs,
                        FlashFwdCudaNeedsScratch(shapes, dtype) ? kFwdTarget : kFwdGraphTarget);
    SetForwardOutputs(ctx, call);
  }

 private:
  FlashAttrs attrs_;
};

class FlashAttentionGradXlaOp : public tf::XlaOpKernel {
 public:
  explicit FlashAttentionGradXlaOp(tf::OpKernelConstruction* ctx) : tf::XlaOpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ReadFlashAttrs(ctx, &attrs_));
  }

  void Compile(tf::XlaOpKernelContext* ctx) override {
    std::vector<tf::TensorShape> all;
    OP_REQUIRES_OK(ctx, InputShapes(ctx, kBwdInputNames, kNumBwdInputs, &all));
    const FlashInputShapes shapes = ShapesAt(all, kBwdForwardInputs);
    FlashBwdParams p;
    OP_REQUIRES_OK(ctx, FillParams(attrs_, shapes, &p));
    OP_REQUIRES_OK(ctx, CheckGradShapes(shapes, all[0], all[4], all[5], all[6]));
    const xla::PrimitiveType type = ctx->input_xla_type(1);
    const xla::XlaOp call = EmitFlashCall(
        ctx, kBwdTarget, kNumBwdInputs,
        {RowMajor(type, shapes.q), RowMajor(type, shapes.k), RowMajor(type, shapes.v)}, attrs_);
    for (int i = 0; i < 3; ++i) ctx->SetOutput(i, xla::GetTupleElement(call, i));
  }

 private:
  FlashAttrs attrs_;
};

// The fp8 forward: checked at compile time as the OpKernel checks (descales included), one call of its own target.
// On the CPU its handler fails as the CPU OpKernel does, at run time, so that a graph means the same on every
// device.
class FlashAttentionFp8XlaOp : public tf::XlaOpKernel {
 public:
  explicit FlashAttentionFp8XlaOp(tf::OpKernelConstruction* ctx) : tf::XlaOpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ReadFlashAttrs(ctx, &attrs_));
  }

  void Compile(tf::XlaOpKernelContext* ctx) override {
    std::vector<tf::TensorShape> all;
    FlashInputShapes shapes;
    FlashFwdParams p;
    OP_REQUIRES_OK(ctx, CheckForwardInputs(ctx, attrs_, kFp8InputNames, kNumFp8Inputs, &all, &shapes, &p));
    OP_REQUIRES_OK(ctx,
                   CheckDescaleShapes(p, all[kNumFwdInputs], all[kNumFwdInputs + 1], all[kNumFwdInputs + 2], &p));
    const DType dtype = DType::kFloat8E4M3;
    const xla::XlaOp call =
        EmitForwardCall(ctx, attrs_, p, shapes, dtype, ctx->output_xla_type(0), kNumFp8Inputs,
                        FlashFwdCudaNeedsScratch(shapes, dtype) ? kFwdFp8Target : kFwdFp8GraphTarget);
    SetForwardOutputs(ctx, call);
  }

 private:
  FlashAttrs attrs_;
};

constexpr tf::DataType kFlashTypes[] = {tf::DT_FLOAT, tf::DT_HALF, tf::DT_BFLOAT16};
constexpr tf::DataType kFp8OutputTypes[] = {tf::DT_BFLOAT16, tf::DT_HALF};

REGISTER_XLA_OP(Name("TfFlash>FlashAttention").TypeConstraint("T", kFlashTypes), FlashAttentionXlaOp);
REGISTER_XLA_OP(Name("TfFlash>FlashAttentionGrad").TypeConstraint("T", kFlashTypes), FlashAttentionGradXlaOp);
REGISTER_XLA_OP(Name("TfFlash>FlashAttentionFp8").TypeConstraint("output_dtype", kFp8OutputTypes),
                FlashAttentionFp8XlaOp);

// XlaOpRegistry turns registrations into kernels on the XLA_*_JIT devices once, the first time anything is
// compiled (RegisterCompilationKernels); a registration made later is stored but never becomes a kernel,
// and jit_compile then fails with "no registered kernel" for our ops. When this library is loaded after
// that point (some jit_compile function ran before `import tf_flash`), register the kernels on each XLA
// backend ourselves, with the KernelDef RegisterCompilationKernels would have built.
bool CompilationKernelsBuilt(const std::string& backend) {
  // Identity has an XLA kernel on every backend: present iff the registry has been built.
  tf::NodeDef identity;
  if (!tf::NodeDefBuilder("probe", "Identity").Input("x", 0, tf::DT_FLOAT).Finalize(&identity).ok()) return false;
  return tf::FindKernelDef(tf::DeviceType(backend), identity, nullptr, nullptr).ok();
}

// Our XLA ops, each with its type attribute and the types it is registered for.
struct OurXlaOp {
  const char* op;
  const char* type_attr;
  absl::Span<const tf::DataType> types;
  tf::OpKernel* (*create)(tf::OpKernelConstruction*);
};

bool HasOurKernel(const std::string& backend, const OurXlaOp& xla_op) {
  tf::NodeDef node;
  node.set_name("probe");
  node.set_op(xla_op.op);
  (*node.mutable_attr())[xla_op.type_attr].set_type(xla_op.types[0]);
  // FindKernelDef needs every attr of the OpDef only for matching constraints; the type attr is the only one.
  return tf::FindKernelDef(tf::DeviceType(backend), node, nullptr, nullptr).ok();
}

void RegisterLateKernel(const std::string& backend, const OurXlaOp& xla_op) {
  auto* def = new tf::KernelDef;
  def->set_op(xla_op.op);
  def->set_device_type(backend);
  auto* allowed = def->add_constraint();
  allowed->set_name(xla_op.type_attr);
  for (tf::DataType type : xla_op.types) allowed->mutable_allowed_values()->mutable_list()->add_type(type);
  // Lives as long as the process, like the registrars RegisterCompilationKernels keeps.
  new tf::kernel_factory::OpKernelRegistrar(def, "XlaJitOp", xla_op.create);
}

template <typename Kernel>
tf::OpKernel* CreateKernel(tf::OpKernelConstruction* ctx) {
  return new Kernel(ctx);
}

const bool kLateKernelsRegistered = [] {
  const OurXlaOp ops[] = {
      {"TfFlash>FlashAttention", "T", kFlashTypes, CreateKernel<FlashAttentionXlaOp>},
      {"TfFlash>FlashAttentionGrad", "T", kFlashTypes, CreateKernel<FlashAttentionGradXlaOp>},
      {"TfFlash>FlashAttentionFp8", "output_dtype", kFp8OutputTypes, CreateKernel<FlashAttentionFp8XlaOp>}};
  for (const std::string& backend : tf::XlaOpRegistry::BackendNames()) {
    if (!CompilationKernelsBuilt(backend)) continue;  // built later, from our REGISTER_XLA_OP above
    for (const OurXlaOp& xla_op : ops) {
      if (!HasOurKernel(backend, xla_op)) RegisterLateKernel(backend, xla_op);
    }
  }
  return true;
}();

// ---- Run time: the FFI handlers ----

ffi::Error ToFfiError(const tf::Status& status) {
  if (status.ok()) return ffi::Error::Success();
  return ffi::Error(static_cast<ffi::ErrorCode>(status.code()), std::string(status.message()));
}

tf::Status ToDType(ffi::DataType type, DType* dtype) {
  switch (type) {
    case ffi::DataType::F32: *dtype = DType::kFloat32; return tf::Status();
    case ffi::DataType::F16: *dtype = DType::kFloat16; return tf::Status();
    case ffi::DataType::BF16: *dtype = DType::kBFloat16; return tf::Status();
    default:
      return tf::errors::InvalidArgument("tf_flash: query must be float32, float16 or bfloat16. Received: XLA type ",
                                         static_cast<int>(type));
  }
}

// The buffers of one call: data pointers and shapes, inputs then results.
struct CallBuffers {
  std::vector<void*> data;
  std::vector<tf::TensorShape> shapes;
  std::vector<ffi::DataType> types;

  tf::Status Add(const ffi::AnyBuffer& buffer) {
    tf::TensorShape shape;
    const auto dims = buffer.dimensions();
    TF_RETURN_IF_ERROR(tf::TensorShape::BuildTensorShape(std::vector<int64_t>(dims.begin(), dims.end()), &shape));
    data.push_back(buffer.untyped_data());
    shapes.push_back(shape);
    types.push_back(buffer.element_type());
    return tf::Status();
  }
};

tf::Status ReadBuffers(const ffi::RemainingArgs& args, int num_args, const ffi::RemainingRets& rets, int num_rets,
                       CallBuffers* in, CallBuffers* out) {
  if (args.size() != static_cast<size_t>(num_args) || rets.size() != static_cast<size_t>(num_rets)) {
    return tf::errors::Internal("tf_flash FFI call with ", args.size(), " operands and ", rets.size(),
                                " results; expected ", num_args, " and ", num_rets);
  }
  for (int i = 0; i < num_args; ++i) {
    auto buffer = args.get<ffi::AnyBuffer>(i);
    if (!buffer.has_value()) return tf::errors::Internal("tf_flash FFI operand ", i, ": ", buffer.error().message());
    TF_RETURN_IF_ERROR(in->Add(*buffer));
  }
  for (int i = 0; i < num_rets; ++i) {
    auto buffer = rets.get<ffi::AnyBuffer>(i);
    if (!buffer.has_value()) return tf::errors::Internal("tf_flash FFI result ", i, ": ", buffer.error().message());
    TF_RETURN_IF_ERROR(out->Add(**buffer));
  }
  return tf::Status();
}

tf::Status ReadAttrs(const ffi::Dictionary& dict, FlashAttrs* attrs) {
#define TF_FLASH_FFI_GET(type, name)                                                                   \
  {                                                                                                   \
    auto value = dict.get<type>(#name);                                                               \
    if (!value.has_value()) {                                                                         \
      return tf::errors::Internal("tf_flash FFI attribute " #name ": ", value.error().message());     \
    }                                                                                                 \
    attrs->name = *value;                                                                             \
  }
  TF_FLASH_ATTRS(TF_FLASH_FFI_GET)
#undef TF_FLASH_FFI_GET
  return attrs->Validate();
}

// The forward's inputs among a call's operands.
FlashInputData DataAt(const std::vector<void*>& data, const int (&index)[kNumFwdInputs]) {
  FlashInputData out;
  for (int i = 0; i < kNumFwdInputs; ++i) out[i] = data[index[i]];
  return out;
}

// Everything of a call but the seed (which lives on the host or the device): validated params with
// every data pointer set, as the OpKernels build them.
struct ForwardCall {
  FlashFwdParams params;
  DType dtype;
  bool empty;
};

// What both forward targets share: attrs, the forward's inputs among the first num_args operands, output and lse
// as the first two of num_rets results (`out`: all of them).
tf::Status PrepareForwardCall(const ffi::Dictionary& dict, const ffi::RemainingArgs& args, int num_args,
                              const ffi::RemainingRets& rets, int num_rets, ForwardCall* call, CallBuffers* in,
                              CallBuffers* out, FlashInputShapes* shapes) {
  FlashAttrs attrs;
  TF_RETURN_IF_ERROR(ReadAttrs(dict, &attrs));
  TF_RETURN_IF_ERROR(ReadBuffers(args, num_args, rets, num_rets, in, out));
  *shapes = ShapesAt(in->shapes, kFwdInputs);
  FlashFwdParams& p = call->params;
  TF_RETURN_IF_ERROR(FillParams(attrs, *shapes, &p));
  SetInputPointers(*shapes, DataAt(in->data, kFwdInputs), &p);
  p.out = out->data[0];
  p.lse = static_cast<float*>(out->data[1]);
  call->empty = out->shapes[0].num_elements() == 0 && out->shapes[1].num_elements() == 0;
  return tf::Status();
}

// A third result of a forward call, the lowering's workspace (EmitForwardCall), as split-KV's runs, the packed
// attn_mask and fp8's V^T.
tf::Status SetWorkspaceResult(const CallBuffers& out, const FlashInputShapes& shapes, ForwardCall* call) {
  if (out.data.size() < 3) return tf::Status();
  FlashFwdParams& p = call->params;
  const FlashFwdCudaWorkspace workspace = FlashFwdCudaWorkspaceLayout(p, shapes, call->dtype);
  if (out.shapes[2].num_elements() < workspace.bytes) {
    return tf::errors::Internal("tf_flash: the workspace result holds ", out.shapes[2].num_elements(),
                                " bytes; the call needs ", workspace.bytes);
  }
  char* base = static_cast<char*>(out.data[2]);
  if (workspace.split_bytes > 0) p.split_workspace = base;
  if (workspace.mask_bytes > 0) p.mask_workspace = base + workspace.mask_offset;
  if (workspace.transpose_bytes > 0) p.value_transposed = base + workspace.transpose_offset;
  return tf::Status();
}

tf::Status PrepareForward(const ffi::Dictionary& dict, const ffi::RemainingArgs& args, const ffi::RemainingRets& rets,
                          ForwardCall* call, CallBuffers* in) {
  CallBuffers out;
  FlashInputShapes shapes;
  TF_RETURN_IF_ERROR(
      PrepareForwardCall(dict, args, kNumFwdInputs, rets, rets.size() == 3 ? 3 : 2, call, in, &out, &shapes));
  TF_RETURN_IF_ERROR(ToDType(in->types[0], &call->dtype));
  return SetWorkspaceResult(out, shapes, call);
}

// The fp8 forward's call: the forward's operands, then the descales; results output (bfloat16 or float16), lse
// and the workspace where it has one.
tf::Status PrepareForwardFp8(const ffi::Dictionary& dict, const ffi::RemainingArgs& args,
                             const ffi::RemainingRets& rets, ForwardCall* call, CallBuffers* in) {
  CallBuffers out;
  FlashInputShapes shapes;
  TF_RETURN_IF_ERROR(
      PrepareForwardCall(dict, args, kNumFp8Inputs, rets, rets.size() == 3 ? 3 : 2, call, in, &out, &shapes));
  if (in->types[0] != ffi::DataType::F8E4M3FN ||
      (out.types[0] != ffi::DataType::BF16 && out.types[0] != ffi::DataType::F16)) {
    return tf::errors::Internal("tf_flash: the fp8 forward's call has query of XLA type ",
                                static_cast<int>(in->types[0]), " and output of XLA type ",
                                static_cast<int>(out.types[0]));
  }
  FlashFwdParams& p = call->params;
  const auto& d = in->data;
  TF_RETURN_IF_ERROR(CheckDescaleShapes(p, in->shapes[kNumFwdInputs], in->shapes[kNumFwdInputs + 1],
                                        in->shapes[kNumFwdInputs + 2], &p));
  p.q_descale = static_cast<const float*>(d[kNumFwdInputs]);
  p.k_descale = static_cast<const float*>(d[kNumFwdInputs + 1]);
  p.v_descale = static_cast<const float*>(d[kNumFwdInputs + 2]);
  p.out_float16 = out.types[0] == ffi::DataType::F16;
  call->dtype = DType::kFloat8E4M3;
  return SetWorkspaceResult(out, shapes, call);
}

struct BackwardCall {
  FlashBwdParams params;
  DType dtype;
  bool empty;
};

tf::Status PrepareBackward(const ffi::Dictionary& dict, const ffi::RemainingArgs& args,
                           const ffi::RemainingRets& rets, BackwardCall* call, CallBuffers* in) {
  FlashAttrs attrs;
  TF_RETURN_IF_ERROR(ReadAttrs(dict, &attrs));
  CallBuffers out;
  TF_RETURN_IF_ERROR(ReadBuffers(args, kNumBwdInputs, rets, 3, in, &out));
  const FlashInputShapes shapes = ShapesAt(in->shapes, kBwdForwardInputs);
  FlashBwdParams& p = call->params;
  TF_RETURN_IF_ERROR(FillParams(attrs, shapes, &p));
  TF_RETURN_IF_ERROR(CheckGradShapes(shapes, in->shapes[0], in->shapes[4], in->shapes[5], in->shapes[6]));
  TF_RETURN_IF_ERROR(ToDType(in->types[1], &call->dtype));
  const auto& d = in->data;
  SetInputPointers(shapes, DataAt(d, kBwdForwardInputs), &p);
  p.d_out = d[0];
  p.out = d[4];
  p.lse = static_cast<float*>(d[5]);
  p.d_lse = static_cast<const float*>(d[6]);
  p.d_q = out.data[0];
  p.d_k = out.data[1];
  p.d_v = out.data[2];
  call->empty = shapes.q.num_elements() == 0 && shapes.k.num_elements() == 0 && shapes.v.num_elements() == 0;
  return tf::Status();
}

void SetSeed(const int64_t* seed, FlashFwdParams* p) {
  p->seed = static_cast<uint64_t>(seed[0]);
  p->seed_offset = static_cast<uint64_t>(seed[1]);
}

// ---- Host ----

// ParallelFor on XLA's intra-op thread pool. The caller and up to num_threads - 1 pool tasks claim
// shards from a shared counter; the caller waits only for shards already claimed, so it never waits on a
// task that has not started (the pool may be busy, or be the caller's own). Tasks that start after the
// work is done find nothing to claim; the shared state outlives them.
ParallelFor PoolParallelFor(ffi::ThreadPool* pool, int num_threads) {
  return [pool, num_threads](int64_t total, int64_t /*cost*/, const std::function<void(int64_t, int64_t)>& work) {
    if (total <= 0) return;
    const int64_t shards = std::min<int64_t>(total, num_threads <= 1 ? 1 : 4 * int64_t{num_threads});
    if (shards == 1) return work(0, total);
    const int64_t per_shard = (total + shards - 1) / shards;
    struct State {
      std::atomic<int64_t> next{0};
      std::mutex mutex;
      std::condition_variable all_done;
      int64_t done = 0;
    };
    auto state = std::make_shared<State>();
    // `work` is only touched while a shard is claimed, i.e. before the caller returns.
    auto run = [state, shards, per_shard, total, work_ptr = &work] {
      for (int64_t shard; (shard = state->next.fetch_add(1)) < shards;) {
        (*work_ptr)(shard * per_shard, std::min(total, (shard + 1) * per_shard));
        std::lock_guard<std::mutex> lock(state->mutex);
        if (++state->done == shards) state->all_done.notify_all();
      }
    };
    for (int i = 1; i < std::min<int64_t>(num_threads, shards); ++i) pool->Schedule(decltype(run)(run));
    run();
    std::unique_lock<std::mutex> lock(state->mutex);
    state->all_done.wait(lock, [&] { return state->done == shards; });
  };
}

ffi::Error FlashFwdHost(ffi::ThreadPool pool, ffi::RemainingArgs args, ffi::RemainingRets rets,
                        ffi::Dictionary attrs) {
  ForwardCall call;
  CallBuffers in;
  tf::Status status = PrepareForward(attrs, args, rets, &call, &in);
  if (status.ok()) status = CheckLengthValues(call.params);
  if (!status.ok() || call.empty) return ToFfiError(status);
  SetSeed(static_cast<const int64_t*>(in.data[kFwdInputs[kSeedInput]]), &call.params);
  const int num_threads = static_cast<int>(std::max<int64_t>(pool.num_threads(), 1));
  return ToFfiError(RunFlashFwdCpu(call.params, call.dtype, PoolParallelFor(&pool, num_threads)));
}

ffi::Error FlashBwdHost(ffi::ThreadPool pool, ffi::RemainingArgs args, ffi::RemainingRets rets,
                        ffi::Dictionary attrs) {
  BackwardCall call;
  CallBuffers in;
  tf::Status status = PrepareBackward(attrs, args, rets, &call, &in);
  if (status.ok()) status = CheckLengthValues(call.params);
  if (!status.ok() || call.empty) return ToFfiError(status);
  SetSeed(static_cast<const int64_t*>(in.data[kBwdForwardInputs[kSeedInput]]), &call.params);
  const int num_threads = static_cast<int>(std::max<int64_t>(pool.num_threads(), 1));
  std::vector<std::unique_ptr<char[]>> held;
  const FlashAllocate allocate = [&held](int64_t bytes, void** ptr) {
    // new[] of char is aligned for any fundamental type (the scratch holds floats).
    held.emplace_back(new char[std::max<int64_t>(bytes, 1)]);
    *ptr = held.back().get();
    return tf::Status();
  };
  return ToFfiError(RunFlashBwdCpu(call.params, call.dtype, num_threads, PoolParallelFor(&pool, num_threads),
                                   allocate));
}

// The fp8 forward on the CPU: the CPU OpKernel's refusal, after the same checks.
ffi::Error FlashFwdFp8Host(ffi::RemainingArgs args, ffi::RemainingRets rets, ffi::Dictionary attrs) {
  ForwardCall call;
  CallBuffers in;
  const tf::Status status = PrepareForwardFp8(attrs, args, rets, &call, &in);
  return ToFfiError(status.ok() ? Fp8NeedsHopperGpu("XLA's CPU platform") : status);
}

XLA_FFI_DEFINE_HANDLER(kFlashFwdHost, FlashFwdHost,
                       ffi::Ffi::Bind()
                           .Ctx<ffi::ThreadPool>()
                           .RemainingArgs()
                           .RemainingRets()
                           .Attrs<ffi::Dictionary>());
XLA_FFI_DEFINE_HANDLER(kFlashBwdHost, FlashBwdHost,
                       ffi::Ffi::Bind()
                           .Ctx<ffi::ThreadPool>()
                           .RemainingArgs()
                           .RemainingRets()
                           .Attrs<ffi::Dictionary>());
XLA_FFI_REGISTER_HANDLER(XLA_FFI_GetApi(), kFwdTarget, "Host", kFlashFwdHost);
XLA_FFI_REGISTER_HANDLER(XLA_FFI_GetApi(), kFwdGraphTarget, "Host", kFlashFwdHost);
XLA_FFI_DEFINE_HANDLER(kFlashFwdFp8Host, FlashFwdFp8Host,
                       ffi::Ffi::Bind().RemainingArgs().RemainingRets().Attrs<ffi::Dictionary>());
XLA_FFI_REGISTER_HANDLER(XLA_FFI_GetApi(), kBwdTarget, "Host", kFlashBwdHost);
XLA_FFI_REGISTER_HANDLER(XLA_FFI_GetApi(), kFwdFp8Target, "Host", kFlashFwdFp8Host);
XLA_FFI_REGISTER_HANDLER(XLA_FFI_GetApi(), kFwdFp8GraphTarget, "Host", kFlashFwdFp8Host);

// ---- CUDA ----
#if TF_FLASH_WITH_CUDA

// Scratch and staging memory from XLA's allocator, valid until the handler's work on the stream ends.
FlashAllocate XlaScratch(ffi::ScratchAllocator* scratch) {
  return [scratch](int64_t bytes, void** ptr) {
    // XLA's FFI refuses alignments above 16 ("Unsupported alignment"); its device allocator (TF's BFC
    // allocator) hands out 256-byte aligned blocks anyway, which the kernels' vector loads need.
    std::optional<void*> memory = scratch->Allocate(static_cast<size_t>(std::max<int64_t>(bytes, 1)), 16);
    if (!memory.has_value()) {
      return tf::errors::ResourceExhausted("tf_flash: XLA's scratch allocator could not provide ", bytes, " bytes");
    }
    *ptr = *memory;
    return tf::Status();
  };
}

// The seed is an XLA operand in device memory: the kernels read it there (params.seed_device), so the
// call never waits for the stream.
void SetDeviceSeed(const void* seed, FlashFwdParams* p) { p->seed_device = static_cast<const int64_t*>(seed); }

using PrepareForwardFn = tf::Status (*)(const ffi::Dictionary&, const ffi::RemainingArgs&, const ffi::RemainingRets&,
                                         ForwardCall*, CallBuffers*);

// Every forward target's handler (16-bit or fp8, as `prepare` reads the call): the call on `stream`, its memory
// from `allocate`.
ffi::Error RunForwardOnStream(PrepareForwardFn prepare, cudaStream_t stream, const ffi::RemainingArgs& args,
                              const ffi::RemainingRets& rets, const ffi::Dictionary& attrs,
                              const FlashAllocate& allocate) {
  ForwardCall call;
  CallBuffers in;
  const tf::Status status = prepare(attrs, args, rets, &call, &in);
  if (!status.ok() || call.empty) return ToFfiError(status);
  SetDeviceSeed(in.data[kFwdInputs[kSeedInput]], &call.params);
  return ToFfiError(call.dtype == DType::kFloat8E4M3 ? RunFlashFwdCudaFp8(call.params, stream, allocate)
                                                     : RunFlashFwdCuda(call.params, call.dtype, stream, allocate));
}

ffi::Error FlashFwdCuda(cudaStream_t stream, ffi::ScratchAllocator scratch, ffi::RemainingArgs args,
                        ffi::RemainingRets rets, ffi::Dictionary attrs) {
  return RunForwardOnStream(PrepareForward, stream, args, rets, attrs, XlaScratch(&scratch));
}

// The graph targets' allocator: none, since a CUDA graph would replay its memory after the allocator took it
// back. The lowering sends only calls that allocate nothing there; one that asks is refused, not run.
tf::Status NoScratch(int64_t bytes, void**) {
  return tf::errors::Internal("tf_flash: the forward lowered for XLA's CUDA graphs asked for ", bytes,
                              " bytes of scratch memory (FlashFwdCudaNeedsScratch is out of date)");
}

ffi::Error FlashFwdCudaGraph(cudaStream_t stream, ffi::RemainingArgs args, ffi::RemainingRets rets,
                             ffi::Dictionary attrs) {
  return RunForwardOnStream(PrepareForward, stream, args, rets, attrs, NoScratch);
}

ffi::Error FlashFwdFp8Cuda(cudaStream_t stream, ffi::ScratchAllocator scratch, ffi::RemainingArgs args,
                           ffi::RemainingRets rets, ffi::Dictionary attrs) {
  return RunForwardOnStream(PrepareForwardFp8, stream, args, rets, attrs, XlaScratch(&scratch));
}

ffi::Error FlashFwdFp8CudaGraph(cudaStream_t stream, ffi::RemainingArgs args, ffi::RemainingRets rets,
                                ffi::Dictionary attrs) {
  return RunForwardOnStream(PrepareForwardFp8, stream, args, rets, attrs, NoScratch);
}

ffi::Error FlashBwdCuda(cudaStream_t stream, ffi::ScratchAllocator scratch, ffi::RemainingArgs args,
                        ffi::RemainingRets rets, ffi::Dictionary attrs) {
  BackwardCall call;
  CallBuffers in;
  tf::Status status = PrepareBackward(attrs, args, rets, &call, &in);
  if (!status.ok() || call.empty) return ToFfiError(status);
  SetDeviceSeed(in.data[kBwdForwardInputs[kSeedInput]], &call.params);
  status = RunFlashBwdCuda(call.params, call.dtype, stream, XlaScratch(&scratch));
  return ToFfiError(status);
}

// The CUDA handlers' two signatures: the stream and XLA's scratch allocator, or (the graph targets) the stream
// alone; then the operands, the results and the attributes.
auto BindWithScratch() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()
      .Ctx<ffi::ScratchAllocator>()
      .RemainingArgs()
      .RemainingRets()
      .Attrs<ffi::Dictionary>();
}
auto BindForGraphs() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()
      .RemainingArgs()
      .RemainingRets()
      .Attrs<ffi::Dictionary>();
}

XLA_FFI_DEFINE_HANDLER(kFlashFwdCuda, FlashFwdCuda, BindWithScratch());
XLA_FFI_DEFINE_HANDLER(kFlashFwdCudaGraph, FlashFwdCudaGraph, BindForGraphs());
XLA_FFI_DEFINE_HANDLER(kFlashBwdCuda, FlashBwdCuda, BindWithScratch());
XLA_FFI_DEFINE_HANDLER(kFlashFwdFp8Cuda, FlashFwdFp8Cuda, BindWithScratch());
XLA_FFI_DEFINE_HANDLER(kFlashFwdFp8CudaGraph, FlashFwdFp8CudaGraph, BindForGraphs());
XLA_FFI_REGISTER_HANDLER(XLA_FFI_GetApi(), kFwdTarget, "CUDA", kFlashFwdCuda);
XLA_FFI_REGISTER_HANDLER(XLA_FFI_GetApi(), kFwdFp8Target, "CUDA", kFlashFwdFp8Cuda);
XLA_FFI_REGISTER_HANDLER(XLA_FFI_GetApi(), kFwdGraphTarget, "CUDA", kFlashFwdCudaGraph,
                         XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE);
XLA_FFI_REGISTER_HANDLER(XLA_FFI_GetApi(), kFwdFp8GraphTarget, "CUDA", kFlashFwdFp8CudaGraph,
                         XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE);
XLA_FFI_REGISTER_HANDLER(XLA_FFI_GetApi(), kBwdTarget, "CUDA", kFlashBwdCuda);
#endif  // TF_FLASH_WITH_CUDA

}  // namespace
}  // namespace tf_flash
