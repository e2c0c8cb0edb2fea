"""tf_flash.data: pack_documents against a plain-Python packer and against the packing rules themselves
(every token once and in order, rows of exactly sequence_length, segment ids, positions, per-document
features, padding only where the next document does not fit), and the pooling helpers against NumPy,
eager and under XLA. CPU only, fast."""
import zlib

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tf_flash import data


# ----------------------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------------------

def documents_dataset(docs, labels=None, dtype=tf.int32, **features):
    """A dataset of the token lists `docs` (dicts {"tokens", "label", **features} when labels are given)."""
    lengths = np.array([len(doc) for doc in docs], np.int64)
    values = np.concatenate([np.asarray(doc, np.int64) for doc in docs] + [np.zeros([0], np.int64)])
    tokens = tf.RaggedTensor.from_row_lengths(tf.constant(values, dtype), lengths)
    if labels is None and not features:
        return tf.data.Dataset.from_tensor_slices(tokens)
    columns = {"tokens": tokens, **features}
    if labels is not None:
        columns["label"] = tf.constant(labels)
    return tf.data.Dataset.from_tensor_slices(columns)


def rows_of(dataset):
    return list(dataset.as_numpy_iterator())


def reference_rows(docs, sequence_length, max_documents=None, long_documents="split"):
    """The packing rule in plain Python: each row is a list of (piece tokens, document index)."""
    max_documents = max_documents or sequence_length
    pieces = []
    for index, doc in enumerate(docs):
        if long_documents == "truncate":
            starts = [0] if doc else []
        else:
            starts = range(0, len(doc), sequence_length)
        pieces += [(list(doc[start:start + sequence_length]), index) for start in starts]
    rows, row = [], []
    for piece in pieces:
        used = sum(len(tokens) for tokens, _ in row)
        if row and (used + len(piece[0]) > sequence_length or len(row) == max_documents):
            rows.append(row)
            row = []
        row.append(piece)
    return rows + ([row] if row else [])


def expected_arrays(row, sequence_length, max_documents, labels, pad_id=0):
    """The packed row's arrays for a reference row."""
    token_ids = np.full(sequence_length, pad_id)
    segment_ids = np.zeros(sequence_length, np.int32)
    positions = np.zeros(sequence_length, np.int32)
    document_ids = np.full(max_documents, -1)
    label = np.zeros(max_documents, np.int32)
    offset = 0
    for slot, (tokens, index) in enumerate(row):
        end = offset + len(tokens)
        token_ids[offset:end] = tokens
        segment_ids[offset:end] = slot + 1
        positions[offset:end] = np.arange(len(tokens))
        document_ids[slot] = index
        label[slot] = labels[index]
        offset = end
    return dict(token_ids=token_ids, segment_ids=segment_ids, positions=positions, document_ids=document_ids,
                label=label)


