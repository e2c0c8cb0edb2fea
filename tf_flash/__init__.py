"""tf_flash: FlashAttention for TensorFlow and Keras.

Importing it loads the op library, registers the gradients and the Keras layers (so saved models
that use them load after `import tf_flash`).
"""
# The package version, in this one place (setup.py reads it; build_info() reports it).
__version__ = "0.2.0"

from tf_flash._ops import build_info, cuda_kernel_counts  # noqa: E402  (after __version__: build_info reports it)
from tf_flash.ops import flash_attention  # noqa: E402
from tf_flash import sparsity  # noqa: E402
from tf_flash import layers  # noqa: E402
from tf_flash import keras  # noqa: E402
from tf_flash import data  # noqa: E402
from tf_flash import parallel  # noqa: E402

__all__ = ["flash_attention", "sparsity", "layers", "keras", "data", "parallel", "build_info",
           "cuda_kernel_counts", "__version__"]
