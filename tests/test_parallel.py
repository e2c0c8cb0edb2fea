"""tf_flash.parallel: context parallelism on tf.distribute, and the kernels' query_offset under it.

Strategies need their devices before TensorFlow starts, so they run in processes of their own
(tests/parallel_helper.py): 4 logical CPU devices under MirroredStrategy (2 and 4 replicas), and 2 worker
processes on localhost under MultiWorkerMirroredStrategy (TF_CONFIG, one CPU device each). Every sharded
result is compared with the unsharded call in float32 on the CPU, to 1e-5."""
import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import parallel_helper
import tf_flash
from tf_flash import ops as flash_ops
from tf_flash import parallel

HELPER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "parallel_helper.py")
TOL = 1e-5


def _run_helper(command, out_dir, env=None, timeout=400):
    proc = subprocess.run([sys.executable, HELPER, command, str(out_dir)], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


def _load(out_dir, name):
    with open(os.path.join(out_dir, f"{name}.json")) as f:
        return json.load(f)


def _free_ports(count):
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("localhost", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


@pytest.fixture(scope="module")
def helpers(tmp_path_factory):
    """The helper processes, started together: 4 logical CPU devices in one process, and two worker
    processes of one MultiWorkerMirroredStrategy on localhost. Returns their output folders."""
    logical_dir = tmp_path_factory.mktemp("parallel_logical")
    workers_dir = tmp_path_factory.mktemp("parallel_workers")
    cpu_only = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    runs = [("logical", logical_dir, cpu_only)]
    cluster = {"worker": [f"localhost:{port}" for port in _free_ports(2)]}
    for index in range(2):
        tf_config = json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}})
        runs.append(("worker", workers_dir, {**cpu_only, "TF_CONFIG": tf_config}))
    procs = [subprocess.Popen([sys.executable, HELPER, command, str(out_dir)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for command, out_dir, env in runs]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=600)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for (command, _, _), proc, output in zip(runs, procs, outputs):
        assert proc.returncode == 0, f"{command}: {output[-6000:]}"
    return logical_dir, workers_dir


@pytest.fixture(scope="module")
def logical(helpers):
    return {name: _load(helpers[0], name) for name in ("cases", "layouts", "layer")}


@pytest.fixture(scope="module")
def workers(helpers):
    return helpers[1]


def _case_ids(replicas, tag=None):
    return [name for name, spec in parallel_helper.CASES.items()
            if (replicas == 2 or f"n{replicas}" in spec[3]) and (tag is None or tag in spec[3])]


@pytest.mark.parametrize("replicas, case", [(2, name) for name in _case_ids(2)] + [(4, name) for name in _case_ids(4)])
def test_sharded_equals_unsharded(logical, replicas, case):
    """context_parallel_attention over 2 or 4 replicas gives the unsharded call's output, lse and gradients
    (bfloat16: the same output; dK and dV, summed over the replicas in float32, within bfloat16's rounding)."""
    result = logical["cases"][f"{case}_{replicas}"]
    for name in parallel_helper.NAMES:
        tol = 1e-2 if parallel_helper.CASES[case][2].get("dtype") == "bfloat16" and name in ("dk", "dv") else TOL
        assert result[name] < tol, (name, result)
    assert result["scale"] > 0.5, result
    if "dropout_effect" in result:  # the masks are the unsharded call's, not merely some dropout
        assert result["dropout_effect"] > 0.1, result


@pytest.mark.parametrize("replicas", [2, 4])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_shard_unshard_round_trip(logical, layout, replicas):
    result = logical["layouts"][f"{layout}_{replicas}"]
    for key in ("shards", "token_shards", "round_trip", "tokens", "mask"):
        assert result[key] is True, (key, result)
    for key in ("d_shard", "d_whole", "d_through"):
        assert result[key] < 1e-6, (key, result)


@pytest.mark.parametrize("replicas", [2, 4])
@pytest.mark.parametrize("case", ["masks", "dropout"])
def test_layer_context_parallel(logical, case, replicas):
    """FlashMultiHeadAttention(context_parallel=True) on shards == the plain layer on the whole sequence:
    causal, GQA, Keras padding masks, or dropout with the layer's seed; outside a strategy it is the plain
    layer."""
    result = logical["layer"][f"{case}_{replicas}"]
    for key in ("out", "grads", "plain"):
        assert result.get(key, 0.0) < TOL, (key, result)
    if case == "masks":
        assert result["config"] is True


def test_multi_worker_training_matches_one_process(workers):
    """Keras training under MultiWorkerMirroredStrategy (2 worker processes, each its half of every global
    batch of 4) ends with the weights of the same fit (batch 4) in one process."""
    import keras
    import saving_helper

    report = _load(workers, "worker0")
    assert report["replicas"] == 2
    arrays = [np.load(os.path.join(workers, f"worker{i}.npz")) for i in range(2)]
    count = report["weights"]
    start = [arrays[0][f"arr_{i}"] for i in range(count)]
    finals = [[a[f"arr_{count + i}"] for i in range(count)] for a in arrays]
    tokens, labels = saving_helper.data()
    model = saving_helper.build_model()
    model.set_weights(start)
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="sparse_categorical_crossentropy")
    model.fit(tokens, labels, batch_size=4, epochs=2, shuffle=False, verbose=0)
    moved = max(np.abs(a - b).max() for a, b in zip(start, model.get_weights()))
    assert moved > 1e-3
    for final in finals:
        assert max(np.abs(a - b).max() for a, b in zip(final, model.get_weights())) < TOL


