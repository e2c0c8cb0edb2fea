"""Dropout in tf_flash.flash_attention: determinism, statistics, and exactness of output and gradient for
the mask the forward used (rebuilt by tests/philox_ref.py, the NumPy twin of cc/kernels/flash/philox.h)."""
import os
import shutil
import subprocess

import numpy as np
import pytest
import tensorflow as tf

import philox_ref
import tf_flash
from device_util import DEVICES, DTYPES, native_dtype, normal, on_device, random_qkv, run_flash, tolerance
from reference import max_error, reference_attention, reference_attention_grad, standard_attention

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = pytest.mark.parametrize("use_function", [False, True], ids=["eager", "function"])
ALL_DTYPES = pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))


# ----------------------------------------------------------------------------------------------------------
# The NumPy Philox twin against the header itself (compiled with the host compiler)
# ----------------------------------------------------------------------------------------------------------

_HARNESS = r"""
#include <cstdio>
#include <cstdlib>
#include "cc/kernels/flash/philox.h"
int main(int argc, char** argv) {
  unsigned long long seed, offset, bh; long long row, col; float rate;
  while (std::scanf("%llu %llu %llu %lld %lld %f", &seed, &offset, &bh, &row, &col, &rate) == 6) {
    const uint32_t th = tf_flash::dropout_threshold(rate);
    const tf_flash::DropoutSeed s{seed, offset, 0};
    const tf_flash::Philox4 r = tf_flash::dropout_draws(s, bh, row, col);
    const int byte = tf_flash::dropout_byte(row, col);
    std::printf("%u %u %d %.9g\n", th, (r.x[byte >> 2] >> (8 * (byte & 3))) & 0xFFu,
                (int)tf_flash::dropout_keep(s, bh, row, col, th), tf_flash::dropout_keep_scale(rate));
  }
  return 0;
}
"""


def _build_harness(directory, source, flags):
    """Compiles a C++ program that includes philox.h with the host compiler; its path (skips without one)."""
    compiler = shutil.which("g++") or shutil.which("clang++")
    if compiler is None:
        pytest.skip("no host C++ compiler")
    src, exe = directory / "harness.cc", directory / "harness"
    src.write_text(source)
    subprocess.run([compiler, "-std=c++17", *flags, f"-I{REPO}", str(src), "-o", str(exe)], check=True)
    return str(exe)


@pytest.fixture(scope="module")
def philox_harness(tmp_path_factory):
    return _build_harness(tmp_path_factory.mktemp("philox"), _HARNESS, ["-O1"])


def test_philox_ref_matches_header(philox_harness):
    rng = np.random.default_rng(0)
    cases = []
    for _ in range(400):
        seed = int(rng.integers(0, 2**63)) * int(rng.integers(1, 3))
        offset = int(rng.choice([0, 1, int(rng.integers(0, 2**63)) * 2]))
        bh = int(rng.choice([0, int(rng.integers(0, 64)), int(rng.integers(0, 2**40))]))
        row, col = int(rng.integers(0, 70000)), int(rng.integers(0, 70000))
        rate = float(rng.choice([0.0, 0.1, 0.25, 0.5, 0.9, 0.999999, float(rng.random())]))
        cases.append((seed % 2**64, offset % 2**64, bh, row, col, rate))
    stdin = "".join(f"{s} {o} {b} {r} {c} {p!r}\n" for s, o, b, r, c, p in cases)
    lines = subprocess.run([philox_harness], input=stdin, capture_output=True, text=True, check=True).stdout
    for (seed, offset, bh, row, col, rate), line in zip(cases, lines.splitlines()):
        th, draw, keep, scale = line.split()
        th, draw, keep = int(th), int(draw), int(keep)
        assert philox_ref.dropout_threshold(rate) == th, (rate, th)
        assert philox_ref.dropout_draws(seed, offset, bh, [row], [col])[0, 0] == draw
        assert philox_ref.dropout_keep(seed, offset, bh, row, col, th) == bool(keep) == (draw >= th)
        assert np.float32(scale) == np.float32(philox_ref.keep_scale(rate)), (rate, scale)
    assert len(lines.splitlines()) == len(cases)


