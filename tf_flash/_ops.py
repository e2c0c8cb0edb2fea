"""Loads the compiled op library once, with a clear error when it is missing or built for another TF."""
import os

import tensorflow as tf

_LIB_NAME = "_flash_attention_ops.so"
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def _candidates():
    # An explicit path wins; then the in-tree Bazel output (development), then the installed copy.
    explicit = os.environ.get("TF_FLASH_LIBRARY")
    if explicit:
        return [explicit]
    repo_root = os.path.dirname(_PACKAGE_DIR)
    return [
        os.path.join(repo_root, "bazel-bin", "cc", _LIB_NAME),
        os.path.join(_PACKAGE_DIR, "_lib", _LIB_NAME),
    ]


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


def build_info():
    """What the loaded library was compiled with, e.g. {'cuda': '1', 'cuda_archs': '80,90a', 'tf': '2.21.0'}."""
    with tf.init_scope():  # eager even when called while a function is being traced
        text = ops.tf_flash_build_info().numpy().decode()
    return dict(item.split("=", 1) for item in text.split(";") if item)


def _check_tf_version():
    # A library built for another TF minor version may load and then misbehave: refuse it up front.
    built_for = build_info().get("tf")
    if built_for and built_for.split(".")[:2] != tf.__version__.split(".")[:2]:
        raise ImportError(
            f"tf_flash: the op library {library_path} was built for TensorFlow {built_for}, but TensorFlow "
            f"{tf.__version__} is running; rebuild it with `pip install --no-build-isolation .`")


_check_tf_version()
