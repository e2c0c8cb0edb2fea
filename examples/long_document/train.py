"""Long-document classification: the same transformer at 512 tokens vs long context.

The experiment of the FlashAttention paper (Section 4.2, long-document classification): the model
that sees more of each document should classify it better, and FlashAttention makes the long context
affordable. This script

1. reads a folder-per-class tree (default ``data/linux-doc``, made by ``prepare_data.py``), splits it
   (stratified, fixed seed) and prints class counts and length statistics;
2. builds the vocabulary on the training split (``keras.layers.TextVectorization``);
3. trains the classifiers once per run, each in its own process, so that its peak memory is its own:
   ``flash``, the example's encoder with ``tf_flash.layers.FlashMultiHeadAttention``, at each context
   length; ``hub``, a KerasHub encoder (``keras_hub.models.BertBackbone`` from its config, position
   embeddings sized to the context) whose ``keras.layers.MultiHeadAttention`` runs tf_flash's kernels
   through ``tf_flash.keras.enabled()`` (Keras' own flash switch); ``keras``, the example's encoder with
   ``keras.layers.MultiHeadAttention`` (Keras' standard attention) at the long context. ``--seeds N``
   repeats the flash and hub runs with N seeds (data split and vocabulary fixed; initialization, dropout
   and batch order change) and the table reports mean +- standard deviation;
4. writes the results table (``results.md``, ``results.json``) and ``accuracy_vs_context.png``;
5. saves the long-context hub model (flash when no hub runs) (with its TextVectorization, so it takes raw text) as
   ``model.keras`` and as a SavedModel (``saved_model/``), reloads both in a fresh process and checks
   that the predictions are identical, then classifies a test document with ``predict.py``.

Configurations (``--preset``):

* ``cpu`` (default): finishes in minutes on 2 CPU cores. 1 block, width 64, 2 heads of 32,
  flash at contexts 512 and 2048, hub at 2048, 3 epochs, batch 16, one seed; the Keras baseline at
  2048 trains 1 epoch (for its time per epoch and memory; ``--keras-epochs 3`` for an equal
  comparison).
* ``full``: the real experiment, for a GPU: 4 blocks, width 256, 4 heads of 64, 512 tokens vs whole
  documents (16384 tokens, all of nearly every document: train.py prints the share), flash and hub, 3 seeds each, 10 epochs; the
  Keras baseline at 4096 and 16384 (1 epoch: its time and memory, and where it runs out of memory).
* ``tiny``: a few documents per class and a toy model (the end-to-end test).

Every preset value can be overridden (``--contexts 512,4096 --epochs 5 ...``). Runs that are already
in ``OUT/runs/`` are reused with ``--resume`` (useful to run the full preset piece by piece).
"""
import argparse
import json
import math
import os
import platform
import resource
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)

