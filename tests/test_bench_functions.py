"""The benchmarks' timed functions compute what their FLOP counts claim (benchmarks/common.py make_fns): the
forward, and for forward+backward the gradients of q, k and v for a given output gradient dO, as torch's
out.backward(dout) does in the same tables. No timing asserts."""
import importlib.util
import os

import numpy as np
import pytest
import tensorflow as tf

from reference import reference_attention, reference_attention_grad

_SPEC = importlib.util.spec_from_file_location(
    "bench_common", os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "common.py"))
common = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(common)


@pytest.mark.parametrize("impl", ["tf_flash", "tf_standard", "tf_standard_xla", "keras_mha"])
@pytest.mark.parametrize("causal", [False, True])
def test_forward_backward_is_the_gradient_for_dout(impl, causal, rng):
    q, k, v, dout = (rng.standard_normal((2, 67, 3, 32)) for _ in range(4))  # 67: no multiple of a tile
    fwd, fwd_bwd = common.make_fns(impl, causal)
    with tf.device("/CPU:0"):
        args = [tf.constant(x, tf.float32) for x in (q, k, v, dout)]
        out, grads = fwd(*args), fwd_bwd(*args)
    ref_out, _ = reference_attention(q, k, v, causal=causal)
    np.testing.assert_allclose(out.numpy(), ref_out, atol=1e-5)
    for name, grad, ref in zip(("dq", "dk", "dv"), grads, reference_attention_grad(q, k, v, dout, causal=causal)):
        np.testing.assert_allclose(grad.numpy(), ref, atol=5e-5, err_msg=name)


@pytest.mark.parametrize("impl", ["tf_flash", "keras_mha"])
def test_chained_calls_feed_each_output_to_the_next_query(impl, rng):
    """--calls-per-function: make_fns(chain=2) is attention(attention(q, k, v), k, v), gradients included (against
    TF's standard attention in float64)."""
    q, k, v, dout = (rng.standard_normal((2, 67, 3, 32)) for _ in range(4))
    with tf.device("/CPU:0"):
        fwd, fwd_bwd = common.make_fns(impl, True, chain=2)
        args = [tf.constant(x, tf.float32) for x in (q, k, v, dout)]
        out, grads = fwd(*args), fwd_bwd(*args)
        _, ref_fwd_bwd = common.make_fns("tf_standard", True, chain=2)
        ref_grads = ref_fwd_bwd(*(tf.constant(x, tf.float64) for x in (q, k, v, dout)))
    once, _ = reference_attention(q, k, v, causal=True)
    twice, _ = reference_attention(once, k, v, causal=True)
    np.testing.assert_allclose(out.numpy(), twice, atol=1e-5)
    for name, grad, ref in zip(("dq", "dk", "dv"), grads, ref_grads):
        np.testing.assert_allclose(grad.numpy(), ref.numpy(), atol=5e-5, err_msg=name)