@pytest.mark.parametrize("case", _case_ids(2, "workers"))
def test_multi_worker_context_parallel(workers, case):
    """context_parallel_attention with the replicas in 2 worker processes (collectives over gRPC)."""
    for index in range(2):
        result = _load(workers, f"worker{index}")["cases"][case]
        for name in parallel_helper.NAMES:
            assert result[name] < TOL, (index, name, result)


# ---- In this process: the default replica context (one replica) and the kernels' query_offset ----

def _inputs(rng, seqlen=96, heads=4, heads_kv=2, dim=16, dtype=tf.float32):
    return [tf.constant(rng.standard_normal((2, seqlen, h, dim)), dtype) for h in (heads, heads_kv, heads_kv)]


def test_one_replica_is_the_plain_call(rng):
    """Outside any strategy (the default replica context: one replica) the functions are the identity and
    flash_attention."""
    q, k, v = _inputs(rng)
    assert parallel.shard_sequence(q) is q
    assert parallel.unshard_sequence(q, layout="contiguous") is q
    got = parallel.context_parallel_attention(q, k, v, causal=True, window=(9, 0))
    expected = tf_flash.flash_attention(q, k, v, causal=True, window=(9, 0))
    np.testing.assert_array_equal(got.numpy(), expected.numpy())


def test_argument_errors(rng):
    q, k, v = _inputs(rng)
    with pytest.raises(ValueError, match=r"`layout` must be one of .*Received: layout='ring'"):
        parallel.shard_sequence(q, layout="ring")
    with pytest.raises(ValueError, match=r"`axis` must be an int .*Received: axis=4"):
        parallel.shard_sequence(q, axis=4)
    with pytest.raises(TypeError, match=r"unexpected keyword arguments \['causal_mask'\]"):
        parallel.context_parallel_attention(q, k, v, causal_mask=True)
    with tf.distribute.OneDeviceStrategy("/cpu:0").scope():
        with pytest.raises(ValueError, match="runs inside a replica context"):
            parallel.context_parallel_attention(q, k, v)
    assert parallel.chunks_of("zigzag", 4, 1) == ((1, 6), 8)
    assert parallel.chunks_of("contiguous", 4, 1) == ((1,), 4)


_OFFSET_CASES = {
    "causal": dict(causal=True),
    "window": dict(window=(13, 4)),
    "causal_window_lengths": dict(causal=True, window=(20, None), kv_lengths=[90, 41]),
    "dropout_gqa_softcap": dict(causal=True, dropout_rate=0.25, seed=11, softcap=2.0),
}


