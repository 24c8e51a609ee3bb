"""Each private Keras/TensorFlow hook in kerasdist._compat still does what kerasdist uses it for.

A Keras or TensorFlow upgrade that changes one of them fails here, by name, before it shows up as
a wrong resume epoch or a hang in a multi-rank test.
"""

import contextlib
import io
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.eager import context

from kerasdist import _compat


def test_a_missing_hook_is_named_with_the_versions_kerasdist_was_tested_with():
    with pytest.raises(ImportError, match=r"keras\.src\.nowhere\.Thing \(testing\).*tested with Keras"):
        _compat._private("keras.src.nowhere", "Thing", "testing")


def test_monitor_callback_compares_in_the_direction_of_its_mode():
    lower = _compat.MonitorCallback(monitor="val_loss", mode="auto")  # a loss: lower is better
    lower._set_monitor_op()
    assert lower._is_improvement(0.5, 1.0) and not lower._is_improvement(1.0, 0.5)
    higher = _compat.MonitorCallback(monitor="val_accuracy", mode="max")
    higher._set_monitor_op()
    assert higher._is_improvement(0.9, 0.8) and not higher._is_improvement(0.8, 0.9)


def test_print_msg_prints_a_line():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        _compat.print_msg("saving model to x.keras")
    assert out.getvalue() == "saving model to x.keras\n"


def test_untracked_attributes_are_not_added_to_a_layers_variables():
    class Holder(keras.layers.Layer):
        def build(self, input_shape):
            self.kept = self.add_weight(shape=(), name="kept")
            self.set_aside()

        @_compat.no_automatic_dependency_tracking
        def set_aside(self):
            self.aside = [keras.Variable(1.0, name="aside")]

    holder = Holder()
    holder.build(None)
    assert [v.name for v in holder.weights] == ["kept"]


def test_the_loss_wrapper_averages_a_plain_loss_function_over_the_batch():
    loss = _compat.LossFunctionWrapper(lambda y, p: tf.square(y - p))
    value = loss(np.array([1.0, 3.0], "float32"), np.array([0.0, 0.0], "float32"))
    assert float(value) == pytest.approx(5.0)


def test_ops_marked_order_insensitive_are_in_tensorflows_set():
    import kerasdist.ops  # noqa: F401  marks the collectives when imported

    assert "KerasdistAllreduce" in _compat.order_insensitive_op_types()
    _compat.mark_order_insensitive(["KerasdistTestOnly"])
    assert {"KerasdistTestOnly", "KerasdistAllreduce"} <= _compat.order_insensitive_op_types()


def test_xla_context_is_seen_only_inside_a_jit_compiled_function():
    seen = {}

    @tf.function(jit_compile=True)
    def compiled(x):
        seen["compiled"] = _compat.in_xla_context()
        return x + 1

    @tf.function
    def plain(x):
        seen["plain"] = _compat.in_xla_context()
        return x + 1

    compiled(tf.constant(1.0))
    plain(tf.constant(1.0))
    assert seen == {"compiled": True, "plain": False}
    assert not _compat.in_xla_context()


def test_setting_the_initial_epoch_from_on_train_begin_makes_fit_start_there():
    epochs = []

    class StartAtTwo(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            _compat.set_initial_epoch(self.model, 2)

        def on_epoch_begin(self, epoch, logs=None):
            epochs.append(epoch)

    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    model.fit(np.zeros((4, 1)), np.zeros((4, 1)), epochs=4, verbose=0, callbacks=[StartAtTwo()])
    assert epochs == [2, 3]
    _compat.set_initial_epoch(model, None)
    epochs.clear()
    model.fit(
        np.zeros((4, 1)),
        np.zeros((4, 1)),
        epochs=2,
        verbose=0,
        callbacks=[keras.callbacks.LambdaCallback(on_epoch_begin=lambda epoch, logs: epochs.append(epoch))],
    )
    assert epochs == [0, 1]


def test_learning_rate_object_tells_a_schedule_from_a_rate():
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5)
    assert _compat.learning_rate_object(keras.optimizers.SGD(schedule)) is schedule
    rate = _compat.learning_rate_object(keras.optimizers.SGD(0.25))
    assert not isinstance(rate, keras.optimizers.schedules.LearningRateSchedule)
    assert float(keras.ops.convert_to_numpy(rate)) == 0.25


