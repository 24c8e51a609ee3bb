"""Every private Keras and TensorFlow hook kerasdist relies on, in one place.

Public APIs cannot do these jobs (why is said at each hook). A Keras or TensorFlow release that
moves or drops one breaks here, at import, with a message naming the hook and the versions
kerasdist was tested with, instead of deep inside `fit`. tests/test_compat.py checks each
hook's behaviour, not only that it exists.
"""

import importlib
import os
import sys

import keras
import tensorflow as tf

TESTED_WITH = "Keras 3.15 and TensorFlow 2.21"


def _private(module, name, used_for):
    """`module.name`, or an ImportError saying what kerasdist needed it for."""
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as error:
        raise ImportError(
            f"kerasdist needs {module}.{name} ({used_for}), which this installation "
            f"(Keras {keras.__version__}, TensorFlow {tf.__version__}) does not have: {error}. kerasdist "
            f"was tested with {TESTED_WITH}; install one of those versions."
        ) from None


# Keras's base for callbacks that watch a metric (mode "auto"/"min"/"max", `_is_improvement`):
# Rank0Checkpoint compares its monitored value exactly as ModelCheckpoint does.
MonitorCallback = _private(
    "keras.src.callbacks.monitor_callback", "MonitorCallback", "Rank0Checkpoint's save_best_only comparisons"
)
# Prints through Keras's own channel, so `keras.utils.disable_interactive_logging` quiets it too.
print_msg = _private("keras.src.utils.io_utils", "print_msg", "Rank0Checkpoint's messages")
# Lets an optimizer keep variables in plain attributes without Keras tracking them twice.
no_automatic_dependency_tracking = _private(
    "keras.src.utils.tracking", "no_automatic_dependency_tracking", "DistributedOptimizer's own variables"
)
# What `model.compile` wraps a plain loss function in; the curvature estimate reuses it.
LossFunctionWrapper = _private("keras.src.losses.losses", "LossFunctionWrapper", "the Hessian power iteration's loss")
_auto_control_deps = _private(
    "tensorflow.python.framework",
    "auto_control_deps",
    "keeping kerasdist's collectives out of tf.function's program order",
)
_control_flow_util = _private("tensorflow.python.ops", "control_flow_util", "refusing XLA-compiled functions")
# The graphs that tf.cond and tf.while_loop trace their branches and bodies into.
_ControlFlowFuncGraph = _private(
    "tensorflow.python.ops.control_flow_v2_func_graphs",
    "ControlFlowFuncGraph",
    "naming collectives inside tf.cond and tf.while_loop by their function",
)
# The graph a tf.function traces into (cond and while graphs are ones too), as opposed to a
# TF1-style graph, whose runs kerasdist cannot count.
_FuncGraph = _private("tensorflow.python.framework.func_graph", "FuncGraph", "numbering the calls of each tf.function")
# AutoGraph runs the code it converts from a temporary module whose file name differs by process;
# the lines that code came from are kept with the module in the transpiler's cache of converted
# functions, and nothing public maps a running frame back to them.
_autograph_transpiler = _private(
    "tensorflow.python.autograph.impl.api",
    "_TRANSPILER",
    "naming collectives made from code AutoGraph converted by their source line",
)
_AUTOGRAPH_FILE_PREFIX = "__autograph_generated_file"
# tf.py_function and tf.numpy_function call their Python bodies from this module, on TensorFlow's
# threads.
_script_ops = _private("tensorflow.python.ops", "script_ops", "telling a collective made inside tf.py_function")
SummaryMetadata = _private(
    "tensorflow.core.framework.summary_pb2",
    "SummaryMetadata",
    "the Estimator's scalar summaries without the tensorboard package",
)
DATA_CLASS_SCALAR = _private(
    "tensorflow.core.framework.summary_pb2",
    "DATA_CLASS_SCALAR",
    "the Estimator's scalar summaries without the tensorboard package",
)


# The eager context, whose ConfigProto its runtime starts with: TensorFlow 2 has no public call
# for the pools' spinning.
_eager_context = _private(
    "tensorflow.python.eager.context", "context", "stopping TensorFlow's thread pools from spinning on one CPU"
)
_ConfigProto = _private(
    "tensorflow.core.protobuf.config_pb2", "ConfigProto", "stopping TensorFlow's thread pools from spinning on one CPU"
)


def stop_thread_spinning():
    """Has TensorFlow's thread pools sleep as soon as they run out of work, instead of spinning
    first; nothing once its runtime has started (it reads the setting when it starts)."""
    eager = _eager_context()
    if eager._context_handle is not None:
        return
    config = _ConfigProto()
    if eager._config is not None:
        config.CopyFrom(eager._config)
    config.experimental.disable_thread_spinning = True
    eager._config = config


def mark_order_insensitive(op_types):
    """Lets tf.function keep the stateful `op_types` (never pruned) without ordering them among
    other stateful ops, which would serialize collectives the engine could fuse."""
    _auto_control_deps.MUST_RUN_ORDER_INSENSITIVE_STATEFUL_OPS = (
        _auto_control_deps.MUST_RUN_ORDER_INSENSITIVE_STATEFUL_OPS | frozenset(op_types)
    )


