"""Keras layers on top of `tf_flash.flash_attention` (registered as serializable under "tf_flash")."""
from tf_flash.layers.flash_attention import FlashAttention
from tf_flash.layers.flash_multi_head_attention import FlashMultiHeadAttention

__all__ = ["FlashAttention", "FlashMultiHeadAttention"]
