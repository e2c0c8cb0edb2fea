"""FP8 (float8_e4m3fn) attention: the Hopper forward with descales (tf_flash.flash_attention's q_descale, k_descale,
v_descale, output_dtype; op TfFlash>FlashAttentionFp8).

GPU cases (an sm_90 GPU and a library with sm_90a code) hold the output to the float64 attention of the
dequantized inputs (query * q_descale, ...). The inputs are quantized per tensor or per (batch entry, kv head) so
that their largest magnitude lands near e4m3's largest (448). Error sources the bounds cover: P rounded to e4m3
before P V (3 mantissa bits: up to 2^-4 relative per probability, about 3-4% of the output's norm once averaged
over keys), and the output's rounding to bfloat16 / float16. Q K^T runs on the fp8 tensor cores, whose sums
keep fewer bits than float32 (about 14): a score's error grows with sum_d |q_d k_d|, so lse's bound does too
(on an H200 the largest lse error was 2^-12.6 to 2^-14 of scale * max_j sum_d |q_d k_d|, the row's largest).
CPU cases check the argument errors, the refusals (no CPU kernels, no gradient) and the XLA lowering (one custom
call of the fp8 target; on the CPU its handler refuses as the CPU kernel does)."""
import re

import numpy as np
import pytest
import tensorflow as tf

import tf_flash
from reference import reference_attention, relative_error, to_numpy
from tf_flash.ops import _flash_attention

FP8 = tf.dtypes.experimental.float8_e4m3fn
# Quantized inputs reach this largest magnitude (e4m3's largest finite is 448; TF's cast gives NaN above it).
E4M3_TARGET = 440.0

# Relative Frobenius error of the output and max |lse error| against float64, by head dim (see the docstring); lse's
# bound grows by LSE_ACCUMULATION times the row's largest scaled sum_d |q_d k_d|.
OUTPUT_TOLERANCE = {64: 0.06, 128: 0.06, 256: 0.06}
LSE_TOLERANCE = {64: 2e-3, 128: 2e-3, 256: 3e-3}
LSE_ACCUMULATION = 2.0 ** -10


def _hopper_fp8():
    """The fp8 forward runs here: an sm_90 GPU and a library with sm_90a code."""
    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        return False
    details = tf.config.experimental.get_device_details(gpus[0])
    archs = tf_flash.build_info().get("cuda_archs", "").split(",")
    return details.get("compute_capability", (0, 0))[0] == 9 and "90a" in archs


def _reduced_build():
    return tf_flash.build_info().get("cuda_reduced") == "1"


hopper = pytest.mark.skipif("not _hopper_fp8()", reason="FP8 attention needs an sm_90 GPU and sm_90a code")


def quantize(x, per_head):
    """x [B, S, Hkv, D] float32 (NumPy) -> (fp8 tensor, descale): descale per tensor (a scalar) or [B, Hkv]."""
    amax = np.abs(x).max(axis=(1, 3), initial=0.0) if per_head else np.abs(x).max(initial=0.0)
    descale = np.maximum(amax, 1e-12).astype(np.float32) / E4M3_TARGET
    scaled = x / (descale[:, None, :, None] if per_head else descale)
    with tf.device("/CPU:0"):
        q = tf.cast(tf.constant(scaled.astype(np.float32)), FP8)
    return q, tf.constant(descale, tf.float32)


def dequantize(x8, descale):
    x = to_numpy(tf.cast(x8, tf.float32))
    d = to_numpy(descale)
    return x * (d[:, None, :, None] if d.ndim == 2 else d)


