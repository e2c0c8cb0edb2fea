"""`tf_flash.parallel`: context parallelism on `tf.distribute`, attention over a sequence split across the
replicas of a strategy (`MirroredStrategy` on one host, `MultiWorkerMirroredStrategy` across hosts).

Inside the replica function every replica holds a shard [B, S/n, ...] of each sequence tensor. The layout
(how the sequence is cut) is defined once, here: the sequence is cut into equal chunks, and

  - "zigzag": 2n chunks; replica r holds chunks r and 2n-1-r, in that order. Under a causal mask the
    early chunk sees few keys and the late chunk many, so every replica gets the same work.
  - "contiguous": n chunks; replica r holds chunk r.

`context_parallel_attention` all-gathers K and V (every replica then holds the whole key sequence) and
runs the flash kernel on each local query chunk against all the keys, with the chunk's position in the
sequence given to the kernel (its causal diagonal, window and dropout draws are those of the unsharded
call, and the key tiles beyond its diagonal are skipped). The backward sums each replica's dK and dV over
the replicas and keeps its own shard (a reduce-scatter). docs/parallel.md says why all-gather, not a ring.
"""
import tensorflow as tf

from tf_flash import _checks
from tf_flash import ops as _flash_ops

__all__ = ["LAYOUTS", "chunks_of", "shard_sequence", "unshard_sequence", "context_parallel_attention",
           "in_replica_context"]

LAYOUTS = ("zigzag", "contiguous")

# The keywords of tf_flash.flash_attention that context_parallel_attention passes on (causal is its own).
_FLASH_KEYWORDS = ("window", "q_lengths", "kv_lengths", "attention_mask", "block_mask", "block_size",
                   "dropout_rate", "seed", "scale", "softcap", "deterministic", "return_lse")


def _replica(function):
    """(replica context, number of replicas, this replica's id as a Python int)."""
    ctx = tf.distribute.get_replica_context()
    if ctx is None:
        raise ValueError(f"tf_flash.parallel.{function} runs inside a replica context (the function given to "
                         "`strategy.run`, or a model called by Keras `fit` under a strategy). Received: a "
                         "cross-replica context (inside `strategy.scope()`, outside `strategy.run`).")
    replica = tf.get_static_value(ctx.replica_id_in_sync_group)
    if replica is None:
        raise ValueError(f"tf_flash.parallel.{function} needs the replica id when the function is traced (it "
                         "places the shard in the sequence); MirroredStrategy and MultiWorkerMirroredStrategy "
                         f"give it. Received: replica_id_in_sync_group={ctx.replica_id_in_sync_group!r}")
    return ctx, int(ctx.num_replicas_in_sync), int(replica)


def _check_layout(layout):
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(f"`layout` must be one of {LAYOUTS}. Received: layout={_checks.describe(layout)}")
    return layout


def chunks_of(layout, replicas, replica):
    """(the chunks replica `replica` holds, in the order of its shard; the number of chunks of the
    sequence): the layout's one definition."""
    _check_layout(layout)
    if layout == "zigzag":
        return (replica, 2 * replicas - 1 - replica), 2 * replicas
    return (replica,), replicas


def _gathered_chunks(layout, replicas):
    """The chunk at each position of the replicas' shards concatenated in replica order."""
    return [chunk for replica in range(replicas) for chunk in chunks_of(layout, replicas, replica)[0]]


def _check_axis(axis, tensor, name):
    rank = tensor.shape.rank
    if not _checks.is_int(axis) or (rank is not None and not -rank <= axis < rank):
        raise ValueError(f"`axis` must be an int naming an axis of `{name}` (rank {rank}). "
                         f"Received: axis={_checks.describe(axis)}")
    if axis < 0:
        if rank is None:
            raise ValueError(f"A negative `axis` needs the rank of `{name}` to be known. Received: axis={axis}")
        axis += rank
    return int(axis)


