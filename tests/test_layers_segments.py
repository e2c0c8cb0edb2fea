"""The layers with packed documents (`segment_ids`, issue 43): FlashMultiHeadAttention and FlashAttention on
packed rows give what each document gives alone (float32 on the CPU, outputs and gradients, causal or
not), combine with Keras padding masks and the other masks (AND), take the (query ids, key ids) pair of
cross-attention, run in tf.function, under XLA and in a Keras model, and refuse bad ids by name."""
import numpy as np
import pytest
import tensorflow as tf
import keras

import tf_flash
from reference import reference_attention
from tf_flash.layers import FlashAttention, FlashMultiHeadAttention

DIM = 6
# Two packed rows of 12 tokens: documents of 5, 4 and 3 tokens; of 7 and 3 tokens then 2 of padding (id 0).
IDS = np.array([[1, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3],
                [1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 0, 0]], np.int32)
TOL = dict(atol=1e-5, rtol=1e-5)


def _rand(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype("float32")


def _documents(ids):
    """(row, start, end) of every run of one id, padding (0) left out."""
    spans = []
    for row, row_ids in enumerate(ids):
        start = 0
        for t in range(1, len(row_ids) + 1):
            if t == len(row_ids) or row_ids[t] != row_ids[start]:
                if row_ids[start] != 0:
                    spans.append((row, start, t))
                start = t
    return spans


def _mha(**kwargs):
    layer = FlashMultiHeadAttention(num_heads=2, key_dim=4, **kwargs)
    layer.build((None, None, DIM), (None, None, DIM))
    layer.set_weights([_rand(*w.shape, seed=i + 10) * 0.5 for i, w in enumerate(layer.weights)])
    return layer


def _loss_and_grads(layer, x, cotangent, **call_kwargs):
    """Output of layer(x, x) and gradients of sum(output * cotangent) to x and the layer's weights."""
    x = tf.convert_to_tensor(x)
    with tf.GradientTape() as tape:
        tape.watch(x)
        out = layer(x, x, **call_kwargs)
        loss = tf.reduce_sum(out * cotangent)
    return out, tape.gradient(loss, [x] + layer.trainable_weights)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mode", ["eager", "function"])
def test_mha_packed_rows_equal_documents_alone(causal, mode):
    layer = _mha()
    x = _rand(2, 12, DIM, seed=1)
    cotangent = _rand(2, 12, DIM, seed=2)
    real = (IDS > 0)[..., None]

    def packed(x):
        return _loss_and_grads(layer, x, cotangent * real, segment_ids=tf.constant(IDS), use_causal_mask=causal)
    out, grads = (tf.function(packed) if mode == "function" else packed)(x)

    expected_out = np.zeros_like(x)
    expected_grads = [np.zeros(g.shape, np.float32) for g in grads]
    for row, start, end in _documents(IDS):
        doc_out, doc_grads = _loss_and_grads(layer, x[row:row + 1, start:end], cotangent[row:row + 1, start:end],
                                             use_causal_mask=causal)
        expected_out[row, start:end] = doc_out[0]
        expected_grads[0][row, start:end] = doc_grads[0][0]
        for total, grad in zip(expected_grads[1:], doc_grads[1:]):
            total += grad.numpy()
    np.testing.assert_allclose(np.where(real, out, 0), expected_out, **TOL)
    # The padding tokens (id 0) attend among themselves, and only the real tokens carry a cotangent: the
    # gradient of x is the documents' on real tokens and zero on padding.
    np.testing.assert_allclose(grads[0], expected_grads[0], **TOL)
    for actual, expected in zip(grads[1:], expected_grads[1:]):
        np.testing.assert_allclose(actual, expected, **TOL)


def test_mha_segment_ids_with_keras_padding_masks():
    """Embedding(mask_zero=True) gives the query/value masks; the segment ids come beside them: the real
    tokens get their documents' outputs, the masked rows Keras' fill (the mean of the values)."""
    tokens = np.array([[3, 4, 5, 6, 7, 8, 9, 2, 3, 4, 0, 0]], np.int32)
    ids = np.array([[1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 0, 0]], np.int32)
    embedding = keras.layers.Embedding(10, DIM, mask_zero=True)
    layer = _mha()
    x = embedding(tokens)
    out = layer(x, x, segment_ids=ids, use_causal_mask=True)
    assert out._keras_mask is not None
    for row, start, end in _documents(ids):
        alone = layer(x[row:row + 1, start:end], x[row:row + 1, start:end], use_causal_mask=True)
        np.testing.assert_allclose(out[row:row + 1, start:end], alone, **TOL)
    # Without segment ids the masked rows get the mean of the values over every key; so they do with them.
    # (The layer takes the Keras mask off its inputs: the masks go in explicitly here.)
    mask = tokens != 0
    plain = layer(x, x, query_mask=mask, value_mask=mask, use_causal_mask=True)
    np.testing.assert_allclose(out[:, 10:], plain[:, 10:], **TOL)


def test_mha_cross_attention_pair_equals_block_mask_and_scores():
    """A (query ids, key ids) pair is the mask equal(q_ids[:, :, None], kv_ids[:, None, :]); a query whose
    document has no key gets what Keras gives a fully masked row. Scores come out masked the same way."""
    layer = _mha()
    query, value = _rand(2, 5, DIM, seed=3), _rand(2, 7, DIM, seed=4)
    q_ids = np.array([[1, 1, 2, 2, 3], [1, 2, 2, 2, 2]], np.int32)  # id 3 of row 0 has no key
    kv_ids = np.array([[1, 1, 1, 2, 2, 2, 2], [1, 1, 2, 2, 2, 0, 0]], np.int32)
    mask = q_ids[:, :, None] == kv_ids[:, None, :]
    for scores in (False, True):
        actual = layer(query, value, segment_ids=(q_ids, kv_ids), return_attention_scores=scores)
        expected = layer(query, value, attention_mask=mask, return_attention_scores=scores)
        for a, e in zip(tf.nest.flatten(actual), tf.nest.flatten(expected)):
            np.testing.assert_allclose(a, e, **TOL)
    # The pair as a list of two tensors, and AND-ed with an attention mask and causal.
    band = np.tril(np.ones([5, 7], bool), 1)
    actual = layer(query, value, segment_ids=[tf.constant(q_ids), tf.constant(kv_ids)], attention_mask=band,
                   use_causal_mask=True)
    expected = layer(query, value, attention_mask=mask & band, use_causal_mask=True)
    np.testing.assert_allclose(actual, expected, **TOL)


@pytest.mark.parametrize("causal", [False, True])
def test_flash_attention_layer_matches_reference(causal):
    q, k, v = (_rand(2, 12, 2, 4, seed=s) for s in (5, 6, 7))
    same = IDS[:, :, None] == IDS[:, None, :]
    expected, _ = reference_attention(q, k, v, causal=causal, attention_mask=same[:, None])
    layer = FlashAttention(causal=causal)
    np.testing.assert_allclose(layer(q, v, key=k, segment_ids=IDS), expected, **TOL)
    # int64 ids (tf.data's default) are taken too; and the pair form with the same ids. A list of two lists
    # is one [2, 12] array of ids (a pair is a tuple, or a list of two tensors).
    np.testing.assert_allclose(layer(q, v, key=k, segment_ids=(IDS.astype(np.int64), IDS)), expected, **TOL)
    np.testing.assert_allclose(layer(q, v, key=k, segment_ids=IDS.tolist()), expected, **TOL)
    # With kv_lengths beside them: both rules hold.
    lengths = np.array([9, 12], np.int32)
    visible = same & (np.arange(12)[None, None, :] < lengths[:, None, None])
    expected, _ = reference_attention(q, k, v, causal=causal, attention_mask=visible[:, None])
    np.testing.assert_allclose(layer(q, v, key=k, segment_ids=IDS, kv_lengths=lengths), expected, **TOL)


def test_segment_ids_under_xla_equal_eager():
    layer = _mha()
    x = tf.constant(_rand(2, 12, DIM, seed=8))
    ids = tf.constant(IDS)
    expected = layer(x, x, segment_ids=ids, use_causal_mask=True)
    compiled = tf.function(lambda x, ids: layer(x, x, segment_ids=ids, use_causal_mask=True), jit_compile=True)
    np.testing.assert_allclose(compiled(x, ids), expected, **TOL)


class _DocumentMean(keras.layers.Layer):
    def __init__(self, documents, **kwargs):
        super().__init__(**kwargs)
        self.documents = documents

    def call(self, hidden, segment_ids):
        return tf_flash.data.segment_mean(hidden, segment_ids, self.documents)


def test_packed_classifier_trains_in_a_keras_model():
    """Segment ids as a model input, positions within documents, per-document pooling: fit runs (under XLA
    too), the gradients reach every weight, the layer's config is unchanged (segment_ids is a call argument)."""
    length, documents = 12, 3
    token_ids = keras.Input([length], dtype="int32")
    segment_ids = keras.Input([length], dtype="int32")
    x = keras.layers.Embedding(20, 8)(token_ids)
    attention = FlashMultiHeadAttention(2, 4, dropout=0.1, name="attention")
    x = x + attention(x, x, segment_ids=segment_ids, use_causal_mask=True)
    pooled = _DocumentMean(documents)(x, segment_ids)
    model = keras.Model([token_ids, segment_ids], keras.layers.Dense(2)(pooled))
    tokens = np.random.default_rng(0).integers(1, 20, [4, length]).astype(np.int32)
    ids = np.concatenate([IDS, IDS])
    labels = np.array([[0, 1, 1], [1, 0, 0]] * 2, np.int32)
    weights = np.array([[1, 1, 1], [1, 1, 0]] * 2, np.float32)  # row 1 holds two documents
    for jit in (False, True):
        model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=jit)
        history = model.fit([tokens, ids], labels, sample_weight=weights, batch_size=2, epochs=1, verbose=0)
        assert np.isfinite(history.history["loss"][0])
    with tf.GradientTape() as tape:
        logits = model([tokens, ids], training=True)
        loss = tf.reduce_sum(logits * weights[..., None])
    grads = tape.gradient(loss, model.trainable_weights)
    assert all(g is not None and np.any(np.asarray(g) != 0) for g in grads)
    assert "segment_ids" not in attention.get_config()


