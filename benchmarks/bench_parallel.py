#!/usr/bin/env python
"""Context parallelism (tf_flash.parallel): the encoder's training step at S x n tokens on n GPUs.

Model: the encoder of bench_model.py (token embedding plus positions, N blocks of attention, residual,
LayerNorm, GELU MLP 4x width, residual, LayerNorm; mean pooling; a dense head; width 768, 12 heads of 64,
4 blocks, AdamW, mixed_bfloat16), batch 1, its attention FlashMultiHeadAttention(context_parallel=True)
under a MirroredStrategy over n GPUs: each GPU holds S tokens of the sequence (zigzag layout), positions
are those of the whole sequence and the pooling sums over the replicas. n = 1 is the same model without a
strategy on one GPU, at S tokens: the baseline each n is compared with. Positions are sinusoidal (fixed),
not bench_model's learned table: a table of S x n rows would add an all-reduce of its gradient (S x n x
width floats per step) that dwarfs what the attention sends.

Per (n, S): median step time over --steps timed steps (a custom training loop, each step synchronized by
reading its loss), model FLOP/s per GPU (6 x non-embedding parameters x tokens, plus attention's
quadratic 3 x 4 S^2 H D per block, halved with --causal, over n GPUs and the step time), its ratio to
n = 1 at the same S per GPU, the peak memory of the busiest GPU, and the communication share: the step's
collectives (per block the all-gather of K and V and the all-reduce of their full-length gradients, and
the optimizer's all-reduce of the weight gradients) timed alone on tensors of the same sizes, over the step
time (an upper bound: TF may overlap them with compute).

Each (n, S) runs in a worker process of its own (TensorFlow keeps a strategy's collective keys for the
process's life: a second strategy there reuses them and its collectives fail), the lengths of each n in
ascending order; an OOM skips that n's longer lengths; --time-limit (seconds, default 450) starts no worker
after it and stops a running one 20 s past it (the rest marked skipped), so that a default run ends within
8 minutes.
Output: results/parallel.json and results/parallel.png (FLOP/s per GPU and memory against tokens per
GPU, one line per n), rewritten after every run.

    python benchmarks/bench_parallel.py                                # every visible GPU count of 1, 2, 4, 8
    python benchmarks/bench_parallel.py --gpus 8 --lengths-per-gpu 65536,131072 --steps 3   # 512k, 1M tokens
    python benchmarks/bench_parallel.py --quick                        # CPU smoke run: 2 logical CPUs
"""
import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

QUICK = {"width": 32, "heads": 2, "blocks": 1, "vocab": 128, "classes": 4, "gpus": [1, 2],
         "lengths_per_gpu": [64, 128], "warmup": 1, "steps": 2, "dtype": "float32"}


# ---------------------------------------------------------------------------------------------------------
# Worker: one process, one GPU count, a list of lengths
# ---------------------------------------------------------------------------------------------------------

def build_model(cfg, total_len, context_parallel):
    """The encoder of the module docstring on a shard of `total_len` tokens (the whole sequence without
    context parallelism)."""
    import keras
    import tensorflow as tf
    from tf_flash import parallel
    from tf_flash.layers import FlashMultiHeadAttention

    width, heads = cfg["width"], cfg["heads"]

    class Embedding(keras.layers.Layer):
        """Tokens plus the sinusoidal encodings of this shard's positions in the whole sequence."""

        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.tokens = keras.layers.Embedding(cfg["vocab"], width)

        def call(self, ids):
            positions = tf.range(total_len)
            if parallel.in_replica_context():
                positions = parallel.shard_sequence(positions, axis=0)
            rates = 1.0 / 10000.0 ** (tf.range(0, width, 2, dtype=tf.float32) / width)
            angles = tf.cast(positions, tf.float32)[:, None] * rates[None, :]
            encoding = tf.concat([tf.sin(angles), tf.cos(angles)], axis=-1)
            return self.tokens(ids) + tf.cast(encoding, self.compute_dtype)[None]

    class Pool(keras.layers.Layer):
        """The mean over the whole sequence: each replica's sum, summed over the replicas."""

        def call(self, x):
            total = tf.reduce_sum(tf.cast(x, tf.float32), axis=1)
            if parallel.in_replica_context():
                total = tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, total)
            return total / total_len

    ids = keras.Input((None,), batch_size=1, dtype="int32", name="ids")
    x = Embedding(name="embedding")(ids)
    for i in range(cfg["blocks"]):
        attended = FlashMultiHeadAttention(num_heads=heads, key_dim=width // heads, context_parallel=context_parallel,
                                           name=f"attention_{i}")(x, x, use_causal_mask=cfg["causal"])
        x = keras.layers.LayerNormalization(name=f"norm_attention_{i}")(x + attended)
        hidden = keras.layers.Dense(4 * width, activation="gelu", name=f"mlp_in_{i}")(x)
        projected = keras.layers.Dense(width, name=f"mlp_out_{i}")(hidden)
        x = keras.layers.LayerNormalization(name=f"norm_mlp_{i}")(x + projected)
    logits = keras.layers.Dense(cfg["classes"], dtype="float32", name="head")(Pool(name="pool")(x))
    return keras.Model(ids, logits, name=f"encoder_{cfg['blocks']}x{width}")