def _natural_order(gathered, layout, replicas, axis):
    """The replicas' shards concatenated in replica order -> the sequence in its order."""
    order = _gathered_chunks(layout, replicas)
    if order == sorted(order):
        return gathered
    pieces = tf.split(gathered, len(order), axis=axis)
    position = {chunk: index for index, chunk in enumerate(order)}
    return tf.concat([pieces[position[chunk]] for chunk in range(len(order))], axis)


def _all_gather(ctx, replicas, replica, tensors, axis):
    """Each tensor's shards of every replica, concatenated along `axis` in replica order. The gradient is a
    reduce-scatter written as the replica context offers it: an all-reduce (sum) of the gathered gradients,
    then this replica's slice (every shard has the same size). TF's own all_gather gradient does the same
    with an extra all-gather of the shard sizes before the slice.

    TF's collectives take no bfloat16: bfloat16 shards travel as the float16 of the same bits (a gather
    copies, it never computes), and their gradients are summed in float32."""
    dtypes = [t.dtype for t in tensors]

    @tf.custom_gradient
    def gather(*shards):
        def grad(*d_gathered):
            wide = [tf.cast(d, tf.float32) if d.dtype == tf.bfloat16 else d for d in d_gathered]
            summed = ctx.all_reduce(tf.distribute.ReduceOp.SUM, wide)
            return [tf.cast(tf.split(d, replicas, axis=axis)[replica], dtype) for d, dtype in zip(summed, dtypes)]

        sent = [tf.bitcast(s, tf.float16) if s.dtype == tf.bfloat16 else s for s in shards]
        gathered = ctx.all_gather(sent, axis=axis)
        return [tf.bitcast(g, tf.bfloat16) if dtype == tf.bfloat16 else g for g, dtype in zip(gathered, dtypes)], grad

    return gather(*tensors)


def _sequence_split(x, name, layout, axis, function):
    """What shard_sequence and unshard_sequence start from: `x` as a tensor, its checked axis, the replica
    context, the number of replicas, this replica's id, its chunks and the number of chunks under `layout`
    (None, None with one replica), and the length along `axis` where the shape knows it."""
    _check_layout(layout)
    x = _checks.to_tensor(x, name)
    axis = _check_axis(axis, x, name)
    ctx, replicas, replica = _replica(function)
    chunks, count = chunks_of(layout, replicas, replica) if replicas > 1 else (None, None)
    length = x.shape[axis] if x.shape.rank is not None else None
    return x, axis, ctx, replicas, replica, chunks, count, length


def shard_sequence(x, layout="zigzag", axis=1):
    """Inside a replica context, this replica's shard of `x`, a tensor holding the whole sequence along
    `axis` (the same on every replica): the chunks the layout gives this replica, concatenated. The length
    along `axis` must be a multiple of the number of chunks (2n for "zigzag", n for "contiguous").
    Differentiable: the gradient is zero outside this replica's chunks (summing over replicas, as the
    strategy does for variables, gives the whole gradient)."""
    x, axis, _, replicas, _, chunks, count, length = _sequence_split(x, "x", layout, axis, "shard_sequence")
    if replicas == 1:
        return x
    if length is not None and length % count:
        raise ValueError(f"The sequence length (axis {axis} of `x`) must be a multiple of the number of chunks, "
                         f"{count} for layout={layout!r} over {replicas} replicas. Received: x.shape={x.shape}")
    pieces = tf.split(x, count, axis=axis)
    return tf.concat([pieces[chunk] for chunk in chunks], axis) if len(chunks) > 1 else pieces[chunks[0]]


