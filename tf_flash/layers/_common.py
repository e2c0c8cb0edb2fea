"""Shared pieces of the Keras layers: their common options, Keras masks to op arguments, explicit scores."""
import keras
import numpy as np
import tensorflow as tf

from tf_flash import _checks
from tf_flash import _masks
from tf_flash import ops as _flash_ops

# Keras' masked softmax fills masked logits with a large negative number, not -inf, so that a row
# with nothing visible stays finite; the explicit scores path does the same.
_LARGE_NEGATIVE = -1e9


def read_only_properties(*names):
    """A class decorator: for each name, a read-only property that returns the attribute `_name`. The layers
    keep their configuration in private attributes, read through properties (the style of Keras'
    MultiHeadAttention); `seed` and the dropout's `seed_generator` are public attributes, as in Keras' layers."""
    def decorate(cls):
        for name in names:
            setattr(cls, name, property(lambda self, attribute="_" + name: getattr(self, attribute)))
        return cls
    return decorate


@read_only_properties("window", "dropout", "block_mask", "block_size", "softcap", "deterministic")
class FlashOptionsLayer(keras.layers.Layer):
    """A Keras layer with the options both tf_flash layers take: checked, kept, and saved by get_config."""

    def __init__(self, *, window, dropout, block_mask, block_size, seed, softcap, deterministic, **kwargs):
        window = None if window is None else _checks.normalize_window(window)
        dropout = _checks.check_rate(dropout, "dropout")
        block_mask = _check_block_mask(block_mask)
        block_q, block_k = _checks.normalize_block_size(block_size)
        seed = _checks.check_int(seed, "seed", optional=True)
        softcap = _checks.normalize_softcap(softcap) or None
        deterministic = _checks.check_bool(deterministic, "deterministic", optional=True)
        super().__init__(**kwargs)
        self.supports_masking = True
        self.supports_jit = True  # the op has an XLA lowering (typed-FFI custom calls)
        self._window = window
        self._dropout = dropout
        self._block_mask = block_mask
        self._block_size = block_q if _checks.is_int(block_size) else (block_q, block_k)  # the user's form
        self._softcap = softcap
        self._deterministic = deterministic
        self.seed = seed
        self.seed_generator = keras.random.SeedGenerator(seed) if dropout > 0 else None

    def _dropout_and_seed(self, training):
        """(dropout_rate, seed) of one call: dropout only in training, with a fresh seed each call."""
        if training and self._dropout > 0:
            return self._dropout, tf.cast(self.seed_generator.next(), tf.int64)
        return 0.0, None

    def get_config(self):
        return {
            **super().get_config(),
            "window": self._window,
            "dropout": self._dropout,
            "block_mask": None if self._block_mask is None else self._block_mask.tolist(),
            "block_size": self._block_size,
            "seed": self.seed,
            "softcap": self._softcap,
            "deterministic": self._deterministic,
        }


def _check_block_mask(block_mask):
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


def to_bool(mask, name="mask"):
    """A Keras mask (bool, or numbers where nonzero = keep) as a bool tensor; anything else is refused."""
    original = mask
    mask = _checks.to_tensor(mask, name)
    if mask.dtype == tf.bool:
        return mask
    if not (mask.dtype.is_integer or mask.dtype.is_floating):
        raise ValueError(f"`{name}` must be a bool (or numeric, nonzero = keep) tensor. Received: {name} of "
                         f"dtype {mask.dtype.name} ({name}={_checks.describe(original)})")
    return tf.cast(mask, tf.bool)


def combine(first, second, operation):
    """`operation(first, second)` of two optional tensors; the one given when the other is None."""
    if first is None:
        return second
    if second is None:
        return first
    return operation(first, second)


def check_padding_mask(mask, name, batch, seqlen):
    """A Keras padding mask [batch, seq] (None passes) as bool, its shape checked: its errors name it,
    not the lengths or attention_mask it becomes. batch, seqlen: Sizes."""
    if mask is None:
        return None
    mask = to_bool(mask, name)
    if mask.shape.rank is not None and mask.shape.rank != 2:
        raise ValueError(f"`{name}` must have shape [batch, seq] (a Keras padding mask). "
                         f"Received: {name}.shape={mask.shape}")
    if mask.shape.rank is None:
        mask = tf.ensure_shape(
            _checks.checked(mask, tf.equal(tf.rank(mask), 2),
                            f"`{name}` must have shape [batch, seq] (a Keras padding mask). Received: "
                            f"{name}.shape=", tf.shape(mask)), [None, None])
    return _checks.check_dims(mask, name, (batch, seqlen), "[batch, seq]")


