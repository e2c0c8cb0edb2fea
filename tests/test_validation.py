"""Bad input gives a clear error that names the argument and the value received, in eager and tf.function,
in `tf_flash.flash_attention` and in the layers alike; inputs that are valid but only known at run time
(unknown ranks and sizes) are accepted and checked when they run."""
import re

import numpy as np
import pytest
import tensorflow as tf

import tf_flash
from device_util import normal
from tf_flash.layers import FlashAttention, FlashMultiHeadAttention

B, S, H, D = 2, 5, 4, 8
ERRORS = (ValueError, TypeError, tf.errors.InvalidArgumentError)
MODES = ["eager", "tf.function"]


def _call(fn, mode):
    return tf.function(fn)() if mode == "tf.function" else fn()


# (id, inputs (q, k, v shapes) or None for the default, kwargs, regex the message must match).
FUNCTION_CASES = [
    ("q_lengths_past_int32", None, dict(q_lengths=[2**32 + 2, 3]),
     r"`q_lengths\[0\]`.*Received: q_lengths\[0\]=4294967298"),
    ("q_lengths_int64_array", None, dict(q_lengths=np.array([3, 2**32 + 2], np.int64)),
     r"`q_lengths\[1\]`.*Received: q_lengths\[1\]=4294967298"),
    ("kv_lengths_empty", None, dict(kv_lengths=np.zeros([0], np.int32)),
     r"`kv_lengths` must have shape \[batch\] = \[2\]. Received: kv_lengths.shape=\(0,\)"),
    ("kv_lengths_empty_list", None, dict(kv_lengths=[]), r"`kv_lengths`.*Received: kv_lengths"),
    ("q_lengths_too_long", None, dict(q_lengths=[S + 1, 1]), r"`q_lengths\[0\]`.*Received: q_lengths\[0\]=6"),
    ("kv_lengths_negative", None, dict(kv_lengths=[2, -1]), r"`kv_lengths\[1\]`.*Received: kv_lengths\[1\]=-1"),
    ("q_lengths_float", None, dict(q_lengths=[1.5, 2.0]), r"`q_lengths` must be an integer.*float32"),
    ("q_lengths_rank2", None, dict(q_lengths=[[1, 2]]), r"`q_lengths`.*Received: q_lengths.shape=\(1, 2\)"),
    ("attention_mask_zero_batch", None, dict(attention_mask=np.zeros([0, H, S, S], bool)),
     r"`attention_mask`.*Received: attention_mask.shape=\(0, 4, 5, 5\)"),
    ("attention_mask_zero_rows", None, dict(attention_mask=np.zeros([0, S], bool)),
     r"`attention_mask`.*Received: attention_mask.shape=\(0, 5\)"),
    ("attention_mask_batch", None, dict(attention_mask=np.ones([3, H, S, S], bool)),
     r"`attention_mask`.*Received: attention_mask.shape=\(3, 4, 5, 5\)"),
    ("attention_mask_string", None, dict(attention_mask=np.array([["a"]])),
     r"`attention_mask` must be a bool.*string"),
    ("attention_mask_int", None, dict(attention_mask=np.ones([S, S], np.int32)),
     r"`attention_mask` must be a bool.*int32"),
    ("attention_mask_rank5", None, dict(attention_mask=np.ones([1, 1, 1, S, S], bool)),
     r"`attention_mask`.*rank 2 to 4.*Received: attention_mask.shape=\(1, 1, 1, 5, 5\)"),
    ("block_mask_zero", None, dict(block_mask=np.zeros([0, 1], bool)),
     r"`block_mask`.*Received: block_mask.shape=\(0, 1\)"),
    ("block_mask_blocks", None, dict(block_mask=np.ones([2, 2], bool), block_size=2),
     r"`block_mask` must be broadcastable to \[2, 4, 3, 3\].*Received: block_mask.shape=\(2, 2\)"),
    ("causal_string", None, dict(causal="no"),
     r"`causal` must be a bool, \"top_left\" or \"bottom_right\". Received: causal='no'"),
    ("causal_int", None, dict(causal=1), r"`causal` must be a bool. Received: causal=1"),
    ("return_lse_string", None, dict(return_lse="no"), r"`return_lse` must be a bool. Received: return_lse='no'"),
    ("seed_2_63", None, dict(seed=2**63, dropout_rate=0.1), r"`seed`.*Received: seed=9223372036854775808"),
    ("seed_bool", None, dict(seed=True, dropout_rate=0.1), r"`seed`.*Received: seed=True"),
    ("seed_float", None, dict(seed=1.5, dropout_rate=0.1), r"`seed`.*Received: seed=1.5"),
    ("seed_shape", None, dict(seed=[1, 2, 3], dropout_rate=0.1), r"`seed`.*shape \(3,\)"),
    ("head_dim_0", ((B, S, H, 0),) * 3, {}, r"head dim of `query`.*Received: query.shape=\(2, 5, 4, 0\)"),
    ("head_dim_300", ((B, S, H, 300),) * 3, {}, r"head dim of `query`.*Received: query.shape=\(2, 5, 4, 300\)"),
    ("value_head_dim_0", ((B, S, H, D), (B, S, H, D), (B, S, H, 0)), {},
     r"head dim of `value`.*Received: value.shape=\(2, 5, 4, 0\)"),
    ("block_size_2_63", None, dict(block_size=2**63), r"`block_size`.*Received: block_size=9223372036854775808"),
    ("block_size_pair_0", None, dict(block_size=(16, 0)), r"`block_size`.*Received: block_size=\(16, 0\)"),
    ("window_2_63", None, dict(window=2**63), r"`window`.*Received: window=9223372036854775808"),
    ("window_pair_2_63", None, dict(window=(1, 2**63)), r"`window`.*Received: window=\(1, 9223372036854775808\)"),
    ("window_negative", None, dict(window=(-2, 3)), r"`window`.*Received: window=\(-2, 3\)"),
    ("window_float", None, dict(window=1.5), r"`window`.*Received: window=1.5"),
    ("batch", ((B, S, H, D), (3, S, H, D), (3, S, H, D)), {},
     r"same batch size. Received: query.shape=\(2, 5, 4, 8\), key.shape=\(3, 5, 4, 8\)"),
    ("head_dim_mismatch", ((B, S, H, D), (B, S, H, 16), (B, S, H, 16)), {},
     r"`query` and `key` must have the same head dim. Received: query.shape=\(2, 5, 4, 8\), key.shape=\(2, 5, 4, 16\)"),
    ("kv_seq_mismatch", ((B, S, H, D), (B, S, H, D), (B, S + 1, H, D)), {},
     r"`key` and `value`.*Received: .*value.shape=\(2, 6, 4, 8\)"),
    ("heads", ((B, S, H, D), (B, S, 3, D), (B, S, 3, D)), {}, r"heads.*Received: query heads=4, key heads=3"),
    ("rank", ((S, H, D), (B, S, H, D), (B, S, H, D)), {}, r"`query` must have rank 4.*Received: query.shape=\(5, 4, 8\)"),
    ("scale_nan", None, dict(scale=float("nan")), r"`scale`.*Received: scale=nan"),
    ("scale_past_float32", None, dict(scale=1e39), r"`scale`.*Received: scale=1e\+39"),
    ("scale_bool", None, dict(scale=True), r"`scale`.*Received: scale=True"),
    ("scale_negative", None, dict(scale=-0.5), r"`scale` must be a finite float >= 0.*Received: scale=-0.5"),
    ("scale_inf", None, dict(scale=float("inf")), r"`scale` must be a finite float >= 0.*Received: scale=inf"),
    ("dropout_one", None, dict(dropout_rate=1.0), r"`dropout_rate`.*Received: dropout_rate=1.0"),
    ("dropout_rounds_to_one", None, dict(dropout_rate=1 - 1e-10), r"`dropout_rate`.*Received: dropout_rate=0.99"),
    ("dropout_bool", None, dict(dropout_rate=True), r"`dropout_rate`.*Received: dropout_rate=True"),
    ("query_int", ((B, S, H, D),) * 3, dict(_dtype=tf.int32), r"`query` must be float32.*Received: query.dtype=int32"),
    ("query_unconvertible", None, dict(_query=object()), r"`query` must be a tensor.*Received: query=<object"),
]


