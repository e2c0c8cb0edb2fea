"""`tf_flash.data`: packing variable-length documents into rows of one fixed length, and pooling per document.

Padding a batch of documents of 100 to 40,000 tokens to a common length wastes most of the compute, and
bucketing by length gives XLA one compilation per bucket. Packing puts several documents in one row of
exactly `sequence_length` tokens instead: every row has the same static shape, and almost every token is a
real one. `segment_ids` tell the documents of a row apart, so that attention stays inside each document
(they are the ids that the `segment_ids=` argument of `tf_flash.flash_attention` takes; docs/data.md says
how to mask attention with them) and a classifier pools each document alone (`segment_mean`,
`segment_first`).

    docs = tf.data.Dataset.from_tensor_slices({"tokens": ragged_tokens, "label": labels})
    rows = tf_flash.data.pack_documents(docs, 4096, token_key="tokens", max_documents_per_row=32)
    rows = rows.batch(8, drop_remainder=True).prefetch(tf.data.AUTOTUNE)
    # row["token_ids"], row["segment_ids"], row["positions"]: [8, 4096]
    # row["label"], row["document_ids"]: [8, 32], slot j holding the document of segment id j + 1

    hidden = ...                                          # [8, 4096, D], from a model on the rows
    pooled = tf_flash.data.segment_mean(hidden, row["segment_ids"], 32)    # [8, 32, D]

docs/data.md describes the row format and how to train a classifier on it.
"""
import numpy as np
import tensorflow as tf

from tf_flash import _checks

__all__ = ["pack_documents", "segment_mean", "segment_first", "LONG_DOCUMENTS"]

# What `pack_documents(long_documents=...)` does with a document longer than a row.
LONG_DOCUMENTS = ("split", "truncate")

# The keys every packed row has; per-document features take the other keys of the input.
_ROW_KEYS = ("token_ids", "segment_ids", "positions", "document_ids")


