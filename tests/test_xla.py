"""tf_flash under XLA: tf.function(jit_compile=True) and Keras jit_compile lower the op to typed-FFI custom
calls to our own kernels (cc/kernels/flash_attention_xla.cc). Every feature against the float64
reference and against the op without XLA, dropout masks, the compiled HLO, linear memory, Keras fit,
saving, import order and compile-time errors."""
import json
import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf

import philox_ref
import saving_helper
import tf_flash
from device_util import DEVICES, DTYPES, normal, on_device, random_qkv, tolerance
from reference import draw_features, reference_attention, reference_attention_grad, relative_error, to_numpy

MODES = ["eager", "function", "xla"]
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _wrap(fn, mode):
    if mode == "eager":
        return fn
    return tf.function(fn, jit_compile=(mode == "xla"))


# (batch, seqlen_q, seqlen_k, heads, heads_kv, head_dim, head_dim_v) and the features: lengths not
# multiples of the tiles, GQA, Dv != D.
FEATURES = {
    "plain": ((2, 77, 77, 4, 4, 32, 32), {}),
    "causal": ((1, 130, 67, 4, 2, 64, 64), {"causal": True}),
    "window": ((2, 90, 150, 2, 1, 16, 24), {"window": (13, 5)}),
    "lengths": ((3, 70, 90, 2, 2, 32, 32), {"q_lengths": "q", "kv_lengths": "kv"}),
    "mask_full": ((2, 45, 60, 2, 2, 16, 16), {"attention_mask": "full"}),
    "mask_broadcast": ((2, 45, 200, 6, 1, 16, 24), {"attention_mask": "rows"}),
    "block_mask": ((1, 150, 170, 4, 2, 32, 32), {"block_mask": "heads", "block_size": (32, 64)}),
    "gqa_dv": ((1, 100, 120, 6, 2, 40, 72), {"causal": True}),
    "scale": ((1, 33, 50, 2, 2, 12, 20), {"scale": 0.3}),  # head dims the GPU pads to 16, 24
    "all": ((2, 140, 160, 4, 2, 32, 48), {"causal": True, "window": (40, None), "q_lengths": "q",
                                           "kv_lengths": "kv", "attention_mask": "full",
                                           "block_mask": "heads", "block_size": 64}),
}


def _forward_backward(q, k, v, d_out, d_lse, kwargs):
    """out, lse and the gradients of sum(out * d_out) + sum(finite lse * d_lse)."""
    with tf.GradientTape() as tape:
        tape.watch([q, k, v])
        out, lse = tf_flash.flash_attention(q, k, v, return_lse=True, **kwargs)
        loss = (tf.reduce_sum(tf.cast(out, tf.float32) * tf.cast(d_out, tf.float32))
                + tf.reduce_sum(tf.where(tf.math.is_inf(lse), 0.0, lse) * d_lse))
    return (out, lse) + tuple(tape.gradient(loss, [q, k, v]))


def _case(rng, feature, dtype):
    shape, feature_kwargs = FEATURES[feature]
    batch, seqlen_q, seqlen_k, heads, heads_kv, head_dim, head_dim_v = shape
    q, k, v = random_qkv(rng, *shape, dtype=DTYPES[dtype])
    kwargs = draw_features(rng, feature_kwargs, batch, seqlen_q, seqlen_k, heads)
    d_out = normal(rng, (batch, seqlen_q, heads, head_dim_v), DTYPES[dtype])
    d_lse = normal(rng, (batch, heads, seqlen_q))
    return q, k, v, d_out, d_lse, kwargs


def _run(mode, device, q, k, v, d_out, d_lse, kwargs):
    # Masks and lengths are tensors (inputs of the compiled function), the rest Python values.
    tensor_kwargs = {name: tf.constant(value) for name, value in kwargs.items()
                     if name in ("q_lengths", "kv_lengths", "attention_mask", "block_mask")}
    static_kwargs = {name: value for name, value in kwargs.items() if name not in tensor_kwargs}

    def fn(q, k, v, d_out, d_lse, tensors):
        return _forward_backward(q, k, v, d_out, d_lse, dict(static_kwargs, **tensors))

    with on_device(device):
        return _wrap(fn, mode)(q, k, v, d_out, d_lse, tensor_kwargs)


