"""tf_flash.flash_attention against a float64 reference: every feature, its gradients, dtypes, devices,
eager and tf.function, bad inputs, long sequences and linear memory."""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf

import tf_flash
from device_util import (DEVICES, DTYPES, GPU_UNSUPPORTED, gpu_unsupported, normal, on_device, random_qkv,
                         tolerance)
from reference import (draw_features, reference_attention, reference_attention_grad, relative_error,
                       standard_attention, to_numpy)


def _run(fn, mode):
    return tf.function(fn)() if mode == "graph" else fn()


# (batch, seqlen_q, seqlen_k, heads, heads_kv, head_dim, head_dim_v): odd lengths, GQA/MQA, Sq != Sk.
SHAPES = [
    (2, 77, 77, 4, 4, 32, 32),
    (1, 130, 67, 4, 2, 64, 64),
    (2, 45, 200, 6, 1, 16, 24),
    (1, 1, 129, 2, 2, 8, 8),
    (1, 257, 257, 2, 1, 128, 128),
    (1, 300, 530, 2, 2, 16, 16),  # several tiles on both axes
    (1, 150, 170, 4, 2, 256, 192),  # the GPU's head dim 256 kernels, head_dim_v padded
]

# Feature sets, each combined with the shapes above.
FEATURES = {
    "plain": {},
    "causal": {"causal": True},
    "window": {"window": (13, 5)},
    "window_left_only": {"window": (20, None), "causal": True},
    "lengths": {"q_lengths": "q", "kv_lengths": "kv"},
    "mask_full": {"attention_mask": "full"},
    "mask_broadcast": {"attention_mask": "rows"},
    "all": {"causal": True, "window": (40, None), "q_lengths": "q", "kv_lengths": "kv", "attention_mask": "full"},
    "scale": {"scale": 0.3},
}



# (device, dtype, feature): every combination on the GPU; on the CPU the half-precision paths share the
# float32 code after conversion, so two features suffice there.
FEATURE_CASES = [pytest.param(*device.values, dtype, feature, marks=device.marks, id=f"{feature}-{dtype}-{device.id}")
                 for device in DEVICES for dtype in DTYPES for feature in FEATURES
                 if device.id == "gpu" or dtype == "float32" or feature in ("plain", "all")]


