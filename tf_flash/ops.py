"""`tf_flash.flash_attention`: the public op, its argument checks and its registered gradient."""
import contextlib
import math

import tensorflow as tf

from tf_flash import _checks, _decode
from tf_flash._masks import NO_MASK_SHAPE
from tf_flash._ops import ops as _ops

_FLOAT_DTYPES = (tf.float32, tf.float16, tf.bfloat16)
_NO_LENGTHS_SHAPE = [0]
_NO_SEGMENT_IDS_SHAPE = [0, 0]
_INT64_MIN, _INT64_MAX = -2**63, 2**63 - 1


def _check_qkv(query, key, value):
    """Static checks of the shapes the kernels need, so that eager calls and tf.function traces get these
    messages (in a trace, TF's shape inference would otherwise answer first); the kernels check again."""
    tensors = (("query", query), ("key", key), ("value", value))
    for name, tensor in tensors:
        if tensor.shape.rank is not None and tensor.shape.rank != 4:
            raise ValueError(f"`{name}` must have rank 4 [batch, seq, heads, dim]. "
                             f"Received: {name}.shape={tensor.shape}")
    dims = {name: tensor.shape.as_list() if tensor.shape.rank is not None else [None] * 4
            for name, tensor in tensors}

    def differ(a, b):
        return a is not None and b is not None and a != b

    shapes = f"Received: query.shape={query.shape}, key.shape={key.shape}, value.shape={value.shape}"
    if differ(dims["query"][0], dims["key"][0]) or differ(dims["query"][0], dims["value"][0]) or differ(
            dims["key"][0], dims["value"][0]):
        raise ValueError(f"`query`, `key` and `value` must have the same batch size. {shapes}")
    if differ(dims["key"][1], dims["value"][1]) or differ(dims["key"][2], dims["value"][2]):
        raise ValueError(f"`key` and `value` must have the same sequence length and heads. {shapes}")
    if differ(dims["query"][3], dims["key"][3]):
        raise ValueError(f"`query` and `key` must have the same head dim. {shapes}")
    heads, heads_kv = dims["query"][2], dims["key"][2]
    if heads is not None and heads_kv is not None and (heads_kv == 0 or heads % heads_kv):
        raise ValueError(f"The number of key/value heads must divide the number of query heads. "
                         f"Received: query heads={heads}, key heads={heads_kv} ({shapes[10:]})")
    for name, dim in (("query", dims["query"][3]), ("key", dims["key"][3]), ("value", dims["value"][3])):
        if dim is not None and not 1 <= dim <= _checks.MAX_HEAD_DIM:
            raise ValueError(f"The head dim of `{name}` (its last axis) must be in [1, {_checks.MAX_HEAD_DIM}]. "
                             f"Received: {name}.shape={dict(tensors)[name].shape}")


_ABSENT = {}  # (shape, dtype, device) -> the eager "absent" tensor


def _absent(shape, dtype, device=None):
    """The op's "absent" encoding of an optional input: an empty tensor (zeros [2] for the seed). Graphs get a
    constant; eager calls share one tensor per device, made once (making it on every call cost more than
    the kernel at small shapes on the GPU)."""
    if not tf.executing_eagerly():
        return tf.zeros(shape, dtype)
    key = (tuple(shape), dtype, device)
    tensor = _ABSENT.get(key)
    if tensor is None:
        with tf.device(device) if device else contextlib.nullcontext():
            tensor = _ABSENT[key] = tf.zeros(shape, dtype)
    return tensor


def _current_device():
    """The device scope of an eager call ("" outside any tf.device): where TF places the op, and so where
    its absent inputs belong."""
    try:
        from tensorflow.python.eager import context  # pylint: disable=import-outside-toplevel
        return context.context().device_name or ""
    except Exception:  # pylint: disable=broad-except  (private TF API: never fail because of it)
        return ""


def _lengths(lengths, name, batch, seqlen, device=None):
    checked = _checks.check_lengths(lengths, name, batch, seqlen)
    return _absent(_NO_LENGTHS_SHAPE, tf.int32, device) if checked is None else checked


