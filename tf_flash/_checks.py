"""Argument checks shared by the op, the layers, the Keras hook and the sparsity builders: one rule and one
message per kind of argument, each message naming the argument and the value received."""
import math
import numbers
import reprlib

import numpy as np
import tensorflow as tf

MAX_HEAD_DIM = 256  # the kernels' largest head dim (CPU and CUDA)
INT32_MAX = 2**31 - 1  # attrs and lengths are int32 in the kernels
INT32_MIN = -2**31


def is_int(value):
    """An integer that is not a bool (NumPy integers included)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def is_bool(value):
    return isinstance(value, (bool, np.bool_))


def describe(value):
    """A short description of a received value for error messages (no dump of a large array)."""
    if isinstance(value, (tf.Tensor, tf.Variable)):
        return f"<tensor shape={value.shape} dtype={value.dtype.name}>"
    if isinstance(value, np.ndarray) and value.size > 8:
        return f"<array shape={value.shape} dtype={value.dtype}>"
    return reprlib.repr(value)


def to_tensor(value, name, dtype_hint=None):
    try:
        return tf.convert_to_tensor(value, dtype_hint=dtype_hint)
    except (TypeError, ValueError) as err:
        raise ValueError(f"`{name}` must be a tensor or convertible to one. Received: {name}={describe(value)} "
                         f"({err})") from err


def check_bool(value, name, optional=False):
    """A bool (or None, when `optional`) -> bool or None."""
    if optional and value is None:
        return None
    if not is_bool(value):
        raise ValueError(f"`{name}` must be a bool{' or None' if optional else ''}. "
                         f"Received: {name}={describe(value)}")
    return bool(value)


CAUSAL_ALIGNMENTS = ("top_left", "bottom_right")


def normalize_causal(causal):
    """`causal` (a bool, "top_left" or "bottom_right") -> (causal, bottom_right), the op's two attrs."""
    if isinstance(causal, str):
        if causal not in CAUSAL_ALIGNMENTS:
            raise ValueError(f"`causal` must be a bool, \"top_left\" or \"bottom_right\". Received: causal={causal!r}")
        return True, causal == "bottom_right"
    return check_bool(causal, "causal"), False


def check_int(value, name, minimum=None, optional=False):
    """An int >= `minimum` (any int when None), or None when `optional` -> int or None."""
    if optional and value is None:
        return None
    if not is_int(value) or (minimum is not None and value < minimum):
        kind = {None: "an int", 0: "a non-negative int", 1: "a positive int"}[minimum]
        raise ValueError(f"`{name}` must be {kind}{' or None' if optional else ''}. Received: {name}={value!r}")
    return int(value)


def _is_real(value):
    return isinstance(value, numbers.Real) and not is_bool(value)


def _is_finite_non_negative(value):
    """A real number >= 0 that stays finite in float32, as the kernels read it."""
    if not _is_real(value):
        return False
    with np.errstate(over="ignore"):  # a value past float32's range is refused, not warned about
        return math.isfinite(np.float32(value)) and value >= 0


def check_rate(value, name):
    """A dropout rate: a number in [0, 1) once rounded to float32, as the kernels read it -> float."""
    if not (_is_real(value) and 0.0 <= np.float32(value) < 1.0):
        raise ValueError(f"`{name}` must be a float in [0, 1). Received: {name}={describe(value)}")
    return float(value)


def int_pair(value, side_ok):
    """An int or a pair whose sides pass `side_ok` -> (first, second) (None sides kept), else None."""
    if is_int(value) and side_ok(value):
        return int(value), int(value)
    if isinstance(value, (tuple, list)) and len(value) == 2 and all(side_ok(side) for side in value):
        return tuple(None if side is None else int(side) for side in value)
    return None


def normalize_window(window):
    """None, an int w (i sees i-w .. i+w) or (left, right) -> (left, right) with None = unlimited side."""
    if window is None:
        return None, None
    pair = int_pair(window, lambda side: side is None or (is_int(side) and 0 <= side <= INT32_MAX))
    if pair is None:
        raise ValueError("`window` must be None, an int in [0, 2**31 - 1] or a pair (left, right) of such ints "
                         f"or None (unlimited). Received: window={describe(window)}")
    return pair