def test_a_replaced_metrics_result_is_what_fit_and_evaluate_report():
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse", metrics=["mae"])
    _compat.replace_metrics_result(model, lambda local, ran_steps: {name: 7.0 for name in local()})
    history = model.fit(np.ones((4, 1)), np.ones((4, 1)), epochs=1, verbose=0)
    assert history.history == {"loss": [7.0], "mae": [7.0]}
    assert model.evaluate(np.ones((4, 1)), np.ones((4, 1)), verbose=0, return_dict=True) == {"loss": 7.0, "mae": 7.0}


def test_a_replaced_metrics_result_is_what_an_evaluation_without_steps_reports():
    # Plain Keras reports {} when no step ran (an empty shard).
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse", metrics=["mae"])
    calls = []

    def make_result(local, ran_steps):
        calls.append(ran_steps)
        return {name: 7.0 for name in local()}

    _compat.replace_metrics_result(model, make_result)
    assert model.evaluate(np.ones((0, 1)), np.ones((0, 1)), verbose=0, return_dict=True) == {"loss": 7.0, "mae": 7.0}
    assert calls == [False]
    model.evaluate(np.ones((2, 1)), np.ones((2, 1)), verbose=0)
    assert calls == [False, True]


def test_enclosing_function_graph_looks_past_cond_and_while_loop_graphs():
    seen = {}

    @tf.function
    def traced(x):
        seen["function"] = tf.compat.v1.get_default_graph()

        def branch():
            seen["cond"] = _compat.enclosing_function_graph()
            return x

        def body(i):
            seen["while"] = _compat.enclosing_function_graph()
            return i + 1

        y = tf.cond(x > 0, branch, lambda: -x)
        return tf.while_loop(lambda i: i < 2, body, [y])

    traced(tf.constant(1.0))
    assert seen["function"].name == "traced"
    assert seen["cond"] is seen["function"] and seen["while"] is seen["function"]


def test_is_function_graph_tells_a_tf_function_graph_from_a_tf1_graph():
    seen = {}

    @tf.function
    def traced():
        seen["function"] = _compat.is_function_graph(tf.compat.v1.get_default_graph())
        return tf.constant(0)

    traced()
    assert seen["function"] is True
    with tf.Graph().as_default() as graph:
        assert _compat.is_function_graph(graph) is False


@tf.autograph.experimental.do_not_convert
def _generated_caller():
    """(file, line) of the innermost frame that runs code AutoGraph generated."""
    frame = sys._getframe(1)
    while "__autograph_generated_file" not in frame.f_code.co_filename:
        frame = frame.f_back
    return frame.f_code.co_filename, frame.f_lineno


def test_autograph_origin_maps_converted_code_to_the_users_own_line_while_tracing():
    import inspect

    origins = []

    @tf.function
    def traced(x):
        for _ in tf.range(2):  # AutoGraph turns the loop body into generated code
            origins.append(_compat.autograph_origin(*_generated_caller()))
            x = x + 1
        return x

    traced(tf.constant(0))
    line = inspect.getsourcelines(traced.python_function)[1] + 3  # from the decorator
    assert origins[0] == (__file__, line)


def _converted_later():
    return _generated_caller()


def test_autograph_origin_maps_converted_code_that_runs_after_the_trace():
    import inspect

    converted = tf.autograph.to_graph(_converted_later)
    line = inspect.getsourcelines(_converted_later)[1] + 1
    assert _compat.autograph_origin(*converted()) == (__file__, line)


def test_autograph_origin_is_none_for_a_file_autograph_did_not_generate():
    assert _compat.autograph_origin(__file__, 1) is None


def test_in_py_function_is_true_in_a_py_function_body_only():
    seen = []

    def body(x):
        seen.append(_compat.in_py_function())
        return x

    tf.py_function(body, [tf.constant(1.0)], tf.float32)
    tf.function(lambda x: tf.numpy_function(body, [x], tf.float32))(tf.constant(1.0))
    assert seen == [True, True]
    assert _compat.in_py_function() is False


