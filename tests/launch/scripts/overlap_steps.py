"""model.fit of six 512-wide Dense layers (1 MiB of kernel each): 1 MiB buckets hold one each.

Run with KERASDIST_TIMELINE and KERASDIST_BUCKET_BYTES=1048576 set: the test reads when each
step's buckets were queued. Between the first layer and the second, a layer that passes its
input on unchanged marks, in backprop, the moment the gradient reaches the first layer: an eager
allreduce named MARKER, made where backprop runs, before the first layer's kernel gradient (the
last one) can be computed. Its "queued" event on the timeline is that moment, on the engine's clock.
"""

import keras
import numpy as np
import tensorflow as tf

import kerasdist as kd

MARKER = "backprop_reached_the_first_layer"


def _mark_backprop(gradient):
    kd.allreduce(tf.zeros([1]), name=MARKER)
    return gradient


@tf.custom_gradient
def _marked_in_backprop(x):
    def gradient(upstream):
        # The gradient passes through the marker, so that the first layer's gradients wait for it
        # and nothing prunes it. Not stateful: tf.function would otherwise run every stateful op
        # made after it (the buckets' allreduces) after it, the very wait the test looks for.
        marked = tf.numpy_function(_mark_backprop, [upstream], Tout=tf.float32, stateful=False)
        return tf.ensure_shape(marked, upstream.shape)

    return tf.identity(x), gradient


class BackpropMarker(keras.layers.Layer):
    def call(self, x):
        return _marked_in_backprop(x)


if __name__ == "__main__":
    kd.init()
    WIDTH, LAYERS, BATCH, STEPS = 512, 6, 512, 12
    keras.utils.set_random_seed(kd.rank())
    dense = [keras.layers.Dense(WIDTH, activation="relu") for _ in range(LAYERS)]
    model = keras.Sequential([keras.Input((WIDTH,)), dense[0], BackpropMarker(), *dense[1:]])
    model.compile(kd.DistributedOptimizer(keras.optimizers.SGD(1e-3)), loss="mse")
    x = np.random.default_rng(kd.rank()).normal(size=(BATCH * STEPS, WIDTH)).astype("float32")
    model.fit(x, x, batch_size=BATCH, epochs=1, verbose=0, callbacks=kd.callbacks())
    print("OVERLAP_STEPS_DONE", flush=True)