_ROW_HARNESS = r"""
#include <cstdio>
#include <vector>
#include "cc/kernels/cpu/philox_avx2.h"
int main() {
  unsigned long long seed, offset, bh; long long row, begin, end; float rate;
  while (std::scanf("%llu %llu %llu %lld %lld %lld %f", &seed, &offset, &bh, &row, &begin, &end, &rate) == 7) {
    const uint32_t th = tf_flash::dropout_threshold(rate);
    const float scale = tf_flash::dropout_keep_scale(rate);
    std::vector<float> out(end - begin, -1.f), pair(end - begin, -1.f), plus8(end - begin, -1.f);
    tf_flash::dropout_row_scales(seed, offset, bh, row, begin, end, th, scale, out.data());
    const long long lo = row & ~8LL;  // rows lo and lo + 8 from the same calls
    tf_flash::dropout_row_scales(seed, offset, bh, lo, begin, end, th, scale, pair.data(), plus8.data());
    for (const auto* v : {&out, &pair, &plus8}) {
      for (float x : *v) std::printf("%.9g ", x);
      std::printf("\n");
    }
  }
  return 0;
}
"""


@pytest.mark.parametrize("simd", ["avx2", "scalar"])
def test_row_scales_match_ref(tmp_path, simd):
    """The CPU kernel's row generator (AVX2 and portable paths) draws exactly philox_ref's mask."""
    if simd == "avx2" and "avx2" not in open("/proc/cpuinfo").read():
        pytest.skip("no AVX2 on this CPU")
    exe = _build_harness(tmp_path, _ROW_HARNESS, ["-O2"] + (["-mavx2"] if simd == "avx2" else []))
    rng = np.random.default_rng(1)
    cases = []
    for _ in range(60):
        begin = int(rng.integers(0, 300))
        end = begin + int(rng.choice([1, 7, 31, 64, 65, 200, int(rng.integers(1, 400))]))
        cases.append((int(rng.integers(0, 2**64, dtype=np.uint64)), int(rng.integers(0, 2**40)),
                      int(rng.integers(0, 2**33)), int(rng.integers(0, 5000)), begin, end,
                      float(rng.choice([0.1, 0.5, 0.9, float(rng.random())]))))
    stdin = "".join(" ".join(repr(x) for x in c) + "\n" for c in cases)
    lines = subprocess.run([exe], input=stdin, capture_output=True, text=True, check=True).stdout.splitlines()
    assert len(lines) == 3 * len(cases)
    for i, (seed, offset, bh, row, begin, end, rate) in enumerate(cases):
        # The row alone, then rows (row & ~8) and (row & ~8) + 8 drawn together.
        for line, r in zip(lines[3 * i:3 * i + 3], (row, row & ~8, (row & ~8) + 8)):
            got = np.array(line.split(), np.float32)
            keep = philox_ref.dropout_draws(seed, offset, bh, [r], np.arange(begin, end))[0] >= \
                philox_ref.dropout_threshold(rate)
            np.testing.assert_array_equal(got, np.where(keep, np.float32(philox_ref.keep_scale(rate)), 0))


def test_philox_ref_statistics():
    mask = philox_ref.keep_mask(123, 0, 2, 3, 128, 130, 0.3)
    n = mask.size
    assert abs(mask.mean() - 0.7) < 6 * np.sqrt(0.3 * 0.7 / n)
    assert (mask[0, 0] != mask[0, 1]).any() and (mask[0, 0] != mask[1, 0]).any()
    np.testing.assert_array_equal(philox_ref.keep_mask(123, 0, 1, 1, 8, 8, 0.0), True)
    assert philox_ref.dropout_threshold(0.5) == 128 and philox_ref.keep_scale(0.5) == 2.0
    # The rate takes effect in steps of 1/256; tiny rates still drop something, none drops everything.
    assert philox_ref.dropout_threshold(0.1) == 26 and philox_ref.dropout_threshold(1e-6) == 1
    assert philox_ref.dropout_threshold(0.999999) == 255


# ----------------------------------------------------------------------------------------------------------
# The op
# ----------------------------------------------------------------------------------------------------------

def _rng_state(q, k, v, device, **kwargs):
    """The (seed, offset) that the forward reports for these arguments (read in a tf.function)."""
    state = run_flash(q, k, v, device, True, **kwargs)[2]
    return int(state[0]), int(state[1])