PRESETS = {
    "cpu": dict(contexts="512,2048", keras_contexts="long", hub_contexts="long", seeds=1,
                epochs=3, keras_epochs=1,
                batch_size=16, embed_dim=64,
                num_heads=2, ff_dim=128, num_layers=1, vocab_size=20000, learning_rate=2e-3,
                hub_learning_rate=None, hub_warmup_epochs=0,
                max_docs_per_class=0, mixed_precision="none"),
    "full": dict(contexts="512,16384", keras_contexts="4096,16384", hub_contexts="all", seeds=3,
                 epochs=10, keras_epochs=1,
                 batch_size=16, embed_dim=256, num_heads=4, ff_dim=512, num_layers=4,
                 vocab_size=30000, learning_rate=1e-3, max_docs_per_class=0,
                 # The post-LayerNorm BERT encoder is trained as BERT is: a lower rate after a warm-up.
                 # At 1e-3 without warm-up it stalled or collapsed after a few epochs on the GPU, and
                 # so did Keras' own attention in the same A/B on the CPU (results/gpu_full_seeds_20261123/).
                 hub_learning_rate=2e-4, hub_warmup_epochs=1,
                 mixed_precision="mixed_bfloat16"),
    "tiny": dict(contexts="64,256", keras_contexts="long", hub_contexts="long", seeds=1,
                 epochs=1, keras_epochs=1,
                 batch_size=8, embed_dim=16,
                 num_heads=2, ff_dim=32, num_layers=1, vocab_size=2000, learning_rate=3e-3,
                 hub_learning_rate=None, hub_warmup_epochs=0,
                 max_docs_per_class=12, mixed_precision="none"),
}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    p.add_argument("--full", action="store_const", const="full", dest="preset",
                   help="same as --preset full")
    p.add_argument("--data-dir", default=os.path.join(REPO_ROOT, "data", "linux-doc"),
                   help="folder-per-class tree of text files")
    p.add_argument("--out", default=None, help="output folder (default runs/long_document/PRESET)")
    p.add_argument("--attention", choices=["flash", "keras"], default="flash",
                   help="attention layer of the example's own encoder at --contexts")
    p.add_argument("--contexts", help="comma-separated context lengths in tokens")
    p.add_argument("--keras-contexts",
                   help="contexts for the keras.layers.MultiHeadAttention baseline: a list, "
                        "'long' (the longest of --contexts), 'all', or 'none'")
    p.add_argument("--hub-contexts",
                   help="contexts for the KerasHub encoder (BertBackbone through tf_flash.keras): a list, "
                        "'long', 'all' or 'none'")
    p.add_argument("--seeds", type=int, default=None,
                   help="seeds per flash and hub run (--seed, --seed+1, ...): mean +- std in the table")
    p.add_argument("--save-model", choices=["flash", "hub", "keras"], default=None,
                   help="which model is saved, reloaded and used by predict.py (default: hub when it "
                        "runs, else --attention), at its longest context")
    p.add_argument("--keras-epochs", type=int, default=None,
                   help="epochs of the keras-attention baseline runs (cpu preset: 1, enough for "
                        "its time and memory; its accuracy is then that of 1 epoch)")
    for name, typ in [("epochs", int), ("batch_size", int), ("embed_dim", int), ("num_heads", int),
                      ("ff_dim", int), ("num_layers", int), ("vocab_size", int),
                      ("learning_rate", float), ("max_docs_per_class", int)]:
        p.add_argument("--" + name.replace("_", "-"), type=typ, default=None)
    p.add_argument("--hub-learning-rate", type=float, default=None,
                   help="peak learning rate of the hub runs (default: --learning-rate; full preset: 2e-4)")
    p.add_argument("--hub-warmup-epochs", type=int, default=None,
                   help="hub runs: linear warm-up over this many epochs, then cosine decay to 0 "
                        "(0: the constant rate of the other runs; full preset: 1)")
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--jit-compile", choices=["false", "auto"], default="false",
                   help="Keras jit_compile for every run (false: the same for both attention "
                        "layers; XLA recompiles for every padded length)")
    p.add_argument("--mixed-precision", choices=["none", "mixed_float16", "mixed_bfloat16"],
                   default=None, help="Keras dtype policy (full preset: mixed_bfloat16)")
    p.add_argument("--cpu-memory-limit-gb", type=float, default=12.0,
                   help="on CPU, skip a keras-attention run whose score tensors alone would need "
                        "more than this (the machine may be shared); GPUs report a real OOM")
    p.add_argument("--no-save", action="store_true", help="skip saving, reloading and predicting")
    p.add_argument("--resume", action="store_true", help="reuse finished runs in OUT/runs/")
    p.add_argument("--in-process", action="store_true",
                   help="train every run in this process instead of one process per run (saves "
                        "the start-up time of each; on a GPU the peak memory stays per run, on a "
                        "CPU the RSS peak then accumulates over the runs)")
    p.add_argument("--verbose", type=int, default=1, help="Keras fit verbosity (1: progress bars)")
    p.add_argument("--replot", action="store_true",
                   help="only redraw OUT/accuracy_vs_context.png from OUT/results.json (e.g. for "
                        "results from a machine without matplotlib)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return args
    for k, v in PRESETS[args.preset].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    try:
        args.contexts = sorted({int(c) for c in str(args.contexts).split(",")})
    except ValueError:
        p.error(f"--contexts must be comma-separated integers. Received: contexts={args.contexts!r}")
    if min(args.contexts) < 1:
        p.error(f"--contexts must be positive. Received: contexts={args.contexts}")
    for name in ("keras_contexts", "hub_contexts"):
        value = str(getattr(args, name))
        if value == "long":
            setattr(args, name, [max(args.contexts)])
        elif value == "all":
            setattr(args, name, list(args.contexts))
        elif value == "none":
            setattr(args, name, [])
        else:
            try:
                setattr(args, name, sorted({int(c) for c in value.split(",")}))
            except ValueError:
                p.error(f"--{name.replace('_', '-')} must be a list, 'long', 'all' or 'none'. "
                        f"Received: {name}={value!r}")
    if args.seeds < 1:
        p.error(f"--seeds must be >= 1. Received: seeds={args.seeds}")
    if args.hub_warmup_epochs < 0 or args.hub_warmup_epochs >= args.epochs:
        p.error(f"--hub-warmup-epochs must be >= 0 and below --epochs ({args.epochs}). Received: "
                f"hub_warmup_epochs={args.hub_warmup_epochs}")
    args.hub_learning_rate = args.hub_learning_rate or args.learning_rate  # the hub runs' peak rate
    if args.save_model is None:
        args.save_model = "hub" if args.hub_contexts else args.attention
    saved_contexts = (args.contexts if args.save_model == args.attention else
                      {"hub": args.hub_contexts, "keras": args.keras_contexts}.get(args.save_model, []))
    if not saved_contexts:
        p.error(f"--save-model {args.save_model}: that model has no run. Received: "
                f"save_model={args.save_model!r}")
    args.save_context = max(saved_contexts)
    if args.embed_dim % args.num_heads:
        p.error(f"--embed-dim must be divisible by --num-heads. Received: embed_dim="
                f"{args.embed_dim}, num_heads={args.num_heads}")
    if args.out is None:
        args.out = os.path.join(REPO_ROOT, "runs", "long_document", args.preset)
    return args


# ----------------------------------------------------------------------------------------------
# Parent: data, runs, results
# ----------------------------------------------------------------------------------------------
def prepare(args):
    import numpy as np
    import common

    t0 = time.time()
    texts, labels, class_names, paths = common.load_tree(args.data_dir)
    if args.max_docs_per_class:
        keep = np.concatenate([np.flatnonzero(labels == c)[:args.max_docs_per_class]
                               for c in range(len(class_names))])
        texts, labels, paths = [texts[i] for i in keep], labels[keep], [paths[i] for i in keep]
    train, val, test = common.stratified_split(labels, seed=args.seed)
    words = np.array([len(t.split()) for t in texts])
    vocab = common.build_vocabulary([texts[i] for i in train], args.vocab_size)
    tokens = common.tokenize(texts, vocab)
    lengths = np.array([len(t) for t in tokens])

    print(f"\n{len(texts)} documents in {len(class_names)} classes from {args.data_dir}")
    print(f"split (stratified, seed {args.seed}): train {len(train)}, val {len(val)}, test {len(test)}")
    print(f"\n{'class':<18}{'train':>7}{'val':>6}{'test':>6}{'median words':>14}")
    for c, name in enumerate(class_names):
        n = [int(np.sum(labels[s] == c)) for s in (train, val, test)]
        print(f"{name:<18}{n[0]:>7}{n[1]:>6}{n[2]:>6}{int(np.median(words[labels == c])):>14}")
    ws, ts = common.length_stats(words), common.length_stats(lengths)
    print(f"\nwords per document:  median {ws['median']}, p90 {ws['p90']}, max {ws['max']}")
    print(f"tokens per document: median {ts['median']}, p90 {ts['p90']}, max {ts['max']}; "
          f"{np.mean(lengths > common.SHORT_CONTEXT):.0%} longer than {common.SHORT_CONTEXT} tokens")
    for c in args.contexts:
        print(f"  context {c:>6}: sees all of {np.mean(lengths <= c):.0%} of the documents, "
              f"{np.minimum(lengths, c).sum() / lengths.sum():.0%} of all tokens")
    print(f"vocabulary: {len(vocab)} entries from the training split ({time.time() - t0:.1f}s)\n")

    os.makedirs(args.out, exist_ok=True)
    data_path = os.path.join(args.out, "data.npz")
    np.savez(data_path, tokens=np.concatenate(tokens), offsets=np.cumsum([0] + [len(t) for t in tokens]),
             labels=labels, train=train, val=val, test=test)
    with open(os.path.join(args.out, "data.json"), "w") as f:
        json.dump({"data_dir": os.path.abspath(args.data_dir), "class_names": class_names,
                   "vocabulary": vocab, "paths": paths, "num_docs": len(texts),
                   "split": {"train": len(train), "val": len(val), "test": len(test)},
                   "words": ws, "tokens": ts}, f)
    return dict(class_names=class_names, paths=paths, test=test, words=ws, tokens=ts,
                num_docs=len(texts), split=[len(train), len(val), len(test)])


def estimated_score_gb(args, context):
    """Memory of standard attention's score tensors in training: ~4 [B, H, S, S] float32 per block."""
    return 4 * args.num_layers * args.batch_size * args.num_heads * context ** 2 * 4 / 2 ** 30


def run_name(attention, context, seed=None):
    return f"{attention}_{context}" + ("" if seed is None else f"_seed{seed}")


def launch(args, attention, context, save, seed):
    name = run_name(attention, context, seed if args.seeds > 1 else None)
    os.makedirs(os.path.join(args.out, "runs"), exist_ok=True)
    result_path = os.path.join(args.out, "runs", name + ".json")
    if args.resume and os.path.exists(result_path):
        with open(result_path) as f:
            result = json.load(f)
        if result.get("status") == "ok" or not save:
            print(f"[{name}] reusing {result_path}")
            return result
    spec = {k: v for k, v in vars(args).items() if k != "worker"}
    spec.update(attention=attention, context=context, save=save, result_path=result_path, seed=seed,
                baseline=attention == "keras" and args.attention != "keras")
    spec_path = os.path.join(args.out, "runs", name + ".spec.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    print(f"\n=== {name}: {attention} attention, context {context} tokens ===", flush=True)
    if os.path.exists(result_path):
        os.remove(result_path)
    t0 = time.time()
    if args.in_process:
        import gc
        import keras

        keras.backend.clear_session()
        gc.collect()
        try:
            returncode = worker(spec_path)
        except Exception as e:  # noqa: BLE001 (report the run as failed, go on with the others)
            print(f"[{name}] failed: {type(e).__name__}: {e}", flush=True)
            returncode = 1
    else:
        returncode = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker",
                                     spec_path]).returncode
    if os.path.exists(result_path):
        with open(result_path) as f:
            return json.load(f)
    status = (f"killed by signal {-returncode} (out of memory?)" if returncode < 0
              else f"failed (exit {returncode})")
    result = {"attention": attention, "context": context, "seed": seed, "status": status,
              "wall_s": time.time() - t0}
    with open(result_path, "w") as f:
        json.dump(result, f)
    return result


