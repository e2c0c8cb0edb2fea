"""Long-document classification: the same transformer at 512 tokens vs long context.

The experiment of the FlashAttention paper (Section 4.2, long-document classification): the model
that sees more of each document should classify it better, and FlashAttention makes the long context
affordable. This script

1. reads a folder-per-class tree (default ``data/linux-doc``, made by ``prepare_data.py``), splits it
   (stratified, fixed seed) and prints class counts and length statistics;
2. builds the vocabulary on the training split (``keras.layers.TextVectorization``);
3. trains the classifiers once per run, each in its own process, so that its peak memory is its own,
   and keeps each run's best epoch on the validation split (early stopping, ``--patience``):
   ``flash``, the example's encoder with ``tf_flash.layers.FlashMultiHeadAttention``, at each context
   length; ``hub``, a KerasHub encoder (``keras_hub.models.BertBackbone`` from its config, position
   embeddings sized to the context) whose ``keras.layers.MultiHeadAttention`` runs tf_flash's kernels
   through ``tf_flash.keras.enabled()`` (Keras' own flash switch); ``keras``, the example's encoder with
   ``keras.layers.MultiHeadAttention`` (Keras' standard attention) at the long context. ``--seeds N``
   repeats the flash and hub runs with N seeds (data split and vocabulary fixed; initialization, dropout
   and batch order change) and the table reports mean +- standard deviation;
4. writes the results table (``results.md``, ``results.json``) and ``accuracy_vs_context.png``, each
   accuracy beside the chance level (always the training split's most frequent class), and says which
   models did not beat it, why that is likely and what to try;
5. saves the long-context hub model (flash when no hub runs) (with its TextVectorization, so it takes raw text) as
   ``model.keras`` and as a SavedModel (``saved_model/``), reloads both in a fresh process and checks
   that the predictions on the whole test split are identical, then classifies a test document with
   ``predict.py``, whose default model is then this one (``runs/long_document/last_run.json``).

Configurations (``--preset``):

* ``cpu`` (default): finishes in minutes on 2 CPU cores. 1 block, width 64, 2 heads of 32,
  flash at contexts 512 and 2048, hub at 2048, 3 epochs (more on a small data set: at least about 300
  training steps, at most 30 epochs, unless ``--epochs`` is given), batch 16, one seed; the Keras
  baseline at 2048 trains 1 epoch (for its time per epoch and memory; ``--keras-epochs 3`` for an
  equal comparison).
* ``full``: the real experiment, for a GPU: 4 blocks, width 256, 4 heads of 64, 512 tokens vs whole
  documents (16384 tokens, all of nearly every document: train.py prints the share), flash and hub, 3 seeds each, 10 epochs; the
  Keras baseline at 4096 and 16384 (1 epoch: its time and memory, and where it runs out of memory).
* ``tiny``: a few documents per class and a toy model (the end-to-end test).

``--pack`` adds, at each of ``--contexts``, the flash model trained on packed rows (``packed``): instead
of batches of similar-length documents padded to a multiple of 128 tokens, ``tf_flash.data.pack_documents``
packs the documents (cut to the context, as the batches cut them) into rows of exactly the context length,
the attention stays inside each document through ``segment_ids``, the position embedding reads each
token's position within its document, and the classifier pools and classifies each document of a row
(``tf_flash.data.segment_mean``; the loss and accuracy count the real documents only). Every batch has one
shape (one XLA compilation with ``--jit-compile true``). The results give, for every run, the real
(non-padding) training tokens per second and the padding fraction beside the accuracy.

``--context-parallel N`` trains the flash model with each document's sequence split over N replicas of a
``tf.distribute.MirroredStrategy`` (N GPUs, or N logical CPU devices): every replica gets the same
documents (padded to the context), takes its zigzag shard of the tokens and of their positions (positions
of the whole sequence), runs ``FlashMultiHeadAttention(context_parallel=True)`` (attention over the whole
sequence) and pools with the masked mean summed over the replicas; Keras ``fit`` trains it under the
strategy. The test split is classified by the same weights on one device.

Every preset value can be overridden (``--contexts 512,4096 --epochs 5 ...``). Runs that are already
in ``OUT/runs/`` are reused with ``--resume`` (useful to run the full preset piece by piece).
``--publish`` copies the results (table, json, plot) to ``examples/long_document/results/cpu`` or
``gpu``, replacing the previous ones: the repository keeps one current result per device.

TensorFlow's start-up notices (its GPU probe on a machine without one, the oneDNN and CPU-instruction
notices) are hidden in the example's processes; ``--tf-logs`` shows them.
"""
import argparse
import contextlib
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

import cli  # noqa: E402 (no TensorFlow: argument errors stay fast)

RESULTS_DIR = os.path.join(HERE, "results")  # the repository's current results, one folder per device
MAX_AUTO_EPOCHS = 30

PRESETS = {
    # min_steps: without --epochs, a small data set trains more epochs, up to about this many steps
    # (at most MAX_AUTO_EPOCHS): three epochs of a hundred documents are too few steps to learn from.
    "cpu": dict(contexts="512,2048", keras_contexts="long", hub_contexts="long", seeds=1,
                epochs=3, keras_epochs=1, min_steps=300, patience=5,
                batch_size=16, embed_dim=64,
                num_heads=2, ff_dim=128, num_layers=1, vocab_size=20000, learning_rate=2e-3,
                hub_learning_rate=None, hub_warmup_epochs=0,
                max_docs_per_class=0, mixed_precision="none"),
    "full": dict(contexts="512,16384", keras_contexts="4096,16384", hub_contexts="all", seeds=3,
                 epochs=10, keras_epochs=1, min_steps=0, patience=5,
                 batch_size=16, embed_dim=256, num_heads=4, ff_dim=512, num_layers=4,
                 vocab_size=30000, learning_rate=1e-3, max_docs_per_class=0,
                 # The post-LayerNorm BERT encoder is trained as BERT is: a lower rate after a warm-up.
                 # At 1e-3 without warm-up it stalls or collapses after a few epochs in mixed_bfloat16,
                 # with Keras' own attention as with tf_flash's: a property of the recipe.
                 hub_learning_rate=2e-4, hub_warmup_epochs=1,
                 mixed_precision="mixed_bfloat16"),
    "tiny": dict(contexts="64,256", keras_contexts="long", hub_contexts="long", seeds=1,
                 epochs=1, keras_epochs=1, min_steps=0, patience=0,
                 batch_size=8, embed_dim=16,
                 num_heads=2, ff_dim=32, num_layers=1, vocab_size=2000, learning_rate=3e-3,
                 hub_learning_rate=None, hub_warmup_epochs=0,
                 max_docs_per_class=12, mixed_precision="none"),
}


