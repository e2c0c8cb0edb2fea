"""Shared pieces of the Keras layers: argument checks, Keras masks to op arguments, explicit scores."""
import numbers

import numpy as np
import tensorflow as tf

from tf_flash import ops as _flash_ops

# Keras' masked softmax fills masked logits with a large negative number, not -inf, so that a row
# with nothing visible stays finite; the explicit scores path does the same.
_LARGE_NEGATIVE = -1e9


# An int that is not a bool: the op module's test, so the layers and the op accept the same values.
is_int = _flash_ops._is_int
Size = _flash_ops.Size


def check_dropout(dropout):
    if not isinstance(dropout, numbers.Real) or isinstance(dropout, bool) or not 0.0 <= dropout < 1.0:
        raise ValueError(f"`dropout` must be a float in [0, 1). Received: dropout={dropout!r}")
    return float(dropout)


def check_seed(seed):
    if seed is not None and not is_int(seed):
        raise ValueError(f"`seed` must be an int or None. Received: seed={seed!r}")
    return seed


def check_window(window):
    """None, an int w (symmetric: i sees i-w .. i+w) or (left, right) with None = unlimited."""
    return None if window is None else _flash_ops.normalize_window(window)


def check_block_size(block_size):
    block_q, block_k = _flash_ops.normalize_block_size(block_size)
    return block_q if is_int(block_size) else (block_q, block_k)


def check_block_mask(block_mask):
    """A static block pattern ([nqb, nkb], [H, nqb, nkb] or [B, H, nqb, nkb]) as a NumPy bool array."""
    if block_mask is None:
        return None
    try:
        array = np.asarray(block_mask)
    except Exception as err:  # pylint: disable=broad-except
        raise ValueError(f"`block_mask` must be array-like. Received: block_mask={block_mask!r}") from err
    if array.dtype != bool or not 2 <= array.ndim <= 4:
        raise ValueError("`block_mask` must be a bool array of rank 2 to 4 ([nqb, nkb], [H, nqb, nkb] or "
                         f"[B, H, nqb, nkb]). Received: block_mask with dtype {array.dtype} and shape "
                         f"{array.shape}")
    return array


def block_mask_to_config(block_mask):
    return None if block_mask is None else block_mask.tolist()


def to_bool(mask, name="mask"):
    """A Keras mask (bool, or numbers where nonzero = keep) as a bool tensor; anything else is refused."""
    original = mask
    mask = _flash_ops._to_tensor(mask, name)
    if mask.dtype == tf.bool:
        return mask
    if not (mask.dtype.is_integer or mask.dtype.is_floating):
        raise ValueError(f"`{name}` must be a bool (or numeric, nonzero = keep) tensor. Received: {name} of "
                         f"dtype {mask.dtype.name} ({name}={_flash_ops._describe(original)})")
    return tf.cast(mask, tf.bool)


def and_masks(first, second):
    """AND of two optional bool masks (None = absent)."""
    if first is None:
        return second
    if second is None:
        return first
    return tf.logical_and(first, second)


def check_padding_mask(mask, name, batch, seqlen):
    """A Keras padding mask [batch, seq] (None passes) as bool, its shape checked: its errors name it,
    not the lengths or attention_mask it becomes. batch, seqlen: Sizes (dim())."""
    if mask is None:
        return None
    mask = to_bool(mask, name)
    if mask.shape.rank is not None and mask.shape.rank != 2:
        raise ValueError(f"`{name}` must have shape [batch, seq] (a Keras padding mask). "
                         f"Received: {name}.shape={mask.shape}")
    if mask.shape.rank is None:
        mask = tf.ensure_shape(
            _flash_ops._checked(mask, tf.equal(tf.rank(mask), 2),
                                f"`{name}` must have shape [batch, seq] (a Keras padding mask). Received: "
                                f"{name}.shape=", tf.shape(mask)), [None, None])
    return _flash_ops.check_dims(mask, name, (batch, seqlen), "[batch, seq]")