def _rank4_mask(mask, name, full, what, device=None):
    """A user mask (bool, rank 2 to 4, broadcastable to `full`, 4 Sizes) as rank 4."""
    if mask is None:
        return _absent(NO_MASK_SHAPE, tf.bool, device)
    original = mask
    mask = _checks.to_tensor(mask, name)
    if mask.dtype != tf.bool:
        raise ValueError(f"`{name}` must be a bool tensor. Received: {name} of dtype {mask.dtype.name} "
                         f"({name}={_checks.describe(original)})")
    rank, received_shape = mask.shape.rank, mask.shape
    if rank is not None and not 2 <= rank <= 4:
        raise ValueError(f"`{name}` must have rank 2 to 4 (broadcastable to {what}). "
                         f"Received: {name}.shape={mask.shape}")
    if rank is None:
        dynamic_rank = tf.rank(mask)
        mask = _checks.checked(mask, (dynamic_rank >= 2) & (dynamic_rank <= 4),
                        f"`{name}` must have rank 2 to 4 (broadcastable to {what}). Received: {name}.shape=",
                        tf.shape(mask))
        padded = tf.concat([tf.ones([tf.maximum(4 - dynamic_rank, 0)], tf.int32), tf.shape(mask)], 0)
        mask = tf.ensure_shape(tf.reshape(mask, padded), [None] * 4)
    elif rank < 4:
        mask = mask[(None,) * (4 - rank)]  # leading broadcast axes
    # [0, 0, 0, 0] is the op's "absent" (the layers pick it at run time for prefix padding masks); a mask
    # with some other zero axis is checked like any other (it would otherwise pass for "absent").
    return _checks.check_dims(mask, name, full, what, received_shape, broadcast=True, absent_ok=rank in (4, None))


def _segment_ids(segment_ids, batch, seqlen_q, seqlen_k, device=None):
    """The op's (q_segment_ids, kv_segment_ids): int32 [B, Sq] and [B, Sk], or both absent. `segment_ids` is
    one [B, S] tensor (self-attention: Sq == Sk) or a pair of the two (_checks.check_segment_ids)."""
    pair = _checks.check_segment_ids(segment_ids, batch, seqlen_q, seqlen_k)
    if pair is None:
        absent = _absent(_NO_SEGMENT_IDS_SHAPE, tf.int32, device)
        return absent, absent
    names = ("segment_ids", "segment_ids") if pair[0] is pair[1] else ("q_segment_ids", "kv_segment_ids")
    ids = []
    for name, tensor in zip(names, pair):
        if tensor.dtype != tf.int32:
            # Ids past int32 would wrap and could make two documents one.
            wide = tf.cast(tensor, tf.int64)
            tensor = _checks.checked(
                tensor, tf.reduce_all((wide >= _checks.INT32_MIN) & (wide <= _checks.INT32_MAX)),
                f"`{name}` must hold int32 values. Received: {name}=", tensor)
        ids.append(tf.cast(tensor, tf.int32))
    return tuple(ids)


def _seed(seed, dropout_rate):
    # The op reads the seed in host memory. Made on the host, it needs no device-to-host copy, which
    # would wait for all work queued on the GPU and so stall the pipeline at every call.
    with tf.device("/CPU:0"):
        if seed is None:
            if dropout_rate == 0.0:
                return _absent([2], tf.int64, "/CPU:0")
            # A stateful draw: two calls differ, and tf.random.set_seed makes a program reproducible
            # (the same advice TF gives for feeding its stateless random ops).
            return tf.random.uniform([2], minval=tf.int64.min, maxval=tf.int64.max, dtype=tf.int64)
        if _checks.is_int(seed):
            if not _INT64_MIN <= seed <= _INT64_MAX:
                raise ValueError("`seed` must be an int in [-2**63, 2**63 - 1] or an integer tensor of shape [2]. "
                                 f"Received: seed={seed!r}")
            return tf.constant([int(seed), 0], tf.int64)
        message = f"`seed` must be an int or an integer tensor of shape [2]. Received: seed={_checks.describe(seed)}"
        if _checks.is_bool(seed):
            raise ValueError(message)
        tensor = _checks.to_tensor(seed, "seed")
        shape = tensor.shape
        # [None] and unknown shapes are checked by the kernel at run time ("seed ... shape [2]").
        if not tensor.dtype.is_integer or (shape.rank is not None and (
                shape.rank != 1 or shape[0] not in (None, 2))):
            raise ValueError(f"{message} of dtype {tensor.dtype.name} and shape {shape}")
        return tf.cast(tensor, tf.int64)