def check_packing_rules(rows, docs, sequence_length, max_documents, long_documents, labels, pad_id=0):
    """The rules of pack_documents' docstring, checked on the rows without the reference packer."""
    max_documents = max_documents or sequence_length
    # Pieces in order, as read back from the rows through segment ids and document ids.
    read = []
    for number, row in enumerate(rows):
        assert row["token_ids"].shape == (sequence_length,)
        assert row["segment_ids"].shape == row["positions"].shape == (sequence_length,)
        assert row["document_ids"].shape == row["label"].shape == (max_documents,)
        assert row["segment_ids"].dtype == row["positions"].dtype == np.int32
        seg = row["segment_ids"]
        used = int(np.count_nonzero(seg))
        count = int(seg.max())
        assert used > 0, "no empty rows"
        # Documents first, padding only at the end; ids 1..count in order, each a contiguous run.
        np.testing.assert_array_equal(seg[used:], 0)
        assert np.all(seg[:used] >= 1) and np.all(np.diff(seg[:used]) >= 0)
        assert np.all(np.diff(seg[:used]) <= 1) and seg[0] == 1
        np.testing.assert_array_equal(row["token_ids"][used:], pad_id)
        np.testing.assert_array_equal(row["positions"][used:], 0)
        assert np.all(row["document_ids"][count:] == -1) and np.all(row["document_ids"][:count] >= 0)
        np.testing.assert_array_equal(row["label"][count:], 0)
        for segment in range(1, count + 1):
            where = np.flatnonzero(seg == segment)
            np.testing.assert_array_equal(row["positions"][where], np.arange(len(where)))
            index = int(row["document_ids"][segment - 1])
            assert row["label"][segment - 1] == labels[index]
            read.append((list(row["token_ids"][where]), index, number))
    # Every token once, in order: the pieces' tokens, joined per document, give the documents back (split)
    # or their first sequence_length tokens (truncate); empty documents have no piece.
    kept = [index for index, doc in enumerate(docs) if doc]
    assert sorted(set(index for _, index, _ in read)) == kept
    assert [index for _, index, _ in read] == sorted(index for _, index, _ in read)
    for index in kept:
        tokens = sum((piece for piece, i, _ in read if i == index), [])
        want = list(docs[index]) if long_documents == "split" else list(docs[index][:sequence_length])
        assert tokens == want
        if long_documents == "split":
            lengths = [len(piece) for piece, i, _ in read if i == index]
            assert all(length == sequence_length for length in lengths[:-1])
    # Padding only where the next piece does not fit (tokens or documents): each row but the last.
    for number in range(len(rows) - 1):
        row_pieces = [piece for piece, _, n in read if n == number]
        next_piece = next(piece for piece, _, n in read if n == number + 1)
        used = sum(len(piece) for piece in row_pieces)
        assert used + len(next_piece) > sequence_length or len(row_pieces) == max_documents


def assert_rows_equal(got, want):
    assert len(got) == len(want)
    for got_row, want_row in zip(got, want):
        assert sorted(got_row) == sorted(want_row)
        for key in want_row:
            np.testing.assert_array_equal(got_row[key], want_row[key], err_msg=key)


# ----------------------------------------------------------------------------------------------------------
# pack_documents
# ----------------------------------------------------------------------------------------------------------

def test_small_example_split():
    docs = [[1, 2, 3], [], [4, 5, 6, 7, 8, 9, 10], [11], [12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]]
    rows = rows_of(data.pack_documents(documents_dataset(docs, labels=[10, 11, 12, 13, 14]), 8,
                                       token_key="tokens", max_documents_per_row=3))
    # [4..10] does not fit after [1, 2, 3]: the first row pads; [11] joins [4..10]; the 11-token document
    # is split into 8 + 3 tokens, each piece a segment with positions from 0.
    assert_rows_equal(rows, [
        dict(token_ids=[1, 2, 3, 0, 0, 0, 0, 0], segment_ids=[1, 1, 1, 0, 0, 0, 0, 0],
             positions=[0, 1, 2, 0, 0, 0, 0, 0], document_ids=[0, -1, -1], label=[10, 0, 0]),
        dict(token_ids=[4, 5, 6, 7, 8, 9, 10, 11], segment_ids=[1, 1, 1, 1, 1, 1, 1, 2],
             positions=[0, 1, 2, 3, 4, 5, 6, 0], document_ids=[2, 3, -1], label=[12, 13, 0]),
        dict(token_ids=[12, 13, 14, 15, 16, 17, 18, 19], segment_ids=[1] * 8, positions=list(range(8)),
             document_ids=[4, -1, -1], label=[14, 0, 0]),
        dict(token_ids=[20, 21, 22, 0, 0, 0, 0, 0], segment_ids=[1, 1, 1, 0, 0, 0, 0, 0],
             positions=[0, 1, 2, 0, 0, 0, 0, 0], document_ids=[4, -1, -1], label=[14, 0, 0]),
    ])


def test_small_example_truncate_and_max_documents():
    docs = [[1], [2], [3], [4, 5, 6, 7, 8, 9]]
    rows = rows_of(data.pack_documents(documents_dataset(docs), 4, long_documents="truncate",
                                       max_documents_per_row=2, pad_id=-1))
    # Two documents at most per row: [3] starts a row with room left; the long document keeps 4 tokens.
    assert_rows_equal(rows, [
        dict(token_ids=[1, 2, -1, -1], segment_ids=[1, 2, 0, 0], positions=[0, 0, 0, 0], document_ids=[0, 1]),
        dict(token_ids=[3, -1, -1, -1], segment_ids=[1, 0, 0, 0], positions=[0, 0, 0, 0], document_ids=[2, -1]),
        dict(token_ids=[4, 5, 6, 7], segment_ids=[1, 1, 1, 1], positions=[0, 1, 2, 3], document_ids=[3, -1]),
    ])


