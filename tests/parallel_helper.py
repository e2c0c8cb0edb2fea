"""Fresh-process side of tests/test_parallel.py: `python tests/parallel_helper.py COMMAND OUT_DIR`.

tf.distribute needs its devices before TensorFlow starts, so every strategy runs here, in a process of its
own. Commands (each writes OUT_DIR/<name>.json):
  logical  4 logical CPU devices; MirroredStrategy over 2 and over 4 of them: every CASE sharded against
           the unsharded call (cases.json), shard/unshard round trips (layouts.json), the Keras layer with
           context_parallel=True (layer.json)
  worker   one worker of a MultiWorkerMirroredStrategy (TF_CONFIG from the environment, one CPU device
           each): Keras fit of saving_helper.build_model (weights to worker<i>.npz) and the CASES marked
           for workers (worker<i>.json)
  gpu      MirroredStrategy over the visible GPUs: the CASES marked for GPUs in bfloat16, with the error of
           the unsharded bfloat16 call against float64 beside each (gpu.json)
"""
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import numpy as np  # noqa: E402

# name -> (sequence length, key/value heads, context_parallel_attention keywords, where else it runs: "n4"
# also over 4 replicas (every case runs over 2), "workers" also by 2 worker processes, "gpu" also on GPUs).
# Batch 2, 4 query heads, head dim 16. With dropout the chunk length S / 2n must be a multiple of 16 at n = 4.
CASES = {
    "plain": (64, 4, dict(), ("n4", "workers")),
    "causal": (64, 4, dict(causal=True), ("n4", "workers", "gpu")),
    "causal_contiguous": (64, 4, dict(causal=True, layout="contiguous"), ()),
    "ragged": (64, 4, dict(causal=True, q_lengths=[64, 37], kv_lengths=[50, 29]), ("n4", "workers", "gpu")),
    "ragged_noncausal": (64, 4, dict(q_lengths=[21, 64], kv_lengths=[64, 9]), ("n4",)),
    "window": (64, 4, dict(window=(5, 3)), ("n4", "gpu")),
    "causal_window": (64, 4, dict(causal=True, window=(11, None), layout="contiguous"), ()),
    "gqa_softcap": (64, 2, dict(causal=True, softcap=3.0, scale=0.4), ("n4", "gpu")),
    "mqa_deterministic": (64, 1, dict(deterministic=True), ()),
    "lse": (64, 4, dict(causal=True, return_lse=True), ()),
    "dropout": (128, 2, dict(causal=True, dropout_rate=0.2, seed=7), ("n4", "workers", "gpu")),
    "dropout_ragged": (128, 4, dict(dropout_rate=0.3, seed=[3, 4], kv_lengths=[100, 128]), ()),
    "key_padding_mask": (64, 4, dict(attention_mask="keys"), ()),
    "attention_mask": (64, 4, dict(causal=True, attention_mask="full"), ()),
    "block_mask": (64, 4, dict(block_mask="blocks", block_size=8), ("n4",)),
    # TF's collectives take no bfloat16: K and V travel as float16 bits, their gradients as float32.
    "bfloat16": (64, 2, dict(causal=True, dtype="bfloat16"), ("n4",)),
}
BATCH, HEADS, HEAD_DIM = 2, 4, 16


def case_inputs(name, dtype=np.float32):
    """The case's whole-sequence inputs (NumPy) and its keywords, from a generator seeded by the name."""
    seqlen, heads_kv, kwargs, _ = CASES[name]
    rng = np.random.default_rng(sum(map(ord, name)))
    kwargs = dict(kwargs)
    arrays = dict(q=rng.standard_normal((BATCH, seqlen, HEADS, HEAD_DIM)),
                  k=rng.standard_normal((BATCH, seqlen, heads_kv, HEAD_DIM)),
                  v=rng.standard_normal((BATCH, seqlen, heads_kv, HEAD_DIM)),
                  d_out=rng.standard_normal((BATCH, seqlen, HEADS, HEAD_DIM)),
                  d_lse=rng.standard_normal((BATCH, HEADS, seqlen)))
    arrays = {key: value.astype(dtype) for key, value in arrays.items()}
    arrays["d_lse"] = arrays["d_lse"].astype(np.float32)
    if kwargs.get("attention_mask") == "keys":
        kwargs["attention_mask"] = rng.random((BATCH, 1, 1, seqlen)) < 0.8
    elif kwargs.get("attention_mask") == "full":
        kwargs["attention_mask"] = rng.random((BATCH, HEADS, seqlen, seqlen)) < 0.7
    if kwargs.get("block_mask") == "blocks":
        blocks = seqlen // kwargs["block_size"]
        kwargs["block_mask"] = rng.random((blocks, blocks)) < 0.6
    for key in ("q_lengths", "kv_lengths"):
        if key in kwargs:
            kwargs[key] = np.asarray(kwargs[key], np.int32)
    if isinstance(kwargs.get("seed"), list):
        kwargs["seed"] = np.asarray(kwargs["seed"], np.int64)
    return arrays, kwargs


