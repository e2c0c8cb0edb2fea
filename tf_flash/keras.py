"""Keras' own flash-attention switch, served by tf_flash on the TensorFlow backend.

Keras 3 has the switch users reach for (`keras.ops.dot_product_attention(..., flash_attention=True)`,
`keras.config.enable_flash_attention()`, `MultiHeadAttention(flash_attention=True)`), but its TensorFlow
backend raises "Flash attention is not supported in tensorflow backend." After

    import tf_flash
    tf_flash.keras.enable()            # or: with tf_flash.keras.enabled(): ...

those calls run tf_flash's kernels with Keras' semantics. `flash_attention=True` asks for it;
`flash_attention=None` (the default of the op, MultiHeadAttention and KerasHub models) uses it unless
`keras.config.disable_flash_attention()` is set, as None means "use flash when possible" on JAX.
What tf_flash cannot serve (an additive `bias`, float64, head dims > 256, a non-boolean mask, ...)
takes Keras' standard path with a one-time warning that says why.

What is patched (every patch is undone by `disable()`, which restores the original objects):
  * `keras.src.backend.tensorflow.nn.dot_product_attention`: the TF backend function all of Keras
    dispatches to (keras.ops, MultiHeadAttention, GroupedQueryAttention, KerasHub layers).
  * `dot_product_attention` in `keras.src.ops.nn` and the modules that re-export it (`keras.ops`,
    `keras.ops.nn`, ...): Keras rejects `attn_logits_soft_cap` off JAX-on-TPU before dispatching to
    the backend; the wrapper lets it through to the backend function above, which serves it.
  * `MultiHeadAttention.__init__` / `_compute_attention`: Keras refuses dropout with flash attention
    and sends dropout > 0 down the einsum path; with tf_flash's Philox dropout (drawn in the kernel,
    regenerated in the backward) the layer runs flash attention with dropout too.
  * KerasHub's `fused_attention_op_available()` gate (False on TF), in every keras_hub module that
    imported it, and in modules imported later.
"""
import contextlib
import functools
import importlib.abc
import inspect
import math
import numbers
import os
import sys
import warnings

import numpy as np
import tensorflow as tf

from tf_flash import _checks
from tf_flash import _masks
from tf_flash import ops as _flash_ops

__all__ = ["enable", "disable", "enabled", "is_enabled", "TESTED_KERAS_VERSIONS"]

# Keras minor versions whose internals this module was read against and tested with.
TESTED_KERAS_VERSIONS = ("3.15",)
# Set to "1" to enable the hook on an untested Keras; the internals are still checked.
_ALLOW_UNTESTED_ENV = "TF_FLASH_KERAS_ALLOW_UNTESTED"

_FLASH_DTYPES = ("float32", "float16", "bfloat16")
_OP_PARAMETERS = ["query", "key", "value", "bias", "mask", "scale", "is_causal", "flash_attention",
                  "attn_logits_soft_cap"]
_MHA_COMPUTE_PARAMETERS = ["self", "query", "key", "value", "attention_mask", "training",
                           "return_attention_scores", "use_causal_mask"]
_KERAS_HUB_UTILS = "keras_hub.src.utils.keras_utils"
_KERAS_HUB_GATE = "fused_attention_op_available"

# (owner, attribute, original, replacement) of every patch in force; empty when disabled.
_patches = []
_warned = set()
_hub_finder = None


# ----------------------------------------------------------------------------------------------------
# Public switch

def is_enabled():
    """Whether the hook is in force."""
    return bool(_patches)


def enable():
    """Serves Keras' flash-attention switch with tf_flash (TensorFlow backend). Idempotent."""
    if _patches:
        return
    internals = _keras_internals()
    backend_nn, op_module, mha_class = internals["backend_nn"], internals["op_module"], internals["mha"]
    original_backend = backend_nn.dot_product_attention
    original_op = op_module.dot_product_attention
    _ORIGINALS.update(backend=original_backend, op=original_op, mha_init=mha_class.__init__,
                      mha_compute=mha_class._compute_attention)

    try:
        _patch(backend_nn, "dot_product_attention", _backend_dot_product_attention)
        for module in _modules_holding("keras", "dot_product_attention", original_op):
            _patch(module, "dot_product_attention", _op_dot_product_attention)
        _patch(mha_class, "__init__", _mha_init)
        _patch(mha_class, "_compute_attention", _mha_compute_attention)
        _enable_keras_hub_gate()
    except BaseException:
        disable()  # all or nothing
        raise


