"""Shared pieces of the tf_flash benchmarks: FLOP formula, timing statistics, the attention baselines,
machine and version info, where results go. Result files and figures: plot.py."""
import datetime
import os
import platform
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_DIR = os.path.join(REPO, "benchmarks", "results")
if REPO not in sys.path:  # run from a checkout: import the in-tree tf_flash
    sys.path.insert(0, REPO)


# ---------------------------------------------------------------------------------------------------------
# FLOPs (docs/performance.md): fwd = 4 b s^2 h d (halved when causal); bwd = 2.5 fwd; fwd+bwd = 3.5 fwd
# ---------------------------------------------------------------------------------------------------------

def attention_flops(batch, seqlen, heads, dim, causal, mode):
    fwd = 4.0 * batch * seqlen * seqlen * heads * dim / (2.0 if causal else 1.0)
    return {"fwd": fwd, "bwd": 2.5 * fwd, "fwd_bwd": 3.5 * fwd}[mode]


def summarize(times):
    """Median and spread (min, max, interquartile) of a list of seconds."""
    times = sorted(times)
    n = len(times)
    q1 = times[(n - 1) // 4]
    q3 = times[(3 * (n - 1) + 3) // 4]
    return {"median_s": statistics.median(times), "min_s": times[0], "max_s": times[-1], "q1_s": q1, "q3_s": q3,
            "n": n}


def time_calls(call, warmup, repeats, budget_s=None, min_repeats=3):
    """Times call() (which must block until its result exists) after `warmup` calls. With budget_s the
    number of timed calls is cut to what fits in the budget, but never below min_repeats."""
    for _ in range(warmup):
        call()
    times = []
    start = time.perf_counter()
    for i in range(repeats):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
        if budget_s is not None and i + 1 >= min_repeats and time.perf_counter() - start > budget_s:
            break
    return summarize(times)


# ---------------------------------------------------------------------------------------------------------
# Attention implementations, all on [B, S, H, D]
# ---------------------------------------------------------------------------------------------------------

def sample_calls(call, fetch, warmup, repeats, min_sample_s=0.025, max_calls=200):
    """The kernel benchmarks' timing: median per-call time over `repeats` samples of k back-to-back calls
    each (k so that a sample lasts about min_sample_s), `fetch` syncing on the last call of a sample."""
    result = None
    for _ in range(warmup):
        result = call()
    if result is not None:
        fetch(result)
    t0 = time.perf_counter()
    fetch(call())
    single = max(time.perf_counter() - t0, 1e-6)
    k = int(min(max_calls, max(1, min_sample_s / single)))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(k):
            result = call()
        fetch(result)
        times.append((time.perf_counter() - t0) / k)
    stats = summarize(times)
    stats["calls_per_sample"] = k
    return stats


def error_text(err):
    """One line for a failed case: "OOM", or the error's type and the line that says what went wrong (a graph
    error's message after its "Detected at node" trace; a tf.function's error: its last line)."""
    name = type(err).__name__
    if "ResourceExhausted" in name or "OutOfMemory" in name or "out of memory" in str(err).lower():
        return "OOM"
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()] or [""]
    framing = ("Graph execution error", "in user code:", "Detected at node", "File ", "[[")
    said = [line for line in lines if not line.startswith(framing)]
    text = (said[-1] if lines[0] == "in user code:" and said else said[0] if said else lines[0])[:240]
    return f"{name}: {text}"


def standard_attention(q, k, v, causal):
    """TF's standard attention: einsum, softmax, einsum (the N x N matrix is materialized)."""
    import tensorflow as tf
    scale = 1.0 / float(q.shape[-1]) ** 0.5
    scores = tf.einsum("bqhd,bkhd->bhqk", q, k) * tf.cast(scale, q.dtype)
    if causal:
        sq, sk = tf.shape(scores)[2], tf.shape(scores)[3]
        visible = tf.range(sk)[None, :] <= tf.range(sq)[:, None]
        scores = tf.where(visible, scores, tf.cast(-1e9 if q.dtype == tf.float32 else -3e4, q.dtype))
    probs = tf.nn.softmax(scores, axis=-1)
    return tf.einsum("bhqk,bkhd->bqhd", probs, v)


def keras_attention(q, k, v, causal):
    """The attention of keras.layers.MultiHeadAttention (Keras 3 routes it to ops.dot_product_attention)."""
    import keras
    scale = 1.0 / float(q.shape[-1]) ** 0.5
    return keras.ops.dot_product_attention(q, k, v, scale=scale, is_causal=causal)


def chained(attn, chain):
    """attn(q, *rest) -> out run `chain` times, each output the next call's query. Where the output's dtype is not
    the query's (fp8 queries give bfloat16), each but the last is cast back to the query's: quantized again."""
    import tensorflow as tf

    def run(q, *rest):
        out = q
        for i in range(chain):
            out = attn(out, *rest)
            if i + 1 < chain and out.dtype != q.dtype:
                out = tf.cast(out, q.dtype)
        return out

    return run


def make_fns(impl, causal, extra=None, chain=1, jit_compile=None):
    """(fwd(q, k, v, dout) -> out, fwd_bwd(q, k, v, dout) -> (dq, dk, dv)) as tf.functions.

    chain > 1: each call runs `chain` attentions, each one's output the next one's query (as a model's layers
    follow one another; none can be dropped, and dv must equal d), so that TF's own cost of a function call
    (0.4-0.6 ms of host time on the lent machines, whatever it holds) is spread over them as over a model's
    graph: the time per attention is the call's over `chain` (with fp8 queries, each but the last output is cast
    back to fp8, an elementwise pass over [b, s, h, d] counted in it). jit_compile: XLA around the call (None:
    only for tf_standard_xla)."""
    import tensorflow as tf
    extra = dict(extra or {})
    jit = False
    if impl == "tf_flash":
        import tf_flash

        def attn(q, k, v):
            return tf_flash.flash_attention(q, k, v, causal=causal, **extra)
    elif impl in ("tf_standard", "tf_standard_xla"):
        jit = impl == "tf_standard_xla"

        def attn(q, k, v):
            return standard_attention(q, k, v, causal)
    elif impl == "keras_mha":
        def attn(q, k, v):
            return keras_attention(q, k, v, causal)
    else:
        raise ValueError(f"unknown impl {impl!r}")

    if jit_compile is not None:
        jit = jit_compile

    attend = chained(attn, chain)

    def fwd(q, k, v, dout):
        return attend(q, k, v)

    def fwd_bwd(q, k, v, dout):
        # dout enters as the output's gradient, as torch's out.backward(dout) does: a loss over the output
        # (sum(out * dout) in float32) would add memory-bound passes over [b, s, h, d] in float32 to every
        # call that are no part of attention and that torch's peer does not run.
        with tf.GradientTape() as tape:
            tape.watch([q, k, v])
            out = attend(q, k, v)
        return tape.gradient(out, [q, k, v], output_gradients=dout)

    return tf.function(fwd, jit_compile=jit), tf.function(fwd_bwd, jit_compile=jit)


# ---------------------------------------------------------------------------------------------------------
# Machine and versions
# ---------------------------------------------------------------------------------------------------------

def _cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _mem_total_gib():
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal"):
                    return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def _git_commit():
    # On the lent GPU machine the tree travels without its git history: tools/gpu.sh names the commit.
    if os.environ.get("TF_FLASH_SOURCE_COMMIT"):
        return os.environ["TF_FLASH_SOURCE_COMMIT"]
    try:
        return subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def host_info():
    """The date, the machine and the git commit, without importing any framework."""
    return {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "host": platform.node(),
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "mem_total_gib": _mem_total_gib(),
        "python": sys.version.split()[0],
        "git_commit": _git_commit(),
    }


def machine_info(gpu=False):
    """host_info() with the versions of TensorFlow, Keras, numpy and tf_flash (its build too), and with gpu=True
    the GPUs (name, memory, driver)."""
    info = host_info()
    try:
        import numpy
        import tensorflow as tf
        info["tensorflow"] = tf.__version__
        info["numpy"] = numpy.__version__
        build = tf.sysconfig.get_build_info()
        if build.get("cuda_version"):  # a GPU build of TensorFlow: the CUDA and cuDNN it was built with
            info["tf_cuda"] = f"{build['cuda_version']}, cuDNN {build.get('cudnn_version', '?')}"
        import keras
        info["keras"] = keras.__version__
    except ImportError:
        pass
    try:
        import tf_flash
        info["tf_flash"] = tf_flash.__version__
        info["tf_flash_build"] = tf_flash.build_info()
    except Exception as err:  # noqa: BLE001 - the library may be missing on a baseline-only run
        info["tf_flash"] = f"unavailable: {err}"
    if gpu:
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                                  "--format=csv,noheader"], capture_output=True, text=True, timeout=30).stdout
            info["gpus"] = [line.strip() for line in out.splitlines() if line.strip()]
        except (OSError, subprocess.SubprocessError):
            info["gpus"] = []
    return info


