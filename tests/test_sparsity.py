"""tf_flash.sparsity builders, and block-sparse flash_attention vs dense attention under the equivalent
element mask (float64 NumPy reference in tests/reference.py)."""
import numpy as np
import pytest
import tensorflow as tf

import tf_flash
from device_util import DEVICES, normal, on_device, random_qkv, run_flash, tolerance
from reference import element_mask, reference_attention, reference_attention_grad
from tf_flash import sparsity

BUILDERS = {
    "dense": lambda sq, sk, bs: sparsity.dense(sq, sk, bs),
    "local": lambda sq, sk, bs: sparsity.local(sq, sk, bs, window=1),
    "local_causal": lambda sq, sk, bs: sparsity.local(sq, sk, bs, window=(2, 0), causal=True),
    "global_local": lambda sq, sk, bs: sparsity.global_local(sq, sk, bs, window=1, num_global=1),
    "bigbird": lambda sq, sk, bs: sparsity.global_local(sq, sk, bs, window=1, num_global=1, num_random=1,
                                                        seed=7),
    "butterfly": lambda sq, sk, bs: sparsity.butterfly(sq, sk, bs),
    "butterfly_global": lambda sq, sk, bs: sparsity.butterfly(sq, sk, bs, max_stride=2, num_global=1),
    "random": lambda sq, sk, bs: sparsity.random_blocks(sq, sk, bs, density=0.4, seed=3),
}


# ----------------------------------------------------------------------------------------------------------
# Builders (no op needed)
# ----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(BUILDERS))
@pytest.mark.parametrize("sq,sk,bs", [(512, 512, 64), (1000, 700, (100, 64)), (1, 1, 128), (129, 257, 32)])
def test_builder_shape_density(name, sq, sk, bs):
    mask, dens = BUILDERS[name](sq, sk, bs)
    assert isinstance(mask, np.ndarray) and mask.dtype == bool
    assert mask.shape == sparsity.num_blocks(sq, sk, bs)
    assert dens == pytest.approx(mask.mean())
    assert dens == pytest.approx(sparsity.density(mask))
    assert 0.0 < dens <= 1.0


def test_num_blocks():
    assert sparsity.num_blocks(512, 512, 128) == (4, 4)
    assert sparsity.num_blocks(513, 100, (128, 64)) == (5, 2)
    assert sparsity.num_blocks(1, 1) == (1, 1)


def test_local_band():
    mask, dens = sparsity.local(8 * 16, 8 * 16, 16, window=1)
    i, j = np.indices((8, 8))
    np.testing.assert_array_equal(mask, np.abs(i - j) <= 1)
    assert dens == pytest.approx((8 + 2 * 7) / 64)
    mask, _ = sparsity.local(8 * 16, 8 * 16, 16, window=(2, 0))
    np.testing.assert_array_equal(mask, (j <= i) & (j >= i - 2))
    causal, _ = sparsity.local(8 * 16, 8 * 16, 16, window=(2, 5), causal=True)
    np.testing.assert_array_equal(causal, mask)
    diag, dens = sparsity.local(64, 64, 16, window=0)
    np.testing.assert_array_equal(diag, np.eye(4, dtype=bool))
    assert dens == 0.25


def test_local_uneven_blocks_covers_element_band():
    # With bq != bk the band is in key blocks around the element diagonal: every element (i, j) with
    # |i - j| < bk must be inside a kept block.
    sq, sk, bs = 300, 260, (48, 32)
    mask, _ = sparsity.local(sq, sk, bs, window=1)
    elements = sparsity.to_element_mask(mask, sq, sk, bs)
    i, j = np.indices((sq, sk))
    assert elements[np.abs(i - j) < 32].all()
    assert not elements[np.abs(i - j) > 48 + 2 * 32].any()


def test_local_causal_blocks_hold_visible_entries():
    sq, sk, bs = 200, 200, (32, 16)
    mask, _ = sparsity.local(sq, sk, bs, window=100, causal=True)
    elements = sparsity.to_element_mask(mask, sq, sk, bs)
    i, j = np.indices((sq, sk))
    np.testing.assert_array_equal(elements | (j > i), np.ones_like(elements))  # covers the lower triangle
    for qb, kb in zip(*np.nonzero(mask)):  # every kept block holds some j <= i
        assert kb * 16 <= min((qb + 1) * 32, sq) - 1


