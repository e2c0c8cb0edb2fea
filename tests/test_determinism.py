"""Op determinism (issue 16, item 1): identical inputs give bit-identical gradients. The CPU backward always
does (dQ partial sums in a fixed order); the GPU backward does with deterministic=True or under
tf.config.experimental.enable_op_determinism() (per-CTA dQ accumulators summed in a fixed order instead
of float atomics)."""
import zlib

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.framework import config as tf_config

from reference import reference_attention_grad, relative_error

import tf_flash

_GPUS = tf.config.list_physical_devices("GPU")
gpu = [pytest.mark.gpu, pytest.mark.skipif(not _GPUS, reason="no GPU")]
DEVICES = [pytest.param("/CPU:0", id="cpu"), pytest.param("/GPU:0", id="gpu", marks=gpu)]


def _rng(request):
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
def op_determinism():
    """TF's op determinism switched on for one test, and off again after it."""
    tf.config.experimental.enable_op_determinism()
    try:
        yield
    finally:
        tf_config.disable_op_determinism()


def _grads(q, k, v, dout, device, use_function, **kwargs):
    def fn():
        with tf.GradientTape() as tape:
            tape.watch([q, k, v])
            out = tf_flash.flash_attention(q, k, v, **kwargs)
            loss = tf.reduce_sum(tf.cast(out, tf.float32) * dout)
        return tape.gradient(loss, [q, k, v])

    with tf.device(device):
        result = tf.function(fn)() if use_function else fn()
    return [x.numpy() for x in result]


def _inputs(rng, batch, sq, sk, heads, heads_kv, dim, dtype):
    shapes = ((batch, sq, heads, dim), (batch, sk, heads_kv, dim), (batch, sk, heads_kv, dim))
    q, k, v = (tf.constant(rng.standard_normal(s).astype(np.float32), dtype) for s in shapes)
    dout = tf.constant(rng.standard_normal((batch, sq, heads, dim)).astype(np.float32))
    return q, k, v, dout


def _assert_bit_identical(runs):
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            np.testing.assert_array_equal(a, b)


