"""Property-based tests (hypothesis): random shapes, masks, lengths, windows, block masks, dropout,
soft-capping and dtypes against the float64 reference, forward and gradients; the same kind of random
configurations, made invalid, through the raw ops (what a SavedModel calls without the Python checks): an
InvalidArgumentError (or TF's own ValueError/TypeError of argument conversion), never a crash. Thread
safety and a leak check.

Profiles (TF_FLASH_HYPOTHESIS_PROFILE): `ci` (default: few examples, derandomized so every run draws the
same examples) and `long` (1,000 examples per test, fresh randomness; a failure prints its reproducer).
TF_FLASH_FUZZ_MAX_SEQLEN (default 48) bounds the drawn sequence lengths: 600 crosses the CPU kernel's
tiles.
TF_FLASH_FUZZ_LOG=path appends every raw-op example to `path` before it runs, so a crash (which takes the
process down with it) leaves its reproducer as the file's last line.
"""
import functools
import os
import resource
import sys
import threading
import time

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

import philox_ref
import tf_flash
from device_util import DTYPES, normal, random_qkv, tolerance
from reference import reference_attention, reference_attention_grad, to_numpy
from tf_flash._ops import ops as raw_ops

settings.register_profile("ci", max_examples=30, deadline=None, derandomize=True, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("long", max_examples=1000, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
PROFILE = os.environ.get("TF_FLASH_HYPOTHESIS_PROFILE", "ci")
# Sequence lengths drawn up to this; above the CPU kernel's tiles (128 x 256) the runs cross tile edges
# (`TF_FLASH_FUZZ_MAX_SEQLEN=600` with the long profile; short by default, for CI's time).
MAX_SEQLEN = int(os.environ.get("TF_FLASH_FUZZ_MAX_SEQLEN", "48"))
settings.load_profile(PROFILE)



# ---- random valid configurations ----

@st.composite
def configurations(draw):
    heads_kv = draw(st.integers(1, 2))
    config = dict(
        batch=draw(st.integers(1, 2)), heads_kv=heads_kv, heads=heads_kv * draw(st.integers(1, 3)),
        seqlen_q=draw(st.integers(1, MAX_SEQLEN)), seqlen_k=draw(st.integers(1, MAX_SEQLEN)),
        head_dim=draw(st.sampled_from([1, 3, 8, 16, 24, 40, 64])),
        dtype=draw(st.sampled_from(sorted(DTYPES))), data_seed=draw(st.integers(0, 2**32 - 1)))
    config["head_dim_v"] = draw(st.sampled_from([config["head_dim"], 5, 16, 32]))
    kwargs = {}
    if draw(st.booleans()):
        kwargs["causal"] = True
    if draw(st.booleans()):
        side = st.one_of(st.none(), st.integers(0, 50))
        kwargs["window"] = (draw(side), draw(side))
    rng = np.random.default_rng(config["data_seed"])
    batch, heads, sq, sk = config["batch"], config["heads"], config["seqlen_q"], config["seqlen_k"]
    if draw(st.booleans()):
        kwargs["q_lengths"] = rng.integers(0, sq + 1, size=batch).astype(np.int32)
    if draw(st.booleans()):
        kwargs["kv_lengths"] = rng.integers(0, sk + 1, size=batch).astype(np.int32)
    if draw(st.booleans()):  # each axis full or broadcast, rank 2 to 4
        full = (batch, heads, sq, sk)
        rank = draw(st.integers(2, 4))
        shape = tuple(size if draw(st.booleans()) else 1 for size in full[4 - rank:])
        kwargs["attention_mask"] = rng.random(shape) < draw(st.sampled_from([0.3, 0.8, 1.0]))
    if draw(st.booleans()):
        block_q, block_k = draw(st.integers(1, 20)), draw(st.integers(1, 20))
        blocks = (-(-sq // block_q), -(-sk // block_k))
        shape = draw(st.sampled_from([blocks, (heads,) + blocks, (batch, heads) + blocks]))
        kwargs["block_mask"] = rng.random(shape) < 0.6
        kwargs["block_size"] = (block_q, block_k)
    if draw(st.booleans()):
        kwargs["dropout_rate"] = draw(st.sampled_from([0.1, 0.5, 0.9]))
        kwargs["seed"] = draw(st.integers(0, 2**63 - 1))
    if draw(st.booleans()):
        kwargs["scale"] = draw(st.floats(0.0, 2.0, allow_nan=False))
    if draw(st.booleans()):
        kwargs["softcap"] = draw(st.sampled_from([0.5, 2.0, 30.0]))
    return config, kwargs


def _inputs(config):
    rng = np.random.default_rng(config["data_seed"] + 1)
    b, sq, sk, h, hkv = (config[k] for k in ("batch", "seqlen_q", "seqlen_k", "heads", "heads_kv"))
    d, dv = config["head_dim"], config["head_dim_v"]
    dtype = DTYPES[config["dtype"]]
    return (*random_qkv(rng, b, sq, sk, h, hkv, d, dv, dtype), normal(rng, (b, sq, h, dv), dtype),
            normal(rng, (b, h, sq)))


def _assert_close(name, actual, expected, tol):
    actual, expected = to_numpy(actual), np.asarray(expected, np.float64)
    assert np.isfinite(actual).all(), f"{name}: non-finite values where the reference is finite"
    # A floor of tol * RMS-size of one term: gradients that cancel to ~0 are judged at the scale of
    # their terms (unit-normal inputs), not relative to their own tiny norm.
    error = np.linalg.norm(actual - expected)
    bound = tol * max(np.linalg.norm(expected), 0.1 * np.sqrt(expected.size))
    assert error <= bound, f"{name}: error {error:.3g} > {bound:.3g}"


@pytest.mark.parametrize("mode", ["eager", "tf.function"])
@given(case=configurations())
def test_matches_float64_reference(case, mode):
    """Forward (output and lse) and gradients (through output and lse) of any valid configuration on
    the CPU against the float64 reference."""
    config, kwargs = case
    note(f"config={config} kwargs={kwargs}")
    q, k, v, d_out, d_lse = _inputs(config)

    def run():
        with tf.GradientTape() as tape:
            tape.watch([q, k, v])
            out, lse = tf_flash.flash_attention(q, k, v, return_lse=True, **kwargs)
            loss = (tf.reduce_sum(tf.cast(out, tf.float32) * tf.cast(d_out, tf.float32))
                    + tf.reduce_sum(tf.where(tf.math.is_inf(lse), 0.0, lse) * d_lse))
        return out, lse, tape.gradient(loss, [q, k, v])

    with tf.device("/CPU:0"):
        out, lse, grads = tf.function(run)() if mode == "tf.function" else run()
    ref_kwargs = dict(kwargs)
    seed = ref_kwargs.pop("seed", None)
    if ref_kwargs.get("dropout_rate"):
        ref_kwargs["keep_mask"] = philox_ref.keep_mask(seed, 0, config["batch"], config["heads"], config["seqlen_q"],
                                                       config["seqlen_k"], ref_kwargs["dropout_rate"])
    ref_out, ref_lse = reference_attention(q, k, v, **ref_kwargs)
    finite = np.isfinite(ref_lse)
    ref_grads = reference_attention_grad(q, k, v, d_out, d_lse=np.where(finite, to_numpy(d_lse), 0.0), **ref_kwargs)
    # Small tensors make norms noisy: the bounds carry a floor (see _assert_close).
    out_tol, grad_tol = tolerance("output", config["dtype"]), tolerance("gradient", config["dtype"])
    assert out.dtype == q.dtype and all(g.dtype == q.dtype for g in grads)
    _assert_close("output", out, ref_out, out_tol)
    lse = lse.numpy()
    np.testing.assert_array_equal(np.isfinite(lse), finite)
    assert (lse[~finite] == -np.inf).all()
    np.testing.assert_allclose(lse[finite], ref_lse[finite], rtol=out_tol, atol=out_tol)
    for name, grad, ref in zip(("d_query", "d_key", "d_value"), grads, ref_grads):
        _assert_close(name, grad, ref, grad_tol)


@given(case=configurations(), splits=st.integers(2, 7))
def test_num_splits_gives_the_unsplit_attention(case, splits):
    """The op's split-KV (num_splits: the decode path's runs, merged by lse) on any valid configuration on the
    CPU, whose kernel splits with every feature: the unsplit call's output and lse, up to the rounding of the
    runs' outputs to the dtype before the merge."""
    config, kwargs = case
    note(f"config={config} kwargs={kwargs} splits={splits}")
    q, k, v, _, _ = _inputs(config)
    op = raw_ops.tf_flash_flash_attention

    def attention(num_splits):
        tf_flash.ops._ops.tf_flash_flash_attention = functools.partial(op, num_splits=num_splits)
        try:
            with tf.device("/CPU:0"):
                return tf_flash.flash_attention(q, k, v, return_lse=True, **kwargs)
        finally:
            tf_flash.ops._ops.tf_flash_flash_attention = op

    (out, lse), (split_out, split_lse) = attention(1), attention(splits)
    _assert_close("output", split_out, to_numpy(out), tolerance("output", config["dtype"]))
    lse, split_lse = lse.numpy(), split_lse.numpy()
    np.testing.assert_array_equal(np.isfinite(split_lse), np.isfinite(lse))
    finite = np.isfinite(lse)
    np.testing.assert_allclose(split_lse[finite], lse[finite], rtol=1e-5, atol=1e-5)


# ---- the raw ops with bad input: an error, never a crash ----

FUZZ_LOG = os.environ.get("TF_FLASH_FUZZ_LOG")
RAW_ERRORS = (tf.errors.InvalidArgumentError, ValueError, TypeError)
FORWARD_INPUTS = ["query", "key", "value", "q_lengths", "kv_lengths", "attention_mask", "block_mask",
                  "q_segment_ids", "kv_segment_ids", "seed"]
GRAD_INPUTS = ["d_output", "query", "key", "value", "output", "lse", "d_lse", "q_lengths", "kv_lengths",
               "attention_mask", "block_mask", "q_segment_ids", "kv_segment_ids", "rng_state"]
INPUT_DTYPES = {"q_lengths": np.int32, "kv_lengths": np.int32, "attention_mask": bool, "block_mask": bool,
                "q_segment_ids": np.int32, "kv_segment_ids": np.int32,
                "seed": np.int64, "rng_state": np.int64, "lse": np.float32, "d_lse": np.float32}

shapes = st.lists(st.integers(0, 6), min_size=0, max_size=5).map(tuple)
# Int attrs are int64 in the op's definition: TF's wrapper refuses what int64 cannot hold before the op
# exists (OverflowError, or a SystemError from its eager fast path), so the values stay in int64.
int_values = st.sampled_from([0, 1, 3, 7, -1, -7, 2**31 - 1, -2**31, 2**31, 2**32 + 2, 2**63 - 1, -2**63])
float_values = st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=32), st.sampled_from([0.0, -1.0, 1e39]))


def _valid_raw_inputs(config, grad):
    """Consistent raw-op inputs for `config` (the starting point that the mutations break)."""
    q, k, v, d_out, _ = _inputs(config)
    b, h, sq = config["batch"], config["heads"], config["seqlen_q"]
    inputs = dict(query=q, key=k, value=v, q_lengths=np.zeros([0], np.int32), kv_lengths=np.zeros([0], np.int32),
                  attention_mask=np.zeros([0, 0, 0, 0], bool), block_mask=np.zeros([0, 0, 0, 0], bool),
                  q_segment_ids=np.zeros([0, 0], np.int32), kv_segment_ids=np.zeros([0, 0], np.int32))
    if not grad:
        inputs["seed"] = np.array([1, 2], np.int64)
        return inputs
    return dict(inputs, d_output=d_out, output=tf.zeros_like(d_out), lse=np.zeros([b, h, sq], np.float32),
                d_lse=np.zeros([b, h, sq], np.float32), rng_state=np.array([1, 2], np.int64))


@st.composite
def raw_op_calls(draw, grad):
    config, _ = draw(configurations())
    inputs = _valid_raw_inputs(config, grad)
    names = GRAD_INPUTS if grad else FORWARD_INPUTS
    rng = np.random.default_rng(config["data_seed"] + 2)
    for name in draw(st.lists(st.sampled_from(names), max_size=3, unique=True)):
        shape = draw(shapes)
        dtype = INPUT_DTYPES.get(name)
        if dtype is bool:
            inputs[name] = rng.random(shape) < 0.5
        elif dtype in (np.int32, np.int64):
            info = np.iinfo(dtype)
            inputs[name] = rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True) \
                if draw(st.booleans()) else rng.integers(-3, 9, size=shape).astype(dtype)
        else:  # lse/d_lse are float32, the other float inputs of the op's type T
            values = rng.standard_normal(shape).astype(np.float32)
            inputs[name] = values if dtype is np.float32 else tf.cast(values, DTYPES[config["dtype"]])
    attrs = dict(scale=draw(st.one_of(st.just(0.125), float_values)), causal=draw(st.booleans()))
    for name in draw(st.lists(st.sampled_from(["window_left", "window_right", "block_q", "block_k"]), unique=True)):
        attrs[name] = draw(int_values)
    if draw(st.booleans()):
        attrs["dropout_rate"] = draw(st.one_of(st.sampled_from([0.0, 0.5, 0.999]), float_values))
    if draw(st.booleans()):
        attrs["softcap"] = draw(st.one_of(st.sampled_from([0.0, 2.0]), float_values))
    if draw(st.booleans()):
        attrs["num_splits"] = draw(st.one_of(st.integers(2, 5), int_values))
    return inputs, attrs


def _describe_call(inputs, attrs):
    """name: (dtype, shape, first values) of every input, and the attrs: enough to rebuild the call."""
    described = {}
    for name, value in inputs.items():
        array = np.asarray(value.numpy() if hasattr(value, "numpy") else value)
        first = array.ravel()[:4]
        described[name] = (array.dtype.name, array.shape,
                           (first.astype(np.float64) if array.dtype.kind == "V" or "float" in array.dtype.name
                            else first).tolist())
    return f"{described} {attrs}"


def _run_raw(op, inputs, attrs, mode):
    if FUZZ_LOG:
        with open(FUZZ_LOG, "a", encoding="utf-8") as log:
            log.write(f"{op.__name__} {mode} {_describe_call(inputs, attrs)}\n")
    note(_describe_call(inputs, attrs))
    with tf.device("/CPU:0"):
        try:
            if mode == "tf.function":
                return tf.function(lambda: op(**inputs, **attrs))()
            return op(**inputs, **attrs)
        except RAW_ERRORS:
            return None


@pytest.mark.parametrize("mode", ["eager", "tf.function"])
@pytest.mark.parametrize("grad", [False, True], ids=["forward", "gradient"])
@given(data=st.data())
def test_raw_op_rejects_bad_input_without_crashing(data, grad, mode):
    op = raw_ops.tf_flash_flash_attention_grad if grad else raw_ops.tf_flash_flash_attention
    result = _run_raw(op, *data.draw(raw_op_calls(grad=grad)), mode)
    if result is not None:
        [t.numpy() for t in result]


# ---- concurrency: threads and tf.data map functions equal sequential calls ----

def _step_inputs(index):
    rng = np.random.default_rng(1000 + index)
    q = normal(rng, (2, 37, 4, 16))
    kv = normal(rng, (2, 45, 2, 16))
    lengths = tf.constant([37 - index % 5, 30], tf.int32)
    return q, kv, lengths


def _step(q, kv, lengths):
    """Forward and backward with dropout (a fixed seed), lengths and a window."""
    with tf.GradientTape() as tape:
        tape.watch([q, kv])
        out = tf_flash.flash_attention(q, kv, kv, causal=True, window=(9, None), q_lengths=lengths,
                                       dropout_rate=0.2, seed=77)
        loss = tf.reduce_sum(out * out)
    d_q, d_kv = tape.gradient(loss, [q, kv])
    return out, d_q, d_kv


def _assert_same(results, expected):
    for got, want in zip(results, expected):
        for g, w in zip(got, want):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@pytest.mark.parametrize("mode", ["eager", "tf.function"])
def test_threads_equal_sequential_calls(mode):
    count, threads_n, rounds = 12, 6, 3
    inputs = [_step_inputs(i) for i in range(count)]
    step = tf.function(_step) if mode == "tf.function" else _step
    with tf.device("/CPU:0"):
        expected = [[t.numpy() for t in step(*args)] for args in inputs]
    results, errors = {}, []

    def worker(worker_id):
        try:
            with tf.device("/CPU:0"):
                for round_ in range(rounds):
                    for i in range(worker_id, count, threads_n):
                        results[(round_, i)] = [t.numpy() for t in step(*inputs[i])]
        except Exception as err:  # pylint: disable=broad-except
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(threads_n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    for (round_, i), got in sorted(results.items()):
        _assert_same([got], [expected[i]])
    assert len(results) == rounds * count


def test_tf_data_parallel_map_equals_sequential_calls():
    count = 16
    inputs = [_step_inputs(i) for i in range(count)]
    with tf.device("/CPU:0"):
        expected = [[t.numpy() for t in _step(*args)] for args in inputs]
    dataset = tf.data.Dataset.from_tensor_slices(tuple(tf.stack(parts) for parts in zip(*inputs)))
    dataset = dataset.map(_step, num_parallel_calls=4, deterministic=True)
    got = [[t.numpy() for t in item] for item in dataset]
    _assert_same(got, expected)


# ---- leaks: memory stays flat over many forward+backward calls ----

def _rss_mb():
    with open("/proc/self/statm", encoding="ascii") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize() / 2**20


LEAK_CALLS = int(os.environ.get("TF_FLASH_LEAK_CALLS", "10000"))


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_many_calls_keep_memory_flat():
    """10,000 eager forward+backward calls (with masks, lengths and dropout, so every input buffer is
    used): the resident set after the first 1,000 (allocator pools warmed up) may not keep growing."""
    q, kv, lengths = _step_inputs(0)
    mask = tf.constant(np.random.default_rng(0).random((2, 1, 37, 45)) < 0.9)
    step = tf.function(lambda q, kv: _step(q, kv, lengths))

    def call():
        with tf.GradientTape() as tape:
            tape.watch([q, kv])
            out = tf_flash.flash_attention(q, kv, kv, attention_mask=mask, q_lengths=lengths, dropout_rate=0.1)
        tape.gradient(out, [q, kv])
        step(q, kv)

    start = time.time()
    warmup = LEAK_CALLS // 10
    with tf.device("/CPU:0"):
        for _ in range(warmup):
            call()
        samples = [_rss_mb()]
        for i in range(LEAK_CALLS - warmup):
            call()
            if (i + 1) % (LEAK_CALLS // 10) == 0:
                samples.append(_rss_mb())
    growth = samples[-1] - samples[0]
    print(f"leak check: {LEAK_CALLS} calls in {time.time() - start:.0f}s, RSS MB after warm-up and every "
          f"{LEAK_CALLS // 10}: {[round(s, 1) for s in samples]}")
    # A leak of one 4-byte scalar per call would be 36 kB; one of the inputs (~50 kB) per call 450 MB.
    assert growth < 30, f"RSS grew by {growth:.1f} MB over {LEAK_CALLS - warmup} calls: {samples}"
