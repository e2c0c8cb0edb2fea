"""The decode path (tf_flash/_decode.py: GQA heads packed into one tile, the op's split-KV runs merged by lse
in the kernels): chosen by shape, equal to the unsplit kernel call to float32 rounding, against the float64
reference with ragged kv_lengths (empty caches included), bottom-right causal, softcap, gradients,
tf.function and XLA, key masks; the op's num_splits with every feature (split, or run whole by the GPU)."""
import numpy as np
import pytest
import tensorflow as tf

from device_util import (DEVICES, DTYPES, check_against_reference, float32_tolerance, normal, on_device, random_qkv,
                         run_with_gradients)
from reference import reference_attention, relative_error
from tf_flash import _decode
from tf_flash.ops import _flash_attention


def _run(q, k, v, d_out, mode="eager", **kwargs):
    return run_with_gradients(_flash_attention, q, k, v, d_out, mode, **kwargs)


def _assert_equal_to_float32_rounding(got, want, device):
    """The decode path's results against the plain call's: the same kernels on the same keys."""
    tol = float32_tolerance(device, 1e-5)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.where(np.isfinite(w), g, 0), np.where(np.isfinite(w), w, 0), rtol=tol, atol=tol)


def test_plan_chooses_by_shape():
    # One new token of Llama-style GQA against long caches: packed, and split until ~128 blocks.
    assert _decode.plan(8, 1, 32768, 32, 8, plain=True) == 2
    assert _decode.plan(1, 1, 131072, 32, 8, plain=True) == 16
    assert _decode.plan(64, 1, 8192, 32, 8, plain=True) == 1  # enough blocks already: heads packed only
    # Training shapes, short caches, masks, unknown shapes: the kernels' own grid.
    assert _decode.plan(8, 4096, 4096, 32, 8, plain=True) is None
    assert _decode.plan(8, 1, 1024, 32, 8, plain=True) is None
    assert _decode.plan(8, 1, 32768, 32, 8, plain=False) is None
    assert _decode.plan(None, 1, 32768, 32, 8, plain=True) is None
    # Runs keep >= 1024 keys of the cache (the kernels split each entry's own keys evenly).
    assert _decode.plan(1, 1, 4099, 8, 8, plain=True) == 4
    # Several causal rows: heads packed where a power of two share a KV head (1: none to pack), and split.
    assert _decode.plan(8, 8, 32768, 32, 8, plain=True, causal_rows=True) == 2
    assert _decode.plan(8, 8, 32768, 8, 8, plain=True, causal_rows=True) == 2
    assert _decode.plan(1, 4, 4096, 12, 4, plain=True, causal_rows=True) is None


# (batch, seqlen_q, heads, heads_kv, seqlen_k, head_dim, splits, kv_lengths)
CASES = [
    (2, 1, 8, 2, 4096, 64, 4, [4096, 1000]),
    (3, 4, 4, 1, 3072, 32, 3, [3000, 5, 0]),  # an empty cache: output 0, lse -inf
    (1, 1, 32, 8, 8192, 128, 8, None),
    (2, 2, 4, 4, 2048, 16, 2, [2048, 1025]),  # plain multi-head attention: only the split
]
DEVICE_DTYPES = [pytest.param(*device.values, dtype, marks=device.marks, id=f"{dtype}-{device.id}")
                 for device in DEVICES for dtype in DTYPES if device.id == "gpu" or dtype == "float32"]


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"b{c[0]}q{c[1]}h{c[2]}kv{c[3]}k{c[4]}")
def test_split_matches_the_reference_and_the_unsplit_call(device, dtype, case, rng):
    batch, seqlen_q, heads, heads_kv, seqlen_k, head_dim, splits, kv_lengths = case
    q, k, v = random_qkv(rng, batch, seqlen_q, seqlen_k, heads, heads_kv, head_dim, dtype=DTYPES[dtype])
    d_out = normal(rng, (batch, seqlen_q, heads, head_dim), DTYPES[dtype])
    kwargs = {} if kv_lengths is None else {"kv_lengths": np.array(kv_lengths, np.int32)}
    if seqlen_q == 1:
        kwargs["causal"] = "bottom_right"  # one new token: the causal row of a KV cache
    with on_device(device, head_dim=head_dim):
        split = _run(q, k, v, d_out, split_kv=splits, **kwargs)
        unsplit = _run(q, k, v, d_out, split_kv=False, **kwargs)
    check_against_reference(split, q, k, v, d_out, dtype, device, **kwargs)
    if dtype == "float32":  # the same kernels on the same keys: float32 rounding of the merge
        _assert_equal_to_float32_rounding(split, unsplit, device)