def _max_error(actual, expected):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    finite = np.isfinite(expected)
    if not np.array_equal(finite, np.isfinite(actual)) or not np.array_equal(expected[~finite], actual[~finite]):
        return float("inf")
    if not finite.any():
        return 0.0
    return float(np.abs(actual[finite] - expected[finite]).max() / max(1.0, np.abs(expected[finite]).max()))


def unsharded(arrays, kwargs, dtype=None):
    """(output, lse, dq, dk, dv) of tf_flash.flash_attention on the whole sequence, as NumPy float64."""
    import tensorflow as tf
    import tf_flash

    kwargs = {key: value for key, value in kwargs.items() if key not in ("layout", "return_lse")}
    tensors = [tf.constant(arrays[key], dtype) for key in ("q", "k", "v")]
    with tf.GradientTape() as tape:
        tape.watch(tensors)
        output, lse = tf_flash.flash_attention(*tensors, return_lse=True, **kwargs)
        loss = tf.reduce_sum(tf.cast(output, tf.float32) * tf.cast(arrays["d_out"], tf.float32))
        loss += tf.reduce_sum(tf.where(tf.math.is_finite(lse), lse * arrays["d_lse"], 0.0))
    grads = tape.gradient(loss, tensors)
    return [np.asarray(tf.cast(x, tf.float64)) for x in [output, lse] + grads]


def _shards(x, layout, replicas, axis=1):
    """Every replica's shard of the NumPy array `x` (tf_flash.parallel.chunks_of: the layout's definition)."""
    from tf_flash import parallel

    counts = [parallel.chunks_of(layout, replicas, r) for r in range(replicas)]
    pieces = np.split(x, counts[0][1], axis=axis)
    return [np.concatenate([pieces[c] for c in chunks], axis) for chunks, _ in counts]


def _whole(shards, layout, axis=1):
    """The inverse of _shards."""
    from tf_flash import parallel

    replicas = len(shards)
    chunks = [parallel.chunks_of(layout, replicas, r)[0] for r in range(replicas)]
    pieces = {}
    for shard, held in zip(shards, chunks):
        pieces.update(zip(held, np.split(shard, len(held), axis=axis)))
    return np.concatenate([pieces[c] for c in sorted(pieces)], axis)


def sharded(strategy, arrays, kwargs, dtype=None):
    """The same five tensors from context_parallel_attention on the shards of `strategy`'s replicas
    (cut and joined here in NumPy: the collectives under test are the attention's own)."""
    import tensorflow as tf
    from tf_flash import parallel

    kwargs = dict(kwargs)
    layout = kwargs.pop("layout", "zigzag")
    kwargs.pop("return_lse", None)
    n = strategy.num_replicas_in_sync
    shards = {key: _shards(arrays[key], layout, n) for key in ("q", "k", "v", "d_out")}
    shards["d_lse"] = _shards(arrays["d_lse"], layout, n, axis=2)
    # With several worker processes each holds only its replicas' results: unshard_sequence gathers them.
    gather = len(strategy.extended.worker_devices) < n

    @tf.function
    def step():
        def replica_fn():
            replica = tf.get_static_value(tf.distribute.get_replica_context().replica_id_in_sync_group)
            q, k, v = (tf.constant(shards[key][replica], dtype) for key in ("q", "k", "v"))
            with tf.GradientTape() as tape:
                tape.watch([q, k, v])
                output, lse = parallel.context_parallel_attention(q, k, v, layout=layout, return_lse=True, **kwargs)
                loss = tf.reduce_sum(tf.cast(output, tf.float32) * shards["d_out"][replica])
                loss += tf.reduce_sum(tf.where(tf.math.is_finite(lse), lse * shards["d_lse"][replica], 0.0))
            results = [output, lse] + tape.gradient(loss, [q, k, v])
            if gather:
                results = [parallel.unshard_sequence(x, layout, axis=2 if i == 1 else 1) for i, x in enumerate(results)]
            return results

        return strategy.run(replica_fn)

    results = [[np.asarray(tf.cast(x, tf.float64)) for x in strategy.experimental_local_results(value)]
               for value in step()]
    if gather:
        return [per_replica[0] for per_replica in results]
    return [_whole(per_replica, layout, axis=2 if index == 1 else 1) for index, per_replica in enumerate(results)]