def _cases():
    for feature in FEATURES:
        yield feature, "float32"
    for feature in ("plain", "all"):
        yield feature, "float16"
        yield feature, "bfloat16"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("feature,dtype", list(_cases()))
def test_every_feature_matches_reference_in_every_mode(device, mode, feature, dtype, rng):
    q, k, v, d_out, d_lse, kwargs = _case(rng, feature, dtype)
    out, lse, *grads = _run(mode, device, q, k, v, d_out, d_lse, kwargs)
    ref_out, ref_lse = reference_attention(q, k, v, **kwargs)
    finite = np.isfinite(ref_lse)
    ref_grads = reference_attention_grad(q, k, v, d_out, d_lse=np.where(finite, to_numpy(d_lse), 0.0), **kwargs)
    out_tol, grad_tol = tolerance("output", dtype, device), tolerance("gradient", dtype, device)
    assert out.dtype == DTYPES[dtype] and lse.dtype == tf.float32
    assert relative_error(out, ref_out) < out_tol
    np.testing.assert_array_equal(np.isfinite(lse.numpy()), finite)
    np.testing.assert_allclose(lse.numpy()[finite], ref_lse[finite], rtol=out_tol, atol=out_tol)
    for name, grad, ref in zip("qkv", grads, ref_grads):
        assert grad.dtype == DTYPES[dtype]
        assert relative_error(grad, ref) < grad_tol, name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("feature,dtype", list(_cases()))
def test_xla_equals_the_op_without_xla(device, feature, dtype, rng):
    case = _case(rng, feature, dtype)
    eager = _run("eager", device, *case)
    compiled = _run("xla", device, *case)
    tol = tolerance("same_kernels", dtype, device)
    for name, got, want in zip(["out", "lse", "dq", "dk", "dv"], compiled, eager):
        got, want = to_numpy(got), to_numpy(want)
        np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want), err_msg=name)
        finite = np.isfinite(want)
        assert relative_error(got[finite], want[finite]) <= tol, name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_dropout_same_mask_with_and_without_xla(device, dtype, rng):
    q, k, v = random_qkv(rng, 2, 70, 90, 4, 2, 32, 24, dtype=DTYPES[dtype])
    d_out = normal(rng, (2, 70, 4, 24), DTYPES[dtype])
    rate = 0.2

    def fn(q, k, v, d_out, seed):  # the seed is a run-time input of the compiled function
        with tf.GradientTape() as tape:
            tape.watch([q, k, v])
            out = tf_flash.flash_attention(q, k, v, causal=True, dropout_rate=rate, seed=seed)
        return (out,) + tuple(tape.gradient(out, [q, k, v], output_gradients=d_out))

    compiled = tf.function(fn, jit_compile=True)
    tol = tolerance("same_kernels", dtype, device)
    with on_device(device):
        results = {}
        for seed in ([7, 0], [123456789012, 5]):
            seed_tensor = tf.constant(seed, tf.int64)
            results[tuple(seed)] = with_xla = compiled(q, k, v, d_out, seed_tensor)
            without = fn(q, k, v, d_out, seed_tensor)
            for name, got, want in zip(["out", "dq", "dk", "dv"], with_xla, without):
                assert relative_error(got, want) <= tol, (seed, name)
    # Different seeds drop different entries; both match the float64 reference with philox_ref's mask.
    first, second = results.values()
    assert relative_error(first[0], second[0]) > 1e-2
    out_tol, grad_tol = tolerance("output", dtype, device), tolerance("gradient", dtype, device)
    for (seed, offset), (out, *grads) in results.items():
        keep = philox_ref.keep_mask(seed, offset, 2, 4, 70, 90, rate)
        kwargs = dict(causal=True, dropout_rate=rate, keep_mask=keep)
        assert relative_error(out, reference_attention(q, k, v, **kwargs)[0]) < out_tol
        for name, grad, ref in zip("qkv", grads, reference_attention_grad(q, k, v, d_out, **kwargs)):
            assert relative_error(grad, ref) < grad_tol, name


