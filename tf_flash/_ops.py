"""Loads the compiled op library once, with a clear error when it is missing or built for another TF."""
import os

import tensorflow as tf

_LIB_NAME = "_flash_attention_ops.so"
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def _candidates(package_dir=_PACKAGE_DIR):
    # An explicit path wins. Imported from a source checkout (the package dir sits next to WORKSPACE and
    # cc/), the in-tree Bazel output comes first (development); an installed package (site-packages)
    # loads only the library it was installed with, never a bazel-bin it happens to sit beside.
    explicit = os.environ.get("TF_FLASH_LIBRARY")
    if explicit:
        return [explicit]
    packaged = os.path.join(package_dir, "_lib", _LIB_NAME)
    repo_root = os.path.dirname(package_dir)
    if os.path.isfile(os.path.join(repo_root, "WORKSPACE")) and os.path.isdir(os.path.join(repo_root, "cc")):
        return [os.path.join(repo_root, "bazel-bin", "cc", _LIB_NAME), packaged]
    return [packaged]


def _load():
    tried = []
    for path in _candidates():
        if not os.path.exists(path):
            tried.append(path)
            continue
        try:
            return tf.load_op_library(path), path
        except (tf.errors.NotFoundError, OSError) as err:
            raise ImportError(
                f"tf_flash: the op library {path} does not load into TensorFlow {tf.__version__} "
                f"(it was probably built against another TensorFlow version; rebuild it with "
                f"`pip install --no-build-isolation .` or `bazel build //cc:{_LIB_NAME}`): {err}"
            ) from err
    raise ImportError(
        "tf_flash: the op library was not found; looked at: " + ", ".join(tried)
        + ". Build it with `pip install --no-build-isolation .` (or `bazel build //cc:" + _LIB_NAME + "`)."
    )


ops, library_path = _load()


def _library_build_info():
    with tf.init_scope():  # eager even when called while a function is being traced
        text = ops.tf_flash_build_info().numpy().decode()
    return dict(item.split("=", 1) for item in text.split(";") if item)


def build_info():
    """What the loaded library holds and where it came from, all values strings, e.g.
    {'cuda': '1', 'cuda_archs': '80,90a', 'cuda_version': '12.8', 'tf': '2.21.0' (what it was compiled
    with), 'version': '0.2.0' (the tf_flash package), 'library': '/.../_flash_attention_ops.so'}."""
    from tf_flash import __version__  # (tf_flash/__init__.py holds the version; it imports this module)

    return dict(_library_build_info(), version=__version__, library=library_path)


def cuda_kernel_counts():
    """CUDA kernel launches of this process by family, e.g. {'forward_sm80': 3, 'forward_sm90': 12,
    'backward_sm80': 3, 'backward_sm90': 12, 'forward_float32': 0, 'backward_float32': 0}: how a test (or a
    user) sees which kernels ran. The Hopper family (sm_90a: TMA, wgmma) runs on H100/H200 for the inputs it
    supports, the sm_80 family elsewhere; TF_FLASH_CUDA_FAMILY=sm80, set before the first call, keeps every
    GPU on sm_80. float32 with TF's TF32 switch off runs on the full-float32 kernels (CUDA cores). All zeros
    in a CPU-only library. Under `jit_compile`, XLA may record a forward into its CUDA graphs and replay it
    without the op's host code: such launches count when recorded, not when replayed."""
    with tf.init_scope():
        counts = ops.tf_flash_kernel_counts().numpy().tolist()
    names = ("forward_sm80", "forward_sm90", "backward_sm80", "backward_sm90", "forward_float32", "backward_float32")
    return dict(zip(names, counts))


def _check_tf_version():
    # A library built for another TF minor version may load and then misbehave: refuse it up front.
    built_for = _library_build_info().get("tf")
    if built_for and built_for.split(".")[:2] != tf.__version__.split(".")[:2]:
        raise ImportError(
            f"tf_flash: the op library {library_path} was built for TensorFlow {built_for}, but TensorFlow "
            f"{tf.__version__} is running; rebuild it with `pip install --no-build-isolation .`")


_check_tf_version()
