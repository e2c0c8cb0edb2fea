"""tf_flash.keras: Keras' own flash-attention switch served by tf_flash on the TensorFlow backend.

keras.ops.dot_product_attention with the switch on against Keras' standard path (switch off) and a
float64 reference of Keras' semantics, over Keras' mask broadcasts, causal, GQA, soft cap, dtypes,
eager / tf.function; MultiHeadAttention (flash with dropout lifted); enable / disable / context restore
Keras' very objects; fallbacks with a warning; saving and a fresh-process reload; XLA."""
import json
import os
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest
import tensorflow as tf
import keras

import tf_flash
from tf_flash import keras as flash_keras
from device_util import DEVICES, DTYPES, normal, random_qkv
from device_util import float32_tolerance as f32_tol
from reference import relative_error, to_numpy

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def _hook_off_after():
    yield
    flash_keras.disable()
    keras.config.enable_flash_attention()  # Keras' default global (None)


def keras_reference(q, k, v, *, mask=None, is_causal=False, scale=None, soft_cap=None):
    """Keras' dot_product_attention in float64: masked logits set to a large negative value (so a row
    with nothing visible averages all values), causal top-left, kv heads repeated for GQA."""
    q, k, v = (to_numpy(x) for x in (q, k, v))
    heads, heads_kv = q.shape[2], k.shape[2]
    k, v = np.repeat(k, heads // heads_kv, axis=2), np.repeat(v, heads // heads_kv, axis=2)
    scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
    logits = np.einsum("btnh,bsnh->bnts", q, k) * scale
    if soft_cap is not None:
        logits = soft_cap * np.tanh(logits / soft_cap)
    visible = np.ones(logits.shape, bool)
    if mask is not None:
        visible &= np.asarray(mask, bool)
    if is_causal:
        visible &= np.tril(np.ones(logits.shape[-2:], bool))
    logits = np.where(visible, logits, -1e300)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("bnts,bsnh->btnh", probs, v)


def _run(fn, mode):
    if mode == "xla":
        return tf.function(fn, jit_compile=True)()
    return tf.function(fn)() if mode == "graph" else fn()


def _assert_switch_parity(q, k, v, d_out, mode, device, **kwargs):
    """keras.ops.dot_product_attention(q, k, v, **kwargs) with the switch off and on (mode: eager, graph or
    xla): the outputs and the gradients of sum(out * d_out) agree. Returns the switch's output."""
    def run(flash):
        def fn():
            with tf.GradientTape() as tape:
                tape.watch([q, k, v])
                out = keras.ops.dot_product_attention(q, k, v, flash_attention=flash, **kwargs)
                loss = tf.reduce_sum(out * d_out)
            return out, tape.gradient(loss, [q, k, v])
        return _run(fn, mode)

    with tf.device(device):
        standard_out, standard_grads = run(False)
        with flash_keras.enabled():
            flash_out, flash_grads = run(True)
    np.testing.assert_allclose(to_numpy(flash_out), to_numpy(standard_out), atol=f32_tol(device, 2e-5),
                               rtol=f32_tol(device, 1e-4))
    for name, a, b in zip("qkv", flash_grads, standard_grads):
        np.testing.assert_allclose(to_numpy(a), to_numpy(b), atol=f32_tol(device, 5e-5),
                                   rtol=f32_tol(device, 1e-4), err_msg=name)
    return flash_out


# Keras' mask broadcasts to [B, N, T, S] (right-aligned, each dim 1 or full), as shapes built from
# (B, N, T, S); a None entry drops the leading axes (lower rank).
MASK_SHAPES = {
    "none": None,
    "BNTS": ("B", "N", "T", "S"),
    "B1TS": ("B", 1, "T", "S"),
    "B11S": ("B", 1, 1, "S"),
    "B1T1": ("B", 1, "T", 1),  # a query mask broadcast over the keys
    "B111": ("B", 1, 1, 1),
    "11TS": (1, 1, "T", "S"),
    "1N1S": (1, "N", 1, "S"),
    "BN11": ("B", "N", 1, 1),
    "NTS": ("N", "T", "S"),
    "TS": ("T", "S"),
    "S": ("S",),
    "scalar": (),
}


def _mask(rng, name, batch, heads, seqlen_q, seqlen_k):
    spec = MASK_SHAPES[name]
    if spec is None:
        return None
    sizes = {"B": batch, "N": heads, "T": seqlen_q, "S": seqlen_k}
    shape = tuple(sizes.get(d, d) for d in spec)
    mask = rng.random(shape) > 0.3
    if len(shape) >= 2 and shape[-2] > 3:
        mask[..., 3, :] = False  # a query row that sees nothing: Keras averages the values there
    return mask


# (batch, seqlen_q, seqlen_k, heads, heads_kv, head_dim): odd lengths, Sq != Sk, GQA.
SHAPES = [(2, 19, 19, 4, 4, 16), (1, 37, 70, 4, 2, 32), (2, 70, 33, 6, 3, 8)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["eager", "graph"])
@pytest.mark.parametrize("mask_name", list(MASK_SHAPES))
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_op_parity_over_masks_causal_gqa(rng, device, mode, mask_name, is_causal, shape):
    batch, seqlen_q, seqlen_k, heads, heads_kv, head_dim = shape
    q, k, v = random_qkv(rng, *shape)
    mask = _mask(rng, mask_name, batch, heads, seqlen_q, seqlen_k)
    reference = keras_reference(q, k, v, mask=mask, is_causal=is_causal)
    with tf.device(device):
        standard = _run(lambda: keras.ops.dot_product_attention(q, k, v, mask=mask, is_causal=is_causal), mode)
        with flash_keras.enabled():
            flash = _run(lambda: keras.ops.dot_product_attention(
                q, k, v, mask=mask, is_causal=is_causal, flash_attention=True), mode)
    assert relative_error(standard, reference) < 1e-5
    assert relative_error(flash, reference) < f32_tol(device, 2e-5)
    np.testing.assert_allclose(to_numpy(flash), to_numpy(standard), atol=f32_tol(device, 2e-5),
                               rtol=f32_tol(device, 1e-4))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_op_parity_dtypes(rng, device, dtype):
    """Half precision: the hook's error against float64 at most 2x that of Keras' standard path."""
    q, k, v = random_qkv(rng, 2, 45, 45, 4, 2, 32, dtype=DTYPES[dtype])
    mask = _mask(rng, "B1TS", 2, 4, 45, 45)
    reference = keras_reference(q, k, v, mask=mask, is_causal=True)
    with tf.device(device):
        standard = keras.ops.dot_product_attention(q, k, v, mask=mask, is_causal=True)
        with flash_keras.enabled():
            flash = keras.ops.dot_product_attention(q, k, v, mask=mask, is_causal=True, flash_attention=True)
    assert flash.dtype == standard.dtype == DTYPES[dtype]
    floor = {"float32": f32_tol(device, 1e-5), "float16": 2e-3, "bfloat16": 1e-2}[dtype]
    assert relative_error(flash, reference) <= max(2 * relative_error(standard, reference), floor)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mask_name", ["none", "B1TS", "B11S"])
def test_gradients_match_keras(rng, device, mask_name):
    q, k, v = random_qkv(rng, 2, 29, 41, 4, 2, 16)
    mask = _mask(rng, mask_name, 2, 4, 29, 41)
    d_out = normal(rng, (2, 29, 4, 16))
    _assert_switch_parity(q, k, v, d_out, "eager", device, mask=mask, scale=0.3)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["eager", "graph"])
