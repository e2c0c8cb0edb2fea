"""The decode path of `tf_flash.flash_attention`: few queries against a long KV cache.

The kernels give each (query tile, query head) one thread block that walks the whole key range, which suits
training shapes. With one new token per step that is a handful of blocks, each streaming a whole cache, and
each KV head read once per query head sharing it. Here the call is rearranged for the same kernels:
  - GQA packing: the `group` query heads of one KV head become rows of one query tile ([B, Sq * group, Hkv]),
    token by token, so each K/V byte is read once; several causal rows (new tokens, bottom-right) keep their
    diagonals through the op's position_shift (`group` rows share one position; a power of two);
  - split-KV ("flash decoding"): the op's num_splits cuts the visible key tiles of each (batch, KV head) into
    `splits` runs, thread blocks of their own, so that B * Hkv * splits blocks share the memory's bandwidth.
    The kernels merge the runs by their lse in float32 (cc/kernels/flash/split_kv.h), after the runs' outputs
    are rounded to the inputs' dtype; under XLA with no host sync and no ops around the kernel but the
    packing. Each entry's runs share its own keys (kv_lengths), so the unused tail of the cache is never read.
A key mask ([B|1, 1, 1, Sk]: a padding or cache mask) is one row for every query row and head, so it goes to
the packed call as it is, and the runs read its bits by the keys' places. Gradients flow through the packing
and the op's lse.
"""
import tensorflow as tf

# The packed rows must fit one query tile of the kernels (128 rows in both GPU families).
_MAX_PACKED_ROWS = 128
# Keys below which the kernels' own grid already fills the machine.
_MIN_KEYS = 2048
# Thread blocks to aim for, about one wave of an H100's or H200's 132 SMs: one block streams its run at about
# 40 GB/s, so ~100 blocks reach the memory's speed. The fewest keys a run keeps.
_TARGET_BLOCKS = 128
_MIN_SPLIT_KEYS = 1024


def shares_positions(group):
    """Whether `group` packed rows can share one position in the kernels (a power of two; 1: no packing)."""
    return group >= 1 and group & (group - 1) == 0


def is_key_mask(mask):
    """Whether a rank-4 attention mask is one row of keys per batch entry ([B|1, 1, 1, Sk], statically), which
    the packed rows share as they are."""
    return mask.shape.rank == 4 and mask.shape[1] == 1 and mask.shape[2] == 1 and mask.shape[3] != 0


def plan(batch, seqlen_q, seqlen_k, heads, heads_kv, *, plain, causal_rows=False):
    """The number of key runs (the op's num_splits) for this static shape (1: pack the heads only), or None when
    the decode path does not apply: shapes unknown at trace time, more query rows than a tile, a short cache,
    or any feature beyond kv_lengths, a key mask (is_key_mask), bottom-right causal, scale and softcap
    (`plain` False). causal_rows: causal over several query rows, which packs the heads only where a power
    of two of them share a KV head (the kernels find a row's position by a shift; 1: none to pack)."""
    if not plain or None in (batch, seqlen_q, seqlen_k, heads, heads_kv) or batch == 0:
        return None
    group = heads // heads_kv
    if seqlen_q * group > _MAX_PACKED_ROWS or seqlen_k < _MIN_KEYS:
        return None
    if causal_rows and not shares_positions(group):
        return None
    wanted = -(-_TARGET_BLOCKS // (batch * heads_kv))
    return max(1, min(wanted, seqlen_k // _MIN_SPLIT_KEYS))


def attend(attention, query, heads_kv):
    """attention(packed query, rows_per_position) -> (out, lse), the op on the packed call (its rows share
    positions in groups of rows_per_position, the number of query heads per KV head; key and value as they
    are); returns (out, lse) of the original one. query [B, Sq, H, D]."""
    batch, seqlen_q, heads, head_dim = query.shape
    group = heads // heads_kv
    rows = seqlen_q * group
    # Query head h reads KV head h // group: rows (s, j) of KV head g hold query head g * group + j at s.
    packed = tf.reshape(tf.transpose(tf.reshape(query, [batch, seqlen_q, heads_kv, group, head_dim]),
                                     [0, 1, 3, 2, 4]), [batch, rows, heads_kv, head_dim])
    out, lse = attention(packed, group)
    head_dim_v = out.shape[3]
    out = tf.reshape(tf.transpose(tf.reshape(out, [batch, seqlen_q, group, heads_kv, head_dim_v]),
                                  [0, 1, 3, 2, 4]), [batch, seqlen_q, heads, head_dim_v])
    lse = tf.reshape(tf.transpose(tf.reshape(lse, [batch, heads_kv, seqlen_q, group]), [0, 1, 3, 2]),
                     [batch, heads, seqlen_q])
    return out, lse