def _inputs(shapes, kwargs):
    kwargs = dict(kwargs)
    dtype = kwargs.pop("_dtype", tf.float32)
    shapes = shapes or ((B, S, H, D),) * 3
    q, k, v = (tf.zeros(shape, dtype) for shape in shapes)
    if "_query" in kwargs:
        q = kwargs.pop("_query")
    return q, k, v, kwargs


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", FUNCTION_CASES, ids=[c[0] for c in FUNCTION_CASES])
def test_function_names_the_argument_and_the_value(case, mode):
    _, shapes, kwargs, pattern = case
    q, k, v, kwargs = _inputs(shapes, kwargs)
    with pytest.raises(ERRORS, match=pattern):
        _call(lambda: tf_flash.flash_attention(q, k, v, **kwargs), mode)


# Arguments only known when the function runs (input_signature with unknown sizes): the error then
# comes at run time, still naming the argument.
RUNTIME_CASES = [
    ("q_lengths_past_int32", dict(q_lengths=(tf.TensorSpec([None], tf.int64), np.array([2**32 + 2, 3], np.int64))),
     r"q_lengths"),
    ("kv_lengths_empty", dict(kv_lengths=(tf.TensorSpec([None], tf.int32), np.zeros([0], np.int32))), r"kv_lengths"),
    ("kv_lengths_too_long_cpu_kernel", dict(kv_lengths=(tf.TensorSpec([None], tf.int32), np.array([9, 1], np.int32))),
     r"kv_lengths\[0\].*Received: kv_lengths\[0\]=9"),
    ("attention_mask_zero_batch",
     dict(attention_mask=(tf.TensorSpec([None] * 4, tf.bool), np.zeros([0, H, S, S], bool))), r"attention_mask"),
    ("attention_mask_unknown_rank_zero_rows",
     dict(attention_mask=(tf.TensorSpec(None, tf.bool), np.zeros([0, S], bool))), r"attention_mask"),
    ("attention_mask_unknown_rank_5", dict(attention_mask=(tf.TensorSpec(None, tf.bool), np.ones([1] * 3 + [S, S], bool))),
     r"attention_mask.*rank 2 to 4"),
    ("block_mask_shape", dict(block_mask=(tf.TensorSpec([None, None], tf.bool), np.ones([2, 2], bool))),
     r"block_mask"),
    ("seed_size_3", dict(seed=(tf.TensorSpec([None], tf.int64), np.array([1, 2, 3], np.int64)), dropout_rate=0.1),
     r"seed.*shape \[2\]"),
]


