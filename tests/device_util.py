"""What the op tests share: the device list, the dtypes, random inputs, the tolerance table, and what the GPU
declares unsupported.

"Not supported on the GPU" is a declared list (GPU_UNSUPPORTED below, read from
cc/kernels/cuda/cuda_entry.cu and flash_bwd_api.cu), never inferred from an error: a test names its
configuration, `gpu_unsupported` says whether the list covers it (the test then skips), and any other
"tf_flash GPU kernel: ..." refusal fails the test. test_flash_attention.py checks both directions: every
declared entry is refused, and every other configuration runs.
"""
import contextlib

import numpy as np
import pytest
import tensorflow as tf

import tf_flash
from reference import reference_attention, reference_attention_grad, relative_error

# The devices an op test runs on: `@pytest.mark.parametrize("device", DEVICES)`; the GPU's only where
# TensorFlow sees one (the `gpu` marker, conftest.py).
DEVICES = [pytest.param("/CPU:0", id="cpu"), pytest.param("/GPU:0", id="gpu", marks=pytest.mark.gpu)]
DTYPES = {"float32": tf.float32, "float16": tf.float16, "bfloat16": tf.bfloat16}


def native_dtype(device):
    """The dtype a test runs in when it is about something else than precision: float32 on the CPU, float16
    on the GPU (its tensor-core kernels' own)."""
    return tf.float16 if _is_gpu(device) else tf.float32


def normal(rng, shape, dtype=tf.float32):
    """Standard normal values of `shape`, drawn in float32 and rounded to `dtype`."""
    return tf.cast(rng.standard_normal(shape).astype(np.float32), dtype)


def random_qkv(rng, batch, seqlen_q, seqlen_k, heads, heads_kv, head_dim, head_dim_v=None, dtype=tf.float32):
    """query [B, Sq, H, D], key [B, Sk, Hkv, D] and value [B, Sk, Hkv, Dv] (Dv default D): `normal`."""
    return (normal(rng, (batch, seqlen_q, heads, head_dim), dtype),
            normal(rng, (batch, seqlen_k, heads_kv, head_dim), dtype),
            normal(rng, (batch, seqlen_k, heads_kv, head_dim_v or head_dim), dtype))


def _round8(dim):
    return (dim + 7) // 8 * 8


def _reduced_build():
    return tf_flash.build_info().get("cuda_reduced") == "1"


def _shared_kib_per_block():
    """Shared memory a block may take on GPU 0, KiB, by compute capability (Hopper's when unknown)."""
    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        return 227
    capability = tf.config.experimental.get_device_details(gpus[0]).get("compute_capability")
    return {(8, 0): 163, (8, 7): 163, (8, 6): 99, (8, 9): 99, (12, 0): 99}.get(capability, 227)


# The full-float32 kernels' shared memory per block by head dim bucket, (forward, backward) in KiB
# (cc/kernels/cuda/float32_kernels.cu: fwd_smem_bytes, bwd_smem_bytes).
_FULL_FLOAT32_KIB = {64: (68, 86), 128: (75, 109), 256: (102, 135)}


def _full_float32_too_large(c):
    if c.get("dtype") != "float32" or tf.config.experimental.tensor_float_32_execution_enabled():
        return False
    dim = max(c.get("head_dim", 0), c.get("head_dim_v", 0))
    bucket = 64 if dim <= 64 else 128 if dim <= 128 else 256
    return _FULL_FLOAT32_KIB[bucket][1] > _shared_kib_per_block()  # the tests run the backward too


# (name, predicate(config) -> bool). config keys: head_dim, head_dim_v, heads, batch, scale, dtype (a name;
# any may be missing: a missing key never matches). The CUDA build stages float32 and head dims that are not
# multiples of 8 (zero-padded), so neither is on the list.
GPU_UNSUPPORTED = [
    # TF_FLASH_CUDA_REDUCED builds (cuda_reduced=1 in build_info) compile head dims 64 and 128 only.
    ("reduced build: head dims above 128",
     lambda c: _reduced_build() and max(_round8(c.get("head_dim", 0)), _round8(c.get("head_dim_v", 0))) > 128),
    # The forward grid puts heads and batch on the y/z axes of the launch (at most 65535 each).
    ("more than 65535 heads or batch entries",
     lambda c: c.get("heads", 0) > 65535 or c.get("batch", 0) > 65535),
    # float32 with TF's TF32 switch off (config key dtype) on GPUs with 99 KiB a block (sm_86, sm_89,
    # sm_120) above head dim 64: support.cu's shared-memory check. Never matches on the lent H100s, so
    # written from the kernels' sizes, not run.
    ("full float32: more shared memory per block than this GPU gives", _full_float32_too_large),
]