@st.composite
def packings(draw):
    """(sequence_length, max_documents_per_row, document lengths): mostly documents that share rows, some
    empty ones and some longer than a row."""
    sequence_length = draw(st.integers(1, 12))
    max_documents = draw(st.one_of(st.none(), st.integers(1, 4)))
    length = st.one_of(st.integers(0, max(1, sequence_length // 2)), st.integers(0, sequence_length),
                       st.integers(sequence_length, 3 * sequence_length))
    return sequence_length, max_documents, draw(st.lists(length, max_size=16))


@settings(max_examples=30, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(packing=packings(), long_documents=st.sampled_from(data.LONG_DOCUMENTS),
       first_token=st.integers(1, 1000))
def test_random_documents(packing, long_documents, first_token):
    sequence_length, max_documents, lengths = packing
    # Distinct token values, so that any reordering or duplication shows.
    starts = np.cumsum([0] + lengths) + first_token
    docs = [list(range(start, start + length)) for start, length in zip(starts, lengths)]
    labels = [7 * index + 1 for index in range(len(docs))]
    packed = data.pack_documents(documents_dataset(docs, labels=labels), sequence_length, token_key="tokens",
                                 long_documents=long_documents, max_documents_per_row=max_documents)
    rows = rows_of(packed)
    check_packing_rules(rows, docs, sequence_length, max_documents, long_documents, labels)
    want = [expected_arrays(row, sequence_length, max_documents or sequence_length, labels)
            for row in reference_rows(docs, sequence_length, max_documents, long_documents)]
    assert_rows_equal(rows, want)


@pytest.mark.parametrize("long_documents", data.LONG_DOCUMENTS)
def test_varied_lengths_seeded(long_documents):
    rng = np.random.default_rng(43)
    lengths = np.concatenate([rng.integers(0, 40, 60), [0, 0, 64, 65, 200, 1, 63]])
    rng.shuffle(lengths)
    docs = [list(rng.integers(1, 50_000, length)) for length in lengths]
    labels = list(rng.integers(0, 5, len(docs)))
    packed = data.pack_documents(documents_dataset(docs, labels=labels), 64, token_key="tokens",
                                 long_documents=long_documents, max_documents_per_row=6)
    rows = rows_of(packed)
    check_packing_rules(rows, docs, 64, 6, long_documents, labels)
    want = [expected_arrays(row, 64, 6, labels) for row in reference_rows(docs, 64, 6, long_documents)]
    assert_rows_equal(rows, want)


@pytest.mark.parametrize("docs", [[], [[]], [[], [], []]], ids=["no_documents", "one_empty", "all_empty"])
def test_no_tokens_no_rows(docs):
    assert rows_of(data.pack_documents(documents_dataset(docs), 8)) == []


def test_documents_of_exactly_one_row():
    docs = [[1, 2, 3, 4], [5, 6, 7, 8], [9]]
    for long_documents in data.LONG_DOCUMENTS:
        rows = rows_of(data.pack_documents(documents_dataset(docs), 4, long_documents=long_documents))
        assert [list(row["token_ids"]) for row in rows] == [[1, 2, 3, 4], [5, 6, 7, 8], [9, 0, 0, 0]]
        assert [list(row["document_ids"]) for row in rows] == [[0, -1, -1, -1], [1, -1, -1, -1], [2, -1, -1, -1]]


def test_token_dtype_kept_and_static_shapes():
    docs = [[1, 2], [3, 4, 5]]
    packed = data.pack_documents(documents_dataset(docs, dtype=tf.int64), 6, pad_id=2**40,
                                 max_documents_per_row=4)
    spec = packed.element_spec
    assert spec["token_ids"] == tf.TensorSpec([6], tf.int64)
    assert spec["segment_ids"] == spec["positions"] == tf.TensorSpec([6], tf.int32)
    assert spec["document_ids"] == tf.TensorSpec([4], tf.int64)
    assert packed.batch(3).element_spec["token_ids"].shape.as_list() == [None, 6]
    (row,) = rows_of(packed)
    np.testing.assert_array_equal(row["token_ids"], [1, 2, 3, 4, 5, 2**40])


def test_features_of_any_fixed_shape_and_dtype():
    docs = [[1, 2], [3], [4, 5, 6, 7, 8]]
    weights = tf.constant([[0.5, 1.5], [2.5, 3.5], [4.5, 5.5]])
    names = tf.constant(["a", "b", "c"])
    flags = tf.constant([True, False, True])
    packed = data.pack_documents(documents_dataset(docs, weight=weights, name=names, flag=flags), 4,
                                 token_key="tokens", max_documents_per_row=2)
    assert packed.element_spec["weight"] == tf.TensorSpec([2, 2], tf.float32)
    rows = rows_of(packed)
    np.testing.assert_array_equal(rows[0]["weight"], [[0.5, 1.5], [2.5, 3.5]])
    np.testing.assert_array_equal(rows[0]["name"], [b"a", b"b"])
    np.testing.assert_array_equal(rows[0]["flag"], [True, False])
    # The split document's two pieces both carry its features; unused slots hold zeros, "" and False.
    for row in rows[1:]:
        np.testing.assert_array_equal(row["weight"], [[4.5, 5.5], [0.0, 0.0]])
        np.testing.assert_array_equal(row["name"], [b"c", b""])
        np.testing.assert_array_equal(row["flag"], [True, False])


def test_tokens_of_unknown_rank():
    docs = [[1, 2, 3], [4]]
    dataset = tf.data.Dataset.from_generator(lambda: iter(np.array(doc, np.int32) for doc in docs),
                                             output_signature=tf.TensorSpec(None, tf.int32))
    (row,) = rows_of(data.pack_documents(dataset, 4))
    np.testing.assert_array_equal(row["segment_ids"], [1, 1, 1, 2])
    # A rank the spec could not tell is checked when the data arrives.
    matrix = tf.data.Dataset.from_generator(lambda: iter([np.zeros([2, 2], np.int32)]),
                                            output_signature=tf.TensorSpec(None, tf.int32))
    with pytest.raises(tf.errors.InvalidArgumentError):
        rows_of(data.pack_documents(matrix, 4))


def test_deterministic_and_independent_of_parallelism():
    rng = np.random.default_rng(7)
    docs = [list(rng.integers(1, 100, length)) for length in rng.integers(0, 50, 80)]
    labels = list(range(len(docs)))
    dataset = documents_dataset(docs, labels=labels)
    first = rows_of(data.pack_documents(dataset, 32, token_key="tokens", max_documents_per_row=4))
    again = rows_of(data.pack_documents(dataset, 32, token_key="tokens", max_documents_per_row=4))
    serial = rows_of(data.pack_documents(dataset, 32, token_key="tokens", max_documents_per_row=4,
                                         num_parallel_calls=None))
    four = rows_of(data.pack_documents(dataset, 32, token_key="tokens", max_documents_per_row=4,
                                       num_parallel_calls=4))
    assert_rows_equal(again, first)
    assert_rows_equal(serial, first)
    assert_rows_equal(four, first)


def test_mirrored_strategy_input_pipeline():
    rng = np.random.default_rng(11)
    docs = [list(rng.integers(1, 100, length)) for length in rng.integers(1, 20, 30)]
    labels = list(rng.integers(0, 3, len(docs)))
    packed = data.pack_documents(documents_dataset(docs, labels=labels), 16, token_key="tokens",
                                 max_documents_per_row=4).batch(2, drop_remainder=True)
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    distributed = strategy.experimental_distribute_dataset(packed)
    table = tf.constant(rng.normal(size=(100, 3)), tf.float32)

    @tf.function
    def step(batch):
        def replica(batch):
            hidden = tf.gather(table, batch["token_ids"])
            return data.segment_mean(hidden, batch["segment_ids"], 4)
        return strategy.run(replica, args=(batch,))

    got = [strategy.experimental_local_results(step(batch))[0].numpy() for batch in distributed]
    want = [numpy_segment_mean(tf.gather(table, batch["token_ids"]).numpy(), batch["segment_ids"].numpy(), 4)
            for batch in packed]
    assert len(got) == len(want) > 0
    for got_batch, want_batch in zip(got, want):
        np.testing.assert_allclose(got_batch, want_batch, rtol=1e-6, atol=1e-6)
    # The same pipeline built per input worker.
    from_function = strategy.distribute_datasets_from_function(lambda context: packed)
    got = [strategy.experimental_local_results(step(batch))[0].numpy() for batch in from_function]
    assert len(got) == len(want)
    for got_batch, want_batch in zip(got, want):
        np.testing.assert_allclose(got_batch, want_batch, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kwargs,message", [
    (dict(sequence_length=0), "sequence_length=0"),
    (dict(sequence_length=2.5), "sequence_length=2.5"),
    (dict(sequence_length=True), "sequence_length=True"),
    (dict(long_documents="drop"), "long_documents='drop'"),
    (dict(max_documents_per_row=0), "max_documents_per_row=0"),
    (dict(pad_id=2**31), "pad_id=2147483648"),
    (dict(pad_id=0.5), "pad_id=0.5"),
    (dict(num_parallel_calls=0), "num_parallel_calls=0"),
    (dict(token_key="text"), "token_key='text'"),
    (dict(token_key=None), "token_key=None"),
])
def test_bad_arguments(kwargs, message):
    dataset = documents_dataset([[1, 2]], labels=[0])
    arguments = {"sequence_length": 4, "token_key": "tokens", **kwargs}
    with pytest.raises(ValueError, match="Received") as error:
        data.pack_documents(dataset, **arguments)
    assert message in str(error.value)


@pytest.mark.parametrize("dataset,message", [
    (tf.data.Dataset.from_tensor_slices([[0.5, 1.5]]), "dtype=tf.float32"),
    (tf.data.Dataset.from_tensor_slices([[[1, 2]]]), "shape=(1, 2)"),
    (tf.data.Dataset.from_tensor_slices({"tokens": [[1, 2]], "document_ids": [3]}), "'document_ids'"),
    (tf.data.Dataset.from_tensor_slices({"tokens": tf.ragged.constant([[1, 2]]),
                                         "words": tf.ragged.constant([[1, 2]])}), "'words'"),
], ids=["float_tokens", "rank_2_tokens", "feature_named_like_an_output", "feature_of_varying_shape"])
def test_bad_datasets(dataset, message):
    token_key = "tokens" if isinstance(dataset.element_spec, dict) else None
    with pytest.raises(ValueError, match="Received") as error:
        data.pack_documents(dataset, 4, token_key=token_key)
    assert message in str(error.value)


def test_not_a_dataset():
    with pytest.raises(ValueError, match=r"dataset=\[\[1, 2\]\]"):
        data.pack_documents([[1, 2]], 4)


# ----------------------------------------------------------------------------------------------------------
# Pooling
# ----------------------------------------------------------------------------------------------------------

def numpy_segment_mean(x, segment_ids, num_segments):
    out = np.zeros((x.shape[0], num_segments, x.shape[2]), np.float64)
    for b in range(x.shape[0]):
        for j in range(num_segments):
            where = segment_ids[b] == j + 1
            if where.any():
                out[b, j] = x[b, where].astype(np.float64).mean(axis=0)
    return out


def numpy_segment_first(x, segment_ids, num_segments):
    out = np.zeros((x.shape[0], num_segments, x.shape[2]), np.float64)
    for b in range(x.shape[0]):
        for j in range(num_segments):
            where = np.flatnonzero(segment_ids[b] == j + 1)
            if where.size:
                out[b, j] = x[b, where[0]]
    return out


POOLS = {"segment_mean": (data.segment_mean, numpy_segment_mean),
         "segment_first": (data.segment_first, numpy_segment_first)}
TOLERANCE = {tf.float64: 1e-12, tf.float32: 1e-6, tf.float16: 2e-3, tf.bfloat16: 2e-2}


def pooling_inputs(seed, batch=3, length=37, features=5, max_id=6):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(batch, length, features))
    # Packed rows (contiguous ids, padding at the end), a row of scattered ids with ids above num_segments,
    # and a row of padding only.
    ids = np.zeros((batch, length), np.int32)
    ids[0, :30] = np.sort(rng.integers(1, 5, 30))
    ids[1] = rng.integers(0, max_id + 1, length)
    return x, ids


@pytest.mark.parametrize("pool", sorted(POOLS))
@pytest.mark.parametrize("dtype", sorted(TOLERANCE, key=lambda d: d.name), ids=lambda d: d.name)
@pytest.mark.parametrize("mode", ["eager", "xla"])
def test_pooling_against_numpy(pool, dtype, mode):
    function, reference = POOLS[pool]
    x, ids = pooling_inputs(seed=zlib.crc32(f"{pool}-{dtype.name}-{mode}".encode()))
    x_tf = tf.constant(x, dtype)
    num_segments = 4
    run = function if mode == "eager" else tf.function(function, jit_compile=True, reduce_retracing=False)
    got = run(x_tf, tf.constant(ids), num_segments)
    assert got.dtype == dtype and got.shape == (3, num_segments, 5)
    # The reference pools what the function received: x rounded to the dtype.
    want = reference(tf.cast(x_tf, tf.float64).numpy(), ids, num_segments)
    np.testing.assert_allclose(tf.cast(got, tf.float64).numpy(), want, rtol=TOLERANCE[dtype],
                               atol=TOLERANCE[dtype])
    np.testing.assert_array_equal(got[2].numpy(), 0)  # a row of padding pools to zeros


@pytest.mark.parametrize("pool", sorted(POOLS))
def test_pooling_unknown_batch_and_int64_ids(pool):
    function, reference = POOLS[pool]
    x, ids = pooling_inputs(seed=5)
    spec = [tf.TensorSpec([None, 37, 5], tf.float32), tf.TensorSpec([None, 37], tf.int64)]
    for jit_compile in (False, True):
        run = tf.function(lambda x, ids: function(x, ids, 6), input_signature=spec, jit_compile=jit_compile)
        got = run(tf.constant(x, tf.float32), tf.constant(ids, tf.int64))
        np.testing.assert_allclose(got.numpy(), reference(x.astype(np.float32), ids, 6), rtol=1e-6, atol=1e-6)


def test_pooling_on_packed_rows():
    docs = [[1, 2, 3], [4, 5], [6, 7, 8, 9, 10, 11]]
    (batch,) = rows_of(data.pack_documents(documents_dataset(docs), 6, max_documents_per_row=3).batch(4))
    x = tf.cast(batch["token_ids"], tf.float32)[..., tf.newaxis]
    np.testing.assert_allclose(data.segment_mean(x, batch["segment_ids"], 3)[..., 0],
                               [[2.0, 4.5, 0.0], [8.5, 0.0, 0.0]])
    np.testing.assert_allclose(data.segment_first(x, batch["segment_ids"], 3)[..., 0],
                               [[1.0, 4.0, 0.0], [6.0, 0.0, 0.0]])


def test_pooling_gradient_of_mean():
    x, ids = pooling_inputs(seed=9)
    x = tf.constant(x, tf.float64)
    with tf.GradientTape() as tape:
        tape.watch(x)
        total = tf.reduce_sum(data.segment_mean(x, ids, 4))
    # d total / d x[b, t] = 1 / (tokens of t's segment) for pooled tokens, 0 elsewhere.
    counts = np.array([[np.sum(row == i) if 1 <= i <= 4 else 0 for i in row] for row in ids])
    want = np.where(counts > 0, 1.0 / np.maximum(counts, 1), 0.0)[..., None] * np.ones(x.shape)
    np.testing.assert_allclose(tape.gradient(total, x).numpy(), want)


@pytest.mark.parametrize("pool", sorted(POOLS))
@pytest.mark.parametrize("args,message", [
    ((np.zeros((2, 3)), np.zeros((2, 3), np.int32), 2), "x=<tensor shape=(2, 3) dtype=float64>"),
    ((np.zeros((2, 3, 4), np.int32), np.zeros((2, 3), np.int32), 2), "x=<tensor shape=(2, 3, 4) dtype=int32>"),
    ((np.zeros((2, 3, 4)), np.zeros((2, 3)), 2), "segment_ids=<tensor shape=(2, 3) dtype=float64>"),
    ((np.zeros((2, 3, 4)), np.zeros((2, 4), np.int32), 2), "segment_ids=<tensor shape=(2, 4) dtype=int32>"),
    ((np.zeros((2, 3, 4)), np.zeros((2, 3), np.int32), 0), "num_segments=0"),
    ((np.zeros((2, 3, 4)), np.zeros((2, 3), np.int32), None), "num_segments=None"),
])
def test_pooling_bad_arguments(pool, args, message):
    function, _ = POOLS[pool]
    with pytest.raises(ValueError, match="Received") as error:
        function(*args)
    assert message in str(error.value)


# ----------------------------------------------------------------------------------------------------------
# In pipelines and models
# ----------------------------------------------------------------------------------------------------------

def test_packs_shards_inside_interleave():
    # docs/data.md's recipe for more throughput: one packer per shard of the documents, interleaved.
    rng = np.random.default_rng(3)
    docs = [list(rng.integers(1, 100, length)) for length in rng.integers(0, 30, 40)]
    dataset = documents_dataset(docs, labels=list(range(len(docs))))

    def packed_shard(shard):
        return data.pack_documents(dataset.shard(4, shard), 32, token_key="tokens", max_documents_per_row=4)
    rows = tf.data.Dataset.range(4).interleave(packed_shard, cycle_length=4, num_parallel_calls=4,
                                               deterministic=True)
    first, again = rows_of(rows), rows_of(rows)
    assert_rows_equal(again, first)
    # Every document once, whole: `label` holds its index in `dataset` (document_ids index the shard).
    found = {}
    for row in first:
        for segment in range(1, row["segment_ids"].max() + 1):
            index = int(row["label"][segment - 1])
            found.setdefault(index, []).extend(row["token_ids"][row["segment_ids"] == segment])
    assert found == {index: doc for index, doc in enumerate(docs) if doc}


# A packed dataset's length is unknown until read: Keras' first epoch says so.
@pytest.mark.filterwarnings("ignore:Your input ran out of data")
def test_keras_classifier_on_packed_rows_under_xla():
    import keras

    sequence_length, max_documents, vocabulary, classes = 32, 4, 50, 3
    rng = np.random.default_rng(1)
    docs = [list(rng.integers(1, vocabulary, length)) for length in rng.integers(1, 20, 40)]
    labels = list(rng.integers(0, classes, len(docs)))
    rows = data.pack_documents(documents_dataset(docs, labels=labels), sequence_length, token_key="tokens",
                               max_documents_per_row=max_documents)

    def to_example(row):
        inputs = {key: row[key] for key in ("token_ids", "segment_ids", "positions")}
        return inputs, row["label"], tf.cast(row["document_ids"] >= 0, tf.float32)
    train = rows.map(to_example).batch(4, drop_remainder=True)

    class Pool(keras.layers.Layer):
        def call(self, hidden, segment_ids):
            return data.segment_mean(hidden, segment_ids, max_documents)

    token_ids = keras.Input([sequence_length], dtype="int32", name="token_ids")
    segment_ids = keras.Input([sequence_length], dtype="int32", name="segment_ids")
    positions = keras.Input([sequence_length], dtype="int32", name="positions")
    hidden = (keras.layers.Embedding(vocabulary, 8)(token_ids)
              + keras.layers.Embedding(sequence_length, 8)(positions))
    logits = keras.layers.Dense(classes)(Pool()(hidden, segment_ids))
    model = keras.Model([token_ids, segment_ids, positions], logits)
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=True)
    history = model.fit(train, epochs=1, verbose=0, shuffle=False)
    assert np.isfinite(history.history["loss"]).all()
    assert model.predict(train, verbose=0).shape[1:] == (max_documents, classes)