def disable():
    """Restores Keras' own functions (the very objects that were replaced). Idempotent."""
    global _hub_finder
    if _hub_finder is not None:
        if _hub_finder in sys.meta_path:
            sys.meta_path.remove(_hub_finder)
        _hub_finder = None
    while _patches:
        owner, name, original, _ = _patches.pop()
        setattr(owner, name, original)
    # keras_hub modules imported while enabled bound the patched gate themselves: give them KerasHub's.
    if "hub_gate" in _ORIGINALS:
        for module in _modules_holding("keras_hub", _KERAS_HUB_GATE, _fused_attention_op_available):
            setattr(module, _KERAS_HUB_GATE, _ORIGINALS["hub_gate"])


@contextlib.contextmanager
def enabled():
    """`with tf_flash.keras.enabled():` the hook is in force inside, and as before after the block."""
    was_enabled = is_enabled()
    enable()
    try:
        yield
    finally:
        if not was_enabled:
            disable()


# ----------------------------------------------------------------------------------------------------
# Keras internals: located and checked in one place

_ORIGINALS = {}


def _keras_internals():
    import keras  # pylint: disable=import-outside-toplevel

    backend = keras.config.backend()
    if backend != "tensorflow":
        raise ValueError("tf_flash.keras serves Keras' TensorFlow backend only. "
                         f"Received: keras.config.backend()={backend!r}")
    version = ".".join(keras.__version__.split(".")[:2])
    if version not in TESTED_KERAS_VERSIONS and os.environ.get(_ALLOW_UNTESTED_ENV) != "1":
        raise RuntimeError(
            f"tf_flash.keras patches Keras internals it was tested against on Keras "
            f"{', '.join(v + '.x' for v in TESTED_KERAS_VERSIONS)}. Received: keras.__version__="
            f"{keras.__version__!r}. Set {_ALLOW_UNTESTED_ENV}=1 to try it anyway (the internals it "
            f"needs are still checked), or use tf_flash.layers.FlashMultiHeadAttention.")
    try:
        from keras.src.backend.tensorflow import nn as backend_nn  # pylint: disable=import-outside-toplevel
        from keras.src.ops import nn as op_module  # pylint: disable=import-outside-toplevel
        from keras.src.layers.attention.multi_head_attention import (  # pylint: disable=import-outside-toplevel
            MultiHeadAttention)
    except ImportError as err:
        raise RuntimeError(_moved(keras, f"a module moved ({err})")) from err
    checks = (
        (backend_nn, "dot_product_attention", _OP_PARAMETERS),
        (op_module, "dot_product_attention", _OP_PARAMETERS),
        (MultiHeadAttention, "_compute_attention", _MHA_COMPUTE_PARAMETERS),
    )
    for owner, name, expected in checks:
        function = getattr(owner, name, None)
        if function is None or list(inspect.signature(function).parameters) != expected:
            raise RuntimeError(_moved(keras, f"{owner.__name__}.{name} is missing or has another signature"))
    for owner, name in ((op_module, "DotProductAttention"), (op_module, "any_symbolic_tensors")):
        if not hasattr(owner, name):
            raise RuntimeError(_moved(keras, f"{owner.__name__}.{name} is missing"))
    init_parameters = inspect.signature(MultiHeadAttention.__init__).parameters
    if "dropout" not in init_parameters or "flash_attention" not in init_parameters:
        raise RuntimeError(_moved(keras, "MultiHeadAttention.__init__ lost `dropout` or `flash_attention`"))
    return {"backend_nn": backend_nn, "op_module": op_module, "mha": MultiHeadAttention}


def _moved(keras, what):
    return (f"tf_flash.keras cannot hook this Keras ({keras.__version__}): {what}. It was written "
            f"against Keras {', '.join(TESTED_KERAS_VERSIONS)}; use tf_flash.layers instead.")


def _patch(owner, name, replacement):
    original = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
    _patches.append((owner, name, original, replacement))
    setattr(owner, name, replacement)


def _modules_holding(prefix, name, value):
    """Loaded modules of package `prefix` whose attribute `name` is `value` (re-exports included)."""
    found = []
    for module_name, module in list(sys.modules.items()):
        if module is None or not (module_name == prefix or module_name.startswith(prefix + ".")):
            continue
        if getattr(module, name, None) is value:
            found.append(module)
    return found


# ----------------------------------------------------------------------------------------------------
# The backend function and the op wrapper