def parse_args(argv):
    p = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    p.add_argument("--full", action="store_const", const="full", dest="preset",
                   help="same as --preset full")
    p.add_argument("--data-dir", default=os.path.join(REPO_ROOT, "data", "linux-doc"),
                   help="folder-per-class tree of text files")
    p.add_argument("--out", default=None, help="output folder (default runs/long_document/PRESET)")
    p.add_argument("--attention", choices=["flash", "keras"], default="flash",
                   help="attention layer of the example's own encoder at --contexts")
    p.add_argument("--pack", action="store_true",
                   help="also train the flash model on packed rows at each of --contexts: documents packed "
                        "into rows of exactly the context length (tf_flash.data.pack_documents), attention "
                        "kept inside each document by segment_ids, one prediction per document")
    p.add_argument("--pack-only", action="store_true",
                   help="--pack without the bucketed flash runs (under --jit-compile true these compile once per "
                        "padded length, the packed ones once)")
    p.add_argument("--context-parallel", type=int, default=1, metavar="N",
                   help="train the flash model with each document's sequence split over N replicas "
                        "(MirroredStrategy over N GPUs, or N logical CPU devices; documents padded to the "
                        "context, which must be a multiple of 2N, of 32N with dropout); 1: off")
    p.add_argument("--pack-batch-size", type=int, default=None,
                   help="rows per packed batch (default: about as many documents per step as --batch-size "
                        "gives the bucketed runs: batch size x mean document length / context, at least 1)")
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
    p.add_argument("--epochs", type=int, default=None,
                   help="training epochs (cpu preset: 3, more on a small data set: about 300 steps, "
                        "at most 30); the best epoch on validation is kept")
    p.add_argument("--patience", type=int, default=None,
                   help="stop a run after this many epochs without a better validation accuracy "
                        "(0: train every epoch; the best epoch is kept either way; presets: 5)")
    p.add_argument("--keep-last", action="store_true",
                   help="keep the last epoch's model instead of the best one on validation")
    for name, typ in [("batch_size", int), ("embed_dim", int), ("num_heads", int),
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
    p.add_argument("--jit-compile", choices=["false", "auto", "true"], default="false",
                   help="Keras jit_compile for every run (false: the same for both attention "
                        "layers; XLA recompiles for every padded length, packed rows compile once; "
                        "auto: Keras' default, XLA on a GPU)")
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
    p.add_argument("--verbose", type=int, default=1, choices=[0, 1, 2],
                   help="Keras fit verbosity (1: progress bars, 2: one line per epoch)")
    p.add_argument("--tf-logs", action="store_true",
                   help="show TensorFlow's own log lines (GPU probing, oneDNN notices), hidden by default")
    p.add_argument("--publish", action="store_true",
                   help="also copy results.md, results.json and the plot to "
                        "examples/long_document/results/cpu (or gpu), replacing the current ones")
    p.add_argument("--replot", action="store_true",
                   help="only rewrite OUT/results.md and redraw OUT/accuracy_vs_context.png from "
                        "OUT/results.json (e.g. for results from a machine without matplotlib)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return args
    args.epochs_given = args.epochs is not None
    for k, v in PRESETS[args.preset].items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    for name in ("epochs", "keras_epochs", "batch_size", "embed_dim", "num_heads", "ff_dim",
                 "num_layers", "vocab_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1. Received: {name}={getattr(args, name)}")
    if args.patience < 0:
        p.error(f"--patience must be >= 0. Received: patience={args.patience}")
    if args.pack_batch_size is not None and args.pack_batch_size < 1:
        p.error(f"--pack-batch-size must be >= 1. Received: pack_batch_size={args.pack_batch_size}")
    args.pack = args.pack or args.pack_only
    if args.context_parallel < 1:
        p.error(f"--context-parallel must be >= 1. Received: context_parallel={args.context_parallel}")
    if args.context_parallel > 1 and args.pack:
        p.error("--context-parallel does not combine with --pack: the sequence-sharded attention takes no "
                f"segment_ids. Received: --pack with context_parallel={args.context_parallel}")
    if args.context_parallel > 1 and args.attention == "keras":
        p.error("--context-parallel shards FlashMultiHeadAttention (Keras' layer attends within one device). "
                f"Received: attention='keras' with context_parallel={args.context_parallel}")
    if args.pack and args.attention == "keras":
        p.error("--pack trains FlashMultiHeadAttention with segment_ids (Keras' layer has none). "
                "Received: --pack with attention='keras'")
    if args.learning_rate <= 0 or (args.hub_learning_rate is not None and args.hub_learning_rate <= 0):
        p.error(f"learning rates must be positive. Received: learning_rate={args.learning_rate}, "
                f"hub_learning_rate={args.hub_learning_rate}")
    if not 0 <= args.dropout < 1:
        p.error(f"--dropout must be in [0, 1). Received: dropout={args.dropout}")
    if args.out is None:
        args.out = os.path.join(REPO_ROOT, "runs", "long_document", args.preset)
    if args.replot:
        if not os.path.isfile(os.path.join(args.out, "results.json")):
            p.error(f"--replot needs OUT/results.json. Received: out={args.out!r}")
        return args
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
    if args.context_parallel > 1:
        # Zigzag shards hold two chunks each; with dropout the kernel draws rows in blocks of 16 per chunk.
        multiple = args.context_parallel * (32 if args.dropout > 0 else 2)
        if any(c % multiple for c in args.contexts):
            p.error(f"--context-parallel {args.context_parallel} needs contexts that are multiples of {multiple} "
                    f"(2 chunks per replica{', 16 tokens a chunk with dropout' if args.dropout > 0 else ''}). "
                    f"Received: contexts={args.contexts}")
    if args.embed_dim % args.num_heads:
        p.error(f"--embed-dim must be divisible by --num-heads. Received: embed_dim="
                f"{args.embed_dim}, num_heads={args.num_heads}")
    problem = data_dir_problem(args.data_dir)
    if problem:
        p.error(problem)
    return args


def data_dir_problem(data_dir):
    """What is wrong with a --data-dir, in one line (None: a folder-per-class tree)."""
    if not os.path.isdir(data_dir):
        hint = ("run examples/long_document/prepare_data.py first" if os.path.abspath(data_dir) ==
                os.path.join(REPO_ROOT, "data", "linux-doc") else "pass a folder-per-class tree")
        return f"--data-dir is not a directory ({hint}). Received: data_dir={data_dir!r}"
    classes = [d for d in sorted(os.listdir(data_dir))
               if os.path.isdir(os.path.join(data_dir, d)) and not d.startswith(".")]
    if len(classes) < 2:
        return (f"--data-dir needs a folder per class, at least 2, each with text files. Received: "
                f"data_dir={data_dir!r} with class folders {classes}")
    empty = [c for c in classes if not any(f for _, _, fs in os.walk(os.path.join(data_dir, c))
                                           for f in fs if not f.startswith("."))]
    if empty:
        return f"--data-dir has class folders without files: {', '.join(empty)}. Received: data_dir={data_dir!r}"
    return None


# ----------------------------------------------------------------------------------------------
# Parent: data, runs, results
# ----------------------------------------------------------------------------------------------
def data_name(data_dir):
    return os.path.basename(os.path.normpath(data_dir))


def repo_relative(path):
    """A path inside the repository as relative to it (results.json stays the same on every clone)."""
    if not os.path.isabs(path):
        return path
    path = os.path.abspath(path)
    return os.path.relpath(path, REPO_ROOT) if path.startswith(REPO_ROOT + os.sep) else path


def prepare(args):
    import numpy as np
    import common

    t0 = time.time()
    texts, labels, class_names, paths, (train, val, test) = common.load_split(
        args.data_dir, seed=args.seed, max_docs_per_class=args.max_docs_per_class)
    words = np.array([len(t.split()) for t in texts])
    vocab = common.build_vocabulary([texts[i] for i in train], args.vocab_size)
    tokens = common.tokenize(texts, vocab)
    lengths = np.array([len(t) for t in tokens])
    chance = common.chance_level(labels, train, test, lengths[test] > common.SHORT_CONTEXT)
    chance["class"] = class_names[chance["class_index"]]
    train_counts = np.bincount(labels[train], minlength=len(class_names))
    steps = math.ceil(len(train) / args.batch_size)
    if not args.epochs_given and args.min_steps and steps * args.epochs < args.min_steps:
        args.epochs = min(MAX_AUTO_EPOCHS, max(args.epochs, math.ceil(args.min_steps / steps)))
        args.epochs_note = (f"{args.epochs} epochs, since {len(train)} training documents make {steps} "
                            f"steps an epoch and learning takes about {args.min_steps} steps "
                            f"(--epochs sets the number)")
    else:
        args.epochs_note = None

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
    print(f"vocabulary: {len(vocab)} entries from the training split ({time.time() - t0:.1f}s)")
    print(f"chance level: {chance['accuracy']:.3f} on the test split (always '{chance['class']}', the "
          f"training split's most frequent class); a model must beat it to have learned anything")
    if args.epochs_note:
        print(args.epochs_note)
    best = "the last epoch's model is kept" if args.keep_last else "the best epoch on validation is kept"
    print(f"training: up to {args.epochs} epochs, {best}"
          + (f", a run stops after {args.patience} epochs without a better one" if args.patience else "")
          + "\n")

    os.makedirs(args.out, exist_ok=True)
    data_path = os.path.join(args.out, "data.npz")
    np.savez(data_path, tokens=np.concatenate(tokens), offsets=np.cumsum([0] + [len(t) for t in tokens]),
             labels=labels, train=train, val=val, test=test)
    with open(os.path.join(args.out, "data.json"), "w") as f:
        json.dump({"data_dir": os.path.abspath(args.data_dir), "class_names": class_names,
                   "vocabulary": vocab, "paths": paths, "num_docs": len(texts),
                   "split": {"train": len(train), "val": len(val), "test": len(test)},
                   "words": ws, "tokens": ts, "chance": chance}, f)
    return dict(class_names=class_names, paths=paths, test=test, words=ws, tokens=ts,
                num_docs=len(texts), split=[len(train), len(val), len(test)], chance=chance,
                name=data_name(args.data_dir), smallest_train_class=int(train_counts.min()),
                vocabulary_sha256=common.vocabulary_fingerprint(vocab))


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


def load_note(results, cores):
    loads = [r["load_avg"] for r in results if r.get("load_avg") is not None]
    if not loads:
        return ""
    if not cores:
        return f" (load average {max(loads):.1f})"
    return (f" (1-minute load average {min(loads):.1f}-{max(loads):.1f} during the runs, "
            f"{cores} cores: other processes shared the machine)" if max(loads) > 1.5 * cores
            else f" (load average {max(loads):.1f}, {cores} cores)")


def fmt(v, spec):
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


METRICS = ("accuracy", "macro_f1", "long_accuracy", "long_macro_f1")
MODEL_NAMES = {"flash": "FlashMultiHeadAttention", "packed": "FlashMultiHeadAttention on packed rows (segment_ids)",
               "hub": "KerasHub BertBackbone + tf_flash.keras", "keras": "keras MultiHeadAttention"}


def aggregate(results):
    """One row per (attention, context): metrics as mean and sample standard deviation over the seeds
    that finished; time as the mean, memory as the maximum."""
    import numpy as np

    rows = []
    for key in dict.fromkeys((r["attention"], r["context"]) for r in results):
        runs = [r for r in results if (r["attention"], r["context"]) == key]
        done = [r for r in runs if r.get("status") == "ok"]
        row = {"attention": key[0], "context": key[1], "seeds": len(done), "runs": len(runs),
               "epochs": max(r["epochs"] for r in done) if done else None,
               "best_epochs": [r["best_epoch"] for r in done if r.get("best_epoch")],
               "train_accuracy": max((r["train_accuracy_best"] for r in done
                                      if r.get("train_accuracy_best") is not None), default=None),
               "test_docs": done[0].get("test_docs") if done else None,
               "status": "ok" if len(done) == len(runs) else
               (f"{len(done)}/{len(runs)} ok; " if done else "") + next(
                   r["status"] for r in runs if r.get("status") != "ok")}
        for metric in METRICS:
            values = np.array([r[metric] for r in done if r.get(metric) is not None], float)
            row[metric] = float(values.mean()) if len(values) else None
            row[metric + "_std"] = float(values.std(ddof=1)) if len(values) > 1 else None
        for metric in ("epoch_s", "epoch_cpu_s", "real_tokens_per_s", "padding_fraction"):
            values = [r[metric] for r in done if r.get(metric) is not None]
            row[metric] = float(np.mean(values)) if values else None
        row["peak_memory_gib"] = max((r["peak_memory_gib"] for r in done), default=None)
        rows.append(row)
    return rows


def fmt_mean(row, metric):
    mean, std = row.get(metric), row.get(metric + "_std")
    return fmt(mean, ".3f") + ("" if std is None else f" +- {std:.3f}")


def fmt_epochs(row):
    """'3' (no validation record), 'best 2 of 3', or for several seeds 'best 4/6/5 of 10'."""
    if row.get("epochs") is None:
        return "-"
    if not row.get("best_epochs"):
        return str(row["epochs"])
    return f"best {'/'.join(map(str, row['best_epochs']))} of {row['epochs']}"


def chance_verdicts(summary, chance):
    """Adds 'beats_chance' (True/False/None) to every summary row."""
    import common

    for row in summary:
        n = row.get("test_docs") or (chance or {}).get("test_docs")
        if chance is None or row.get("accuracy") is None or not n:
            row["beats_chance"] = None
        else:
            row["beats_chance"] = bool(common.beats_chance(row["accuracy"], n, chance["accuracy"]))
    return summary


def chance_paragraph(summary, chance, info, epochs_note=None):
    """The plain statement under the table: every model beat chance, or which did not, why that is
    likely and what to try."""
    import common

    if chance is None:
        return ""
    failed = [r for r in summary if r.get("beats_chance") is False]
    head = (f"Chance level: {chance['accuracy']:.3f} on the {chance['test_docs']} test documents "
            f"(always '{chance['class']}', the training split's most frequent class)")
    if chance.get("long_accuracy") is not None:
        head += f", {chance['long_accuracy']:.3f} on the {chance['long_docs']} longer than 512 tokens"
    head += "."
    if not failed:
        if not any(r.get("beats_chance") for r in summary):
            return head
        return head + (" Every model that finished beat it (one-sided binomial test on the test "
                       "split, p < 0.05).")
    names = ", ".join(f"{r['attention']} at {r['context']} ({r['accuracy']:.3f})" for r in failed)
    train_acc = min((r["train_accuracy"] for r in failed if r.get("train_accuracy") is not None),
                    default=None)
    reasons, tries = common.chance_advice(
        train_docs=info["split"][0], smallest_class=info.get("smallest_train_class"),
        test_docs=chance["test_docs"], epochs=max(r["epochs"] or 0 for r in failed),
        train_accuracy=train_acc, chance=chance["accuracy"])
    text = (f"{head}\n\n**Not better than chance: {names}.** "
            f"{'This model' if len(failed) == 1 else 'These models'} did not learn to classify these "
            f"documents (the accuracy is within what always answering '{chance['class']}' or luck "
            f"gives).")
    if reasons:
        text += " Likely: " + "; ".join(reasons) + "."
    text += " Try: " + "; ".join(tries) + " (examples/README.md, \"Your own documents\")."
    if epochs_note:
        text += f" ({epochs_note}.)"
    return text


def write_results(args, info, results, device, quiet=False, date=None, cores=None):
    summary = chance_verdicts(aggregate(results), info.get("chance"))
    chance = info.get("chance") or {}
    rows = []
    acc_head = "test acc" + (f" (chance {chance['accuracy']:.3f})" if chance else "")
    long_head = "acc >512 tok" + (f" (chance {chance['long_accuracy']:.3f})"
                                  if chance.get("long_accuracy") is not None else "")
    rows.append(f"| model | context | seeds | epochs | {acc_head} | beats chance | macro-F1 | {long_head} | "
                "F1 >512 tok | s/epoch | CPU s/epoch | real tok/s | padding | peak mem GiB | status |")
    rows.append("|" + "---|" * 15)
    for r in summary:
        beats = {True: "yes", False: "**no**", None: "-"}[r.get("beats_chance")]
        padding = r.get("padding_fraction")
        rows.append("| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |".format(
            r["attention"], r["context"], r["seeds"], fmt_epochs(r), fmt_mean(r, "accuracy"), beats,
            fmt_mean(r, "macro_f1"), fmt_mean(r, "long_accuracy"), fmt_mean(r, "long_macro_f1"),
            fmt(r.get("epoch_s"), ".1f"), fmt(r.get("epoch_cpu_s"), ".0f"), fmt(r.get("real_tokens_per_s"), ".0f"),
            "-" if padding is None else f"{padding:.0%}", fmt(r.get("peak_memory_gib"), ".2f"), r["status"]))
    table = "\n".join(rows)
    if any(r["runs"] > 1 for r in summary):
        per_run = ["| model | context | seed | test acc | macro-F1 | acc >512 tok | F1 >512 tok | status |",
                   "|" + "---|" * 8]
        for r in results:
            per_run.append("| {} | {} | {} | {} | {} | {} | {} | {} |".format(
                r["attention"], r["context"], r.get("seed", "-"), *(fmt(r.get(m), ".3f") for m in METRICS),
                r["status"]))
        table += "\n\nEvery run:\n\n" + "\n".join(per_run)
    verdict = chance_paragraph(summary, info.get("chance"), info, getattr(args, "epochs_note", None))
    ok = next((r for r in results if r.get("status") == "ok"), {})
    mem_kind = ok.get("memory_kind", "peak RSS of the training process" if device == "CPU" else "")
    ran = [k for k in MODEL_NAMES if any(r["attention"] == k and r.get("status") == "ok" for r in results)]
    lines = [f"Models: {'; '.join(f'{k}: {MODEL_NAMES[k]}' for k in ran) or 'none finished'}"
             + (" (the hub model computes its attention with tf_flash's kernels through Keras' own "
                "flash switch)" if "hub" in ran else "") + "."]
    if args.seeds > 1:
        lines[-1] += (f" Metrics over several seeds: mean +- sample standard deviation (seeds "
                      f"{args.seed}..{args.seed + args.seeds - 1}; split and vocabulary fixed).")
    kept = ("the last epoch's weights (--keep-last)" if args.keep_last else
            "the weights of the best epoch on the validation split" +
            (f" (a run stops after {args.patience} epochs without a better one)" if args.patience else ""))
    lines.append(f"Data: {info['name']}, {info['num_docs']} documents, {len(info['class_names'])} "
                 f"classes, split train/val/test {'/'.join(map(str, info['split']))}; tokens per "
                 f"document median {info['tokens']['median']}, p90 {info['tokens']['p90']}, max "
                 f"{info['tokens']['max']}.")
    hub_recipe = ""
    if "hub" in ran and (args.hub_learning_rate != args.learning_rate or args.hub_warmup_epochs):
        hub_recipe = f" (hub: {args.hub_learning_rate}" + (
            f", {args.hub_warmup_epochs}-epoch warm-up then cosine decay" if args.hub_warmup_epochs
            else "") + ")"
    baseline = ""
    sharded = next((r for r in results if r.get("context_parallel", 1) > 1 and r.get("status") == "ok"), None)
    if sharded:
        lines[0] += (f" The flash runs trained with each document's sequence split over "
                     f"{sharded['context_parallel']} replicas (--context-parallel: "
                     f"FlashMultiHeadAttention(context_parallel=True) under a MirroredStrategy; documents "
                     f"padded to the context); their test split is classified on one device.")
    packed = {r["context"]: r for r in results if r["attention"] == "packed" and r.get("status") == "ok"}
    baseline_pack = ("; packed batches: " + ", ".join(
        f"{r['pack_batch_size']} rows of {context} tokens (up to {r['max_documents']} documents a row)"
        for context, r in sorted(packed.items()))) if packed else ""
    if "keras" in ran and args.attention != "keras" and args.keras_epochs != args.epochs:
        baseline = f"; the keras baseline trains {args.keras_epochs} epoch{'s' if args.keras_epochs > 1 else ''}"
    lines.append(f"Model: {args.num_layers} block{'s' if args.num_layers > 1 else ''}, width "
                 f"{args.embed_dim}, {args.num_heads} heads, ff {args.ff_dim}, vocabulary "
                 f"{args.vocab_size}, {ok.get('params', '?')} parameters; batch {args.batch_size}, "
                 f"AdamW lr {args.learning_rate}{hub_recipe}, up to {args.epochs} epochs{baseline}{baseline_pack}; "
                 f"evaluated with {kept}; jit_compile={args.jit_compile}, precision "
                 f"{args.mixed_precision}; settings of the {args.preset} preset unless given.")
    long_docs, test_docs = ok.get("long_docs", chance.get("long_docs", "?")), ok.get(
        "test_docs", chance.get("test_docs", "?"))
    lines.append(f"Test accuracy / macro-F1 on all {test_docs} test documents and on the {long_docs} "
                 f"longer than 512 tokens; beats chance: a one-sided binomial test against the chance "
                 f"level, p < 0.05; s/epoch: training + validation, mean over the epochs after the "
                 f"first (one epoch: without its first step, which traces the graph); CPU s/epoch: the "
                 f"process's CPU time per epoch (user + system, all threads: less sensitive to other "
                 f"load than wall time); real tok/s: the training split's real (non-padding) tokens, "
                 f"cut to the context, per second of training (without validation; epochs after the "
                 f"first, or without the first step); padding: the share of the training batches' token "
                 f"slots that are padding; peak memory: {mem_kind}.")
    if date is None:  # this run's, not a record's
        date, cores = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), os.cpu_count()
    lines.append(f"Device: {device}{load_note(results, cores)}; TensorFlow {ok.get('tf_version', '?')}, Keras "
                 f"{ok.get('keras_version', '?')}; {date}.")
    meta = "\n".join(lines)
    md = (f"# Long-document classification on {info['name']}: accuracy against context length\n\n"
          f"{table}\n\n{verdict}\n\n{meta}\n")
    doc = {"preset": args.preset, "device": device, "date": date, "cores": cores, "config": {
        k: (repo_relative(v) if k == "data_dir" else v) for k, v in vars(args).items()
        if k not in ("worker", "out", "publish", "replot", "resume", "tf_logs")}, "data": {
        "name": info["name"], "num_docs": info["num_docs"], "classes": info["class_names"],
        "split": info["split"], "words": info["words"], "tokens": info["tokens"],
        "chance": info.get("chance"), "smallest_train_class": info.get("smallest_train_class")},
        "summary": summary, "runs": results}
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(md)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(doc, f, indent=1)
    if not quiet:
        print("\n" + table + "\n\n" + verdict + "\n\n" + meta + "\n")
    plot(doc, args.out, quiet)
    if args.publish and not quiet:
        publish(args.out, device)


def publish(out, device):
    """Copies the results to the repository's current results of this device, replacing them."""
    import shutil

    dest = os.path.join(RESULTS_DIR, "cpu" if device == "CPU" else "gpu")
    os.makedirs(dest, exist_ok=True)
    for name in ("results.md", "results.json", "accuracy_vs_context.png"):
        if os.path.exists(os.path.join(out, name)):
            shutil.copyfile(os.path.join(out, name), os.path.join(dest, name))
    print(f"published to {repo_relative(dest)}")


MODEL_LABELS = {"flash": "FlashMultiHeadAttention", "packed": "FlashMultiHeadAttention, packed rows",
                "hub": "KerasHub BERT + tf_flash.keras", "keras": "keras MultiHeadAttention"}


def plot(doc, out, quiet=False):
    """accuracy_vs_context.png from a results.json document: the models that finished, all test
    documents (solid, filled markers) and those longer than 512 tokens (dashed, open markers), the
    chance level, failed runs marked at their context. Returns the legend's entries."""
    try:
        import matplotlib
    except ImportError:
        if not quiet:
            print("matplotlib is not installed: `pip install matplotlib` for accuracy_vs_context.png "
                  "(or `train.py --replot --out DIR` on a machine that has it)")
        return []
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results, summary = doc["runs"], aggregate(doc["runs"])
    data = doc.get("data", {})
    chance = data.get("chance")
    name = data.get("name") or os.path.basename(os.path.normpath(doc["config"]["data_dir"]))
    fig, ax = plt.subplots(figsize=(7.0, 4.2))
    styles = {"flash": ("tab:blue", "o"), "packed": ("tab:purple", "D"), "hub": ("tab:green", "^"),
              "keras": ("tab:orange", "s")}
    # Models at the same context and accuracy would hide each other: each is drawn a little to the
    # side of its context (the ticks mark the contexts).
    shift = {"flash": 2 ** -0.08, "packed": 2 ** -0.04, "hub": 1.0, "keras": 2 ** 0.08}
    epochs = {r["epochs"] for r in summary if r["seeds"]}
    for attention in ("flash", "packed", "hub", "keras"):
        done = [r for r in summary if r["attention"] == attention and r["seeds"]]
        color, marker = styles[attention]
        label = MODEL_LABELS[attention]
        if done and len(epochs) > 1:
            n = "/".join(sorted({str(r["epochs"]) for r in done}))
            label += f" ({n} epoch{'' if n == '1' else 's'})"
        if done:
            xs = [r["context"] * shift[attention] for r in done]

            def errors(metric):
                return [r.get(metric + "_std") or 0.0 for r in done]
            all_long = all(r.get("long_docs") == r.get("test_docs") for r in results
                           if r["attention"] == attention and r.get("status") == "ok")
            ax.errorbar(xs, [r["accuracy"] for r in done], yerr=errors("accuracy"), marker=marker,
                        color=color, capsize=3, markersize=7,
                        label=f"{label}: all test docs" + (" (all > 512 tokens)" if all_long else ""))
            longs = [r.get("long_accuracy") for r in done]
            if not all_long and all(v is not None for v in longs):
                ax.errorbar(xs, longs, yerr=errors("long_accuracy"), marker=marker, color=color,
                            linestyle="--", capsize=3, markersize=7, markerfacecolor="white",
                            label=f"{label}: docs > 512 tokens")
        for r in results:
            if r["attention"] == attention and r.get("status") != "ok":
                ax.axvline(r["context"] * shift[attention], color=color, linestyle=":", alpha=0.6)
                ax.annotate(f"{attention}: {r['status'].split(':')[0]}", (r["context"] * shift[attention], 0.05),
                            color=color, rotation=90, fontsize=8, ha="right")
    if chance:
        ax.axhline(chance["accuracy"], color="grey", linestyle=":", linewidth=1.5,
                   label=f"chance: always '{chance['class']}' ({chance['accuracy']:.2f})")
        if chance.get("long_accuracy") is not None and abs(chance["long_accuracy"] - chance["accuracy"]) > 0.01 \
                and chance.get("long_docs") != chance.get("test_docs"):
            ax.axhline(chance["long_accuracy"], color="grey", linestyle="-.", linewidth=1,
                       label=f"chance on docs > 512 tokens ({chance['long_accuracy']:.2f})")
    ax.set_xscale("log", base=2)
    ticks = sorted({r["context"] for r in results})
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.minorticks_off()
    if ticks:
        ax.set_xlim(min(ticks) / 2 ** 0.5, max(ticks) * 2 ** 0.5)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("test accuracy")
    ax.set_ylim(0, 1.05)
    ax.grid(alpha=0.3)
    seeds = max((r["seeds"] for r in summary), default=1)
    test_docs = (chance or {}).get("test_docs") or next((r["test_docs"] for r in summary if r.get("test_docs")), None)
    subtitle = (f"{test_docs} test documents" if test_docs else "") + (
        f", mean +- std over {seeds} seeds" if seeds > 1 else "") + f", {doc.get('device', '')}"
    ax.set_title(f"Long-document classification on {name}\n{subtitle.strip(', ')}", fontsize=10)
    # Below the axes: inside, the legend would hide points.
    legend = ax.legend(fontsize=7.5, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2, frameon=False)
    path = os.path.join(out, "accuracy_vs_context.png")
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    if not quiet:
        print(f"wrote {path}")
    return [t.get_text() for t in legend.get_texts()]


def replot(args):
    """results.md and the plot again from OUT/results.json, with the settings it records."""
    with open(os.path.join(args.out, "results.json")) as f:
        saved = json.load(f)
    # Records without these settings were evaluated with the last epoch's weights.
    config = {"patience": 0, "keep_last": True, "epochs_note": None, **saved["config"],
              "out": args.out, "publish": args.publish}
    data = saved["data"]
    info = {"name": data.get("name") or data_name(config["data_dir"]), "num_docs": data["num_docs"],
            "class_names": data["classes"], "split": data["split"], "words": data["words"],
            "tokens": data["tokens"], "chance": data.get("chance"),
            "smallest_train_class": data.get("smallest_train_class")}
    write_results(argparse.Namespace(**config), info, saved["runs"], saved["device"],
                  date=saved.get("date", "date not recorded"), cores=saved.get("cores"))


def last_run_record(args, info):
    """Points predict.py's default model at this run's saved model."""
    path = cli.last_run_file()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"model": os.path.abspath(os.path.join(args.out, "model.keras")),
                   "out": os.path.abspath(args.out), "data_dir": os.path.abspath(args.data_dir),
                   "data_set": info["name"], "finished": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())},
                  f, indent=1)


