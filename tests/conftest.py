"""Shared pytest setup: the `gpu` and `slow` markers, CPU pinning of the tests that do not choose a device
(device_util.DEVICES), and `rng`, a NumPy generator seeded from the test id."""
import os
import sys
import zlib

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# Test helpers (reference.py, philox_ref.py, ...) import by module name.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import tensorflow as tf  # noqa: E402

HAVE_GPU = bool(tf.config.list_physical_devices("GPU"))
# Tests start helper processes (saving, MirroredStrategy) that need GPU memory beside this one.
for _gpu in tf.config.list_physical_devices("GPU"):
    tf.config.experimental.set_memory_growth(_gpu, True)

RUN_SLOW = os.environ.get("TF_FLASH_SLOW_TESTS") == "1"
# TF_FLASH_TEST_TF32=0: the whole run with TF's TF32 switch off, so that every float32 GPU case runs on the
# full-float32 kernels and is held to float32's bounds (device_util.gpu_float32_bound_dtype).
if os.environ.get("TF_FLASH_TEST_TF32") == "0":
    tf.config.experimental.enable_tensor_float_32_execution(False)


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a GPU; skipped when TensorFlow sees none")
    config.addinivalue_line("markers", "slow: runs only with TF_FLASH_SLOW_TESTS=1 (minutes on 2 cores)")


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="no GPU visible to TensorFlow")
    skip_slow = pytest.mark.skip(reason="slow: set TF_FLASH_SLOW_TESTS=1 to run it")
    for item in items:
        if "gpu" in item.keywords and not HAVE_GPU:
            item.add_marker(skip_gpu)
        if "slow" in item.keywords and not RUN_SLOW:
            item.add_marker(skip_slow)


def _chooses_device(request):
    # A test parametrized on `device` (device_util.DEVICES), or marked gpu, places its work itself.
    return "device" in request.fixturenames or request.node.get_closest_marker("gpu") is not None


@pytest.fixture(autouse=True)
def _cpu_unless_a_device_is_chosen(request):
    """Tests that do not choose a device hold CPU expectations (float32 at float32 precision, the CPU's
    value checks): on a GPU host they would otherwise run on the GPU's float16 path."""
    if _chooses_device(request):
        yield
        return
    with tf.device("/CPU:0"):
        yield


def seed_of(request):
    """A seed from the test id (module, function and parameters): the same in every process, unlike
    hash() of a string, so a failure replays with `pytest <id>`."""
    test_id = f"{os.path.basename(request.node.path)}::{request.node.name}"
    return zlib.crc32(test_id.encode())


@pytest.fixture
def rng(request):
    """np.random.Generator seeded from the test id (stable across processes and runs)."""
    return np.random.default_rng(seed_of(request))