NAMES = ("out", "lse", "dq", "dk", "dv")


def compare_case(strategy, name, dtype=None):
    arrays, kwargs = case_inputs(name)
    dtype = kwargs.pop("dtype", dtype)
    expected = unsharded(arrays, kwargs, dtype)
    actual = sharded(strategy, arrays, kwargs, dtype)
    result = {key: _max_error(a, e) for key, a, e in zip(NAMES, actual, expected)}
    result["scale"] = float(np.abs(expected[0]).max())
    if kwargs.get("dropout_rate"):  # the mask matters: without dropout the output differs
        plain = unsharded(arrays, dict(kwargs, dropout_rate=0.0))
        result["dropout_effect"] = _max_error(expected[0], plain[0])
    return result


def _strategies(devices):
    import tensorflow as tf

    strategies = {}
    for n in (2, 4):
        if n <= len(devices):
            # Two strategies in one process need collective group keys apart (TF's hook for its own tests).
            tf.distribute.MirroredStrategy._collective_key_base = 1000 * n
            strategies[n] = tf.distribute.MirroredStrategy(devices[:n])
    return strategies


def _layouts(strategies):
    """shard_sequence / unshard_sequence: round trips (axes, dtypes) and gradients of both."""
    import tensorflow as tf
    from tf_flash import parallel

    rng = np.random.default_rng(1)
    result = {}
    for n, strategy in strategies.items():
        for layout in ("zigzag", "contiguous"):
            x = rng.standard_normal((2, 3, 8 * n, 5)).astype(np.float32)
            w = rng.standard_normal(x.shape).astype(np.float32)
            tokens = rng.integers(0, 100, size=(3, 8 * n)).astype(np.int32)

            @tf.function
            def step(layout=layout):
                def replica_fn():
                    full = tf.constant(x)
                    with tf.GradientTape(persistent=True) as tape:
                        tape.watch(full)
                        shard = parallel.shard_sequence(full, layout, axis=2)
                        shard_loss = tf.reduce_sum(shard * parallel.shard_sequence(tf.constant(w), layout, axis=-2))
                        whole = parallel.unshard_sequence(shard, layout, axis=-2)
                        whole_loss = tf.reduce_sum(whole * w)
                    token_shard = parallel.shard_sequence(tf.constant(tokens), layout)
                    mask_shard = parallel.shard_sequence(tf.constant(tokens) > 50, layout)
                    return dict(shard=shard, whole=whole, d_shard=tape.gradient(shard_loss, full),
                                d_whole=tape.gradient(whole_loss, full), d_through=tape.gradient(whole_loss, shard),
                                tokens=parallel.unshard_sequence(token_shard, layout),
                                mask=parallel.unshard_sequence(mask_shard, layout),
                                token_shard=token_shard)

                return strategy.run(replica_fn)

            out = {key: [np.asarray(v) for v in strategy.experimental_local_results(value)]
                   for key, value in step().items()}
            chunks = [parallel.chunks_of(layout, n, r)[0] for r in range(n)]
            pieces = np.split(x, len(sum(chunks, ())), axis=2)
            token_pieces = np.split(tokens, len(sum(chunks, ())), axis=1)
            result[f"{layout}_{n}"] = dict(
                shards=all(np.array_equal(out["shard"][r], np.concatenate([pieces[c] for c in chunks[r]], 2))
                           for r in range(n)),
                token_shards=all(np.array_equal(out["token_shard"][r],
                                                np.concatenate([token_pieces[c] for c in chunks[r]], 1))
                                 for r in range(n)),
                round_trip=all(np.array_equal(whole, x) for whole in out["whole"]),
                tokens=all(np.array_equal(t, tokens) for t in out["tokens"]),
                mask=all(np.array_equal(m, tokens > 50) for m in out["mask"]),
                # Summed over replicas (what the strategy does with gradients), each gradient is the whole one:
                # w for the shards' loss, n * w for the loss every replica computes on the gathered whole.
                d_shard=_max_error(sum(out["d_shard"]), w),
                d_whole=_max_error(sum(out["d_whole"]), n * w),
                d_through=_max_error(np.concatenate([out["d_through"][r] for r in range(n)], 2),
                                     np.concatenate([n * np.concatenate([np.split(w, len(sum(chunks, ())), 2)[c]
                                                                         for c in chunks[r]], 2)
                                                     for r in range(n)], 2)))
    return result