def load_note(results):
    loads = [r["load_avg"] for r in results if r.get("load_avg") is not None]
    if not loads:
        return ""
    return (f" (1-minute load average {min(loads):.1f}-{max(loads):.1f} during the runs, "
            f"{os.cpu_count()} cores: other processes shared the machine)" if max(loads) > 1.5 *
            os.cpu_count() else f" (load average {max(loads):.1f}, {os.cpu_count()} cores)")


def fmt(v, spec):
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


METRICS = ("accuracy", "macro_f1", "long_accuracy", "long_macro_f1")
MODEL_NAMES = {"flash": "FlashMultiHeadAttention", "hub": "KerasHub BertBackbone + tf_flash.keras",
               "keras": "keras MultiHeadAttention"}


def aggregate(results):
    """One row per (attention, context): metrics as mean and sample standard deviation over the seeds
    that finished; time as the mean, memory as the maximum."""
    import numpy as np

    rows = []
    for key in dict.fromkeys((r["attention"], r["context"]) for r in results):
        runs = [r for r in results if (r["attention"], r["context"]) == key]
        done = [r for r in runs if r.get("status") == "ok"]
        row = {"attention": key[0], "context": key[1], "seeds": len(done), "runs": len(runs),
               "epochs": done[0]["epochs"] if done else None,
               "status": "ok" if len(done) == len(runs) else
               (f"{len(done)}/{len(runs)} ok; " if done else "") + next(
                   r["status"] for r in runs if r.get("status") != "ok")}
        for metric in METRICS:
            values = np.array([r[metric] for r in done], float)
            row[metric] = float(values.mean()) if len(values) else None
            row[metric + "_std"] = float(values.std(ddof=1)) if len(values) > 1 else None
        for metric in ("epoch_s", "epoch_cpu_s"):
            row[metric] = float(np.mean([r[metric] for r in done])) if done else None
        row["peak_memory_gib"] = max((r["peak_memory_gib"] for r in done), default=None)
        rows.append(row)
    return rows


