"""Packed documents: `segment_ids` against the float64 reference (random packings of 1-50 documents, lengths
that are not multiples of any tile, causal and not, cross-attention ids, GQA, every other mask), against
per-document calls, with dropout (the same Philox mask as the dense block-diagonal mask), under XLA, and
its argument errors."""
import numpy as np
import pytest
import tensorflow as tf

import tf_flash
from device_util import (DEVICES, DTYPES, float32_tolerance, normal, on_device, random_qkv, run_with_gradients,
                         tolerance)
from reference import element_mask, reference_attention, reference_attention_grad, relative_error


def packed_ids(rng, batch, seqlen, max_docs):
    """Contiguous runs: each row holds 1..max_docs documents of random lengths (ids increasing per row)."""
    rows = []
    for _ in range(batch):
        docs = int(rng.integers(1, max_docs + 1))
        cuts = np.sort(rng.choice(np.arange(1, seqlen), size=min(docs - 1, seqlen - 1), replace=False))
        rows.append(np.searchsorted(cuts, np.arange(seqlen), side="right"))
    return np.stack(rows).astype(np.int32)


def scattered_ids(rng, batch, seqlen):
    """Non-contiguous ids: every entry one of three documents at random (correct, if not the fast path)."""
    return rng.integers(0, 3, size=(batch, seqlen)).astype(np.int32)


def _run(q, k, v, d_out, mode="eager", **kwargs):
    return run_with_gradients(tf_flash.flash_attention, q, k, v, d_out, mode, **kwargs)


def _check_against_reference(result, q, k, v, d_out, dtype, device, **kwargs):
    out, lse, dq, dk, dv = result
    ref_out, ref_lse = reference_attention(q, k, v, **kwargs)
    ref_grads = reference_attention_grad(q, k, v, d_out, **kwargs)
    assert relative_error(out, ref_out) < tolerance("output", dtype, device)
    np.testing.assert_array_equal(np.isfinite(lse), np.isfinite(ref_lse))
    finite = np.isfinite(ref_lse)
    assert np.max(np.abs(lse[finite] - ref_lse[finite]), initial=0.0) < tolerance("lse", dtype, device)
    for got, ref in zip((dq, dk, dv), ref_grads):
        assert np.all(np.isfinite(got))
        assert relative_error(got, ref) < tolerance("gradient", dtype, device)


# (batch, seqlen, heads, heads_kv, head_dim, max documents): lengths past one and several tiles.
SHAPES = [(2, 77, 4, 2, 32, 5), (1, 300, 2, 2, 64, 50), (3, 531, 2, 1, 16, 12), (1, 1000, 2, 2, 128, 3)]
CASES = [pytest.param(*device.values, dtype, marks=device.marks, id=f"{dtype}-{device.id}")
         for device in DEVICES for dtype in DTYPES if device.id == "gpu" or dtype == "float32"]


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_packed_rows_match_the_reference(device, dtype, causal, shape, rng):
    batch, seqlen, heads, heads_kv, head_dim, max_docs = shape
    q, k, v = random_qkv(rng, batch, seqlen, seqlen, heads, heads_kv, head_dim, dtype=DTYPES[dtype])
    d_out = normal(rng, (batch, seqlen, heads, head_dim), DTYPES[dtype])
    ids = packed_ids(rng, batch, seqlen, max_docs)
    with on_device(device, head_dim=head_dim):
        result = _run(q, k, v, d_out, segment_ids=tf.constant(ids), causal=causal)
    _check_against_reference(result, q, k, v, d_out, dtype, device, segment_ids=ids, causal=causal)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["scattered", "cross", "with_other_masks", "softcap"])