def _layer(strategies):
    """FlashMultiHeadAttention(context_parallel=True) on sequence shards == the layer on the whole sequence
    (output and weight gradients): causal, GQA, Keras padding masks (padded rows get the mean of the whole
    sequence's values, as Keras'); and dropout in training, with the layer's seed."""
    import tensorflow as tf
    from tf_flash import parallel
    from tf_flash.layers import FlashMultiHeadAttention

    rng = np.random.default_rng(2)
    result = {}
    for n, strategy in strategies.items():
        seqlen = 32 * n  # with dropout each chunk (S / 2n) is a multiple of 16
        x = rng.standard_normal((2, seqlen, 12)).astype(np.float32)
        valid = np.arange(seqlen)[None, :] < np.array([[seqlen], [seqlen - 21]])
        weights = rng.standard_normal(x.shape).astype(np.float32)
        for name, options, call in (("masks", dict(), dict(query_mask=valid, value_mask=valid)),
                                    ("dropout", dict(dropout=0.25, seed=3), dict(training=True))):
            with strategy.scope():
                layer = FlashMultiHeadAttention(4, 8, num_key_value_heads=2, context_parallel=True, **options)
                layer.build((None, None, 12), (None, None, 12))
            reference = FlashMultiHeadAttention(4, 8, num_key_value_heads=2, **options)
            reference.build((None, None, 12), (None, None, 12))
            reference.set_weights([w.numpy() for w in layer.weights])
            with tf.GradientTape() as tape:
                expected = reference(tf.constant(x), tf.constant(x), use_causal_mask=True, **call)
                loss = tf.reduce_sum(expected * weights)
            expected_grads = tape.gradient(loss, reference.trainable_weights)

            @tf.function
            def step():
                def replica_fn():
                    shard = parallel.shard_sequence(tf.constant(x))
                    shard_call = {key: parallel.shard_sequence(tf.constant(value)) if "mask" in key else value
                                  for key, value in call.items()}  # noqa: B023 (called at once)
                    with tf.GradientTape() as tape:
                        out = layer(shard, shard, use_causal_mask=True, **shard_call)  # noqa: B023
                        loss = tf.reduce_sum(out * parallel.shard_sequence(tf.constant(weights)))
                    grads = tape.gradient(loss, layer.trainable_weights)  # noqa: B023
                    # Each replica's gradients cover its rows: the strategy sums them.
                    grads = tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, grads)
                    return parallel.unshard_sequence(out), grads

                return strategy.run(replica_fn)

            out, grads = step()
            out = strategy.experimental_local_results(out)[0]
            grads = [strategy.experimental_local_results(g)[0] for g in grads]
            result[f"{name}_{n}"] = dict(out=_max_error(out, expected),
                                         grads=max(_max_error(g, e) for g, e in zip(grads, expected_grads)))
            if name == "masks":  # outside a replica context (no strategy) the layer is the plain one
                plain = layer(tf.constant(x), tf.constant(x), use_causal_mask=True, **call)
                result[f"{name}_{n}"].update(plain=_max_error(plain, expected),
                                             config=layer.get_config()["context_parallel"])
    return result