def fmt_mean(row, metric):
    mean, std = row.get(metric), row.get(metric + "_std")
    return fmt(mean, ".3f") + ("" if std is None else f" +- {std:.3f}")


def write_results(args, info, results, device, quiet=False):
    summary = aggregate(results)
    rows = []
    header = ("| model | context | seeds | epochs | test acc | macro-F1 | acc >512 tok | F1 >512 tok | "
              "s/epoch | CPU s/epoch | peak mem GiB | status |")
    rows.append(header)
    rows.append("|" + "---|" * 12)
    for r in summary:
        rows.append("| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |".format(
            r["attention"], r["context"], r["seeds"], fmt(r["epochs"], "d"), fmt_mean(r, "accuracy"),
            fmt_mean(r, "macro_f1"), fmt_mean(r, "long_accuracy"), fmt_mean(r, "long_macro_f1"),
            fmt(r.get("epoch_s"), ".1f"), fmt(r.get("epoch_cpu_s"), ".0f"),
            fmt(r.get("peak_memory_gib"), ".2f"), r["status"]))
    table = "\n".join(rows)
    if any(r["runs"] > 1 for r in summary):
        per_run = ["| model | context | seed | test acc | macro-F1 | acc >512 tok | F1 >512 tok | status |",
                   "|" + "---|" * 8]
        for r in results:
            per_run.append("| {} | {} | {} | {} | {} | {} | {} | {} |".format(
                r["attention"], r["context"], r.get("seed", "-"), *(fmt(r.get(m), ".3f") for m in METRICS),
                r["status"]))
        table += "\n\nEvery run:\n\n" + "\n".join(per_run)
    ok = next((r for r in results if r.get("status") == "ok"), {})
    mem_kind = ok.get("memory_kind", "peak RSS of the training process" if device == "CPU" else "")
    models = "; ".join(f"{k}: {v}" for k, v in MODEL_NAMES.items()
                       if any(r["attention"] == k for r in results))
    hub_recipe = ""
    if args.hub_contexts and (args.hub_learning_rate != args.learning_rate or args.hub_warmup_epochs):
        hub_recipe = f" (hub: {args.hub_learning_rate}" + (f", {args.hub_warmup_epochs}-epoch warm-up then cosine decay"
                                           if args.hub_warmup_epochs else "") + ")"
    meta = (f"Models: {models} (the hub model computes its attention with tf_flash's kernels through "
            f"Keras' own flash switch). Metrics with several seeds: mean +- sample standard "
            f"deviation over the seeds (seeds {args.seed}..{args.seed + args.seeds - 1}; split and "
            f"vocabulary fixed).\n"
            f"Data: {info['num_docs']} documents, {len(info['class_names'])} classes "
            f"({os.path.basename(os.path.normpath(args.data_dir))}), split train/val/test "
            f"{'/'.join(map(str, info['split']))}; tokens per document median {info['tokens']['median']}, "
            f"p90 {info['tokens']['p90']}, max {info['tokens']['max']}.\n"
            f"Model: {args.num_layers} blocks, width {args.embed_dim}, {args.num_heads} heads, "
            f"ff {args.ff_dim}, vocabulary {args.vocab_size}, {ok.get('params', '?')} parameters; "
            f"batch {args.batch_size}, AdamW lr {args.learning_rate}{hub_recipe}, "
            f"jit_compile={args.jit_compile}, precision {args.mixed_precision}.\n"
            f"Test accuracy / macro-F1 on all test documents and on those longer than 512 tokens "
            f"({ok.get('long_docs', '?')} of {ok.get('test_docs', '?')}); s/epoch: training + validation, "
            f"mean over the epochs after the first (one epoch: without its first step, which "
            f"traces the graph); CPU s/epoch: the process's CPU time per "
            f"epoch (user + system, all threads: less sensitive to other load than wall time); "
            f"peak memory: {mem_kind}.\n"
            f"Device: {device}{load_note(results)}; TensorFlow {ok.get('tf_version', '?')}, Keras "
            f"{ok.get('keras_version', '?')}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.")
    md = f"# Long-document classification: context length ({args.preset} preset)\n\n{table}\n\n{meta}\n"
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(md)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"preset": args.preset, "device": device, "config": {
            k: v for k, v in vars(args).items() if k not in ("worker",)}, "data": {
            "num_docs": info["num_docs"], "classes": info["class_names"], "split": info["split"],
            "words": info["words"], "tokens": info["tokens"]}, "summary": summary, "runs": results},
            f, indent=1)
    if not quiet:
        print("\n" + table + "\n\n" + meta + "\n")
    plot(args, results, quiet)