def test_global_local():
    mask, dens = sparsity.global_local(8 * 16, 8 * 16, 16, window=0, num_global=2)
    assert mask[:2].all() and mask[:, :2].all()
    rest = mask[2:, 2:]
    np.testing.assert_array_equal(rest, np.eye(6, dtype=bool))
    assert dens == pytest.approx((64 - 36 + 6) / 64)


def test_bigbird_random_blocks():
    base, _ = sparsity.global_local(32 * 16, 32 * 16, 16, window=1, num_global=1)
    mask, dens = sparsity.global_local(32 * 16, 32 * 16, 16, window=1, num_global=1, num_random=3, seed=1)
    assert (mask | ~base).all()  # contains the base pattern
    extra = mask & ~base
    np.testing.assert_array_equal(extra.sum(axis=1)[1:], 3)  # row 0 is global: nothing left to add
    again, _ = sparsity.global_local(32 * 16, 32 * 16, 16, window=1, num_global=1, num_random=3, seed=1)
    np.testing.assert_array_equal(mask, again)
    other, _ = sparsity.global_local(32 * 16, 32 * 16, 16, window=1, num_global=1, num_random=3, seed=2)
    assert (mask != other).any()
    heads, _ = sparsity.global_local(32 * 16, 32 * 16, 16, num_random=2, seed=1, num_heads=3)
    assert heads.shape == (3, 32, 32) and (heads[0] != heads[1]).any()


def test_butterfly_pattern():
    mask, dens = sparsity.butterfly(16 * 64, 16 * 64, 64)
    i, j = np.indices((16, 16))
    x = i ^ j
    np.testing.assert_array_equal(mask, np.isin(x, [0, 1, 2, 4, 8]))
    assert dens == pytest.approx((1 + 4) / 16)
    # Union of butterfly factors: the factor of stride s pairs block i with i ^ s.
    union = np.eye(16, dtype=bool)
    for stride in (1, 2, 4, 8):
        union[np.arange(16), np.arange(16) ^ stride] = True
    np.testing.assert_array_equal(mask, union)
    assert (mask == mask.T).all()
    # Paper-scale: s = 8192, block 128 -> 64 blocks, 7 per row.
    big, dens = sparsity.butterfly(8192, 8192, 128)
    assert big.shape == (64, 64) and dens == pytest.approx(7 / 64)
    np.testing.assert_array_equal(big.sum(axis=1), 7)


def test_butterfly_max_stride_global_and_crop():
    mask, _ = sparsity.butterfly(16 * 64, 16 * 64, 64, max_stride=4)
    x = np.bitwise_xor(*np.indices((16, 16)))
    np.testing.assert_array_equal(mask, np.isin(x, [0, 1, 2]))
    diag, dens = sparsity.butterfly(256, 256, 64, max_stride=1)
    np.testing.assert_array_equal(diag, np.eye(4, dtype=bool))
    glob, _ = sparsity.butterfly(16 * 64, 16 * 64, 64, max_stride=2, num_global=1)
    assert glob[0].all() and glob[:, 0].all()
    cropped, _ = sparsity.butterfly(10 * 64, 6 * 64, 64)  # 10 x 6 blocks: the 16-block pattern cropped
    full, _ = sparsity.butterfly(16 * 64, 16 * 64, 64)
    np.testing.assert_array_equal(cropped, full[:10, :6])
    assert cropped.any(axis=1).all()


