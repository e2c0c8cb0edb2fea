"""Shared pytest setup: the `gpu` marker, skipped without a GPU, and a `device` fixture (cpu, gpu)."""
import os
import sys

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# Test helpers (reference.py, philox_ref.py, ...) import by module name.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import tensorflow as tf  # noqa: E402

HAVE_GPU = bool(tf.config.list_physical_devices("GPU"))
# Tests start helper processes (saving, MirroredStrategy) that need GPU memory beside this one.
for _gpu in tf.config.list_physical_devices("GPU"):
    tf.config.experimental.set_memory_growth(_gpu, True)


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a GPU; skipped when TensorFlow sees none")


def pytest_collection_modifyitems(config, items):
    if HAVE_GPU:
        return
    skip = pytest.mark.skip(reason="no GPU visible to TensorFlow")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(params=["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
def device(request):
    """Runs the test body under tf.device of the parameter; yields "cpu" or "gpu"."""
    with tf.device("/GPU:0" if request.param == "gpu" else "/CPU:0"):
        yield request.param