def test_other_ids_and_masks(device, case, rng):
    batch, seqlen_q, seqlen_k, heads, heads_kv, head_dim = 2, 150, 150, 4, 2, 64
    extra = {}
    if case == "scattered":
        ids = scattered_ids(rng, batch, seqlen_q)
    elif case == "cross":  # queries of one length against keys of another, one id tensor each
        seqlen_k = 233
        ids = (packed_ids(rng, batch, seqlen_q, 4), packed_ids(rng, batch, seqlen_k, 4))
    elif case == "with_other_masks":
        ids = packed_ids(rng, batch, seqlen_q, 6)
        extra = dict(causal=True, window=(40, None), q_lengths=np.array([150, 111], np.int32),
                     kv_lengths=np.array([97, 150], np.int32),
                     attention_mask=rng.random((batch, 1, seqlen_q, seqlen_k)) < 0.8)
    else:
        ids = packed_ids(rng, batch, seqlen_q, 6)
        extra = dict(softcap=2.0, scale=1.5)
    q, k, v = random_qkv(rng, batch, seqlen_q, seqlen_k, heads, heads_kv, head_dim)
    d_out = normal(rng, (batch, seqlen_q, heads, head_dim))
    tf_ids = tuple(map(tf.constant, ids)) if isinstance(ids, tuple) else tf.constant(ids)
    with on_device(device, head_dim=head_dim):
        result = _run(q, k, v, d_out, segment_ids=tf_ids, **extra)
    _check_against_reference(result, q, k, v, d_out, "float32", device, segment_ids=ids, **extra)


@pytest.mark.parametrize("device", DEVICES)
def test_packed_row_equals_one_call_per_document(device, rng):
    lengths = [37, 130, 1, 64, 68]  # one row of 300 tokens
    heads, head_dim = 2, 32
    q, k, v = random_qkv(rng, 1, sum(lengths), sum(lengths), heads, heads, head_dim)
    ids = np.repeat(np.arange(len(lengths)), lengths)[None].astype(np.int32)
    with on_device(device, head_dim=head_dim):
        packed = tf_flash.flash_attention(q, k, v, segment_ids=ids, causal=True).numpy()
        starts = np.cumsum([0] + lengths)
        separate = np.concatenate([
            tf_flash.flash_attention(q[:, a:b], k[:, a:b], v[:, a:b], causal=True).numpy()
            for a, b in zip(starts[:-1], starts[1:])], axis=1)
    # GPU float32 on float16 operands scales each call's inputs by their own largest value: a few ulps.
    tol = float32_tolerance(device, 2e-5)
    np.testing.assert_allclose(packed, separate, rtol=tol, atol=tol)


@pytest.mark.parametrize("device", DEVICES)
def test_dropout_draws_the_dense_masks_philox_mask(device, rng):
    """Dropout depends on (seed, position) only: segment ids give the outputs and gradients of the same
    block-diagonal pattern given as a dense attention_mask."""
    batch, seqlen, heads, head_dim = 2, 200, 2, 32
    q, k, v = random_qkv(rng, batch, seqlen, seqlen, heads, heads, head_dim)
    d_out = normal(rng, (batch, seqlen, heads, head_dim))
    ids = packed_ids(rng, batch, seqlen, 7)
    dense = (ids[:, :, None] == ids[:, None, :])[:, None]
    common = dict(dropout_rate=0.3, seed=1234, causal=True)
    with on_device(device, head_dim=head_dim):
        with_ids = _run(q, k, v, d_out, segment_ids=ids, **common)
        with_mask = _run(q, k, v, d_out, attention_mask=dense, **common)
    for got, want in zip(with_ids, with_mask):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["tf.function", "xla"])
def test_graph_and_xla_match_eager(mode, rng):
    batch, seqlen, heads, head_dim = 2, 190, 2, 32
    q, k, v = random_qkv(rng, batch, seqlen, seqlen, heads, heads, head_dim)
    d_out = normal(rng, (batch, seqlen, heads, head_dim))
    ids = tf.constant(packed_ids(rng, batch, seqlen, 9))
    with tf.device("/CPU:0"):
        eager = _run(q, k, v, d_out, segment_ids=ids, causal=True)
        traced = _run(q, k, v, d_out, mode=mode, segment_ids=ids, causal=True)
    for got, want in zip(traced, eager):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6)