def test_callbacks_setting_the_model_is_the_list_of_the_fit_that_set_it():
    seen = []

    class Probe(keras.callbacks.Callback):
        def set_model(self, model):
            super().set_model(model)
            seen.append(_compat.callbacks_setting_the_model())

    probe, other = Probe(), keras.callbacks.History()
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    keras.callbacks.CallbackList([probe, other], model=model)
    probe.set_model(model)  # called directly: no list
    assert seen[0] is not None and probe in seen[0] and other in seen[0], seen
    assert seen[1] is None


def test_thread_spinning_is_stopped_in_the_config_the_runtime_starts_with():
    script = (
        "import tensorflow as tf; from kerasdist import _compat; from tensorflow.python.eager import context\n"
        "_compat.stop_thread_spinning(); tf.ones(2) + 1\n"
        "print(context.context().config.experimental.disable_thread_spinning)"
    )
    started = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert started.returncode == 0 and started.stdout.split()[-1] == "True", started.stderr[-2000:]


def test_thread_spinning_is_left_alone_once_the_runtime_has_started():
    tf.ones(2) + 1
    _compat.stop_thread_spinning()
    assert not context.context().config.experimental.disable_thread_spinning


def test_dataset_inputs_are_the_datasets_it_reads_from():
    first, second = tf.data.Dataset.range(3), tf.data.Dataset.range(4)
    zipped = tf.data.Dataset.zip(first, second)
    assert _compat.dataset_inputs(zipped) == [first, second]
    assert _compat.dataset_inputs(first) == []


def test_dataset_function_graphs_hold_the_ops_of_the_functions_it_applies():
    mapped = tf.data.Dataset.range(3).interleave(lambda x: tf.data.Dataset.range(x).shuffle(2))
    (graph,) = _compat.dataset_function_graphs(mapped)
    assert "ShuffleDatasetV3" in [op.type for op in graph.get_operations()]
    assert _compat.dataset_function_graphs(tf.data.Dataset.range(3)) == []


def test_is_filter_tells_a_filter_from_other_datasets():
    assert _compat.is_filter(tf.data.Dataset.range(3).filter(lambda x: x > 0))
    assert not _compat.is_filter(tf.data.Dataset.range(3).map(lambda x: x))


def test_dataset_random_seeds_are_zero_unseeded_and_follow_the_op_and_global_seeds():
    tf.random.set_seed(None)
    try:
        assert _compat.dataset_random_seeds(tf.data.Dataset.range(3).shuffle(3)) == ("Dataset.shuffle", 0, 0)
        assert _compat.dataset_random_seeds(tf.data.Dataset.random()) == ("Dataset.random", 0, 0)
        _, seed, seed2 = _compat.dataset_random_seeds(tf.data.Dataset.range(3).shuffle(3, seed=7))
        assert seed != 0 and seed2 == 7
        tf.random.set_seed(1234)
        _, seed, seed2 = _compat.dataset_random_seeds(tf.data.Dataset.range(3).shuffle(3))
        tf.random.set_seed(1234)
        assert seed == 1234 and (seed, seed2) == _compat.dataset_random_seeds(tf.data.Dataset.range(3).shuffle(3))[1:]
    finally:
        tf.random.set_seed(None)
    assert _compat.dataset_random_seeds(tf.data.Dataset.range(3)) is None


@pytest.mark.parametrize("deterministic, expected", [(None, "default"), (True, "true"), (False, "false")])
def test_dataset_determinism_is_read_from_each_parallel_step(deterministic, expected):
    source = tf.data.Dataset.range(8)
    steps = {
        "Dataset.map": source.map(lambda x: x, num_parallel_calls=2, deterministic=deterministic),
        "Dataset.batch": source.batch(2, num_parallel_calls=2, deterministic=deterministic),
        "Dataset.interleave": source.interleave(
            lambda x: tf.data.Dataset.range(x), num_parallel_calls=2, deterministic=deterministic
        ),
        "tf.data.experimental.parallel_interleave": source.apply(
            tf.data.experimental.parallel_interleave(
                lambda x: tf.data.Dataset.range(x),
                cycle_length=2,
                sloppy=None if deterministic is None else not deterministic,
            )
        ),
    }
    for transformation, step in steps.items():
        assert _compat.dataset_determinism(step) == (transformation, expected)
    assert _compat.dataset_determinism(source.map(lambda x: x)) is None
