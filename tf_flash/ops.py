"""`tf_flash.flash_attention`: the public op, its argument checks and its registered gradient."""
import contextlib
import math
import numbers
import reprlib

import numpy as np
import tensorflow as tf

from tf_flash._ops import ops as _ops

_FLOAT_DTYPES = (tf.float32, tf.float16, tf.bfloat16)
_NO_LENGTHS_SHAPE = [0]
_NO_MASK_SHAPE = [0, 0, 0, 0]
_MAX_HEAD_DIM = 256  # the kernels' largest head dim (CPU and CUDA)
_INT32_MAX = 2**31 - 1  # attrs and lengths are int32 in the kernels
_INT64_MIN, _INT64_MAX = -2**63, 2**63 - 1


def _is_int(value):
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def _is_bool(value):
    return isinstance(value, (bool, np.bool_))


def _describe(value):
    """A short description of a received value for error messages (no dump of a large array)."""
    if isinstance(value, (tf.Tensor, tf.Variable)):
        return f"<tensor shape={value.shape} dtype={value.dtype.name}>"
    if isinstance(value, np.ndarray) and value.size > 8:
        return f"<array shape={value.shape} dtype={value.dtype}>"
    return reprlib.repr(value)


def _to_tensor(value, name, dtype_hint=None):
    try:
        return tf.convert_to_tensor(value, dtype_hint=dtype_hint)
    except (TypeError, ValueError) as err:
        raise ValueError(f"`{name}` must be a tensor or convertible to one. Received: {name}={_describe(value)} "
                         f"({err})") from err


def _in_xla_context():
    try:
        from tensorflow.python.ops import control_flow_util  # pylint: disable=import-outside-toplevel
        return control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph())
    except Exception:  # pylint: disable=broad-except  (private TF API: never fail because of it)
        return False


def _checked(tensor, condition, *message):
    """`tensor`, after a run-time check of `condition` (graph mode, for what the static shapes cannot
    decide); the error names the argument through `message`. Eager: raises at once. Under XLA, where
    Assert compiles to nothing, the op's XLA kernel checks the shapes itself: nothing is added."""
    if not tf.executing_eagerly() and _in_xla_context():
        return tensor
    assertion = tf.debugging.Assert(condition, list(message), summarize=16)
    if tf.executing_eagerly():
        return tensor
    with tf.control_dependencies([assertion]):
        return tf.identity(tensor)


def _static_value(tensor):
    """The value of `tensor` when it is known without running anything on a device, else None."""
    if isinstance(tensor, tf.Tensor) and not hasattr(tensor, "graph") and "GPU" in tensor.device:
        return None  # an eager tensor on the GPU: reading it would wait for the GPU
    return tf.get_static_value(tensor)


def _check_bool(value, name):
    if not _is_bool(value):
        raise ValueError(f"`{name}` must be a bool. Received: {name}={_describe(value)}")
    return bool(value)


def normalize_window(window):
    """None, an int w (i sees i-w .. i+w) or (left, right) -> (left, right) with None = unlimited side."""

    def side_ok(side):
        return _is_int(side) and 0 <= side <= _INT32_MAX

    if window is None:
        return None, None
    if side_ok(window):
        return int(window), int(window)
    if isinstance(window, (tuple, list)) and len(window) == 2 and all(
            side is None or side_ok(side) for side in window):
        return tuple(None if side is None else int(side) for side in window)
    raise ValueError("`window` must be None, an int in [0, 2**31 - 1] or a pair (left, right) of such ints "
                     f"or None (unlimited). Received: window={_describe(window)}")


def normalize_block_size(block_size):
    """A positive int or a pair of positive ints (below 2**31) -> (block_q, block_k)."""

    def side_ok(side):
        return _is_int(side) and 0 < side <= _INT32_MAX

    if side_ok(block_size):
        return int(block_size), int(block_size)
    if isinstance(block_size, (tuple, list)) and len(block_size) == 2 and all(side_ok(s) for s in block_size):
        return int(block_size[0]), int(block_size[1])
    raise ValueError("`block_size` must be an int in [1, 2**31 - 1] or a pair of such ints. "
                     f"Received: block_size={_describe(block_size)}")