def expand_attention_mask(mask, batch, heads, seqlen_q, seqlen_k):
    """A Keras-style attention mask ([Sq, Sk], [B, Sq, Sk] or [B, H, Sq, Sk]) as rank 4, its shape checked
    (each axis the full size or 1). batch, heads, seqlen_q, seqlen_k: Sizes (dim()).

    Missing axes are inserted before the query axis, as Keras' MultiHeadAttention broadcasts them
    (a rank-3 mask is [B, Sq, Sk], not [H, Sq, Sk]).
    """
    mask = to_bool(mask, "attention_mask")
    rank = mask.shape.rank
    if rank is None or not 2 <= rank <= 4:
        raise ValueError("`attention_mask` must have rank 2 ([Sq, Sk]), 3 ([B, Sq, Sk]) or 4 "
                         f"([B, H, Sq, Sk]). Received: attention_mask.shape={mask.shape}")
    layout = {2: ("[seq_q, seq_k]", (seqlen_q, seqlen_k)), 3: ("[batch, seq_q, seq_k]", (batch, seqlen_q, seqlen_k)),
              4: ("[batch, heads, seq_q, seq_k]", (batch, heads, seqlen_q, seqlen_k))}
    what, expected = layout[rank]
    mask = _flash_ops.check_dims(mask, "attention_mask", expected, what, broadcast=True)
    while mask.shape.rank < 4:
        mask = tf.expand_dims(mask, axis=-3)
    return mask


def check_lengths(lengths, name, batch, seqlen):
    """User lengths [batch] in [0, seq] as int32, checked at run time too: the layer turns them into masks,
    which no kernel checks."""
    return _flash_ops.check_lengths(lengths, name, batch, seqlen, runtime_range_check=True)


def dim(tensor, axis):
    """The Size (static int or None, tensor() on demand) of one axis of `tensor`."""
    return _flash_ops.axis_size(tensor, axis)


def check_bool_or_none(value, name):
    if value is not None and not _flash_ops._is_bool(value):
        raise ValueError(f"`{name}` must be a bool or None. Received: {name}={_flash_ops._describe(value)}")
    return None if value is None else bool(value)


def padding_lengths(mask):
    """[B, S] padding mask -> (lengths [B] int32, is_prefix scalar bool), decided in the graph.

    A mask is a prefix when every row is True up to its length and False after (padding at the end);
    then the lengths describe it exactly. Otherwise the lengths returned are the full length S.
    """
    mask = to_bool(mask)
    size = tf.shape(mask)[1]
    lengths = tf.reduce_sum(tf.cast(mask, tf.int32), axis=1)
    is_prefix = tf.reduce_all(tf.equal(mask, tf.sequence_mask(lengths, size)))
    return tf.where(is_prefix, lengths, size), is_prefix


def check_scale(scale):
    """None (1/sqrt(head dim)) or a finite float >= 0 (the check of tf_flash.flash_attention)."""
    return None if scale is None else _flash_ops.normalize_scale(scale)


def check_softcap(softcap):
    """None (off) or a positive finite number (the check of tf_flash.flash_attention)."""
    value = _flash_ops.normalize_softcap(softcap)
    return None if value == 0.0 else value


def _in_xla_context():
    """Whether the call is being traced for XLA (tf.function(jit_compile=True), Keras jit_compile)."""
    try:
        from tensorflow.python.ops import control_flow_util  # pylint: disable=import-outside-toplevel
        return bool(control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()))
    except Exception:  # pylint: disable=broad-except  (private TF API: fall back to the static form)
        return True


def check_deterministic(deterministic):
    if deterministic is not None and not isinstance(deterministic, bool):
        raise ValueError(f"`deterministic` must be None or a bool. Received: deterministic={deterministic!r}")
    return deterministic


def _empty_mask():
    return tf.zeros([0, 0, 0, 0], tf.bool)


