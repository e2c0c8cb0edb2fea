"""Logit soft-capping (`softcap`): scaled scores s -> softcap * tanh(s / softcap) before the softmax, in
the forward (output, lse) and the backward (through tanh), against the float64 reference, alone and with
causal / window / lengths / masks / GQA / dropout; argument checks; the layers' `softcap`."""
import numpy as np
import pytest
import tensorflow as tf

import philox_ref
import tf_flash
from device_util import DEVICES, DTYPES, native_dtype, normal, random_qkv, run_flash, tolerance
from reference import max_error, reference_attention, reference_attention_grad, standard_attention


def _inputs(rng, batch, sq, sk, heads, heads_kv, dim, dim_v, dtype, logit_scale=3.0):
    # Scores of a few times the cap, so that the tanh bends them (not only its linear part).
    q, k, v = random_qkv(rng, batch, sq, sk, heads, heads_kv, dim, dim_v)
    return [tf.cast(x, dtype) for x in (q * logit_scale, k * logit_scale, v)]


FEATURES = {
    "plain": dict(),
    "causal": dict(causal=True),
    "window_lengths_gqa": dict(window=(40, 7), q_lengths=[150, 71], kv_lengths=[300, 133], gqa=True),
    "attention_mask": dict(attention_mask="random", scale=0.3),
    "block_mask": dict(block_mask="random", block_size=(64, 64)),
    "dropout_causal": dict(causal=True, dropout_rate=0.25),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("use_function", [False, True], ids=["eager", "function"])
@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_softcap_matches_reference(rng, device, dtype, use_function, feature):
    # Lengths that are not multiples of any tile (CPU 128 x 256, CUDA 64/128).
    batch, heads, sq, sk, dim, dim_v, softcap = 2, 4, 150, 300, 32, 24, 5.0
    kw = dict(FEATURES[feature])
    heads_kv = 2 if kw.pop("gqa", False) else heads
    if kw.get("attention_mask") == "random":
        kw["attention_mask"] = rng.random((batch, heads, sq, sk)) < 0.7
    if kw.get("block_mask") == "random":
        kw["block_mask"] = rng.random((heads, 3, 5)) < 0.6
    rate = kw.pop("dropout_rate", 0.0)
    q, k, v = _inputs(rng, batch, sq, sk, heads, heads_kv, dim, dim_v, dtype)
    dout = normal(rng, (batch, sq, heads, dim_v))
    out, lse, rng_state, dq, dk, dv = run_flash(q, k, v, device, use_function, dout=dout, softcap=softcap,
                                           dropout_rate=rate, seed=[11, 2], **kw)
    ref_kw = dict(kw, softcap=softcap)
    if rate:
        seed, offset = (11, 2) if not use_function else (int(rng_state[0]), int(rng_state[1]))
        ref_kw.update(keep_mask=philox_ref.keep_mask(seed, offset, batch, heads, sq, sk, rate), dropout_rate=rate)
    ref_out, ref_lse = reference_attention(q, k, v, **ref_kw)
    out_tol = tolerance("max_output", dtype, device)
    if dtype != tf.float32:  # at most 2x the error of same-dtype standard attention
        std = standard_attention(q, k, v, dtype=q.dtype.as_numpy_dtype, **ref_kw)
        out_tol = max(out_tol, 2 * max_error(std, ref_out))
    assert max_error(out, ref_out) <= out_tol
    finite = np.isfinite(ref_lse)
    np.testing.assert_array_equal(np.isfinite(lse), finite)
    np.testing.assert_allclose(lse[finite], ref_lse[finite], atol=tolerance("softcapped_lse", dtype, device))
    for name, got, want in zip("qkv", (dq, dk, dv), reference_attention_grad(q, k, v, dout, **ref_kw)):
        err = max_error(got, want)
        assert err <= tolerance("max_gradient", dtype, device), f"d{name}: {err}"


@pytest.mark.parametrize("device", DEVICES)
def test_softcap_changes_the_result_and_large_cap_is_identity(rng, device):
    dtype = native_dtype(device)
    q, k, v = _inputs(rng, 1, 70, 90, 2, 2, 64, 64, dtype)
    dout = normal(rng, (1, 70, 2, 64))
    plain = run_flash(q, k, v, device, dout=dout)
    capped = run_flash(q, k, v, device, dout=dout, softcap=2.0)
    assert max_error(capped[0], plain[0]) > 1e-2  # the cap bends these scores
    huge = run_flash(q, k, v, device, dout=dout, softcap=1e6)  # tanh(s / c) * c = s to float precision
    for a, b in zip(huge[:2] + huge[3:], plain[:2] + plain[3:]):
        assert max_error(a, b) < (2e-3 if dtype == tf.float16 else 1e-5)
    zero = run_flash(q, k, v, device, dout=dout, softcap=0)  # 0 = off
    for a, b in zip(zero, plain):
        np.testing.assert_array_equal(a, b)


def test_softcap_gradient_numerically(rng):
    # tf.test.compute_gradient on a small float32 case (finite differences through the tanh).
    q, k, v = _inputs(rng, 1, 9, 11, 2, 1, 8, 8, tf.float32, logit_scale=2.0)
    with tf.device("/CPU:0"):
        for i in range(3):
            def f(x, i=i):
                args = [q, k, v]
                args[i] = x
                return tf_flash.flash_attention(*args, softcap=1.5, causal=True)

            theoretical, numerical = tf.test.compute_gradient(f, [[q, k, v][i]], delta=1e-2)
            np.testing.assert_allclose(theoretical[0], numerical[0], atol=5e-3)


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf"), "5", True, [5.0]])
def test_softcap_rejects_bad_values(bad):
    q = tf.zeros([1, 4, 1, 8])
    with pytest.raises(ValueError, match=r"softcap.*Received: softcap="):
        tf_flash.flash_attention(q, q, q, softcap=bad)
    with pytest.raises(ValueError, match=r"softcap.*Received: softcap="):
        tf.function(lambda: tf_flash.flash_attention(q, q, q, softcap=bad))()


def test_raw_op_rejects_negative_softcap():
    q = tf.zeros([1, 4, 1, 8])
    with pytest.raises(tf.errors.InvalidArgumentError, match="softcap"):
        tf_flash._ops.ops.tf_flash_flash_attention(
            query=q, key=q, value=q, q_lengths=tf.zeros([0], tf.int32), kv_lengths=tf.zeros([0], tf.int32),
            attention_mask=tf.zeros([0, 0, 0, 0], tf.bool), block_mask=tf.zeros([0, 0, 0, 0], tf.bool),
            q_segment_ids=tf.zeros([0, 0], tf.int32), kv_segment_ids=tf.zeros([0, 0], tf.int32),
            seed=tf.zeros([2], tf.int64), scale=1.0, softcap=-2.0)


def test_layers_softcap_and_config(rng):
    q, k, v = _inputs(rng, 2, 20, 20, 2, 2, 16, 16, tf.float32)
    with tf.device("/CPU:0"):
        layer = tf_flash.layers.FlashAttention(causal=True, softcap=4.0)
        out = layer(q, v, key=k)
        expected = tf_flash.flash_attention(q, k, v, causal=True, softcap=4.0)
        np.testing.assert_allclose(out.numpy(), expected.numpy(), rtol=1e-6, atol=1e-6)
        config = layer.get_config()
        assert config["softcap"] == 4.0
        assert tf_flash.layers.FlashAttention.from_config(config).softcap == 4.0

        mha = tf_flash.layers.FlashMultiHeadAttention(num_heads=2, key_dim=8, softcap=3.0)
        x = normal(rng, (2, 12, 16))
        y = mha(x, x)
        assert y.shape == (2, 12, 16)
        config = mha.get_config()
        assert config["softcap"] == 3.0
        clone = tf_flash.layers.FlashMultiHeadAttention.from_config(config)
        clone(x, x)
        clone.set_weights(mha.get_weights())
        np.testing.assert_allclose(clone(x, x).numpy(), y.numpy(), rtol=1e-6, atol=1e-6)

    for bad in (-1.0, float("nan"), "3"):
        with pytest.raises(ValueError, match="softcap"):
            tf_flash.layers.FlashAttention(softcap=bad)
        with pytest.raises(ValueError, match="softcap"):
            tf_flash.layers.FlashMultiHeadAttention(num_heads=2, key_dim=8, softcap=bad)
