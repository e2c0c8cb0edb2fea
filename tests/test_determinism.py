"""Op determinism (issue 16, item 1): identical inputs give bit-identical gradients. The CPU backward always
does (dQ partial sums in a fixed order); the GPU backward does with deterministic=True or under
tf.config.experimental.enable_op_determinism() (per-CTA dQ accumulators summed in a fixed order instead
of float atomics)."""
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.framework import config as tf_config

import tf_flash
from device_util import DEVICES, native_dtype, normal, random_qkv, run_flash, tolerance
from reference import reference_attention_grad, relative_error


@pytest.fixture
def op_determinism():
    """TF's op determinism switched on for one test, and off again after it."""
    tf.config.experimental.enable_op_determinism()
    try:
        yield
    finally:
        tf_config.disable_op_determinism()


def _grads(q, k, v, dout, device, use_function, **kwargs):
    """[dq, dk, dv] of sum(out * dout) (run_flash)."""
    return run_flash(q, k, v, device, use_function, dout=dout, **kwargs)[3:]


def _inputs(rng, batch, sq, sk, heads, heads_kv, dim, dtype):
    """random_qkv and an output gradient (float32)."""
    return (*random_qkv(rng, batch, sq, sk, heads, heads_kv, dim, dtype=dtype), normal(rng, (batch, sq, heads, dim)))


def _assert_bit_identical(runs):
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            np.testing.assert_array_equal(a, b)


# (batch, sq, sk, heads, heads_kv, dim): few (batch, kv head) units, so that the GPU's deterministic
# mode gives one CTA per key tile; and many units, so that each CTA loops over several key tiles.
SHAPES = {"few_units": (1, 300, 1100, 4, 2, 64), "many_units": (8, 257, 2100, 32, 16, 64)}
# many_units is a GPU case (several key tiles per CTA); on the CPU few_units covers the path.
DEVICE_SHAPES = [pytest.param(*device.values, shape, marks=device.marks, id=f"{shape}-{device.id}")
                 for device in DEVICES for shape in sorted(SHAPES) if device.id == "gpu" or shape == "few_units"]


@pytest.mark.parametrize("device,shape", DEVICE_SHAPES)
@pytest.mark.parametrize("use_function", [False, True], ids=["eager", "function"])
@pytest.mark.parametrize("mode", ["argument", "op_determinism"])
def test_deterministic_backward_bit_identical(request, rng, device, use_function, shape, mode):
    batch, sq, sk, heads, heads_kv, dim = SHAPES[shape]
    dtype = native_dtype(device)
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


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("masks", ["documents", "blocks"])
def test_deterministic_backward_with_masks_bit_identical(rng, head_dim, masks):
    """The deterministic dQ where the backward's kernel loops over several key tiles per CTA (many (batch,
    kv head) units), with an attention mask (the Hopper kernel's packed path) or a block mask of whole tiles,
    GQA and odd lengths: bit-identical runs, the gradients of float64 attention."""
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
def test_deterministic_gradients_match_reference(rng, device):
    dtype = native_dtype(device)
    q, k, v, dout = _inputs(rng, 2, 200, 700, 4, 2, 64, dtype)
    kw = dict(window=(100, 30), kv_lengths=[700, 333])
    got = _grads(q, k, v, dout, device, False, deterministic=True, **kw)
    for name, a, want in zip("qkv", got, reference_attention_grad(q, k, v, dout, **kw)):
        err = np.abs(np.asarray(a, np.float64) - want).max() / max(1.0, np.abs(want).max())
        assert err < tolerance("max_gradient", dtype, device), f"d{name}: {err}"


def test_cpu_backward_is_deterministic_without_asking(rng):
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
