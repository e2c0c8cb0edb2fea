"""float32 keeps float32's range on every device (issue 16, item 2).

The GPU computes float32 on float16 tensor-core operands, each input scaled by a power of two the device
chooses from its largest magnitude (cc/kernels/flash/launch.h): TF32's 10-bit mantissa at float32's
range. Inputs and gradients far outside float16's range (1e-8 .. 1e5, and Q and K of unequal size) stay
finite and as accurate as at unit scale, in both front doors (the op, and XLA's custom call), against the
float64 reference. The CPU computes float32 exactly and runs the same cases.
"""
import warnings
import zlib

import numpy as np
import pytest
import tensorflow as tf

import tf_flash
from device_util import gpu_float32_bound_dtype, on_device
from reference import reference_attention, reference_attention_grad

DEVICES = ["/CPU:0", pytest.param("/GPU:0", marks=pytest.mark.gpu)]

# Magnitudes of (Q, K, V, dO, d_lse): all far below float16's smallest normal, values and output gradients
# above its largest, Q and K of unequal size (logits of order one), both small (dQ and dK of 1e-6 relative
# to the others), values and output gradients at opposite ends, and a gradient into lse that outweighs
# the one through the output.
MAGNITUDES = {
    "all_1e-8": (1e-8, 1e-8, 1e-8, 1e-8, 1e-8),
    "v_dout_1e5": (1.0, 1.0, 1e5, 1e5, 1e3),
    "q_1e4_k_1e-4": (1e4, 1e-4, 1.0, 1.0, 1.0),
    "qk_1e-6": (1e-6, 1e-6, 1.0, 1.0, 1.0),
    "v_1e-7_dout_3e4": (0.5, 2.0, 1e-7, 3e4, 1e2),
    "dlse_1e4_dout_1e-6": (1.0, 1.0, 1.0, 1e-6, 1e4),
}
# (batch, seqlen_q, seqlen_k, heads, heads_kv, head_dim, head_dim_v) and the features that move the
# scales' path: sequence lengths off the tiles, GQA, padded head dims, Dv != D, causal, soft-capping.
SHAPES = {
    "plain": ((2, 77, 90, 4, 4, 64, 64), {}),
    "causal_gqa": ((1, 130, 130, 4, 2, 40, 24), {"causal": True}),
    "softcap": ((2, 65, 70, 2, 2, 128, 128), {"softcap": 20.0}),
}
# Relative error vs float64, (output, gradients): the bounds of the dtype the device computes float32 at.
BOUNDS = {"float32": (1e-5, 1e-4), "float16": (4e-3, 1.5e-2)}


def _rel_err(x, ref):
    x = np.asarray(x, np.float64)
    return np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-300)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["eager", "xla"])
@pytest.mark.parametrize("shape_name", list(SHAPES))
@pytest.mark.parametrize("magnitudes", list(MAGNITUDES))
def test_float32_far_from_float16_range(device, mode, shape_name, magnitudes):
    (b, sq, sk, h, hkv, d, dv), features = SHAPES[shape_name]
    rng = np.random.default_rng(zlib.crc32(f"{shape_name}/{magnitudes}".encode()))
    sizes = MAGNITUDES[magnitudes]
    shapes = ((b, sq, h, d), (b, sk, hkv, d), (b, sk, hkv, dv), (b, sq, h, dv), (b, h, sq))
    q, k, v, dout, dlse = (rng.standard_normal(s) * m for s, m in zip(shapes, sizes))
    q, k, v, dout, dlse = (x.astype(np.float32) for x in (q, k, v, dout, dlse))  # the reference's inputs too

    def run(q, k, v, dout, dlse):
        with tf.GradientTape() as tape:
            tape.watch([q, k, v])
            out, lse = tf_flash.flash_attention(q, k, v, return_lse=True, **features)
            loss = tf.reduce_sum(out * dout) + tf.reduce_sum(lse * dlse)
        return (out, *tape.gradient(loss, [q, k, v]))

    fn = run if mode == "eager" else tf.function(run, jit_compile=True)
    with on_device(device, batch=b, heads=h, head_dim=d, head_dim_v=dv):
        got = [np.asarray(x.numpy(), np.float64) for x in fn(*(tf.constant(x) for x in (q, k, v, dout, dlse)))]

    ref_out, _ = reference_attention(q, k, v, **features)
    refs = (ref_out, *reference_attention_grad(q, k, v, dout, d_lse=dlse, **features))
    bound_dtype = gpu_float32_bound_dtype() if "GPU" in device else "float32"
    out_bound, grad_bound = BOUNDS[bound_dtype]
    for name, x, ref, bound in zip(("out", "dq", "dk", "dv"), got, refs, (out_bound,) + (grad_bound,) * 3):
        assert np.isfinite(x).all(), f"{name}: non-finite entries where the reference is finite"
        assert _rel_err(x, ref) < bound, f"{name}: relative error {_rel_err(x, ref):.3g} (bound {bound})"


@pytest.fixture
def tf32_off():
    was = tf.config.experimental.tensor_float_32_execution_enabled()
    tf.config.experimental.enable_tensor_float_32_execution(False)
    yield
    tf.config.experimental.enable_tensor_float_32_execution(was)


@pytest.mark.parametrize("case", ["float32_warns", "placed_on_cpu", "bfloat16", "tf32_on"])
def test_tf32_off_on_a_gpu_machine_warns_once(monkeypatch, tf32_off, case):
    # The GPU computes float32 at TF32 grade also when TF's TF32 switch is off (no full-float32 GPU kernel
    # yet): a user who turned it off is told, once, instead of silently getting less. Simulated GPU machine.
    from tf_flash import ops
    listed = tf.config.list_physical_devices
    monkeypatch.setattr(tf.config, "list_physical_devices",
                        lambda kind=None: ["gpu"] if kind == "GPU" else listed(kind))
    monkeypatch.setattr(ops, "_warned_gpu_float32", False)
    if case == "tf32_on":
        tf.config.experimental.enable_tensor_float_32_execution(True)
    dtype = tf.bfloat16 if case == "bfloat16" else tf.float32
    q = tf.cast(tf.random.stateless_normal((1, 8, 1, 16), seed=[1, 2]), dtype)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with tf.device("/CPU:0" if case == "placed_on_cpu" else None):  # None: TF places it (the GPU)
            for _ in range(2):
                tf_flash.flash_attention(q, q, q)
    told = [w for w in caught if issubclass(w.category, RuntimeWarning) and "TF32" in str(w.message)]
    assert len(told) == (1 if case == "float32_warns" else 0), [str(w.message) for w in caught]
