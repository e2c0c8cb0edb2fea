"""`FlashAttention`: the attention step alone, on already-projected heads [B, S, H, D]."""
import keras
import tensorflow as tf

from tf_flash import _checks
from tf_flash.layers import _common


@keras.saving.register_keras_serializable(package="tf_flash")
@_common.read_only_properties("causal", "scale")
class FlashAttention(_common.FlashOptionsLayer):
    """Exact attention on projected heads with `tf_flash.flash_attention`; no weights.

    The [Sq, Sk] score matrix is never materialized. Use it inside your own attention block; for a
    drop-in replacement of `keras.layers.MultiHeadAttention` see `FlashMultiHeadAttention`.

    Args:
        causal: False; True or "top_left": query i sees keys j <= i; "bottom_right": the queries are the
            last positions of each entry's keys (decoding against a KV cache filled to `kv_lengths`; see
            `tf_flash.flash_attention`). `use_causal_mask` in `call` can also turn it on per call, in this
            alignment.
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
        segment_ids: packed documents: int [B, S] (self-attention, Sq == Sk), or a pair
            (q_segment_ids [B, Sq], kv_segment_ids [B, Sk]); query i sees key j only where their ids
            are equal, AND every other mask (causal stays on row positions, so it is causal within each
            document). O(B x S) memory, unlike a block-diagonal `attention_mask`; masked tiles are
            skipped. See `tf_flash.flash_attention` and `tf_flash.data.pack_documents`.
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
        _checks.normalize_causal(causal)  # bool, "top_left" or "bottom_right"
        causal = causal if isinstance(causal, str) else bool(causal)
        scale = None if scale is None else _checks.normalize_scale(scale)
        super().__init__(window=window, dropout=dropout, block_mask=block_mask, block_size=block_size, seed=seed,
                         softcap=softcap, deterministic=deterministic, **kwargs)
        self._causal = causal
        self._scale = scale

    def build(self, query_shape, value_shape=None, key_shape=None):
        self.built = True

    def call(self, query, value, key=None, query_mask=None, value_mask=None, key_mask=None,
             attention_mask=None, q_lengths=None, kv_lengths=None, block_mask=None,
             use_causal_mask=None, training=None, segment_ids=None):
        if key is None:
            key = value
            key_mask = None
        dtype = self.compute_dtype
        query, key, value = (tf.cast(t, dtype) for t in (query, key, value))
        # Every mask and length is checked against the inputs here, under its own name (the op would
        # report what they become: lengths, attention_mask).
        batch, heads = _checks.axis_size(query, 0), _checks.axis_size(query, 2)
        seqlen_q, seqlen_k = _checks.axis_size(query, 1), _checks.axis_size(key, 1)
        query_mask = _common.check_padding_mask(query_mask, "query_mask", batch, seqlen_q)
        kv_mask = _common.combine(_common.check_padding_mask(value_mask, "value_mask", batch, seqlen_k),
                                  _common.check_padding_mask(key_mask, "key_mask", batch, seqlen_k),
                                  tf.logical_and)
        if attention_mask is not None:
            attention_mask = _common.expand_attention_mask(attention_mask, batch, heads, seqlen_q, seqlen_k)
        segment_ids = _checks.check_segment_ids(segment_ids, batch, seqlen_q, seqlen_k)
        # Checked at run time too: a padding mask may lower them (tf.minimum) before the kernels see them,
        # and the GPU kernels clamp lengths instead of checking them.
        q_lengths = _checks.check_lengths(q_lengths, "q_lengths", batch, seqlen_q, runtime_range_check=True)
        kv_lengths = _checks.check_lengths(kv_lengths, "kv_lengths", batch, seqlen_k, runtime_range_check=True)
        use_causal_mask = _checks.check_bool(use_causal_mask, "use_causal_mask", optional=True)
        alignment = self._causal if isinstance(self._causal, str) else True
        causal = self._causal if use_causal_mask is None else (alignment if use_causal_mask else False)
        dropout_rate, seed = self._dropout_and_seed(training)
        if block_mask is None:
            block_mask = self._block_mask
        return _common.attend(
            query, key, value, query_mask=query_mask, kv_mask=kv_mask, q_lengths=q_lengths,
            kv_lengths=kv_lengths, attention_mask=attention_mask, segment_ids=segment_ids, causal=causal,
            window=self._window,
            block_mask=block_mask, block_size=self._block_size, dropout_rate=dropout_rate, seed=seed,
            scale=self._scale, softcap=self._softcap, deterministic=self._deterministic, empty_rows="zeros")

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
        return {**super().get_config(), "causal": self._causal, "scale": self._scale}
