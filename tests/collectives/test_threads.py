"""Collectives made from several threads pair by name, never by thread scheduling.

* An unnamed eager collective is named after its line and a count of the calls made there. Only
  one thread's calls are counted alike on every rank, so an unnamed eager call from any thread
  but the one that started kerasdist (here the main thread, which imported kd_testutil) is
  refused with a RuntimeError naming both threads, the line and the fix, before it reaches the
  engine (the same decision on every rank). Named calls pair by their name from any thread.
  (tests/launch/test_worker_thread.py starts kerasdist in a worker thread and fits there.)
* A `tf.py_function` body runs on one of TensorFlow's threads: the same rule, and the message
  says what to do there.
* Code AutoGraph converted that runs after the trace (a py_function body, a function converted
  with `tf.autograph.to_graph`) is named after the user's own line, not after AutoGraph's
  temporary file, whose name differs by rank.
* Collectives inside a `tf.function` are named per trace, so a function traced and called in a
  worker thread pairs as it does in the main thread.
"""

import inspect
import threading

import numpy as np
import pytest
import tensorflow as tf
from kd_testutil import RANK, SIZE, assert_world_still_works, needs_two_ranks

import kerasdist as kd
from kerasdist import runtime

JOIN_S = 60


def _in_thread(fn, name="worker"):
    """`fn()` run in a thread of its own: (result, error)."""
    outcome = [None, None]

    def run():
        try:
            outcome[0] = fn()
        except Exception as error:  # noqa: BLE001 - asserted on by the caller
            outcome[1] = error

    thread = threading.Thread(target=run, name=name)
    thread.start()
    thread.join(JOIN_S)
    assert not thread.is_alive(), f"rank {RANK}: thread {name} still runs after {JOIN_S} s"
    return outcome


_UNNAMED_CALLS = {
    "allreduce": lambda: kd.allreduce(tf.constant([1.0])),
    "grouped_allreduce": lambda: kd.grouped_allreduce([tf.constant([1.0]), tf.constant([2])]),
    "allgather": lambda: kd.allgather(tf.constant([1.0])),
    "grouped_allgather": lambda: kd.grouped_allgather([tf.constant([1.0])]),
    "broadcast": lambda: kd.broadcast(tf.constant([1.0]), root_rank=0),
    "broadcast_variables": lambda: kd.broadcast_variables([tf.Variable([1.0])], root_rank=0),
    "reducescatter": lambda: kd.reducescatter(tf.ones([SIZE])),
    "grouped_reducescatter": lambda: kd.grouped_reducescatter([tf.ones([SIZE])]),
    "alltoall": lambda: kd.alltoall(tf.ones([SIZE])),
    "broadcast_object": lambda: kd.broadcast_object("x"),
    "allgather_object": lambda: kd.allgather_object("x"),
    "barrier": lambda: kd.barrier(),
}


@pytest.mark.parametrize("collective", sorted(_UNNAMED_CALLS))
def test_an_unnamed_eager_collective_off_the_starting_thread_is_refused_naming_the_threads_and_the_fix(collective):
    result, error = _in_thread(_UNNAMED_CALLS[collective], name="loader-3")
    assert_world_still_works()
    assert result is None, f"rank {RANK}: {collective} from a worker thread ran and gave {result!r}"
    assert isinstance(error, RuntimeError), f"rank {RANK}: {error!r}"
    message = str(error)
    assert "from thread 'loader-3', not from the thread that started kerasdist ('MainThread')" in message, message
    assert "name=" in message and "make the call from thread 'MainThread'" in message, message
    assert "test_threads.py:" in message, message  # the user's line, not one of kerasdist's


def test_the_refusal_names_the_line_that_made_the_call():
    def call():
        return kd.allreduce(tf.constant(1.0))

    line = inspect.getsourcelines(call)[1] + 1
    _, error = _in_thread(call)
    assert isinstance(error, RuntimeError), repr(error)
    assert f"test_threads.py:{line}" in str(error), str(error)


def _two_threads(work, order):
    """The outcomes of `work("A", r + 1)` and `work("B", 1000 * (r + 1))`, each in a thread of its
    own, started in `order`: a result, or the exception raised."""
    values = {"A": RANK + 1.0, "B": 1000.0 * (RANK + 1)}
    outcomes = {}

    def run(tag):
        try:
            outcomes[tag] = work(tag, values[tag])
        except Exception as error:  # noqa: BLE001 - asserted on by the caller
            outcomes[tag] = error

    threads = {tag: threading.Thread(target=run, args=(tag,)) for tag in order}
    for tag in order:
        threads[tag].start()
    for tag in order:
        threads[tag].join(JOIN_S)
    return outcomes


def _unnamed_sum(tag, value):
    return float(kd.allreduce(tf.constant(value), op=kd.Sum))


def test_two_threads_calling_one_line_are_refused_instead_of_pairing_by_scheduling():
    # The probe of issue 49: thread A sends r + 1 and thread B 1000 * (r + 1) from the same line,
    # started in a different order on each rank. Numbered per line, their calls cross-paired
    # (rank 0's A with rank 1's B) in half of the iterations, without an error.
    for _ in range(3):
        outcomes = _two_threads(_unnamed_sum, ["A", "B"] if RANK % 2 == 0 else ["B", "A"])
        assert_world_still_works()
        assert all(isinstance(outcome, RuntimeError) for outcome in outcomes.values()), f"rank {RANK}: {outcomes}"


