"""Keras layers: FlashMultiHeadAttention against keras.layers.MultiHeadAttention (same weights -> same
outputs and gradients), masks, extras (GQA, window, block-sparse, dropout), FlashAttention, configs,
compile()/fit with Keras' defaults, mixed precision. Tiny shapes: the suite runs on 2 CPU cores."""
import numpy as np
import pytest
import tensorflow as tf
import keras

import saving_helper
import tf_flash
from device_util import DEVICES
from reference import reference_attention
from tf_flash import _masks
from tf_flash.layers import FlashAttention, FlashMultiHeadAttention

MODES = pytest.mark.parametrize("mode", ["eager", "function"])
B, T, S, DIM = 2, 5, 7, 6


def _tolerance(device):
    """assert_allclose bounds: Keras' float32 einsums (and the kernel's float32) may run in TF32 on a GPU."""
    return {"atol": 5e-3, "rtol": 5e-3} if "GPU" in device else {}


def _rand(*shape, seed=0):
    """Standard normal float32 values as a NumPy array (also while a tf.function traces), one generator each."""
    return np.random.default_rng(seed).standard_normal(shape).astype("float32")


def _set_mask(tensor, mask):
    from keras.src.backend import set_keras_mask
    set_keras_mask(tensor, None if mask is None else tf.constant(mask))
    return tensor


def _twins(mha_kwargs, flash_kwargs=None, keras_cls=None, q_shape=(B, T, DIM), v_shape=(B, S, DIM),
           k_shape=None):
    """A Keras layer and a FlashMultiHeadAttention built on the same shapes with the same weights."""
    keras_cls = keras_cls or keras.layers.MultiHeadAttention
    reference = keras_cls(**mha_kwargs)
    flash = FlashMultiHeadAttention(**(flash_kwargs if flash_kwargs is not None else mha_kwargs))
    for layer in (reference, flash):
        layer.build(q_shape, v_shape, k_shape)
    reference.set_weights([_rand(*w.shape, seed=i + 10) * 0.5 for i, w in enumerate(reference.weights)])
    flash.set_weights(reference.get_weights())
    return reference, flash


def _forward_backward(layer, query, value, key, call_kwargs, mode, query_mask=None):
    """Output, and gradients of sum(output * cotangent) w.r.t. the inputs and the weights."""

    def step(query, value, key):
        with tf.GradientTape() as tape:
            tape.watch([query, value, key])
            _set_mask(query, query_mask)
            result = layer(query, value, key=key, **call_kwargs)
            output = result[0] if isinstance(result, tuple) else result
            loss = tf.reduce_sum(tf.cast(output, "float32") * tf.constant(_rand(*output.shape, seed=99)))
        grads = tape.gradient(loss, [query, value, key] + layer.trainable_weights)
        return result, grads

    fn = tf.function(step) if mode == "function" else step
    return fn(tf.constant(query), tf.constant(value), tf.constant(key))


def _assert_close(actual, expected, atol=2e-5, rtol=2e-5):
    flat_a, flat_e = tf.nest.flatten(actual), tf.nest.flatten(expected)
    assert len(flat_a) == len(flat_e)
    for a, e in zip(flat_a, flat_e):
        a, e = (tf.convert_to_tensor(x) if isinstance(x, tf.IndexedSlices) else x for x in (a, e))
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(e, np.float32), atol=atol, rtol=rtol)


def _prefix(lengths, size):
    return np.arange(size)[None, :] < np.asarray(lengths)[:, None]


HOLES = np.array([[1, 0, 1, 1, 0, 1, 1], [0, 1, 1, 0, 1, 0, 0]], bool)
EMPTY_ROWS = np.ones([B, T, S], bool)
EMPTY_ROWS[0, 1] = False  # a query row that sees nothing
EMPTY_ROWS[1, ::2, 3:] = False