def test_random_blocks():
    mask, dens = sparsity.random_blocks(8192, 8192, 128, density=1 / 8, seed=0)
    assert mask.sum() == 64 * 64 // 8 and dens == 0.125
    again, _ = sparsity.random_blocks(8192, 8192, 128, density=1 / 8, seed=0)
    np.testing.assert_array_equal(mask, again)
    other, _ = sparsity.random_blocks(8192, 8192, 128, density=1 / 8, seed=1)
    assert (mask != other).any()
    heads, dens = sparsity.random_blocks(1024, 1024, 128, density=0.5, seed=0, num_heads=4)
    assert heads.shape == (4, 8, 8) and dens == 0.5 and (heads[0] != heads[1]).any()
    diag, dens = sparsity.random_blocks(1024, 1024, 128, density=0.01, seed=0, keep_diagonal=True)
    assert np.diag(diag).all() and dens >= 8 / 64
    tiny, dens = sparsity.random_blocks(10, 10, 128, density=0.01)
    assert tiny.shape == (1, 1) and tiny.all() and dens == 1.0


def test_num_heads_broadcast():
    for build in (sparsity.dense, sparsity.local, sparsity.butterfly):
        mask, dens = build(512, 256, 64, num_heads=3)
        single, dens1 = build(512, 256, 64)
        assert mask.shape == (3, 8, 4) and dens == dens1
        np.testing.assert_array_equal(mask[2], single)


def test_density_fn():
    assert sparsity.density(np.array([[True, False], [False, False]])) == 0.25
    assert sparsity.density(tf.constant([[True, True]])) == 1.0
    with pytest.raises(ValueError, match="bool"):
        sparsity.density(np.ones((2, 2)))
    with pytest.raises(ValueError, match="empty"):
        sparsity.density(np.zeros((0, 2), bool))