def attend(query, key, value, *, query_mask=None, kv_mask=None, attention_mask=None, causal=False,
           window=None, block_mask=None, block_size=128, dropout_rate=0.0, seed=None, scale=None,
           softcap=None, deterministic=None, empty_rows="zeros"):
    """flash_attention on [B, S, H, D] heads with Keras padding masks.

    query_mask [B, Sq] / kv_mask [B, Sk]: prefix masks become q_lengths / kv_lengths (the kernel
    skips the padding); any other pattern goes through the general attention_mask path (kv) or is
    applied to the output rows (query). attention_mask must already be rank 4.

    empty_rows: what a query row that sees no key (or is masked out by query_mask) returns:
    "zeros" (the op's convention) or "mean" (the mean of the values over all keys: what Keras'
    MultiHeadAttention returns there on its default path, a uniform softmax over masked logits).
    """
    q_lengths = kv_lengths = None
    if query_mask is not None:
        q_lengths, _ = padding_lengths(query_mask)
    if kv_mask is not None:
        kv_lengths, kv_prefix = padding_lengths(kv_mask)
        kv_mask4 = kv_mask[:, None, None, :]
        if attention_mask is not None:
            attention_mask = tf.logical_and(attention_mask, kv_mask4)
        elif _in_xla_context():
            # XLA needs static shapes (a cond between an absent and a present mask has none): the mask
            # goes in always, all True when it is a prefix (then the lengths alone do the work).
            attention_mask = tf.logical_or(kv_mask4, kv_prefix)
        else:
            # Only a non-prefix padding mask pays for the general path.
            attention_mask = tf.cond(kv_prefix, _empty_mask, lambda: kv_mask4)
    output, lse = _flash_ops.flash_attention(
        query, key, value, causal=causal, window=window, q_lengths=q_lengths, kv_lengths=kv_lengths,
        attention_mask=attention_mask, block_mask=block_mask, block_size=block_size,
        dropout_rate=dropout_rate, seed=seed, scale=scale, softcap=softcap, deterministic=deterministic,
        return_lse=True)
    # Without masks, a window or a block pattern every row sees key 0 (causal included): no fill.
    may_have_empty_rows = any(arg is not None for arg in (query_mask, kv_mask, attention_mask, window,
                                                          block_mask))
    if empty_rows == "mean" and may_have_empty_rows:
        empty = tf.equal(tf.transpose(lse, [0, 2, 1]), -np.inf)[..., None]  # [B, Sq, H, 1]
        if query_mask is not None:
            empty = tf.logical_or(empty, tf.logical_not(query_mask)[:, :, None, None])
        fill = tf.reduce_mean(value, axis=1, keepdims=True)  # [B, 1, Hkv, Dv]
        groups = query.shape[2] // value.shape[2]
        if groups > 1:
            fill = tf.repeat(fill, groups, axis=2)
        output = tf.where(empty, fill, output)
    elif query_mask is not None:
        output = tf.where(query_mask[:, :, None, None], output, tf.zeros([], output.dtype))
    return output


def dense_visibility(batch, heads, seqlen_q, seqlen_k, *, query_mask=None, kv_mask=None,
                     attention_mask=None, causal=False, window=None, block_mask=None, block_size=128):
    """Every rule of attend() as one bool tensor broadcastable to [B, H, Sq, Sk] (True = visible)."""
    del batch, heads  # broadcast
    rows = tf.range(seqlen_q)[:, None]
    cols = tf.range(seqlen_k)[None, :]
    visible = tf.ones([seqlen_q, seqlen_k], tf.bool)
    if causal:
        visible = tf.logical_and(visible, cols <= rows)
    if window is not None:
        left, right = window
        if left is not None:
            visible = tf.logical_and(visible, cols >= rows - left)
        if right is not None:
            visible = tf.logical_and(visible, cols <= rows + right)
    visible = visible[None, None]
    if query_mask is not None:
        visible = tf.logical_and(visible, to_bool(query_mask)[:, None, :, None])
    if kv_mask is not None:
        visible = tf.logical_and(visible, to_bool(kv_mask)[:, None, None, :])
    if attention_mask is not None:
        visible = tf.logical_and(visible, attention_mask)
    if block_mask is not None:
        block_q, block_k = (block_size, block_size) if is_int(block_size) else block_size
        blocks = to_bool(block_mask)
        while blocks.shape.rank < 4:
            blocks = blocks[None]
        blocks = tf.gather(blocks, tf.range(seqlen_q) // block_q, axis=2)
        blocks = tf.gather(blocks, tf.range(seqlen_k) // block_k, axis=3)
        visible = tf.logical_and(visible, blocks)
    return visible


def attention_probabilities(query, key, visible, scale, softcap=None):
    """Explicit softmax(scale * q k^T) [B, H, Sq, Sk] in float32 (soft-capped like the kernel when
    softcap is given), masked like Keras' Softmax layer
    (masked logits filled with a large negative number, masked probabilities then set to 0, so a
    row with nothing visible is all zeros). O(Sq * Sk) memory: only for return_attention_scores."""
    groups = query.shape[2] // key.shape[2]
    if groups > 1:
        key = tf.repeat(key, groups, axis=2)
    logits = tf.einsum("bqhd,bkhd->bhqk", tf.cast(query, tf.float32), tf.cast(key, tf.float32)) * scale
    if softcap:
        logits = softcap * tf.tanh(logits / softcap)
    logits = tf.where(visible, logits, _LARGE_NEGATIVE)
    probs = tf.nn.softmax(logits, axis=-1)
    return tf.where(visible, probs, 0.0)
