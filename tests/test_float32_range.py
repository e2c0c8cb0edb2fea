"""float32 keeps float32's range on every device, and its precision where TF's TF32 switch asks (issue 16,
item 2).

While TF32 is on, the GPU computes float32 on float16 tensor-core operands, each input scaled by a power of
two the device chooses from its largest magnitude (cc/kernels/flash/launch.h): TF32's 10-bit mantissa at
float32's range. With `tf.config.experimental.enable_tensor_float_32_execution(False)` it runs the
full-float32 kernels (cc/kernels/cuda/float32_kernels.cu) and is held to float32's bounds. Inputs and
gradients far outside float16's range (1e-8 .. 1e5, and Q and K of unequal size) stay finite and as
accurate as at unit scale, in both front doors (the op, and XLA's custom call), against the float64
reference. The CPU computes float32 exactly and runs the same cases.
"""
import contextlib
import zlib

import numpy as np
import pytest
import tensorflow as tf

import tf_flash
from device_util import on_device, tolerance
from reference import reference_attention, reference_attention_grad, relative_error

# (device, TF's TF32 switch): the CPU computes float32 exactly either way; the GPU has a kernel for each.
DEVICE_TF32 = [pytest.param("/CPU:0", True, id="CPU"),
               pytest.param("/GPU:0", True, marks=pytest.mark.gpu, id="GPU-tf32"),
               pytest.param("/GPU:0", False, marks=pytest.mark.gpu, id="GPU-full-float32")]

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


@contextlib.contextmanager
def tf32_switch(enabled):
    was = tf.config.experimental.tensor_float_32_execution_enabled()
    tf.config.experimental.enable_tensor_float_32_execution(enabled)
    try:
        yield
    finally:
        tf.config.experimental.enable_tensor_float_32_execution(was)


@pytest.mark.parametrize("device,tf32", DEVICE_TF32)
@pytest.mark.parametrize("mode", ["eager", "xla"])
@pytest.mark.parametrize("shape_name", list(SHAPES))
@pytest.mark.parametrize("magnitudes", list(MAGNITUDES))
def test_float32_far_from_float16_range(device, tf32, mode, shape_name, magnitudes):
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
    with tf32_switch(tf32), on_device(device, batch=b, heads=h, head_dim=d, head_dim_v=dv):
        before = tf_flash.cuda_kernel_counts()
        got = [np.asarray(x.numpy(), np.float64) for x in fn(*(tf.constant(x) for x in (q, k, v, dout, dlse)))]
        ran = {name: n - before[name] for name, n in tf_flash.cuda_kernel_counts().items()}
        # The bounds of the precision this device computes float32 at, under this TF32 switch.
        out_bound, grad_bound = tolerance("output", tf.float32, device), tolerance("gradient", tf.float32, device)
    if "GPU" in device:  # which kernels ran: the full-float32 ones exactly when TF32 is off
        full = ran["forward_float32"] > 0 and ran["backward_float32"] > 0
        assert full == (not tf32), ran

    ref_out, _ = reference_attention(q, k, v, **features)
    refs = (ref_out, *reference_attention_grad(q, k, v, dout, d_lse=dlse, **features))
    for name, x, ref, bound in zip(("out", "dq", "dk", "dv"), got, refs, (out_bound,) + (grad_bound,) * 3):
        assert np.isfinite(x).all(), f"{name}: non-finite entries where the reference is finite"
        error = relative_error(x, ref, floor=1e-300)
        assert error < bound, f"{name}: relative error {error:.3g} (bound {bound})"


@pytest.mark.gpu
def test_full_float32_gradients_are_bit_identical_across_runs():
    # The full-float32 backward adds no atomics (dQ per query tile, dK and dV per key tile): always
    # deterministic, whatever enable_op_determinism says. Causal, GQA and dropout on lengths off the tiles.
    rng = np.random.default_rng(zlib.crc32(b"full-float32-determinism"))
    q = tf.constant(rng.standard_normal((2, 333, 4, 64)), tf.float32)
    k = tf.constant(rng.standard_normal((2, 301, 2, 64)), tf.float32)
    v = tf.constant(rng.standard_normal((2, 301, 2, 64)), tf.float32)

    def grads():
        with tf.GradientTape() as tape:
            tape.watch([q, k, v])
            out = tf_flash.flash_attention(q, k, v, causal=True, dropout_rate=0.1, seed=7)
            loss = tf.reduce_sum(out * out)
        return [g.numpy() for g in tape.gradient(loss, [q, k, v])]

    with tf32_switch(False), tf.device("/GPU:0"):
        first, second = grads(), grads()
    for a, b in zip(first, second):
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32))