def _wants_flash(flash_attention):
    """Keras' argument: True asks for flash; None means "when possible" unless the global switch is off."""
    if flash_attention is None:
        import keras  # pylint: disable=import-outside-toplevel
        return keras.config.is_flash_attention_enabled() is not False
    return bool(flash_attention)


def _warn_once(reason):
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"tf_flash.keras: Keras' standard attention runs instead of flash attention: {reason}.",
                      stacklevel=3)


def _backend_dot_product_attention(query, key, value, bias=None, mask=None, scale=None, is_causal=False,
                                   flash_attention=None, attn_logits_soft_cap=None):
    """keras.src.backend.tensorflow.nn.dot_product_attention, with flash attention served by tf_flash."""
    if _wants_flash(flash_attention):
        output, reason = _flash_or_reason(query, key, value, bias=bias, mask=mask, scale=scale,
                                          is_causal=is_causal, soft_cap=attn_logits_soft_cap)
        if reason is None:
            return output
        if attn_logits_soft_cap is not None:
            raise ValueError("`attn_logits_soft_cap` on the TensorFlow backend is served by tf_flash's "
                             f"kernels only, and they cannot serve this call: {reason}. Received: "
                             f"attn_logits_soft_cap={attn_logits_soft_cap!r}")
        if reason is not _DELEGATE:
            _warn_once(reason)
    elif attn_logits_soft_cap is not None:
        raise ValueError("`attn_logits_soft_cap` on the TensorFlow backend is served by tf_flash's kernels "
                         "only, and flash attention is off for this call (flash_attention=False, or None "
                         "with keras.config.disable_flash_attention()). Received: "
                         f"flash_attention={flash_attention!r}, attn_logits_soft_cap={attn_logits_soft_cap!r}")
    return _ORIGINALS["backend"](query, key, value, bias=bias, mask=mask, scale=scale, is_causal=is_causal,
                                 flash_attention=False)


def _op_dot_product_attention(query, key, value, bias=None, mask=None, scale=None, is_causal=False,
                              flash_attention=None, attn_logits_soft_cap=None):
    """keras.ops.dot_product_attention; with a soft cap it dispatches as Keras does, minus Keras'
    JAX-on-TPU-only check (the backend function above serves the soft cap)."""
    if attn_logits_soft_cap is None:
        return _ORIGINALS["op"](query, key, value, bias=bias, mask=mask, scale=scale, is_causal=is_causal,
                                flash_attention=flash_attention)
    from keras.src.ops import nn as op_module  # pylint: disable=import-outside-toplevel
    if op_module.any_symbolic_tensors((query, key, value)):
        return op_module.DotProductAttention(
            is_causal=is_causal, flash_attention=flash_attention, attn_logits_soft_cap=attn_logits_soft_cap,
        ).symbolic_call(query, key, value, bias=bias, mask=mask, scale=scale)
    return _backend_dot_product_attention(query, key, value, bias=bias, mask=mask, scale=scale,
                                          is_causal=is_causal, flash_attention=flash_attention,
                                          attn_logits_soft_cap=attn_logits_soft_cap)


# Reason returned for inputs Keras' own function rejects: it runs to raise its own error, no warning.
_DELEGATE = "Keras' own checks reject these inputs"


def _repeated_heads_source(tensor):
    """In a graph, the [B, S, Hkv, D] tensor whose heads `tensor` repeats (tf.repeat(x, G, axis=2): KerasHub's
    Llama, Mistral, Mixtral, Phi-3 and Qwen attention repeat K and V to every query head), else None.
    tf.repeat is ExpandDims at axis 3, Tile by G on that axis, Reshape; the static shapes prove it, so head
    h * G + j of `tensor` is head h of the source, which is what the kernels' GQA reads. The attention then
    reads K and V once instead of G times, and the repeat, with no other reader, is pruned (at 32k keys,
    KerasHub's repeat and the attention's reads of it are about half of a decoding step's cache traffic)."""
    if tf.executing_eagerly() or not hasattr(tensor, "op") or tensor.op.type != "Reshape":
        return None
    tiled = tensor.op.inputs[0]
    if tiled.op.type != "Tile" or tiled.op.inputs[0].op.type != "ExpandDims":
        return None
    expanded = tiled.op.inputs[0]
    source = expanded.op.inputs[0]
    axis = tf.get_static_value(expanded.op.inputs[1])
    # The multiples as far as they are static: 1 but on the new axis, whose count (G) the tile's shape holds.
    multiples = tf.get_static_value(tiled.op.inputs[1], partial=True)
    if (source.shape.rank != 4 or axis is None or np.ndim(axis) != 0 or int(axis) not in (3, -2)
            or tiled.shape.rank != 5 or tiled.shape[3] is None or multiples is None or np.size(multiples) != 5
            or any(multiples[i] is None or int(multiples[i]) != 1 for i in (0, 1, 2, 4))):
        return None
    heads = None if source.shape[2] is None else source.shape[2] * tiled.shape[3]
    if tensor.shape.rank != 4 or not tensor.shape[2:].is_compatible_with([heads, source.shape[3]]):
        return None
    # The source with `tensor`'s batch and sequence axes (tf.repeat keeps them: then a no-op; any reshape
    # that regroups them keeps each position's heads together, so this regroups alike).
    grouped = tf.reshape(source, tf.concat([tf.shape(tensor)[:2], tf.shape(source)[2:]], axis=0))
    grouped.set_shape(tensor.shape[:2].concatenate(source.shape[2:]))
    return grouped