def normalize_softcap(softcap):
    """None or 0 (off), or a positive finite number -> the float the op takes (0.0 = off)."""
    if softcap is None:
        return 0.0
    if (_is_bool(softcap) or not isinstance(softcap, numbers.Real) or not math.isfinite(np.float32(softcap))
            or softcap < 0):
        raise ValueError("`softcap` must be None (off) or a positive finite number. "
                         f"Received: softcap={_describe(softcap)}")
    return float(softcap)


def normalize_scale(scale):
    """The score scale -> the float the op takes: finite (float32 range) and >= 0, the rule of every device
    (the op checks it again, cc/kernels/flash_attention_params.cc, with the same words)."""
    if (_is_bool(scale) or not isinstance(scale, numbers.Real) or not math.isfinite(np.float32(scale))
            or scale < 0):
        raise ValueError("`scale` must be a finite float >= 0 (float32 range). "
                         f"Received: scale={_describe(scale)}")
    return float(scale)


def _check_qkv(query, key, value):
    """Static checks of the shapes the kernels need (the kernels check again at run time: this gives the
    same message under tf.function, where TF's shape inference would otherwise answer first)."""
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
        if dim is not None and not 1 <= dim <= _MAX_HEAD_DIM:
            raise ValueError(f"The head dim of `{name}` (its last axis) must be in [1, {_MAX_HEAD_DIM}]. "
                             f"Received: {name}.shape={dict(tensors)[name].shape}")


class Size:
    """One axis size: `static` (an int, or None when only known at run time) and `tensor()`, the size as a
    scalar int32 tensor, built only when a run-time check needs it (no extra op on the eager fast path)."""

    def __init__(self, static, make_tensor):
        self.static = static
        self._make_tensor = make_tensor

    def tensor(self):
        return tf.constant(self.static, tf.int32) if self.static is not None else self._make_tensor()


def axis_size(tensor, axis):
    """The Size of one axis of `tensor`."""
    static = tensor.shape[axis] if tensor.shape.rank is not None else None
    return Size(static, lambda: tf.shape(tensor)[axis])