# name -> (layer kwargs, call kwargs, shapes (T, S), query keras mask)
PARITY_CASES = {
    "plain": ({}, {}, (T, S), None),
    "self": ({}, {}, (T, T), None),
    "causal": ({}, {"use_causal_mask": True}, (T, T), None),
    "causal_cross_long_q": ({}, {"use_causal_mask": True}, (7, 4), None),
    "causal_cross_long_k": ({}, {"use_causal_mask": True}, (4, 7), None),
    "value_dim": ({"value_dim": 3}, {}, (T, S), None),
    "output_shape_int": ({"output_shape": 4}, {}, (T, S), None),
    "output_shape_tuple": ({"output_shape": (3, 2)}, {}, (T, S), None),
    "no_bias": ({"use_bias": False}, {}, (T, S), None),
    "gate": ({"use_gate": True, "value_dim": 3}, {}, (T, S), None),
    "attention_mask": ({}, {"attention_mask": EMPTY_ROWS}, (T, S), None),
    "value_mask_prefix": ({}, {"value_mask": _prefix([3, 7], S)}, (T, S), None),
    "value_mask_holes": ({}, {"value_mask": HOLES}, (T, S), None),
    "value_mask_empty_row": ({}, {"value_mask": _prefix([0, 4], S)}, (T, S), None),
    "key_mask": ({}, {"key_mask": _prefix([2, 6], S), "value_mask": HOLES}, (T, S), None),
    "query_mask_prefix": ({}, {}, (T, S), _prefix([3, 5], T)),
    "query_mask_holes": ({}, {}, (T, S), HOLES[:, :T]),
    "sliding_window": ({"sliding_window": 2}, {}, (T, T), None),
    "sliding_window_cross": ({"sliding_window": 2}, {"use_causal_mask": True}, (8, 3), None),
    "everything": ({"value_dim": 3, "output_shape": 5},
                   {"use_causal_mask": True, "value_mask": HOLES[:, :T], "attention_mask": EMPTY_ROWS[:, :, :T]},
                   (T, T), _prefix([4, 2], T)),
    # Keras takes its explicit softmax path with dropout > 0 (zeros on empty rows): match it.
    "dropout_inference": ({"dropout": 0.3}, {"attention_mask": EMPTY_ROWS, "training": False}, (T, S),
                          _prefix([3, 5], T)),
}