def _flash_or_reason(query, key, value, *, bias, mask, scale, is_causal, soft_cap, dropout_rate=0.0,
                     seed=None):
    """(output, None) computed by tf_flash with Keras' semantics, or (None, why it cannot serve)."""
    from keras.src import backend as keras_backend  # pylint: disable=import-outside-toplevel

    query, key, value = (tf.convert_to_tensor(x) for x in (query, key, value))
    if any(x.shape.rank != 4 for x in (query, key, value)):
        return None, _DELEGATE
    key_source, value_source = _repeated_heads_source(key), _repeated_heads_source(value)
    if (key_source is not None and value_source is not None and key_source.shape[2] is not None
            and key_source.shape[2] == value_source.shape[2]):
        key, value = key_source, value_source
    if bias is not None:
        return None, "an additive `bias` was given (tf_flash takes boolean masks only)"
    compute_dtype = keras_backend.result_type(query.dtype, key.dtype, value.dtype)
    if compute_dtype not in _FLASH_DTYPES:
        return None, f"the inputs compute in {compute_dtype} (tf_flash takes {', '.join(_FLASH_DTYPES)})"
    heads, heads_kv = query.shape[2], key.shape[2]
    head_dim, head_dim_k, head_dim_v = query.shape[3], key.shape[3], value.shape[3]
    if None in (heads, heads_kv, head_dim, head_dim_k, head_dim_v):
        return None, "the head count or head dim is not known statically"
    if head_dim != head_dim_k or heads_kv == 0 or heads % heads_kv or value.shape[2] != heads_kv:
        return None, _DELEGATE
    if max(head_dim, head_dim_v) > _checks.MAX_HEAD_DIM:
        return None, f"head dim {max(head_dim, head_dim_v)} > {_checks.MAX_HEAD_DIM}"
    scale = _python_scale(scale, head_dim)
    if scale is None:
        return None, "`scale` is a symbolic tensor (tf_flash takes a Python number)"
    if mask is not None:
        mask = tf.convert_to_tensor(mask)
        if mask.dtype != tf.bool:
            return None, _DELEGATE  # Keras' logical_and rejects a non-boolean mask
        if mask.shape.rank is None or mask.shape.rank > 4:
            return None, _DELEGATE
        if mask.shape.rank < 2:
            mask = tf.reshape(mask, [1] * (2 - mask.shape.rank) + ([-1] if mask.shape.rank == 1 else []))
    if soft_cap is not None and (_checks.is_bool(soft_cap) or not isinstance(soft_cap, numbers.Real)
                                 or not math.isfinite(soft_cap) or soft_cap <= 0):
        raise ValueError("`attn_logits_soft_cap` must be None or a positive finite number. "
                         f"Received: attn_logits_soft_cap={soft_cap!r}")

    query, key, value = (tf.cast(x, compute_dtype) for x in (query, key, value))
    attend = functools.partial(_flash_ops.flash_attention, query, key, value, causal=bool(is_causal), scale=scale,
                               softcap=soft_cap, dropout_rate=dropout_rate, seed=seed, return_lse=True)
    rows_seeing_keys = None  # [B|1, 1, T, 1] with a padding product: rows that see some key
    if mask is None:
        output, lse = attend()
    elif mask.shape.rank == 4 and mask.shape[1] == 1 and mask.shape[2] == 1:
        output, lse = _attend_with_key_mask(attend, mask, tf.shape(key)[:2])
    elif mask.shape.rank == 4 and mask.shape[1] == 1:
        (output, lse), rows_seeing_keys = _attend_with_padding_product(attend, mask, tf.shape(key)[:2],
                                                                       try_causal=not is_causal)
    else:
        output, lse = attend(attention_mask=mask)
    if mask is not None:
        masked_rows = None
        if rows_seeing_keys is not None:
            masked_rows = tf.logical_not(tf.transpose(rows_seeing_keys, [0, 2, 1, 3]))  # [B|1, T, 1, 1]
        output = _masks.fill_empty_rows(output, lse, value, masked_rows)
    return output, None


