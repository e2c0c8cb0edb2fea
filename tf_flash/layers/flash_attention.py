"""`FlashAttention`: the attention step alone, on already-projected heads [B, S, H, D]."""
import keras
import tensorflow as tf

from tf_flash.layers import _common


@keras.saving.register_keras_serializable(package="tf_flash")
class FlashAttention(keras.layers.Layer):
    """Exact attention on projected heads with `tf_flash.flash_attention`; no weights.

    The [Sq, Sk] score matrix is never materialized. Use it inside your own attention block; for a
    drop-in replacement of `keras.layers.MultiHeadAttention` see `FlashMultiHeadAttention`.

    Args:
        causal: query i sees keys j <= i (top-left aligned). `use_causal_mask` in `call` can also
            turn it on per call.
        window: None, an int w (i sees i-w .. i+w) or (left, right), None on a side = unlimited.
        dropout: dropout rate on the attention probabilities, applied only when `training`, in
            steps of 1/256 (see `tf_flash.flash_attention`). The mask is regenerated in the backward pass from a seed drawn from a
            `keras.random.SeedGenerator` (a fresh mask each training call, reproducible under
            `keras.utils.set_random_seed`).
        scale: score scale; None = 1/sqrt(head dim).
        block_mask: optional static block-sparse pattern, bool [nqb, nkb], [H, nqb, nkb] or
            [B, H, nqb, nkb] (see `tf_flash.sparsity`); False blocks are skipped. A `block_mask`
            given to `call` replaces it for that call.
        block_size: int or (bq, bk): the blocks `block_mask` describes.
        seed: int seed of the dropout `SeedGenerator`.
        softcap: logit soft-capping: scaled scores s -> softcap * tanh(s / softcap) before the
            softmax (Gemma 2); None = off.
        deterministic: bit-identical gradients for identical inputs (GPU: dQ summed in a fixed
            order); None follows `tf.config.experimental.enable_op_determinism()`.

    Call arguments:
        query: [B, Sq, H, D]. value: [B, Sk, Hkv, Dv]. key: [B, Sk, Hkv, D], default `value`.
            Hkv must divide H (grouped-query attention).
        query_mask, value_mask, key_mask: Keras padding masks [B, Sq] / [B, Sk] (filled in by
            Keras masking). Prefix masks (padding at the end) become lengths and the kernel skips the
            padding; other patterns take the general masked path. Masked query rows return 0.
        attention_mask: bool [Sq, Sk], [B, Sq, Sk] (Keras convention) or [B, H, Sq, Sk]; True =
            attend.
        q_lengths, kv_lengths: int [B] valid prefix lengths (alternative to the masks).
        block_mask: per-call block pattern (see above).
        use_causal_mask: None = the constructor's `causal`; True/False overrides it.
        training: dropout only when True.

    Returns:
        [B, Sq, H, Dv] in the layer's compute dtype; its Keras mask is the query mask. A query row
        that sees no key returns 0.

    XLA: the layer sets `supports_jit = True`; under `jit_compile` (Keras' default "auto" on a GPU,
    or True) the op lowers to custom calls to the same kernels, so XLA fuses the rest of the model
    around flash attention and never builds the [Sq, Sk] scores.
    """

    def __init__(self, causal=False, window=None, dropout=0.0, scale=None, block_mask=None,
                 block_size=128, seed=None, softcap=None, deterministic=None, **kwargs):
        if not isinstance(causal, bool):
            raise ValueError(f"`causal` must be a bool. Received: causal={causal!r}")
        window = _common.check_window(window)
        dropout = _common.check_dropout(dropout)
        scale = _common.check_scale(scale)
        block_mask = _common.check_block_mask(block_mask)
        block_size = _common.check_block_size(block_size)
        seed = _common.check_seed(seed)
        softcap = _common.check_softcap(softcap)
        deterministic = _common.check_deterministic(deterministic)
        super().__init__(**kwargs)
        self.supports_masking = True
        self.supports_jit = True  # the op has an XLA lowering (typed-FFI custom calls)
        self.causal = causal
        self.softcap = softcap
        self.deterministic = deterministic
        self.window = window
        self.dropout = dropout
        self.scale = None if scale is None else float(scale)
        self.block_mask = block_mask
        self.block_size = block_size
        self.seed = seed
        self.seed_generator = keras.random.SeedGenerator(seed) if dropout > 0 else None

    def build(self, query_shape, value_shape=None, key_shape=None):
        self.built = True

    def call(self, query, value, key=None, query_mask=None, value_mask=None, key_mask=None,
             attention_mask=None, q_lengths=None, kv_lengths=None, block_mask=None,
             use_causal_mask=None, training=None):
        if key is None:
            key = value
            key_mask = None
        dtype = self.compute_dtype
        query, key, value = (tf.cast(t, dtype) for t in (query, key, value))
        # Every mask and length is checked against the inputs here, under its own name (the op would
        # report what they become: lengths, attention_mask).
        batch, heads = _common.dim(query, 0), _common.dim(query, 2)
        seqlen_q, seqlen_k = _common.dim(query, 1), _common.dim(key, 1)
        query_mask = _common.check_padding_mask(query_mask, "query_mask", batch, seqlen_q)
        kv_mask = _common.and_masks(_common.check_padding_mask(value_mask, "value_mask", batch, seqlen_k),
                                    _common.check_padding_mask(key_mask, "key_mask", batch, seqlen_k))
        if attention_mask is not None:
            attention_mask = _common.expand_attention_mask(attention_mask, batch, heads, seqlen_q, seqlen_k)
        if q_lengths is not None:
            q_lengths = _common.check_lengths(q_lengths, "q_lengths", batch, seqlen_q)
            query_mask = _common.and_masks(query_mask, tf.sequence_mask(q_lengths, seqlen_q.tensor()))
        if kv_lengths is not None:
            kv_lengths = _common.check_lengths(kv_lengths, "kv_lengths", batch, seqlen_k)
            kv_mask = _common.and_masks(kv_mask, tf.sequence_mask(kv_lengths, seqlen_k.tensor()))
        use_causal_mask = _common.check_bool_or_none(use_causal_mask, "use_causal_mask")
        causal = self.causal if use_causal_mask is None else use_causal_mask
        dropout_rate, seed = 0.0, None
        if training and self.dropout > 0:
            dropout_rate = self.dropout
            seed = tf.cast(self.seed_generator.next(), tf.int64)
        if block_mask is None:
            block_mask = self.block_mask
        return _common.attend(
            query, key, value, query_mask=query_mask, kv_mask=kv_mask, attention_mask=attention_mask,
            causal=causal, window=self.window, block_mask=block_mask, block_size=self.block_size,
            dropout_rate=dropout_rate, seed=seed, scale=self.scale, softcap=self.softcap,
            deterministic=self.deterministic, empty_rows="zeros")

    def compute_mask(self, query, previous_mask=None):
        return previous_mask

    def compute_output_shape(self, query_shape, value_shape, key_shape=None):
        query_shape, value_shape = tuple(query_shape), tuple(value_shape)
        if len(query_shape) != 4 or len(value_shape) != 4:
            raise ValueError("`query` and `value` must have rank 4 [batch, seq, heads, dim]. Received: "
                             f"query_shape={query_shape}, value_shape={value_shape}")
        return query_shape[:-1] + value_shape[-1:]

    def compute_output_spec(self, query, value, key=None, **kwargs):
        shape = self.compute_output_shape(query.shape, value.shape)
        return keras.KerasTensor(shape, dtype=self.compute_dtype)

    def get_config(self):
        config = {
            "causal": self.causal,
            "window": self.window,
            "dropout": self.dropout,
            "scale": self.scale,
            "block_mask": _common.block_mask_to_config(self.block_mask),
            "block_size": self.block_size,
            "seed": self.seed,
            "softcap": self.softcap,
            "deterministic": self.deterministic,
        }
        return {**super().get_config(), **config}