def expand_attention_mask(mask, batch, heads, seqlen_q, seqlen_k):
    """A Keras-style attention mask ([Sq, Sk], [B, Sq, Sk] or [B, H, Sq, Sk]) as rank 4, its shape checked
    (each axis the full size or 1). batch, heads, seqlen_q, seqlen_k: Sizes.

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
    mask = _checks.check_dims(mask, "attention_mask", expected, what, broadcast=True)
    while mask.shape.rank < 4:
        mask = tf.expand_dims(mask, axis=-3)
    return mask


def attend(query, key, value, *, query_mask=None, kv_mask=None, q_lengths=None, kv_lengths=None,
           attention_mask=None, segment_ids=None, causal=False, window=None, block_mask=None, block_size=128,
           dropout_rate=0.0, seed=None, scale=None, softcap=None, deterministic=None, empty_rows="zeros"):
    """flash_attention on [B, S, H, D] heads with Keras padding masks.

    query_mask [B, Sq] / kv_mask [B, Sk]: prefix masks become q_lengths / kv_lengths (the kernel
    skips the padding), combined with the lengths given; any other pattern goes through the general
    attention_mask path (kv) or is applied to the output rows (query). attention_mask must already be
    rank 4. segment_ids: None or (query ids, key ids) from _checks.check_segment_ids; a query sees a key only where
    their ids are equal, AND every other rule (the op's `segment_ids`).

    empty_rows: what a query row that sees no key (or is masked out by query_mask) returns:
    "zeros" (the op's convention) or "mean" (the mean of the values over all keys: what Keras'
    MultiHeadAttention returns there on its default path, a uniform softmax over masked logits).
    """
    if query_mask is not None:
        q_lengths = combine(q_lengths, _masks.prefix_lengths(query_mask)[0], tf.minimum)
    if kv_mask is not None:
        kv_mask4 = kv_mask[:, None, None, :]
        if attention_mask is None:
            attention_mask, mask_lengths = _masks.key_padding(kv_mask, kv_mask4)
        else:
            attention_mask = tf.logical_and(attention_mask, kv_mask4)
            mask_lengths, _ = _masks.prefix_lengths(kv_mask)
        kv_lengths = combine(kv_lengths, mask_lengths, tf.minimum)
    extra = {}
    if segment_ids is not None:
        q_ids, kv_ids = segment_ids
        # One tensor for self-attention, as the op takes it; a pair otherwise.
        extra["segment_ids"] = q_ids if q_ids is kv_ids else (q_ids, kv_ids)
    output, lse = _flash_ops.flash_attention(
        query, key, value, causal=causal, window=window, q_lengths=q_lengths, kv_lengths=kv_lengths,
        attention_mask=attention_mask, block_mask=block_mask, block_size=block_size,
        dropout_rate=dropout_rate, seed=seed, scale=scale, softcap=softcap, deterministic=deterministic,
        return_lse=True, **extra)
    # Without lengths, masks, segment ids, a window or a block pattern every row sees key 0 (causal
    # included): no fill. (Cross-attention ids may leave a query's document without keys.)
    may_have_empty_rows = any(arg is not None for arg in (q_lengths, kv_lengths, attention_mask, segment_ids,
                                                          window, block_mask))
    if empty_rows == "mean" and may_have_empty_rows:
        masked_rows = None if query_mask is None else tf.logical_not(query_mask)[:, :, None, None]
        output = _masks.fill_empty_rows(output, lse, value, masked_rows)
    elif query_mask is not None:
        output = tf.where(query_mask[:, :, None, None], output, tf.zeros([], output.dtype))
    return output


def dense_visibility(batch, heads, seqlen_q, seqlen_k, *, query_mask=None, kv_mask=None,
                     attention_mask=None, segment_ids=None, causal=False, window=None, block_mask=None,
                     block_size=128):
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
    if segment_ids is not None:
        q_ids, kv_ids = (tf.cast(ids, tf.int64) for ids in segment_ids)
        visible = tf.logical_and(visible, tf.equal(q_ids[:, None, :, None], kv_ids[:, None, None, :]))
    if block_mask is not None:
        block_q, block_k = _checks.normalize_block_size(block_size)
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