def plot(args, results, quiet=False):
    try:
        import matplotlib
    except ImportError:
        if not quiet:
            print("matplotlib is not installed: `pip install matplotlib` for accuracy_vs_context.png "
                  "(or `train.py --replot --out DIR` on a machine that has it)")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    styles = {"flash": ("tab:blue", "o"), "hub": ("tab:green", "^"), "keras": ("tab:orange", "s")}
    summary = aggregate(results)
    for attention in ("flash", "hub", "keras"):
        runs = [r for r in results if r["attention"] == attention]
        done = [r for r in summary if r["attention"] == attention and r["seeds"]]
        color, marker = styles[attention]
        label = {"flash": "FlashMultiHeadAttention", "hub": "KerasHub BERT + tf_flash.keras",
                 "keras": "keras MultiHeadAttention"}[attention]
        if done and len({r["epochs"] for r in summary if r["seeds"]}) > 1:
            n = "/".join(sorted({str(r["epochs"]) for r in done}))
            label += f" ({n} epoch{'' if n == '1' else 's'})"
        if done:
            def errors(metric):
                return [r[metric + "_std"] or 0.0 for r in done]
            ax.errorbar([r["context"] for r in done], [r["accuracy"] for r in done], yerr=errors("accuracy"),
                        marker=marker, color=color, capsize=3, label=f"{label}: all test docs")
            ax.errorbar([r["context"] for r in done], [r["long_accuracy"] for r in done],
                        yerr=errors("long_accuracy"), marker=marker, color=color, linestyle="--", capsize=3,
                        label=f"{label}: docs > 512 tokens")
        for r in runs:
            if r.get("status") != "ok":
                ax.axvline(r["context"], color=color, linestyle=":", alpha=0.6)
                ax.annotate(r["status"].split(":")[0], (r["context"], 0.05), color=color, rotation=90,
                            fontsize=8, ha="right")
    ax.set_xscale("log", base=2)
    ticks = sorted({r["context"] for r in results})
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("test accuracy")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    seeds = max((r["seeds"] for r in summary), default=1)
    ax.set_title(f"Long-document classification ({args.preset} preset"
                 + (f", mean +- std over {seeds} seeds)" if seeds > 1 else ")"))
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    path = os.path.join(args.out, "accuracy_vs_context.png")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    if not quiet:
        print(f"wrote {path}")


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        return worker(args.worker)
    if args.replot:
        with open(os.path.join(args.out, "results.json")) as f:
            saved = json.load(f)
        args.preset = saved["preset"]
        plot(args, saved["runs"])
        return 0
    t_start = time.time()
    info = prepare(args)
    device = detect_device()
    seeds = [args.seed + i for i in range(args.seeds)]
    plan = []
    for seed in seeds:
        plan += [(args.attention, c, seed) for c in args.contexts]
        plan += [("hub", c, seed) for c in args.hub_contexts]
    # The Keras baseline shows time and memory (and where it runs out of memory): one seed.
    plan += [("keras", c, seeds[0]) for c in args.keras_contexts if ("keras", c, seeds[0]) not in plan]
    save_run = (args.save_model, args.save_context, seeds[0])
    results = []
    for attention, context, seed in plan:
        if attention == "keras" and device == "CPU" and \
                estimated_score_gb(args, context) > args.cpu_memory_limit_gb:
            gb = estimated_score_gb(args, context)
            print(f"\n=== keras_{context}: skipped, attention scores alone need ~{gb:.0f} GiB > "
                  f"--cpu-memory-limit-gb {args.cpu_memory_limit_gb:g} ===")
            results.append({"attention": attention, "context": context, "seed": seed,
                            "status": f"skipped: ~{gb:.0f} GiB of scores"})
            continue
        results.append(launch(args, attention, context,
                              save=not args.no_save and (attention, context, seed) == save_run, seed=seed))
        write_results(args, info, results, device, quiet=True)  # partial results survive a kill
    write_results(args, info, results, device)

    status = 0
    if not args.no_save:
        status = check_saved(args, info)
    print(f"\ntotal wall time {time.time() - t_start:.0f}s; results in {args.out}")
    if any(r.get("status") == "ok" for r in results) is False:
        status = 1
    return status