def gpu_unsupported(**config):
    """The name of the GPU_UNSUPPORTED entry that covers `config`, or None."""
    for name, covers in GPU_UNSUPPORTED:
        if covers(config):
            return name
    return None


def _is_gpu(device):
    return "GPU" in str(device).upper()


@contextlib.contextmanager
def on_device(device, **config):
    """tf.device(device). On the GPU, a `config` (head_dim=..., head_dim_v=..., heads=..., batch=...,
    scale=...) that GPU_UNSUPPORTED covers skips the test before anything runs; a GPU refusal of any
    other configuration fails it, saying that the refusal is not declared."""
    if _is_gpu(device):
        reason = gpu_unsupported(**config)
        if reason is not None:
            pytest.skip(f"declared unsupported on the GPU: {reason}")
    with tf.device(device):
        try:
            yield
        except tf.errors.InvalidArgumentError as err:
            if _is_gpu(device) and "GPU kernel" in str(err):
                pytest.fail("the GPU refused a configuration that tests/device_util.py GPU_UNSUPPORTED does not "
                            f"declare unsupported ({config or 'no configuration given'}): {str(err)[:400]}")
            raise


def run_flash(query, key, value, device, use_function=False, dout=None, **kwargs):
    """tf_flash.flash_attention(query, key, value, **kwargs) on `device` (on_device, configured by the inputs),
    eagerly or in a tf.function, with the gradients of sum(out * dout) when `dout` is given. Returns NumPy
    [out, lse, rng_state, dq, dk, dv]: rng_state, the op's (seed, offset), only from a tf.function (its
    outputs are reachable there); the gradients only with dout; None otherwise."""
    def fn():
        with tf.GradientTape() as tape:
            tape.watch([query, key, value])
            out, lse = tf_flash.flash_attention(query, key, value, return_lse=True, **kwargs)
            loss = None if dout is None else tf.reduce_sum(tf.cast(out, tf.float32) * dout)
        rng_state = out.op.outputs[2] if use_function else None
        grads = [None] * 3 if dout is None else tape.gradient(loss, [query, key, value])
        return out, lse, rng_state, *grads

    config = dict(batch=query.shape[0], heads=query.shape[2], head_dim=query.shape[3], head_dim_v=value.shape[3],
                  dtype=query.dtype.name)
    with on_device(device, **config):
        result = tf.function(fn)() if use_function else fn()
    return [None if x is None else x.numpy() for x in result]


def run_with_gradients(attention, query, key, value, d_out, mode="eager", **kwargs):
    """attention(query, key, value, return_lse=True, **kwargs) with the gradients of sum(out * d_out), eagerly,
    in a tf.function ("tf.function") or under XLA ("xla"): NumPy [out, lse, dq, dk, dv]."""
    def fn():
        with tf.GradientTape() as tape:
            tape.watch([query, key, value])
            out, lse = attention(query, key, value, return_lse=True, **kwargs)
            loss = tf.reduce_sum(tf.cast(out, tf.float32) * tf.cast(d_out, tf.float32))
        return (out, lse, *tape.gradient(loss, [query, key, value]))
    if mode != "eager":
        fn = tf.function(fn, jit_compile=mode == "xla")
    return [t.numpy() for t in fn()]


def check_against_reference(result, q, k, v, d_out, dtype, device, **kwargs):
    """[out, lse, dq, dk, dv] of run_with_gradients against the float64 reference of the same call: output,
    lse (where finite, and finite exactly where the reference's is), zeros in rows that see no key, and the
    gradients, each within its TOLERANCE for `dtype` on `device`."""
    out, lse, *grads = result
    ref_out, ref_lse = reference_attention(q, k, v, **kwargs)
    assert relative_error(out, ref_out) < tolerance("output", dtype, device)
    np.testing.assert_array_equal(np.isfinite(lse), np.isfinite(ref_lse))
    finite = np.isfinite(ref_lse)
    assert np.max(np.abs(lse[finite] - ref_lse[finite]), initial=0.0) < tolerance("lse", dtype, device)
    np.testing.assert_array_equal(out[~np.isfinite(lse).transpose(0, 2, 1)], 0)  # rows that see nothing: 0
    for got, ref in zip(grads, reference_attention_grad(q, k, v, d_out, **kwargs)):
        assert relative_error(got, ref) < tolerance("gradient", dtype, device)


