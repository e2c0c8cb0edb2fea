"""tf_flash: FlashAttention for TensorFlow and Keras.

Importing it loads the op library, registers the gradients and the Keras layers (so saved models
that use them load after `import tf_flash`).
"""
from tf_flash._ops import build_info
from tf_flash.ops import flash_attention
from tf_flash import sparsity
from tf_flash import layers
from tf_flash import keras

__version__ = "0.1.0"

__all__ = ["flash_attention", "sparsity", "layers", "keras", "build_info", "__version__"]