def model_flops(cfg, model, total_len):
    """Model FLOPs of one training step: 6 x non-embedding parameters x tokens, plus attention's scores and
    weighted sum (fwd 4 S^2 H D per block, halved when causal; backward twice the forward)."""
    embedding = sum(math.prod(w.shape) for w in model.get_layer("embedding").weights)
    dense = 6.0 * (model.count_params() - embedding) * total_len
    head_dim = cfg["width"] // cfg["heads"]
    attention = 3.0 * common.attention_flops(1, total_len, cfg["heads"], head_dim, cfg["causal"], "fwd")
    return dense + cfg["blocks"] * attention


def _peak_bytes(tf, devices):
    return max(tf.config.experimental.get_memory_info(d)["peak"] for d in devices)


def _communication_s(tf, strategy, cfg, model, per_gpu_len, steps):
    """The step's collectives alone: per block, the all-gather of K and V shards [1, S, H, D] and the
    all-reduce of their full-length gradients; the all-reduce of every dense weight gradient (float32) and
    the all-gather of the token embedding's sparse gradient (S rows). In the formats tf_flash.parallel sends
    them: bfloat16 gathered as float16 bits, its gradients summed in float32."""
    bf16 = "bfloat16" in cfg["dtype"]
    gather_dtype, reduce_dtype = (tf.float16, tf.float32) if bf16 else (tf.float32, tf.float32)
    head_dim = cfg["width"] // cfg["heads"]
    embedding = {id(w) for w in model.get_layer("embedding").weights}
    shapes = [w.shape for w in model.trainable_weights if id(w) not in embedding]

    @tf.function
    def collectives():
        def replica_fn():
            ctx = tf.distribute.get_replica_context()
            shard = tf.ones([1, per_gpu_len, cfg["heads"], head_dim], gather_dtype)
            results = []
            for _ in range(cfg["blocks"]):
                gathered = ctx.all_gather([shard, shard], axis=1)
                results += ctx.all_reduce(tf.distribute.ReduceOp.SUM, [tf.cast(g, reduce_dtype) for g in gathered])
            results += ctx.all_reduce(tf.distribute.ReduceOp.SUM, [tf.ones(s, tf.float32) for s in shapes])
            results.append(ctx.all_gather(tf.ones([per_gpu_len, cfg["width"]], tf.float32), axis=0))
            return tf.add_n([tf.cast(tf.reshape(r, [-1])[0], tf.float32) for r in results])

        return strategy.run(replica_fn)

    value = collectives()
    float(strategy.experimental_local_results(value)[0])
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        float(strategy.experimental_local_results(collectives())[0])
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run_length(cfg, n, per_gpu_len):
    import keras
    import tensorflow as tf

    gpus = tf.config.list_logical_devices("GPU") or tf.config.list_logical_devices("CPU")
    devices = [d.name for d in gpus[:n]]
    total_len = per_gpu_len * n
    physical = tf.config.list_physical_devices("GPU")
    device = tf.config.experimental.get_device_details(physical[0]).get("device_name", "GPU") if physical else "CPU"
    record = {"gpus": n, "tokens_per_gpu": per_gpu_len, "tokens": total_len, "causal": cfg["causal"],
              "device": device}
    keras.backend.clear_session()
    keras.config.set_dtype_policy(cfg["dtype"])
    strategy = tf.distribute.MirroredStrategy(devices) if n > 1 else tf.distribute.OneDeviceStrategy(devices[0])
    t0 = time.perf_counter()
    with strategy.scope():
        model = build_model(cfg, total_len, context_parallel=n > 1)
        optimizer = keras.optimizers.AdamW(learning_rate=1e-4)
        optimizer.build(model.trainable_variables)
    record["params"] = int(model.count_params())
    ids = tf.random.stateless_uniform([1, total_len], seed=[1, total_len], maxval=cfg["vocab"], dtype=tf.int32)
    labels = tf.constant([1])
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    from tf_flash import parallel

    @tf.function
    def step():
        def replica_fn():
            shard = parallel.shard_sequence(ids) if n > 1 else ids
            with tf.GradientTape() as tape:
                # Every replica computes the whole sequence's loss (the pooling sums over them), and its
                # gradients cover its own shard: 1/n of the loss each, summed by the optimizer.
                loss = loss_fn(labels, model(shard, training=True)) / n
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss * n

        return strategy.run(replica_fn)

    def run_step():
        return float(strategy.experimental_local_results(step())[0])

    record["build_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    run_step()
    record["first_step_s"] = time.perf_counter() - t0
    for _ in range(cfg["warmup"]):
        run_step()
    memory_devices = [d.split("device:")[-1] for d in devices] if "GPU" in devices[0] else []
    for d in memory_devices:
        tf.config.experimental.reset_memory_stats(d)
    times = []
    for _ in range(cfg["steps"]):
        t = time.perf_counter()
        loss = run_step()
        times.append(time.perf_counter() - t)
    step_s = statistics.median(times)
    flops = model_flops(cfg, model, total_len)
    record.update(status="ok", steps=len(times), median_ms=1e3 * step_s, min_ms=1e3 * min(times),
                  max_ms=1e3 * max(times), loss=loss, model_flops=flops,
                  tflops_per_gpu=flops / n / step_s / 1e12, tokens_per_s=total_len / step_s)
    if memory_devices:
        record["peak_bytes"] = _peak_bytes(tf, memory_devices)
    if n > 1:
        record["communication_ms"] = 1e3 * _communication_s(tf, strategy, cfg, model, per_gpu_len,
                                                            max(3, cfg["steps"] // 2))
        record["communication_share"] = record["communication_ms"] / record["median_ms"]
    return record


def worker_main(task_path):
    with open(task_path) as f:
        task = json.load(f)
    cfg = task["cfg"]
    import tensorflow as tf

    if cfg.get("quick"):
        cpus = tf.config.list_physical_devices("CPU")
        tf.config.set_logical_device_configuration(cpus[0], [tf.config.LogicalDeviceConfiguration()] * 2)
    for gpu in tf.config.list_physical_devices("GPU"):
        tf.config.experimental.set_memory_growth(gpu, True)
    import tf_flash  # noqa: F401

    per_gpu_len = task["length"]
    try:
        record = run_length(cfg, task["gpus"], per_gpu_len)
    except Exception as err:  # noqa: BLE001 - recorded, the parent decides what runs next
        text = common.error_text(err)
        record = {"gpus": task["gpus"], "tokens_per_gpu": per_gpu_len, "tokens": per_gpu_len * task["gpus"],
                  "status": "oom" if text == "OOM" else "error", "error": text}
    with open(task_path + ".result", "w") as f:
        json.dump(record, f)


# ---------------------------------------------------------------------------------------------------------
# Parent: one worker per GPU count, results and figure
# ---------------------------------------------------------------------------------------------------------

def _add_ratios(records):
    """Each run's FLOP/s per GPU over one GPU's of the same kind at the same tokens per GPU."""
    single = {(r.get("device"), r["tokens_per_gpu"]): r["tflops_per_gpu"] for r in records
              if r["gpus"] == 1 and r["status"] == "ok"}
    for r in records:
        key = (r.get("device"), r["tokens_per_gpu"])
        if r["status"] == "ok" and r["gpus"] > 1 and key in single:
            r["flops_per_gpu_vs_one_gpu"] = r["tflops_per_gpu"] / single[key]


def write_outputs(path, records, cfg, args, info):
    _add_ratios(records)
    payload = {"benchmark": "parallel", "command": common.command_line(), "config": cfg, "machine": info,
               "records": records}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=1, default=str)
    _figure(payload, os.path.splitext(path)[0] + ".png")


def _figure(payload, png_path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    ok = [r for r in payload["records"] if r["status"] == "ok"]
    if not ok:
        return
    fig, (ax_flops, ax_mem) = plt.subplots(1, 2, figsize=(11, 4.2))
    kinds = sorted({r.get("device", "") for r in ok})
    for kind, n in sorted({(r.get("device", ""), r["gpus"]) for r in ok}):
        rows = sorted((r for r in ok if r["gpus"] == n and r.get("device", "") == kind),
                      key=lambda r: r["tokens_per_gpu"])
        label = ("1 GPU" if n == 1 else f"{n} GPUs (context parallel)") + (f", {kind}" if len(kinds) > 1 else "")
        ax_flops.plot([r["tokens_per_gpu"] for r in rows], [r["tflops_per_gpu"] for r in rows], "o-", label=label)
        if all("peak_bytes" in r for r in rows):
            ax_mem.plot([r["tokens_per_gpu"] for r in rows], [r["peak_bytes"] / 2**30 for r in rows], "o-",
                        label=label)
    for ax, ylabel in ((ax_flops, "model TFLOP/s per GPU"), (ax_mem, "peak memory of the busiest GPU (GiB)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens per GPU (sequence = tokens per GPU x GPUs)")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    machine = payload["machine"]
    device = "several GPU kinds" if len(kinds) > 1 else (machine.get("gpus") or [machine.get("cpu", "CPU")])[0]
    cfg = payload["config"]
    fig.suptitle(f"Encoder training step, {cfg['blocks']} blocks x {cfg['width']}, context parallel over n GPUs "
                 f"({'causal' if cfg['causal'] else 'bidirectional'}); {device}, {machine.get('date_utc', '')}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="CPU smoke run: tiny model, 2 logical CPU devices")
    p.add_argument("--gpus", default=None, help="comma-separated GPU counts (default: 1, 2, 4, 8 up to the visible)")
    p.add_argument("--lengths-per-gpu", default="16384,32768", help="tokens per GPU, comma-separated")
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--vocab", type=int, default=30522)
    p.add_argument("--classes", type=int, default=8)
    p.add_argument("--causal", action="store_true", help="causal attention (the zigzag layout balances it)")
    p.add_argument("--dtype", default="mixed_bfloat16")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--timeout", type=float, default=240, help="seconds per worker (one GPU count and length)")
    p.add_argument("--time-limit", type=float, default=450,
                   help="seconds: no worker starts after it, and a running one is stopped 20 s past it")
    p.add_argument("--json", default=os.path.join(common.RESULTS_DIR, "parallel.json"))
    p.add_argument("--worker", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _run_worker(cfg, n, per_gpu_len, timeout):
    """One (GPU count, length) in a fresh process: its record. A process runs one strategy: a second
    MirroredStrategy in the same process reuses the first one's collective keys, and TensorFlow then
    mismatches their shapes."""
    with tempfile.TemporaryDirectory() as tmp:
        task_path = os.path.join(tmp, "task.json")
        with open(task_path, "w") as f:
            json.dump({"cfg": cfg, "gpus": n, "length": per_gpu_len}, f)
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
        try:
            proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", task_path], env=env,
                                  capture_output=True, text=True, timeout=max(1.0, timeout))
            failure = None if proc.returncode == 0 else f"worker exit {proc.returncode}: {proc.stderr[-300:]}"
        except subprocess.TimeoutExpired:
            failure = f"worker timeout after {timeout:.0f} s"
        if os.path.exists(task_path + ".result"):
            with open(task_path + ".result") as f:
                return json.load(f)
    return {"gpus": n, "tokens_per_gpu": per_gpu_len, "tokens": per_gpu_len * n,
            "status": failure or "worker wrote no result"}


def _summary(record):
    if record["status"] != "ok":
        return record["status"] + (": " + record["error"] if "error" in record else "")
    text = f"{record['median_ms']:.0f} ms/step, {record['tflops_per_gpu']:.1f} TFLOP/s per GPU"
    if "communication_share" in record:
        text += f", communication {100 * record['communication_share']:.0f}%"
    return text


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        worker_main(args.worker)
        return
    cfg = {"width": args.width, "heads": args.heads, "blocks": args.blocks, "vocab": args.vocab,
           "classes": args.classes, "causal": args.causal, "dtype": args.dtype, "warmup": args.warmup,
           "steps": args.steps, "gpus": None, "lengths_per_gpu": [int(x) for x in args.lengths_per_gpu.split(",")]}
    if args.quick:
        cfg.update(QUICK, quick=True)
        args.json = os.path.join(common.RESULTS_DIR, "quick", "parallel.json")
    import tensorflow as tf  # the parent only counts the GPUs and writes the machine's description

    visible = len(tf.config.list_physical_devices("GPU"))
    if not args.quick and visible == 0:
        raise SystemExit("bench_parallel.py measures GPUs: none visible (--quick runs the CPU smoke run)")
    if args.gpus:
        counts = [int(x) for x in args.gpus.split(",")]
    else:
        counts = cfg["gpus"] or [c for c in (1, 2, 4, 8) if c <= visible]
    cfg["gpus"] = counts
    info = common.machine_info(gpu=not args.quick)
    start, records = time.perf_counter(), []
    for n in counts:
        skip = None  # why this n's longer lengths do not run
        for per_gpu_len in cfg["lengths_per_gpu"]:
            if skip is None and time.perf_counter() - start > args.time_limit:
                skip = "skipped: time limit"
            if skip:
                record = {"gpus": n, "tokens_per_gpu": per_gpu_len, "tokens": per_gpu_len * n, "status": skip}
            else:
                timeout = min(args.timeout, args.time_limit + 20 - (time.perf_counter() - start))
                record = _run_worker(cfg, n, per_gpu_len, timeout)
                if record["status"] == "oom":
                    skip = "skipped: a shorter length ran out of memory"
            records.append(record)
            print(f"{n} GPU(s) x {per_gpu_len} tokens: {_summary(record)}", flush=True)
            write_outputs(args.json, records, cfg, args, info)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