def unshard_sequence(x_shard, layout="zigzag", axis=1):
    """Inside a replica context, the whole sequence gathered from every replica's shard (made by
    `shard_sequence` with the same layout), in sequence order, on every replica. Differentiable: the
    gradient sums the replicas' gradients and keeps this replica's shard."""
    x_shard, axis, ctx, replicas, replica, chunks, _, length = _sequence_split(
        x_shard, "x_shard", layout, axis, "unshard_sequence")
    if replicas == 1:
        return x_shard
    if length is not None and length % len(chunks):
        raise ValueError(f"A {layout!r} shard holds {len(chunks)} chunks of equal length: its length (axis "
                         f"{axis} of `x_shard`) must be a multiple of {len(chunks)}. "
                         f"Received: x_shard.shape={x_shard.shape}")
    if x_shard.dtype == tf.bool:  # collectives move numbers
        return tf.cast(unshard_sequence(tf.cast(x_shard, tf.int32), layout, axis), tf.bool)
    if x_shard.dtype.is_floating:
        (gathered,) = _all_gather(ctx, replicas, replica, [x_shard], axis)
    else:
        gathered = ctx.all_gather(x_shard, axis=axis)
    return _natural_order(gathered, layout, replicas, axis)


def _rows_of_chunk(mask, offset, rows, name):
    """`mask` (axis -2: the query rows of the whole sequence, 1 to broadcast, or 0 in the op's "absent"
    [0, 0, 0, 0]) cut to rows [offset, offset + rows)."""
    mask = _checks.to_tensor(mask, name)
    if mask.shape.rank is None or mask.shape.rank < 2:
        raise ValueError(f"`{name}` must have a known rank of 2 to 4 under context parallelism. "
                         f"Received: {name}.shape={mask.shape}")
    size = mask.shape[-2]
    if size in (0, 1):
        return mask
    if size is not None:
        return mask[..., offset:offset + rows, :]
    rank = mask.shape.rank
    whole = tf.shape(mask)[-2] <= 1
    begin = tf.concat([tf.zeros([rank - 2], tf.int32), [tf.where(whole, 0, offset), 0]], 0)
    size = tf.concat([tf.fill([rank - 2], -1), [tf.where(whole, -1, rows), -1]], 0)
    return tf.slice(mask, begin, size)