@needs_two_ranks
def test_named_calls_from_two_threads_pair_by_name_whatever_order_the_threads_run_in():
    for iteration in range(5):
        both_ready = threading.Barrier(2)

        def named_sum(tag, value, both_ready=both_ready):
            both_ready.wait(JOIN_S)  # both threads submit together: neither waits seconds alone
            return float(kd.allreduce(tf.constant(value), op=kd.Sum, name=f"thread_{tag}"))

        outcomes = _two_threads(named_sum, ["A", "B"] if (RANK + iteration) % 2 == 0 else ["B", "A"])
        expected_a = SIZE * (SIZE + 1) / 2
        assert outcomes == {"A": expected_a, "B": 1000.0 * expected_a}, f"rank {RANK}: {outcomes}"


def test_kerasdists_own_collectives_off_the_starting_thread_say_where_to_call_fit_or_start_kerasdist():
    # Its callbacks in fit, the Estimator and kerasdist.data make unnamed collectives: a user
    # cannot name them, so the message must not ask for name=.
    result, error = _in_thread(lambda: kd.data.check_equal_steps(3), name="trainer")
    assert_world_still_works()
    assert result is None, f"rank {RANK}: check_equal_steps from a worker thread gave {result!r}"
    assert isinstance(error, RuntimeError), f"rank {RANK}: {error!r}"
    message = str(error)
    assert "kerasdist.data" in message and "thread 'trainer'" in message, message
    assert "call fit (or whatever called this) from thread 'MainThread'" in message, message
    assert "start kerasdist from the thread that calls fit: call kerasdist.init() there" in message, message
    assert "name=" not in message, message


def test_unnamed_eager_calls_belong_to_the_thread_that_started_kerasdist_not_to_the_main_thread(monkeypatch):
    # As in a process whose worker thread called kerasdist.init() first (test_worker_thread.py
    # starts one for real): that thread's unnamed calls pair, the main thread's are refused.
    sums = []
    trainer = threading.Thread(
        target=lambda: sums.extend(float(kd.allreduce(tf.constant(RANK + i), op=kd.Sum)) for i in range(3)),
        name="trainer",
    )
    monkeypatch.setattr(runtime.state(), "thread", trainer)
    trainer.start()
    trainer.join(JOIN_S)
    assert not trainer.is_alive(), f"rank {RANK}: the trainer thread still runs after {JOIN_S} s"
    assert sums == [sum(r + i for r in range(SIZE)) for i in range(3)], f"rank {RANK}: {sums}"
    with pytest.raises(RuntimeError) as refused:
        kd.allreduce(tf.constant(1.0))
    monkeypatch.undo()  # the main thread's calls are the rest of the suite's
    assert_world_still_works()
    message = str(refused.value)
    assert "from thread 'MainThread', not from the thread that started kerasdist ('trainer', which has ended)" in (
        message
    ), message


def test_a_tf_function_traced_and_called_in_a_worker_thread_pairs_as_in_the_main_thread():
    @tf.function
    def step(x):
        return kd.allreduce(x, op=kd.Sum)

    def three_steps():
        return [float(step(tf.constant(float(RANK + i)))) for i in range(3)]

    result, error = _in_thread(three_steps)
    assert error is None, f"rank {RANK}: {error!r}"
    assert result == [sum(r + i for r in range(SIZE)) for i in range(3)]


# ------------------------------------------------------- tf.py_function and AutoGraph's code


def test_an_unnamed_collective_in_a_py_function_is_refused_naming_the_users_line_and_the_fix():
    # The probe of issue 49: identical code on every rank failed after the mismatch timeout,
    # each rank's call named after AutoGraph's temporary file (`__autograph_generated_file...`).
    @tf.function
    def step(x):
        def body(value):
            return kd.allreduce(value, op=kd.Sum)

        return tf.py_function(body, [x], tf.float32)

    line = inspect.getsourcelines(step.python_function)[1] + 3
    try:
        step(tf.constant(1.0))
        error = None
    except tf.errors.OpError as raised:
        error = raised
    assert_world_still_works()
    assert error is not None, f"rank {RANK}: the unnamed collective in a py_function ran"
    # TensorFlow's message holds the body's traceback (AutoGraph's file included), then ours.
    refusals = [text for text in error.message.splitlines() if text.startswith("RuntimeError: kerasdist.")]
    assert refusals, error.message
    assert "tf.py_function" in refusals[0] and "name=" in refusals[0], refusals[0]
    assert f"allreduce at test_threads.py:{line} " in refusals[0], refusals[0]


def test_a_named_collective_in_a_py_function_pairs():
    @tf.function
    def step(x):
        def body(value):
            return kd.allreduce(value, op=kd.Sum, name="py_function_sum")

        return tf.py_function(body, [x], tf.float32)

    for i in range(3):
        assert float(step(tf.constant(float(RANK + i)))) == sum(r + i for r in range(SIZE))


def _reduce_rank_plus_one():
    return kd.allreduce(tf.constant(float(RANK + 1)), op=kd.Sum)


def test_code_autograph_converted_is_named_after_the_users_line_when_it_runs_later():
    converted = tf.autograph.to_graph(_reduce_rank_plus_one)
    line = inspect.getsourcelines(_reduce_rank_plus_one)[1] + 1
    _, error = _in_thread(converted)
    assert isinstance(error, RuntimeError), repr(error)
    assert f"test_threads.py:{line}" in str(error), str(error)


@needs_two_ranks
def test_code_autograph_converted_and_run_eagerly_pairs_across_ranks():
    # Each rank's converted copy lives in a temporary file of another name.
    converted = tf.autograph.to_graph(_reduce_rank_plus_one)
    result = [float(converted()) for _ in range(2)]
    np.testing.assert_array_equal(result, [SIZE * (SIZE + 1) / 2] * 2)