# (batch, seqlen_q, heads, heads_kv, seqlen_k, head_dim, kv_lengths): several new tokens, bottom-right causal,
# against caches filled to ragged lengths (one shorter than the new tokens, one empty).
CAUSAL_ROWS_CASES = [
    (4, 8, 8, 2, 2100, 64, [2100, 1037, 5, 0]),
    (2, 3, 8, 4, 700, 32, [699, 3]),
    (1, 16, 32, 4, 4096, 128, None),  # 128 packed rows: one whole tile
    (2, 5, 4, 4, 3000, 64, [3000, 1500]),  # no GQA: nothing packed, the runs keep each row's diagonal
]


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("case", CAUSAL_ROWS_CASES, ids=lambda c: f"b{c[0]}q{c[1]}h{c[2]}kv{c[3]}k{c[4]}")
def test_causal_rows_keep_their_diagonals(device, dtype, splits, case, rng):
    """Packed token by token, `group` rows share a position (the op's position_shift); each run masks by the
    keys' places in the cache, so split runs keep the diagonals too."""
    batch, seqlen_q, heads, heads_kv, seqlen_k, head_dim, kv_lengths = case
    q, k, v = random_qkv(rng, batch, seqlen_q, seqlen_k, heads, heads_kv, head_dim, dtype=DTYPES[dtype])
    d_out = normal(rng, (batch, seqlen_q, heads, head_dim), DTYPES[dtype])
    kwargs = {"causal": "bottom_right"}
    if kv_lengths is not None:
        kwargs["kv_lengths"] = np.array(kv_lengths, np.int32)
    with on_device(device, head_dim=head_dim):
        packed = _run(q, k, v, d_out, split_kv=splits, **kwargs)
        unpacked = _run(q, k, v, d_out, split_kv=False, **kwargs)
    check_against_reference(packed, q, k, v, d_out, dtype, device, **kwargs)
    if dtype == "float32":
        _assert_equal_to_float32_rounding(packed, unpacked, device)


# (batch, seqlen_q, heads, heads_kv, seqlen_k, head_dim, splits, the key mask's batch, kv_lengths): a key mask
# ([B|1, 1, 1, Sk]: padding, or a decoding step's cache mask) is shared by the packed rows as it is.
KEY_MASK_CASES = [
    (2, 1, 8, 2, 4096, 64, 4, 2, [4096, 2900]),
    (3, 4, 8, 4, 3000, 128, 3, 1, [3000, 1000, 2]),  # several causal rows, one mask row for the batch
    (1, 1, 32, 8, 5000, 64, 8, 1, None),
    (2, 1, 4, 4, 2100, 32, 2, 2, [2100, 1500]),  # no GQA (the sm_80 family at head dim 32)
]


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("pattern", ["random", "all True"])
@pytest.mark.parametrize("case", KEY_MASK_CASES, ids=lambda c: f"b{c[0]}q{c[1]}h{c[2]}kv{c[3]}k{c[4]}m{c[7]}")
def test_key_masks_take_the_decode_path(device, dtype, pattern, case, rng):
    """The split runs read a key mask by the keys' places: against the reference and the unsplit call; value
    rows of hidden keys poisoned with NaN change nothing (0 x NaN must not reach the output)."""
    batch, seqlen_q, heads, heads_kv, seqlen_k, head_dim, splits, mask_batch, kv_lengths = case
    q, k, v = random_qkv(rng, batch, seqlen_q, seqlen_k, heads, heads_kv, head_dim, dtype=DTYPES[dtype])
    d_out = normal(rng, (batch, seqlen_q, heads, head_dim), DTYPES[dtype])
    shown = rng.random((mask_batch, 1, 1, seqlen_k)) < 0.6 if pattern == "random" else \
        np.ones((mask_batch, 1, 1, seqlen_k), bool)
    if pattern == "random":
        shown[..., 200:1400] = False  # whole hidden tiles, in every run's share
    kwargs = {"attention_mask": shown, "causal": "bottom_right"}
    if kv_lengths is not None:
        kwargs["kv_lengths"] = np.array(kv_lengths, np.int32)
    with on_device(device, head_dim=head_dim):
        split = _run(q, k, v, d_out, split_kv=splits, **kwargs)
        unsplit = _run(q, k, v, d_out, split_kv=False, **kwargs)
        hidden = np.broadcast_to(~shown[:, 0, 0, :, None, None], v.shape)
        poisoned = tf.constant(np.where(hidden, np.nan, v.numpy().astype(np.float32)), v.dtype)
        out_poisoned = _flash_attention(q, k, poisoned, split_kv=splits, **kwargs)
    check_against_reference(split, q, k, v, d_out, dtype, device, **kwargs)
    np.testing.assert_array_equal(out_poisoned.numpy(), split[0])
    if dtype == "float32":
        _assert_equal_to_float32_rounding(split, unsplit, device)