@pytest.mark.parametrize("prefix", [True, False])
def test_key_padding_mask_becomes_lengths(rng, monkeypatch, device, mode, prefix):
    """A [B, 1, 1, S] padding mask (KerasHub's encoders) that is a prefix runs as kv lengths (the kernel
    skips the padding); a row of length 0 and a non-prefix mask keep Keras' results."""
    q, k, v = random_qkv(rng, 3, 21, 45, 4, 2, 16)
    lengths = np.array([45, 17, 0])
    mask = (np.arange(45)[None, :] < lengths[:, None])[:, None, None, :]
    if not prefix:
        mask = mask.copy()
        mask[1, 0, 0, 3] = False
    seen = []
    original = tf_flash.ops.flash_attention

    def recording(*args, **kwargs):
        seen.append(kwargs.get("kv_lengths") is not None)
        return original(*args, **kwargs)

    monkeypatch.setattr(tf_flash.ops, "flash_attention", recording)
    with tf.device(device), flash_keras.enabled():
        got = _run(lambda: keras.ops.dot_product_attention(q, k, v, mask=mask, is_causal=True), mode)
    assert seen and all(seen)
    np.testing.assert_allclose(to_numpy(got), keras_reference(q, k, v, mask=mask, is_causal=True),
                               atol=f32_tol(device, 2e-5), rtol=f32_tol(device, 1e-4))