def test_pair_of_id_inputs_in_a_functional_model():
    """Cross-attention ids as two model inputs (a tuple of Keras tensors): the model gives the eager call's
    output and survives a save/load round trip of its config."""
    query, value = keras.Input([5, DIM]), keras.Input([7, DIM])
    q_ids, kv_ids = keras.Input([5], dtype="int32"), keras.Input([7], dtype="int32")
    layer = FlashMultiHeadAttention(2, 4, name="cross")
    model = keras.Model([query, value, q_ids, kv_ids], layer(query, value, segment_ids=(q_ids, kv_ids)))
    inputs = [_rand(2, 5, DIM, seed=11), _rand(2, 7, DIM, seed=12),
              np.array([[1, 1, 2, 2, 2], [1, 1, 1, 1, 1]], np.int32),
              np.array([[1, 2, 2, 2, 1, 1, 2], [1, 1, 1, 0, 0, 0, 0]], np.int32)]
    expected = layer(inputs[0], inputs[1], segment_ids=(inputs[2], inputs[3]))
    np.testing.assert_allclose(model(inputs), expected, **TOL)
    clone = keras.Model.from_config(model.get_config())
    clone.set_weights(model.get_weights())
    np.testing.assert_allclose(clone(inputs), expected, **TOL)


@pytest.mark.parametrize("segment_ids, fragment", [
    (np.ones([2, 12], np.float32), "`segment_ids` must be an integer tensor"),
    (np.ones([2, 12], bool), "`segment_ids` must be an integer tensor"),
    (np.ones([2, 11], np.int32), "segment_ids.shape=(2, 11)"),
    (np.ones([12], np.int32), "segment_ids.shape=(12,)"),
    ((np.ones([2, 12], np.int32),) * 3, "a tuple of 3"),
    ((np.ones([2, 12], np.int32), np.ones([2, 5], np.int32)), "kv_segment_ids.shape=(2, 5)"),
    ("abc", "segment_ids"),
])
def test_bad_segment_ids_are_refused_by_name(segment_ids, fragment):
    layer = _mha()
    x = tf.constant(_rand(2, 12, DIM))
    with pytest.raises(ValueError, match="Received") as info:
        layer(x, x, segment_ids=segment_ids)
    assert fragment in str(info.value)
    with pytest.raises(ValueError, match="Received") as info:
        FlashAttention()(tf.reshape(x, [2, 12, 2, 3]), tf.reshape(x, [2, 12, 2, 3]), segment_ids=segment_ids)
    assert fragment in str(info.value)


def test_one_tensor_of_ids_is_for_self_attention():
    layer = _mha()
    with pytest.raises(ValueError, match="give a pair") as info:
        layer(tf.constant(_rand(2, 5, DIM)), tf.constant(_rand(2, 7, DIM)), segment_ids=np.ones([2, 5], np.int32))
    assert "seq_q=5, seq_k=7" in str(info.value)


def test_context_parallel_refuses_segment_ids(monkeypatch):
    """In a replica context with several replicas (tf_flash.parallel's test: test_parallel.py) the sharded
    attention takes no segment ids: the layer says so, naming them. Elsewhere the layer takes them."""
    layer = _mha(context_parallel=True)
    x = tf.constant(_rand(2, 12, DIM))
    expected = _mha()(x, x, segment_ids=IDS)
    np.testing.assert_allclose(layer(x, x, segment_ids=IDS), expected, **TOL)  # no strategy: the plain layer
    monkeypatch.setattr(tf_flash.parallel, "in_replica_context", lambda: True)
    with pytest.raises(ValueError, match="segment_ids is not available with context_parallel=True") as info:
        layer(x, x, segment_ids=IDS)
    assert "Received: segment_ids of shape (2, 12)" in str(info.value)