def _inputs(rng, batch, seqlen_q, seqlen_k, heads, heads_kv, head_dim, per_head, amplitude=1.0):
    """Quantized q, k, v and their descales. Per head, each (batch, kv head) gets its own amplitude, so that a
    descale read from the wrong entry shows. q's descale is per kv head too (the op's [B, Hkv]); its query heads
    share it."""
    shapes = [(batch, seqlen_q, heads, head_dim), (batch, seqlen_k, heads_kv, head_dim),
              (batch, seqlen_k, heads_kv, head_dim)]
    arrays = []
    for shape in shapes:
        x = rng.standard_normal(shape).astype(np.float32) * amplitude
        if per_head:
            x *= rng.uniform(0.25, 4.0, size=(batch, 1, shape[2], 1)).astype(np.float32)
        arrays.append(x)
    if per_head and heads != heads_kv:  # q's descale is [B, Hkv]: quantize its heads by groups
        group = heads // heads_kv
        grouped = arrays[0].reshape(batch, seqlen_q, heads_kv, group * head_dim)
        q8, qd = quantize(grouped, per_head=True)
        q8 = tf.reshape(q8, (batch, seqlen_q, heads, head_dim))
    else:
        q8, qd = quantize(arrays[0], per_head)
    k8, kd = quantize(arrays[1], per_head)
    v8, vd = quantize(arrays[2], per_head)
    return (q8, k8, v8), (qd, kd, vd)


def _dequantized(tensors, descales, heads):
    q8, k8, v8 = tensors
    qd, kd, vd = descales
    if qd.shape.rank == 2 and heads != k8.shape[2]:  # [B, Hkv] over groups of query heads
        group = heads // k8.shape[2]
        qd = tf.repeat(qd, group, axis=1)
    return dequantize(q8, qd), dequantize(k8, kd), dequantize(v8, vd)


def _run(tensors, descales, mode="eager", attention=tf_flash.flash_attention, **kwargs):
    q8, k8, v8 = tensors
    qd, kd, vd = descales

    def fn(q8, k8, v8, qd, kd, vd):
        return attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, return_lse=True, **kwargs)

    if mode in ("tf.function", "xla"):
        fn = tf.function(fn, jit_compile=mode == "xla")
    with tf.device("/GPU:0"):
        on_gpu = [tf.identity(t) for t in (q8, k8, v8, qd, kd, vd)]
        out, lse = fn(*on_gpu)
    return out, lse


def _check(out, lse, tensors, descales, head_dim, output_dtype=tf.bfloat16, **reference_kwargs):
    heads = tensors[0].shape[2]
    q, k, v = _dequantized(tensors, descales, heads)
    ref_out, ref_lse = reference_attention(q, k, v, **reference_kwargs)
    assert out.dtype == output_dtype and lse.dtype == tf.float32
    out, lse = to_numpy(out), to_numpy(lse)
    assert relative_error(out, ref_out) < OUTPUT_TOLERANCE[head_dim]
    np.testing.assert_array_equal(np.isfinite(lse), np.isfinite(ref_lse))
    finite = np.isfinite(ref_lse)
    group = q.shape[2] // k.shape[2]
    magnitude = np.einsum("bihd,bjhd->bhij", np.abs(q), np.repeat(np.abs(k), group, axis=2)).max(axis=3, initial=0.0)
    bound = LSE_TOLERANCE[head_dim] + LSE_ACCUMULATION * magnitude / np.sqrt(head_dim)  # the default scale
    assert np.all(np.abs(lse[finite] - ref_lse[finite]) < bound[finite])
    np.testing.assert_array_equal(out[~finite.transpose(0, 2, 1)], 0)  # rows that see nothing: 0


def _skip_uncompiled(head_dim):
    if head_dim > 128 and _reduced_build():
        pytest.skip("reduced build: head dims above 128 not compiled")


# ---- GPU: against float64 ----

