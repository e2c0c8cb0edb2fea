"""Device helpers shared by the op tests."""
import contextlib

import pytest
import tensorflow as tf


@contextlib.contextmanager
def on_device(device):
    """tf.device(device); a configuration the CUDA build does not cover (its error names the GPU kernel)
    skips the GPU variant instead of failing it."""
    with tf.device(device):
        try:
            yield
        except tf.errors.InvalidArgumentError as err:
            if "GPU kernel" in str(err):
                pytest.skip(f"not covered by the GPU kernels: {str(err).splitlines()[0][:200]}")
            raise


def hold_gpu_float32_to_float16(request, monkeypatch, tables, float32_bounds=()):
    """float32 on the GPU computes on float16 operands (tf_flash.build_info()["gpu_float32_compute"]): in a
    test parametrized on the GPU, each {dtype: bound} table gives float32 the float16 bound, or the bound
    given in float32_bounds, pairs (table, bound) for what the rounding of float32 inputs moves further
    (float16 inputs carry no such rounding)."""
    callspec = getattr(request.node, "callspec", None)
    if callspec is not None and "GPU" in str(callspec.params.get("device", "")).upper():
        for table in tables:
            monkeypatch.setitem(table, tf.float32, table[tf.float16])
        for table, bound in float32_bounds:
            monkeypatch.setitem(table, tf.float32, bound)