def _logical(out_dir):
    import tensorflow as tf

    cpus = tf.config.list_physical_devices("CPU")
    tf.config.set_logical_device_configuration(cpus[0], [tf.config.LogicalDeviceConfiguration()] * 4)
    import tf_flash  # noqa: F401

    strategies = _strategies([d.name for d in tf.config.list_logical_devices("CPU")])
    cases = {f"{name}_{n}": compare_case(strategy, name) for n, strategy in strategies.items()
             for name, spec in CASES.items() if n == 2 or f"n{n}" in spec[3]}
    _write(out_dir, "cases", cases)
    _write(out_dir, "layouts", _layouts(strategies))
    _write(out_dir, "layer", _layer(strategies))


def _worker(out_dir):
    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    import keras
    import tf_flash  # noqa: F401
    import saving_helper

    task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    tokens, labels = saving_helper.data()
    with strategy.scope():
        keras.utils.set_random_seed(1)
        model = saving_helper.build_model()
        optimizer = keras.optimizers.SGD(0.05)
    start = [w.copy() for w in model.get_weights()]
    # A custom training loop: Keras 3's fit() and train_on_batch() fail under MultiWorkerMirroredStrategy
    # (keras-team/keras#20585). Each worker takes its half of every global batch of 4; the loss is summed over
    # the examples and divided by the global batch, and the optimizer sums the replicas' gradients.
    loss_fn = keras.losses.SparseCategoricalCrossentropy(reduction="sum")

    @tf.function
    def train_step(x, y):
        def replica_fn(x, y):
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True)) / 4.0
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))

        strategy.run(replica_fn, args=(x, y))

    for _ in range(2):
        for begin in range(0, len(tokens), 4):
            rows = slice(begin + 2 * task, begin + 2 * task + 2)
            train_step(tf.constant(tokens[rows]), tf.constant(labels[rows]))
    np.savez(os.path.join(out_dir, f"worker{task}.npz"), *(start + model.get_weights()))
    cases = {name: compare_case(strategy, name) for name, spec in CASES.items() if "workers" in spec[3]}
    _write(out_dir, f"worker{task}", dict(cases=cases, replicas=strategy.num_replicas_in_sync, weights=len(start)))


def _gpu(out_dir, device_type="GPU"):
    import tensorflow as tf

    for gpu in tf.config.list_physical_devices("GPU"):
        tf.config.experimental.set_memory_growth(gpu, True)
    import tf_flash  # noqa: F401
    import philox_ref
    import reference

    devices = [d.name for d in tf.config.list_logical_devices(device_type)]
    strategy = tf.distribute.MirroredStrategy(devices[:4] if len(devices) >= 4 else devices[:2])
    result = {"replicas": strategy.num_replicas_in_sync}
    for name, spec in CASES.items():
        if "gpu" not in spec[3]:
            continue
        arrays, kwargs = case_inputs(name)
        exact_kwargs = {k: v for k, v in kwargs.items() if k not in ("layout", "return_lse", "seed", "deterministic")}
        if kwargs.get("dropout_rate"):
            exact_kwargs["keep_mask"] = philox_ref.keep_mask(int(kwargs["seed"]), 0, BATCH, HEADS, arrays["q"].shape[1],
                                                             arrays["k"].shape[1], kwargs["dropout_rate"])
        exact = reference.reference_attention(arrays["q"], arrays["k"], arrays["v"], **exact_kwargs)[0]
        exact_grads = reference.reference_attention_grad(arrays["q"], arrays["k"], arrays["v"], arrays["d_out"],
                                                         d_lse=arrays["d_lse"], **exact_kwargs)
        with tf.device(devices[0]):
            flat = unsharded(arrays, kwargs, tf.bfloat16)
        parts = sharded(strategy, arrays, kwargs, tf.bfloat16)
        result[name] = dict(unsharded=_max_error(flat[0], exact), sharded=_max_error(parts[0], exact),
                            unsharded_grads=max(_max_error(a, e) for a, e in zip(flat[2:], exact_grads)),
                            sharded_grads=max(_max_error(a, e) for a, e in zip(parts[2:], exact_grads)))
    _write(out_dir, "gpu", result)


def _write(out_dir, name, result):
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    {"logical": _logical, "worker": _worker, "gpu": _gpu}[sys.argv[1]](sys.argv[2])
