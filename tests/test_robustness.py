"""Inputs that must not break the kernels (issue 16, items 3 and 5), against the float64 reference:

- NaN in positions no query sees (keys/values beyond kv_lengths, outside the window or the causal
  triangle, hidden by attention_mask or block_mask; query rows beyond q_lengths) never reaches the
  output or the gradients: scores are masked by replacement, padding loads as zeros, and a value row no
  query sees is never multiplied in;
- large logits: the backward recomputes each score with the forward's operations, so float32 gradients
  stay within 2x of the error of dense float32 attention for any scale and |logit| up to 1e6;
- float16/bfloat16 inputs near 6e4 give no Inf/NaN gradient where the reference is finite;
- windows as wide as the attribute allows (2^31 - 1) give the gradients of an unlimited window.
"""
import numpy as np
import pytest
import tensorflow as tf

import tf_flash
from device_util import DEVICES, native_dtype, normal, random_qkv, run_flash, tolerance
from reference import element_mask, max_error, reference_attention, reference_attention_grad

INT32_MAX = 2 ** 31 - 1


def _random_numpy(rng, batch, sq, sk, heads, heads_kv, head_dim, dtype):
    """random_qkv and an output gradient (float32) as NumPy arrays, for the tests to poison or scale."""
    q, k, v = random_qkv(rng, batch, sq, sk, heads, heads_kv, head_dim, dtype=dtype)
    return [x.numpy() for x in (q, k, v, normal(rng, (batch, sq, heads, head_dim)))]


def _run(q, k, v, dout, device, **kwargs):
    """(out, lse, dq, dk, dv) as float64 NumPy arrays, gradients of sum(out * dout) (run_flash)."""
    out, lse, _, *grads = run_flash(*(tf.constant(x) for x in (q, k, v)), device, dout=dout, **kwargs)
    return [np.asarray(x, np.float64) for x in (out, lse, *grads)]


# ---------------------------------------------------------------------------------------------------------
# NaN in invisible positions
# ---------------------------------------------------------------------------------------------------------