def pack_documents(dataset, sequence_length, *, token_key=None, long_documents="split", pad_id=0,
                   max_documents_per_row=None, num_parallel_calls=tf.data.AUTOTUNE):
    """Packs a dataset of variable-length documents into rows of exactly `sequence_length` tokens.

    Documents are taken in the order of `dataset` and packed greedily (next fit): a document goes into the
    current row when its tokens fit in the room left and the row holds fewer than `max_documents_per_row`
    documents; otherwise the current row is finished, padded with `pad_id`, and the document starts the next
    row. A document is never cut to fill the end of a row, so padding appears only at the end of a row that
    the next document does not fit in, and at the end of the last row. Empty documents are skipped (they
    still count in `document_ids`, which index the input dataset).

    A document longer than `sequence_length` is, by `long_documents`:
      - `"split"`: cut into pieces of `sequence_length` tokens (the last piece holds the rest), each packed
        as a document of its own: every token of the input appears exactly once, in order. The pieces of a
        document share its `document_ids` entry and its features; positions restart at 0 in each piece
        (each piece is a segment of its own, so attention does not cross from one piece to the next, and
        positions stay below `sequence_length`, within a position-embedding table of that size).
      - `"truncate"`: its first `sequence_length` tokens are kept, the rest is dropped.

    Each element of the result is a dict:
      - `token_ids`: `[sequence_length]`, the dtype of the input tokens; `pad_id` after the last document.
      - `segment_ids`: int32 `[sequence_length]`: 1, 2, ..., k for the k documents of the row, in order;
        0 for padding: the ids that the `segment_ids=` argument of `tf_flash.flash_attention` takes.
      - `positions`: int32 `[sequence_length]`: the position of each token within its document (piece),
        from 0; 0 for padding.
      - `document_ids`: int64 `[max_documents_per_row]`: slot j holds the index in `dataset` of the
        document of segment id j + 1, or -1 where the row has fewer documents.
      - one entry per per-document feature (the keys of a dict element other than `token_key`):
        `[max_documents_per_row, *feature_shape]`, slot j holding the feature of segment id j + 1, zeros
        (empty strings, False) in unused slots.

    The packing is a `tf.data.Dataset.scan` over the documents (sequential, like every packing that keeps
    the input order), between `map`s that run with `num_parallel_calls`; there are no Python generators or
    `py_function`s, so the result works in `tf.distribute` input pipelines (it is a function from Dataset to
    Dataset). The result is deterministic: the same input gives the same rows (unless
    `tf.data.Options.deterministic` is False, which lets the parallel `map`s reorder documents).

    Args:
        dataset: a `tf.data.Dataset` whose elements are 1-D integer tensors of token ids (when `token_key`
            is None), or dicts holding such a tensor under `token_key` and per-document features (tensors
            of a fixed shape: labels, weights, ids) under the other keys. Tuples such as `(tokens, label)`
            become dicts with `dataset.map(lambda t, y: {"tokens": t, "label": y})`.
        sequence_length: positive int, the number of tokens in every row.
        token_key: None (elements are token tensors) or the key of the tokens in dict elements.
        long_documents: `"split"` or `"truncate"`: what happens to a document longer than a row (above).
        pad_id: int, the token id of padding; it must fit the dtype of the tokens.
        max_documents_per_row: positive int, the most documents (pieces) in one row, and the size of the
            per-document outputs. A full row is finished early (with padding). None means
            `sequence_length`, the most a row can hold; a smaller value keeps the per-document outputs and
            the pooled tensors small.
        num_parallel_calls: the parallelism of the `map`s before and after the packing scan, as in
            `tf.data.Dataset.map`; `tf.data.AUTOTUNE` by default.

    Returns:
        A `tf.data.Dataset` of packed rows (dicts, above), unbatched: batch it with `.batch(...)`.

    Raises:
        ValueError: for an argument outside the ranges above, a dataset whose elements are not token
            tensors or dicts as described, or a feature named like an output key.
    """
    if not isinstance(dataset, tf.data.Dataset):
        raise ValueError(f"`dataset` must be a tf.data.Dataset. Received: dataset={_checks.describe(dataset)}")
    sequence_length = _checks.check_int(sequence_length, "sequence_length", minimum=1)
    if sequence_length > _checks.INT32_MAX:
        raise ValueError(f"`sequence_length` must be at most 2**31 - 1 (segment ids and positions are int32). "
                         f"Received: sequence_length={sequence_length}")
    if not isinstance(long_documents, str) or long_documents not in LONG_DOCUMENTS:
        raise ValueError(f"`long_documents` must be one of {LONG_DOCUMENTS}. "
                         f"Received: long_documents={_checks.describe(long_documents)}")
    max_documents = _checks.check_int(max_documents_per_row, "max_documents_per_row", minimum=1, optional=True)
    if max_documents is None:
        max_documents = sequence_length
    if not (num_parallel_calls is None or num_parallel_calls == tf.data.AUTOTUNE
            or (_checks.is_int(num_parallel_calls) and num_parallel_calls >= 1)):
        raise ValueError("`num_parallel_calls` must be None, tf.data.AUTOTUNE or a positive int. "
                         f"Received: num_parallel_calls={_checks.describe(num_parallel_calls)}")
    token_spec, feature_specs = _element_specs(dataset.element_spec, token_key)
    pad_id = _check_pad_id(pad_id, token_spec.dtype)

    documents = _documents(dataset, token_key, feature_specs, num_parallel_calls)
    pieces = _pieces(documents, sequence_length, long_documents, num_parallel_calls)
    rows = pieces.scan(_empty_row(sequence_length, max_documents, token_spec.dtype, pad_id, feature_specs),
                       _packer(sequence_length, max_documents, token_spec.dtype, pad_id, feature_specs))
    rows = rows.filter(lambda finished, row: finished)
    return rows.map(lambda finished, row: _finish(row, sequence_length), num_parallel_calls=num_parallel_calls)