@pytest.mark.parametrize("device", DEVICES)
@ALL_DTYPES
@MODES
def test_same_seed_bit_identical(device, dtype, use_function):
    rng = np.random.default_rng(0)
    q, k, v = random_qkv(rng, 2, 70, 90, 4, 2, 32, dtype=dtype)
    dout = normal(rng, (2, 70, 4, 32))
    first = run_flash(q, k, v, device, use_function, dout=dout, dropout_rate=0.3, seed=1234)
    second = run_flash(q, k, v, device, use_function, dout=dout, dropout_rate=0.3, seed=1234)
    for a, b in zip(first, second):
        if a is not None:
            np.testing.assert_array_equal(a, b)
    other = run_flash(q, k, v, device, use_function, dropout_rate=0.3, seed=1235)
    assert (other[0] != first[0]).any()
    no_dropout = run_flash(q, k, v, device, use_function)
    assert (no_dropout[0] != first[0]).any()
    np.testing.assert_array_equal(no_dropout[1], first[1])  # lse does not see dropout


def _one_hot_case(batch, heads, n, dtype):
    """q = k = 0 (uniform probabilities 1/n) and value = identity: out[b, i, h, j] = keep[b, h, i, j] / ((1-p) n)."""
    q = tf.zeros([batch, n, heads, n], dtype)
    k = tf.zeros([batch, n, heads, n], dtype)
    v = tf.constant(np.broadcast_to(np.eye(n, dtype=np.float32)[None, :, None, :], (batch, n, heads, n)), dtype)
    return q, k, v


def _recover_keep(out, n, rate):
    # [B, Sq, H, n] -> [B, H, Sq, Sk]
    return np.asarray(out, np.float64).transpose(0, 2, 1, 3) * n / philox_ref.keep_scale(rate) > 0.5


@pytest.mark.parametrize("device", DEVICES)
@ALL_DTYPES
@pytest.mark.parametrize("rate", [0.1, 0.5, 0.8])
def test_kept_fraction_and_mask_recovered_through_output(device, dtype, rate):
    batch, heads, n = 4, 4, 128
    q, k, v = _one_hot_case(batch, heads, n, dtype)
    out, _, rng_state, *_ = run_flash(q, k, v, device, True, dropout_rate=rate, seed=99)
    keep = _recover_keep(out, n, rate)
    values = np.asarray(out, np.float64).transpose(0, 2, 1, 3)[keep] * n / philox_ref.keep_scale(rate)
    np.testing.assert_allclose(values, 1.0, rtol=tolerance("kept_value", dtype, device))
    fraction = keep.mean()
    kept = 1 - philox_ref.dropout_threshold(rate) / 256  # the rate in steps of 1/256
    assert abs(kept - (1 - rate)) <= 1 / 512
    bound = 6 * np.sqrt(kept * (1 - kept) / keep.size)
    assert abs(fraction - kept) < bound, (fraction, kept, bound)
    # Every (batch, head) has its own stream, and the mask is the one philox.h defines.
    assert (keep[0, 0] != keep[0, 1]).any() and (keep[0, 0] != keep[1, 0]).any()
    expected = philox_ref.keep_mask(int(rng_state[0]), int(rng_state[1]), batch, heads, n, n, rate)
    np.testing.assert_array_equal(keep, expected)


@pytest.mark.parametrize("device", DEVICES)
def test_gradient_uses_forward_mask_recovered_through_output(device):
    # The mask recovered through the output (value = identity) alone, with no knowledge of the RNG,
    # must give the reference gradient of the op's backward pass.
    batch, heads, n, rate = 1, 2, 64, 0.4
    dtype = native_dtype(device)
    rng = np.random.default_rng(1)
    zeros, _, eye = _one_hot_case(batch, heads, n, dtype)
    out_mask = run_flash(zeros, zeros, eye, device, False, dropout_rate=rate, seed=5)[0]
    keep = _recover_keep(out_mask, n, rate)
    q, k, v = random_qkv(rng, batch, n, n, heads, heads, n, dtype=dtype)
    dout = normal(rng, (batch, n, heads, n))
    out, _, _, dq, dk, dv = run_flash(q, k, v, device, False, dout=dout, dropout_rate=rate, seed=5)
    kw = dict(keep_mask=keep, dropout_rate=rate)
    assert max_error(out, reference_attention(q, k, v, **kw)[0]) < tolerance("max_output", dtype, device)
    for name, got, want in zip("qkv", (dq, dk, dv), reference_attention_grad(q, k, v, dout, **kw)):
        assert max_error(got, want) < tolerance("max_gradient", dtype, device), f"d{name}"


