"""Which CUDA kernel family runs, read from the library's launch counts (tf_flash._ops.cuda_kernel_counts):
the Hopper forward (sm_90a: TMA, wgmma, warp-specialized) on an sm_90 GPU for the inputs it takes, the
sm_80 family for the rest (element and block masks, dropout, soft-capping, head dims 32 and 96) and on
every other GPU (cc/kernels/cuda/cuda_entry.cu). Each case also checks the result against float64
attention, so that a family that ran is also a family that is right."""
import numpy as np
import pytest
import tensorflow as tf

import tf_flash
from tf_flash._ops import cuda_kernel_counts
from reference import reference_attention

pytestmark = pytest.mark.gpu


def _hopper_expected():
    """True when the forward must take the Hopper family: an sm_90 GPU, a library with sm_90a code."""
    details = tf.config.experimental.get_device_details(tf.config.list_physical_devices("GPU")[0])
    archs = tf_flash.build_info().get("cuda_archs", "").split(",")
    return details.get("compute_capability", (0, 0))[0] == 9 and "90a" in archs


def _run(rng, dtype, head_dim, **kwargs):
    b, s, h = 2, 300, 4  # 300: not a multiple of any tile
    q, k, v = (rng.standard_normal((b, s, h, head_dim)).astype(np.float32) for _ in range(3))
    before = cuda_kernel_counts()
    with tf.device("/GPU:0"):
        out = tf_flash.flash_attention(*(tf.constant(x, dtype) for x in (q, k, v)), **kwargs)
    after = cuda_kernel_counts()
    ran = {family: after[family] - before[family] for family in after}
    return out, (q, k, v), ran


@pytest.mark.parametrize("dtype", [tf.bfloat16, tf.float16])
@pytest.mark.parametrize("head_dim", [64, 128, 256, 100])
@pytest.mark.parametrize("causal", [False, True])
def test_forward_family_and_result(dtype, head_dim, causal, rng):
    out, (q, k, v), ran = _run(rng, dtype, head_dim, causal=causal)
    if _hopper_expected():
        assert ran["forward_sm90"] == 1 and ran["forward_sm80"] == 0, ran
    else:
        assert ran["forward_sm90"] == 0 and ran["forward_sm80"] == 1, ran
    ref, _ = reference_attention(q, k, v, causal=causal)
    tol = 2e-2 if dtype == tf.float16 else 6e-2
    np.testing.assert_allclose(tf.cast(out, tf.float64).numpy(), ref, atol=tol, rtol=0)


@pytest.mark.parametrize("features", [
    dict(dropout_rate=0.1, seed=3),
    dict(softcap=20.0),
    dict(block_mask=np.array([[True, False, True]] * 3), block_size=128),
])
def test_features_outside_the_hopper_family_run_sm80(features, rng):
    _, _, ran = _run(rng, tf.bfloat16, 128, **features)
    assert ran["forward_sm80"] == 1 and ran["forward_sm90"] == 0, ran


def test_attention_mask_runs_sm80(rng):
    mask = tf.constant(rng.random((300, 300)) < 0.8)
    _, _, ran = _run(rng, tf.bfloat16, 64, attention_mask=mask)
    assert ran["forward_sm80"] == 1 and ran["forward_sm90"] == 0, ran


def test_head_dim_32_runs_sm80(rng):
    _, _, ran = _run(rng, tf.float16, 32)
    assert ran["forward_sm80"] == 1 and ran["forward_sm90"] == 0, ran


def test_backward_after_a_hopper_forward(rng):
    """The backward (sm_80 family) reads the Hopper forward's out and lse: gradients against float64."""
    b, s, h, d = 1, 200, 2, 128
    q, k, v, dout = (rng.standard_normal((b, s, h, d)).astype(np.float32) for _ in range(4))
    tq, tk, tv = (tf.constant(x, tf.bfloat16) for x in (q, k, v))
    with tf.device("/GPU:0"), tf.GradientTape() as tape:
        tape.watch([tq, tk, tv])
        out = tf_flash.flash_attention(tq, tk, tv, causal=True)
        loss = tf.reduce_sum(tf.cast(out, tf.float32) * dout)
    grads = tape.gradient(loss, [tq, tk, tv])
    from reference import reference_attention_grad
    ref_grads = reference_attention_grad(q, k, v, dout, causal=True)
    for g, r in zip(grads, ref_grads):
        g = tf.cast(g, tf.float64).numpy()
        assert np.linalg.norm(g - r) <= 2e-2 * np.linalg.norm(r), (np.linalg.norm(g - r), np.linalg.norm(r))


def test_xla_front_door_reaches_the_same_family(rng):
    """jit_compile: the XLA custom call launches the kernels through the same entry point."""
    q, k, v = (tf.constant(rng.standard_normal((2, 256, 2, 128)), tf.bfloat16) for _ in range(3))
    attend = tf.function(lambda q, k, v: tf_flash.flash_attention(q, k, v, causal=True), jit_compile=True)
    with tf.device("/GPU:0"):
        attend(q, k, v)  # compiles
        before = cuda_kernel_counts()
        attend(q, k, v).numpy()
    after = cuda_kernel_counts()
    family = "forward_sm90" if _hopper_expected() else "forward_sm80"
    assert after[family] - before[family] == 1, (before, after)
