"""Keras masks as op arguments, shared by the layers and the Keras hook: padding masks that are prefixes
become lengths (the kernel then skips the padding instead of reading a mask), and query rows that see no
key get Keras' value for them."""
import numpy as np
import tensorflow as tf

from tf_flash import _checks

NO_MASK_SHAPE = [0, 0, 0, 0]  # the op reads a mask of this shape as "no mask"


def absent_mask():
    return tf.zeros(NO_MASK_SHAPE, tf.bool)


def prefix_lengths(mask):
    """A bool padding mask [B, S] -> (lengths [B] int32, is_prefix scalar bool), decided in the graph.

    A mask is a prefix when every row is True up to its length and False after (padding at the end); then
    the lengths describe it exactly. Otherwise the lengths are the full length S (they hide nothing)."""
    size = tf.shape(mask)[1]
    lengths = tf.reduce_sum(tf.cast(mask, tf.int32), axis=1)
    is_prefix = tf.reduce_all(tf.equal(mask, tf.sequence_mask(lengths, size)))
    return tf.where(is_prefix, lengths, size), is_prefix


def key_padding(keys, mask):
    """A key padding mask, as `keys` [B, Sk] bool and as `mask`, the same broadcastable to
    [B, H, Sq, Sk] -> (attention_mask, kv_lengths) for the op. A prefix becomes kv_lengths alone; any other
    pattern goes in as the mask."""
    lengths, is_prefix = prefix_lengths(keys)
    if _checks.in_xla_context():
        # XLA needs static shapes (a cond between an absent and a present mask has none): the mask goes in
        # always, all True when it is a prefix (then the lengths alone do the work).
        return tf.logical_or(mask, is_prefix), lengths
    return tf.cond(is_prefix, absent_mask, lambda: mask), lengths


def fill_empty_rows(output, lse, value, masked_rows=None):
    """`output` [B, Sq, H, Dv] with Keras' value in the query rows that see no key: the mean of the values
    over all keys. Keras masks logits with a large negative number, not -inf, so such a row gets a uniform
    softmax (the op returns 0 there). The op's lse [B, H, Sq] (-inf) marks those rows; `masked_rows`,
    broadcastable to [B, Sq, 1, 1], adds rows to treat alike."""
    empty = tf.equal(tf.transpose(lse, [0, 2, 1]), -np.inf)[..., None]  # [B, Sq, H, 1]
    if masked_rows is not None:
        empty = tf.logical_or(empty, masked_rows)
    fill = tf.reduce_mean(tf.cast(value, tf.float32), axis=1, keepdims=True)  # [B, 1, Hkv, Dv]
    groups = output.shape[2] // value.shape[2]
    if groups > 1:
        fill = tf.repeat(fill, groups, axis=2)
    return tf.where(empty, tf.cast(fill, output.dtype), output)