FEATURES = {
    "plain": dict(),
    "causal": dict(causal=True),
    "gqa_window": dict(window=(20, 5), gqa=True),
    "lengths": dict(q_lengths=[50, 33], kv_lengths=[77, 20]),
    "causal_lengths_gqa": dict(causal=True, q_lengths=[61, 40], kv_lengths=[45, 80], gqa=True),
    "attention_mask_scale": dict(attention_mask="random", scale=0.2),
}


@pytest.mark.parametrize("device", DEVICES)
@ALL_DTYPES
@MODES
@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_output_and_gradient_match_reference_with_philox_mask(device, dtype, use_function, feature):
    rng = np.random.default_rng(2)
    batch, heads, sq, sk, dim, dim_v, rate = 2, 4, 61, 80, 32, 24, 0.2
    kw = dict(FEATURES[feature])
    heads_kv = 2 if kw.pop("gqa", False) else heads
    if kw.get("attention_mask") == "random":
        kw["attention_mask"] = rng.random((batch, heads, sq, sk)) < 0.8
    q, k, v = random_qkv(rng, batch, sq, sk, heads, heads_kv, dim, dim_v, dtype)
    dout = normal(rng, (batch, sq, heads, dim_v))
    out, lse, rng_state, dq, dk, dv = run_flash(q, k, v, device, use_function, dout=dout, dropout_rate=rate,
                                             seed=[7, 3] if use_function else 7, **kw)
    if rng_state is None:
        seed, offset = _rng_state(q, k, v, device, dropout_rate=rate, seed=7, **kw)
    else:
        seed, offset = int(rng_state[0]), int(rng_state[1])
    keep = philox_ref.keep_mask(seed, offset, batch, heads, sq, sk, rate)
    ref_kw = dict(kw, keep_mask=keep, dropout_rate=rate)
    ref_out, ref_lse = reference_attention(q, k, v, **ref_kw)
    out_tol = tolerance("max_output", dtype, device)
    if dtype != tf.float32:  # at most 2x the error of same-dtype standard attention
        std_err = max_error(standard_attention(q, k, v, dtype=q.dtype.as_numpy_dtype, **ref_kw), ref_out)
        out_tol = max(out_tol, 2 * std_err)
    assert max_error(out, ref_out) <= out_tol
    finite = np.isfinite(ref_lse)
    np.testing.assert_array_equal(np.isfinite(lse), finite)
    np.testing.assert_allclose(lse[finite], ref_lse[finite], atol=tolerance("lse", dtype, device))
    for name, got, want in zip("qkv", (dq, dk, dv), reference_attention_grad(q, k, v, dout, **ref_kw)):
        assert max_error(got, want) <= tolerance("max_gradient", dtype, device), f"d{name}: {max_error(got, want)}"


@pytest.mark.parametrize("device", DEVICES)
def test_compute_gradient_fixed_seed(device):
    rng = np.random.default_rng(3)
    q, k, v = random_qkv(rng, 1, 6, 9, 2, 1, 8, 4)

    def fn(q, k, v):
        return tf_flash.flash_attention(q, k, v, causal=True, dropout_rate=0.3, seed=42)

    with on_device(device):
        theoretical, _ = tf.test.compute_gradient(fn, [q, k, v], delta=1e-2)
    # The same seed drops the same entries on every device, so the finite differences come from the CPU
    # kernel (float32): on the GPU float32 runs on float16 operands, whose rounding swamps them.
    with tf.device("/CPU:0"):
        _, numerical = tf.test.compute_gradient(fn, [q, k, v], delta=1e-2)
    tol = 1e-2 if "GPU" in device else 5e-3
    for t, n in zip(theoretical, numerical):
        np.testing.assert_allclose(t, n, atol=tol, rtol=tol)


@pytest.mark.parametrize("device", DEVICES)
@MODES
def test_seed_none(device, use_function):
    rng = np.random.default_rng(4)
    q, k, v = random_qkv(rng, 1, 40, 40, 2, 2, 32, dtype=native_dtype(device))

    def fn():
        return tf_flash.flash_attention(q, k, v, dropout_rate=0.5)

    run = tf.function(fn) if use_function else fn
    with on_device(device):
        a, b = run().numpy(), run().numpy()
        assert (a != b).any(), "two calls without a seed must draw different masks"
        tf.random.set_seed(17)
        c = (tf.function(fn) if use_function else fn)().numpy()
        tf.random.set_seed(17)
        d = (tf.function(fn) if use_function else fn)().numpy()
    np.testing.assert_array_equal(c, d)