@pytest.mark.parametrize("jit_compile", [False, True])
def test_key_mask_in_a_graph_is_one_call_without_a_branch(rng, jit_compile):
    """A decoding step's cache mask ([B, 1, 1, S], a prefix or not) in a graph: one tf_flash call with the
    lengths and the mask, no tf.cond (a GPU runtime waits on the host for a conditional's predicate, in every
    layer of every step), on the decode path."""
    q, k, v = random_qkv(rng, 2, 1, 2100, 8, 2, 16)
    for lengths in ([2100, 1234], [2100, 0]):
        mask = (np.arange(2100)[None, :] < np.array(lengths)[:, None])[:, None, None, :]
        if lengths[1] == 0:
            mask[0, 0, 0, 7] = False  # not a prefix
        constant = tf.constant(mask)
        fn = tf.function(lambda q, k, v: keras.ops.dot_product_attention(q, k, v, mask=constant),  # noqa: B023
                         jit_compile=jit_compile)
        with flash_keras.enabled():
            got = fn(q, k, v)
            if jit_compile:
                hlo = fn.experimental_get_compiler_ir(q, k, v)(stage="hlo")
                assert "tf_flash_attention_fwd" in hlo and " conditional(" not in hlo
            else:
                ops = {op.type for op in fn.get_concrete_function(q, k, v).graph.get_operations()}
                assert "TfFlash>FlashAttention" in ops and not ops & {"If", "StatelessIf"}
        np.testing.assert_allclose(to_numpy(got), keras_reference(q, k, v, mask=mask), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["eager", "graph"])
@pytest.mark.parametrize("keys", ["prefix", "scattered", "not_a_product"])
def test_padding_product_mask_runs_as_key_mask(rng, monkeypatch, device, mode, keys):
    """A [B, 1, T, S] mask that is query padding x key padding (what Keras' masking builds for padded
    sequences) runs under the key mask alone: as kv lengths when the keys are a prefix, else as a
    [B, 1, 1, S] key mask; padded query rows (a batch row with none valid included) keep Keras' mean of the
    values. Any other [B, 1, T, S] mask runs as given. Outputs and gradients against Keras' own path."""
    q, k, v = random_qkv(rng, 3, 21, 45, 4, 2, 16)
    q_valid = np.arange(21)[None, :] < np.array([21, 9, 0])[:, None]
    k_valid = np.arange(45)[None, :] < np.array([45, 17, 30])[:, None]
    if keys == "scattered":
        k_valid[1, 3] = False
    mask = (q_valid[:, :, None] & k_valid[:, None, :])[:, None]
    if keys == "not_a_product":
        mask = mask.copy()
        mask[0, 0, 5, 7] = False
    d_out = normal(rng, (3, 21, 4, 16))
    calls = []
    original = tf_flash.ops.flash_attention

    def recording(*args, **kwargs):
        calls.append((tuple(kwargs["attention_mask"].shape) if kwargs.get("attention_mask") is not None else None,
                      kwargs.get("kv_lengths") is not None))
        return original(*args, **kwargs)

    monkeypatch.setattr(tf_flash.ops, "flash_attention", recording)
    _assert_switch_parity(q, k, v, d_out, mode, device, mask=mask, scale=0.3)
    if mode == "eager":  # one branch runs (graph mode traces both)
        expected = {"prefix": [(None, True)], "scattered": [((3, 1, 1, 45), True)],
                    "not_a_product": [((3, 1, 21, 45), False)]}[keys]
        assert [(None if m is None or m == (0, 0, 0, 0) else m, lengths) for m, lengths in calls] == expected


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["eager", "graph"])
@pytest.mark.parametrize("keys", ["prefix", "scattered", "not_causal"])
@pytest.mark.parametrize("seqlen_k", [21, 45])
def test_causal_padding_product_runs_causal_under_key_mask(rng, monkeypatch, device, mode, keys, seqlen_k):
    """A [B, 1, T, S] mask that is query padding x key padding x the causal triangle (a decoder's masks
    merged: MultiHeadAttention(use_causal_mask=True) with Keras masking, KerasHub's decoders) runs causal
    under the key mask alone (kv lengths when a prefix); rows that see nothing (a padded first key, a padded
    query) keep Keras' mean of the values. A mask that only looks like it runs as given. Outputs and
    gradients against Keras' own path."""
    q, k, v = random_qkv(rng, 3, 21, seqlen_k, 4, 2, 16)
    q_valid = np.arange(21)[None, :] < np.array([21, 9, 0])[:, None]
    k_valid = np.arange(seqlen_k)[None, :] < np.array([seqlen_k, 17, 12])[:, None]
    if keys != "prefix":
        k_valid[1, 0] = False  # left padding: query 0 of batch row 1 sees nothing
        k_valid[0, 5] = False
    causal = np.tril(np.ones((21, seqlen_k), bool))
    mask = (q_valid[:, :, None] & k_valid[:, None, :] & causal)[:, None]
    if keys == "not_causal":
        mask = mask.copy()
        mask[0, 0, 2, 7] = True  # a future key
    d_out = normal(rng, (3, 21, 4, 16))
    calls = []
    original = tf_flash.ops.flash_attention

    def recording(*args, **kwargs):
        mask_shape = kwargs["attention_mask"].shape if kwargs.get("attention_mask") is not None else None
        calls.append((None if mask_shape is None or tuple(mask_shape) == (0, 0, 0, 0) else tuple(mask_shape),
                      kwargs.get("kv_lengths") is not None, kwargs.get("causal")))
        return original(*args, **kwargs)

    monkeypatch.setattr(tf_flash.ops, "flash_attention", recording)
    flash_out = _assert_switch_parity(q, k, v, d_out, mode, device, mask=mask, scale=0.3)
    if mode == "eager":  # one branch runs (graph mode traces them all)
        expected = {"prefix": [(None, True, True)], "scattered": [((3, 1, 1, seqlen_k), True, True)],
                    "not_causal": [((3, 1, 21, seqlen_k), False, False)]}[keys]
        assert calls == expected
    np.testing.assert_allclose(to_numpy(flash_out), keras_reference(q, k, v, mask=mask, scale=0.3),
                               atol=f32_tol(device, 2e-5), rtol=f32_tol(device, 1e-4))