def _attend_with_key_mask(attend, mask, key_shape):
    """attend() under a [B|1, 1, 1, S|1] key mask (KerasHub's padding masks and its decoding steps' cache
    masks), with kv lengths so that the kernels skip the padding at the end: the lengths alone when the mask
    is a prefix per batch row, else the lengths and the mask (the kernels read one row per tile). In a graph,
    one call with no branch: the mask goes in all True where it is a prefix. A tf.cond would wait for its
    predicate on the host (the GPU runtimes copy it there), in every layer of every decoding step.
    key_shape: (batch, keys) of the key tensor (a mask broadcast over the keys covers all of them)."""
    batch, size = key_shape[0], key_shape[1]
    keys = tf.broadcast_to(mask[:, 0, 0, :], tf.stack([tf.shape(mask)[0], size]))
    lengths, is_prefix = _masks.prefix_lengths(keys)
    kv_lengths = tf.broadcast_to(lengths, tf.reshape(batch, [1]))
    if tf.executing_eagerly():
        return attend(**({} if bool(is_prefix) else {"attention_mask": mask}), kv_lengths=kv_lengths)
    return attend(attention_mask=tf.logical_or(keys, is_prefix)[:, None, None, :], kv_lengths=kv_lengths)


def _attend_with_padding_product(attend, mask, key_shape, try_causal):
    """attend() under a [B|1, 1, T, S] mask. When the mask is the product of a query mask and a key mask
    (what Keras' masking builds from padding: query_mask[:, :, None] & value_mask[:, None, :]), or, with
    try_causal, that product with the causal triangle (a decoder's padding and causal masks merged, as
    Keras' MultiHeadAttention(use_causal_mask=True) and KerasHub's decoders build them), it runs under the
    key mask alone, causal in the second case (_attend_with_key_mask: kv lengths or one mask row per tile,
    where a [T, S] mask is read entry by entry, several times the unmasked kernels' time on the GPU); the
    query rows that see no key are returned for the caller to fill as empty rows. Any other mask runs as
    given. Returns ((output, lse), rows [B|1, 1, T, 1])."""
    rows = tf.reduce_any(mask, axis=3, keepdims=True)
    keys = tf.reduce_any(mask, axis=2, keepdims=True)
    product = tf.logical_and(rows, keys)
    is_product = tf.reduce_all(tf.equal(mask, product))
    as_given = lambda: attend(attention_mask=mask)  # pylint: disable=unnecessary-lambda-assignment
    if try_causal:
        # Top-left aligned, as tf_flash's causal (query i sees keys j <= i); the derived rows and keys make
        # the test exact: where it holds, causal attention under `keys` sees what the mask shows.
        shape = tf.shape(mask)
        lower = tf.cast(tf.linalg.band_part(tf.ones(shape[2:], tf.int8), -1, 0), tf.bool)
        is_causal_product = tf.reduce_all(tf.equal(mask, tf.logical_and(product, lower)))
        causal_key_mask = lambda: _attend_with_key_mask(  # pylint: disable=unnecessary-lambda-assignment
            functools.partial(attend, causal=True), keys, key_shape)
        otherwise = lambda: tf.cond(is_causal_product, causal_key_mask, as_given)  # pylint: disable=unnecessary-lambda-assignment
    else:
        otherwise = as_given
    result = tf.cond(is_product, lambda: _attend_with_key_mask(attend, keys, key_shape), otherwise)
    return result, rows


def _python_scale(scale, head_dim):
    if scale is None:
        return 1.0 / float(head_dim) ** 0.5
    if isinstance(scale, numbers.Real) or (isinstance(scale, np.ndarray) and scale.ndim == 0):
        return float(scale)
    if isinstance(scale, tf.Tensor) and hasattr(scale, "numpy") and scale.shape.rank == 0:
        return float(scale.numpy())  # an eager tensor
    return None