def test_split_kv_refusals(rng):
    # Three query heads per KV head under a causal mask over several rows: no shift finds a row's position.
    q, k, v = random_qkv(rng, 1, 4, 4096, 12, 4, 32)
    with pytest.raises(ValueError, match="power of two"):
        _flash_attention(q, k, v, causal="bottom_right", split_kv=1)
    # The decode path takes key masks only (one row for every head and query row): another mask is never dropped.
    q, k, v = random_qkv(rng, 1, 1, 4096, 8, 2, 32)
    with pytest.raises(ValueError, match="split_kv"):
        _flash_attention(q, k, v, attention_mask=np.ones((1, 8, 1, 4096), bool), split_kv=2)


@pytest.mark.parametrize("extra,match", [
    ({}, "must divide the query length"),
    ({"dropout_rate": 0.1}, "takes no dropout"),
    ({"q_lengths": [2]}, "takes no q_lengths"),
    ({"num_splits": 0}, "num_splits must be in"),
])
def test_op_attribute_errors(extra, match, rng):
    """position_shift's rules and num_splits' range, from the op itself."""
    from tf_flash.ops import _absent, _ops, _seed, NO_MASK_SHAPE, _NO_LENGTHS_SHAPE, _NO_SEGMENT_IDS_SHAPE
    q, k, v = random_qkv(rng, 1, 6 if not extra or "num_splits" in extra else 4, 64, 4, 1, 16)
    rate = extra.get("dropout_rate", 0.0)
    no_ids = _absent(_NO_SEGMENT_IDS_SHAPE, tf.int32, None)
    with tf.device("/CPU:0"), pytest.raises((tf.errors.InvalidArgumentError, ValueError), match=match):
        _ops.tf_flash_flash_attention(
            query=q, key=k, value=v,
            q_lengths=tf.constant(extra["q_lengths"], tf.int32) if "q_lengths" in extra else
            _absent(_NO_LENGTHS_SHAPE, tf.int32, None),
            kv_lengths=_absent(_NO_LENGTHS_SHAPE, tf.int32, None),
            attention_mask=_absent(NO_MASK_SHAPE, tf.bool, None), block_mask=_absent(NO_MASK_SHAPE, tf.bool, None),
            q_segment_ids=no_ids, kv_segment_ids=no_ids, seed=_seed(1 if rate else None, rate), scale=0.25,
            causal=True, bottom_right=True, dropout_rate=rate, position_shift=0 if "num_splits" in extra else 2,
            num_splits=extra.get("num_splits", 1))


@pytest.mark.parametrize("mode", ["tf.function", "xla"])
def test_graph_and_xla_match_eager(mode, rng):
    q, k, v = random_qkv(rng, 2, 1, 4096, 8, 2, 32)
    d_out = normal(rng, (2, 1, 8, 32))
    kwargs = dict(causal="bottom_right", kv_lengths=tf.constant([4096, 2222]), softcap=3.0,
                  attention_mask=rng.random((2, 1, 1, 4096)) < 0.8)
    if mode == "xla":  # and several causal rows, packed, through the XLA custom call
        q, d_out = tf.concat([q, q[:, :, ::-1]], 1), tf.concat([d_out, d_out], 1)
    with tf.device("/CPU:0"):
        eager = _run(q, k, v, d_out, **kwargs)
        traced = _run(q, k, v, d_out, mode=mode, **kwargs)
    for got, want in zip(traced, eager):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6)


