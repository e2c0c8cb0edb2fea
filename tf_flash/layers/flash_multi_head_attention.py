"""`FlashMultiHeadAttention`: a drop-in replacement for `keras.layers.MultiHeadAttention`."""
import math
import string

import keras
import tensorflow as tf
from keras import constraints
from keras import initializers
from keras import regularizers

from tf_flash import _checks
from tf_flash import parallel
from tf_flash.layers import _common

try:  # Keras keeps these private; they are what its own MultiHeadAttention uses.
    from keras.src.backend import get_keras_mask as _get_keras_mask
    from keras.src.backend import set_keras_mask as _set_keras_mask
except ImportError:  # pragma: no cover
    def _get_keras_mask(tensor):
        return getattr(tensor, "_keras_mask", None)

    def _set_keras_mask(tensor, mask):
        try:
            tensor._keras_mask = mask  # pylint: disable=protected-access
        except AttributeError:
            pass


@keras.saving.register_keras_serializable(package="tf_flash")
@_common.read_only_properties("num_heads", "key_dim", "value_dim", "num_key_value_heads", "use_bias", "attention_axes",
                              "query_dense", "key_dense", "value_dense", "output_dense")
class FlashMultiHeadAttention(_common.FlashOptionsLayer):
    """Multi-head attention computed by `tf_flash.flash_attention`: a drop-in for
    `keras.layers.MultiHeadAttention` (Keras 3.15).

    Same constructor arguments, `call` signature, sublayers (`query`, `key`, `value`, `gate`,
    `attention_output`, EinsumDense with the same equations) and weight shapes as Keras'
    MultiHeadAttention: weights move both ways with `get_weights`/`set_weights` (of the layers or of
    two models of the same topology; a `.weights.h5` file keys layers by class name, so it does not
    load across the two classes), and with the same weights both layers give the same outputs and
    gradients up to float rounding. The [Sq, Sk] score matrix is never materialized, except for
    `return_attention_scores=True`. Saved models (`.keras`, SavedModel) load after `import tf_flash`.

    Args (Keras' MultiHeadAttention):
        num_heads, key_dim, value_dim, dropout, use_bias, output_shape, sliding_window,
        kernel_initializer, bias_initializer, kernel_regularizer, bias_regularizer,
        activity_regularizer, kernel_constraint, bias_constraint, use_gate, seed: as in Keras.
        attention_axes: only attention over the sequence axis of [batch, seq, features] inputs
            (None, 1 or -2, Keras' default for rank-3 inputs). Anything else raises ValueError.
        flash_attention: accepted for compatibility and ignored: this layer always runs the
            tf_flash kernel (on CPU and GPU, with dropout and masks).

    Args (tf_flash extras):
        num_key_value_heads: grouped-query attention: the `key`/`value` projections produce this
            many heads (must divide `num_heads`), shared by groups of query heads. None =
            `num_heads` (then the weights are exactly Keras' MultiHeadAttention's).
        window: (left, right): query i sees keys i-left .. i+right (None on a side = unlimited), or
            an int w for (w, w). Keras' `sliding_window=w` is window (w-1, w-1); give one of them.
        block_mask: optional static block-sparse pattern, bool [nqb, nkb], [H, nqb, nkb] or
            [B, H, nqb, nkb] (see `tf_flash.sparsity`); False blocks are skipped. A `block_mask`
            given to `call` replaces it for that call.
        block_size: int or (bq, bk): the blocks `block_mask` describes.
        softcap: logit soft-capping: scaled scores s -> softcap * tanh(s / softcap) before the
            softmax (Gemma 2); None = off. Returned attention scores are capped the same way.
        deterministic: bit-identical gradients for identical inputs (GPU: dQ summed in a fixed
            order); None follows `tf.config.experimental.enable_op_determinism()`.
        context_parallel: when called inside the replica function of a `tf.distribute` strategy with
            several replicas, the inputs are this replica's shards of the sequence ("zigzag" layout,
            `tf_flash.parallel.shard_sequence`) and the attention runs over the whole sequence
            (`tf_flash.parallel.context_parallel_attention`); padding masks are the shards' masks.
            `attention_mask`, `segment_ids` and `return_attention_scores` are then refused, and with
            dropout the sequence length must be a multiple of 32 x replicas. Elsewhere the layer is
            unchanged.
            See docs/parallel.md.

    Call arguments: those of Keras' MultiHeadAttention (query, value, key, query_mask, value_mask,
        key_mask, attention_mask, return_attention_scores, training, use_causal_mask) plus
        `block_mask` and `segment_ids` (packed documents: int [B, S] for self-attention, or a pair
        (q_segment_ids [B, Sq], kv_segment_ids [B, Sk]); a query sees a key only where their ids are
        equal, AND every other mask, causal staying on row positions; refused with
        context_parallel=True in a replica context). Keras padding masks (e.g. from
        `Embedding(mask_zero=True)`) arrive as query_mask/value_mask/key_mask; prefix masks (padding
        at the end) become sequence lengths and the kernel skips the padding; other patterns go
        through the general mask path.

    Differences from Keras' MultiHeadAttention (all documented choices):
        - `dropout` drops entries of the attention probabilities like Keras, but with the kernel's
          Philox generator fed by a `keras.random.SeedGenerator`: the same seeding behaviour, not the
          same random mask as Keras' Dropout layer, and the rate in steps of 1/256 (0.1 drops with
          probability 26/256; kept entries are scaled by 256/230, so the expectation is unchanged).
        - `return_attention_scores=True` computes the [B, H, Sq, Sk] scores explicitly in float32
          (O(Sq * Sk) memory and time, the cost flash attention otherwise avoids); the output still
          comes from the kernel. The scores are the pre-dropout probabilities, as in Keras.
        - An explicit `query_mask` argument is honoured (Keras 3.15 replaces it with the Keras mask
          of `query`).
        - Query rows with nothing to attend to (masked query rows, fully masked rows) give what
          Keras gives: the mean of the values when `dropout == 0` and scores are not returned
          (Keras' default path: a uniform softmax over masked logits), zeros otherwise (Keras'
          explicit path). Keras propagates the query mask so these rows are normally ignored.
        - Inputs must be [batch, seq, features] (Keras also accepts higher ranks with several
          attention axes).
        - XLA: the layer sets `supports_jit = True`, so `compile()` with the default
          `jit_compile="auto"` compiles the model with XLA on a GPU, and `jit_compile=True` works on
          every device; the attention lowers to custom calls to tf_flash's kernels (never to dense
          attention), and XLA fuses the projections, norms and optimizer around it.
    """

    def __init__(self, num_heads, key_dim, value_dim=None, dropout=0.0, use_bias=True,
                 output_shape=None, attention_axes=None, sliding_window=None, flash_attention=None,
                 kernel_initializer="glorot_uniform", bias_initializer="zeros",
                 kernel_regularizer=None, bias_regularizer=None, activity_regularizer=None,
                 kernel_constraint=None, bias_constraint=None, use_gate=False, seed=None,
                 num_key_value_heads=None, window=None, block_mask=None, block_size=128, softcap=None,
                 deterministic=None, context_parallel=False, **kwargs):
        num_heads = _checks.check_int(num_heads, "num_heads", minimum=1)
        key_dim = _checks.check_int(key_dim, "key_dim", minimum=1)
        value_dim = _checks.check_int(value_dim, "value_dim", minimum=1, optional=True)
        num_key_value_heads = _checks.check_int(num_key_value_heads, "num_key_value_heads", minimum=1,
                                                optional=True)
        if num_key_value_heads is not None and num_heads % num_key_value_heads:
            raise ValueError("`num_key_value_heads` must divide `num_heads`. Received: "
                             f"num_heads={num_heads}, num_key_value_heads={num_key_value_heads}")
        if output_shape:
            if _checks.is_int(output_shape):
                output_shape = (output_shape,)
            if not isinstance(output_shape, (tuple, list)) or not all(
                    _checks.is_int(dim) and dim > 0 for dim in output_shape):
                raise ValueError("`output_shape` must be None, a positive int or a tuple of positive "
                                 f"ints. Received: output_shape={output_shape!r}")
            output_shape = tuple(int(dim) for dim in output_shape)
        else:
            output_shape = None
        if _checks.is_int(attention_axes):
            attention_axes = (attention_axes,)
        if attention_axes is not None:
            if not isinstance(attention_axes, (tuple, list)) or tuple(attention_axes) not in ((1,), (-2,)):
                raise ValueError(
                    "FlashMultiHeadAttention attends over the sequence axis of [batch, seq, features] "
                    "inputs only: `attention_axes` must be None, 1 or -2 (attention over several axes "
                    "is not supported; flatten them into one sequence axis first). "
                    f"Received: attention_axes={attention_axes!r}")
            attention_axes = (1,)
        if sliding_window is not None and not (_checks.is_int(sliding_window) and 0 < sliding_window <= 2**31):
            raise ValueError("`sliding_window` must be None or an int in [1, 2**31]. "
                             f"Received: sliding_window={sliding_window!r}")
        if sliding_window is not None and window is not None:
            raise ValueError("Give `sliding_window` (Keras: |i - j| < sliding_window) or `window` "
                             f"(left, right), not both. Received: sliding_window={sliding_window}, "
                             f"window={window!r}")
        flash_attention = _checks.check_bool(flash_attention, "flash_attention", optional=True)
        use_gate = _checks.check_bool(use_gate, "use_gate")
        context_parallel = _checks.check_bool(context_parallel, "context_parallel")
        super().__init__(window=window, dropout=dropout, block_mask=block_mask, block_size=block_size, seed=seed,
                         softcap=softcap, deterministic=deterministic, **kwargs)
        self._num_heads = num_heads
        self._key_dim = key_dim
        self._value_dim = value_dim if value_dim else key_dim
        self._num_key_value_heads = num_key_value_heads or num_heads
        self._use_bias = bool(use_bias)
        self._output_shape = output_shape
        self._attention_axes = attention_axes
        self._sliding_window = sliding_window
        self._flash_attention = flash_attention
        self._kernel_initializer = initializers.get(kernel_initializer)
        self._bias_initializer = initializers.get(bias_initializer)
        self._kernel_regularizer = regularizers.get(kernel_regularizer)
        self._bias_regularizer = regularizers.get(bias_regularizer)
        self._activity_regularizer = regularizers.get(activity_regularizer)
        self._kernel_constraint = constraints.get(kernel_constraint)
        self._bias_constraint = constraints.get(bias_constraint)
        self._use_gate = use_gate
        self._context_parallel = context_parallel
        self._inverse_sqrt_key_dim = 1.0 / math.sqrt(float(key_dim))

    @classmethod
    def from_keras(cls, layer, **overrides):
        """A FlashMultiHeadAttention with the config (and, when built, the weights) of a
        `keras.layers.MultiHeadAttention`; `overrides` replace config entries (e.g. a new name).

        For a whole model: `keras.models.clone_model(model, clone_function=...)` with this for the
        attention layers, then `new_model.set_weights(model.get_weights())`.
        """
        config = layer.get_config()
        config.update(overrides)
        flash = cls.from_config(config)
        if layer.built:
            dims = [sub.kernel.shape[0] for sub in (layer.query_dense, layer.value_dense, layer.key_dense)]
            flash.build(*[(None, None, dim) for dim in dims])
            flash.set_weights(layer.get_weights())
        return flash

    @property
    def _effective_window(self):
        if self._sliding_window is not None:
            return (self._sliding_window - 1, self._sliding_window - 1)
        return self._window

    def build(self, query_shape, value_shape, key_shape=None):
        key_shape = value_shape if key_shape is None else key_shape
        query_shape, value_shape, key_shape = tuple(query_shape), tuple(value_shape), tuple(key_shape)
        for name, shape in (("query", query_shape), ("value", value_shape), ("key", key_shape)):
            if len(shape) != 3:
                raise ValueError(f"FlashMultiHeadAttention takes [batch, seq, features] inputs. "
                                 f"Received: {name}_shape={shape}")
        if value_shape[1:-1] != key_shape[1:-1]:
            raise ValueError("All dimensions of `value` and `key`, except the last one, must be equal. "
                             f"Received: value_shape={value_shape} and key_shape={key_shape}")
        heads, kv_heads = self._num_heads, self._num_key_value_heads
        self._query_dense = self._projection("query", query_shape, [heads, self._key_dim])
        self._key_dense = self._projection("key", key_shape, [kv_heads, self._key_dim])
        if self._use_gate:
            self._gate_dense = self._projection("gate", query_shape, [heads, self._value_dim],
                                                activation="sigmoid")
        self._value_dense = self._projection("value", value_shape, [kv_heads, self._value_dim])
        # Keras resolves the default attention axes at build time; so do we (same get_config).
        self._attention_axes = (1,)
        output_dims = self._output_shape or (query_shape[-1],)
        equation, bias_axes = _projection_equation(free_dims=2, bound_dims=2,
                                                   output_dims=len(output_dims))
        self._output_dense = keras.layers.EinsumDense(
            equation, output_shape=[None] + list(output_dims),
            bias_axes=bias_axes if self._use_bias else None, name="attention_output",
            **self._sublayer_kwargs())
        self._output_dense.build(query_shape[:-1] + (heads, self._value_dim))
        self.built = True

    def _projection(self, name, input_shape, head_dims, activation=None):
        equation, bias_axes = _projection_equation(free_dims=2, bound_dims=1, output_dims=2)
        layer = keras.layers.EinsumDense(
            equation, output_shape=[None] + list(head_dims),
            bias_axes=bias_axes if self._use_bias else None, activation=activation, name=name,
            **self._sublayer_kwargs())
        layer.build(input_shape)
        return layer

    def _sublayer_kwargs(self):
        # Fresh initializer instances per sublayer: a seeded initializer reused would give every
        # projection the same values.
        return dict(
            kernel_initializer=self._kernel_initializer.__class__.from_config(
                self._kernel_initializer.get_config()),
            bias_initializer=self._bias_initializer.__class__.from_config(
                self._bias_initializer.get_config()),
            kernel_regularizer=self._kernel_regularizer,
            bias_regularizer=self._bias_regularizer,
            activity_regularizer=self._activity_regularizer,
            kernel_constraint=self._kernel_constraint,
            bias_constraint=self._bias_constraint,
            dtype=self.dtype_policy,
        )

    def call(self, query, value, key=None, query_mask=None, value_mask=None, key_mask=None,
             attention_mask=None, return_attention_scores=False, training=None,
             use_causal_mask=False, block_mask=None, segment_ids=None):
        if key is None:
            key = value
        if query_mask is None:
            query_mask = _get_keras_mask(query)
        return_attention_scores = _checks.check_bool(return_attention_scores, "return_attention_scores",
                                                     optional=True)
        use_causal_mask = bool(_checks.check_bool(use_causal_mask, "use_causal_mask", optional=True))
        # Masks are checked against the inputs here, under their own names (the op would report what they
        # become: lengths, attention_mask).
        batch, seqlen_q = _checks.axis_size(query, 0), _checks.axis_size(query, 1)
        seqlen_k = _checks.axis_size(key, 1)
        heads = _checks.Size(self._num_heads, None)
        query_mask = _common.check_padding_mask(query_mask, "query_mask", batch, seqlen_q)
        value_mask = _common.check_padding_mask(value_mask, "value_mask", batch, seqlen_k)
        key_mask = _common.check_padding_mask(key_mask, "key_mask", batch, seqlen_k)
        if attention_mask is not None:
            attention_mask = _common.expand_attention_mask(attention_mask, batch, heads, seqlen_q, seqlen_k)
        segment_ids = _checks.check_segment_ids(segment_ids, batch, seqlen_q, seqlen_k)
        # The masks are handled here; keep them from reaching the projections (which do not
        # support masking), as Keras' MultiHeadAttention does.
        for tensor in (query, value, key):
            _set_keras_mask(tensor, None)

        if self._use_gate:
            gate = self._gate_dense(query)
        query = self._query_dense(query)
        key = self._key_dense(key)
        value = self._value_dense(value)
        kv_mask = _common.combine(value_mask, key_mask, tf.logical_and)
        attention_output, attention_scores = self._compute_attention(
            query, key, value, query_mask=query_mask, kv_mask=kv_mask,
            attention_mask=attention_mask, training=training,
            return_attention_scores=return_attention_scores, use_causal_mask=use_causal_mask,
            block_mask=block_mask, segment_ids=segment_ids)
        if self._use_gate:
            attention_output = attention_output * gate
        attention_output = self._output_dense(attention_output)
        if query_mask is not None:
            _set_keras_mask(attention_output, query_mask)
        if return_attention_scores:
            return attention_output, attention_scores
        return attention_output

    def _compute_attention(self, query, key, value, query_mask=None, kv_mask=None,
                           attention_mask=None, training=None, return_attention_scores=False,
                           use_causal_mask=False, block_mask=None, segment_ids=None):
        """Attention on projected heads: query [B, T, N, key_dim], key [B, S, Nkv, key_dim],
        value [B, S, Nkv, value_dim] -> ([B, T, N, value_dim], scores [B, N, T, S] or None).

        Unlike Keras' hook of the same name it takes the padding masks separately (so that prefix
        masks can become lengths), `attention_mask` as rank 4 and `segment_ids` as the checked (query ids,
        key ids) pair of `_checks.check_segment_ids`.
        """
        dropout_rate, seed = self._dropout_and_seed(training)
        if block_mask is None:
            block_mask = self._block_mask
        masks = dict(query_mask=query_mask, kv_mask=kv_mask, attention_mask=attention_mask,
                     segment_ids=segment_ids, causal=bool(use_causal_mask), window=self._effective_window,
                     block_mask=block_mask, block_size=self._block_size)
        # Keras' MultiHeadAttention takes its fused path (uniform softmax on fully masked rows)
        # when there is no dropout and no scores are asked for, else its explicit path (zeros).
        empty_rows = "mean" if self._dropout == 0 and not return_attention_scores else "zeros"
        if self._context_parallel and parallel.in_replica_context():
            if return_attention_scores:
                raise ValueError("return_attention_scores=True is not available with context_parallel=True in a "
                                 "replica context (the scores of a sequence shard span every replica's keys). "
                                 "Received: return_attention_scores=True")
            if masks.pop("segment_ids") is not None:
                # The sharded attention runs each query chunk against the whole sequence's keys and takes no
                # segment ids; a block-diagonal attention_mask instead would be O(S^2) again.
                raise ValueError("segment_ids is not available with context_parallel=True in a replica context: "
                                 "the sequence-sharded attention does not take segment ids (packed documents "
                                 "would span the shards). Train packed rows without context_parallel, or give "
                                 "each sequence one document. Received: segment_ids of shape "
                                 f"{segment_ids[0].shape} (query ids) and {segment_ids[1].shape} (key ids)")
            output = parallel._attend_shards(  # pylint: disable=protected-access
                query, key, value, dropout_rate=dropout_rate, seed=seed, scale=self._inverse_sqrt_key_dim,
                softcap=self._softcap, deterministic=self._deterministic, empty_rows=empty_rows, **masks)
            return output, None
        output = _common.attend(query, key, value, dropout_rate=dropout_rate, seed=seed,
                                scale=self._inverse_sqrt_key_dim, softcap=self._softcap,
                                deterministic=self._deterministic, empty_rows=empty_rows, **masks)
        scores = None
        if return_attention_scores:
            shape = tf.shape(query)
            visible = _common.dense_visibility(shape[0], self._num_heads, shape[1], tf.shape(key)[1],
                                               **masks)
            scores = _common.attention_probabilities(query, key, visible, self._inverse_sqrt_key_dim,
                                                     self._softcap)
            scores = tf.cast(scores, self.compute_dtype)
        return output, scores

    def compute_output_shape(self, query_shape, value_shape, key_shape=None):
        query_shape, value_shape = tuple(query_shape), tuple(value_shape)
        key_shape = value_shape if key_shape is None else tuple(key_shape)
        if value_shape[1:-1] != key_shape[1:-1]:
            raise ValueError("All dimensions of `value` and `key`, except the last one, must be equal. "
                             f"Received: value_shape={value_shape} and key_shape={key_shape}")
        if self._output_shape:
            return query_shape[:-1] + self._output_shape
        return query_shape

    def compute_output_spec(self, query, value, key=None, query_mask=None, value_mask=None,
                            key_mask=None, attention_mask=None, return_attention_scores=False,
                            training=None, use_causal_mask=False, block_mask=None, segment_ids=None):
        output_shape = self.compute_output_shape(query.shape, value.shape,
                                                 None if key is None else key.shape)
        output = keras.KerasTensor(output_shape, dtype=self.compute_dtype)
        if return_attention_scores:
            scores_shape = (query.shape[0], self._num_heads, query.shape[1], value.shape[1])
            return output, keras.KerasTensor(scores_shape, dtype=self.compute_dtype)
        return output

    def get_config(self):
        config = {
            "num_heads": self._num_heads,
            "key_dim": self._key_dim,
            "value_dim": self._value_dim,
            "use_bias": self._use_bias,
            "use_gate": self._use_gate,
            "output_shape": self._output_shape,
            "attention_axes": self._attention_axes,
            "sliding_window": self._sliding_window,
            "flash_attention": self._flash_attention,
            "kernel_initializer": initializers.serialize(self._kernel_initializer),
            "bias_initializer": initializers.serialize(self._bias_initializer),
            "kernel_regularizer": regularizers.serialize(self._kernel_regularizer),
            "bias_regularizer": regularizers.serialize(self._bias_regularizer),
            "activity_regularizer": regularizers.serialize(self._activity_regularizer),
            "kernel_constraint": constraints.serialize(self._kernel_constraint),
            "bias_constraint": constraints.serialize(self._bias_constraint),
            "num_key_value_heads": self._num_key_value_heads,
            "context_parallel": self._context_parallel,
        }
        return {**super().get_config(), **config}


def _projection_equation(free_dims, bound_dims, output_dims):
    """EinsumDense equation and bias axes for a projection: the first `free_dims` input axes are
    kept, the next `bound_dims` contracted, `output_dims` new axes produced (Keras' layout, so
    kernels have the same shapes as in Keras' MultiHeadAttention)."""
    letters = iter(string.ascii_lowercase)
    free = "".join(next(letters) for _ in range(free_dims))
    bound = "".join(next(letters) for _ in range(bound_dims))
    out = "".join(next(letters) for _ in range(output_dims))
    return f"{free}{bound},{bound}{out}->{free}{out}", out