@pytest.mark.parametrize("device", DEVICES)
def test_dropout_without_seed_under_xla_backward_uses_the_forward_mask(device, rng):
    # seed=None draws the seed inside the compiled function; the gradient must regenerate that draw's
    # mask. With value = I, out = P_dropped, and with d_out = I, d_value = P_dropped^T: equal iff the
    # forward and backward dropped the same entries.
    seqlen_q, seqlen_k = 40, 48
    q = normal(rng, (1, seqlen_q, 1, 16))
    k = normal(rng, (1, seqlen_k, 1, 16))
    v = tf.eye(seqlen_k)[None, :, None, :]
    d_out = tf.eye(seqlen_q, seqlen_k)[None, :, None, :]

    @tf.function(jit_compile=True)
    def fn():
        with tf.GradientTape() as tape:
            tape.watch(v)
            out = tf_flash.flash_attention(q, k, v, dropout_rate=0.3)
        return out, tape.gradient(out, v, output_gradients=d_out)

    with on_device(device):
        (out, d_v), (other, _) = fn(), fn()
    probs = to_numpy(out)[0, :, 0, :]
    tol = 1e-5 if "CPU" in device else 4e-3  # the GPU computes float32 on float16 operands
    np.testing.assert_allclose(to_numpy(d_v)[0, :seqlen_k, 0, :seqlen_q].T, probs, rtol=tol, atol=tol / 10)
    assert (probs == 0).mean() > 0.1  # dropout happened
    assert relative_error(other, out) > 1e-2  # and each call draws a new seed


def _hlo(fn, *args):
    return fn.experimental_get_compiler_ir(*args)(stage="hlo")


def test_hlo_calls_our_kernels_and_never_builds_scores(rng):
    seqlen = 384  # a size no other dim has: an [.., 384, 384] value would be the score matrix
    q, k, v = random_qkv(rng, 1, seqlen, seqlen, 2, 2, 32)

    @tf.function(jit_compile=True)
    def fn(q, k, v):
        with tf.GradientTape() as tape:
            tape.watch([q, k, v])
            out = tf_flash.flash_attention(q, k, v, causal=True, dropout_rate=0.1, seed=1)
        return out, tape.gradient(out, [q, k, v])

    hlo = _hlo(fn, q, k, v)
    assert 'custom_call_target="tf_flash_attention_fwd"' in hlo
    assert 'custom_call_target="tf_flash_attention_bwd"' in hlo
    assert "api_version=API_VERSION_TYPED_FFI" in hlo
    assert not re.search(rf"\[[0-9,]*{seqlen},{seqlen}\]", hlo), "an [S, S] value in the HLO"
    assert " dot(" not in hlo


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case, graph", [
    ("bfloat16", True), ("float16 decode", True), ("split decode", True), ("block mask, softcap, dropout", True),
    ("attention_mask", True), ("split decode, key mask", True),
    ("float32", False), ("split decode, head dim 20", False), ("head dim 20", False), ("segment ids", False)])
