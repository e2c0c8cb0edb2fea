"""causal="bottom_right": the Sq queries are the last Sq positions of each entry's keys (decoding against a KV
cache filled to kv_lengths). Against the float64 reference for Sq in {1, 7, 128} and Sk up to 40k with
ragged kv_lengths, with window, gradients, GQA, tf.function and XLA; and its argument errors."""
import numpy as np
import pytest
import tensorflow as tf

import tf_flash
from device_util import DEVICES, DTYPES, check_against_reference, normal, on_device, random_qkv, run_with_gradients

CASES = [pytest.param(*device.values, dtype, marks=device.marks, id=f"{dtype}-{device.id}")
         for device in DEVICES for dtype in DTYPES if device.id == "gpu" or dtype == "float32"]


def _run(q, k, v, d_out, mode="eager", **kwargs):
    return run_with_gradients(tf_flash.flash_attention, q, k, v, d_out, mode, **kwargs)


# (seqlen_q, seqlen_k, kv_lengths, heads, heads_kv, head_dim): one new token, a few (speculative decoding),
# a prefill chunk; caches filled to ragged lengths, past several tiles, and one shorter than the queries.
SHAPES = [
    (1, 40000, [40000, 12345], 4, 1, 64),
    (7, 3000, [3000, 1000], 8, 2, 128),
    (128, 1500, [1500, 300], 4, 2, 64),
    (128, 700, [700, 77], 2, 2, 32),  # entry 1: 77 keys for 128 queries, its first 51 rows see nothing
    (33, 33, None, 2, 1, 16),         # Sq == Sk without lengths: top-left's result
]


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"q{s[0]}-k{s[1]}")
def test_bottom_right_matches_the_reference(device, dtype, shape, rng):
    seqlen_q, seqlen_k, kv_lengths, heads, heads_kv, head_dim = shape
    batch = 2 if kv_lengths else 1
    q, k, v = random_qkv(rng, batch, seqlen_q, seqlen_k, heads, heads_kv, head_dim, dtype=DTYPES[dtype])
    d_out = normal(rng, (batch, seqlen_q, heads, head_dim), DTYPES[dtype])
    kwargs = dict(causal="bottom_right")
    if kv_lengths:
        kwargs["kv_lengths"] = np.array(kv_lengths, np.int32)
    with on_device(device, head_dim=head_dim):
        result = _run(q, k, v, d_out, **kwargs)
    check_against_reference(result, q, k, v, d_out, dtype, device, **kwargs)


@pytest.mark.parametrize("device", DEVICES)
def test_bottom_right_window(device, rng):
    """Sliding-window decoding (Mistral): the window is aligned to the bottom right too."""
    q, k, v = random_qkv(rng, 2, 16, 900, 4, 2, 64)
    d_out = normal(rng, (2, 16, 4, 64))
    kwargs = dict(causal="bottom_right", window=(256, 0), kv_lengths=np.array([900, 500], np.int32))
    with on_device(device, head_dim=64):
        result = _run(q, k, v, d_out, **kwargs)
    check_against_reference(result, q, k, v, d_out, "float32", device, **kwargs)


@pytest.mark.parametrize("mode", ["tf.function", "xla"])
def test_graph_and_xla_match_eager(mode, rng):
    q, k, v = random_qkv(rng, 2, 5, 300, 2, 1, 32)
    d_out = normal(rng, (2, 5, 2, 32))
    kwargs = dict(causal="bottom_right", kv_lengths=tf.constant([300, 123]))
    with tf.device("/CPU:0"):
        eager = _run(q, k, v, d_out, **kwargs)
        traced = _run(q, k, v, d_out, mode=mode, **kwargs)
    for got, want in zip(traced, eager):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6)


def test_top_left_by_name_is_true(rng):
    q, k, v = random_qkv(rng, 1, 40, 90, 2, 2, 16)
    np.testing.assert_array_equal(tf_flash.flash_attention(q, k, v, causal="top_left").numpy(),
                                  tf_flash.flash_attention(q, k, v, causal=True).numpy())


@pytest.mark.parametrize("causal", ["bottom-right", "BOTTOM_RIGHT", 1.0])
def test_bad_causal_names_the_argument(causal, rng):
    q, k, v = random_qkv(rng, 1, 8, 8, 2, 2, 16)
    with pytest.raises(ValueError, match=r"`causal` must be a bool"):
        tf_flash.flash_attention(q, k, v, causal=causal)


@pytest.mark.parametrize("use_causal_mask", [None, True, False])
def test_flash_attention_layer_takes_the_alignment(use_causal_mask, rng):
    """FlashAttention(causal="bottom_right"): the op's result, `use_causal_mask` turning it on and off in that
    alignment, and the setting kept by the layer's config."""
    import keras  # pylint: disable=import-outside-toplevel
    layer = tf_flash.layers.FlashAttention(causal="bottom_right")
    q, k, v = random_qkv(rng, 2, 3, 200, 4, 2, 16)
    lengths = np.array([200, 50], np.int32)
    got = layer(q, v, key=k, kv_lengths=lengths, use_causal_mask=use_causal_mask)
    causal = "bottom_right" if use_causal_mask in (None, True) else False
    want = tf_flash.flash_attention(q, k, v, kv_lengths=lengths, causal=causal)
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-6, atol=1e-6)
    assert keras.layers.deserialize(keras.layers.serialize(layer)).causal == "bottom_right"


def test_flash_attention_layer_refuses_an_unknown_alignment():
    with pytest.raises(ValueError, match=r"`causal` must be a bool"):
        tf_flash.layers.FlashAttention(causal="diagonal")