def flash_attention(query, key, value, *, causal=False, window=None, q_lengths=None, kv_lengths=None,
                    attention_mask=None, block_mask=None, block_size=128, dropout_rate=0.0, seed=None,
                    scale=None, softcap=None, deterministic=None, return_lse=False, segment_ids=None,
                    q_descale=None, k_descale=None, v_descale=None, output_dtype=None):
    """Exact attention computed in tiles; the [Sq, Sk] score matrix never exists in memory.

    Args:
      query: [B, Sq, H, D] float32, float16 or bfloat16; or float8_e4m3fn (forward only, Hopper GPUs: see
        q_descale).
      key: [B, Sk, Hkv, D], same dtype; Hkv must divide H (grouped-query / multi-query attention).
      value: [B, Sk, Hkv, Dv], same dtype.
      causal: True or "top_left": query i sees keys j <= i (top-left aligned, like `tf.linalg.band_part`).
        "bottom_right": the Sq queries are the last Sq positions of each entry's keys (decoding against a KV
        cache): query i of entry b sees keys j <= kv_lengths[b] - Sq + i (Sk without kv_lengths); `window`
        is then aligned the same way. Rows that land before the first key see nothing. Equal to
        "top_left" when Sq == Sk and no kv_lengths are given.
      window: (left, right): query i sees keys i-left .. i+right; None on a side = unlimited.
      q_lengths, kv_lengths: int [B] valid prefix lengths; rows/columns beyond are invisible.
      attention_mask: bool, broadcastable to [B, H, Sq, Sk] (rank 2 to 4), True = attend.
      block_mask: bool [nqb, nkb], [H, nqb, nkb] or [B, H, nqb, nkb]; False blocks are skipped.
      block_size: int or (bq, bk), the blocks `block_mask` describes.
      segment_ids: packed documents. int [B, S] (self-attention, Sq == Sk) or a pair (q_segment_ids [B, Sq],
        kv_segment_ids [B, Sk]) (a tuple, or a list of two tensors): query i sees key j only where their ids are equal (AND every other mask;
        `causal` stays on row positions, so it is causal within each document). Memory O(B x S); tiles whose
        rows and keys hold no common id are skipped, tiles inside one document run unmasked. Contiguous
        runs of ids are the fast path; any ids are correct.
      dropout_rate: dropout on the attention probabilities, in [0, 1). Applied in steps of 1/256: an
        entry is dropped with probability round(256 * rate) / 256 (at least 1/256 for rate > 0) and kept
        entries are scaled by 1 / (1 - that probability), so the expectation is exact.
      seed: int or int64 [2]; same seed and inputs give the same output. None draws one from TF's
        global random state (reproducible under `tf.random.set_seed`).
      scale: score scale, finite and >= 0 (on every device); default 1/sqrt(D).
      softcap: logit soft-capping (Gemma 2): the scaled scores s become softcap * tanh(s / softcap)
        before the softmax. None (or 0) = off; else a positive finite number.
      deterministic: True: the backward gives bit-identical gradients for identical inputs on one device
        (the GPU then sums dQ in a fixed order instead of by float atomics; the CPU always does). None
        follows `tf.config.experimental.enable_op_determinism()` (read when the gradient runs); False
        is the fast GPU path unless op determinism is enabled.
      return_lse: also return the log-sum-exp [B, H, Sq] float32 (-inf on rows that see nothing).
      q_descale, k_descale, v_descale: float8_e4m3fn inputs only: the dequantization factors, float32 scalars
        (per tensor) or [B, Hkv] (per batch entry and KV head); None = 1. The result is the attention of
        query * q_descale, key * k_descale and value * v_descale (q_descale * k_descale joins the scores' scale,
        v_descale multiplies the output). FP8 runs on Hopper GPUs only (sm_90; elsewhere a clear error), forward
        only (the gradient raises), without dropout; under jit_compile as one custom call too. Head dims are
        multiples of 16 up to 256.
      output_dtype: float8_e4m3fn inputs only: tf.bfloat16 (None, the default) or tf.float16.

    Returns:
      output [B, Sq, H, Dv] in the dtype of query (output_dtype for float8_e4m3fn); (output, lse) when
      return_lse.
    """
    return _flash_attention(query, key, value, causal=causal, window=window, q_lengths=q_lengths,
                            kv_lengths=kv_lengths, attention_mask=attention_mask, block_mask=block_mask,
                            block_size=block_size, dropout_rate=dropout_rate, seed=seed, scale=scale,
                            softcap=softcap, deterministic=deterministic, return_lse=return_lse,
                            segment_ids=segment_ids, q_descale=q_descale, k_descale=k_descale,
                            v_descale=v_descale, output_dtype=output_dtype)