def test_forward_lowering_marks_calls_without_scratch_for_cuda_graphs(device, case, graph, rng):
    """The forward of a call that needs no scratch memory lowers to the target whose CUDA handler XLA may record
    into its CUDA graphs (flash_attention_xla.cc); the others keep the target with the scratch allocator. Both
    give the eager op's output. A split decode call's workspace and a packed attention mask are a result of the
    call, not scratch."""
    b, sq, sk, h, hkv, d = 2, 37, 300, 4, 2, 64
    dtype, kwargs = tf.bfloat16, {}
    if case == "float16 decode":
        dtype, sq = tf.float16, 1
        kwargs = {"causal": "bottom_right", "kv_lengths": tf.constant([300, 111])}
    elif case.startswith("split decode"):  # the decode path's runs (_decode.plan: 8 of them)
        sq, sk, h, d = 1, 8192, 8, 20 if case.endswith("20") else d  # head dim 20: staged to 24, workspace too
        kwargs = {"causal": "bottom_right", "kv_lengths": tf.constant([8192, 3001])}
        if case.endswith("key mask"):  # KerasHub's cache mask, or padding: read by the split runs
            kwargs["attention_mask"] = tf.constant(rng.random((b, 1, 1, sk)) > 0.3)
    elif case == "block mask, softcap, dropout":  # none of them takes scratch memory
        kwargs = {"block_mask": tf.constant([[[[True, False, True]]]]), "softcap": 30.0, "dropout_rate": 0.1,
                  "seed": 7}
    elif case == "float32":
        dtype = tf.float32
    elif case == "head dim 20":
        d = 20
    elif case == "segment ids":
        sq = sk
        kwargs = {"segment_ids": tf.constant(np.repeat([[0, 1, 2]], b, 0).repeat(100, axis=1).astype(np.int32))}
    elif case == "attention_mask":
        kwargs = {"attention_mask": tf.constant(rng.random((b, 1, sq, sk)) > 0.3)}
    q, k, v = random_qkv(rng, b, sq, sk, h, hkv, d, dtype=dtype)

    def attention(q, k, v):
        return tf_flash.flash_attention(q, k, v, **kwargs)

    compiled = tf.function(attention, jit_compile=True)
    with on_device(device):
        hlo = _hlo(compiled, q, k, v)
        got, want = compiled(q, k, v), attention(q, k, v)
    target = "tf_flash_attention_fwd_graph" if graph else "tf_flash_attention_fwd"
    assert f'custom_call_target="{target}"' in hlo
    if case.startswith("split decode") or (case == "attention_mask" and tf_flash.build_info()["cuda"] == "1"):
        assert re.search(r"u8\[[0-9]+\]", hlo), "no workspace result"
    assert relative_error(got, want) < tolerance("output", dtype, device)


MEMORY_SCRIPT = textwrap.dedent("""
    import json, resource, sys
    sys.path.insert(0, {repo!r})
    import numpy as np, tensorflow as tf, tf_flash
    b, s, h, d = 1, 16384, 1, 64
    rng = np.random.default_rng(0)
    q, k, v = (tf.constant(rng.standard_normal((b, s, h, d)).astype(np.float32)) for _ in range(3))

    @tf.function(jit_compile=True)
    def step(q, k, v):
        with tf.GradientTape() as tape:
            tape.watch([q, k, v])
            out = tf_flash.flash_attention(q, k, v, causal=True)
            loss = tf.reduce_sum(out)
        return loss, tape.gradient(loss, [q, k, v])

    hlo = step.experimental_get_compiler_ir(q, k, v)(stage="hlo")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    loss, grads = step(q, k, v)
    finite = bool(np.isfinite(loss.numpy())) and all(np.isfinite(g.numpy()).all() for g in grads)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({{"growth_mb": (peak - before) / 1024, "finite": finite,
                      "custom_call": "tf_flash_attention_bwd" in hlo}}))
""")


def test_memory_stays_linear_at_16k_under_xla_on_cpu():
    # One [16384, 16384] float32 score matrix is 1 GiB; dense attention's forward and backward hold
    # several. Our custom calls need O(s * d): q, k, v, out and their gradients are 4 MiB each.
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT.format(repo=REPO)], capture_output=True,
                          text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["finite"] and result["custom_call"], result
    assert result["growth_mb"] < 256, result


def _raw_op(q, k, v, q_lengths=None, kv_lengths=None, attention_mask=None, block_mask=None, block_size=16):
    """The op itself, past the Python checks of tf_flash.flash_attention: what the XLA kernel validates."""
    from tf_flash._ops import ops

    none_lengths, none_mask = tf.zeros([0], tf.int32), tf.zeros([0, 0, 0, 0], tf.bool)
    return ops.tf_flash_flash_attention(
        query=q, key=k, value=v, q_lengths=none_lengths if q_lengths is None else q_lengths,
        kv_lengths=none_lengths if kv_lengths is None else kv_lengths,
        attention_mask=none_mask if attention_mask is None else attention_mask,
        block_mask=none_mask if block_mask is None else block_mask, q_segment_ids=tf.zeros([0, 0], tf.int32),
        kv_segment_ids=tf.zeros([0, 0], tf.int32), seed=tf.zeros([2], tf.int64),
        block_q=block_size, block_k=block_size, scale=0.25)[0]