@pytest.mark.parametrize("device", DEVICES)
def test_seed_int_and_tensor(device):
    rng = np.random.default_rng(5)
    dtype = native_dtype(device)
    q, k, v = random_qkv(rng, 1, 40, 48, 2, 2, 32, dtype=dtype)
    with on_device(device):
        by_int = tf_flash.flash_attention(q, k, v, dropout_rate=0.3, seed=8).numpy()
        by_int_again = tf_flash.flash_attention(q, k, v, dropout_rate=0.3, seed=8).numpy()
        by_tensor = tf_flash.flash_attention(q, k, v, dropout_rate=0.3,
                                             seed=tf.constant([8, 1], tf.int64)).numpy()
        by_tensor_again = tf_flash.flash_attention(q, k, v, dropout_rate=0.3,
                                                   seed=tf.constant([8, 1], tf.int64)).numpy()
        by_tensor_other = tf_flash.flash_attention(q, k, v, dropout_rate=0.3,
                                                   seed=tf.constant([8, 2], tf.int64)).numpy()
    np.testing.assert_array_equal(by_int, by_int_again)
    np.testing.assert_array_equal(by_tensor, by_tensor_again)
    assert (by_tensor != by_tensor_other).any()

    # A seed fed into one traced function: different values, no retrace, different masks; the
    # reported rng state is the mask's (checked against the Philox twin).
    @tf.function(input_signature=[tf.TensorSpec([2], tf.int64)])
    def traced(seed):
        out = tf_flash.flash_attention(q, k, v, dropout_rate=0.3, seed=seed)
        return out, out.op.outputs[2]

    with on_device(device):
        out1, state1 = traced(tf.constant([8, 1], tf.int64))
        out2, state2 = traced(tf.constant([-5, 2**40], tf.int64))
    assert (out1.numpy() != out2.numpy()).any()
    np.testing.assert_array_equal(out1, by_tensor)
    for out, state in ((out1, state1), (out2, state2)):
        keep = philox_ref.keep_mask(int(state[0]), int(state[1]), 1, 2, 40, 48, 0.3)
        ref = reference_attention(q, k, v, keep_mask=keep, dropout_rate=0.3)[0]
        assert max_error(out, ref) < tolerance("max_output", dtype, device)


@pytest.mark.parametrize("device", DEVICES)
def test_rate_zero_is_no_dropout(device):
    rng = np.random.default_rng(6)
    q, k, v = random_qkv(rng, 1, 33, 47, 2, 1, 32, dtype=native_dtype(device))
    with on_device(device):
        plain = tf_flash.flash_attention(q, k, v).numpy()
        zero = tf_flash.flash_attention(q, k, v, dropout_rate=0.0, seed=3).numpy()
    np.testing.assert_array_equal(plain, zero)


@pytest.mark.parametrize("rate", [-0.1, 1.0, 1.5, "0.1", None, float("nan")])
def test_dropout_rate_validation(rate):
    q = tf.zeros([1, 8, 1, 8])
    with pytest.raises((ValueError, tf.errors.InvalidArgumentError), match="dropout_rate") as info:
        tf_flash.flash_attention(q, q, q, dropout_rate=rate)
    assert "Received" in str(info.value) or "received" in str(info.value)


@pytest.mark.parametrize("seed", [1.5, "7", [1, 2, 3], np.zeros([2, 2], np.int64)])
def test_seed_validation(seed):
    q = tf.zeros([1, 8, 1, 8])
    with pytest.raises((ValueError, tf.errors.InvalidArgumentError), match="seed"):
        tf_flash.flash_attention(q, q, q, dropout_rate=0.1, seed=seed)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [tf.float16, tf.bfloat16], ids=["f16", "bf16"])
def test_cpu_and_gpu_drop_the_same_entries(dtype):
    batch, heads, n, rate = 2, 2, 128, 0.3
    q, k, v = _one_hot_case(batch, heads, n, dtype)
    outs = [run_flash(q, k, v, device, False, dropout_rate=rate, seed=2024)[0] for device in ("/CPU:0", "/GPU:0")]
    np.testing.assert_array_equal(_recover_keep(outs[0], n, rate), _recover_keep(outs[1], n, rate))