# float32 on the GPU: while TF's TF32 switch is on, the CUDA build computes it on float16 operands scaled
# by powers of two (build_info()["gpu_float32_compute"] == "float16_scaled": TF32's 10-bit mantissa at
# float32's range, cc/kernels/flash/launch.h), held to the float16 bounds (test_float32_range.py holds its
# range); with the switch off, on the full-float32 kernels, held to float32's. This is the one place that
# says so: map a compute name to the bound table it earns. TF_FLASH_TEST_TF32=0 runs a whole suite with the
# switch off (conftest.py).
GPU_FLOAT32_BOUNDS_OF = {"float16_scaled": "float16", "float32": "float32"}


def gpu_float32_bound_dtype():
    """The dtype whose tolerances GPU float32 results are held to: "float16" while TF32 is on, "float32"
    with TF's TF32 switch off (see above): build_info() reads the switch when asked."""
    return GPU_FLOAT32_BOUNDS_OF[tf_flash.build_info().get("gpu_float32_compute", "float32")]


# Error bounds against the float64 reference (tests/reference.py), by measure and input dtype. float32
# accumulates like the reference; in half precision the inputs themselves are rounded, so the bounds scale
# with the dtype's epsilon. float32 on the GPU is held to the bound of gpu_float32_bound_dtype() (float16's
# while TF32 is on), or to its "gpu_float32" entry where the rounding of float32 inputs to float16 operands
# moves a result further (float16 inputs carry no such rounding).
TOLERANCE = {
    # relative_error: the norm of the error over the norm of the reference.
    "output": {"float32": 1e-5, "float16": 4e-3, "bfloat16": 3e-2},
    "gradient": {"float32": 1e-4, "float16": 1.5e-2, "bfloat16": 8e-2},
    # max_error: the largest error over max(1, largest reference value).
    "max_output": {"float32": 2e-5, "float16": 5e-3, "bfloat16": 4e-2},
    "max_gradient": {"float32": 1e-4, "float16": 2e-2, "bfloat16": 1.5e-1},
    # The largest absolute error of lse (float32 on float16 operands: up to 2e-3 measured on the H100).
    "lse": {"float32": 2e-5, "float16": 2e-3, "bfloat16": 2e-3, "gpu_float32": 4e-3},
    # lse where the scores reach a soft cap's size (tests/test_softcap.py): the rounding of the inputs moves
    # it further (float32 on float16 operands: 4.7e-3 measured on the H100).
    "softcapped_lse": {"float32": 2e-5, "float16": 2e-3, "bfloat16": 2e-2, "gpu_float32": 1e-2},
    # The kept entries of a dropout mask read through the output (relative).
    "kept_value": {"float32": 1e-5, "float16": 2e-3, "bfloat16": 2e-2},
    # XLA against the op without XLA (max_error): the same kernels; only the CPU backward's split over
    # threads may differ.
    "same_kernels": {"float32": 2e-6, "float16": 2e-3, "bfloat16": 1.6e-2},
}


def tolerance(measure, dtype, device="/CPU:0"):
    """TOLERANCE[measure] for inputs of `dtype` (a name or a tf.DType) computed on `device`."""
    bounds, name = TOLERANCE[measure], tf.as_dtype(dtype).name
    if name == "float32" and _is_gpu(device) and gpu_float32_bound_dtype() == "float16":
        return bounds.get("gpu_float32", bounds["float16"])
    return bounds[name]


# Float16-grade results carry about 2^-11 relative error where float32 carries 2^-24; 100x covers a
# float32 tolerance written for the CPU (a few ulps of accumulated rounding) at float16 grade.
FLOAT16_GRADE_FACTOR = 100


def float32_tolerance(device, tol):
    """`tol`, a float32 tolerance, as it applies on `device`: widened by FLOAT16_GRADE_FACTOR on a GPU
    whose float32 is computed on float16 operands (gpu_float32_bound_dtype() == "float16")."""
    if _is_gpu(device) and gpu_float32_bound_dtype() == "float16":
        return tol * FLOAT16_GRADE_FACTOR
    return tol