# ---------------------------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------------------------

def output_dir(out_dir, quick):
    """--out-dir if given, else results/ (results/quick/ for a --quick smoke run, git-ignored)."""
    if out_dir:
        return out_dir
    return os.path.join(RESULTS_DIR, "quick") if quick else RESULTS_DIR


def command_line():
    return "python benchmarks/" + " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:])


def add_json_argument(parser, name):
    """--json: where a GPU script's result goes (default results/<name>.json, its figure beside it)."""
    parser.add_argument("--json", default=os.path.join(RESULTS_DIR, f"{name}.json"),
                        help=f"the result file (default results/{name}.json; the figure beside it)")


def require_gpu(script):
    import tensorflow as tf
    if not tf.config.list_physical_devices("GPU"):
        raise SystemExit(f"{script} measures the GPU path: no GPU visible")


class RunLog:
    """Prints each line and keeps it in a log file beside the results (git-ignored)."""

    def __init__(self, path):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.file = open(path, "w")

    def __call__(self, msg):
        print(msg, flush=True)
        self.file.write(msg + "\n")
        self.file.flush()

    def close(self):
        self.file.close()


def torch_env():
    """The environment of torch's processes (the benchmarks' peers): this one as it was before TensorFlow's stash
    (.gpu/env/env.sh) was sourced: without PYTHONPATH (the workers import only torch and this folder's
    modules) and with LD_LIBRARY_PATH cut to what follows the stash's entries, which env.sh puts in front (its
    CUDA 12 shims and the folders they point into, an older cuDNN among them)."""
    env = dict(os.environ)
    for name in ("PYTHONPATH", "XLA_FLAGS", "TF_FLASH_LIBRARY"):
        env.pop(name, None)
    paths = env.get("LD_LIBRARY_PATH", "").split(":")
    stash = [i for i, path in enumerate(paths) if ".tf_flash_gpu" in path]
    if stash:
        kept = [path for path in paths[stash[-1] + 1:] if path]
        if kept:
            env["LD_LIBRARY_PATH"] = ":".join(kept)
        else:
            env.pop("LD_LIBRARY_PATH")
    return env