@pytest.mark.parametrize("case", RUNTIME_CASES, ids=[c[0] for c in RUNTIME_CASES])
def test_function_checks_at_run_time_what_the_trace_cannot_see(case):
    _, kwargs, pattern = case
    kwargs = dict(kwargs)
    (name, (spec, value)), = [(n, a) for n, a in kwargs.items() if isinstance(a, tuple)]
    del kwargs[name]
    q = tf.zeros([B, S, H, D])
    fn = tf.function(lambda arg: tf_flash.flash_attention(q, q, q, **{name: arg}, **kwargs), input_signature=[spec])
    with pytest.raises(tf.errors.InvalidArgumentError, match=pattern):
        fn(value)


def test_unknown_shapes_that_are_valid_run_and_match(rng):
    """A mask of unknown rank, a seed of shape [None] and inputs of unknown sizes are accepted."""
    q = normal(rng, [B, S, H, D])
    mask = rng.random([S, S]) < 0.7
    mask[:, 0] = True
    seed = np.array([7, 1], np.int64)
    expected = tf_flash.flash_attention(q, q, q, attention_mask=mask, dropout_rate=0.2, seed=seed,
                                        q_lengths=[5, 3])
    fn = tf.function(
        lambda q, mask, seed, lengths: tf_flash.flash_attention(q, q, q, attention_mask=mask, dropout_rate=0.2,
                                                                seed=seed, q_lengths=lengths, scale=D ** -0.5),
        input_signature=[tf.TensorSpec([None, None, None, None]), tf.TensorSpec(None, tf.bool),
                         tf.TensorSpec([None], tf.int64), tf.TensorSpec([None], tf.int64)])
    np.testing.assert_array_equal(fn(q, mask, seed, np.array([5, 3])).numpy(), expected.numpy())


