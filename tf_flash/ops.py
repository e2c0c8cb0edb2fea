"""`tf_flash.flash_attention`: the public op, its argument checks and its registered gradient."""
import math
import numbers

import tensorflow as tf

from tf_flash._ops import ops as _ops

_FLOAT_DTYPES = (tf.float32, tf.float16, tf.bfloat16)
_NO_LENGTHS_SHAPE = [0]
_NO_MASK_SHAPE = [0, 0, 0, 0]


def _is_int(value):
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def normalize_window(window):
    """None, an int w (i sees i-w .. i+w) or (left, right) -> (left, right) with None = unlimited side."""
    if window is None:
        return None, None
    if _is_int(window) and window >= 0:
        return int(window), int(window)
    if isinstance(window, (tuple, list)) and len(window) == 2 and all(
            side is None or (_is_int(side) and side >= 0) for side in window):
        return tuple(None if side is None else int(side) for side in window)
    raise ValueError("`window` must be None, a non-negative int or a pair (left, right) of non-negative ints "
                     f"or None (unlimited). Received: window={window!r}")


def normalize_block_size(block_size):
    """A positive int or a pair of positive ints -> (block_q, block_k)."""
    if _is_int(block_size) and block_size > 0:
        return int(block_size), int(block_size)
    if isinstance(block_size, (tuple, list)) and len(block_size) == 2 and all(
            _is_int(side) and side > 0 for side in block_size):
        return int(block_size[0]), int(block_size[1])
    raise ValueError("`block_size` must be a positive int or a pair of positive ints. "
                     f"Received: block_size={block_size!r}")


def normalize_softcap(softcap):
    """None or 0 (off), or a positive finite number -> the float the op takes (0.0 = off)."""
    if softcap is None:
        return 0.0
    if (isinstance(softcap, bool) or not isinstance(softcap, numbers.Real) or not math.isfinite(softcap)
            or softcap < 0):
        raise ValueError("`softcap` must be None (off) or a positive finite number. "
                         f"Received: softcap={softcap!r}")
    return float(softcap)


def _lengths(lengths, name):
    if lengths is None:
        return tf.zeros(_NO_LENGTHS_SHAPE, tf.int32)
    lengths = tf.convert_to_tensor(lengths)
    if not lengths.dtype.is_integer:
        raise ValueError(f"`{name}` must be an integer tensor [batch]. Received: {name} of dtype {lengths.dtype.name}")
    if lengths.shape.rank is not None and lengths.shape.rank != 1:
        raise ValueError(f"`{name}` must have shape [batch]. Received: {name} with shape {lengths.shape}")
    return tf.cast(lengths, tf.int32)


def _rank4_mask(mask, name, max_rank):
    if mask is None:
        return tf.zeros(_NO_MASK_SHAPE, tf.bool)
    mask = tf.convert_to_tensor(mask)
    if mask.dtype != tf.bool:
        raise ValueError(f"`{name}` must be a bool tensor. Received: {name} of dtype {mask.dtype.name}")
    rank = mask.shape.rank
    if rank is None or rank < 2 or rank > max_rank:
        raise ValueError(f"`{name}` must have rank 2 to {max_rank}. Received: {name} with shape {mask.shape}")
    return tf.reshape(mask, tf.concat([tf.ones([4 - rank], tf.int32), tf.shape(mask)], 0)) if rank < 4 else mask


def _seed(seed, dropout_rate):
    # The op reads the seed in host memory. Made on the host, it needs no device-to-host copy, which
    # would wait for all work queued on the GPU and so stall the pipeline at every call.
    with tf.device("/CPU:0"):
        if seed is None:
            if dropout_rate == 0.0:
                return tf.zeros([2], tf.int64)
            # A stateful draw: two calls differ, and tf.random.set_seed makes a program reproducible
            # (the same advice TF gives for feeding its stateless random ops).
            return tf.random.uniform([2], minval=tf.int64.min, maxval=tf.int64.max, dtype=tf.int64)
        if isinstance(seed, numbers.Integral) and not isinstance(seed, bool):
            return tf.constant([int(seed), 0], tf.int64)
        seed = tf.convert_to_tensor(seed)
        if not seed.dtype.is_integer or (seed.shape.rank is not None and seed.shape.as_list() != [2]):
            raise ValueError(f"`seed` must be an int or an integer tensor of shape [2]. Received: seed={seed!r}")
        return tf.cast(seed, tf.int64)