@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True, "bottom_right"])
@pytest.mark.parametrize("heads_kv", [4, 1], ids=["mha", "gqa"])
@pytest.mark.parametrize("per_head", [False, True], ids=["per_tensor", "per_head"])
def test_fp8_forward_matches_float64(rng, head_dim, causal, heads_kv, per_head):
    _skip_uncompiled(head_dim)
    seqlen_q, seqlen_k = 200, 333  # not multiples of any tile
    tensors, descales = _inputs(rng, 2, seqlen_q, seqlen_k, 4, heads_kv, head_dim, per_head)
    before = tf_flash.cuda_kernel_counts()["forward_sm90"]
    out, lse = _run(tensors, descales, causal=causal)
    assert tf_flash.cuda_kernel_counts()["forward_sm90"] > before
    _check(out, lse, tensors, descales, head_dim, causal=causal)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("output_dtype", [tf.bfloat16, tf.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("mode", ["eager", "tf.function", "xla"])
def test_fp8_output_dtype_and_modes(rng, head_dim, output_dtype, mode):
    _skip_uncompiled(head_dim)
    tensors, descales = _inputs(rng, 1, 257, 129, 2, 2, head_dim, per_head=False)
    out, lse = _run(tensors, descales, mode=mode, output_dtype=output_dtype)
    _check(out, lse, tensors, descales, head_dim, output_dtype=output_dtype)
    if mode != "eager":  # the same kernel on the same inputs: the eager call's bits
        eager_out, eager_lse = _run(tensors, descales, output_dtype=output_dtype)
        np.testing.assert_array_equal(to_numpy(out), to_numpy(eager_out))
        np.testing.assert_array_equal(to_numpy(lse), to_numpy(eager_lse))


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("features", ["kv_lengths", "window", "softcap", "segment_ids", "attention_mask",
                                      "block_mask", "q_lengths"])
@pytest.mark.parametrize("mode", ["eager", "xla"])
def test_fp8_features(rng, head_dim, features, mode):
    """The Hopper forward's features come through the fp8 kernel (the same templated kernel), and through its XLA
    custom call (the packed attn_mask and V^T in its workspace result)."""
    batch, seqlen, heads, heads_kv = 2, 384, 4, 2
    tensors, descales = _inputs(rng, batch, seqlen, seqlen, heads, heads_kv, head_dim, per_head=True)
    kwargs = {}
    if features == "kv_lengths":
        kwargs = dict(kv_lengths=tf.constant([300, 77], tf.int32), causal="bottom_right")
    elif features == "q_lengths":
        kwargs = dict(q_lengths=tf.constant([383, 5], tf.int32), kv_lengths=tf.constant([129, 384], tf.int32))
    elif features == "window":
        kwargs = dict(window=(100, 30), causal=False)
    elif features == "softcap":
        kwargs = dict(softcap=5.0, causal=True)
    elif features == "segment_ids":
        ids = np.repeat(np.arange(6), 64)[None].repeat(batch, 0).astype(np.int32)
        ids[1] = np.repeat([0, 1, 2], [100, 200, 84])
        kwargs = dict(segment_ids=tf.constant(ids), causal=True)
    elif features == "attention_mask":
        mask = rng.random((batch, 1, seqlen, seqlen)) < 0.7
        mask[:, :, :, 200:] = False  # whole hidden key tiles beside partly hidden ones
        kwargs = dict(attention_mask=tf.constant(mask))
    elif features == "block_mask":
        blocks = -(-seqlen // 128)
        block_mask = rng.random((heads, blocks, blocks)) < 0.6
        block_mask[:, :, 0] = True
        kwargs = dict(block_mask=tf.constant(block_mask), block_size=128)
    out, lse = _run(tensors, descales, mode=mode, **kwargs)
    reference_kwargs = {name: (to_numpy(value, None) if isinstance(value, tf.Tensor) else value)
                        for name, value in kwargs.items()}
    _check(out, lse, tensors, descales, head_dim, **reference_kwargs)


# (batch, seqlen_q, heads, heads_kv, seqlen_k, head_dim, splits, kv_lengths): decoding steps against fp8 caches.
FP8_DECODE_CASES = [
    (2, 1, 8, 2, 4500, 128, 4, [4500, 1000]),
    (3, 4, 8, 2, 3000, 64, 3, [3000, 5, 0]),  # several new tokens on their diagonals; an empty cache
    (1, 1, 16, 4, 2100, 256, 2, None),
    (2, 1, 4, 4, 4096, 128, None, [4096, 2049]),  # no GQA; the runs as _decode.plan chooses them
]


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("case", FP8_DECODE_CASES, ids=lambda c: f"b{c[0]}q{c[1]}h{c[2]}kv{c[3]}k{c[4]}d{c[5]}")
@pytest.mark.parametrize("mode", ["eager", "xla"])
def test_fp8_decode_path(rng, case, mode):
    """fp8 calls of decoding shape take the decode path (_decode.py): query heads packed by KV head (their descales
    per KV head are the packed heads' own), the key range in runs merged by lse. Against the float64 attention of
    the dequantized inputs, and the unsplit call's lse (both from float32 row sums); value rows of keys a key mask
    hides, poisoned with NaN, change nothing."""
    batch, seqlen_q, heads, heads_kv, seqlen_k, head_dim, splits, kv_lengths = case
    _skip_uncompiled(head_dim)
    tensors, descales = _inputs(rng, batch, seqlen_q, seqlen_k, heads, heads_kv, head_dim, per_head=True)
    kwargs = dict(causal="bottom_right")
    if kv_lengths is not None:
        kwargs["kv_lengths"] = tf.constant(kv_lengths, tf.int32)
    out, lse = _run(tensors, descales, mode=mode, attention=_flash_attention, split_kv=splits, **kwargs)
    reference_kwargs = {name: (to_numpy(value, None) if isinstance(value, tf.Tensor) else value)
                        for name, value in kwargs.items()}
    _check(out, lse, tensors, descales, head_dim, **reference_kwargs)
    _, unsplit_lse = _run(tensors, descales, mode=mode, attention=_flash_attention, split_kv=False, **kwargs)
    lse, unsplit_lse = to_numpy(lse), to_numpy(unsplit_lse)
    np.testing.assert_array_equal(np.isfinite(lse), np.isfinite(unsplit_lse))
    np.testing.assert_allclose(lse[np.isfinite(lse)], unsplit_lse[np.isfinite(lse)], rtol=1e-5, atol=1e-5)

    shown = rng.random((batch, 1, 1, seqlen_k)) < 0.6
    shown[..., 100:1100] = False  # whole hidden tiles, in the first run's share
    q8, k8, v8 = tensors
    hidden = np.broadcast_to(~shown[:, 0, 0, :, None, None], v8.shape)
    with tf.device("/CPU:0"):
        poisoned = tf.cast(tf.where(hidden, np.nan, tf.cast(v8, tf.float32)), FP8)
    masked = dict(kwargs, attention_mask=tf.constant(shown))
    out, lse = _run(tensors, descales, mode=mode, attention=_flash_attention, split_kv=splits, **masked)
    out_poisoned, _ = _run((q8, k8, poisoned), descales, mode=mode, attention=_flash_attention, split_kv=splits,
                           **masked)
    np.testing.assert_array_equal(to_numpy(out_poisoned), to_numpy(out))
    reference_kwargs["attention_mask"] = shown
    _check(out, lse, tensors, descales, head_dim, **reference_kwargs)


@pytest.mark.gpu
@hopper
def test_fp8_output_fully_written(rng):
    """Every element of the output and lse is written: buffers recycled from a NaN fill show up otherwise."""
    tensors, descales = _inputs(rng, 2, 131, 97, 3, 3, 64, per_head=False)
    for _ in range(2):
        with tf.device("/GPU:0"):
            poison = tf.fill([2 * 131 * 3 * 64 * 4], tf.constant(np.nan, tf.float32))  # fills the pool with NaNs
            del poison
        out, lse = _run(tensors, descales, q_lengths=tf.constant([100, 131], tf.int32),
                        kv_lengths=tf.constant([97, 50], tf.int32), causal=True)
        out, lse = to_numpy(out), to_numpy(lse)
        assert np.isfinite(out).all()
        assert not np.isnan(lse).any()


@pytest.mark.gpu
@hopper
def test_fp8_without_keys(rng):
    """No keys: every row sees nothing (output 0, lse -inf), as at 16 bits."""
    tensors, descales = _inputs(rng, 2, 33, 0, 2, 1, 64, per_head=False)
    out, lse = _run(tensors, descales)
    np.testing.assert_array_equal(to_numpy(out), 0)
    assert np.isneginf(to_numpy(lse)).all()


@pytest.mark.gpu
@hopper
def test_fp8_refuses_unsupported_head_dim(rng):
    tensors, descales = _inputs(rng, 1, 16, 16, 1, 1, 40, per_head=False)  # not a multiple of 16
    with pytest.raises(tf.errors.InvalidArgumentError, match="FP8.*multiples of 16"):
        _run(tensors, descales)


@pytest.mark.gpu
def test_fp8_on_a_gpu_that_is_not_hopper(rng):
    if _hopper_fp8():
        pytest.skip("this GPU runs fp8")
    tensors, descales = _inputs(rng, 1, 16, 16, 1, 1, 64, per_head=False)
    with pytest.raises(tf.errors.InvalidArgumentError, match="FP8.*Hopper"):
        _run(tensors, descales)


# ---- CPU: argument errors and refusals ----

def _small(rng, head_dim=64, heads=2, heads_kv=2):
    return _inputs(rng, 2, 8, 8, heads, heads_kv, head_dim, per_head=False)


def test_fp8_on_cpu_says_hopper(rng):
    (q, k, v), (qd, kd, vd) = _small(rng)
    with tf.device("/CPU:0"):
        with pytest.raises(tf.errors.InvalidArgumentError, match="FP8 \\(float8_e4m3fn\\).*Hopper GPU"):
            tf_flash.flash_attention(q, k, v, q_descale=qd, k_descale=kd, v_descale=vd)


def test_fp8_mixed_dtypes(rng):
    (q, k, v), _ = _small(rng)
    with pytest.raises(ValueError, match="`key` must have the dtype of query \\(float8_e4m3fn\\).*bfloat16"):
        tf_flash.flash_attention(q, tf.cast(tf.cast(k, tf.float32), tf.bfloat16), v)
    with pytest.raises(ValueError, match="`value` must have the dtype of query \\(float32\\).*float8_e4m3fn"):
        tf_flash.flash_attention(tf.cast(q, tf.float32), tf.cast(k, tf.float32), v)


def test_other_fp8_formats_refused(rng):
    e5m2 = tf.dtypes.experimental.float8_e5m2
    x = tf.cast(tf.constant(rng.standard_normal((1, 8, 1, 64)).astype(np.float32)), e5m2)
    with pytest.raises(ValueError, match="float8_e4m3fn.*Received: query.dtype=float8_e5m2"):
        tf_flash.flash_attention(x, x, x)


@pytest.mark.parametrize("name", ["q_descale", "k_descale", "v_descale", "output_dtype"])
def test_fp8_arguments_need_fp8_inputs(rng, name):
    q = tf.constant(rng.standard_normal((1, 8, 2, 64)).astype(np.float32))
    value = tf.bfloat16 if name == "output_dtype" else 0.5
    with pytest.raises(ValueError, match=f"`{name}` applies to float8_e4m3fn inputs only"):
        tf_flash.flash_attention(q, q, q, **{name: value})


@pytest.mark.parametrize("output_dtype", [tf.float32, "int8", FP8, 3])
def test_fp8_output_dtype_checked(rng, output_dtype):
    (q, k, v), _ = _small(rng)
    with pytest.raises(ValueError, match="`output_dtype` must be None, tf.bfloat16 or tf.float16.*Received"):
        tf_flash.flash_attention(q, k, v, output_dtype=output_dtype)


@pytest.mark.parametrize("shape", [[3], [2, 3], [2, 2, 1], [1, 2]])
def test_fp8_descale_shape_checked(rng, shape):
    (q, k, v), _ = _small(rng)  # batch 2, kv heads 2
    with pytest.raises(ValueError, match="`k_descale` must be a float32 scalar \\(per tensor\\) or "
                                         "\\[batch, kv_heads\\] = \\[2, 2\\]. Received: k_descale.shape"):
        tf_flash.flash_attention(q, k, v, k_descale=tf.ones(shape, tf.float32))


def test_fp8_descale_dtype_checked(rng):
    (q, k, v), _ = _small(rng)
    with pytest.raises(ValueError, match="`v_descale` must be float32. Received: v_descale of dtype float16"):
        tf_flash.flash_attention(q, k, v, v_descale=tf.constant(1.0, tf.float16))


def test_fp8_descales_all_of_one_form_in_the_op(rng):
    """The op itself (what a SavedModel or a direct call feeds) checks that the three descales agree; the Python
    front door broadcasts a scalar among [B, Hkv] ones."""
    from tf_flash._ops import ops  # pylint: disable=import-outside-toplevel
    (q, k, v), _ = _small(rng)
    empty_mask = tf.zeros([0, 0, 0, 0], tf.bool)
    with tf.device("/CPU:0"), pytest.raises(tf.errors.InvalidArgumentError,
                                            match="must all be per tensor or all per \\[batch, kv_heads\\]"):
        ops.tf_flash_flash_attention_fp8(
            query=q, key=k, value=v, q_lengths=tf.zeros([0], tf.int32), kv_lengths=tf.zeros([0], tf.int32),
            attention_mask=empty_mask, block_mask=empty_mask, q_segment_ids=tf.zeros([0, 0], tf.int32),
            kv_segment_ids=tf.zeros([0, 0], tf.int32), seed=tf.zeros([2], tf.int64),
            q_descale=tf.ones([2, 2]), k_descale=tf.ones([]), v_descale=tf.ones([]), scale=0.125)


def test_fp8_scalar_descale_broadcast_beside_per_head(rng):
    """A scalar descale beside [B, Hkv] ones reaches the op as [B, Hkv] (then the CPU's refusal, not a shape
    error)."""
    (q, k, v), _ = _small(rng)
    with tf.device("/CPU:0"), pytest.raises(tf.errors.InvalidArgumentError, match="Hopper GPU"):
        tf_flash.flash_attention(q, k, v, q_descale=tf.ones([2, 2]), k_descale=0.5)


def test_fp8_dropout_refused(rng):
    (q, k, v), _ = _small(rng)
    with pytest.raises(ValueError, match="FP8 \\(float8_e4m3fn\\) attention takes no dropout.*dropout_rate=0.1"):
        tf_flash.flash_attention(q, k, v, dropout_rate=0.1)


def test_fp8_under_xla_is_one_custom_call(rng):
    """Under jit_compile the fp8 forward lowers to one call of its own target, the descales among its operands and
    no score matrix (a call that needs no scratch memory: the target XLA records into its CUDA graphs); on the CPU
    that call refuses at run time, as the CPU kernel does."""
    seqlen = 136  # a size no other dim has: an [.., 136, 136] value would be the score matrix
    tensors, descales = _inputs(rng, 1, seqlen, seqlen, 2, 1, 64, per_head=True)

    @tf.function(jit_compile=True)
    def fn(q8, k8, v8, qd, kd, vd):
        return tf_flash.flash_attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, causal=True,
                                        output_dtype=tf.float16)

    with tf.device("/CPU:0"):
        hlo = fn.experimental_get_compiler_ir(*tensors, *descales)(stage="hlo")
        # A CUDA build adds the workspace result (V^T) even for the CPU: the lowering does not know the device.
        call = re.search(r"= \(f16\[1,136,2,64\](\{[0-9,]*\})?, f32\[1,2,136\](\{[0-9,]*\})?(, u8\[[0-9]+\]\S*)?\) "
                         r"custom-call\(([^)]*)\)"
                         r".*custom_call_target=\"tf_flash_attention_fwd_fp8_graph\"", hlo)
        assert call, hlo
        assert call.group(4).count("f8e4m3fn[1,136,") == 3 and call.group(4).count("f32[1,1]") == 3
        assert "api_version=API_VERSION_TYPED_FFI" in hlo
        assert not re.search(rf"\[[0-9,]*{seqlen},{seqlen}\]", hlo), "an [S, S] value in the HLO"
        assert " dot(" not in hlo
        with pytest.raises(tf.errors.InvalidArgumentError, match="FP8 \\(float8_e4m3fn\\).*Hopper GPU.*XLA's CPU"):
            fn(*tensors, *descales)


def test_fp8_decode_path_under_xla_is_one_packed_split_call(rng):
    """A decoding step of fp8 under jit_compile: one fp8 custom call on the packed query ([B, group, Hkv, D]) with
    the runs in its num_splits attribute and their memory in a workspace result, so that XLA keeps it in its CUDA
    graphs (the graph target); the whole cache is its K and V operands, no score matrix."""
    tensors, descales = _inputs(rng, 1, 1, 4096, 8, 2, 64, per_head=True)

    @tf.function(jit_compile=True)
    def fn(q8, k8, v8, qd, kd, vd):
        return _flash_attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, causal="bottom_right",
                                split_kv=4)

    with tf.device("/CPU:0"):
        hlo = fn.experimental_get_compiler_ir(*tensors, *descales)(stage="hlo")
    calls = [line for line in hlo.splitlines() if "custom-call(" in line]
    assert len(calls) == 1 and 'custom_call_target="tf_flash_attention_fwd_fp8_graph"' in calls[0], hlo
    assert "custom-call(f8e4m3fn[1,4,2,64]" in calls[0] and calls[0].count("f8e4m3fn[1,4096,2,64]") >= 2
    assert re.search(r"= \(bf16\[1,4,2,64\]\S*, f32\[1,2,4\]\S*, u8\[[0-9]+\]\S*\) custom-call", calls[0])
    assert re.search(r"num_splits = 4\b", calls[0]), calls[0]
    assert " dot(" not in hlo


def test_fp8_under_xla_checks_descales_at_compile_time(rng):
    """The lowering checks the op's inputs as the kernel does (here the descales, which the Python front door
    would broadcast: the op called directly)."""
    from tf_flash._ops import ops  # pylint: disable=import-outside-toplevel
    (q, k, v), _ = _small(rng)
    empty_mask = tf.zeros([0, 0, 0, 0], tf.bool)

    @tf.function(jit_compile=True)
    def fn(q, k, v):
        return ops.tf_flash_flash_attention_fp8(
            query=q, key=k, value=v, q_lengths=tf.zeros([0], tf.int32), kv_lengths=tf.zeros([0], tf.int32),
            attention_mask=empty_mask, block_mask=empty_mask, q_segment_ids=tf.zeros([0, 0], tf.int32),
            kv_segment_ids=tf.zeros([0, 0], tf.int32), seed=tf.zeros([2], tf.int64),
            q_descale=tf.ones([2, 2]), k_descale=tf.ones([]), v_descale=tf.ones([]), scale=0.125)[0]

    with tf.device("/CPU:0"), pytest.raises(tf.errors.InvalidArgumentError,
                                            match="must all be per tensor or all per \\[batch, kv_heads\\]"):
        fn(q, k, v)


def test_fp8_gradient_raises(rng):
    (q, k, v), _ = _small(rng)

    @tf.function(autograph=False)  # (autograph would wrap the LookupError into its StagingError)
    def fn(q_descale):
        out = tf_flash.flash_attention(q, k, v, q_descale=q_descale)
        return tf.gradients(tf.reduce_sum(tf.cast(out, tf.float32)), q_descale)

    with pytest.raises(LookupError, match="FP8 \\(float8_e4m3fn\\) attention has no gradient"):
        fn.get_concrete_function(tf.TensorSpec([], tf.float32))


def test_fp8_shape_inference(rng):
    (q, k, v), _ = _small(rng, heads=4, heads_kv=2)

    @tf.function
    def fn(q, k, v):
        out, lse = tf_flash.flash_attention(q, k, v, output_dtype=tf.float16, return_lse=True)
        assert out.shape.as_list() == [2, 8, 4, 64] and out.dtype == tf.float16
        assert lse.shape.as_list() == [2, 4, 8] and lse.dtype == tf.float32
        return out

    fn.get_concrete_function(q, k, v)