# ----------------------------------------------------------------------------------------------------
# MultiHeadAttention: flash attention with dropout

def _mha_init(self, *args, **kwargs):
    """MultiHeadAttention.__init__ without Keras' "Dropout is not supported when flash attention is
    enabled" error: tf_flash serves dropout inside the kernel (see _mha_compute_attention)."""
    arguments = inspect.signature(_ORIGINALS["mha_init"]).bind(self, *args, **kwargs).arguments
    dropout = arguments.get("dropout", 0.0)
    flash_attention = arguments.get("flash_attention")
    if flash_attention and dropout and dropout > 0.0:
        arguments["dropout"] = 0.0
        extra = arguments.pop("kwargs", {})
        arguments.pop("self")
        _ORIGINALS["mha_init"](self, **arguments, **extra)
        self._dropout = dropout  # read by build (the Dropout sublayer), get_config and the attention
        return
    _ORIGINALS["mha_init"](self, *args, **kwargs)


def _mha_compute_attention(self, query, key, value, attention_mask=None, training=None,
                           return_attention_scores=False, use_causal_mask=False):
    """MultiHeadAttention._compute_attention: with dropout > 0 and flash on, tf_flash with its in-kernel
    dropout instead of Keras' einsum path; everything else as Keras (whose dot_product_attention call
    reaches the hooked backend function)."""
    original = _ORIGINALS["mha_compute"]
    if (self._dropout > 0.0 and not return_attention_scores and len(query.shape) == 4
            and _wants_flash(self._flash_attention) and not isinstance(training, tf.Tensor)):
        from keras.src import ops  # pylint: disable=import-outside-toplevel
        mask = attention_mask
        if mask is not None:
            # Keras' broadcast of a [B, T, S] mask to [B, N, T, S] (MultiHeadAttention._compute_attention).
            axis = -len(self._attention_axes) * 2 - 1
            for _ in range(4 - len(mask.shape)):
                mask = ops.expand_dims(mask, axis=axis)
            mask = ops.cast(mask, "bool")
        rate, seed = 0.0, None
        if training:
            rate = float(self._dropout)
            seed = tf.cast(self._dropout_layer.seed_generator.next(), tf.int64)
        output, reason = _flash_or_reason(query, key, value, bias=None, mask=mask,
                                          scale=self._inverse_sqrt_key_dim, is_causal=use_causal_mask,
                                          soft_cap=None, dropout_rate=rate, seed=seed)
        if reason is None:
            return output, None
        if reason is not _DELEGATE:
            _warn_once(reason)
    return original(self, query, key, value, attention_mask=attention_mask, training=training,
                    return_attention_scores=return_attention_scores, use_causal_mask=use_causal_mask)


# ----------------------------------------------------------------------------------------------------
# KerasHub's gate

def _fused_attention_op_available():
    """keras_hub's gate: True on the TensorFlow backend while the hook is in force."""
    import keras  # pylint: disable=import-outside-toplevel
    if _patches and keras.config.backend() == "tensorflow":
        return True
    return _ORIGINALS["hub_gate"]()


def _patch_keras_hub_gate(utils_module):
    original = getattr(utils_module, _KERAS_HUB_GATE, None)
    if original is None or original is _fused_attention_op_available:
        return
    _ORIGINALS["hub_gate"] = original
    # Model modules bind the gate by name (`from ...keras_utils import fused_attention_op_available`).
    for module in [utils_module] + _modules_holding("keras_hub", _KERAS_HUB_GATE, original):
        if getattr(module, _KERAS_HUB_GATE) is original:
            _patch(module, _KERAS_HUB_GATE, _fused_attention_op_available)


class _KerasHubGateFinder(importlib.abc.MetaPathFinder):
    """Patches the gate right after keras_hub's keras_utils module runs, before any model module binds it
    (for keras_hub imported after enable())."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _KERAS_HUB_UTILS:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchingLoader(spec.loader)
                return spec
        return None


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        if _patches:
            _patch_keras_hub_gate(module)


def _enable_keras_hub_gate():
    global _hub_finder
    utils_module = sys.modules.get(_KERAS_HUB_UTILS)
    if utils_module is not None:
        _patch_keras_hub_gate(utils_module)
    else:
        _hub_finder = _KerasHubGateFinder()
        sys.meta_path.insert(0, _hub_finder)