def _num_blocks(seqlen, block):
    """The Size of the number of `block`-row blocks covering `seqlen` (the last one partial)."""
    return Size(None if seqlen.static is None else -(-seqlen.static // block),
                lambda: (seqlen.tensor() + block - 1) // block)


def check_lengths(lengths, name, batch, seqlen, runtime_range_check=False):
    """Validates user lengths [batch] with values in [0, seqlen] -> int32 tensor, or None if None.

    batch, seqlen: Size (axis_size). Values known on the host are checked
    here (an int64 2**32 + 2 would otherwise wrap to 2 in int32); others: a non-int32 tensor is checked to
    fit int32 before the cast, and with runtime_range_check against [0, seqlen] at run time (else the CPU
    kernel checks the range; the GPU kernels clamp to it)."""
    if lengths is None:
        return None
    tensor = _to_tensor(lengths, name)
    if not tensor.dtype.is_integer:
        raise ValueError(f"`{name}` must be an integer tensor [batch]. Received: {name} of dtype "
                         f"{tensor.dtype.name} ({name}={_describe(lengths)})")
    if tensor.shape.rank is not None and tensor.shape.rank != 1:
        raise ValueError(f"`{name}` must have shape [batch]. Received: {name}.shape={tensor.shape}")
    size_static = tensor.shape[0] if tensor.shape.rank == 1 else None
    if size_static is not None and batch.static is not None:
        if size_static != batch.static:
            raise ValueError(f"`{name}` must have shape [batch] = [{batch.static}]. "
                             f"Received: {name}.shape={tensor.shape}")
    else:
        tensor = _checked(tensor, tf.equal(tf.size(tensor), batch.tensor()),
                          f"`{name}` must have shape [batch]: batch, then {name}.shape:", batch.tensor(),
                          tf.shape(tensor))
    upper = seqlen.static if seqlen.static is not None else _INT32_MAX
    values = _static_value(tensor)
    if values is not None:
        for index, length in enumerate(np.asarray(values).reshape(-1)):
            if not 0 <= int(length) <= upper:
                raise ValueError(f"`{name}[{index}]` must be in [0, {upper}] (the sequence length). "
                                 f"Received: {name}[{index}]={int(length)}")
        return tf.cast(tensor, tf.int32)
    if tensor.dtype != tf.int32:
        wide = tf.cast(tensor, tf.int64)
        tensor = _checked(tensor, tf.reduce_all((wide >= 0) & (wide <= _INT32_MAX)),
                          f"`{name}` must hold values in [0, 2**31 - 1]. Received: {name}=", tensor)
    if runtime_range_check:
        wide = tf.cast(tensor, tf.int64)
        tensor = _checked(tensor, tf.reduce_all((wide >= 0) & (wide <= tf.cast(seqlen.tensor(), tf.int64))),
                          f"`{name}` must hold values in [0, seq length]: seq length, then {name}:",
                          seqlen.tensor(), tensor)
    return tf.cast(tensor, tf.int32)


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
    checked = check_lengths(lengths, name, batch, seqlen)
    return _absent(_NO_LENGTHS_SHAPE, tf.int32, device) if checked is None else checked


def _rank4_mask(mask, name, full, what, device=None):
    """A user mask (bool, rank 2 to 4, broadcastable to `full`, 4 Sizes) as rank 4."""
    if mask is None:
        return _absent(_NO_MASK_SHAPE, tf.bool, device)
    original = mask
    mask = _to_tensor(mask, name)
    if mask.dtype != tf.bool:
        raise ValueError(f"`{name}` must be a bool tensor. Received: {name} of dtype {mask.dtype.name} "
                         f"({name}={_describe(original)})")
    rank, received_shape = mask.shape.rank, mask.shape
    if rank is not None and not 2 <= rank <= 4:
        raise ValueError(f"`{name}` must have rank 2 to 4 (broadcastable to {what}). "
                         f"Received: {name}.shape={mask.shape}")
    if rank is None:
        dynamic_rank = tf.rank(mask)
        mask = _checked(mask, (dynamic_rank >= 2) & (dynamic_rank <= 4),
                        f"`{name}` must have rank 2 to 4 (broadcastable to {what}). Received: {name}.shape=",
                        tf.shape(mask))
        padded = tf.concat([tf.ones([tf.maximum(4 - dynamic_rank, 0)], tf.int32), tf.shape(mask)], 0)
        mask = tf.ensure_shape(tf.reshape(mask, padded), [None] * 4)
    elif rank < 4:
        mask = mask[(None,) * (4 - rank)]  # leading broadcast axes
    # [0, 0, 0, 0] is the op's "absent" (the layers pick it at run time for prefix padding masks); a mask
    # with some other zero axis is checked like any other (it would otherwise pass for "absent").
    return check_dims(mask, name, full, what, received_shape, broadcast=True, absent_ok=rank in (4, None))


def check_dims(tensor, name, expected, what, received_shape=None, broadcast=False, absent_ok=False):
    """`tensor` whose every axis has the expected size (or 1, with `broadcast`): statically where both
    sizes are known, else at run time. `expected`: one Size per axis.
    absent_ok: also accept the op's "absent" encoding, every axis 0."""
    received_shape = tensor.shape if received_shape is None else received_shape
    if absent_ok and tensor.shape.as_list() == [0] * len(expected):
        return tensor
    allowed = "1 or " if broadcast else ""
    decided = True
    for size, full in zip(tensor.shape.as_list(), expected):
        if size is None or full.static is None:
            decided = decided and broadcast and size == 1
        elif size != full.static and not (broadcast and size == 1):
            sizes = [f.static for f in expected]
            requirement = (f"be broadcastable to {sizes} ({what}, each axis 1 or that size)" if broadcast
                           else f"have shape {what} = {sizes}")
            raise ValueError(f"`{name}` must {requirement}. Received: {name}.shape={received_shape}")
    if decided:
        return tensor
    full_dynamic = tf.stack([f.tensor() for f in expected])
    shape = tf.shape(tensor)
    matches = tf.equal(shape, full_dynamic)
    if broadcast:
        matches = matches | tf.equal(shape, 1)
    ok = tf.reduce_all(matches)
    if absent_ok:
        ok = ok | tf.reduce_all(tf.equal(shape, 0))
    return _checked(tensor, ok,
                    f"`{name}` must have shape {what} (each axis {allowed}that size): that shape, then "
                    f"{name}.shape:", full_dynamic, shape)


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
        if _is_int(seed):
            if not _INT64_MIN <= seed <= _INT64_MAX:
                raise ValueError("`seed` must be an int in [-2**63, 2**63 - 1] or an integer tensor of shape [2]. "
                                 f"Received: seed={seed!r}")
            return tf.constant([int(seed), 0], tf.int64)
        message = f"`seed` must be an int or an integer tensor of shape [2]. Received: seed={_describe(seed)}"
        if _is_bool(seed):
            raise ValueError(message)
        tensor = _to_tensor(seed, "seed")
        shape = tensor.shape
        # [None] and unknown shapes are checked by the kernel at run time ("seed ... shape [2]").
        if not tensor.dtype.is_integer or (shape.rank is not None and (
                shape.rank != 1 or shape[0] not in (None, 2))):
            raise ValueError(f"{message} of dtype {tensor.dtype.name} and shape {shape}")
        return tf.cast(tensor, tf.int64)


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
      scale: score scale, finite and >= 0 (on every device); default 1/sqrt(D).
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
    query = _to_tensor(query, "query")
    key = _to_tensor(key, "key", dtype_hint=query.dtype)
    value = _to_tensor(value, "value", dtype_hint=query.dtype)
    if query.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"`query` must be float32, float16 or bfloat16. Received: query.dtype={query.dtype.name}")
    for name, tensor in (("key", key), ("value", value)):
        if tensor.dtype != query.dtype:
            raise ValueError(f"`{name}` must have the dtype of query ({query.dtype.name}). "
                             f"Received: {name}.dtype={tensor.dtype.name}")
    _check_qkv(query, key, value)
    causal = _check_bool(causal, "causal")
    return_lse = _check_bool(return_lse, "return_lse")
    if (_is_bool(dropout_rate) or not isinstance(dropout_rate, numbers.Real)
            or not 0.0 <= np.float32(dropout_rate) < 1.0):
        raise ValueError(f"`dropout_rate` must be a float in [0, 1). Received: dropout_rate={_describe(dropout_rate)}")
    block_q, block_k = normalize_block_size(block_size)
    window_left, window_right = (-1 if side is None else side for side in normalize_window(window))
    head_dim = query.shape[3] if query.shape.rank is not None else None
    if scale is None:
        if head_dim is None:
            raise ValueError("`scale` must be given when the head dim of query is not known statically. "
                             f"Received: scale=None, query.shape={query.shape}")
        scale = 1.0 / math.sqrt(head_dim)
    scale = normalize_scale(scale)
    softcap = normalize_softcap(softcap)
    if deterministic is not None and not isinstance(deterministic, bool):
        raise ValueError(f"`deterministic` must be None or a bool. Received: deterministic={deterministic!r}")

    batch, heads = axis_size(query, 0), axis_size(query, 2)
    seqlen_q, seqlen_k = axis_size(query, 1), axis_size(key, 1)
    blocks_q, blocks_k = _num_blocks(seqlen_q, block_q), _num_blocks(seqlen_k, block_k)
    device = _current_device() if tf.executing_eagerly() else None  # where eager absent inputs are kept
    output, lse, _ = _ops.tf_flash_flash_attention(
        query=query, key=key, value=value,
        q_lengths=_lengths(q_lengths, "q_lengths", batch, seqlen_q, device),
        kv_lengths=_lengths(kv_lengths, "kv_lengths", batch, seqlen_k, device),
        attention_mask=_rank4_mask(attention_mask, "attention_mask", (batch, heads, seqlen_q, seqlen_k),
                                   "[batch, heads, seq_q, seq_k]", device),
        block_mask=_rank4_mask(block_mask, "block_mask", (batch, heads, blocks_q, blocks_k),
                               "[batch, heads, query blocks, key blocks]", device),
        seed=_seed(seed, dropout_rate),
        causal=causal, window_left=window_left, window_right=window_right,
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