def normalize_block_size(block_size):
    """A positive int or a pair of positive ints (below 2**31) -> (block_q, block_k)."""
    pair = int_pair(block_size, lambda side: is_int(side) and 0 < side <= INT32_MAX)
    if pair is None:
        raise ValueError("`block_size` must be an int in [1, 2**31 - 1] or a pair of such ints. "
                         f"Received: block_size={describe(block_size)}")
    return pair


def normalize_scale(scale):
    """The score scale -> the float the op takes: finite (float32 range) and >= 0 on every device (the op
    checks it again, cc/kernels/flash_attention_params.cc)."""
    if not _is_finite_non_negative(scale):
        raise ValueError("`scale` must be a finite float >= 0 (float32 range). "
                         f"Received: scale={describe(scale)}")
    return float(scale)


def normalize_softcap(softcap):
    """None or 0 (off), or a positive finite number -> the float the op takes (0.0 = off)."""
    if softcap is None:
        return 0.0
    if not _is_finite_non_negative(softcap):
        raise ValueError("`softcap` must be None (off) or a positive finite number. "
                         f"Received: softcap={describe(softcap)}")
    return float(softcap)


def in_xla_context():
    """Whether the call is being traced for XLA (tf.function(jit_compile=True), Keras jit_compile); never eagerly."""
    if tf.executing_eagerly():
        return False
    try:
        from tensorflow.python.ops import control_flow_util  # pylint: disable=import-outside-toplevel
        return bool(control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()))
    except (ImportError, AttributeError):  # private TF API moved: assume XLA, whose forms work outside it too
        return True


def checked(tensor, condition, *message):
    """`tensor`, after a run-time check of `condition` (for what the static shapes cannot decide); the error
    names the argument through `message`. Eager: raises at once. Under XLA, where Assert compiles to
    nothing, the op's XLA kernel checks the shapes itself: nothing is added."""
    if in_xla_context():
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