def _flash_attention(query, key, value, *, causal=False, window=None, q_lengths=None, kv_lengths=None,
                    attention_mask=None, block_mask=None, block_size=128, dropout_rate=0.0, seed=None,
                    scale=None, softcap=None, deterministic=None, return_lse=False, query_offset=0,
                    segment_ids=None, split_kv=None, q_descale=None, k_descale=None, v_descale=None,
                    output_dtype=None):
    """flash_attention with the kernels' query_offset (tf_flash.parallel's chunks): row i of `query` is row
    i + query_offset of the attention for causal, window and the dropout mask; lengths and masks stay in
    `query`'s rows. An int in [0, 2**31), a multiple of 16 with dropout. split_kv: the decode path
    (_decode.py) by shape (None), never (False), or with that many key runs (an int, for its tests)."""
    query = _checks.to_tensor(query, "query")
    key = _checks.to_tensor(key, "key", dtype_hint=query.dtype)
    value = _checks.to_tensor(value, "value", dtype_hint=query.dtype)
    if query.dtype not in _FLOAT_DTYPES + (_FP8,):
        raise ValueError("`query` must be float32, float16, bfloat16 or float8_e4m3fn (forward only, Hopper GPUs). "
                         f"Received: query.dtype={query.dtype.name}")
    for name, tensor in (("key", key), ("value", value)):
        if tensor.dtype != query.dtype:
            raise ValueError(f"`{name}` must have the dtype of query ({query.dtype.name}). "
                             f"Received: {name}.dtype={tensor.dtype.name}")
    _check_qkv(query, key, value)
    fp8 = query.dtype == _FP8
    causal, bottom_right = _checks.normalize_causal(causal)
    return_lse = _checks.check_bool(return_lse, "return_lse")
    dropout_rate = _checks.check_rate(dropout_rate, "dropout_rate")
    output_dtype = _check_fp8_arguments(fp8, q_descale, k_descale, v_descale, output_dtype, dropout_rate)
    block_q, block_k = _checks.normalize_block_size(block_size)
    window_left, window_right = (-1 if side is None else side for side in _checks.normalize_window(window))
    head_dim = query.shape[3] if query.shape.rank is not None else None
    if scale is None:
        if head_dim is None:
            raise ValueError("`scale` must be given when the head dim of query is not known statically. "
                             f"Received: scale=None, query.shape={query.shape}")
        scale = 1.0 / math.sqrt(head_dim)
    scale = _checks.normalize_scale(scale)
    softcap = _checks.normalize_softcap(softcap)
    deterministic = _checks.check_bool(deterministic, "deterministic", optional=True)
    query_offset = _checks.check_int(query_offset, "query_offset", minimum=0)

    batch, heads = _checks.axis_size(query, 0), _checks.axis_size(query, 2)
    seqlen_q, seqlen_k = _checks.axis_size(query, 1), _checks.axis_size(key, 1)
    blocks_q, blocks_k = _checks.num_blocks(seqlen_q, block_q), _checks.num_blocks(seqlen_k, block_k)
    device = _current_device() if tf.executing_eagerly() else None  # where eager absent inputs are kept
    mask = _rank4_mask(attention_mask, "attention_mask", (batch, heads, seqlen_q, seqlen_k),
                       "[batch, heads, seq_q, seq_k]", device)
    plain = ((attention_mask is None or _decode.is_key_mask(mask)) and block_mask is None and segment_ids is None
             and q_lengths is None
             and window_left < 0 and window_right < 0 and dropout_rate == 0.0 and query_offset == 0
             and (not causal or bottom_right))
    # Causal with one query row is kv_lengths alone; several rows keep their diagonals (the op's position_shift).
    causal_rows = causal and seqlen_q.static != 1
    heads_kv = _checks.axis_size(key, 2).static
    splits = (None if split_kv is False else split_kv if split_kv else
              _decode.plan(batch.static, seqlen_q.static, seqlen_k.static, heads.static, heads_kv, plain=plain,
                           causal_rows=causal_rows))
    if split_kv and not plain:
        raise ValueError("split_kv: the decode path takes kv_lengths, a key mask, bottom-right causal, scale and "
                         f"softcap only (_decode.py). Received: split_kv={split_kv} with other arguments")
    if splits and causal_rows and not (None not in (heads.static, heads_kv) and
                                       _decode.shares_positions(heads.static // heads_kv)):
        raise ValueError("split_kv: causal rows keep their diagonals in packed heads only where a power of two of "
                         f"query heads share a KV head (_decode.py). Received: split_kv={split_kv}, causal with "
                         f"{seqlen_q.static} query rows, query.shape={query.shape}, key.shape={key.shape}")
    if fp8:
        descales = _descales(q_descale, k_descale, v_descale, batch, _checks.axis_size(key, 2))
        attention_op = _ops.tf_flash_flash_attention_fp8
        extra = dict(zip(_DESCALE_NAMES, descales), output_dtype=output_dtype)
    else:
        attention_op, extra = _ops.tf_flash_flash_attention, {}
    if splits:
        packed_kv_lengths = _lengths(kv_lengths, "kv_lengths", batch, seqlen_k, device)

        def attention(packed, rows_per_position):  # descales per (batch, KV head): the packed heads' own
            out, packed_lse, _ = attention_op(
                query=packed, key=key, value=value, q_lengths=_absent(_NO_LENGTHS_SHAPE, tf.int32, device),
                kv_lengths=packed_kv_lengths, attention_mask=mask,  # one row for all: unchanged by the packing
                block_mask=_absent(NO_MASK_SHAPE, tf.bool, device),
                q_segment_ids=_absent(_NO_SEGMENT_IDS_SHAPE, tf.int32, device),
                kv_segment_ids=_absent(_NO_SEGMENT_IDS_SHAPE, tf.int32, device), seed=_seed(None, 0.0),
                scale=float(scale), softcap=softcap, deterministic=bool(deterministic), causal=causal_rows,
                bottom_right=causal_rows, position_shift=rows_per_position.bit_length() - 1 if causal_rows else 0,
                num_splits=int(splits), **extra)
            return out, packed_lse

        output, lse = _decode.attend(attention, query, heads_kv)
        return (output, lse) if return_lse else output
    q_segment_ids, kv_segment_ids = _segment_ids(segment_ids, batch, seqlen_q, seqlen_k, device)
    output, lse, _ = attention_op(
        query=query, key=key, value=value,
        q_lengths=_lengths(q_lengths, "q_lengths", batch, seqlen_q, device),
        kv_lengths=_lengths(kv_lengths, "kv_lengths", batch, seqlen_k, device),
        attention_mask=mask,
        block_mask=_rank4_mask(block_mask, "block_mask", (batch, heads, blocks_q, blocks_k),
                               "[batch, heads, query blocks, key blocks]", device),
        q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
        seed=_seed(seed, dropout_rate),
        causal=causal, window_left=window_left, window_right=window_right,
        block_q=block_q, block_k=block_k, dropout_rate=float(dropout_rate), scale=float(scale),
        softcap=softcap, deterministic=bool(deterministic), query_offset=query_offset, bottom_right=bottom_right,
        **extra)
    return (output, lse) if return_lse else output


_FP8 = tf.dtypes.experimental.float8_e4m3fn
_FP8_OUTPUT_DTYPES = (tf.bfloat16, tf.float16)
_DESCALE_NAMES = ("q_descale", "k_descale", "v_descale")


def _check_fp8_arguments(fp8, q_descale, k_descale, v_descale, output_dtype, dropout_rate):
    """The float8_e4m3fn arguments: descales and output_dtype only with fp8 inputs; fp8 without dropout (the rate
    check_rate returned). Returns the output dtype (tf.bfloat16 by default; None for other
    inputs)."""
    given = {name: value for name, value in zip(_DESCALE_NAMES + ("output_dtype",),
                                                (q_descale, k_descale, v_descale, output_dtype)) if value is not None}
    if not fp8:
        if given:
            name, value = next(iter(given.items()))
            raise ValueError(f"`{name}` applies to float8_e4m3fn inputs only. Received: "
                             f"{name}={_checks.describe(value)} with inputs of another dtype")
        return None
    if output_dtype is None:
        output_dtype = tf.bfloat16
    else:
        try:
            output_dtype = tf.as_dtype(output_dtype)
        except TypeError:
            output_dtype = None
        if output_dtype not in _FP8_OUTPUT_DTYPES:
            raise ValueError("`output_dtype` must be None, tf.bfloat16 or tf.float16 for float8_e4m3fn inputs. "
                             f"Received: output_dtype={_checks.describe(given['output_dtype'])}")
    if dropout_rate != 0.0:
        raise ValueError("FP8 (float8_e4m3fn) attention takes no dropout (a forward for inference). "
                         f"Received: dropout_rate={_checks.describe(dropout_rate)}")
    return output_dtype


def _descales(q_descale, k_descale, v_descale, batch, heads_kv):
    """The op's three descale inputs, float32: all scalars (per tensor), or all [B, Hkv] (a scalar among [B, Hkv]
    ones is broadcast to that shape). None = 1. batch, heads_kv: Sizes."""
    tensors = []
    for name, value in zip(_DESCALE_NAMES, (q_descale, k_descale, v_descale)):
        if value is None:
            tensors.append(tf.constant(1.0, tf.float32))
            continue
        tensor = _checks.to_tensor(value, name, dtype_hint=tf.float32)
        if tensor.dtype != tf.float32:
            raise ValueError(f"`{name}` must be float32. Received: {name} of dtype {tensor.dtype.name} "
                             f"({name}={_checks.describe(value)})")
        shape = tensor.shape
        expected = [batch.static, heads_kv.static]
        per_tensor = shape.rank == 0 or (shape.rank == 1 and shape[0] == 1)
        per_head = shape.rank == 2 and all(e is None or d is None or d == e for d, e in zip(shape.as_list(), expected))
        if shape.rank is None or not (per_tensor or per_head):
            shown = ["B" if e is None else e for e in expected]
            raise ValueError(f"`{name}` must be a float32 scalar (per tensor) or [batch, kv_heads] = [{shown[0]}, "
                             f"{shown[1]}]. Received: {name}.shape={shape}")
        tensors.append(tf.reshape(tensor, []) if shape.rank == 1 else tensor)
    if any(t.shape.rank == 2 for t in tensors):
        per_head_shape = tf.stack([batch.tensor(), heads_kv.tensor()])
        tensors = [t if t.shape.rank == 2 else tf.broadcast_to(t, per_head_shape) for t in tensors]
    return tensors


@tf.RegisterGradient("TfFlash>FlashAttentionFp8")
def _flash_attention_fp8_grad(op, *unused_grads):
    raise LookupError(
        "FP8 (float8_e4m3fn) attention has no gradient: tf_flash.flash_attention with float8_e4m3fn inputs is a "
        f"forward for inference; train on bfloat16 or float16 inputs. Received: a gradient request through op "
        f"{op.name!r} of type {op.type}")


@tf.RegisterGradient("TfFlash>FlashAttention")
def _flash_attention_grad(op, d_output, d_lse, _d_rng_state):
    (query, key, value, q_lengths, kv_lengths, attention_mask, block_mask, q_segment_ids, kv_segment_ids,
     _seed_input) = op.inputs
    output, lse, rng_state = op.outputs
    if d_output is None:
        d_output = tf.zeros_like(output)
    if d_lse is None:
        d_lse = tf.zeros_like(lse)
    attrs = {name: op.get_attr(name) for name in (
        "causal", "window_left", "window_right", "block_q", "block_k", "dropout_rate", "scale",
        "softcap", "deterministic", "query_offset", "bottom_right", "position_shift", "num_splits")}
    d_query, d_key, d_value = _ops.tf_flash_flash_attention_grad(
        d_output=d_output, query=query, key=key, value=value, output=output, lse=lse, d_lse=d_lse,
        q_lengths=q_lengths, kv_lengths=kv_lengths, attention_mask=attention_mask, block_mask=block_mask,
        q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, rng_state=rng_state, **attrs)
    return [d_query, d_key, d_value] + [None] * 7