def context_parallel_attention(query, key, value, *, causal=False, layout="zigzag", **flash_kwargs):
    """Attention over a sequence sharded across the replicas of a `tf.distribute` strategy.

    Called inside the replica function on this replica's shards (made by `shard_sequence` with the same
    `layout`), it returns this replica's shard of the output of `tf_flash.flash_attention` over the whole
    sequence, with gradients to the three shards. Self-attention: query, key and value shards hold the
    same positions.

    Args:
      query: [B, S/n, H, D]; key: [B, S/n, Hkv, D]; value: [B, S/n, Hkv, Dv] (GQA as in flash_attention).
        S/n must be known when the function is traced; with "zigzag" it is two chunks of S/(2n).
      causal: position i sees positions j <= i of the whole sequence.
      layout: "zigzag" (balanced under a causal mask) or "contiguous"; see `shard_sequence`.
      **flash_kwargs: the keywords of `tf_flash.flash_attention`, over the whole sequence:
        window; q_lengths and kv_lengths (valid prefixes of the whole sequence, the same on every replica);
        attention_mask (broadcastable to [B, H, S, S]) and block_mask ([.., S/bq, S/bk], the chunk length
        S/(2n) or S/n a multiple of bq), the same on every replica; dropout_rate with `seed` an int or an
        int64 [2] tensor of the same value on every replica (the dropout mask is the unsharded call's;
        the chunk length must be a multiple of 16); scale, softcap, deterministic; return_lse (this
        replica's rows of lse, [B, H, S/n]).

    Returns:
      This replica's output shard [B, S/n, H, Dv] (and its lse [B, H, S/n] with return_lse).
    """
    unknown = sorted(set(flash_kwargs) - set(_FLASH_KEYWORDS))
    if unknown:
        raise TypeError(f"context_parallel_attention() got unexpected keyword arguments {unknown}; it takes "
                        "`causal`, `layout` and these keywords of tf_flash.flash_attention: "
                        f"{list(_FLASH_KEYWORDS)}")
    _check_layout(layout)
    ctx, replicas, replica = _replica("context_parallel_attention")
    if replicas == 1:
        return _flash_ops.flash_attention(query, key, value, causal=causal, **flash_kwargs)
    query = _checks.to_tensor(query, "query")
    key = _checks.to_tensor(key, "key", dtype_hint=query.dtype)
    value = _checks.to_tensor(value, "value", dtype_hint=query.dtype)
    causal = _checks.check_bool(causal, "causal")
    return_lse = _checks.check_bool(flash_kwargs.pop("return_lse", False), "return_lse")
    shapes = f"Received: query.shape={query.shape}, key.shape={key.shape}, value.shape={value.shape}"
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        if tensor.shape.rank != 4:
            raise ValueError(f"`{name}` must have rank 4 [batch, seq shard, heads, dim]. {shapes}")
    shard_length = query.shape[1]
    if shard_length is None:
        raise ValueError("The shard length (axis 1 of `query`) must be known when the function is traced: it "
                         f"places the chunks in the sequence. {shapes}")
    if key.shape[1] not in (None, shard_length) or value.shape[1] not in (None, shard_length):
        raise ValueError(f"`query`, `key` and `value` must be shards of the same sequence (the same length on "
                         f"axis 1). {shapes}")
    chunks, count = chunks_of(layout, replicas, replica)
    if shard_length % len(chunks):
        raise ValueError(f"A {layout!r} shard holds {len(chunks)} chunks of equal length: the shard length must "
                         f"be a multiple of {len(chunks)}. {shapes}")
    chunk_length = shard_length // len(chunks)
    sequence_length = chunk_length * count

    dropout_rate = _checks.check_rate(flash_kwargs.get("dropout_rate", 0.0), "dropout_rate")
    if dropout_rate > 0:
        if chunk_length % 16:
            raise ValueError("With dropout the chunk length (the sequence length over the number of chunks, "
                             f"{count} for layout={layout!r}) must be a multiple of 16: dropout draws rows in "
                             f"blocks of 16. Received: chunk length {chunk_length} (query.shape={query.shape})")
        if flash_kwargs.get("seed") is None:
            raise ValueError("With dropout, `seed` must be given (an int, or an int64 [2] tensor of the same value "
                             "on every replica): replicas drawing their own would drop different entries than "
                             "the unsharded call. Received: seed=None")
    batch = _checks.axis_size(query, 0)
    q_lengths = _checks.check_lengths(flash_kwargs.pop("q_lengths", None), "q_lengths", batch,
                                      _checks.Size(sequence_length, None))
    flash_kwargs["kv_lengths"] = _checks.check_lengths(flash_kwargs.get("kv_lengths"), "kv_lengths", batch,
                                                       _checks.Size(sequence_length, None))
    attention_mask = flash_kwargs.pop("attention_mask", None)
    block_mask = flash_kwargs.pop("block_mask", None)
    block_q, _ = _checks.normalize_block_size(flash_kwargs.get("block_size", 128))
    if block_mask is not None and chunk_length % block_q:
        raise ValueError("With a block_mask the chunk length must be a multiple of the query block size: each "
                         "replica's chunks take whole rows of block_mask. Received: chunk length "
                         f"{chunk_length} (query.shape={query.shape}, layout={layout!r}), "
                         f"block_size={flash_kwargs.get('block_size', 128)!r}")

    # Key columns are the sequence's positions wherever some rule reads them.
    ordered = (causal or flash_kwargs.get("window") is not None or flash_kwargs["kv_lengths"] is not None
               or dropout_rate > 0 or attention_mask is not None or block_mask is not None)
    key_all, value_all = _all_gather(ctx, replicas, replica, [key, value], axis=1)
    if ordered:
        key_all = _natural_order(key_all, layout, replicas, axis=1)
        value_all = _natural_order(value_all, layout, replicas, axis=1)

    outputs, lses = [], []
    for index, chunk in enumerate(chunks):
        offset = chunk * chunk_length
        kwargs = dict(flash_kwargs)
        if q_lengths is not None:
            kwargs["q_lengths"] = tf.clip_by_value(q_lengths - offset, 0, chunk_length)
        if attention_mask is not None:
            kwargs["attention_mask"] = _rows_of_chunk(attention_mask, offset, chunk_length, "attention_mask")
        if block_mask is not None:
            kwargs["block_mask"] = _rows_of_chunk(block_mask, offset // block_q, chunk_length // block_q,
                                                  "block_mask")
        rows = query[:, index * chunk_length:(index + 1) * chunk_length]
        output, lse = _flash_ops._flash_attention(rows, key_all, value_all, causal=causal, return_lse=True,
                                                  query_offset=offset, **kwargs)
        outputs.append(output)
        lses.append(lse)
    output = tf.concat(outputs, 1) if len(outputs) > 1 else outputs[0]
    if not return_lse:
        return output
    return output, (tf.concat(lses, 2) if len(lses) > 1 else lses[0])