def check_saved(args, info):
    model = os.path.join(args.out, "model.keras")
    if not os.path.exists(model):
        print("no saved model (the saving run did not finish)")
        return 1
    predict = os.path.join(HERE, "predict.py")
    print("\n=== reload in a fresh process: .keras and SavedModel, predictions must be identical ===",
          flush=True)
    rc = subprocess.run([sys.executable, predict, "--model", model, "--verify",
                         os.path.join(args.out, "reference.json")]).returncode
    doc = info["paths"][int(info["test"][0])]
    print(f"\n=== predict.py on a test document ({os.path.relpath(doc, args.data_dir)}) ===",
          flush=True)
    rc2 = subprocess.run([sys.executable, predict, "--model", model, doc]).returncode
    return rc or rc2


def detect_device():
    out = subprocess.run([sys.executable, "-c",
                          "import os; os.environ['TF_CPP_MIN_LOG_LEVEL']='3'\n"
                          "import tensorflow as tf\n"
                          "g = tf.config.list_physical_devices('GPU')\n"
                          "print(tf.config.experimental.get_device_details(g[0]).get('device_name', 'GPU') "
                          "if g else 'CPU')"], capture_output=True, text=True)
    name = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else "CPU"
    if name == "CPU":
        return "CPU"
    return name