def test_empty_batch_with_empty_lengths_and_mask_is_valid():
    q = tf.zeros([0, S, H, D])
    out = tf_flash.flash_attention(q, q, q, q_lengths=np.zeros([0], np.int32), attention_mask=np.zeros([0, H, S, S], bool))
    assert out.shape == (0, S, H, D)


# ---- the layers: the same checks, and Keras masks reported under their own names ----

def _flash_attention_layer(**call_kwargs):
    layer = FlashAttention()
    q = tf.zeros([B, S, H, D])
    return lambda: layer(q, q, **call_kwargs)


def _mha_layer(**call_kwargs):
    layer = FlashMultiHeadAttention(num_heads=2, key_dim=4)
    q = tf.zeros([B, S, 6])
    v = tf.zeros([B, S + 1, 6])
    layer(q, v)  # built outside the tf.function
    return lambda: layer(q, v, **call_kwargs)


LAYER_CASES = [
    ("fa_q_lengths_negative", _flash_attention_layer, dict(q_lengths=[-1, 2]),
     r"`q_lengths\[0\]`.*Received: q_lengths\[0\]=-1"),
    ("fa_kv_lengths_too_long", _flash_attention_layer, dict(kv_lengths=[2, S + 1]),
     r"`kv_lengths\[1\]`.*Received: kv_lengths\[1\]=6"),
    ("fa_q_lengths_float", _flash_attention_layer, dict(q_lengths=[1.0, 2.0]), r"`q_lengths` must be an integer"),
    ("fa_q_lengths_past_int32", _flash_attention_layer, dict(q_lengths=[2**32 + 2, 3]),
     r"`q_lengths\[0\]`.*Received: q_lengths\[0\]=4294967298"),
    ("fa_kv_lengths_batch", _flash_attention_layer, dict(kv_lengths=[1, 2, 3]),
     r"`kv_lengths` must have shape \[batch\].*Received: kv_lengths.shape=\(3,\)"),
    ("fa_value_mask_shape", _flash_attention_layer, dict(value_mask=np.ones([B, S + 1], bool)),
     r"`value_mask` must have shape \[batch, seq\].*Received: value_mask.shape=\(2, 6\)"),
    ("fa_query_mask_string", _flash_attention_layer, dict(query_mask=np.array([["a"] * S] * B)),
     r"`query_mask` must be a bool.*string"),
    ("fa_attention_mask_string", _flash_attention_layer, dict(attention_mask=np.array([["a"] * S] * S)),
     r"`attention_mask` must be a bool.*string"),
    ("fa_attention_mask_shape", _flash_attention_layer, dict(attention_mask=np.ones([B, S, S + 1], bool)),
     r"`attention_mask` must be broadcastable to \[2, 5, 5\] \(\[batch, seq_q, seq_k\].*Received: attention_mask.shape=\(2, 5, 6\)"),
    ("fa_use_causal_mask_string", _flash_attention_layer, dict(use_causal_mask="no"),
     r"`use_causal_mask` must be a bool or None. Received: use_causal_mask='no'"),
    ("mha_query_mask_shape", _mha_layer, dict(query_mask=np.ones([B, S + 1], bool)),
     r"`query_mask` must have shape \[batch, seq\].*Received: query_mask.shape=\(2, 6\)"),
    ("mha_value_mask_batch", _mha_layer, dict(value_mask=np.ones([3, S + 1], bool)),
     r"`value_mask` must have shape \[batch, seq\].*Received: value_mask.shape=\(3, 6\)"),
    ("mha_key_mask_rank", _mha_layer, dict(key_mask=np.ones([S + 1], bool)),
     r"`key_mask` must have shape \[batch, seq\].*Received: key_mask.shape=\(6,\)"),
    ("mha_value_mask_string", _mha_layer, dict(value_mask=np.array([["a"] * (S + 1)] * B)),
     r"`value_mask` must be a bool.*string"),
    ("mha_attention_mask_shape", _mha_layer, dict(attention_mask=np.ones([B, S, S], bool)),
     r"`attention_mask` must be broadcastable to \[2, 5, 6\] \(\[batch, seq_q, seq_k\].*Received: attention_mask.shape=\(2, 5, 5\)"),
    ("mha_attention_mask_heads", _mha_layer, dict(attention_mask=np.ones([B, 3, S, S + 1], bool)),
     r"`attention_mask` must be broadcastable to \[2, 2, 5, 6\] \(\[batch, heads, seq_q, seq_k\].*Received: attention_mask.shape=\(2, 3, 5, 6\)"),
    ("mha_use_causal_mask_string", _mha_layer, dict(use_causal_mask="no"),
     r"`use_causal_mask` must be a bool or None. Received: use_causal_mask='no'"),
    ("mha_return_attention_scores_string", _mha_layer, dict(return_attention_scores="no"),
     r"`return_attention_scores` must be a bool or None. Received: return_attention_scores='no'"),
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", LAYER_CASES, ids=[c[0] for c in LAYER_CASES])
def test_layers_name_the_argument_and_the_value(case, mode):
    _, make, kwargs, pattern = case
    with pytest.raises(ERRORS, match=pattern):
        _call(make(**kwargs), mode)


def test_layer_lengths_checked_at_run_time():
    layer = FlashAttention()
    q = tf.zeros([B, S, H, D])
    fn = tf.function(lambda lengths: layer(q, q, q_lengths=lengths), input_signature=[tf.TensorSpec([None], tf.int32)])
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"q_lengths"):
        fn(tf.constant([-1, 2]))
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"q_lengths"):
        fn(tf.constant([S + 1, 2]))
    assert fn(tf.constant([S, 2])).shape == (B, S, H, D)