# Graph mode (tf.function) for a representative subset; every case in eager mode.
GRAPH_CASES = {"plain", "causal", "value_mask_holes", "query_mask_holes", "everything", "dropout_inference"}
PARITY_PARAMS = [(case, "eager") for case in sorted(PARITY_CASES)] + [
    (case, "function") for case in sorted(GRAPH_CASES)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case, mode", PARITY_PARAMS)
def test_parity_with_keras_mha(case, mode, device):
    layer_kwargs, call_kwargs, (seq_q, seq_k), query_mask = PARITY_CASES[case]
    kwargs = dict(num_heads=2, key_dim=4, **layer_kwargs)
    keras_key = "key_mask" in call_kwargs
    shapes = dict(q_shape=(B, seq_q, DIM), v_shape=(B, seq_k, DIM), k_shape=(B, seq_k, 5) if keras_key else None)
    mha, flash = _twins(kwargs, **shapes)
    query, value = _rand(B, seq_q, DIM, seed=1), _rand(B, seq_k, DIM, seed=2)
    key = _rand(B, seq_k, 5, seed=3) if keras_key else value
    with tf.device(device):
        expected = _forward_backward(mha, query, value, key, call_kwargs, mode, query_mask)
        actual = _forward_backward(flash, query, value, key, call_kwargs, mode, query_mask)
    _assert_close(actual, expected, **_tolerance(device))


@MODES
@pytest.mark.parametrize("case", ["plain", "causal", "attention_mask", "value_mask_holes", "everything"])
def test_return_attention_scores_parity(case, mode):
    layer_kwargs, call_kwargs, (seq_q, seq_k), query_mask = PARITY_CASES[case]
    mha, flash = _twins(dict(num_heads=2, key_dim=4, **layer_kwargs), q_shape=(B, seq_q, DIM),
                        v_shape=(B, seq_k, DIM))
    query, value = _rand(B, seq_q, DIM, seed=1), _rand(B, seq_k, DIM, seed=2)
    call_kwargs = dict(call_kwargs, return_attention_scores=True)
    (out_e, scores_e), grads_e = _forward_backward(mha, query, value, value, call_kwargs, mode, query_mask)
    (out_a, scores_a), grads_a = _forward_backward(flash, query, value, value, call_kwargs, mode, query_mask)
    assert scores_a.shape == (B, 2, seq_q, seq_k)
    _assert_close((out_a, scores_a, grads_a), (out_e, scores_e, grads_e))


@pytest.mark.parametrize("kv_heads", [1, 2])
@pytest.mark.parametrize("causal", [False, True])
def test_grouped_query_attention_matches_keras(kv_heads, causal):
    gqa_kwargs = dict(head_dim=4, num_query_heads=4, num_key_value_heads=kv_heads)
    flash_kwargs = dict(num_heads=4, key_dim=4, num_key_value_heads=kv_heads)
    gqa, flash = _twins(gqa_kwargs, flash_kwargs, keras_cls=keras.layers.GroupQueryAttention,
                        q_shape=(B, T, DIM), v_shape=(B, T, DIM))
    assert [w.shape for w in flash.weights] == [w.shape for w in gqa.weights]
    assert flash.key_dense.kernel.shape == (DIM, kv_heads, 4)
    query, value = _rand(B, T, DIM, seed=1), _rand(B, T, DIM, seed=2)
    call_kwargs = {"use_causal_mask": causal, "value_mask": _prefix([3, 5], T)}
    expected = _forward_backward(gqa, query, value, value, call_kwargs, "eager")
    actual = _forward_backward(flash, query, value, value, call_kwargs, "eager")
    _assert_close(actual, expected)
    call_kwargs["return_attention_scores"] = True
    expected = _forward_backward(gqa, query, value, value, call_kwargs, "eager")
    actual = _forward_backward(flash, query, value, value, call_kwargs, "eager")
    _assert_close(actual, expected)


@pytest.mark.parametrize("window", [(1, 2), (0, None), (None, 1), 2])
def test_window_matches_banded_attention_mask(window):
    mha, flash = _twins(dict(num_heads=2, key_dim=4), dict(num_heads=2, key_dim=4, window=window),
                        q_shape=(B, T, DIM), v_shape=(B, S, DIM))
    left, right = (window, window) if isinstance(window, int) else window
    rows, cols = np.arange(T)[:, None], np.arange(S)[None, :]
    band = np.ones([T, S], bool)
    if left is not None:
        band &= cols >= rows - left
    if right is not None:
        band &= cols <= rows + right
    query, value = _rand(B, T, DIM, seed=1), _rand(B, S, DIM, seed=2)
    expected = _forward_backward(mha, query, value, value, {"attention_mask": band}, "eager")
    actual = _forward_backward(flash, query, value, value, {}, "eager")
    _assert_close(actual, expected)


@pytest.mark.parametrize("where", ["constructor", "call"])
def test_block_mask_matches_expanded_attention_mask(where):
    seq = 8
    block_mask = np.array([[True, False, False, True], [False, True, False, False],
                           [True, True, True, False], [False, False, True, True]])
    flash_kwargs = dict(num_heads=2, key_dim=4, block_size=2)
    call_kwargs = {}
    if where == "constructor":
        flash_kwargs["block_mask"] = block_mask
    else:
        call_kwargs["block_mask"] = tf.constant(block_mask)
    mha, flash = _twins(dict(num_heads=2, key_dim=4), flash_kwargs, q_shape=(B, seq, DIM),
                        v_shape=(B, seq, DIM))
    dense = np.repeat(np.repeat(block_mask, 2, axis=0), 2, axis=1)
    query, value = _rand(B, seq, DIM, seed=1), _rand(B, seq, DIM, seed=2)
    expected = _forward_backward(mha, query, value, value, {"attention_mask": dense}, "eager")
    actual = _forward_backward(flash, query, value, value, call_kwargs, "eager")
    _assert_close(actual, expected)


def test_weights_move_both_ways_between_models():
    # Model-level get_weights/set_weights (a `.weights.h5` file keys layers by class name, so a file
    # written by one class does not load into the other by path).
    def model(layer):
        query = keras.Input((T, DIM))
        value = keras.Input((S, DIM))
        return keras.Model([query, value], layer(query, value, use_causal_mask=True))

    mha_model = model(keras.layers.MultiHeadAttention(2, 4, value_dim=3, name="attention"))
    flash_model = model(FlashMultiHeadAttention(2, 4, value_dim=3, name="attention"))
    inputs = [_rand(B, T, DIM, seed=1), _rand(B, S, DIM, seed=2)]
    flash_model.set_weights(mha_model.get_weights())
    _assert_close(flash_model(inputs), mha_model(inputs))
    flash_model.set_weights([w * 0.5 for w in flash_model.get_weights()])
    mha_model.set_weights(flash_model.get_weights())
    _assert_close(mha_model(inputs), flash_model(inputs))
    for mha_layer, flash_layer in zip(mha_model.layers, flash_model.layers):
        assert [w.path.split("/", 1)[1] for w in mha_layer.weights] == [
            w.path.split("/", 1)[1] for w in flash_layer.weights]


def test_from_keras_copies_config_and_weights():
    mha = keras.layers.MultiHeadAttention(2, 4, value_dim=3, output_shape=5, use_gate=True, name="a")
    query, value, key = (tf.constant(_rand(B, n, d, seed=n)) for n, d in ((T, DIM), (S, 3), (S, 4)))
    expected = mha(query, value, key, use_causal_mask=True)
    flash = FlashMultiHeadAttention.from_keras(mha, name="b")
    assert flash.name == "b" and flash.get_config()["value_dim"] == 3
    _assert_close(flash(query, value, key, use_causal_mask=True), expected)
    assert not FlashMultiHeadAttention.from_keras(keras.layers.MultiHeadAttention(2, 4)).built


def _embedding_model(attention_cls, causal, **kwargs):
    tokens = keras.Input((None,), dtype="int32")
    x = keras.layers.Embedding(11, DIM, mask_zero=True, name="embed")(tokens)
    x = attention_cls(num_heads=2, key_dim=4, name="attention", **kwargs)(x, x, use_causal_mask=causal)
    pooled = keras.layers.GlobalAveragePooling1D(name="pool")(x)  # honours the propagated mask
    return keras.Model(tokens, [x, pooled])


@MODES
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("padding", ["end", "holes"])
def test_keras_masking_from_embedding(causal, padding, mode):
    tokens = np.array([[3, 4, 5, 0, 0, 0], [1, 2, 3, 4, 5, 6]], "int32")
    if padding == "holes":
        tokens[1, [1, 4]] = 0
    mha_model = _embedding_model(keras.layers.MultiHeadAttention, causal)
    flash_model = _embedding_model(FlashMultiHeadAttention, causal)
    flash_model.set_weights(mha_model.get_weights())

    def run(model):
        def step(tokens):
            with tf.GradientTape() as tape:
                x, pooled = model(tokens)
                loss = tf.reduce_sum(pooled * tf.constant(_rand(*pooled.shape, seed=5)))
            return x, pooled, tape.gradient(loss, model.trainable_weights)
        return (tf.function(step) if mode == "function" else step)(tf.constant(tokens))

    _assert_close(run(flash_model), run(mha_model))
    x, _, _ = run(flash_model)
    if mode == "eager":
        from keras.src.backend import get_keras_mask
        np.testing.assert_array_equal(get_keras_mask(x), tokens != 0)


def test_prefix_lengths_detects_prefix_masks_in_graph():
    @tf.function(input_signature=[tf.TensorSpec([None, None], tf.bool)])
    def lengths(mask):
        return _masks.prefix_lengths(mask)

    prefix = _prefix([2, 0, 5], 5)
    lens, is_prefix = lengths(prefix)
    assert bool(is_prefix) and lens.numpy().tolist() == [2, 0, 5]
    holes = prefix.copy()
    holes[2, 1] = False
    lens, is_prefix = lengths(holes)
    assert not bool(is_prefix) and lens.numpy().tolist() == [5, 5, 5]


@pytest.mark.parametrize("padding", ["end", "holes"])
def test_prefix_masks_reach_the_op_as_lengths(padding, monkeypatch):
    """Padding at the end -> q_lengths/kv_lengths and no element mask (the kernel skips the padding);
    any other pattern -> the general attention_mask path."""
    calls = []
    real = tf_flash.ops.flash_attention

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(tf_flash.ops, "flash_attention", spy)
    tokens = np.array([[3, 4, 5, 0, 0, 0], [1, 2, 3, 4, 5, 6]], "int32")
    if padding == "holes":
        tokens[1, 2] = 0
    _embedding_model(FlashMultiHeadAttention, causal=False)(tokens)
    (kwargs,) = calls
    mask = kwargs["attention_mask"]
    if padding == "end":
        assert kwargs["q_lengths"].numpy().tolist() == [3, 6]
        assert kwargs["kv_lengths"].numpy().tolist() == [3, 6]
        assert mask.shape.num_elements() == 0
    else:
        assert kwargs["kv_lengths"].numpy().tolist() == [6, 6]
        np.testing.assert_array_equal(np.asarray(mask).reshape(2, 6), tokens != 0)


def test_dropout_only_in_training_and_fresh_each_step():
    query = tf.constant(_rand(B, T, DIM, seed=1))
    plain = FlashMultiHeadAttention(2, 4)
    dropped = FlashMultiHeadAttention(2, 4, dropout=0.5, seed=3)
    plain(query, query)
    dropped(query, query)
    dropped.set_weights(plain.get_weights())
    # Inference: no dropout at all.
    _assert_close(dropped(query, query), plain(query, query))
    _assert_close(dropped(query, query, training=False), plain(query, query))
    first = dropped(query, query, training=True)
    second = dropped(query, query, training=True)
    assert np.abs(first - plain(query, query)).max() > 1e-3
    assert np.abs(first - second).max() > 1e-3, "each training call must draw a new mask"
    fn = tf.function(lambda q: dropped(q, q, training=True))
    assert np.abs(fn(query) - fn(query)).max() > 1e-3, "a traced step must draw a new mask each run"


def test_dropout_reproducible_under_set_random_seed():
    query = tf.constant(_rand(B, T, DIM, seed=1))

    def draw():
        keras.utils.set_random_seed(123)
        layer = FlashMultiHeadAttention(2, 4, dropout=0.4)
        return [layer(query, query, training=True) for _ in range(2)]

    first, second = draw(), draw()
    _assert_close(first, second, atol=0, rtol=0)


def test_dropout_gradients_match_numeric():
    layer = FlashAttention(dropout=0.3, seed=7)
    q, k, v = (tf.constant(_rand(1, 3, 2, 4, seed=s).astype("float64")) for s in (1, 2, 3))
    seed = layer.seed_generator.state.numpy().copy()

    def f(q, k, v):
        layer.seed_generator.state.assign(seed)  # the same mask on every evaluation
        return layer(tf.cast(q, "float32"), tf.cast(v, "float32"), tf.cast(k, "float32"), training=True)

    with tf.GradientTape() as tape:
        tape.watch([q, k, v])
        out = tf.reduce_sum(tf.cast(f(q, k, v), "float64") * _rand(1, 3, 2, 4, seed=4))
    grads = tape.gradient(out, [q, k, v])
    eps = 1e-3
    for index, (x, g) in enumerate(zip((q, k, v), grads)):
        flat = x.numpy().ravel()
        for i in (0, 5, 17):
            plus, minus = flat.copy(), flat.copy()
            plus[i] += eps
            minus[i] -= eps
            args = [q, k, v]
            vals = []
            for pert in (plus, minus):
                args[index] = tf.constant(pert.reshape(x.shape))
                vals.append(float(tf.reduce_sum(tf.cast(f(*args), "float64") * _rand(1, 3, 2, 4, seed=4))))
            numeric = (vals[0] - vals[1]) / (2 * eps)
            np.testing.assert_allclose(g.numpy().ravel()[i], numeric, atol=2e-3, rtol=2e-3)


# ---------------------------------------------------------------- FlashAttention (projected heads)

@pytest.mark.parametrize("device", DEVICES)
@MODES
@pytest.mark.parametrize("case", ["plain", "causal", "window", "gqa", "kv_prefix", "kv_holes",
                                  "query_holes", "attention_mask", "lengths", "block"])
def test_flash_attention_layer_matches_reference(case, mode, device):
    heads, heads_kv, seq_q, seq_k = 2, 2, 5, 7
    layer_kwargs, call_kwargs, ref_kwargs = {}, {}, {}
    query_rows = None
    if case == "causal":
        layer_kwargs["causal"] = True
        ref_kwargs["causal"] = True
    elif case == "window":
        layer_kwargs["window"] = (1, 0)
        ref_kwargs["window"] = (1, 0)
    elif case == "gqa":
        heads, heads_kv = 4, 2
    elif case in ("kv_prefix", "kv_holes"):
        mask = _prefix([3, 7], seq_k) if case == "kv_prefix" else HOLES
        call_kwargs["value_mask"] = mask
        ref_kwargs["attention_mask"] = mask[:, None, None, :]
    elif case == "query_holes":
        call_kwargs["query_mask"] = HOLES[:, :seq_q]
        query_rows = HOLES[:, :seq_q]
    elif case == "attention_mask":
        call_kwargs["attention_mask"] = EMPTY_ROWS
        ref_kwargs["attention_mask"] = EMPTY_ROWS[:, None]
    elif case == "lengths":
        call_kwargs.update(q_lengths=[3, 5], kv_lengths=[7, 2])
        ref_kwargs.update(q_lengths=np.array([3, 5]), kv_lengths=np.array([7, 2]))
    elif case == "block":
        block = np.array([[True, False, True, False], [False, True, True, True], [True, False, False, True]])
        layer_kwargs.update(block_mask=block, block_size=2)
        ref_kwargs.update(block_mask=block, block_size=2)
    q = _rand(B, seq_q, heads, 4, seed=1)
    k = _rand(B, seq_k, heads_kv, 4, seed=2)
    v = _rand(B, seq_k, heads_kv, 3, seed=3)
    layer = FlashAttention(**layer_kwargs)
    call = lambda q, k, v: layer(q, v, k, **call_kwargs)  # noqa: E731
    with tf.device(device):
        out = (tf.function(call) if mode == "function" else call)(tf.constant(q), tf.constant(k), tf.constant(v))
    expected, _ = reference_attention(q, k, v, **ref_kwargs)
    if query_rows is not None:
        expected = np.where(query_rows[:, :, None, None], expected, 0.0)
    assert out.shape == (B, seq_q, heads, 3)
    _assert_close(out, expected, **({"atol": 1e-5} | _tolerance(device)))


class _SplitHeads(keras.layers.Layer):
    """[B, S, H*D] -> [B, S, H, D], keeping the Keras padding mask (Reshape drops it)."""

    def __init__(self, heads, **kwargs):
        super().__init__(**kwargs)
        self.heads = heads
        self.supports_masking = True

    def call(self, x):
        return tf.reshape(x, tf.concat([tf.shape(x)[:2], [self.heads, x.shape[-1] // self.heads]], 0))

    def compute_output_shape(self, shape):
        return tuple(shape[:2]) + (self.heads, shape[-1] // self.heads)


def test_flash_attention_layer_gets_keras_masks_in_a_model():
    tokens = keras.Input((None,), dtype="int32")
    x = keras.layers.Embedding(9, 8, mask_zero=True, name="embed")(tokens)
    heads = _SplitHeads(2)(x)
    attended = FlashAttention(causal=True, name="flash")(heads, heads)
    merged = keras.layers.Reshape((-1, 8))(attended)
    model = keras.Model(tokens, [attended, keras.layers.Dense(1)(keras.layers.GlobalAveragePooling1D()(merged))])
    data = np.array([[1, 2, 3, 0], [4, 5, 6, 7]], "int32")
    got, _ = model(data)
    embedded = model.get_layer("embed")(data).numpy().reshape(2, 4, 2, 4)
    expected, _ = reference_attention(embedded, embedded, embedded, causal=True, q_lengths=np.array([3, 4]),
                                      kv_lengths=np.array([3, 4]))
    _assert_close(got, expected, atol=1e-5)

    model = keras.Model(tokens, model.outputs[1])
    model.compile(optimizer="sgd", loss="mse")
    history = model.fit(data, np.ones([2, 1], "float32"), epochs=1, verbose=0)
    assert np.all(np.isfinite(history.history["loss"]))
    assert model.get_layer("flash").compute_output_shape((2, 4, 2, 4), (2, 6, 2, 3)) == (2, 4, 2, 3)


# ---------------------------------------------------------------- configs and argument checks

def test_signatures_extend_keras_mha():
    import inspect
    for method in ("__init__", "call"):
        ours = list(inspect.signature(getattr(FlashMultiHeadAttention, method)).parameters)
        theirs = list(inspect.signature(getattr(keras.layers.MultiHeadAttention, method)).parameters)
        theirs = [name for name in theirs if name != "kwargs"]
        assert ours[:len(theirs)] == theirs, method


def test_config_round_trip():
    layer = FlashMultiHeadAttention(
        3, 4, value_dim=5, dropout=0.1, use_bias=False, output_shape=(2, 3), sliding_window=4,
        kernel_initializer="he_normal", kernel_regularizer="l2", bias_constraint="non_neg", use_gate=True,
        seed=4, num_key_value_heads=1, block_mask=np.eye(2, dtype=bool), block_size=(4, 8), name="fmha")
    config = layer.get_config()
    clone = FlashMultiHeadAttention.from_config(config)
    assert clone.get_config() == config
    serialized = keras.saving.serialize_keras_object(layer)
    assert serialized["registered_name"] == "tf_flash>FlashMultiHeadAttention"
    assert keras.saving.deserialize_keras_object(serialized).get_config() == config

    attention = FlashAttention(causal=True, window=(3, None), dropout=0.2, scale=0.5,
                               block_mask=[[True, False]], block_size=16, seed=1, name="fa")
    config = attention.get_config()
    assert FlashAttention.from_config(config).get_config() == config
    assert keras.saving.serialize_keras_object(attention)["registered_name"] == "tf_flash>FlashAttention"


def test_built_keras_mha_config_loads_into_flash():
    mha = keras.layers.MultiHeadAttention(2, 4, output_shape=3, sliding_window=3)
    mha(tf.zeros([1, 4, DIM]), tf.zeros([1, 4, DIM]))  # Keras rewrites attention_axes at build
    flash = FlashMultiHeadAttention.from_config(mha.get_config())
    assert flash.get_config()["attention_axes"] == mha.get_config()["attention_axes"]


@pytest.mark.parametrize("kwargs, fragment", [
    ({"num_heads": 0}, "num_heads=0"),
    ({"key_dim": 2.5}, "key_dim=2.5"),
    ({"value_dim": -1}, "value_dim=-1"),
    ({"dropout": 1.0}, "dropout=1.0"),
    ({"attention_axes": (1, 2)}, "attention_axes=(1, 2)"),
    ({"attention_axes": 2}, "attention_axes="),
    ({"sliding_window": 0}, "sliding_window=0"),
    ({"sliding_window": 2, "window": 3}, "sliding_window=2"),
    ({"window": (-1, 2)}, "window=(-1, 2)"),
    ({"num_key_value_heads": 3}, "num_key_value_heads=3"),
    ({"output_shape": "x"}, "output_shape='x'"),
    ({"block_size": 0}, "block_size=0"),
    ({"block_mask": np.ones([2], bool)}, "block_mask"),
    ({"seed": "1"}, "seed='1'"),
])
def test_mha_rejects_bad_arguments(kwargs, fragment):
    full = dict(num_heads=4, key_dim=4)
    full.update(kwargs)
    with pytest.raises(ValueError, match="Received") as info:
        FlashMultiHeadAttention(**full)
    assert fragment in str(info.value)


def test_mha_rejects_several_attention_axes_inputs():
    layer = FlashMultiHeadAttention(2, 4)
    with pytest.raises(ValueError, match="query_shape"):
        layer(tf.zeros([1, 3, 3, DIM]), tf.zeros([1, 3, 3, DIM]))


@pytest.mark.parametrize("kwargs, fragment", [
    ({"causal": 1}, "causal=1"), ({"window": "a"}, "window='a'"), ({"dropout": -0.1}, "dropout=-0.1"),
    ({"scale": -1}, "scale=-1"), ({"block_size": (2, 0)}, "block_size=(2, 0)"), ({"seed": 1.5}, "seed=1.5"),
])
def test_flash_attention_rejects_bad_arguments(kwargs, fragment):
    with pytest.raises(ValueError, match="Received") as info:
        FlashAttention(**kwargs)
    assert fragment in str(info.value)


def test_symbolic_shapes():
    query, value = keras.Input((T, DIM)), keras.Input((S, 3))
    out, scores = FlashMultiHeadAttention(2, 4, output_shape=(3, 2))(query, value, return_attention_scores=True)
    assert out.shape == (None, T, 3, 2) and scores.shape == (None, 2, T, S)
    assert FlashMultiHeadAttention(2, 4).compute_output_shape((1, T, DIM), (1, S, 3)) == (1, T, DIM)


# ---------------------------------------------------------------- training as users do it

def _classifier(attention_layer, dtype_policy=None):
    tokens = keras.Input((None,), dtype="int32")
    x = keras.layers.Embedding(20, 8, mask_zero=True)(tokens)
    x = attention_layer(x, x, use_causal_mask=True)
    x = keras.layers.GlobalAveragePooling1D()(x)
    return keras.Model(tokens, keras.layers.Dense(2, dtype="float32")(x))


def test_compile_defaults_resolve_xla_like_keras_attention_and_fit_runs():
    model = _classifier(FlashMultiHeadAttention(2, 4, dropout=0.1))
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    from keras.src.trainers.trainer import model_supports_jit
    assert model_supports_jit(model)  # "auto": XLA on a GPU, off on CPU-only machines (Keras' rule)
    tokens, labels = saving_helper.data()
    history = model.fit(tokens, labels, epochs=1, batch_size=4, verbose=0)
    assert model.jit_compile is bool(tf.config.list_physical_devices("GPU"))
    assert np.all(np.isfinite(history.history["loss"]))
    assert model.predict(tokens, verbose=0).shape == (8, 2)
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", jit_compile=True)
    assert model.jit_compile is True
    assert np.all(np.isfinite(model.fit(tokens, labels, epochs=1, batch_size=4, verbose=0).history["loss"]))


def test_xla_compiled_call_equals_eager():
    layer = FlashMultiHeadAttention(2, 4)
    query = tf.constant(_rand(B, T, DIM))
    expected = layer(query, query, use_causal_mask=True)
    compiled = tf.function(lambda q: layer(q, q, use_causal_mask=True), jit_compile=True)(query)
    np.testing.assert_allclose(compiled, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_mixed_precision(policy):
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(policy)
    try:
        mha, flash = _twins(dict(num_heads=2, key_dim=4), q_shape=(B, T, DIM), v_shape=(B, S, DIM))
        assert all(w.dtype == "float32" for w in flash.weights)
        query, value = _rand(B, T, DIM, seed=1), _rand(B, S, DIM, seed=2)
        call_kwargs = {"value_mask": _prefix([4, 7], S), "use_causal_mask": True}
        expected = _forward_backward(mha, query, value, value, call_kwargs, "eager")
        actual = _forward_backward(flash, query, value, value, call_kwargs, "eager")
        tol = 2e-2 if policy == "mixed_float16" else 1e-1
        assert actual[0].dtype == keras.config.dtype_policy().compute_dtype
        heads = tf.constant(_rand(B, T, 2, 4, seed=3))
        attended = FlashAttention(causal=True)(heads, heads)
        assert attended.dtype == keras.config.dtype_policy().compute_dtype
        expected_heads, _ = reference_attention(heads.numpy(), heads.numpy(), heads.numpy(), causal=True)
        _assert_close(attended, expected_heads, atol=tol, rtol=tol)
        _assert_close(actual, expected, atol=tol, rtol=tol)

        model = _classifier(FlashMultiHeadAttention(2, 4))
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
        if policy == "mixed_float16":
            assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
        tokens, labels = saving_helper.data()
        history = model.fit(tokens, labels, epochs=2, batch_size=4, verbose=0)
        assert np.all(np.isfinite(history.history["loss"]))
    finally:
        keras.config.set_dtype_policy(previous)