@pytest.mark.parametrize("device,dtype,feature", FEATURE_CASES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_forward_and_gradients(device, dtype, shape, feature, rng):
    batch, seqlen_q, seqlen_k, heads, heads_kv, head_dim, head_dim_v = shape
    tf_dtype = DTYPES[dtype]
    q, k, v = random_qkv(rng, batch, seqlen_q, seqlen_k, heads, heads_kv, head_dim, head_dim_v, dtype=tf_dtype)
    kwargs = draw_features(rng, FEATURES[feature], batch, seqlen_q, seqlen_k, heads)
    d_out = normal(rng, (batch, seqlen_q, heads, head_dim_v), tf_dtype)
    d_lse = normal(rng, (batch, heads, seqlen_q))
    with on_device(device, head_dim=head_dim, head_dim_v=head_dim_v):
        with tf.GradientTape() as tape:
            tape.watch([q, k, v])
            out, lse = tf_flash.flash_attention(q, k, v, return_lse=True, **kwargs)
            # d_lse flows too: lse is differentiable (its gradient is P).
            loss = (tf.reduce_sum(tf.cast(out, tf.float32) * tf.cast(d_out, tf.float32))
                    + tf.reduce_sum(tf.where(tf.math.is_inf(lse), 0.0, lse) * d_lse))
        grads = tape.gradient(loss, [q, k, v])
    ref_out, ref_lse = reference_attention(q, k, v, **kwargs)
    finite = np.isfinite(ref_lse)
    d_lse_ref = np.where(finite, to_numpy(d_lse), 0.0)
    ref_grads = reference_attention_grad(q, k, v, d_out, d_lse=d_lse_ref, **kwargs)
    out_tol, grad_tol = tolerance("output", dtype, device), tolerance("gradient", dtype, device)
    assert out.dtype == tf_dtype and lse.dtype == tf.float32
    assert relative_error(out, ref_out) < out_tol
    np.testing.assert_array_equal(np.isfinite(lse.numpy()), finite)
    assert lse.numpy()[~finite].max(initial=-np.inf) == -np.inf
    np.testing.assert_allclose(lse.numpy()[finite], ref_lse[finite], rtol=out_tol, atol=out_tol)
    for name, grad, ref in zip("qkv", grads, ref_grads):
        assert grad.dtype == tf_dtype
        assert relative_error(grad, ref) < grad_tol, name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["eager", "graph"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", [32, 64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_low_precision_error_within_2x_standard_attention(device, mode, dtype, head_dim, causal, rng):
    tf_dtype = DTYPES[dtype]
    q, k, v = random_qkv(rng, 2, 200, 333, 4, 2, head_dim, dtype=tf_dtype)
    d_out = normal(rng, (2, 200, 4, head_dim), tf_dtype)
    with on_device(device, head_dim=head_dim, head_dim_v=head_dim):
        def fn():
            with tf.GradientTape() as tape:
                tape.watch([q, k, v])
                out = tf_flash.flash_attention(q, k, v, causal=causal)
            return out, tape.gradient(out, [q, k, v], output_gradients=d_out)
        out, grads = _run(fn, mode)
    assert out.dtype == tf_dtype and all(g.dtype == tf_dtype for g in grads)
    ref = reference_attention(q, k, v, causal=causal)[0]
    baseline = standard_attention(q, k, v, causal=causal)
    bound = 2 * relative_error(baseline, ref)
    assert relative_error(out, ref) <= bound
    # Gradients: the same-dtype standard attention's gradient error is about the forward's; allow the
    # bound of the forward scaled by a small factor for the longer chain of rounding.
    ref_grads = reference_attention_grad(q, k, v, d_out, causal=causal)
    for name, grad, r in zip("qkv", grads, ref_grads):
        assert relative_error(grad, r) <= 4 * bound, name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("head_dim", [8, 24, 40, 96, 160, 192, 256])
def test_head_dims(device, head_dim, rng):
    q, k, v = random_qkv(rng, 1, 70, 90, 2, 1, head_dim)
    # On the GPU 160 and 192 run the backward's head dim 256 kernels, zero-padded.
    with on_device(device, head_dim=head_dim, head_dim_v=head_dim):
        with tf.GradientTape() as tape:
            tape.watch([q, k, v])
            out = tf_flash.flash_attention(q, k, v, causal=True)
        grads = tape.gradient(out, [q, k, v])
    out_tol, grad_tol = tolerance("output", tf.float32, device), tolerance("gradient", tf.float32, device)
    assert relative_error(out, reference_attention(q, k, v, causal=True)[0]) < out_tol
    ref_grads = reference_attention_grad(q, k, v, tf.ones_like(out), causal=True)
    for name, grad, ref in zip("qkv", grads, ref_grads):
        assert relative_error(grad, ref) < grad_tol, name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_rows_with_nothing_visible_give_zero_and_minus_inf(device, dtype):
    rng = np.random.default_rng(3)
    q, k, v = random_qkv(rng, 2, 40, 50, 2, 2, 32, dtype=DTYPES[dtype])
    mask = np.ones((2, 2, 40, 50), bool)
    mask[:, :, 5] = False  # one row sees nothing through the mask
    kwargs = dict(attention_mask=mask, q_lengths=[30, 40], kv_lengths=[50, 0], window=(3, None))
    with tf.device(device):
        with tf.GradientTape() as tape:
            tape.watch([q, k, v])
            out, lse = tf_flash.flash_attention(q, k, v, return_lse=True, **kwargs)
        grads = tape.gradient(out, [q, k, v])
    out, lse = out.numpy().astype(np.float32), lse.numpy()
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    assert (out[0, 5] == 0).all() and (out[0, 30:] == 0).all() and (out[1] == 0).all()
    assert (lse[0, :, 5] == -np.inf).all() and (lse[0, :, 30:] == -np.inf).all() and (lse[1] == -np.inf).all()
    for grad in grads:
        assert not np.isnan(to_numpy(grad)).any()
    assert (to_numpy(grads[1])[1] == 0).all() and (to_numpy(grads[0])[0, 30:] == 0).all()


@pytest.mark.parametrize("device", DEVICES)
def test_empty_sequences(device):
    dtype = tf.float32
    q = tf.random.normal([2, 5, 2, 16], dtype=dtype)
    k = tf.random.normal([2, 0, 2, 16], dtype=dtype)
    with tf.device(device):
        with tf.GradientTape() as tape:
            tape.watch([q, k])
            out, lse = tf_flash.flash_attention(q, k, k, return_lse=True)
        d_q = tape.gradient(out, q)
    assert out.shape == (2, 5, 2, 16) and (out.numpy() == 0).all() and (lse.numpy() == -np.inf).all()
    assert (d_q.numpy() == 0).all()
    with tf.device(device):
        out = tf_flash.flash_attention(tf.zeros([2, 0, 2, 16], dtype), q, q)
    assert out.shape == (2, 0, 2, 16)


# Every configuration the GPU must run: all dtypes, head dims 1..256 (multiples of 8 or not, key and value
# head dims apart) with every masking feature and dropout. Only GPU_UNSUPPORTED may refuse one.
GPU_COVERAGE_HEAD_DIMS = [(1, 1), (8, 8), (24, 40), (32, 32), (45, 45), (64, 64), (64, 128), (80, 80), (96, 96),
                          (100, 100), (128, 128), (128, 64), (160, 160), (192, 192), (200, 136), (256, 256)]
GPU_COVERAGE_FEATURES = {
    "plain": {},
    "causal_gqa": {"causal": True, "gqa": True},
    "window_lengths": {"window": (7, 3), "q_lengths": [33, 17], "kv_lengths": [50, 9]},
    "masks": {"attention_mask": "random", "block_mask": "random", "block_size": 16},
    "dropout": {"dropout_rate": 0.25, "seed": 3},
}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("head_dims", GPU_COVERAGE_HEAD_DIMS, ids=lambda d: f"d{d[0]}_dv{d[1]}")
def test_gpu_runs_every_configuration_not_declared_unsupported(dtype, head_dims, rng):
    """A GPU refusal ("tf_flash GPU kernel: ...") of any configuration GPU_UNSUPPORTED does not declare
    fails here: a regression cannot hide as a skip."""
    head_dim, head_dim_v = head_dims
    expected = gpu_unsupported(head_dim=head_dim, head_dim_v=head_dim_v, heads=4, batch=2, dtype=dtype)
    for name, features in GPU_COVERAGE_FEATURES.items():
        kwargs = dict(features)
        heads_kv = 2 if kwargs.pop("gqa", False) else 4
        if kwargs.get("attention_mask") == "random":
            kwargs["attention_mask"] = rng.random((2, 4, 40, 50)) < 0.8
            kwargs["block_mask"] = rng.random((4, 3, 4)) < 0.7
        q, k, v = random_qkv(rng, 2, 40, 50, 4, heads_kv, head_dim, head_dim_v, dtype=DTYPES[dtype])
        try:
            with tf.device("/GPU:0"):
                with tf.GradientTape() as tape:
                    tape.watch([q, k, v])
                    out = tf_flash.flash_attention(q, k, v, **kwargs)
                grads = tape.gradient(out, [q, k, v])
            [t.numpy() for t in (out, *grads)]
        except tf.errors.InvalidArgumentError as err:
            assert expected is not None and "GPU kernel" in str(err), (
                f"{name}: the GPU refused a configuration not declared unsupported: {err}")
            continue
        assert expected is None, f"{name}: declared unsupported ({expected}) but the GPU ran it"


@pytest.mark.gpu
@pytest.mark.parametrize("config", [dict(heads=65536, batch=1, head_dim=8, scale=None),
                                    dict(heads=2, batch=65536, head_dim=8, scale=None),
                                    dict(heads=2, batch=1, head_dim=256, scale=None),
                                    dict(heads=2, batch=1, head_dim=256, scale=None, dtype="float32")],
                         ids=["heads", "batch", "head_dim_256", "full_float32_head_dim_256"])
def test_gpu_refuses_what_it_declares_unsupported(config):
    """Each GPU_UNSUPPORTED entry is real: the GPU refuses it with an InvalidArgumentError naming the GPU
    kernel (the head dim 256 case is declared only in a reduced build, full float32 at head dim 256 only on
    GPUs with 99 KiB of shared memory a block; otherwise they must run)."""
    assert len(GPU_UNSUPPORTED) == 3  # a new entry needs a case here
    dtype = config.get("dtype", "float16")
    q = tf.zeros([config["batch"], 3, config["heads"], config["head_dim"]], dtype)
    tf32 = tf.config.experimental.tensor_float_32_execution_enabled()
    if dtype == "float32":
        tf.config.experimental.enable_tensor_float_32_execution(False)  # the full-float32 kernels
    try:
        declared = gpu_unsupported(**config)
        with tf.device("/GPU:0"):
            if declared is None:
                assert tf_flash.flash_attention(q, q, q, scale=config["scale"]).shape == q.shape
                return
            with pytest.raises(tf.errors.InvalidArgumentError, match="GPU kernel"):
                tf_flash.flash_attention(q, q, q, scale=config["scale"]).numpy()
    finally:
        tf.config.experimental.enable_tensor_float_32_execution(tf32)


@pytest.mark.parametrize("device", DEVICES)
def test_outputs_fully_written(device):
    """Every element is written: the outputs of a poisoned allocator would show up as NaN or garbage.
    Run twice on one device after a NaN-producing op so recycled buffers hold NaNs."""
    rng = np.random.default_rng(5)
    dtype = tf.float32
    q, k, v = random_qkv(rng, 2, 131, 97, 3, 3, 45, dtype=dtype)  # head dim 45: the GPU pads it
    with tf.device(device):
        for _ in range(2):
            poison = tf.fill([2 * 131 * 3 * 45 * 4], tf.constant(np.nan, dtype))  # fills the pool with NaNs
            del poison
            with tf.GradientTape() as tape:
                tape.watch([q, k, v])
                out = tf_flash.flash_attention(q, k, v, q_lengths=[100, 131], kv_lengths=[97, 50], causal=True)
            grads = tape.gradient(out, [q, k, v])
            for t in [out, *grads]:
                assert np.isfinite(to_numpy(t)).all()


def test_compute_gradient_float32():
    rng = np.random.default_rng(11)
    q, k, v = random_qkv(rng, 1, 6, 7, 2, 1, 4)
    mask = rng.random((1, 2, 6, 7)) < 0.8

    def f(q, k, v):
        return tf_flash.flash_attention(q, k, v, causal=False, window=(3, 2), attention_mask=mask, kv_lengths=[6])

    theoretical, numerical = tf.test.compute_gradient(f, [q, k, v], delta=1e-2)
    for t, n in zip(theoretical, numerical):
        np.testing.assert_allclose(t, n, atol=2e-2, rtol=2e-2)


def test_retraces_for_other_shapes_and_graph_gradient():
    fn = tf.function(lambda q: tf.reduce_sum(tf_flash.flash_attention(q, q, q, causal=True)))
    for seqlen in (5, 70, 129):
        q = tf.random.normal([1, seqlen, 2, 16])
        with tf.GradientTape() as tape:
            tape.watch(q)
            y = fn(q)
        assert tape.gradient(y, q).shape == q.shape


def test_static_shape_inference():
    @tf.function(input_signature=[tf.TensorSpec([None, None, 8, 32]), tf.TensorSpec([None, None, 2, 32]),
                                  tf.TensorSpec([None, None, 2, 16])])
    def fn(q, k, v):
        out, lse = tf_flash.flash_attention(q, k, v, return_lse=True)
        assert out.shape.as_list() == [None, None, 8, 16]
        assert lse.shape.as_list() == [None, 8, None]
        return out

    assert fn(tf.zeros([1, 3, 8, 32]), tf.zeros([1, 4, 2, 32]), tf.zeros([1, 4, 2, 16])).shape == (1, 3, 8, 16)


BAD_INPUTS = [
    (dict(q=(1, 4, 2, 8), k=(1, 4, 3, 8)), "heads"),
    (dict(q=(1, 4, 2, 8), k=(1, 4, 2, 16)), "head dim"),
    (dict(q=(1, 4, 2, 8), k=(2, 4, 2, 8)), "batch"),
    (dict(q=(1, 4, 2, 300)), "head dim"),
    (dict(q=(4, 2, 8)), "rank 4"),
    (dict(q_lengths=[5]), "q_lengths"),
    (dict(kv_lengths=[-1]), "kv_lengths"),
    (dict(kv_lengths=[1, 2]), "kv_lengths"),
    (dict(attention_mask=np.ones((1, 2, 4, 3), bool)), "attention_mask"),
    (dict(attention_mask=np.ones((4, 4))), "attention_mask"),
    (dict(block_mask=np.ones((3, 3), bool), block_size=2), "block_mask"),
    (dict(dropout_rate=1.0), "dropout_rate"),
    (dict(dropout_rate=-0.1), "dropout_rate"),
    (dict(window=(-2, 3)), "window"),
    (dict(block_size=0), "block_size"),
    (dict(seed=[1, 2, 3]), "seed"),
    (dict(value_dtype=tf.float16), "value"),
]


@pytest.mark.parametrize("case", BAD_INPUTS, ids=lambda c: c[1] if isinstance(c, str) else None)
def test_bad_inputs_raise_clear_errors(case):
    kwargs, word = case
    kwargs = dict(kwargs)
    q_shape = kwargs.pop("q", (1, 4, 2, 8))
    k_shape = kwargs.pop("k", (1, 4, 2, q_shape[-1]) if len(q_shape) == 4 else (1, 4, 2, 8))
    value_dtype = kwargs.pop("value_dtype", tf.float32)
    q, k = tf.zeros(q_shape), tf.zeros(k_shape)
    v = tf.zeros(k_shape, value_dtype)
    with pytest.raises((ValueError, tf.errors.InvalidArgumentError), match=word):
        tf_flash.flash_attention(q, k, v, **kwargs)


def test_bad_lengths_inside_tf_function():
    fn = tf.function(lambda q, lengths: tf_flash.flash_attention(q, q, q, kv_lengths=lengths))
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"kv_lengths\[0\].*Received: kv_lengths\[0\]=9"):
        fn(tf.zeros([1, 4, 2, 8]), tf.constant([9]))


def test_long_sequence_past_2_31_scores():
    """b*h*s*s = 2^32 scores: TF's standard attention cannot run this; the tiled kernel does, exactly."""
    seqlen, rng = 65536, np.random.default_rng(2)
    q, k, v = random_qkv(rng, 1, seqlen, seqlen, 1, 1, 16)
    out = tf_flash.flash_attention(q, k, v).numpy()
    rows = np.sort(rng.choice(seqlen, size=8, replace=False))
    ref = reference_attention(tf.gather(q, rows, axis=1), k, v)[0]
    assert relative_error(out[:, rows], ref) < 1e-5


def test_memory_is_linear_in_sequence_length():
    """Forward+backward at s=16384, h=8, d=64: the scores alone would be 8 GiB; peak RSS must stay within
    a few hundred MB of the inputs. Measured in a fresh process so earlier tests do not count."""
    script = textwrap.dedent("""
        import resource, tensorflow as tf, tf_flash
        q, k, v = (tf.random.normal([1, 16384, 8, 64]) for _ in range(3))
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        with tf.GradientTape() as tape:
            tape.watch([q, k, v])
            out = tf_flash.flash_attention(q, k, v, causal=True)
        grads = tape.gradient(out, [q, k, v])
        _ = [g.numpy() for g in grads]
        print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024)
    """)
    # A CPU expectation (the CPU backward's scratch): the helper process sees no GPU.
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                            timeout=900)
    assert result.returncode == 0, result.stderr[-2000:]
    grown_mb = float(result.stdout.strip().splitlines()[-1])
    # Inputs are 32 MiB each; outputs, gradients and dQ partials are a few times that.
    assert grown_mb < 400, f"peak RSS grew by {grown_mb:.0f} MB"


def test_library_reports_the_tensorflow_it_was_built_for():
    info = tf_flash.build_info()
    assert info["tf"].split(".")[:2] == tf.__version__.split(".")[:2]
    assert info["cuda"] in ("0", "1")


def test_library_reports_kernel_launches_by_family():
    counts = tf_flash.cuda_kernel_counts()
    assert set(counts) == {"forward_sm80", "forward_sm90", "backward_sm80", "backward_sm90", "forward_float32",
                           "backward_float32"}
    assert all(isinstance(n, int) and n >= 0 for n in counts.values())
    if tf_flash.build_info()["cuda"] == "0":
        assert not any(counts.values())
