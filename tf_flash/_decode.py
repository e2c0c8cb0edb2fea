"""The decode path of `tf_flash.flash_attention`: few queries against a long KV cache.

The kernels give each (query tile, query head) one thread block that walks the whole key range, which suits
training shapes. With one new token per step that is a handful of blocks, each streaming a whole cache, and
each KV head read once per query head sharing it. Here the call is rearranged for the same kernels:
  - GQA packing: the `group` query heads of one KV head become rows of one query tile ([B, Sq * group, Hkv]),
    token by token, so each K/V byte is read once; several causal rows (new tokens, bottom-right) keep their
    diagonals through the op's position_shift (`group` rows share one position; a power of two);
  - split-KV ("flash decoding"): the key range is cut into `splits` chunks that become batch entries (a
    reshape of the cache, no copy), each with its own kv_lengths (the unused tail of the cache is empty and
    skipped), so that B * Hkv * splits blocks share the machine's memory bandwidth. Not under a causal mask
    over several rows: a chunk ahead of the last would need the diagonal of its place in the cache, which
    its own kv_lengths do not give;
  - the chunks' outputs merge by their lse (a log-sum-exp weighting in float32), under XLA too, with no
    host sync.
The result is the attention of the unsplit call (the chunks' outputs are rounded to the inputs' dtype before
the merge). Gradients flow through the merge and the op's lse.
"""
import tensorflow as tf

# The packed rows must fit one query tile of the kernels (128 rows in both GPU families).
_MAX_PACKED_ROWS = 128
# Keys below which the kernels' own grid already fills the machine.
_MIN_KEYS = 2048
# Thread blocks to aim for, about one wave of an H100's or H200's 132 SMs: one block streams its chunk at about
# 40 GB/s, so ~100 blocks reach the memory's speed, and more chunks only add merge work. The fewest keys a chunk
# keeps.
_TARGET_BLOCKS = 128
_MIN_CHUNK_KEYS = 1024
# Outside XLA the split's glue (the rearranging, the chunk lengths, the merge) runs as some 30 separate TF ops,
# about 250 us on a GPU, which the split repays only where each (batch, KV head) streams at least this many keys
# (at 40 GB/s, 32k keys of head dim 128 take ~400 us unsplit).
_MIN_KEYS_UNFUSED = 32768


def shares_positions(group):
    """Whether `group` packed rows can share one position in the kernels (a power of two above one)."""
    return group > 1 and group & (group - 1) == 0


def plan(batch, seqlen_q, seqlen_k, heads, heads_kv, *, plain, causal_rows=False, fused=True):
    """The number of key chunks for this static shape (1: pack the heads only), or None when the decode path
    does not apply: shapes unknown at trace time, more query rows than a tile, a short cache, or any feature
    beyond kv_lengths, bottom-right causal, scale and softcap (`plain` False). causal_rows: causal over
    several query rows, which packs the heads (where a power of two of them, above one, share a KV head:
    the kernels find a row's position by a shift) but splits nothing. fused: the call is traced for XLA,
    which fuses the glue around the kernel; outside it only long caches are split."""
    if not plain or None in (batch, seqlen_q, seqlen_k, heads, heads_kv) or batch == 0:
        return None
    group = heads // heads_kv
    if seqlen_q * group > _MAX_PACKED_ROWS or seqlen_k < _MIN_KEYS:
        return None
    if causal_rows:
        return 1 if shares_positions(group) else None
    if not fused and seqlen_k < _MIN_KEYS_UNFUSED:
        return 1
    wanted = max(1, -(-_TARGET_BLOCKS // (batch * heads_kv)))
    splits = 1
    for candidate in range(2, wanted + 1):  # the largest divisor of seqlen_k up to `wanted`, chunks not too short
        if seqlen_k % candidate == 0 and seqlen_k // candidate >= _MIN_CHUNK_KEYS:
            splits = candidate
    return splits


def attend(attention, query, key, value, kv_lengths, splits):
    """attention(q, k, v, kv_lengths, rows_per_position) -> (out, lse), the op on the rearranged call (the
    packed rows share positions in groups of rows_per_position, the number of query heads per KV head);
    returns (out, lse) of the original one. query [B, Sq, H, D], key/value [B, Sk, Hkv, D/Dv], kv_lengths
    int32 [B] or None."""
    batch, seqlen_q, heads, head_dim = query.shape
    seqlen_k, heads_kv, head_dim_v = key.shape[1], key.shape[2], value.shape[3]
    group, chunk = heads // heads_kv, seqlen_k // splits
    rows = seqlen_q * group
    # Query head h reads KV head h // group: rows (s, j) of KV head g hold query head g * group + j at s.
    packed = tf.reshape(tf.transpose(tf.reshape(query, [batch, seqlen_q, heads_kv, group, head_dim]),
                                     [0, 1, 3, 2, 4]), [batch, rows, heads_kv, head_dim])
    packed = tf.repeat(packed, splits, axis=0)  # [B * splits, rows, Hkv, D]: entry b * splits + c is chunk c
    keys = tf.reshape(key, [batch * splits, chunk, heads_kv, head_dim])
    values = tf.reshape(value, [batch * splits, chunk, heads_kv, head_dim_v])
    lengths = tf.fill([batch], seqlen_k) if kv_lengths is None else tf.cast(kv_lengths, tf.int32)
    starts = tf.range(splits, dtype=tf.int32) * chunk
    chunk_lengths = tf.reshape(tf.clip_by_value(lengths[:, None] - starts[None, :], 0, chunk), [-1])
    out, lse = attention(packed, keys, values, chunk_lengths, group)
    if splits > 1:
        lse = tf.reshape(lse, [batch, splits, heads_kv, rows])
        total = tf.reduce_logsumexp(lse, axis=1)  # -inf where no chunk sees a key
        seen = tf.math.is_finite(total)
        weights = tf.where(seen[:, None], tf.exp(lse - tf.where(seen, total, 0.0)[:, None]), 0.0)
        out = tf.reshape(tf.cast(out, tf.float32), [batch, splits, rows, heads_kv, head_dim_v])
        out = tf.reduce_sum(out * tf.transpose(weights, [0, 1, 3, 2])[..., None], axis=1)
        out, lse = tf.cast(out, query.dtype), total
    out = tf.reshape(tf.transpose(tf.reshape(out, [batch, seqlen_q, group, heads_kv, head_dim_v]),
                                  [0, 1, 3, 2, 4]), [batch, seqlen_q, heads, head_dim_v])
    lse = tf.reshape(tf.transpose(tf.reshape(lse, [batch, heads_kv, seqlen_q, group]), [0, 1, 3, 2]),
                     [batch, heads, seqlen_q])
    return out, lse