def test_xla_lowers_segment_ids_to_the_custom_call(rng):
    q, k, v = random_qkv(rng, 1, 64, 64, 2, 2, 16)
    ids = tf.constant(packed_ids(rng, 1, 64, 3))
    fn = tf.function(lambda q, k, v, ids: tf_flash.flash_attention(q, k, v, segment_ids=ids), jit_compile=True)
    hlo = fn.experimental_get_compiler_ir(q, k, v, ids)(stage="hlo")
    assert "tf_flash_attention_fwd" in hlo


@pytest.mark.parametrize("device", DEVICES)
def test_deterministic_gradients_are_bit_identical(device, rng):
    batch, seqlen, heads, head_dim = 2, 400, 4, 64
    q, k, v = random_qkv(rng, batch, seqlen, seqlen, heads, 2, head_dim)
    d_out = normal(rng, (batch, seqlen, heads, head_dim))
    ids = packed_ids(rng, batch, seqlen, 8)
    with on_device(device, head_dim=head_dim):
        first = _run(q, k, v, d_out, segment_ids=ids, causal=True, deterministic=True)
        second = _run(q, k, v, d_out, segment_ids=ids, causal=True, deterministic=True)
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("segment_ids,match", [
    (np.zeros([2, 5], np.float32), r"`segment_ids` must be an integer tensor"),
    (np.zeros([2, 64, 1], np.int32), r"`segment_ids` must have shape \[batch, seq\]"),
    (np.zeros([3, 64], np.int32), r"`segment_ids` must have shape \[batch, seq\] = \[2, 64\]"),
    ((np.zeros([2, 64], np.int32),), r"a tuple of 1"),
    ((np.zeros([2, 64], np.int32), np.zeros([2, 63], np.int32)), r"`kv_segment_ids` must have shape"),
    (np.array([[2**40] * 64] * 2, np.int64), r"`segment_ids` must hold int32 values"),
])
def test_bad_segment_ids_name_the_argument(segment_ids, match, rng):
    q, k, v = random_qkv(rng, 2, 64, 64, 2, 2, 16)
    with pytest.raises((ValueError, tf.errors.InvalidArgumentError), match=match):
        tf_flash.flash_attention(q, k, v, segment_ids=segment_ids)


def test_one_id_tensor_needs_self_attention(rng):
    q, k, v = random_qkv(rng, 1, 32, 48, 2, 2, 16)
    with pytest.raises(ValueError, match=r"give a pair \(q_segment_ids"):
        tf_flash.flash_attention(q, k, v, segment_ids=np.zeros([1, 32], np.int32))


def test_raw_op_refuses_one_id_tensor_without_the_other(rng):
    from tf_flash._ops import ops as raw_ops  # pylint: disable=import-outside-toplevel
    q, k, v = random_qkv(rng, 1, 32, 32, 2, 2, 16)
    with pytest.raises(tf.errors.InvalidArgumentError, match="kv_segment_ids must have shape"):
        raw_ops.tf_flash_flash_attention(
            query=q, key=k, value=v, q_lengths=np.zeros([0], np.int32), kv_lengths=np.zeros([0], np.int32),
            attention_mask=np.zeros([0, 0, 0, 0], bool), block_mask=np.zeros([0, 0, 0, 0], bool),
            q_segment_ids=np.zeros([1, 32], np.int32), kv_segment_ids=np.zeros([0, 0], np.int32),
            seed=np.zeros([2], np.int64), scale=0.25)


def test_reference_rule_by_hand():
    """The reference's rule itself on a tiny case worked by hand: ids (0, 0, 1) against (0, 1)."""
    mask = element_mask(1, 1, 3, 2, segment_ids=(np.array([[0, 0, 1]]), np.array([[0, 1]])))
    np.testing.assert_array_equal(mask[0, 0], [[True, False], [True, False], [False, True]])