def flash_attention(query, key, value, *, causal=False, window=None, q_lengths=None, kv_lengths=None,
                    attention_mask=None, block_mask=None, block_size=128, dropout_rate=0.0, seed=None,
                    scale=None, softcap=None, deterministic=None, return_lse=False):
    """Exact attention computed in tiles; the [Sq, Sk] score matrix never exists in memory.

    Args:
      query: [B, Sq, H, D] float32, float16 or bfloat16.
      key: [B, Sk, Hkv, D], same dtype; Hkv must divide H (grouped-query / multi-query attention).
      value: [B, Sk, Hkv, Dv], same dtype.
      causal: query i sees keys j <= i (top-left aligned, like `tf.linalg.band_part`).
      window: (left, right): query i sees keys i-left .. i+right; None on a side = unlimited.
      q_lengths, kv_lengths: int [B] valid prefix lengths; rows/columns beyond are invisible.
      attention_mask: bool, broadcastable to [B, H, Sq, Sk] (rank 2 to 4), True = attend.
      block_mask: bool [nqb, nkb], [H, nqb, nkb] or [B, H, nqb, nkb]; False blocks are skipped.
      block_size: int or (bq, bk), the blocks `block_mask` describes.
      dropout_rate: dropout on the attention probabilities, in [0, 1). Applied in steps of 1/256: an
        entry is dropped with probability round(256 * rate) / 256 (at least 1/256 for rate > 0) and kept
        entries are scaled by 1 / (1 - that probability), so the expectation is exact.
      seed: int or int64 [2]; same seed and inputs give the same output. None draws one from TF's
        global random state (reproducible under `tf.random.set_seed`).
      scale: score scale, default 1/sqrt(D).
      softcap: logit soft-capping (Gemma 2): the scaled scores s become softcap * tanh(s / softcap)
        before the softmax. None (or 0) = off; else a positive finite number.
      deterministic: True: the backward gives bit-identical gradients for identical inputs on one device
        (the GPU then sums dQ in a fixed order instead of by float atomics; the CPU always does). None
        follows `tf.config.experimental.enable_op_determinism()` (read when the gradient runs); False
        is the fast GPU path unless op determinism is enabled.
      return_lse: also return the log-sum-exp [B, H, Sq] float32 (-inf on rows that see nothing).

    Returns:
      output [B, Sq, H, Dv] in the dtype of query; (output, lse) when return_lse.
    """
    query = tf.convert_to_tensor(query)
    key = tf.convert_to_tensor(key, dtype_hint=query.dtype)
    value = tf.convert_to_tensor(value, dtype_hint=query.dtype)
    if query.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"`query` must be float32, float16 or bfloat16. Received: query.dtype={query.dtype.name}")
    for name, tensor in (("key", key), ("value", value)):
        if tensor.dtype != query.dtype:
            raise ValueError(f"`{name}` must have the dtype of query ({query.dtype.name}). "
                             f"Received: {name}.dtype={tensor.dtype.name}")
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        if tensor.shape.rank is not None and tensor.shape.rank != 4:
            raise ValueError(f"`{name}` must have rank 4 [batch, seq, heads, dim]. "
                             f"Received: {name} with shape {tensor.shape}")
    heads, heads_kv = query.shape[2], key.shape[2]
    if heads is not None and heads_kv is not None and (heads_kv == 0 or heads % heads_kv):
        raise ValueError(f"The number of key/value heads must divide the number of query heads. "
                         f"Received: query heads={heads}, key heads={heads_kv}")
    if not isinstance(dropout_rate, numbers.Real) or not 0.0 <= dropout_rate < 1.0:
        raise ValueError(f"`dropout_rate` must be in [0, 1). Received: dropout_rate={dropout_rate!r}")
    block_q, block_k = normalize_block_size(block_size)
    window_left, window_right = (-1 if side is None else side for side in normalize_window(window))
    head_dim = query.shape[3]
    if scale is None:
        if head_dim is None:
            raise ValueError("`scale` must be given when the head dim of query is not known statically.")
        scale = 1.0 / float(head_dim) ** 0.5
    if not isinstance(scale, numbers.Real):
        raise ValueError(f"`scale` must be a Python float. Received: scale={scale!r}")
    softcap = normalize_softcap(softcap)
    if deterministic is not None and not isinstance(deterministic, bool):
        raise ValueError(f"`deterministic` must be None or a bool. Received: deterministic={deterministic!r}")

    output, lse, _ = _ops.tf_flash_flash_attention(
        query=query, key=key, value=value,
        q_lengths=_lengths(q_lengths, "q_lengths"), kv_lengths=_lengths(kv_lengths, "kv_lengths"),
        attention_mask=_rank4_mask(attention_mask, "attention_mask", 4),
        block_mask=_rank4_mask(block_mask, "block_mask", 4),
        seed=_seed(seed, dropout_rate),
        causal=bool(causal), window_left=window_left, window_right=window_right,
        block_q=block_q, block_k=block_k, dropout_rate=float(dropout_rate), scale=float(scale),
        softcap=softcap, deterministic=bool(deterministic))
    return (output, lse) if return_lse else output


@tf.RegisterGradient("TfFlash>FlashAttention")
def _flash_attention_grad(op, d_output, d_lse, _d_rng_state):
    query, key, value, q_lengths, kv_lengths, attention_mask, block_mask, _seed_input = op.inputs
    output, lse, rng_state = op.outputs
    if d_output is None:
        d_output = tf.zeros_like(output)
    if d_lse is None:
        d_lse = tf.zeros_like(lse)
    attrs = {name: op.get_attr(name) for name in (
        "causal", "window_left", "window_right", "block_q", "block_k", "dropout_rate", "scale",
        "softcap", "deterministic")}
    d_query, d_key, d_value = _ops.tf_flash_flash_attention_grad(
        d_output=d_output, query=query, key=key, value=value, output=output, lse=lse, d_lse=d_lse,
        q_lengths=q_lengths, kv_lengths=kv_lengths, attention_mask=attention_mask, block_mask=block_mask,
        rng_state=rng_state, **attrs)
    return [d_query, d_key, d_value, None, None, None, None, None]