def test_multi_query_attention_served(rng):
    """One kv head: Keras' own TF path fails (einsum shapes); the hook serves it."""
    q, k, v = random_qkv(rng, 2, 17, 23, 4, 1, 16)
    with flash_keras.enabled():
        flash = keras.ops.dot_product_attention(q, k, v, flash_attention=True)
    assert relative_error(flash, keras_reference(q, k, v)) < 2e-5


def test_none_follows_the_global_switch(rng):
    """flash_attention=None: tf_flash unless keras.config.disable_flash_attention(); True: always."""
    q, k, v = random_qkv(rng, 1, 9, 9, 2, 2, 8)
    calls = []
    original = tf_flash.ops.flash_attention

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    with flash_keras.enabled(), pytest.MonkeyPatch.context() as patch:
        patch.setattr(tf_flash.ops, "flash_attention", counting)
        keras.ops.dot_product_attention(q, k, v)
        assert len(calls) == 1
        keras.config.disable_flash_attention()
        keras.ops.dot_product_attention(q, k, v)
        assert len(calls) == 1
        keras.ops.dot_product_attention(q, k, v, flash_attention=True)
        assert len(calls) == 2
        keras.ops.dot_product_attention(q, k, v, flash_attention=False)
        assert len(calls) == 2


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["eager", "graph"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_soft_cap(rng, device, mode, dtype):
    """attn_logits_soft_cap (Keras rejects it off JAX-on-TPU) served: cap * tanh(logits / cap)."""
    q, k, v = random_qkv(rng, 2, 33, 33, 4, 2, 16, dtype=DTYPES[dtype])
    q = q * 4  # logits large enough for the cap to matter
    mask = _mask(rng, "B1TS", 2, 4, 33, 33)
    reference = keras_reference(q, k, v, mask=mask, is_causal=True, soft_cap=2.5)
    uncapped = keras_reference(q, k, v, mask=mask, is_causal=True)
    assert np.linalg.norm(reference - uncapped) > 0.05 * np.linalg.norm(reference)
    with tf.device(device), flash_keras.enabled():
        flash = _run(lambda: keras.ops.dot_product_attention(
            q, k, v, mask=mask, is_causal=True, attn_logits_soft_cap=2.5), mode)
    assert relative_error(flash, reference) < {"float32": f32_tol(device, 2e-5), "float16": 3e-3, "bfloat16": 2e-2}[dtype]


def test_soft_cap_gradients(rng):
    q, k, v = random_qkv(rng, 1, 21, 21, 2, 2, 8)
    cap = 1.5

    def loss_of(attend):
        with tf.GradientTape() as tape:
            tape.watch([q, k, v])
            loss = tf.reduce_sum(tf.sin(attend()))
        return tape.gradient(loss, [q, k, v])

    def capped_standard():  # Keras' math with the cap inserted, in float64
        q64, k64, v64 = (tf.cast(x, tf.float64) for x in (q, k, v))
        logits = tf.einsum("btnh,bsnh->bnts", q64, k64) / np.sqrt(8.0)
        probs = tf.nn.softmax(cap * tf.tanh(logits / cap), axis=-1)
        return tf.einsum("bnts,bsnh->btnh", probs, v64)

    expected = loss_of(capped_standard)
    with flash_keras.enabled():
        got = loss_of(lambda: keras.ops.dot_product_attention(q, k, v, attn_logits_soft_cap=cap))
    for name, a, b in zip("qkv", got, expected):
        np.testing.assert_allclose(to_numpy(a), to_numpy(b), atol=5e-5, rtol=1e-4, err_msg=name)


def test_soft_cap_without_flash_raises(rng):
    q, k, v = random_qkv(rng, 1, 5, 5, 2, 2, 8)
    with pytest.raises(ValueError, match="only supported for JAX on TPU"):
        keras.ops.dot_product_attention(q, k, v, attn_logits_soft_cap=2.0)  # hook off: Keras' error
    with flash_keras.enabled():
        with pytest.raises(ValueError, match="flash_attention=False"):
            keras.ops.dot_product_attention(q, k, v, attn_logits_soft_cap=2.0, flash_attention=False)
        with pytest.raises(ValueError, match="bias"):
            keras.ops.dot_product_attention(q, k, v, bias=tf.zeros([1, 1, 5, 5]), attn_logits_soft_cap=2.0)
        with pytest.raises(ValueError, match="Received: attn_logits_soft_cap=-1.0"):
            keras.ops.dot_product_attention(q, k, v, attn_logits_soft_cap=-1.0)


# ----------------------------------------------------------------------------------------------------
# Fallbacks: Keras' standard result, one warning that says why

@pytest.mark.parametrize("case", ["bias", "float64", "head_dim"])
def test_unservable_arguments_fall_back_with_one_warning(rng, case):
    head_dim = 264 if case == "head_dim" else 8
    dtype = tf.float64 if case == "float64" else tf.float32
    q, k, v = random_qkv(rng, 2, 11, 13, 2, 2, head_dim, dtype=dtype)
    bias = tf.constant(rng.standard_normal((2, 1, 11, 13)), dtype) if case == "bias" else None
    expected = keras.ops.dot_product_attention(q, k, v, bias=bias, is_causal=True)
    flash_keras._warned.clear()
    with flash_keras.enabled():
        with pytest.warns(UserWarning, match={"bias": "bias", "float64": "float64", "head_dim": "head dim"}[case]):
            got = keras.ops.dot_product_attention(q, k, v, bias=bias, is_causal=True, flash_attention=True)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # once only
            keras.ops.dot_product_attention(q, k, v, bias=bias, is_causal=True, flash_attention=True)
    np.testing.assert_array_equal(to_numpy(got), to_numpy(expected))


def test_keras_errors_are_kept(rng):
    """Inputs Keras' own function rejects still get Keras' error (no warning, no tf_flash error)."""
    q = tf.zeros([2, 5, 8])
    with flash_keras.enabled():
        with pytest.raises(ValueError, match="only supports 4D inputs"):
            keras.ops.dot_product_attention(q, q, q, flash_attention=True)


@pytest.mark.parametrize("device", DEVICES)
def test_xla_runs_the_kernel(rng, device):
    with tf.device(device):
        q, k, v = random_qkv(rng, 2, 37, 37, 4, 2, 16)
        mask = _mask(rng, "B1TS", 2, 4, 37, 37)
        flash_keras._warned.clear()
        with flash_keras.enabled(), warnings.catch_warnings():
            warnings.simplefilter("error")  # no fallback
            got = tf.function(lambda: keras.ops.dot_product_attention(q, k, v, mask=mask, is_causal=True),
                              jit_compile=True)()
    assert relative_error(got, keras_reference(q, k, v, mask=mask, is_causal=True)) < f32_tol(device, 2e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("keys", ["product", "causal_product", "other"])
def test_xla_padding_product_branches(rng, device, keys):
    """Under jit_compile the padding-product routing is a tf.cond whose every branch XLA compiles (the key
    mask, the causal key mask, the mask as given); each gives Keras' result, outputs and gradients."""
    q, k, v = random_qkv(rng, 2, 29, 29, 4, 2, 16)
    valid = np.arange(29)[None, :] < np.array([29, 13])[:, None]
    mask = valid[:, :, None] & valid[:, None, :]
    if keys != "product":
        mask &= np.tril(np.ones((29, 29), bool))
    if keys == "other":
        mask[0, 4, 9] = True
    mask = mask[:, None]
    d_out = normal(rng, (2, 29, 4, 16))
    _assert_switch_parity(q, k, v, d_out, "xla", device, mask=mask)


# ----------------------------------------------------------------------------------------------------
# The switch itself

def _hooked_objects():
    from keras.src.backend.tensorflow import nn as backend_nn
    from keras.src.ops import nn as op_module
    from keras.src.layers.attention.multi_head_attention import MultiHeadAttention
    import keras.src.ops
    return {
        "backend": backend_nn.dot_product_attention,
        "op": op_module.dot_product_attention,
        "keras.ops": keras.ops.dot_product_attention,
        "keras.ops.nn": keras.ops.nn.dot_product_attention,
        "keras.src.ops": keras.src.ops.dot_product_attention,
        "mha_init": MultiHeadAttention.__dict__["__init__"],
        "mha_compute": MultiHeadAttention.__dict__["_compute_attention"],
    }


def test_enable_disable_restore_the_very_objects():
    before = _hooked_objects()
    assert not flash_keras.is_enabled()
    flash_keras.enable()
    flash_keras.enable()  # idempotent
    during = _hooked_objects()
    assert all(during[name] is not before[name] for name in before), during
    assert during["keras.ops"] is during["op"] is during["keras.ops.nn"] is during["keras.src.ops"]
    flash_keras.disable()
    assert all(value is before[name] for name, value in _hooked_objects().items())
    flash_keras.disable()  # idempotent
    assert all(value is before[name] for name, value in _hooked_objects().items())


def test_context_manager_restores_the_previous_state():
    before = _hooked_objects()
    with flash_keras.enabled():
        assert flash_keras.is_enabled()
        with flash_keras.enabled():
            pass
        assert flash_keras.is_enabled()  # the inner block leaves the outer one in force
    assert not flash_keras.is_enabled()
    assert all(value is before[name] for name, value in _hooked_objects().items())
    flash_keras.enable()
    with flash_keras.enabled():
        pass
    assert flash_keras.is_enabled()
    with pytest.raises(RuntimeError):
        with flash_keras.enabled():
            raise RuntimeError("inside")
    assert flash_keras.is_enabled()


def test_keras_behaviour_after_disable(rng):
    q, k, v = random_qkv(rng, 1, 5, 5, 2, 2, 8)
    with flash_keras.enabled():
        keras.ops.dot_product_attention(q, k, v, flash_attention=True)
    with pytest.raises(ValueError, match="not supported in tensorflow backend"):
        keras.ops.dot_product_attention(q, k, v, flash_attention=True)
    with pytest.raises(ValueError, match="Dropout is not supported"):
        keras.layers.MultiHeadAttention(2, 8, dropout=0.1, flash_attention=True)


def test_untested_keras_version_refused(monkeypatch):
    monkeypatch.setattr(keras, "__version__", "3.99.0")
    with pytest.raises(RuntimeError, match=r"Received: keras.__version__='3.99.0'"):
        flash_keras.enable()
    assert not flash_keras.is_enabled()
    monkeypatch.setenv("TF_FLASH_KERAS_ALLOW_UNTESTED", "1")
    flash_keras.enable()
    assert flash_keras.is_enabled()


def test_moved_internals_refused(monkeypatch):
    from keras.src.backend.tensorflow import nn as backend_nn

    def moved(query, key, value, bias=None, mask=None, scale=None, is_causal=False, flash_attention=None):
        raise AssertionError("never called")

    monkeypatch.setattr(backend_nn, "dot_product_attention", moved)
    with pytest.raises(RuntimeError, match="another signature"):
        flash_keras.enable()
    assert not flash_keras.is_enabled()


def test_other_backend_refused(monkeypatch):
    monkeypatch.setattr(keras.config, "backend", lambda: "jax")
    with pytest.raises(ValueError, match="Received: keras.config.backend\\(\\)='jax'"):
        flash_keras.enable()


# ----------------------------------------------------------------------------------------------------
# MultiHeadAttention

def _mha_pair(rng, dropout=0.0, **kwargs):
    standard = keras.layers.MultiHeadAttention(4, 8, dropout=dropout, seed=3, **kwargs)
    flash = keras.layers.MultiHeadAttention(4, 8, dropout=dropout, seed=3, flash_attention=True, **kwargs)
    x = normal(rng, (2, 23, 16))
    standard(x, x)
    flash(x, x)
    flash.set_weights(standard.get_weights())
    return standard, flash, x


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("masking", ["none", "causal", "attention_mask", "keras_padding", "causal_keras_padding"])
def test_multi_head_attention_parity(rng, device, masking):
    with tf.device(device):
        with flash_keras.enabled():
            standard, flash, x = _mha_pair(rng)
            kwargs = {}
            if masking == "causal":
                kwargs["use_causal_mask"] = True
            elif masking == "attention_mask":
                kwargs["attention_mask"] = tf.constant(rng.random((2, 23, 23)) > 0.4)
            elif masking == "keras_padding":
                kwargs["query_mask"] = kwargs["value_mask"] = tf.sequence_mask([23, 11], 23)
            elif masking == "causal_keras_padding":  # a decoder: padding x causal, served causal with lengths
                kwargs["query_mask"] = kwargs["value_mask"] = tf.sequence_mask([23, 11], 23)
                kwargs["use_causal_mask"] = True
            calls = []
            original = tf_flash.ops.flash_attention
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(tf_flash.ops, "flash_attention",
                              lambda *a, **kw: calls.append(kw) or original(*a, **kw))
                got = flash(x, x, **kwargs)
            assert calls, "tf_flash did not run"
            if masking == "causal_keras_padding":
                assert calls[0]["causal"] and calls[0].get("kv_lengths") is not None
        keras.config.disable_flash_attention()
        standard_layer = keras.layers.MultiHeadAttention(4, 8, seed=3)
        standard_layer(x, x)
        standard_layer.set_weights(standard.get_weights())
        expected = standard_layer(x, x, **kwargs)
    np.testing.assert_allclose(to_numpy(got), to_numpy(expected), atol=f32_tol(device, 2e-5),
                               rtol=f32_tol(device, 1e-4))


def test_multi_head_attention_dropout_with_flash(rng):
    """Keras refuses dropout with flash_attention=True; with the hook, tf_flash's in-kernel dropout."""
    keras.utils.set_random_seed(0)
    with flash_keras.enabled():
        layer = keras.layers.MultiHeadAttention(4, 8, dropout=0.25, flash_attention=True, seed=5)
        x = normal(rng, (2, 31, 16))
        inference = layer(x, x, training=False)
        assert layer.get_config()["dropout"] == 0.25
        calls = []
        original = tf_flash.ops.flash_attention

        def counting(*args, **kwargs):
            calls.append(kwargs.get("dropout_rate"))
            return original(*args, **kwargs)

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(tf_flash.ops, "flash_attention", counting)
            first = layer(x, x, training=True)
            second = layer(x, x, training=True)
            again = layer(x, x, training=False)
        assert calls == [0.25, 0.25, 0.0]
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(layer(x, x, training=True) ** 2)
        grads = tape.gradient(loss, layer.trainable_weights)
    assert all(g is not None and np.isfinite(to_numpy(g)).all() for g in grads)
    np.testing.assert_array_equal(to_numpy(again), to_numpy(inference))
    assert not np.allclose(to_numpy(first), to_numpy(inference))
    assert not np.allclose(to_numpy(first), to_numpy(second))  # a fresh mask per step
    # Inference equals Keras' layer without dropout and the same weights.
    keras.config.disable_flash_attention()
    plain = keras.layers.MultiHeadAttention(4, 8)
    plain(x, x)
    plain.set_weights(layer.get_weights())
    np.testing.assert_allclose(to_numpy(inference), to_numpy(plain(x, x)), atol=2e-5)


def test_multi_head_attention_scores_keep_keras_path(rng):
    with flash_keras.enabled():
        layer = keras.layers.MultiHeadAttention(2, 8)  # flash None
        x = normal(rng, (1, 7, 16))
        out, scores = layer(x, x, return_attention_scores=True)
    assert scores.shape == (1, 2, 7, 7)


# ----------------------------------------------------------------------------------------------------
# Saving: a model built and saved with the switch on reloads in a fresh process

def _mha_model():
    tokens = keras.Input((None,), dtype="int32")
    x = keras.layers.Embedding(30, 16, mask_zero=True)(tokens)
    x = keras.layers.MultiHeadAttention(4, 4, flash_attention=True, dropout=0.1, name="mha")(
        x, x, use_causal_mask=True)
    x = keras.layers.GlobalAveragePooling1D()(x)
    return keras.Model(tokens, keras.layers.Dense(3)(x))


def test_saved_with_the_switch_on_reloads_in_a_fresh_process(rng, tmp_path):
    tokens = rng.integers(1, 30, size=(4, 13)).astype("int32")
    tokens[1, 7:] = 0
    with flash_keras.enabled():
        keras.utils.set_random_seed(0)
        model = _mha_model()
        model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(tokens, np.arange(4) % 3, epochs=1, verbose=0)
        logits = model.predict(tokens, verbose=0)
        model.save(tmp_path / "model.keras")
        model.export(str(tmp_path / "exported"), verbose=False)
    np.savez(tmp_path / "expected.npz", tokens=tokens, logits=logits)
    script = textwrap.dedent(f"""
        import json, sys
        import numpy as np
        sys.path.insert(0, {REPO!r})
        import keras, tensorflow as tf, tf_flash
        tf_flash.keras.enable()
        expected = np.load({str(tmp_path / 'expected.npz')!r})
        calls = []
        original = tf_flash.ops.flash_attention
        tf_flash.ops.flash_attention = lambda *a, **k: calls.append(1) or original(*a, **k)
        model = keras.models.load_model({str(tmp_path / 'model.keras')!r})
        keras_diff = float(np.abs(model.predict(expected["tokens"], verbose=0) - expected["logits"]).max())
        exported = tf.saved_model.load({str(tmp_path / 'exported')!r})
        export_diff = float(np.abs(exported.serve(tf.constant(expected["tokens"])).numpy()
                                   - expected["logits"]).max())
        print(json.dumps({{"keras": keras_diff, "export": export_diff, "flash_calls": len(calls)}}))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["keras"] < 1e-5 and result["export"] < 1e-5, result
    assert result["flash_calls"] > 0, result  # the reloaded .keras model runs tf_flash


@pytest.mark.parametrize("repeat", ["heads", "heads, bfloat16", "sequence", "tiled heads"])
def test_repeated_kv_heads_reach_the_kernels_grouped(rng, monkeypatch, repeat):
    """K and V repeated to every query head (keras.ops.repeat on the heads axis, as KerasHub's Llama does) reach
    the kernels as the grouped KV heads in a graph, so each K/V byte is read once; a repeat along another
    axis, or heads tiled in another order, are taken as given. Outputs against Keras' own path."""
    dtype = tf.bfloat16 if repeat.endswith("bfloat16") else tf.float32
    q, k, v = random_qkv(rng, 2, 5, 37, 8, 2, 16, dtype=dtype)
    if repeat == "sequence":
        k, v = k[:, :1], v[:, :1]
    mask = tf.constant(rng.random((2, 1, 1, 37)) < 0.8)

    def widen(x):
        if repeat == "sequence":
            return keras.ops.repeat(keras.ops.repeat(x, 4, axis=2), 37, axis=1)
        if repeat == "tiled heads":
            return tf.tile(x, [1, 1, 4, 1])
        return keras.ops.repeat(x, 4, axis=2)

    heads_seen = []
    original = tf_flash.ops.flash_attention

    def recording(*args, **kwargs):
        heads_seen.append(args[1].shape[2])
        return original(*args, **kwargs)

    monkeypatch.setattr(tf_flash.ops, "flash_attention", recording)
    fn = tf.function(lambda q, k, v: keras.ops.dot_product_attention(q, widen(k), widen(v), mask=mask))
    with flash_keras.enabled():
        got = fn(q, k, v)
    assert heads_seen and set(heads_seen) == {2 if repeat.startswith("heads") else 8}
    want = keras_reference(q, widen(k), widen(v), mask=mask)
    tol = 2e-2 if dtype == tf.bfloat16 else 2e-5
    np.testing.assert_allclose(to_numpy(got).astype(np.float32), np.asarray(want, np.float32), atol=tol, rtol=tol)


@pytest.mark.parametrize("mode", ["graph", "xla"])
def test_repeated_kv_heads_train_as_keras(rng, monkeypatch, mode):
    """Gradients through K and V that the model repeated (KerasHub's Llama training step): the kernels take the
    grouped heads, the gradients reach the repeat's source summed over each group, as Keras' own path gives."""
    heads_seen = []
    original = tf_flash.ops.flash_attention
    monkeypatch.setattr(tf_flash.ops, "flash_attention",
                        lambda *args, **kwargs: heads_seen.append(args[1].shape[2]) or original(*args, **kwargs))
    q, k, v = random_qkv(rng, 2, 33, 33, 8, 2, 16)
    d_out = normal(rng, (2, 33, 8, 16))
    mask = tf.constant((np.arange(33)[None, :] < np.array([[33], [20]]))[:, None, None, :])

    def run(flash):
        def fn():
            with tf.GradientTape() as tape:
                tape.watch([q, k, v])
                out = keras.ops.dot_product_attention(q, keras.ops.repeat(k, 4, axis=2), keras.ops.repeat(v, 4, axis=2),
                                                      mask=mask, is_causal=True, flash_attention=flash)
                loss = tf.reduce_sum(out * d_out)
            return out, tape.gradient(loss, [q, k, v])
        return _run(fn, mode)

    standard_out, standard_grads = run(False)
    with flash_keras.enabled():
        flash_out, flash_grads = run(True)
    assert heads_seen and set(heads_seen) == {2}
    np.testing.assert_allclose(to_numpy(flash_out), to_numpy(standard_out), atol=2e-5, rtol=1e-4)
    for name, a, b in zip("qkv", flash_grads, standard_grads):
        np.testing.assert_allclose(to_numpy(a), to_numpy(b), atol=5e-5, rtol=1e-4, err_msg=name)