@pytest.mark.parametrize("case", ["q_lengths", "attention_mask", "block_mask", "head_dim"])
def test_static_shape_errors_are_the_ops_messages_at_compile_time(case, rng):
    q, k, v = random_qkv(rng, 2, 40, 40, 2, 2, 16)
    kwargs, message = {
        "q_lengths": (dict(q_lengths=tf.constant([3, 4, 5])),
                      r"q_lengths must have shape \[batch\] = \[2\].*Received: q_lengths with shape \[3\]"),
        "attention_mask": (dict(attention_mask=tf.ones([2, 3, 40, 40], tf.bool)),
                           r"attention_mask must be broadcastable to \[2, 2, 40, 40\]. Received: attention_mask"),
        "block_mask": (dict(block_mask=tf.ones([1, 1, 2, 2], tf.bool)),
                       r"block_mask must be broadcastable to \[2, 2, 3, 3\]. Received: block_mask"),
        "head_dim": (None, r"head dim must be in \[1, 256\]. Received: 300"),
    }[case]
    if case == "head_dim":
        q = k = v = normal(rng, (1, 8, 1, 300))
        kwargs = {}
    fn = tf.function(lambda q, k, v: _raw_op(q, k, v, **kwargs), jit_compile=True)
    with pytest.raises(tf.errors.InvalidArgumentError, match=message) as error:
        fn(q, k, v)
    assert "XLA" in str(error.value) or "tf2xla" in str(error.value) or "compil" in str(error.value)


def test_dynamic_shapes_get_a_clear_error(rng):
    q = normal(rng, (1, 40, 2, 16))

    @tf.function(jit_compile=True)
    def fn(q, present):  # a mask absent or present at run time: XLA gives it a dynamic shape
        mask = tf.cond(present, lambda: tf.ones([1, 1, 1, 40], tf.bool), lambda: tf.zeros([0, 0, 0, 0], tf.bool))
        return tf_flash.flash_attention(q, q, q, attention_mask=mask)

    with pytest.raises(tf.errors.InvalidArgumentError, match=r"needs static shapes. Received: attention_mask"):
        fn(q, tf.constant(True))


def test_length_values_are_checked_at_run_time_on_cpu(rng):
    q, k, v = random_qkv(rng, 2, 40, 40, 2, 2, 16)
    fn = tf.function(lambda q, k, v, lengths: tf_flash.flash_attention(q, k, v, kv_lengths=lengths),
                     jit_compile=True)
    with tf.device("/CPU:0"):
        fn(q, k, v, tf.constant([40, 3]))
        with pytest.raises(tf.errors.InvalidArgumentError, match=r"kv_lengths\[1\] must be in \[0, 40\]. "
                                                                 r"Received: kv_lengths\[1\]=41"):
            fn(q, k, v, tf.constant([40, 41]))


IMPORT_ORDER_SCRIPT = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {repo!r})
    import numpy as np, tensorflow as tf
    # XLA builds its kernel registry the first time anything is compiled: do that before tf_flash loads.
    assert float(tf.function(lambda x: x * 2.0 + 1.0, jit_compile=True)(tf.constant(1.0))) == 3.0
    import tf_flash
    rng = np.random.default_rng(0)
    q, k, v = (tf.constant(rng.standard_normal((1, 50, 2, 16)).astype(np.float32)) for _ in range(3))

    def fn(q, k, v):
        with tf.GradientTape() as tape:
            tape.watch(q)
            out = tf_flash.flash_attention(q, k, v, causal=True)
        return out, tape.gradient(out, q)

    compiled = tf.function(fn, jit_compile=True)
    hlo = compiled.experimental_get_compiler_ir(q, k, v)(stage="hlo")
    (out, dq), (ref, dq_ref) = compiled(q, k, v), fn(q, k, v)
    q8 = tf.cast(q, tf.dtypes.experimental.float8_e4m3fn)  # the fp8 op's lowering (its type attr: output_dtype)
    fp8_hlo = tf.function(lambda q8: tf_flash.flash_attention(q8, q8, q8), jit_compile=True
                          ).experimental_get_compiler_ir(q8)(stage="hlo")
    print(json.dumps({{"diff": float(np.abs(out - ref).max()), "grad_diff": float(np.abs(dq - dq_ref).max()),
                      "custom_call": "tf_flash_attention_fwd" in hlo and "tf_flash_attention_bwd" in hlo,
                      "fp8_custom_call": "tf_flash_attention_fwd_fp8" in fp8_hlo}}))
