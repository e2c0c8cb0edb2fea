"""One full-float32 forward+backward (TF32 off), 16 x 1024, 8 heads of head dim argv[1], between
cudaProfilerStart/Stop for `ncu --profile-from-start off` (final_round.sh)."""
import ctypes
import sys

import tensorflow as tf

import tf_flash

tf.config.experimental.enable_tensor_float_32_execution(False)
q, k, v = [tf.random.normal((16, 1024, 8, int(sys.argv[1]))) for _ in range(3)]


@tf.function
def step(q, k, v):
    with tf.GradientTape() as t:
        t.watch([q, k, v])
        loss = tf.reduce_sum(tf_flash.flash_attention(q, k, v))
    return tf.reduce_sum(t.gradient(loss, [q, k, v])[0])


step(q, k, v).numpy()
cudart = ctypes.CDLL("libcudart.so.12")
cudart.cudaProfilerStart()
step(q, k, v).numpy()
cudart.cudaProfilerStop()