def _element_specs(spec, token_key):
    """(the TensorSpec of the tokens, {feature key: TensorSpec}) of the input's elements, checked."""
    if token_key is None:
        if isinstance(spec, dict):
            raise ValueError("`token_key` must name the tokens when the dataset's elements are dicts. "
                             f"Received: token_key=None with element keys {sorted(spec)}")
        token_spec, feature_specs = spec, {}
        where = "the dataset's elements"
    else:
        if not isinstance(spec, dict) or token_key not in spec:
            keys = sorted(spec) if isinstance(spec, dict) else None
            raise ValueError(f"`token_key` must be a key of the dataset's dict elements. Received: "
                             f"token_key={token_key!r} with " + (f"element keys {keys}" if keys is not None
                                                                 else f"element_spec={spec}"))
        feature_specs = {key: value for key, value in spec.items() if key != token_key}
        token_spec = spec[token_key]
        where = f"the dataset's `{token_key}` entries"
    token_spec = _dense_spec(token_spec)
    if token_spec is None or not token_spec.dtype.is_integer or token_spec.shape.rank not in (None, 1):
        raise ValueError(f"{where} must be 1-D integer tensors of token ids (dense: map ragged or sparse "
                         f"tokens to dense first). Received: element_spec={spec}")
    for key, feature in feature_specs.items():
        if key in _ROW_KEYS:
            raise ValueError(f"A per-document feature must not be named like an output of the packed rows "
                             f"{_ROW_KEYS}. Received: a feature named {key!r}")
        dense = _dense_spec(feature)
        if dense is None or not dense.shape.is_fully_defined():
            raise ValueError(f"Per-document feature {key!r} must be a dense tensor of a fixed shape (it is "
                             f"stacked into [max_documents_per_row, ...]). Received: {key!r} with spec {feature}")
        feature_specs[key] = dense
    return token_spec, feature_specs


def _dense_spec(spec):
    """The TensorSpec of a dense element, or None. `Dataset.from_tensor_slices` of a ragged tensor gives
    rows as RaggedTensorSpecs of ragged_rank 0: dense tensors, as the functions of `map` receive them."""
    if isinstance(spec, tf.TensorSpec):
        return spec
    if isinstance(spec, tf.RaggedTensorSpec) and spec.ragged_rank == 0:
        return tf.TensorSpec(spec.shape, spec.dtype)
    return None


def _check_pad_id(pad_id, dtype):
    info = np.iinfo(dtype.as_numpy_dtype)
    if not _checks.is_int(pad_id) or not info.min <= pad_id <= info.max:
        raise ValueError(f"`pad_id` must be an int that fits the tokens' dtype {dtype.name} "
                         f"([{info.min}, {info.max}]). Received: pad_id={_checks.describe(pad_id)}")
    return int(pad_id)


def _documents(dataset, token_key, feature_specs, num_parallel_calls):
    """The non-empty documents as (tokens [n], index in `dataset`, features, flush=False), followed by one
    flush marker (no tokens, flush=True) that makes the packing scan emit its last, open row."""
    def split_element(index, element):
        if token_key is None:
            tokens, features = element, {}
        else:
            features = {key: element[key] for key in feature_specs}
            tokens = element[token_key]
        # A token spec of unknown rank is checked here, when the data is seen.
        return tf.ensure_shape(tokens, [None]), index, features, tf.constant(False)

    documents = dataset.enumerate().map(split_element, num_parallel_calls=num_parallel_calls)
    documents = documents.filter(lambda tokens, index, features, flush: tf.size(tokens) > 0)
    token_dtype = documents.element_spec[0].dtype
    flush = tf.data.Dataset.from_tensors((
        tf.zeros([0], token_dtype), tf.constant(-1, tf.int64),
        {key: tf.zeros(spec.shape, spec.dtype) for key, spec in feature_specs.items()}, tf.constant(True)))
    return documents.concatenate(flush)


