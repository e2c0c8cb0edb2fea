"""Shared helpers of the repository rules: which Python to ask, and running it."""

# PYTHON_BIN_PATH picks the interpreter (setup.py sets it to the one running pip). TF_FLASH_PYTHON_FINGERPRINT
# is set by setup.py to that interpreter's TensorFlow version and location, so that upgrading TensorFlow
# reconfigures the build instead of reusing headers of the old one.
PYTHON_ENV = ["PYTHON_BIN_PATH", "TF_FLASH_PYTHON_FINGERPRINT"]

def find_python(repository_ctx):
    """Absolute path of the Python interpreter: $PYTHON_BIN_PATH, else python3 on PATH."""
    explicit = repository_ctx.os.environ.get("PYTHON_BIN_PATH", "").strip()
    if explicit:
        if explicit.startswith("/"):
            return explicit
        found = repository_ctx.which(explicit)
        if found:
            return str(found)
        fail("PYTHON_BIN_PATH=%s: no such interpreter." % explicit)
    for name in ["python3", "python"]:
        found = repository_ctx.which(name)
        if found:
            return str(found)
    fail("No Python interpreter found: set PYTHON_BIN_PATH or put python3 on PATH.")

def run_python(repository_ctx, python, script, what):
    """Runs a Python snippet and returns its stdout; fails with the interpreter's stderr."""
    result = repository_ctx.execute(
        [python, "-c", script],
        environment = {"TF_CPP_MIN_LOG_LEVEL": "3", "CUDA_VISIBLE_DEVICES": ""},
        quiet = True,
    )
    if result.return_code != 0:
        fail("%s: `%s -c ...` failed:\n%s" % (what, python, result.stderr))
    return result.stdout

def parse_key_values(text):
    """Lines 'TF_FLASH_KEY=value' (printed by our snippets) into a dict of lists of values, in order;
    a key may repeat (one flag a line). Other lines (library noise) are skipped."""
    values = {}
    for line in text.splitlines():
        if not line.startswith("TF_FLASH_"):
            continue
        key, _, value = line.partition("=")
        values.setdefault(key, []).append(value)
    return values