# (batch, sq, sk, heads, heads_kv, dim): few (batch, kv head) units, so that the GPU's deterministic
# mode gives one CTA per key tile; and many units, so that each CTA loops over several key tiles.
SHAPES = {"few_units": (1, 300, 1100, 4, 2, 64), "many_units": (8, 257, 2100, 32, 16, 64)}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("use_function", [False, True], ids=["eager", "function"])
@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("mode", ["argument", "op_determinism"])
def test_deterministic_backward_bit_identical(request, device, use_function, shape, mode):
    if "CPU" in device and shape == "many_units":
        pytest.skip("a GPU case (several key tiles per CTA); on the CPU few_units covers the path")
    rng = _rng(request)
    batch, sq, sk, heads, heads_kv, dim = SHAPES[shape]
    dtype = tf.float16 if "GPU" in device else tf.float32
    q, k, v, dout = _inputs(rng, batch, sq, sk, heads, heads_kv, dim, dtype)
    kwargs = dict(causal=True, dropout_rate=0.1, seed=[3, 4])
    if mode == "argument":
        kwargs["deterministic"] = True
        runs = [_grads(q, k, v, dout, device, use_function, **kwargs) for _ in range(3)]
    else:
        request.getfixturevalue("op_determinism")
        runs = [_grads(q, k, v, dout, device, use_function, **kwargs) for _ in range(3)]
    _assert_bit_identical(runs)
    # And the deterministic gradients are the gradients (the default path's, to rounding).
    default = _grads(q, k, v, dout, device, use_function, causal=True, dropout_rate=0.1, seed=[3, 4],
                     deterministic=False)
    for a, b in zip(runs[0], default):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.abs(a - b).max() <= (2e-2 if dtype == tf.float16 else 1e-5) * max(1.0, np.abs(b).max())


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("masks", ["documents", "blocks"])
def test_deterministic_backward_with_masks_bit_identical(request, head_dim, masks):
    """The deterministic dQ where the backward's kernel loops over several key tiles per CTA (many (batch,
    kv head) units), with an attention mask (the Hopper kernel's packed path) or a block mask of whole tiles,
    GQA and odd lengths: bit-identical runs, the gradients of float64 attention."""
    if not _GPUS:
        pytest.skip("no GPU")
    rng = _rng(request)
    batch, sq, sk, heads, heads_kv = 4, 300, 1100, 32, 16
    q, k, v, dout = _inputs(rng, batch, sq, sk, heads, heads_kv, head_dim, tf.bfloat16)
    if masks == "documents":  # query i sees the keys of its document (every 150 rows: 550 keys)
        kw = dict(attention_mask=(np.arange(sq)[:, None] // 150) == (np.arange(sk)[None, :] * sq // sk // 150))
    else:
        kw = dict(block_mask=rng.random((batch, heads, 3, 9)) < 0.6, block_size=128, causal=True)
    runs = [_grads(q, k, v, dout, "/GPU:0", False, deterministic=True, **kw) for _ in range(3)]
    _assert_bit_identical(runs)
    want = reference_attention_grad(*(tf.cast(x, tf.float64).numpy() for x in (q, k, v)), dout.numpy(), **kw)
    for name, got, ref in zip("qkv", runs[0], want):
        assert relative_error(got, ref) <= 3e-2, f"d{name}"


@pytest.mark.parametrize("device", DEVICES)
def test_deterministic_gradients_match_reference(request, device):
    rng = _rng(request)
    dtype = tf.float16 if "GPU" in device else tf.float32
    q, k, v, dout = _inputs(rng, 2, 200, 700, 4, 2, 64, dtype)
    kw = dict(window=(100, 30), kv_lengths=[700, 333])
    got = _grads(q, k, v, dout, device, False, deterministic=True, **kw)
    for name, a, want in zip("qkv", got, reference_attention_grad(q, k, v, dout, **kw)):
        err = np.abs(np.asarray(a, np.float64) - want).max() / max(1.0, np.abs(want).max())
        assert err < (2e-2 if dtype == tf.float16 else 1e-4), f"d{name}: {err}"


def test_cpu_backward_is_deterministic_without_asking(request):
    rng = _rng(request)
    q, k, v, dout = _inputs(rng, 2, 333, 517, 4, 1, 32, tf.float32)
    runs = [_grads(q, k, v, dout, "/CPU:0", False, attention_mask=np.tril(np.ones((333, 517), bool)))
            for _ in range(3)]
    _assert_bit_identical(runs)


@pytest.mark.parametrize("bad", ["yes", 1, 0.0])
def test_deterministic_argument_checked(bad):
    q = tf.zeros([1, 4, 1, 8])
    with pytest.raises(ValueError, match=r"deterministic.*Received: deterministic="):
        tf_flash.flash_attention(q, q, q, deterministic=bad)
    with pytest.raises(ValueError, match="deterministic"):
        tf_flash.layers.FlashAttention(deterministic=bad)
    with pytest.raises(ValueError, match="deterministic"):
        tf_flash.layers.FlashMultiHeadAttention(num_heads=2, key_dim=4, deterministic=bad)


def test_layers_carry_deterministic():
    layer = tf_flash.layers.FlashAttention(deterministic=True)
    assert layer.get_config()["deterministic"] is True
    assert tf_flash.layers.FlashAttention.from_config(layer.get_config()).deterministic is True
    mha = tf_flash.layers.FlashMultiHeadAttention(num_heads=2, key_dim=4, deterministic=True)
    assert tf_flash.layers.FlashMultiHeadAttention.from_config(mha.get_config()).deterministic is True
    x = tf.random.stateless_normal([2, 9, 8], seed=[1, 2])
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = mha(x, x)
    assert tape.gradient(y, x).shape == x.shape
