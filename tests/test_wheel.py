"""The package as installed: its version, what build_info() reports, which library it loads.

.ci/run also runs this file against the binary wheel installed in a fresh virtualenv, from a directory
outside the source tree (TF_FLASH_EXPECT_INSTALLED=1): there tf_flash must come from site-packages and
load the library the wheel holds.
"""
import os
import re
import zlib

import numpy as np
import pytest
import tensorflow as tf

import tf_flash
from tf_flash import _ops
from reference import reference_attention, to_numpy

EXPECT_INSTALLED = os.environ.get("TF_FLASH_EXPECT_INSTALLED") == "1"


def test_version_is_reported():
    assert re.fullmatch(r"\d+\.\d+\.\d+", tf_flash.__version__), tf_flash.__version__
    assert tf_flash.build_info()["version"] == tf_flash.__version__


def test_build_info_describes_the_loaded_library():
    info = tf_flash.build_info()
    assert info["library"] == _ops.library_path and os.path.isfile(info["library"])
    assert info["tf"].split(".")[:2] == tf.__version__.split(".")[:2]
    assert info["cuda"] in ("0", "1"), info
    if info["cuda"] == "1":
        archs = info["cuda_archs"].split(",")
        assert archs and all(re.fullmatch(r"\d+a?(\+ptx)?", arch) for arch in archs), info


def _touch(path):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    open(path, "w").close()


def test_installed_package_ignores_a_bazel_bin_beside_it(tmp_path, monkeypatch):
    """In site-packages only the packaged library counts; in a source checkout bazel-bin comes first."""
    monkeypatch.delenv("TF_FLASH_LIBRARY", raising=False)
    name = "_flash_attention_ops.so"
    site = tmp_path / "site-packages"
    _touch(str(site / "bazel-bin" / "cc" / name))  # a stray build output next to the package
    assert _ops._candidates(str(site / "tf_flash")) == [str(site / "tf_flash" / "_lib" / name)]

    checkout = tmp_path / "checkout"
    _touch(str(checkout / "WORKSPACE"))
    os.makedirs(checkout / "cc")
    assert _ops._candidates(str(checkout / "tf_flash")) == [
        str(checkout / "bazel-bin" / "cc" / name), str(checkout / "tf_flash" / "_lib" / name)]

    monkeypatch.setenv("TF_FLASH_LIBRARY", "/elsewhere/" + name)
    assert _ops._candidates(str(site / "tf_flash")) == ["/elsewhere/" + name]


@pytest.mark.skipif(not EXPECT_INSTALLED, reason="checks an installed package (.ci/run's wheel smoke test)")
def test_installed_wheel_loads_its_own_library():
    package_dir = os.path.dirname(os.path.abspath(tf_flash.__file__))
    assert "site-packages" in package_dir.split(os.sep), package_dir
    assert "TF_FLASH_LIBRARY" not in os.environ
    assert _ops.library_path == os.path.join(package_dir, "_lib", "_flash_attention_ops.so")


@pytest.mark.parametrize("causal", [False, True])
def test_installed_op_matches_reference(request, causal):
    """A forward against the float64 reference: the loaded library computes."""
    rng = np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))
    q = tf.constant(rng.standard_normal((2, 77, 4, 40)), tf.float32)  # 77: not a multiple of a tile
    k = tf.constant(rng.standard_normal((2, 131, 2, 40)), tf.float32)
    v = tf.constant(rng.standard_normal((2, 131, 2, 24)), tf.float32)
    out = tf_flash.flash_attention(q, k, v, causal=causal)
    ref, _ = reference_attention(q, k, v, causal=causal)
    np.testing.assert_allclose(to_numpy(out), ref, rtol=2e-5, atol=2e-5)