# ----------------------------------------------------------------------------------------------
# Worker: one training run in its own process
# ----------------------------------------------------------------------------------------------
def worker(spec_path):
    with open(spec_path) as f:
        spec = json.load(f)
    if spec["attention"] != "hub":
        return train_run(spec)
    import warnings
    import common

    # KerasHub's BertBackbone has a pooler this classifier does not use (it pools the sequence).
    warnings.filterwarnings("ignore", message=r"Gradients do not exist for variables \['pooled_dense")
    # Keras' own flash switch, served by tf_flash: the encoder's MultiHeadAttention runs our kernels.
    # Only inside this run: a keras baseline trained later in the same process (--in-process) keeps
    # Keras' standard attention.
    with common.import_tf_flash().keras.enabled():
        return train_run(spec)


def learning_rate(spec, steps_per_epoch):
    """The run's AdamW rate: constant, or for a hub run with warm-up epochs a linear warm-up to the hub
    rate followed by cosine decay over the remaining steps."""
    import keras

    if spec["attention"] != "hub":
        return spec["learning_rate"]
    if not spec["hub_warmup_epochs"]:
        return spec["hub_learning_rate"]
    warmup_steps = spec["hub_warmup_epochs"] * steps_per_epoch
    return keras.optimizers.schedules.CosineDecay(
        0.0, decay_steps=max(1, spec["epochs"] * steps_per_epoch - warmup_steps),
        warmup_target=spec["hub_learning_rate"],
        warmup_steps=warmup_steps)