def num_blocks(seqlen, block):
    """The Size of the number of `block`-row blocks covering `seqlen` (a Size; the last block partial)."""
    return Size(None if seqlen.static is None else -(-seqlen.static // block),
                lambda: (seqlen.tensor() + block - 1) // block)


def check_lengths(lengths, name, batch, seqlen, runtime_range_check=False):
    """Validates user lengths [batch] with values in [0, seqlen] -> int32 tensor, or None if None.

    batch, seqlen: Sizes. Values known on the host are checked here (an int64 2**32 + 2 would otherwise
    wrap to 2 in int32); others: a non-int32 tensor is checked to fit int32 before the cast, and with
    runtime_range_check against [0, seqlen] at run time (else the CPU kernel checks the range; the GPU
    kernels clamp to it)."""
    if lengths is None:
        return None
    tensor = to_tensor(lengths, name)
    if not tensor.dtype.is_integer:
        raise ValueError(f"`{name}` must be an integer tensor [batch]. Received: {name} of dtype "
                         f"{tensor.dtype.name} ({name}={describe(lengths)})")
    if tensor.shape.rank is not None and tensor.shape.rank != 1:
        raise ValueError(f"`{name}` must have shape [batch]. Received: {name}.shape={tensor.shape}")
    size_static = tensor.shape[0] if tensor.shape.rank == 1 else None
    if size_static is not None and batch.static is not None:
        if size_static != batch.static:
            raise ValueError(f"`{name}` must have shape [batch] = [{batch.static}]. "
                             f"Received: {name}.shape={tensor.shape}")
    else:
        tensor = checked(tensor, tf.equal(tf.size(tensor), batch.tensor()),
                         f"`{name}` must have shape [batch]: batch, then {name}.shape:", batch.tensor(),
                         tf.shape(tensor))
    upper = seqlen.static if seqlen.static is not None else INT32_MAX
    values = _static_value(tensor)
    if values is not None:
        for index, length in enumerate(np.asarray(values).reshape(-1)):
            if not 0 <= int(length) <= upper:
                raise ValueError(f"`{name}[{index}]` must be in [0, {upper}] (the sequence length). "
                                 f"Received: {name}[{index}]={int(length)}")
        return tf.cast(tensor, tf.int32)
    if tensor.dtype != tf.int32:
        wide = tf.cast(tensor, tf.int64)
        tensor = checked(tensor, tf.reduce_all((wide >= 0) & (wide <= INT32_MAX)),
                         f"`{name}` must hold values in [0, 2**31 - 1]. Received: {name}=", tensor)
    if runtime_range_check:
        wide = tf.cast(tensor, tf.int64)
        tensor = checked(tensor, tf.reduce_all((wide >= 0) & (wide <= tf.cast(seqlen.tensor(), tf.int64))),
                         f"`{name}` must hold values in [0, seq length]: seq length, then {name}:",
                         seqlen.tensor(), tensor)
    return tf.cast(tensor, tf.int32)


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
    return checked(tensor, ok,
                   f"`{name}` must have shape {what} (each axis {allowed}that size): that shape, then "
                   f"{name}.shape:", full_dynamic, shape)


def _is_segment_pair(segment_ids):
    """Whether a `segment_ids` call argument is the (query ids, key ids) pair: a tuple of two, or a list of
    two tensors or arrays (a list of two lists of ints is one [2, S] array of ids)."""
    if isinstance(segment_ids, tuple):
        return True
    return (isinstance(segment_ids, list) and len(segment_ids) == 2
            and all(hasattr(ids, "shape") for ids in segment_ids))  # tensors, arrays, Keras tensors


def _segment_tensor(ids, name, batch, seqlen, what):
    """One tensor of segment ids, [batch, seqlen] integers; its shape and dtype checked under `name`."""
    tensor = to_tensor(ids, name)
    if not tensor.dtype.is_integer:
        raise ValueError(f"`{name}` must be an integer tensor ({what}: a document id per token). "
                         f"Received: {name} of dtype {tensor.dtype.name} ({name}={describe(ids)})")
    if tensor.shape.rank is not None and tensor.shape.rank != 2:
        raise ValueError(f"`{name}` must have shape {what}. Received: {name}.shape={tensor.shape}")
    if tensor.shape.rank is None:
        tensor = tf.ensure_shape(
            checked(tensor, tf.equal(tf.rank(tensor), 2),
                            f"`{name}` must have shape {what}. Received: {name}.shape=", tf.shape(tensor)),
            [None, None])
    # Other integer dtypes (tf.data's int64) go on as they are: the op checks that they fit int32.
    return check_dims(tensor, name, (batch, seqlen), what)


def check_segment_ids(segment_ids, batch, seqlen_q, seqlen_k):
    """`segment_ids` (the op's argument, the layers' call argument) -> (query ids [B, Sq], key ids [B, Sk]),
    integer, checked under the argument's name; None passes. One tensor [B, S] holds the ids of self-attention (Sq == Sk: the same
    tensor is returned twice); a pair (q_segment_ids, kv_segment_ids) those of cross-attention.
    batch, seqlen_q, seqlen_k: Sizes."""
    if segment_ids is None:
        return None
    if _is_segment_pair(segment_ids):
        if len(segment_ids) != 2:
            raise ValueError("`segment_ids` must be one int tensor [batch, seq] (self-attention) or a pair "
                             "(q_segment_ids [batch, seq_q], kv_segment_ids [batch, seq_k]). Received: a "
                             f"{type(segment_ids).__name__} of {len(segment_ids)} (segment_ids="
                             f"{describe(segment_ids)})")
        # The op's names for the two halves of the pair.
        return (_segment_tensor(segment_ids[0], "q_segment_ids", batch, seqlen_q, "[batch, seq_q]"),
                _segment_tensor(segment_ids[1], "kv_segment_ids", batch, seqlen_k, "[batch, seq_k]"))
    if seqlen_q.static is not None and seqlen_k.static is not None and seqlen_q.static != seqlen_k.static:
        raise ValueError("`segment_ids` as one tensor is for self-attention (query and key of one length); for "
                         "a query and keys of different lengths give a pair (q_segment_ids [batch, seq_q], "
                         f"kv_segment_ids [batch, seq_k]). Received: seq_q={seqlen_q.static}, "
                         f"seq_k={seqlen_k.static}, segment_ids={describe(segment_ids)}")
    ids = _segment_tensor(segment_ids, "segment_ids", batch, seqlen_q, "[batch, seq]")
    if seqlen_q.static is None or seqlen_k.static is None:
        ids = check_dims(ids, "segment_ids", (batch, seqlen_k), "[batch, seq] (key length)")
    return ids, ids
