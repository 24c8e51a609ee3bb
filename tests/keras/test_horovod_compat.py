"""kerasdist.horovod: Horovod 0.28's TF2 / Keras API with Horovod's semantics.

Expected values come from Horovod's documented rules, written out here independently of the
code under test. The file runs at 1, 2 and 3 ranks.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import kerasdist as kd
import kerasdist.horovod.tensorflow as hvd_tf
import kerasdist.horovod.tensorflow.keras as hvd

hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()


def _linear_model(lr, **optimizer_arguments):
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1, use_bias=False, kernel_initializer="ones")])
    model.compile(hvd.DistributedOptimizer(keras.optimizers.SGD(lr), **optimizer_arguments), loss="mse")
    return model


class _RatePerBatch(keras.callbacks.Callback):
    """Records the learning rate each batch runs at (read after the callbacks before it set it)."""

    def __init__(self):
        super().__init__()
        self.rates = []

    def on_train_batch_begin(self, batch, logs=None):
        self.rates.append(float(self.model.optimizer.learning_rate.numpy()))


def _fit_recording_rates(callback, epochs, steps, lr=0.1):
    model = _linear_model(lr)
    recorder = _RatePerBatch()
    x, y = np.ones((steps * 2, 2), np.float32), np.ones((steps * 2, 1), np.float32)
    history = model.fit(x, y, batch_size=2, epochs=epochs, callbacks=[callback, recorder], verbose=0, shuffle=False)
    return recorder.rates, history


def test_warmup_takes_the_scaled_rate_and_starts_at_its_size_th_part():
    # Horovod: initial_lr is the rate after warmup; batch b of epoch e runs at
    # initial_lr / size * (1 + (e + (b + 1) / S) * (size - 1) / W).
    target, warmup_epochs, steps = 0.08 * SIZE, 2, 4
    rates, history = _fit_recording_rates(hvd.callbacks.LearningRateWarmupCallback(target, warmup_epochs), 3, steps)
    expected = [
        target / SIZE * (1 + (e + (b + 1) / steps) * (SIZE - 1) / warmup_epochs)
        for e in range(warmup_epochs)
        for b in range(steps)
    ] + [target] * steps  # after warmup the rate is left at the last one set
    np.testing.assert_allclose(rates, expected, rtol=1e-6)
    np.testing.assert_allclose(history.history["lr"][-1], target, rtol=1e-6)


def test_warmup_needs_its_initial_rate():
    with pytest.raises(TypeError):
        hvd.callbacks.LearningRateWarmupCallback(warmup_epochs=2)  # Horovod's first argument is required


def test_a_constant_schedule_multiplier_decays_exponentially():
    # Horovod: a constant m sets initial_lr * m ** (epoch - start_epoch) at each epoch's start.
    callback = hvd.callbacks.LearningRateScheduleCallback(0.4, 0.5, start_epoch=1, end_epoch=4)
    rates, _ = _fit_recording_rates(callback, epochs=5, steps=2, lr=0.3)
    per_epoch = [0.3, 0.4, 0.2, 0.1, 0.1]  # epoch 0 untouched; 4 is past end_epoch and keeps 0.1
    np.testing.assert_allclose(rates, np.repeat(per_epoch, 2), rtol=1e-6)


def test_a_schedule_function_without_staircase_sees_the_fractional_epoch():
    callback = hvd.callbacks.LearningRateScheduleCallback(1.0, lambda epoch: 0.1 * (1 + epoch), staircase=False)
    rates, _ = _fit_recording_rates(callback, epochs=2, steps=4)
    np.testing.assert_allclose(rates, [0.1 * (1 + e + b / 4) for e in range(2) for b in range(4)], rtol=1e-6)


@pytest.mark.parametrize("average_aggregated_gradients", [None, False, True])
def test_backward_passes_sum_micro_batches_unless_asked_to_average(average_aggregated_gradients):
    # Horovod's default (average_aggregated_gradients=False) applies the SUM of the k micro-batch
    # gradients, each averaged over ranks.
    arguments = (
        {} if average_aggregated_gradients is None else {"average_aggregated_gradients": average_aggregated_gradients}
    )
    lr, k = 0.25, 2
    optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(lr), backward_passes_per_step=k, **arguments)
    variable = tf.Variable([0.0, 0.0])
    for micro_batch in range(k):
        optimizer.apply([tf.constant([1.0, -1.0]) * (RANK + 1) * (micro_batch + 1)], [variable])
    rank_mean_of_sums = np.mean([(r + 1) * sum(m + 1 for m in range(k)) for r in range(SIZE)])
    step = rank_mean_of_sums / (k if average_aggregated_gradients else 1)
    np.testing.assert_allclose(variable.numpy(), -lr * step * np.array([1.0, -1.0]), rtol=1e-6)


def test_optimizer_arguments_are_checked_as_horovod_checks_them():
    sgd = keras.optimizers.SGD(0.1)
    with pytest.raises(ValueError, match="only supports Average and Sum"):
        hvd.DistributedOptimizer(sgd, op=hvd_tf.Max)
    with pytest.raises(ValueError, match="gradient_predivide_factor not supported with op != Average"):
        hvd.DistributedOptimizer(sgd, op=hvd.Sum, gradient_predivide_factor=2.0)
    with pytest.raises(NotImplementedError, match="Adasum"):
        hvd.DistributedOptimizer(sgd, op=hvd_tf.Adasum)
    with pytest.raises(ValueError, match="groups should be"):
        hvd.DistributedOptimizer(sgd, groups=-1)


def test_gradient_predivide_and_groups_leave_the_average_unchanged():
    optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(1.0), gradient_predivide_factor=4.0, groups=2)
    variable = tf.Variable([0.0])
    optimizer.apply([tf.constant([float(RANK)])], [variable])
    np.testing.assert_allclose(variable.numpy(), [-np.mean(np.arange(SIZE))])


def test_alltoall_returns_the_received_splits():
    # Rank r sends r + 1 rows to every rank.
    rows, received = hvd_tf.alltoall(tf.fill([SIZE * (RANK + 1)], float(RANK)), splits=[RANK + 1] * SIZE)
    assert received.numpy().tolist() == [r + 1 for r in range(SIZE)]
    np.testing.assert_array_equal(rows.numpy(), np.repeat(np.arange(SIZE, dtype=np.float32), np.arange(1, SIZE + 1)))


def test_allreduce_averages_by_default_and_maps_the_deprecated_average_argument():
    value = tf.constant([float(RANK + 1)])
    mean, total = np.mean(np.arange(1, SIZE + 1)), np.sum(np.arange(1, SIZE + 1))
    np.testing.assert_allclose(hvd_tf.allreduce(value).numpy(), [mean])
    with pytest.warns(DeprecationWarning) as warned:
        np.testing.assert_allclose(hvd_tf.allreduce(value, average=False).numpy(), [total])
    assert warned[0].filename == __file__  # attributed to the script's line, not to kerasdist
    with pytest.raises(ValueError, match="supersedes average"):
        hvd_tf.allreduce(value, average=True, op=hvd.Sum)
    np.testing.assert_allclose(hvd_tf.allreduce(value, op=hvd_tf.Max).numpy(), [SIZE])


def test_allreduce_of_slices_gathers_rows_and_divides_values_by_size():
    slices = tf.IndexedSlices(tf.constant([[float(RANK + 1)]]), tf.constant([RANK]), tf.constant([SIZE, 1]))
    reduced = hvd_tf.allreduce(slices)
    assert isinstance(reduced, tf.IndexedSlices)
    np.testing.assert_array_equal(reduced.indices.numpy(), np.arange(SIZE))
    np.testing.assert_allclose(reduced.values.numpy().ravel(), np.arange(1, SIZE + 1) / SIZE)
    with pytest.raises(NotImplementedError, match="Pre/postscale"):
        hvd_tf.allreduce(slices, prescale_factor=2.0)


def test_keras_module_collectives_take_and_return_numpy_values():
    total = hvd.allreduce(np.array([RANK, 1.0], np.float32), op=hvd.Sum)
    assert isinstance(total, np.ndarray)
    np.testing.assert_allclose(total, [SIZE * (SIZE - 1) / 2, SIZE])
    np.testing.assert_array_equal(hvd.allgather(np.array([RANK])), np.arange(SIZE))
    np.testing.assert_array_equal(hvd.broadcast(np.array([RANK + 7]), root_rank=SIZE - 1), [SIZE + 6])


def test_object_collectives_and_the_broadcast_function():
    assert hvd_tf.allgather_object({"rank": RANK}) == [{"rank": r} for r in range(SIZE)]
    broadcast = hvd_tf.broadcast_object_fn(root_rank=0)
    assert broadcast(("from", RANK)) == ("from", 0)
    assert hvd_tf.broadcast_object([RANK], root_rank=SIZE - 1) == [SIZE - 1]


def test_grouped_collectives():
    a, b = hvd_tf.grouped_allreduce([tf.constant(float(RANK)), tf.constant([RANK, 1])], op=hvd.Sum)
    assert float(a) == SIZE * (SIZE - 1) / 2 and b.numpy().tolist() == [SIZE * (SIZE - 1) // 2, SIZE]
    (gathered,) = hvd_tf.grouped_allgather([tf.constant([RANK])])
    assert gathered.numpy().tolist() == list(range(SIZE))
    (shard,) = hvd_tf.grouped_reducescatter([tf.ones([SIZE, 2])], op=hvd.Sum)
    np.testing.assert_array_equal(shard.numpy(), np.full((1, 2), SIZE))


def test_metric_average_callback_averages_the_epoch_logs_over_ranks():
    logs = {"loss": float(RANK + 1), "val_accuracy": 0.5 * RANK}
    hvd.callbacks.MetricAverageCallback().on_epoch_end(0, logs)
    assert logs == pytest.approx(
        {"loss": np.mean(np.arange(1, SIZE + 1)), "val_accuracy": 0.5 * np.mean(np.arange(SIZE))}
    )


def test_partial_tape_keeps_local_layer_gradients_unreduced_and_scaled():
    shared, local = keras.layers.Dense(1, use_bias=False), keras.layers.Dense(1, use_bias=False)
    x = tf.constant([[float(RANK + 1)]])
    shared(x), local(x)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(shared(x) + local(x))
    tape = hvd_tf.PartialDistributedGradientTape(tape, local_layers=[local])
    shared_grad, local_grad = tape.gradient(loss, [shared.kernel, local.kernel])
    np.testing.assert_allclose(shared_grad.numpy(), [[np.mean(np.arange(1, SIZE + 1))]])
    np.testing.assert_allclose(local_grad.numpy(), [[(RANK + 1) / SIZE]])


def test_best_model_checkpoint_saves_on_rank_zero_when_the_monitor_improves(tmp_path):
    path = str(tmp_path / f"best-{RANK}.keras")
    model = _linear_model(0.01)
    x, y = np.ones((4, 2), np.float32), np.zeros((4, 1), np.float32)
    model.fit(x, y, epochs=2, callbacks=[hvd.callbacks.BestModelCheckpoint(monitor="loss", filepath=path)], verbose=0)
    assert (tmp_path / f"best-{RANK}.keras").exists() == (RANK == 0)
    with pytest.raises(ValueError, match="filepath"):
        hvd.callbacks.BestModelCheckpoint()


def test_names_kerasdist_does_not_offer_say_what_to_use():
    with pytest.raises(NotImplementedError, match=r"elastic training \(run\); call the training function directly"):
        hvd.elastic.run(lambda state: None)
    with pytest.raises(NotImplementedError, match=r"\(KerasState\); pass kerasdist.callbacks.Rank0Checkpoint"):
        hvd.elastic.KerasState(None, batch=0, epoch=0)
    with pytest.raises(NotImplementedError, match=r"\(CommitStateCallback\); kerasdist.callbacks.Rank0Checkpoint"):
        hvd.elastic.CommitStateCallback(state=None)
    with pytest.raises(NotImplementedError, match="process sets"):
        hvd_tf.allreduce(tf.constant(1.0), process_set=object())
    with pytest.raises(NotImplementedError, match="KERASDIST_TIMELINE"):
        hvd_tf.start_timeline("/tmp/timeline.json")
    with pytest.raises(NotImplementedError, match="Adasum"):
        hvd_tf.allreduce(tf.constant(1.0), op=hvd_tf.Adasum)
    optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1))
    with pytest.raises(ValueError, match="compression='fp16'"):
        hvd_tf.reducescatter(tf.ones([SIZE]), compression="fp16")
    with pytest.raises(NotImplementedError, match="PartialDistributedGradientTape"):
        optimizer.register_local_var(tf.Variable(1.0))


def test_horovod_settings_are_read_when_kerasdist_ones_are_unset():
    environ = {
        "HOROVOD_FUSION_THRESHOLD": "1048576",
        "HOROVOD_CYCLE_TIME": "2.5",
        "HOROVOD_LOG_LEVEL": "TRACE",
        "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "90",
        "KERASDIST_STALL_TIMEOUT_S": "30",  # kerasdist's own setting wins
        "HOROVOD_STALL_CHECK_DISABLE": "1",
        "HOROVOD_AUTOTUNE": "0",
        "HOROVOD_HIERARCHICAL_ALLREDUCE": "1",
    }
    hvd_tf._adopt_horovod_settings(environ)
    assert environ["KERASDIST_AUTOTUNE"] == "off"
    assert environ["KERASDIST_ALLREDUCE_ALGORITHM"] == "hierarchical"
    assert environ["KERASDIST_FUSION_THRESHOLD"] == "1048576"
    assert environ["KERASDIST_CYCLE_TIME_MS"] == "2.5"
    assert environ["KERASDIST_LOG_LEVEL"] == "debug"
    assert environ["KERASDIST_STALL_TIMEOUT_S"] == "30"
    assert environ["KERASDIST_STALL_WARNING_S"] == "0"
    with pytest.raises(ValueError, match="HOROVOD_CACHE_CAPACITY='-3'.*KERASDIST_CACHE_CAPACITY"):
        hvd_tf._adopt_horovod_settings({"HOROVOD_CACHE_CAPACITY": "-3"})


def test_the_keras_module_offers_what_horovod_scripts_call():
    assert hvd.size() == kd.size() and hvd.local_rank() == kd.local_rank()
    assert hvd.Compression.fp16 is kd.Compression.fp16
    assert not hvd.gloo_built() and hvd.mpi_built()


def test_sync_batch_normalization_is_kerasdists_layer():
    assert hvd.SyncBatchNormalization is kd.SyncBatchNormalization
    assert hvd_tf.SyncBatchNormalization is kd.layers.SyncBatchNormalization


def test_join_returns_the_rank_that_joined_last_the_same_on_every_rank():
    last = hvd_tf.join()
    assert last in range(SIZE) and hvd_tf.allgather_object(last) == [last] * SIZE


def test_load_model_wraps_a_plain_saved_optimizer_and_keeps_its_state(tmp_path):
    # As Horovod's load_model does: training the loaded model averages gradients, from the
    # saved Adam slots and step count. Expected: plain Keras on the union of the shards.
    keras.utils.set_random_seed(3)
    x = np.random.default_rng(3).normal(size=(4 * SIZE, 3)).astype("float32")
    y = x @ np.array([[1.0], [-1.0], [2.0]], "float32")
    saved = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    saved.compile(keras.optimizers.Adam(0.05), loss="mse")
    saved.fit(x, y, batch_size=len(x), epochs=2, verbose=0)
    path = str(tmp_path / "plain.keras")  # each rank writes the same model to its own directory
    saved.save(path)

    loaded = hvd.load_model(path)
    assert isinstance(loaded.optimizer, kd.DistributedOptimizer)
    assert int(loaded.optimizer.iterations) == 2
    loaded.fit(x[RANK::SIZE], y[RANK::SIZE], batch_size=4, epochs=2, shuffle=False, verbose=0)

    reference = keras.saving.load_model(path)
    reference.fit(x, y, batch_size=len(x), epochs=2, shuffle=False, verbose=0)
    for got, expected in zip(loaded.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    assert int(loaded.optimizer.iterations) == 4


@pytest.mark.parametrize(
    "name", ["allgather_object", "broadcast_object", "broadcast_object_fn", "join", "barrier", "broadcast_variables"]
)
def test_the_keras_module_offers_horovod_tensorflow_s_names(name):
    assert getattr(hvd, name) is getattr(hvd_tf, name)


def test_the_keras_module_s_object_collectives_work():
    assert hvd.allgather_object(RANK) == list(range(SIZE))
    assert hvd.broadcast_object({"rank": RANK}, root_rank=0) == {"rank": 0}


@pytest.mark.parametrize("name", ["no_such_name", "os", "_op"])
def test_an_unknown_name_of_the_keras_module_is_an_attribute_error_naming_it(name):
    with pytest.raises(AttributeError, match=rf"module 'kerasdist.horovod.tensorflow.keras' has no attribute '{name}'"):
        getattr(hvd, name)


@pytest.mark.skipif(SIZE < 2, reason="the ranks' weights can differ only between 2 or more ranks")
def test_a_model_built_by_fit_s_first_step_trains_alike_on_every_rank_without_a_false_warning(capfd):
    keras.utils.set_random_seed(RANK)  # each rank initialises its own weights
    model = keras.Sequential([keras.layers.Dense(2), keras.layers.Dense(1)])  # no input shape
    model.compile(hvd.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss="mse")
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0)]
    model.fit(np.ones((4, 3)), np.ones((4, 1)), batch_size=2, verbose=0, callbacks=callbacks)
    # The script is right: the broadcast callback traces the first step ahead of running it and
    # broadcasts the weights that trace created, so no rank computes with its own.
    assert "different trainable weights" not in capfd.readouterr().err
    kernels = hvd.allgather_object(model.get_weights()[0].tolist())
    assert all(kernel == kernels[0] for kernel in kernels)