BATCH, HEADS, HEADS_KV, SQ, SK = 2, 4, 2, 130, 300
POISON = {
    "kv_lengths": dict(kv_lengths=[170, 61]),
    "q_lengths": dict(q_lengths=[100, 7]),
    "causal": dict(causal=True),  # Sk > Sq: keys >= Sq are seen by no query
    "window": dict(window=(16, 5)),  # keys >= Sq + 5 are seen by no query
    "window_causal_lengths": dict(window=(20, 0), causal=True, q_lengths=[90, 130], kv_lengths=[300, 45]),
    "attention_mask": dict(attention_mask="columns"),
    "key_mask": dict(attention_mask="keys"),  # [B, 1, 1, Sk] padding: the kernels' one-row path
    "block_mask": dict(block_mask="columns", block_size=(32, 64)),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("head_dim", [40, 64])
@pytest.mark.parametrize("case", sorted(POISON))
def test_nan_in_invisible_positions_does_not_leak(rng, device, dtype, head_dim, case):
    if "GPU" in device and dtype == np.float32:
        dtype = np.float16  # the GPU's float32 is computed on float16 operands
    kw = dict(POISON[case])
    if kw.get("attention_mask") == "columns":  # [B, 1, Sq, Sk]: random, and some key columns all False
        mask = rng.random((BATCH, 1, SQ, SK)) < 0.7
        mask[:, :, :, rng.random(SK) < 0.3] = False
        mask[0, :, 5, :] = False  # a query row that sees nothing
        kw["attention_mask"] = mask
    elif kw.get("attention_mask") == "keys":  # [B, 1, 1, Sk]: every query sees the same keys
        kw["attention_mask"] = rng.random((BATCH, 1, 1, SK)) < 0.7
    if kw.get("block_mask") == "columns":
        blocks = rng.random((HEADS_KV, -(-SQ // 32), -(-SK // 64))) < 0.7
        blocks[:, :, 1] = False
        kw["block_mask"] = np.repeat(blocks, HEADS // HEADS_KV, axis=0)  # the same for a GQA group
    q, k, v, dout = _random_numpy(rng, BATCH, SQ, SK, HEADS, HEADS_KV, head_dim, dtype)
    visible = element_mask(BATCH, HEADS, SQ, SK, **kw)
    key_unseen = ~visible.any(axis=(1, 2))  # [B, Sk]: no head, no query sees the key
    row_unseen = ~visible.any(axis=(1, 3))  # [B, Sq]: rows no head sees anything from
    if case not in ("q_lengths", "attention_mask"):
        assert key_unseen.any()
    poisoned = [x.copy() for x in (q, k, v)]
    poisoned[1][key_unseen] = np.nan
    poisoned[2][key_unseen] = np.inf
    poisoned_dout = dout.copy()
    if "q_lengths" in kw:  # query rows beyond q_lengths: garbage in q and in the incoming gradient
        q_pad = np.arange(SQ)[None, :] >= np.asarray(kw["q_lengths"])[:, None]
        poisoned[0][q_pad] = np.nan
        poisoned_dout[q_pad] = np.nan
    out, lse, dq, dk, dv = _run(*poisoned, poisoned_dout, device, **kw)
    ref_out, ref_lse = reference_attention(q, k, v, **kw)
    ref_grads = reference_attention_grad(q, k, v, dout, **kw)
    for name, got in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, dq, dk, dv)):
        if name == "lse":
            np.testing.assert_array_equal(np.isfinite(got), np.isfinite(ref_lse))
        else:
            assert np.isfinite(got).all(), f"{name}: {np.count_nonzero(~np.isfinite(got))} non-finite entries"
    tol, grad_tol = tolerance("max_output", dtype), tolerance("max_gradient", dtype)
    assert max_error(out, ref_out) < tol
    assert np.abs(dk[key_unseen]).max(initial=0) == 0 and np.abs(dv[key_unseen]).max(initial=0) == 0
    assert np.abs(out[row_unseen]).max(initial=0) == 0  # a query row that sees nothing returns 0
    for name, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv), ref_grads):
        assert max_error(got, want) < grad_tol, f"{name}: {max_error(got, want)}"


# ---------------------------------------------------------------------------------------------------------
# Large logits: the backward's probabilities are the forward's
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("head_dim", [8, 100, 128])
@pytest.mark.parametrize("scale", [0.3, 128 ** -0.5], ids=["0.3", "rsqrt128"])
@pytest.mark.parametrize("logit", [1e2, 1e4, 1e6])
def test_large_logits_float32_within_2x_of_dense(rng, head_dim, scale, logit):
    batch, heads, seq = 1, 2, 67
    q, k, v, dout = _random_numpy(rng, batch, seq, seq, heads, heads, head_dim, np.float32)
    # q . k * scale has a spread of about `logit`.
    amplitude = np.float32(np.sqrt(logit / (scale * np.sqrt(head_dim))))
    q, k = q * amplitude, k * amplitude
    ours = _run(q, k, v, dout, "/CPU:0", scale=scale, causal=True)
    ref_out, _ = reference_attention(q, k, v, scale=scale, causal=True)
    ref = reference_attention_grad(q, k, v, dout, scale=scale, causal=True)
    dense = _dense_float32_causal(q, k, v, dout, scale)
    for name, got, base, want in zip(("out", "dq", "dk", "dv"), [ours[0]] + ours[2:], dense, [ref_out, *ref]):
        assert np.isfinite(got).all(), name
        # Relative Frobenius errors (at |logit| >= 1e4 the softmax is one-hot and dq, dk of the reference are
        # ~0: both errors are then rounding noise of the same size, hence norms rather than one entry).
        scale_of = max(np.linalg.norm(want), 1e-30)
        err, dense_err = np.linalg.norm(got - want) / scale_of, np.linalg.norm(base - want) / scale_of
        assert err <= max(2 * dense_err, 1e-6), f"{name}: {err} vs dense float32 {dense_err}"


def _dense_float32_causal(q, k, v, dout, scale):
    q, k, v = (tf.constant(x, tf.float32) for x in (q, k, v))
    seq = q.shape[1]
    visible = tf.constant(np.tril(np.ones((seq, seq), bool)))
    with tf.device("/CPU:0"), tf.GradientTape() as tape:
        tape.watch([q, k, v])
        logits = tf.einsum("bqhd,bkhd->bhqk", q, k) * scale
        logits = tf.where(visible, logits, -np.inf)
        out = tf.einsum("bhqk,bkhd->bqhd", tf.nn.softmax(logits, axis=-1), v)
        loss = tf.reduce_sum(out * dout)
    return [np.asarray(x.numpy(), np.float64) for x in (out, *tape.gradient(loss, [q, k, v]))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("logit", [1e4, 1e6])
def test_large_logits_gradients_finite(rng, device, logit):
    # On the GPU (float16 operands) accuracy at such logits is bounded by the input rounding; the
    # gradients must stay finite and the probabilities (through dV) right where the softmax is one-hot.
    dtype = native_dtype(device).as_numpy_dtype
    batch, heads, seq, head_dim, scale = 1, 2, 150, 128, 128 ** -0.5
    q, k, v, dout = _random_numpy(rng, batch, seq, seq, heads, heads, head_dim, np.float32)
    amplitude = min(np.sqrt(logit / (scale * np.sqrt(head_dim))), 6e4)
    q, k = (np.clip(x * amplitude, -6e4, 6e4).astype(dtype) for x in (q, k))
    v = v.astype(dtype)
    out, lse, dq, dk, dv = _run(q, k, v, dout, device, scale=scale)
    for name, x in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, dq, dk, dv)):
        assert np.isfinite(x).all(), name