def test_to_element_mask():
    block = np.array([[True, False, True], [False, True, False]])
    el = sparsity.to_element_mask(block, 5, 7, (3, 3))
    assert el.shape == (5, 7) and el.dtype == bool
    for i in range(5):
        for j in range(7):
            assert el[i, j] == block[i // 3, j // 3]
    heads = sparsity.to_element_mask(np.stack([block, ~block]), 5, 7, (3, 3))
    assert heads.shape == (2, 5, 7)
    np.testing.assert_array_equal(heads[1], ~el)
    np.testing.assert_array_equal(sparsity.to_element_mask(tf.constant(block), 5, 7, 3), el)
    # Agrees with the reference's own expansion.
    np.testing.assert_array_equal(element_mask(1, 1, 5, 7, block_mask=block, block_size=3)[0, 0], el)


@pytest.mark.parametrize("call,match", [
    (lambda: sparsity.local(0, 10), "seqlen_q"),
    (lambda: sparsity.local(10, -1), "seqlen_k"),
    (lambda: sparsity.local(10.0, 10), "seqlen_q"),
    (lambda: sparsity.local(10, 10, 0), "block_size"),
    (lambda: sparsity.local(10, 10, (16, 0)), "block_size"),
    (lambda: sparsity.local(10, 10, (16, 16, 16)), "block_size"),
    (lambda: sparsity.local(10, 10, True), "block_size"),
    (lambda: sparsity.local(10, 10, window=-1), "window"),
    (lambda: sparsity.local(10, 10, window=(1,)), "window"),
    (lambda: sparsity.local(10, 10, window=1.5), "window"),
    (lambda: sparsity.local(10, 10, num_heads=0), "num_heads"),
    (lambda: sparsity.global_local(10, 10, num_global=-1), "num_global"),
    (lambda: sparsity.global_local(10, 10, num_random=-2), "num_random"),
    (lambda: sparsity.global_local(10, 10, num_random=1, seed=-1), "seed"),
    (lambda: sparsity.butterfly(10, 10, max_stride=3), "max_stride"),
    (lambda: sparsity.butterfly(10, 10, max_stride=0), "max_stride"),
    (lambda: sparsity.butterfly(10, 10, num_global=-1), "num_global"),
    (lambda: sparsity.random_blocks(10, 10, density=0.0), "density"),
    (lambda: sparsity.random_blocks(10, 10, density=1.5), "density"),
    (lambda: sparsity.random_blocks(10, 10, density="half"), "density"),
    (lambda: sparsity.random_blocks(10, 10, seed=1.5), "seed"),
    (lambda: sparsity.to_element_mask(np.ones((2, 2), bool), 10, 10, 4), "block_mask"),
    (lambda: sparsity.to_element_mask(np.ones((3, 3)), 10, 10, 4), "bool"),
    (lambda: sparsity.to_element_mask(np.ones(3, bool), 10, 10, 4), "rank"),
])
def test_validation(call, match):
    with pytest.raises(ValueError, match=match) as info:
        call()
    assert "Received" in str(info.value)



# ----------------------------------------------------------------------------------------------------------
# Block-sparse flash_attention vs dense attention under the equivalent element mask
# ----------------------------------------------------------------------------------------------------------

FLOAT32_AND_BFLOAT16 = pytest.mark.parametrize("dtype", [tf.float32, tf.bfloat16], ids=["float32", "bfloat16"])


def _run_flash(q, k, v, device, use_function, dout=None, **kwargs):
    """run_flash's out, lse and, with dout, dq, dk, dv; skips on an unsupported block size."""
    try:
        out, lse, _, *grads = run_flash(q, k, v, device, use_function, dout=dout, **kwargs)
    except (tf.errors.InvalidArgumentError, ValueError) as err:
        if "block_size" in str(err) or "block_q" in str(err) or "block_k" in str(err):
            pytest.skip(f"block size not supported by the kernel: {err}")
        raise
    return [out, lse] + (grads if dout is not None else [])


def _assert_close(actual, expected, tol, what, absolute=False):
    """Same -inf/inf pattern, and max error <= tol * max(1, max|expected|) (absolute: <= tol)."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    finite = np.isfinite(expected)
    np.testing.assert_array_equal(np.isfinite(actual), finite, err_msg=f"{what}: inf pattern")
    if not finite.any():
        return
    err = np.abs(actual[finite] - expected[finite]).max()
    bound = tol if absolute else tol * max(1.0, np.abs(expected[finite]).max())
    assert err <= bound, f"{what}: max error {err:.3g} > {bound:.3g}"


def _check(out, lse, grads, q, k, v, dout, device, **ref_kw):
    dtype = q.dtype
    ref_out, ref_lse = reference_attention(q, k, v, **ref_kw)
    _assert_close(out, ref_out, tolerance("max_output", dtype, device), "out")
    _assert_close(lse, ref_lse, tolerance("lse", dtype, device), "lse", absolute=True)
    if grads:
        for name, got, want in zip(("dq", "dk", "dv"), grads, reference_attention_grad(q, k, v, dout, **ref_kw)):
            _assert_close(got, want, tolerance("max_gradient", dtype, device), name)


@pytest.mark.parametrize("device", DEVICES)
@FLOAT32_AND_BFLOAT16
@pytest.mark.parametrize("name", sorted(BUILDERS))
@pytest.mark.parametrize("sq,sk,bs", [(256, 256, 64), (193, 131, 32), (200, 300, (64, 32)), (77, 77, 128),
                                      (300, 260, 128)])
def test_builders_match_dense_with_element_mask(device, dtype, name, sq, sk, bs):
    rng = np.random.default_rng(0)
    q, k, v = random_qkv(rng, 2, sq, sk, 2, 2, 32, dtype=dtype)
    mask, _ = BUILDERS[name](sq, sk, bs)
    out, lse = _run_flash(q, k, v, device, False, block_mask=mask, block_size=bs)
    el = sparsity.to_element_mask(mask, sq, sk, bs)
    _check(out, lse, None, q, k, v, None, device, attention_mask=el)
    # And the op's own dense path under the element mask agrees.
    dense_out, dense_lse = _run_flash(q, k, v, device, False, attention_mask=el)
    _assert_close(out, dense_out, tolerance("max_output", dtype, device), "out vs attention_mask path")
    _assert_close(lse, dense_lse, tolerance("lse", dtype, device), "lse vs attention_mask path", absolute=True)


@pytest.mark.parametrize("device", DEVICES)
@FLOAT32_AND_BFLOAT16
@pytest.mark.parametrize("use_function", [False, True], ids=["eager", "function"])
@pytest.mark.parametrize("mask_rank", [2, 3, 4])
def test_block_mask_ranks_and_gradients(device, dtype, use_function, mask_rank):
    rng = np.random.default_rng(1)
    batch, heads, sq, sk, bs = 2, 4, 160, 224, 32
    q, k, v = random_qkv(rng, batch, sq, sk, heads, 2, 32, 64, dtype=dtype)
    shape = {2: (), 3: (heads,), 4: (batch, heads)}[mask_rank] + sparsity.num_blocks(sq, sk, bs)
    mask = rng.random(shape) < 0.5
    dout = normal(rng, (batch, sq, heads, 64))
    out, lse, *grads = _run_flash(q, k, v, device, use_function, dout=dout,
                                  block_mask=mask, block_size=bs)
    _check(out, lse, grads, q, k, v, dout, device, block_mask=mask, block_size=bs)


COMPOSE = {
    "causal": dict(causal=True),
    "window": dict(window=(40, 17)),
    "lengths": dict(q_lengths=[150, 61], kv_lengths=[97, 200]),
    "causal_lengths_window": dict(causal=True, window=(64, None), q_lengths=[150, 100], kv_lengths=[130, 33]),
    "attention_mask": dict(attention_mask="random"),
    "scale": dict(scale=0.3),
}


@pytest.mark.parametrize("device", DEVICES)
@FLOAT32_AND_BFLOAT16
@pytest.mark.parametrize("feature", sorted(COMPOSE))
@pytest.mark.parametrize("pattern", ["local", "butterfly", "random"])
@pytest.mark.parametrize("heads,heads_kv", [(4, 4), (4, 1)])
def test_block_sparse_composes(device, dtype, feature, pattern, heads, heads_kv):
    rng = np.random.default_rng(2)
    batch, sq, sk, bs = 2, 150, 200, 32
    q, k, v = random_qkv(rng, batch, sq, sk, heads, heads_kv, 32, dtype=dtype)
    mask, _ = BUILDERS[pattern](sq, sk, bs)
    kw = dict(COMPOSE[feature])
    if kw.get("attention_mask") == "random":
        kw["attention_mask"] = rng.random((batch, 1, sq, sk)) < 0.7
    dout = normal(rng, (batch, sq, heads, 32))
    out, lse, *grads = _run_flash(q, k, v, device, False, dout=dout,
                                  block_mask=mask, block_size=bs, **kw)
    _check(out, lse, grads, q, k, v, dout, device, block_mask=mask, block_size=bs, **kw)


@pytest.mark.parametrize("device", DEVICES)
@FLOAT32_AND_BFLOAT16
def test_empty_rows_give_zero(device, dtype):
    # Query blocks with no kept key block: out 0, lse -inf, no NaN, zero gradients.
    rng = np.random.default_rng(3)
    sq, sk, bs = 256, 256, 64
    q, k, v = random_qkv(rng, 1, sq, sk, 2, 2, 32, dtype=dtype)
    mask = np.zeros((4, 4), bool)
    mask[1, 2] = mask[3, 0] = True
    dout = normal(rng, (1, sq, 2, 32))
    out, lse, dq, dk, dv = _run_flash(q, k, v, device, False, dout=dout,
                                      block_mask=mask, block_size=bs)
    assert not np.isnan(out).any() and not np.isnan(dq).any()
    np.testing.assert_array_equal(out[:, :64], 0)
    np.testing.assert_array_equal(out[:, 128:192], 0)
    assert np.isneginf(lse[:, :, :64]).all()
    np.testing.assert_array_equal(dq[:, :64], 0)
    np.testing.assert_array_equal(dk[:, 64:128], 0)  # key block 1 is never visible
    np.testing.assert_array_equal(dv[:, 64:128], 0)
    _check(out, lse, (dq, dk, dv), q, k, v, dout, device, block_mask=mask, block_size=bs)


@pytest.mark.parametrize("device", DEVICES)
@FLOAT32_AND_BFLOAT16
@pytest.mark.parametrize("dim", [64, 256])  # 256: the GPU backward's 64 x 64 tiles
def test_skipped_blocks_are_not_loaded(device, dtype, dim):
    # NaN in keys/values of key blocks that no query block keeps: if such a tile were loaded and
    # multiplied (even by a probability of 0) the NaN would reach the output or the gradients.
    rng = np.random.default_rng(4)
    sq = sk = 512
    bs = 128
    q, k, v = random_qkv(rng, 1, sq, sk, 2, 2, dim, dtype=dtype)
    mask = np.ones((4, 4), bool)
    mask[:, 2] = False
    k_np, v_np = k.numpy(), v.numpy()
    k_np[:, 256:384] = np.nan
    v_np[:, 256:384] = np.nan
    k_nan, v_nan = tf.constant(k_np), tf.constant(v_np)
    dout = normal(rng, (1, sq, 2, dim))
    out, lse, dq, dk, dv = _run_flash(q, k_nan, v_nan, device, False, dout=dout,
                                      block_mask=mask, block_size=bs)
    assert np.isfinite(out).all() and np.isfinite(lse).all() and np.isfinite(dq).all()
    keep = np.r_[0:256, 384:512]
    assert np.isfinite(dk[:, keep]).all() and np.isfinite(dv[:, keep]).all()
    ref_out, _ = reference_attention(q, k, v, block_mask=mask, block_size=bs)
    _assert_close(out, ref_out, tolerance("max_output", dtype, device), "out")


@pytest.mark.parametrize("device", DEVICES)
def test_block_sparse_float16(device):
    rng = np.random.default_rng(5)
    sq, sk, bs = 256, 192, 64
    q, k, v = random_qkv(rng, 1, sq, sk, 2, 2, 64, dtype=tf.float16)
    mask, _ = sparsity.butterfly(sq, sk, bs, num_global=1)
    dout = normal(rng, (1, sq, 2, 64))
    out, lse, *grads = _run_flash(q, k, v, device, False, dout=dout, block_mask=mask, block_size=bs)
    _check(out, lse, grads, q, k, v, dout, device, block_mask=mask, block_size=bs)


@pytest.mark.parametrize("device", DEVICES)
@FLOAT32_AND_BFLOAT16
def test_block_sparse_with_dropout_matches_reference(device, dtype):
    # Dropout composes with block sparsity: the keep mask is recomputed from the op's rng state.
    from philox_ref import keep_mask as philox_keep_mask
    rng = np.random.default_rng(6)
    batch, heads, sq, sk, bs, rate = 2, 2, 96, 160, 32, 0.25
    q, k, v = random_qkv(rng, batch, sq, sk, heads, 1, 32, dtype=dtype)
    mask, _ = sparsity.local(sq, sk, bs, window=1)
    dout = normal(rng, (batch, sq, heads, 32))

    @tf.function
    def fn():
        with tf.GradientTape() as tape:
            tape.watch([q, k, v])
            out = tf_flash.flash_attention(q, k, v, block_mask=mask, block_size=bs, dropout_rate=rate, seed=11)
            loss = tf.reduce_sum(tf.cast(out, tf.float32) * dout)
        return (out, out.op.outputs[1], out.op.outputs[2]) + tuple(tape.gradient(loss, [q, k, v]))

    with on_device(device):
        out, lse, rng_state, *grads = fn()
    seed, offset = (int(x) for x in rng_state.numpy())
    keep = philox_keep_mask(seed, offset, batch, heads, sq, sk, rate)
    _check(out, lse, grads, q, k, v, dout, device, block_mask=mask, block_size=bs, keep_mask=keep,
           dropout_rate=rate)


def test_bad_block_mask_shape():
    q = tf.zeros([1, 128, 2, 16])
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError), match="block"):
        tf_flash.flash_attention(q, q, q, block_mask=np.ones((3, 3), bool), block_size=64)
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError), match="block_mask"):
        tf_flash.flash_attention(q, q, q, block_mask=np.ones((2, 2), np.int32), block_size=64)
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError), match="block_size"):
        tf_flash.flash_attention(q, q, q, block_mask=np.ones((2, 2), bool), block_size=0)