def order_insensitive_op_types():
    return _auto_control_deps.MUST_RUN_ORDER_INSENSITIVE_STATEFUL_OPS


def in_xla_context():
    """True while tracing a function compiled with jit_compile=True (or called from one)."""
    return _control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph())


def enclosing_function_graph():
    """The graph of the `tf.function` being traced: past the branch and body graphs of
    `tf.cond` and `tf.while_loop`, which trace into graphs of their own."""
    graph = tf.compat.v1.get_default_graph()
    while isinstance(graph, _ControlFlowFuncGraph):
        graph = graph.outer_graph
    return graph


def is_function_graph(graph):
    """True for the graph of a `tf.function` (or of its cond and while bodies)."""
    return isinstance(graph, _FuncGraph)


def autograph_origin(filename, lineno):
    """`(file, line)` of the code that line `lineno` of AutoGraph's generated `filename` was
    converted from, while tracing and whenever the converted code runs later (a `tf.py_function`
    body); None for a file AutoGraph did not generate, or a line it added."""
    if not os.path.basename(filename).startswith(_AUTOGRAPH_FILE_PREFIX):
        return None
    with _autograph_transpiler._cache_lock:
        factories = [
            factory for variants in _autograph_transpiler._cache._cache.values() for factory in variants.values()
        ]
    for factory in factories:
        if getattr(factory.module, "__file__", None) == filename:
            origin = factory.source_map.get((filename, lineno))
            return None if origin is None else (origin.loc.filename, origin.loc.lineno)
    return None


