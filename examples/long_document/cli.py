"""Command-line plumbing shared by the example's scripts; imports nothing heavy.

``quiet_tensorflow`` must run before TensorFlow is imported: TensorFlow reads its logging level and the
visible CUDA devices once, at import and at its first device query. ``import_tensorflow`` then imports
it without its start-up notices.
"""
import argparse
import glob
import os
import sys
import tempfile
import warnings

# Lines TensorFlow writes to stderr while it is imported that report no problem of the run: the
# CUDA stubs' "no driver" notice and absl's "before InitializeLog" banner (written before
# TF_CPP_MIN_LOG_LEVEL applies, so only filtering removes them), the CPU-instruction and oneDNN notices.
_IMPORT_NOTICES = (
    "All log messages before absl::InitializeLog() is called",
    "cudart_stub.cc",
    "cpu_feature_guard.cc",
    "To enable the following instructions",
    "oneDNN custom operations are on",
    "failed call to cuInit",
)


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (``prog: error: ...``, exit status 2), no usage dump."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def gpu_present():
    """True where an NVIDIA GPU can be reached: its device nodes exist (``/dev/nvidia0``, ...; WSL's
    ``/dev/dxg``) and CUDA_VISIBLE_DEVICES does not hide every device.

    The device nodes, not ``nvidia-smi`` or the CUDA libraries, decide: a CPU machine may carry the
    driver's libraries (TensorFlow's wheel loads them and then fails ``cuInit``), while a container
    without the device nodes cannot use a GPU whatever is installed.
    """
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    if glob.glob("/dev/nvidia[0-9]*") or os.path.exists("/dev/dxg"):
        return True
    return False


def quiet_tensorflow(tf_logs=False):
    """Sets the environment so that TensorFlow, imported afterwards here and in child processes, prints
    no start-up notices; ``tf_logs=True`` leaves TensorFlow's logging as it is.

    Without a GPU: no CUDA device is made visible (TensorFlow then skips its GPU set-up) and only
    TensorFlow's fatal messages print (``TF_CPP_MIN_LOG_LEVEL=3``), because its GPU probe reports a
    missing GPU at error level ("failed call to cuInit") although nothing failed. With a GPU: errors
    still print (level 2); the oneDNN and CPU-instruction notices, at info level, do not.
    Values the user set in the environment win.
    """
    if tf_logs:
        return
    if gpu_present():
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    else:
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    # Python-level notices of TensorFlow's and Keras' own modules that say nothing about this run.
    warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"(tensorflow|keras|tf_keras)")
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"(tensorflow|keras)")
    os.environ["LONG_DOCUMENT_QUIET"] = "1"


def import_tensorflow():
    """``import tensorflow``; after ``quiet_tensorflow()`` (in this process or a parent), without the
    start-up notices it writes to stderr while loading (every other line it writes is passed on)."""
    if "tensorflow" in sys.modules or os.environ.get("LONG_DOCUMENT_QUIET") != "1":
        import tensorflow
        return tensorflow
    _filtered_import()
    import tensorflow
    # Its Python logger warns when a tf.function retraces: the example's batches have many padded
    # lengths, so it retraces by design.
    tensorflow.get_logger().setLevel("ERROR")
    return tensorflow


def _filtered_import():
    sys.stderr.flush()
    with tempfile.TemporaryFile() as captured:
        saved = os.dup(2)
        os.dup2(captured.fileno(), 2)
        try:
            import tensorflow  # noqa: F401 (loaded here, with stderr captured)
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            lines = captured.read().decode("utf-8", errors="replace").splitlines(keepends=True)
            sys.stderr.write("".join(line for line in lines
                                     if not any(n in line for n in _IMPORT_NOTICES)))
            sys.stderr.flush()


REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def last_run_file():
    """Where train.py records the model of its last run (predict.py's default model).

    LONG_DOCUMENT_LAST_RUN moves it (the tests do, so that they leave the user's record alone)."""
    return os.environ.get("LONG_DOCUMENT_LAST_RUN") or os.path.join(
        REPO_ROOT, "runs", "long_document", "last_run.json")