@pytest.mark.parametrize("case", sorted(_OFFSET_CASES))
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "xla"])
def test_query_offset_rows_are_the_whole_calls_rows(rng, case, jit):
    """The kernels' query_offset: rows [a, b) of the queries with query_offset=a give rows [a, b) of the
    whole call (causal, window, dropout mask), and their gradients sum to the whole call's; through the XLA
    lowering too (its custom calls carry the attribute)."""
    kwargs = _OFFSET_CASES[case]
    q, k, v = _inputs(rng)
    d_out = tf.constant(rng.standard_normal(q.shape), tf.float32)
    cuts = [0, 32, 48, 96]

    def whole(q, k, v):
        out = tf_flash.flash_attention(q, k, v, **kwargs)
        return out, tf.gradients(tf.reduce_sum(out * d_out), [q, k, v])

    def pieces(q, k, v):
        outs = [flash_ops._flash_attention(q[:, a:b], k, v, query_offset=a, **kwargs)
                for a, b in zip(cuts[:-1], cuts[1:])]
        out = tf.concat(outs, 1)
        return out, tf.gradients(tf.reduce_sum(out * d_out), [q, k, v])

    whole_fn = tf.function(whole, jit_compile=jit)
    pieces_fn = tf.function(pieces, jit_compile=jit)
    expected, expected_grads = whole_fn(q, k, v)
    got, grads = pieces_fn(q, k, v)
    np.testing.assert_allclose(got.numpy(), expected.numpy(), atol=2e-6, rtol=2e-6)
    for g, e in zip(grads, expected_grads):
        np.testing.assert_allclose(g.numpy(), e.numpy(), atol=5e-6, rtol=5e-6)


def test_query_offset_errors(rng):
    q, k, v = _inputs(rng)
    with pytest.raises(tf.errors.InvalidArgumentError, match="multiple of 16 with dropout.*query_offset=8"):
        flash_ops._flash_attention(q[:, 8:], k, v, query_offset=8, dropout_rate=0.1, seed=1)
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError), match="query_offset.*Received: query_offset=-1"):
        flash_ops._flash_attention(q, k, v, query_offset=-1)


@pytest.mark.gpu
def test_query_offset_on_gpu(rng):
    """The CUDA families honour query_offset (causal, window, dropout) as the CPU does: rows [a, b) with
    query_offset=a against the whole call, bfloat16, forward and gradients, within bfloat16's rounding."""
    q, k, v = _inputs(rng, seqlen=384, dim=64, dtype=tf.bfloat16)
    d_out = tf.constant(rng.standard_normal(q.shape), tf.bfloat16)
    cuts = [0, 128, 208, 384]
    for kwargs in _OFFSET_CASES.values():
        with tf.device("/GPU:0"), tf.GradientTape(persistent=True) as tape:
            tape.watch([q, k, v])
            whole = tf_flash.flash_attention(q, k, v, **kwargs)
            parts = tf.concat([flash_ops._flash_attention(q[:, a:b], k, v, query_offset=a, **kwargs)
                               for a, b in zip(cuts[:-1], cuts[1:])], 1)
            loss_whole = tf.reduce_sum(tf.cast(whole * d_out, tf.float32))
            loss_parts = tf.reduce_sum(tf.cast(parts * d_out, tf.float32))
        np.testing.assert_allclose(tf.cast(parts, tf.float32), tf.cast(whole, tf.float32), atol=2e-2, rtol=2e-2)
        for g, e in zip(tape.gradient(loss_parts, [q, k, v]), tape.gradient(loss_whole, [q, k, v])):
            e = tf.cast(e, tf.float32).numpy()
            assert np.abs(tf.cast(g, tf.float32).numpy() - e).max() <= 3e-2 * max(1.0, np.abs(e).max())


@pytest.mark.gpu
def test_context_parallel_on_gpus(tmp_path):
    """MirroredStrategy over the visible GPUs (4, or 2): bfloat16, each case's sharded output and gradients
    within 2x the error of the unsharded bfloat16 call against float64 (+ 1e-3)."""
    if len(tf.config.list_physical_devices("GPU")) < 2:
        pytest.skip("needs 2 GPUs")
    _run_helper("gpu", tmp_path)
    result = _load(tmp_path, "gpu")
    assert result["replicas"] >= 2
    for name, errors in result.items():
        if name == "replicas":
            continue
        assert errors["sharded"] <= 2 * errors["unsharded"] + 1e-3, (name, errors)
        assert errors["sharded_grads"] <= 2 * errors["unsharded_grads"] + 1e-3, (name, errors)