def in_replica_context():
    """True inside the replica function of a strategy with more than one replica: where the layers'
    `context_parallel=True` takes effect."""
    ctx = tf.distribute.get_replica_context()
    return ctx is not None and ctx.num_replicas_in_sync > 1


def _attend_shards(query, key, value, *, query_mask=None, kv_mask=None, attention_mask=None, causal=False,
                   window=None, block_mask=None, block_size=128, dropout_rate=0.0, seed=None, scale=None,
                   softcap=None, deterministic=None, empty_rows="zeros", layout="zigzag"):
    """tf_flash.layers' attention (layers/_common.attend) on sequence shards [B, S/n, H, D]: the Keras
    padding masks of the shards [B, S/n] are gathered into masks of the whole sequence, whose prefixes
    become lengths; a query row that sees no key gets zeros, or with empty_rows="mean" the mean of the
    values of the whole sequence."""
    from tf_flash import _masks  # pylint: disable=import-outside-toplevel

    if attention_mask is not None:
        raise ValueError("With context parallelism the layers take Keras padding masks (query_mask, value_mask, "
                         "key_mask), not an attention_mask over the shards. Received: "
                         f"attention_mask={_checks.describe(attention_mask)}")
    q_lengths = kv_lengths = None
    if query_mask is not None:
        q_lengths, _ = _masks.prefix_lengths(unshard_sequence(query_mask, layout))
    if kv_mask is not None:
        keys = unshard_sequence(kv_mask, layout)
        attention_mask, kv_lengths = _masks.key_padding(keys, keys[:, None, None, :])
    output, lse = context_parallel_attention(
        query, key, value, causal=causal, layout=layout, window=window, q_lengths=q_lengths,
        kv_lengths=kv_lengths, attention_mask=attention_mask, block_mask=block_mask, block_size=block_size,
        dropout_rate=dropout_rate, seed=seed, scale=scale, softcap=softcap, deterministic=deterministic,
        return_lse=True)
    may_have_empty_rows = any(arg is not None for arg in (query_mask, kv_mask, window, block_mask))
    if empty_rows == "mean" and may_have_empty_rows:
        ctx, replicas, _ = _replica("context_parallel_attention")
        total = ctx.all_reduce(tf.distribute.ReduceOp.SUM,
                               tf.reduce_sum(tf.cast(value, tf.float32), axis=1, keepdims=True))
        mean = total / float(value.shape[1] * replicas)  # fill_empty_rows takes the mean over axis 1: of one row
        masked_rows = None if query_mask is None else tf.logical_not(query_mask)[:, :, None, None]
        return _masks.fill_empty_rows(output, lse, mean, masked_rows)
    if query_mask is not None:
        output = tf.where(query_mask[:, :, None, None], output, tf.zeros([], output.dtype))
    return output