def test_keras_padding_mask_errors_name_the_mask():
    """A Keras mask (as from Embedding(mask_zero=True)) of the wrong shape is reported as the mask the
    user handed over (here value_mask), never as kv_lengths or attention_mask."""
    layer = FlashAttention()
    q = tf.zeros([B, S, H, D])
    with pytest.raises(ValueError) as info:
        layer(q, q, value_mask=tf.ones([B, S - 1], tf.bool))
    # Keras adds the call's arguments below the message; the message is the line that says "must".
    message = next(line for line in str(info.value).splitlines() if "must" in line)
    assert "kv_lengths" not in message and "attention_mask" not in message
    assert re.search(r"`value_mask` must .*Received: value_mask.shape=\(2, 4\)", message)


@pytest.mark.parametrize("kwargs", [dict(window=2**63), dict(block_size=2**63), dict(causal="no"),
                                    dict(dropout=True), dict(seed=1.5)], ids=lambda k: next(iter(k)))
def test_layer_constructors_name_the_argument(kwargs):
    name, value = next(iter(kwargs.items()))
    with pytest.raises(ValueError, match=rf"`{name}`.*Received: {name}={re.escape(repr(value))}"):
        FlashAttention(**kwargs)


@pytest.mark.parametrize("kwargs", [dict(sliding_window=2**63), dict(window=(2**31, 0)), dict(block_size=(1, 0)),
                                    dict(use_gate="no")], ids=lambda k: next(iter(k)))