def train_run(spec):
    import numpy as np
    import keras
    import tensorflow as tf
    import common

    out = spec["out"]
    data = np.load(os.path.join(out, "data.npz"))
    with open(os.path.join(out, "data.json")) as f:
        meta = json.load(f)
    offsets, flat = data["offsets"], data["tokens"]
    tokens = [flat[offsets[i]:offsets[i + 1]] for i in range(len(offsets) - 1)]
    labels, train, val, test = data["labels"], data["train"], data["val"], data["test"]
    vocab, class_names = meta["vocabulary"], meta["class_names"]
    context, attention = spec["context"], spec["attention"]
    gpus = tf.config.list_physical_devices("GPU")
    result = {"attention": attention, "context": context, "seed": spec["seed"], "tf_version": tf.__version__,
              "keras_version": keras.__version__, "host": platform.node()}

    common.set_seed(spec["seed"])
    if spec["mixed_precision"] != "none":
        keras.mixed_precision.set_global_policy(spec["mixed_precision"])

    def batches(idx, shuffle):
        return common.LengthBucketedBatches([tokens[i] for i in idx], labels[idx], context,
                                            spec["batch_size"], shuffle=shuffle, seed=spec["seed"])

    train_b, val_b, test_b = batches(train, True), batches(val, False), batches(test, False)
    if attention == "hub":
        model = common.build_hub_classifier(len(vocab), len(class_names), context, spec["embed_dim"],
                                            spec["num_heads"], spec["ff_dim"], spec["num_layers"],
                                            spec["dropout"])
    else:
        model = common.build_classifier(len(vocab), len(class_names), context, spec["embed_dim"],
                                        spec["num_heads"], spec["ff_dim"], spec["num_layers"],
                                        spec["dropout"], attention)
    model.compile(optimizer=keras.optimizers.AdamW(learning_rate(spec, train_b.num_batches), weight_decay=0.01),
                  loss="sparse_categorical_crossentropy", metrics=["accuracy"],
                  jit_compile=False if spec["jit_compile"] == "false" else "auto")
    result["params"] = int(model.count_params())

    epochs = spec["keras_epochs"] if spec.get("baseline") else spec["epochs"]

    class EpochTimer(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.t, self.first_step, self.cpu = time.perf_counter(), None, time.process_time()

        def on_train_batch_end(self, batch, logs=None):
            if self.first_step is None:
                self.first_step = time.perf_counter()
            loads.append(os.getloadavg()[0])

        def on_epoch_end(self, epoch, logs=None):
            now = time.perf_counter()
            times.append(now - self.t)
            cpu_times.append(time.process_time() - self.cpu)
            n = train_b.num_batches
            after_first.append((now - self.first_step) * n / max(1, n - 1))

    times, after_first, loads, cpu_times = [], [], [], []
    if gpus:
        tf.config.experimental.reset_memory_stats("GPU:0")
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20
    try:
        history = model.fit(train_b.dataset(), validation_data=val_b.dataset(), epochs=epochs,
                            callbacks=[EpochTimer()], verbose=spec["verbose"])
        probs = model.predict(test_b.dataset(), verbose=0)
    except tf.errors.ResourceExhaustedError as e:
        result.update(status="OOM", error=str(e).splitlines()[0][:300])
        return finish(spec, result, gpus)
    order = test_b.order()
    y_true = labels[test][order]
    y_pred = probs.argmax(-1)
    long = np.array([len(tokens[i]) for i in test])[order] > common.SHORT_CONTEXT
    n = len(class_names)
    result.update(
        status="ok", epochs=epochs, epoch_times_s=times,
        epoch_s=float(np.mean(times[1:]) if len(times) > 1 else after_first[0]),
        load_avg=float(np.mean(loads)) if loads else None, epoch_cpu_times_s=cpu_times,
        epoch_cpu_s=float(np.mean(cpu_times[1:]) if len(cpu_times) > 1 else cpu_times[0]),
        cpu_s=float(sum(resource.getrusage(resource.RUSAGE_SELF)[:2])),
        train_s=float(sum(times)), rss_before_fit_gib=rss0,
        accuracy=common.accuracy(y_true, y_pred), macro_f1=common.macro_f1(y_true, y_pred, n),
        long_accuracy=common.accuracy(y_true[long], y_pred[long]),
        long_macro_f1=common.macro_f1(y_true[long], y_pred[long], n),
        test_docs=int(len(y_true)), long_docs=int(long.sum()),
        val_accuracy=[float(a) for a in history.history.get("val_accuracy", [])])
    print(f"[{attention}_{context} seed {spec['seed']}] test accuracy {result['accuracy']:.3f}, macro-F1 "
          f"{result['macro_f1']:.3f}; on the {result['long_docs']} documents > "
          f"{common.SHORT_CONTEXT} tokens: accuracy {result['long_accuracy']:.3f}, macro-F1 "
          f"{result['long_macro_f1']:.3f}; {result['epoch_s']:.1f}s/epoch", flush=True)
    finish(spec, result, gpus, measure_only=True)
    if spec["save"]:
        save(spec, model, vocab, class_names, meta["paths"], test)
    return finish(spec, result, gpus)


def finish(spec, result, gpus, measure_only=False):
    if "peak_memory_gib" not in result:
        if gpus:
            import tensorflow as tf
            result["peak_memory_gib"] = tf.config.experimental.get_memory_info("GPU:0")["peak"] / 2 ** 30
            result["memory_kind"] = "peak GPU memory (tf.config.experimental.get_memory_info)"
        else:
            result["peak_memory_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20
            result["memory_kind"] = ("peak RSS of the training process (includes ~"
                                     f"{result.get('rss_before_fit_gib', 0):.1f} GiB before fit)")
            if spec.get("in_process"):
                result["memory_kind"] += ", accumulated over the runs (--in-process)"
    if measure_only:
        return 0
    with open(spec["result_path"], "w") as f:
        json.dump(result, f, indent=1)
    return 0


def save(spec, classifier, vocab, class_names, paths, test):
    """Saves the model with its tokenizer (raw text in) as .keras and SavedModel + reference outputs."""
    import tensorflow as tf
    import common

    out = spec["out"]
    text_model = common.build_text_model(classifier, vocab, spec["context"])
    keras_path = os.path.join(out, "model.keras")
    text_model.save(keras_path)
    export_path = os.path.join(out, "saved_model")
    text_model.export(export_path, verbose=False)
    with open(os.path.join(out, "labels.json"), "w") as f:
        json.dump({"class_names": class_names, "context": spec["context"],
                   "attention": spec["attention"]}, f)
    sample = [int(i) for i in test[:16]]
    texts = []
    for i in sample:
        with open(paths[i], "rb") as fh:
            texts.append(fh.read().decode("utf-8", errors="replace"))
    probs = text_model.predict(tf.constant(texts), batch_size=4, verbose=0)
    with open(os.path.join(out, "reference.json"), "w") as f:
        json.dump({"texts": texts, "probs": probs.tolist()}, f)
    print(f"saved {keras_path} and {export_path}/ (raw text in, class probabilities out)")


if __name__ == "__main__":
    sys.exit(main())