def _pieces(documents, sequence_length, long_documents, num_parallel_calls):
    """The documents cut (split) or cut short (truncate) to at most `sequence_length` tokens each."""
    if long_documents == "truncate":
        return documents.map(lambda tokens, index, features, flush: (tokens[:sequence_length], index, features,
                                                                     flush),
                             num_parallel_calls=num_parallel_calls)

    def split(tokens, index, features, flush):
        length = tf.size(tokens)
        # The flush marker (no tokens) stays one element.
        count = tf.maximum((length + sequence_length - 1) // sequence_length, 1)
        piece_lengths = tf.minimum(length - tf.range(count) * sequence_length, sequence_length)
        pieces = tf.RaggedTensor.from_row_lengths(tokens, piece_lengths)

        def repeat(value):
            return tf.repeat(value[tf.newaxis], count, axis=0)
        return pieces, repeat(index), tf.nest.map_structure(repeat, features), repeat(flush)

    # unbatch turns each document's [count, None] ragged pieces into `count` dense 1-D elements.
    return documents.map(split, num_parallel_calls=num_parallel_calls).unbatch()


def _empty_row(sequence_length, max_documents, token_dtype, pad_id, feature_specs):
    """The scan's state for a row with no document yet."""
    return {
        "token_ids": tf.fill([sequence_length], tf.constant(pad_id, token_dtype)),
        "used": tf.constant(0, tf.int32),  # tokens in the row
        "count": tf.constant(0, tf.int32),  # documents in the row
        "starts": tf.zeros([max_documents], tf.int32),  # where each document starts
        "document_ids": tf.fill([max_documents], tf.constant(-1, tf.int64)),
        "features": {key: tf.zeros([max_documents, *spec.shape], spec.dtype)
                     for key, spec in feature_specs.items()},
    }


def _packer(sequence_length, max_documents, token_dtype, pad_id, feature_specs):
    """The scan function: (open row, next piece) -> (new open row, (whether the old row is finished, old
    row)). Each step emits the old row; the filter after the scan keeps the finished ones."""
    def step(row, piece):
        tokens, index, features, flush = piece
        length = tf.size(tokens, out_type=tf.int32)
        fits = (row["used"] + length <= sequence_length) & (row["count"] < max_documents)
        finished = tf.where(flush, row["count"] > 0, tf.logical_not(fits))
        # A piece that does not fit starts an empty row (it always fits there: it is at most a row long).
        base = tf.cond(finished,
                       lambda: _empty_row(sequence_length, max_documents, token_dtype, pad_id, feature_specs),
                       lambda: row)
        offset, slot = base["used"], base["count"]
        # Scatters copy the row once and write only the piece, O(sequence_length + piece) per document.
        new_row = {
            "token_ids": tf.tensor_scatter_nd_update(base["token_ids"], (offset + tf.range(length))[:, None],
                                                     tokens),
            "used": offset + length,
            "count": slot + 1,
            "starts": tf.tensor_scatter_nd_update(base["starts"], [[slot]], [offset]),
            "document_ids": tf.tensor_scatter_nd_update(base["document_ids"], [[slot]], [index]),
            "features": {key: tf.tensor_scatter_nd_update(base["features"][key], [[slot]], value[tf.newaxis])
                         for key, value in features.items()},
        }
        return new_row, (finished, row)
    return step


def _finish(row, sequence_length):
    """A finished scan state -> the packed row's dict (segment ids and positions from the starts)."""
    count, used = row["count"], row["used"]
    index = tf.range(sequence_length, dtype=tf.int32)
    starts = row["starts"][:count]
    # A 1 at each document's start, summed along the row: the segment id of every token (1-based).
    marks = tf.scatter_nd(starts[:, tf.newaxis], tf.ones([count], tf.int32), [sequence_length])
    in_document = index < used
    segment_ids = tf.where(in_document, tf.cumsum(marks), 0)
    positions = tf.where(in_document, index - tf.gather(row["starts"], tf.maximum(segment_ids - 1, 0)), 0)
    return {"token_ids": row["token_ids"], "segment_ids": segment_ids, "positions": positions,
            "document_ids": row["document_ids"], **row["features"]}


# ----------------------------------------------------------------------------------------------------------
# Pooling per document
# ----------------------------------------------------------------------------------------------------------

def _pooling_inputs(x, segment_ids, num_segments, function):
    """Checked (x, num_segments, batch size, the flat slot [batch, length] of each token, the number of
    slots): the slot `total` collects the tokens that no segment pools."""
    x = _checks.to_tensor(x, "x")
    segment_ids = _checks.to_tensor(segment_ids, "segment_ids")
    num_segments = _checks.check_int(num_segments, "num_segments", minimum=1)
    if x.shape.rank != 3 or not x.dtype.is_floating:
        raise ValueError(f"`x` of {function} must be a float tensor [batch, length, features]. "
                         f"Received: x={_checks.describe(x)}")
    if segment_ids.shape.rank != 2 or not segment_ids.dtype.is_integer:
        raise ValueError(f"`segment_ids` of {function} must be an integer tensor [batch, length]. "
                         f"Received: segment_ids={_checks.describe(segment_ids)}")
    if not x.shape[:2].is_compatible_with(segment_ids.shape):
        raise ValueError(f"`segment_ids` must have the shape [batch, length] of `x`'s first two axes. "
                         f"Received: segment_ids={_checks.describe(segment_ids)} for x={_checks.describe(x)}")
    ids = tf.cast(segment_ids, tf.int32)
    # Static where known (always under XLA), so that the number of segments below is a compile-time constant.
    batch = x.shape[0] if x.shape[0] is not None else tf.shape(x)[0]
    total = batch * num_segments
    # Segment id s of row b is slot b * num_segments + s - 1 of one flat segment sum; padding (0) and ids
    # above num_segments go to one extra slot, `total`, that is dropped.
    valid = (ids >= 1) & (ids <= num_segments)
    flat = tf.where(valid, ids - 1 + tf.range(batch)[:, tf.newaxis] * num_segments, total)
    return x, num_segments, batch, flat, total


def segment_mean(x, segment_ids, num_segments):
    """The mean of `x` over the tokens of each segment (document) of each row.

    For rows packed by `pack_documents`: `segment_mean(hidden, row["segment_ids"], max_documents_per_row)`
    gives one vector per document, in the order of the per-document outputs (slot j = segment id j + 1),
    ready for a per-document classifier head. Shapes are static, so it works in `tf.function`, under XLA
    (`jit_compile=True`) and in Keras models.

    Args:
        x: float tensor `[batch, length, features]`.
        segment_ids: integer tensor `[batch, length]`: 1..num_segments for the tokens of segments, 0 for
            padding. Tokens with id 0 or above `num_segments` are ignored. The tokens of a segment need not
            be contiguous.
        num_segments: positive int, the number of segments pooled per row.

    Returns:
        `[batch, num_segments, features]` in the dtype of `x`: entry `[b, j]` is the mean of `x[b, t]` over
        the tokens t with `segment_ids[b, t] == j + 1`, or zeros where row b has no such token. float16 and
        bfloat16 inputs are summed in float32.

    Raises:
        ValueError: for inputs of the wrong rank or dtype, mismatched shapes, or `num_segments` below 1.
    """
    x, num_segments, batch, flat, total = _pooling_inputs(x, segment_ids, num_segments, "segment_mean")
    sum_dtype = tf.float32 if x.dtype in (tf.float16, tf.bfloat16) else x.dtype
    sums = tf.math.unsorted_segment_sum(tf.cast(x, sum_dtype), flat, total + 1)[:-1]
    counts = tf.math.unsorted_segment_sum(tf.ones_like(flat, sum_dtype), flat, total + 1)[:-1]
    means = sums / tf.maximum(counts, 1)[:, tf.newaxis]
    return tf.cast(tf.reshape(means, [batch, num_segments, tf.shape(x)[2]]), x.dtype)


def segment_first(x, segment_ids, num_segments):
    """`x` at the first token of each segment (document) of each row: the "[CLS] token" pooling.

    The arguments are those of `segment_mean`; so are the shapes (static, fine under XLA).

    Returns:
        `[batch, num_segments, features]` in the dtype of `x`: entry `[b, j]` is `x[b, t]` for the first
        token t with `segment_ids[b, t] == j + 1`, or zeros where row b has no such token.

    Raises:
        ValueError: for inputs of the wrong rank or dtype, mismatched shapes, or `num_segments` below 1.
    """
    x, num_segments, batch, flat, total = _pooling_inputs(x, segment_ids, num_segments, "segment_first")
    length = tf.shape(x)[1]
    token_index = tf.broadcast_to(tf.range(length)[tf.newaxis], tf.shape(flat))
    # The smallest token index of each segment; an absent segment gets int32's maximum.
    first = tf.reshape(tf.math.unsorted_segment_min(token_index, flat, total + 1)[:-1], [batch, num_segments])
    present = first < length
    pooled = tf.gather(x, tf.where(present, first, 0), batch_dims=1)
    return tf.where(present[..., tf.newaxis], pooled, tf.zeros([], x.dtype))