def test_multi_head_constructor_names_the_argument(kwargs):
    name, value = next(iter(kwargs.items()))
    with pytest.raises(ValueError, match=rf"`{name}`.*Received: {name}={re.escape(repr(value))}"):
        FlashMultiHeadAttention(num_heads=2, key_dim=4, **kwargs)


# ---- the raw ops (what a SavedModel calls without the Python checks) ----
# The kernels' own validation (cc/kernels/flash_attention_params.cc), which a SavedModel reaches directly.

def _raw_forward_inputs(**overrides):
    q = tf.zeros([B, S, H, D])
    inputs = dict(query=q, key=q, value=q, q_lengths=np.zeros([0], np.int32), kv_lengths=np.zeros([0], np.int32),
                  attention_mask=np.zeros([0, 0, 0, 0], bool), block_mask=np.zeros([0, 0, 0, 0], bool),
                  q_segment_ids=np.zeros([0, 0], np.int32), kv_segment_ids=np.zeros([0, 0], np.int32),
                  seed=np.array([1, 2], np.int64), scale=0.25)
    inputs.update(overrides)
    return inputs


def test_raw_op_refuses_a_zero_batch_mask_when_the_batch_is_not_empty():
    from tf_flash._ops import ops as raw_ops  # pylint: disable=import-outside-toplevel
    with pytest.raises(tf.errors.InvalidArgumentError, match="attention_mask"):
        raw_ops.tf_flash_flash_attention(**_raw_forward_inputs(attention_mask=np.zeros([0, H, S, S], bool)))


def test_raw_gradient_op_names_rng_state():
    from tf_flash._ops import ops as raw_ops  # pylint: disable=import-outside-toplevel
    inputs = _raw_forward_inputs()
    out, lse, _ = raw_ops.tf_flash_flash_attention(**inputs)
    del inputs["seed"]
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"rng_state"):
        raw_ops.tf_flash_flash_attention_grad(d_output=out, output=out, lse=lse, d_lse=lse,
                                              rng_state=np.array([1, 2, 3], np.int64), **inputs)


# One rule for the score scale on every device and in every front door: finite and >= 0 (0 is allowed: it
# gives the mean of the visible values). The Python API and the layers refuse it with one message; the op
# itself (cc/kernels/flash_attention_params.cc, what a SavedModel or XLA reaches, before any device's
# kernel) with its own, on the CPU here and on the GPU through the same check.
@pytest.mark.parametrize("scale", [-0.5, float("inf"), float("-inf"), float("nan")])
def test_scale_must_be_finite_and_non_negative_everywhere(scale):
    q = tf.zeros([B, S, H, D])
    with pytest.raises(ValueError, match=r"`scale` must be a finite float >= 0"):
        tf_flash.flash_attention(q, q, q, scale=scale)
    with pytest.raises(ValueError, match=r"`scale` must be a finite float >= 0"):
        FlashAttention(scale=scale)
    from tf_flash._ops import ops as raw_ops  # pylint: disable=import-outside-toplevel
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"scale must be finite and >= 0. Received: scale="):
        raw_ops.tf_flash_flash_attention(**_raw_forward_inputs(scale=scale))


def test_scale_zero_is_accepted():
    q = tf.random.stateless_normal([B, S, H, D], seed=[1, 2])
    out = tf_flash.flash_attention(q, q, q, scale=0.0)
    # Every key weighs the same: the output is the mean of the values.
    np.testing.assert_allclose(out.numpy(), np.broadcast_to(q.numpy().mean(axis=1, keepdims=True), q.shape),
                               rtol=1e-5, atol=1e-5)