# ---------------------------------------------------------------------------------------------------------
# float16 / bfloat16 near the top of float16's range
# ---------------------------------------------------------------------------------------------------------

# On the GPU these overflowed until round 9 (issue #16 item 5): the forward's exponent s * c - round(max * c)
# is off by the rounding of max * c, hundreds at |logits| ~ 1e9; the kernels now exponentiate (s - max) * c
# there (fwd_kernel.h, kFmaExponentLimit).
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [tf.float16, tf.bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize("head_dim", [8, 100, 128])
def test_half_inputs_near_6e4_give_finite_gradients(rng, device, dtype, head_dim):
    batch, heads, seq = 1, 2, 64
    shape = (batch, seq, heads, head_dim)
    q, k, v = (np.sign(rng.standard_normal(shape)) * rng.uniform(5e4, 6e4, shape) for _ in range(3))
    dout = rng.uniform(-1, 1, shape).astype(np.float32)
    q, k, v = (tf.constant(x, dtype) for x in (q, k, v))
    with tf.device(device):
        with tf.GradientTape() as tape:
            tape.watch([q, k, v])
            out = tf_flash.flash_attention(q, k, v)
            loss = tf.reduce_sum(tf.cast(out, tf.float32) * dout)
        grads = tape.gradient(loss, [q, k, v])
    assert np.isfinite(np.asarray(out.numpy(), np.float32)).all()
    largest = float(dtype.max)
    for name, got, want in zip("qkv", grads, reference_attention_grad(q, k, v, dout)):
        got = np.asarray(got.numpy(), np.float64)
        representable = np.isfinite(want) & (np.abs(want) < largest)
        bad = representable & ~np.isfinite(got)
        assert not bad.any(), f"d{name}: {np.count_nonzero(bad)} non-finite entries where the reference is finite"


# ---------------------------------------------------------------------------------------------------------
# Windows as wide as the attribute allows
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("window", [(INT32_MAX, INT32_MAX), (3, INT32_MAX), (INT32_MAX, 0), (INT32_MAX - 5, 2)],
                         ids=["max_max", "3_max", "max_0", "max-5_2"])
def test_wide_window_gradients(rng, device, window):
    dtype = native_dtype(device)
    batch, heads, sq, sk, head_dim = 2, 2, 200, 333, 64  # Sk not a multiple of any tile
    q, k, v, dout = _random_numpy(rng, batch, sq, sk, heads, heads, head_dim, dtype)
    for kw in (dict(window=window), dict(window=window, kv_lengths=[333, 150])):
        out, _, dq, dk, dv = _run(q, k, v, dout, device, **kw)
        ref_out, _ = reference_attention(q, k, v, **kw)
        tol, grad_tol = tolerance("max_output", dtype), tolerance("max_gradient", dtype)
        assert max_error(out, ref_out) < tol
        for name, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv), reference_attention_grad(q, k, v, dout, **kw)):
            assert max_error(got, want) < grad_tol, f"{name} with {kw}: {max_error(got, want)}"