def main(argv=None):
    args = parse_args(argv)
    cli.quiet_tensorflow(tf_logs=getattr(args, "tf_logs", False))
    if not args.worker and not args.replot and args.in_process and args.context_parallel > 1 \
            and not cli.gpu_present():
        # The runs share this process: its logical CPU devices must exist before TensorFlow starts.
        import common
        common.ensure_cpu_replicas(args.context_parallel)
    if args.worker:
        cli.import_tensorflow()  # before the run imports Keras, which imports TensorFlow unfiltered
        return worker(args.worker)
    if args.replot:
        replot(args)
        return 0
    t_start = time.time()
    try:
        info = prepare(args)
    except (OSError, ValueError) as e:  # an unreadable tree: one line, as for a bad argument
        print(f"train.py: error: {e}", file=sys.stderr)
        return 2
    device = detect_device()
    seeds = [args.seed + i for i in range(args.seeds)]
    plan = []
    for seed in seeds:
        if not args.pack_only:
            plan += [(args.attention, c, seed) for c in args.contexts]
        if args.pack:
            plan += [("packed", c, seed) for c in args.contexts]
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
    print(f"\ntotal wall time {time.time() - t_start:.0f}s; results in {repo_relative(args.out)}")
    if not any(r.get("status") == "ok" for r in results):
        status = 1
    return status