def in_py_function():
    """True when called, at any depth, from the body of a `tf.py_function` or `tf.numpy_function`."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_globals is vars(_script_ops):
            return True
        frame = frame.f_back
    return False


def callbacks_setting_the_model():
    """Called from a callback's `set_model`: the callbacks of the `fit` (the `CallbackList`) that
    is calling it, or None when something else called it. Keras passes a callback no list, and
    StopAgreement must know whether any of them may stop training at a batch."""
    caller = sys._getframe(2).f_locals.get("self")  # the caller of set_model: CallbackList.set_model
    return caller.callbacks if isinstance(caller, keras.callbacks.CallbackList) else None


def trace_train_function(train_function, iterator):
    """Traces the `tf.function` behind Keras's `model.train_function` for `iterator` without
    running a step, so that every variable its first step creates (layers built on first call,
    optimizers built at their first `apply`) exists, initialised, before any step uses it; the
    call that follows runs that trace. False when there is no `tf.function` to trace
    (`run_eagerly=True`). Keras makes the `tf.function` inside `make_train_function` and keeps
    only a closure over it; no public call traces a train function ahead of its first step.
    """
    names = train_function.__code__.co_freevars
    if "multi_step_on_iterator" not in names:
        raise ImportError(
            f"kerasdist traces Keras's train function through its closure's multi_step_on_iterator, which "
            f"Keras {keras.__version__} does not have; kerasdist was tested with {TESTED_WITH}"
        )
    function = train_function.__closure__[names.index("multi_step_on_iterator")].cell_contents
    if not isinstance(function, tf.types.experimental.PolymorphicFunction):
        return False
    function.get_concrete_function(iterator)
    return True


def all_layers(model):
    """`model` and every layer inside it, nested models and layers held as attributes included
    (Keras's `model.layers` lists only the top level of a functional or Sequential model)."""
    return list(model._flatten_layers(include_self=True, recursive=True))


def set_initial_epoch(model, epoch):
    """Makes a `fit` that has begun start at `epoch`; None gives back its `initial_epoch`.

    `fit` reads `model._initial_epoch` after `on_train_begin`: this is how Keras's own
    BackupAndRestore resumes, and no public argument can change the epoch from a callback.
    """
    if not hasattr(model, "_initial_epoch"):
        raise ImportError(
            f"kerasdist resumes fit() through keras.Model._initial_epoch, which Keras "
            f"{keras.__version__} does not have; kerasdist was tested with {TESTED_WITH}"
        )
    model._initial_epoch = epoch


def learning_rate_object(optimizer):
    """The optimizer's rate as given: a variable, or the `LearningRateSchedule` it evaluates
    (`optimizer.learning_rate` evaluates a schedule, so it cannot tell the two apart)."""
    return optimizer._learning_rate


def replace_metrics_result(model, make_result):
    """Makes `model.get_metrics_result` return `make_result(local_result, ran_steps=True)` where
    it runs eagerly, and the results of an epoch or `evaluate` in which this rank ran no step
    (an empty shard) `make_result(local_result, ran_steps=False)`.

    Keras builds the epoch's logs (and `evaluate`'s results) from the eager call, outside the
    compiled step; the calls inside a train or test step stay per batch and local. It does so in
    `Model._get_metrics_result_or_logs(logs)`, which returns the last step's logs instead when
    they do not name the metrics: `{}` after no step, so such a rank would report nothing.
    """
    if not hasattr(model, "_get_metrics_result_or_logs"):
        raise ImportError(
            f"kerasdist reports the metrics of a rank with an empty shard through "
            f"keras.Model._get_metrics_result_or_logs, which Keras {keras.__version__} does not "
            f"have; kerasdist was tested with {TESTED_WITH}"
        )
    local_result = model.get_metrics_result
    local_result_or_logs = model._get_metrics_result_or_logs

    def get_metrics_result():
        if not tf.executing_eagerly():
            return local_result()
        return make_result(local_result, ran_steps=True)

    def get_metrics_result_or_logs(logs):
        if not logs:  # the last step's logs: none when this rank ran no step
            return make_result(local_result, ran_steps=False)
        return local_result_or_logs(logs)

    model.get_metrics_result = get_metrics_result
    model._get_metrics_result_or_logs = get_metrics_result_or_logs


# tf.data keeps what decides a dataset's element order in its Python objects (a shuffle's seeds, a
# parallel step's `deterministic`) and lists a dataset's inputs and functions through private
# methods; no public call reads them back. Serializing the whole pipeline instead
# (tf.raw_ops.DatasetToGraphV2) copies every in-memory tensor it holds: 1.7 s for 400 MB.
_ORDER_CHECK = "checking that a dataset's elements come in the same order on every rank before kerasdist.data.shard"
_RANDOM_DATASETS = (
    (_private("tensorflow.python.data.ops.shuffle_op", "_ShuffleDataset", _ORDER_CHECK), "Dataset.shuffle"),
    (_private("tensorflow.python.data.ops.random_op", "_RandomDataset", _ORDER_CHECK), "Dataset.random"),
    (
        _private("tensorflow.python.data.experimental.ops.global_shuffle_op", "_GlobalShuffleDataset", _ORDER_CHECK),
        "tf.data.experimental.global_shuffle",
    ),
)
_ParallelInterleaveDataset = _private(
    "tensorflow.python.data.ops.interleave_op", "_ParallelInterleaveDataset", _ORDER_CHECK
)
_PARALLEL_DATASETS = (
    (_private("tensorflow.python.data.ops.map_op", "_ParallelMapDataset", _ORDER_CHECK), "Dataset.map"),
    (_private("tensorflow.python.data.ops.batch_op", "_ParallelBatchDataset", _ORDER_CHECK), "Dataset.batch"),
    (_ParallelInterleaveDataset, "Dataset.interleave"),
    (
        _private("tensorflow.python.data.ops.readers", "ParallelInterleaveDataset", _ORDER_CHECK),
        "tf.data.experimental.parallel_interleave",
    ),
)
_FilterDataset = _private("tensorflow.python.data.ops.filter_op", "_FilterDataset", _ORDER_CHECK)


def dataset_inputs(dataset):
    """The datasets `dataset` reads from (a zip or `sample_from_datasets` has several)."""
    return list(dataset._inputs())


def dataset_function_graphs(dataset):
    """The graphs of the functions `dataset` applies (map, filter, interleave, ...), whose ops
    include any dataset built inside them."""
    return [wrapper.function.graph for wrapper in dataset._functions()]


def is_filter(dataset):
    """True for a `Dataset.filter`, whose function decides which elements are kept."""
    return isinstance(dataset, _FilterDataset)


def dataset_random_seeds(dataset):
    """`(transformation, seed, seed2)` for a dataset that draws random numbers (a shuffle,
    `Dataset.random`), with the seeds tf.data derived from the op seed and the global seed: both
    0 when neither was set, so that each iteration draws afresh; a seed that is not a constant is
    None. None for other datasets."""
    for kind, transformation in _RANDOM_DATASETS:
        if isinstance(dataset, kind):
            return transformation, _constant_int(dataset._seed), _constant_int(dataset._seed2)
    return None


def _constant_int(tensor):
    value = tf.get_static_value(tensor)
    return None if value is None else int(value)


def dataset_determinism(dataset):
    """`(transformation, deterministic)` for a parallel map, batch or interleave: "true",
    "false", or "default" (the pipeline's `tf.data.Options.deterministic` decides, true unless
    set); None for other datasets, and where it cannot be read."""
    for kind, transformation in _PARALLEL_DATASETS:
        if isinstance(dataset, kind):
            if hasattr(dataset, "_deterministic"):
                return transformation, dataset._deterministic
            return transformation, _serialized_determinism(dataset)
    return None


def _serialized_determinism(dataset):
    """`Dataset.interleave` keeps its setting in its op only: serialize the pipeline up to it
    (typically file names) and read the op's attribute."""
    if not tf.executing_eagerly():
        return None
    try:
        serialized = tf.raw_ops.DatasetToGraphV2(
            input_dataset=dataset._variant_tensor,
            external_state_policy=tf.data.experimental.ExternalStatePolicy.IGNORE.value,
            strip_device_assignment=True,
        )
    except tf.errors.OpError:  # a dataset that cannot be serialized
        return None
    graph = tf.compat.v1.GraphDef.FromString(serialized.numpy())
    nodes = {node.name: node for node in graph.node}
    output = next(node for node in graph.node if node.op == "_Retval")
    produced_by = nodes[output.input[0].split(":")[0]]
    return produced_by.attr["deterministic"].s.decode() if "deterministic" in produced_by.attr else None