def test_the_public_call_takes_the_decode_path(rng, monkeypatch):
    import tf_flash  # pylint: disable=import-outside-toplevel
    taken = []
    original = _decode.plan
    monkeypatch.setattr(_decode, "plan", lambda *args, **kwargs: taken.append(original(*args, **kwargs)) or taken[-1])
    q, k, v = random_qkv(rng, 1, 1, 8192, 32, 8, 64)
    ref, _ = reference_attention(q, k, v, causal="bottom_right", kv_lengths=[5000])
    out = tf_flash.flash_attention(q, k, v, causal="bottom_right", kv_lengths=[5000])
    assert taken == [8] and relative_error(out, ref) < 1e-5
    out = tf.function(lambda q, k, v: tf_flash.flash_attention(q, k, v, causal="bottom_right", kv_lengths=[5000]),
                      jit_compile=True)(q, k, v)
    assert taken == [8, 8] and relative_error(out, ref) < 1e-5


# The op's num_splits with a full attention mask (split on the GPU too), where the GPU kernels run the call whole
# (segment ids, dropout) and the CPU kernel splits, and with more runs than key tiles (empty runs): the same
# attention either way.
@pytest.mark.parametrize("device", [pytest.param(*d.values, marks=d.marks, id=d.id) for d in DEVICES])
@pytest.mark.parametrize("feature", ["attention_mask", "segment_ids", "dropout", "more runs than key tiles"])
def test_num_splits_with_every_feature(device, feature, rng):
    from tf_flash.ops import _absent, _ops, _seed, NO_MASK_SHAPE, _NO_LENGTHS_SHAPE, _NO_SEGMENT_IDS_SHAPE
    batch, seqlen_q, seqlen_k, heads = 2, 70, 1100, 4
    q, k, v = random_qkv(rng, batch, seqlen_q, seqlen_k, heads, 2, 64, dtype=tf.float16)
    q_ids = np.repeat(np.arange(1, 4), 24)[None, :seqlen_q].repeat(batch, 0)  # three documents
    kv_ids = np.repeat(np.arange(1, 4), 367)[None, :seqlen_k].repeat(batch, 0)
    no_ids = _absent(_NO_SEGMENT_IDS_SHAPE, tf.int32, None)
    inputs = dict(
        q_lengths=_absent(_NO_LENGTHS_SHAPE, tf.int32, None), kv_lengths=tf.constant([1100, 901], tf.int32),
        attention_mask=(tf.constant(rng.random((batch, 1, seqlen_q, seqlen_k)) < 0.7)
                        if feature == "attention_mask" else _absent(NO_MASK_SHAPE, tf.bool, None)),
        block_mask=_absent(NO_MASK_SHAPE, tf.bool, None),
        q_segment_ids=tf.constant(q_ids, tf.int32) if feature == "segment_ids" else no_ids,
        kv_segment_ids=tf.constant(kv_ids, tf.int32) if feature == "segment_ids" else no_ids,
        seed=_seed(7 if feature == "dropout" else None, 0.2 if feature == "dropout" else 0.0), scale=0.125,
        dropout_rate=0.2 if feature == "dropout" else 0.0)
    with on_device(device, head_dim=64):
        whole = _ops.tf_flash_flash_attention(query=q, key=k, value=v, num_splits=1, **inputs)
        split = _ops.tf_flash_flash_attention(query=q, key=k, value=v,
                                              num_splits=64 if feature.startswith("more") else 3, **inputs)
    tol = 2e-3
    np.testing.assert_allclose(split[0].numpy().astype(np.float32), whole[0].numpy().astype(np.float32),
                               rtol=tol, atol=tol)
    lse_whole, lse_split = whole[1].numpy(), split[1].numpy()
    np.testing.assert_array_equal(np.isfinite(lse_split), np.isfinite(lse_whole))
    finite = np.isfinite(lse_whole)
    np.testing.assert_allclose(lse_split[finite], lse_whole[finite], rtol=1e-5, atol=1e-5)