def check_saved(args, info):
    model = os.path.join(args.out, "model.keras")
    if not os.path.exists(model):
        print("no saved model (the saving run did not finish)")
        return 1
    last_run_record(args, info)
    predict = os.path.join(HERE, "predict.py")
    print(f"\n=== reload in a fresh process: .keras and SavedModel, predictions on the "
          f"{len(info['test'])} test documents must be identical ===", flush=True)
    rc = subprocess.run([sys.executable, predict, "--model", model, "--verify",
                         os.path.join(args.out, "reference.json")]).returncode
    doc = info["paths"][int(info["test"][0])]
    print(f"\n=== predict.py on a test document ({os.path.relpath(doc, args.data_dir)}) ===",
          flush=True)
    rc2 = subprocess.run([sys.executable, predict, "--model", model, doc]).returncode
    return rc or rc2


def detect_device():
    if not cli.gpu_present():
        return "CPU"
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
    replicas = spec.get("context_parallel", 1) if spec["attention"] == "flash" else 1
    # Before TensorFlow's first op: on a CPU the strategy splits it into logical devices.
    strategy = common.replica_strategy(replicas) if replicas > 1 else None
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

    packed = attention == "packed"
    if packed:
        # One model shape for every split: the most documents any row of the context can hold.
        max_documents = common.max_documents_per_row([len(t) for t in tokens], context)
        mean_length = float(np.mean([max(1, min(len(tokens[i]), context)) for i in train]))
        pack_batch_size = spec.get("pack_batch_size") or max(1, round(spec["batch_size"] * mean_length / context))
        result.update(max_documents=max_documents, pack_batch_size=pack_batch_size)

    def batches(idx, shuffle):
        if packed:
            return common.PackedBatches([tokens[i] for i in idx], labels[idx], context, pack_batch_size,
                                        max_documents, shuffle=shuffle, seed=spec["seed"])
        # Sharded, every batch is padded to the context: the shards' length is fixed when the step is traced
        # (the kernel skips the padding all the same: the padding masks become lengths).
        return common.LengthBucketedBatches([tokens[i] for i in idx], labels[idx], context,
                                            spec["batch_size"], shuffle=shuffle, seed=spec["seed"],
                                            pad_to=context if strategy else 128)

    train_b, val_b, test_b = batches(train, True), batches(val, False), batches(test, False)
    real_tokens, token_slots, shapes = train_b.token_stats()
    result.update(real_tokens=int(real_tokens), token_slots=int(token_slots),
                  padding_fraction=1.0 - real_tokens / token_slots, train_shapes=int(shapes))
    if strategy:
        result["context_parallel"] = replicas
    sizes = (spec["embed_dim"], spec["num_heads"], spec["ff_dim"], spec["num_layers"], spec["dropout"])
    # A sharded model's variables and optimizer are made under its strategy.
    with strategy.scope() if strategy else contextlib.nullcontext():
        if strategy:
            model = common.build_sharded_classifier(len(vocab), len(class_names), context, *sizes)
        elif packed:
            model = common.build_packed_classifier(len(vocab), len(class_names), context, max_documents, *sizes)
        elif attention == "hub":
            model = common.build_hub_classifier(len(vocab), len(class_names), context, *sizes)
        else:
            model = common.build_classifier(len(vocab), len(class_names), context, *sizes, attention)
        optimizer = keras.optimizers.AdamW(learning_rate(spec, train_b.num_batches), weight_decay=0.01)
        jit_compile = {"false": False, "auto": "auto", "true": True}[spec["jit_compile"]]
        if packed:
            # One prediction per document slot; the unused slots weigh 0, and the loss is the mean over the
            # real documents (not over every slot), so its scale and the learning rate mean what they mean
            # unpacked.
            model.compile(optimizer=optimizer,
                          loss=keras.losses.SparseCategoricalCrossentropy(reduction="mean_with_sample_weight"),
                          weighted_metrics=["accuracy"], jit_compile=jit_compile)
        else:
            model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy", metrics=["accuracy"],
                          jit_compile=jit_compile)
    result["params"] = int(model.count_params())

    epochs = spec["keras_epochs"] if spec.get("baseline") else spec["epochs"]

    class EpochTimer(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.t, self.first_step, self.cpu = time.perf_counter(), None, time.process_time()

        def on_train_batch_end(self, batch, logs=None):
            self.last_step = time.perf_counter()
            if self.first_step is None:
                self.first_step = self.last_step
            loads.append(os.getloadavg()[0])

        def on_epoch_end(self, epoch, logs=None):
            now = time.perf_counter()
            times.append(now - self.t)
            cpu_times.append(time.process_time() - self.cpu)
            n = train_b.num_batches
            after_first.append((now - self.first_step) * n / max(1, n - 1))
            # The training steps alone (validation runs after the last one): for tokens per second.
            train_times.append(self.last_step - self.t)
            train_after_first.append((self.last_step - self.first_step) * n / max(1, n - 1))

    times, after_first, loads, cpu_times, train_times, train_after_first = [], [], [], [], [], []
    if gpus:
        tf.config.experimental.reset_memory_stats("GPU:0")
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20
    best = common.BestOnValidation(patience=spec["patience"], restore=not spec["keep_last"])
    try:
        # The batches shuffle themselves (documents of similar length stay together): shuffle=False.
        if strategy:
            def sharded(batches):
                # Every replica gets the same documents; their length is static, as the shards need it.
                whole = batches.dataset().map(lambda x, y: (tf.ensure_shape(x, [None, context]), y))
                return common.replicated(strategy, whole)
            history = model.fit(sharded(train_b), validation_data=sharded(val_b), epochs=epochs,
                                steps_per_epoch=train_b.num_batches, validation_steps=val_b.num_batches,
                                callbacks=[EpochTimer(), best], verbose=spec["verbose"], shuffle=False)
            # The test split on one device, by the same weights (the sharding layers are plain there).
            whole_model = common.build_sharded_classifier(len(vocab), len(class_names), context, *sizes)
            whole_model.set_weights(model.get_weights())
            model = whole_model
        else:
            history = model.fit(train_b.dataset(), validation_data=val_b.dataset(), epochs=epochs,
                                callbacks=[EpochTimer(), best], verbose=spec["verbose"], shuffle=False)
        probs = model.predict(test_b.dataset(), verbose=0)
    except tf.errors.ResourceExhaustedError as e:
        result.update(status="OOM", error=str(e).splitlines()[0][:300])
        return finish(spec, result, gpus)
    if packed:
        # probs [rows, max_documents, classes]: each test document in exactly one slot.
        slots = test_b.slots()
        taken = slots >= 0
        order = slots[taken]
        if sorted(order.tolist()) != list(range(len(test))):
            raise RuntimeError(f"packed test rows must hold every test document once. Received: documents "
                               f"{sorted(order.tolist())} of {len(test)}")
        y_pred = probs[taken].argmax(-1)
    else:
        order = test_b.order()
        y_pred = probs.argmax(-1)
    y_true = labels[test][order]
    long = np.array([len(tokens[i]) for i in test])[order] > common.SHORT_CONTEXT
    n = len(class_names)
    hist = history.history
    train_acc = [float(a) for a in hist.get("accuracy", [])]
    best_epoch = best.best_epoch if not spec["keep_last"] else len(train_acc)
    chance = meta.get("chance") or {}
    result.update(
        status="ok", epochs=len(times), epochs_planned=epochs, best_epoch=best_epoch,
        stopped_early=best.stopped_epoch is not None, kept="last" if spec["keep_last"] else "best",
        train_accuracy=train_acc,
        train_accuracy_best=train_acc[best_epoch - 1] if best_epoch and train_acc else None,
        val_loss=[float(a) for a in hist.get("val_loss", [])],
        chance_accuracy=chance.get("accuracy"), epoch_times_s=times,
        epoch_s=float(np.mean(times[1:]) if len(times) > 1 else after_first[0]),
        real_tokens_per_s=real_tokens / float(np.mean(train_times[1:]) if len(train_times) > 1
                                              else train_after_first[0] or train_times[0]),
        load_avg=float(np.mean(loads)) if loads else None, epoch_cpu_times_s=cpu_times,
        epoch_cpu_s=float(np.mean(cpu_times[1:]) if len(cpu_times) > 1 else cpu_times[0]),
        cpu_s=float(sum(resource.getrusage(resource.RUSAGE_SELF)[:2])),
        train_s=float(sum(times)), rss_before_fit_gib=rss0,
        accuracy=common.accuracy(y_true, y_pred), macro_f1=common.macro_f1(y_true, y_pred, n),
        long_accuracy=common.accuracy(y_true[long], y_pred[long]),
        long_macro_f1=common.macro_f1(y_true[long], y_pred[long], n),
        test_docs=int(len(y_true)), long_docs=int(long.sum()),
        val_accuracy=[float(a) for a in hist.get("val_accuracy", [])])
    kept = (f"best epoch {best_epoch} of {len(times)}" + (" (stopped early)" if result["stopped_early"] else "")
            if not spec["keep_last"] else f"last of {len(times)} epochs")
    chance_note = ""
    if chance:
        verdict = ("beats it" if common.beats_chance(result["accuracy"], result["test_docs"], chance["accuracy"])
                   else "NOT better than chance")
        chance_note = f" (chance {chance['accuracy']:.3f}: {verdict})"
    long_note = (f"; on the {result['long_docs']} document{'s' if result['long_docs'] > 1 else ''} > "
                 f"{common.SHORT_CONTEXT} tokens: accuracy "
                 f"{result['long_accuracy']:.3f}" + (f" (chance {chance['long_accuracy']:.3f})"
                                                     if chance.get("long_accuracy") is not None else "")
                 + f", macro-F1 {result['long_macro_f1']:.3f}") if result["long_docs"] else ""
    print(f"[{attention}_{context} seed {spec['seed']}] {kept}: test accuracy {result['accuracy']:.3f}"
          f"{chance_note}, macro-F1 {result['macro_f1']:.3f}{long_note}; {result['epoch_s']:.1f}s/epoch",
          flush=True)
    finish(spec, result, gpus, measure_only=True)
    if spec["save"]:
        save(spec, model, vocab, meta, test, result)
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


def save(spec, classifier, vocab, meta, test, result):
    """Saves the model with its tokenizer (raw text in) as .keras and SavedModel, what it was trained
    on (labels.json: predict.py names the model and checks it against a data set with it), and its
    predictions on the whole test split (reference.json: the reload check)."""
    import tensorflow as tf
    import common

    out = spec["out"]
    text_model = common.build_text_model(classifier, vocab, spec["context"])
    keras_path = os.path.join(out, "model.keras")
    text_model.save(keras_path)
    export_path = os.path.join(out, "saved_model")
    text_model.export(export_path, verbose=False)
    with open(os.path.join(out, "labels.json"), "w") as f:
        json.dump({"class_names": meta["class_names"], "context": spec["context"],
                   "attention": spec["attention"], "data_dir": meta["data_dir"],
                   "data_set": os.path.basename(os.path.normpath(meta["data_dir"])),
                   "num_docs": meta["num_docs"], "split": meta["split"],
                   "vocabulary_size": len(vocab), "vocabulary_sha256": common.vocabulary_fingerprint(vocab),
                   "vocab_size": spec["vocab_size"], "seed": spec["seed"],
                   "max_docs_per_class": spec["max_docs_per_class"], "preset": spec["preset"],
                   "best_epoch": result.get("best_epoch"), "epochs": result.get("epochs"),
                   "test_accuracy": result.get("accuracy"), "chance": meta.get("chance"),
                   "trained": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}, f, indent=1)
    texts = []
    for i in test:
        with open(meta["paths"][int(i)], "rb") as fh:
            texts.append(fh.read().decode("utf-8", errors="replace"))
    probs = text_model.predict(tf.constant(texts), batch_size=16, verbose=0)
    with open(os.path.join(out, "reference.json"), "w") as f:
        json.dump({"texts": texts, "probs": probs.tolist()}, f)
    print(f"saved {keras_path} and {export_path}/ (raw text in, class probabilities out)")


if __name__ == "__main__":
    sys.exit(main())