""")


def test_registration_is_seen_when_xla_compiled_before_import():
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run([sys.executable, "-c", IMPORT_ORDER_SCRIPT.format(repo=REPO)], capture_output=True,
                          text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["custom_call"] and result["fp8_custom_call"], result
    assert result["diff"] < 1e-5 and result["grad_diff"] < 1e-4, result


# ---- Keras ----

def _keras_model(seed=0):
    import keras
    from tf_flash.layers import FlashAttention, FlashMultiHeadAttention

    keras.utils.set_random_seed(seed)
    tokens = keras.Input((None,), dtype="int32")
    x = keras.layers.Embedding(30, 16, mask_zero=True)(tokens)
    x = FlashMultiHeadAttention(2, 8, name="mha")(x, x, use_causal_mask=True)
    heads = keras.layers.Reshape((-1, 2, 8))(x)
    heads = FlashAttention(window=(3, 1), name="flash")(heads, heads)
    x = keras.layers.Add()([x, keras.layers.Reshape((-1, 16))(heads)])
    x = keras.layers.LayerNormalization()(keras.layers.GlobalAveragePooling1D()(x))
    return keras.Model(tokens, keras.layers.Dense(3)(x))


def _keras_data():
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 30, size=(16, 12)).astype("int32")
    tokens[::3, 9:] = 0  # Keras padding masks, as prefixes: the lengths fast path
    return tokens, rng.integers(0, 3, size=(16,)).astype("int32")


def test_layers_declare_xla_support():
    from keras.src.trainers.trainer import model_supports_jit

    from tf_flash.layers import FlashAttention, FlashMultiHeadAttention

    assert FlashAttention().supports_jit and FlashMultiHeadAttention(2, 4).supports_jit
    assert model_supports_jit(_keras_model())


@pytest.mark.gpu
def test_compile_default_auto_turns_xla_on_on_the_gpu():
    import keras

    model = _keras_model()
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    tokens, labels = _keras_data()
    model.fit(tokens, labels, epochs=1, batch_size=8, verbose=0)
    assert model.jit_compile is True


@pytest.mark.parametrize("device", DEVICES)
def test_keras_fit_with_xla_equals_fit_without(device):
    import keras

    tokens, labels = _keras_data()
    weights = {}
    with tf.device(device):
        for jit in (False, True):
            model = _keras_model()
            # SGD, not Adam: Adam turns a gradient's rounding noise into steps of the full learning rate
            # where gradients are near 0 (seen on the H100, whose float32 runs on float16 operands: 9e-3).
            model.compile(optimizer=keras.optimizers.SGD(0.1),
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=jit)
            model.fit(tokens, labels, epochs=2, batch_size=8, shuffle=False, verbose=0)
            weights[jit] = model.get_weights()
    tol = 2e-3 if "GPU" in device else 2e-5  # XLA fuses the surrounding float32 math differently
    for without, with_xla in zip(weights[False], weights[True]):
        np.testing.assert_allclose(with_xla, without, rtol=tol, atol=tol)


def test_model_trained_under_xla_saves_and_reloads_in_a_fresh_process(tmp_path):
    saving_helper.train_and_save(tmp_path, epochs=2, jit_compile=True)
    saving_helper.assert_reloads(tmp_path)
