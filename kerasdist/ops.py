"""Collectives on TensorFlow tensors, eager or inside ``tf.function``, and on Python objects.

Each call becomes one request to the engine, identified by a name that must match across
ranks: ``name=``, or the place it was called from and a count of the calls made there (per trace
inside a ``tf.function``). A call one rank cannot make (bad input) fails on that
rank at once and, through the engine, on the others too. Gradients follow the convention that
the global objective is the sum of the per-rank losses.
"""

import collections
import ctypes
import enum
import itertools
import os
import pickle
import struct
import sys
import threading
import weakref

import numpy as np
import tensorflow as tf

from kerasdist import _compat, runtime

_OP_TYPES = (
    "KerasdistExecutionCount",
    "KerasdistAllreduce",
    "KerasdistAllgather",
    "KerasdistBroadcast",
    "KerasdistReducescatter",
    "KerasdistAlltoall",
)
# The ops are stateful, so tf.function never prunes one whose result a rank leaves unused (the
# other ranks would wait for it). They need no program order, though: the engine negotiates
# one, and serializing them like other stateful ops would defeat tensor fusion.
_compat.mark_order_insensitive(_OP_TYPES)


class _OpKind(enum.IntEnum):
    """The engine's operation kinds (values match the C++ engine)."""

    ALLREDUCE = 0
    ALLGATHER = 1
    BROADCAST = 2
    REDUCESCATTER = 3
    ALLTOALL = 4


_REDUCIBLE_DTYPES = (tf.uint8, tf.int8, tf.int32, tf.int64, tf.float16, tf.bfloat16, tf.float32, tf.float64)
_MOVABLE_DTYPES = _REDUCIBLE_DTYPES + (tf.bool,)


class ReduceOp(enum.IntEnum):
    """How allreduce and reducescatter combine values (values match the C++ engine).

    Example:

    ```python
    import tensorflow as tf
    import kerasdist

    kerasdist.init()
    mine = tf.constant(float(kerasdist.rank() + 1))  # rank r sends r + 1
    n = kerasdist.size()
    print(float(kerasdist.allreduce(mine, op=kerasdist.ReduceOp.SUM)) == n * (n + 1) / 2)  # True
    print(float(kerasdist.allreduce(mine, op=kerasdist.Max)) == n)  # True
    print(kerasdist.Average is kerasdist.ReduceOp.AVERAGE)  # True
    ```
    """

    #: The sum divided by ``size()`` (integers: the mean rounded toward zero); the default.
    AVERAGE = 0
    #: The sum over ranks.
    SUM = 1
    #: The smallest value, element by element.
    MIN = 2
    #: The largest value, element by element.
    MAX = 3
    #: The product over ranks.
    PRODUCT = 4


Average, Sum, Min, Max, Product = ReduceOp.AVERAGE, ReduceOp.SUM, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT


class _Cast:
    """Sends float32/float64 tensors in a 16-bit dtype and restores their own afterwards.

    An allreduce leaves the conversions to the engine, which does them while packing and
    unpacking (vectorised, the averaging folded in) and sums in float32; gathered values (the
    `IndexedSlices` of an embedding gradient) are cast here. 16-bit tensors pass unchanged:
    float16 through bf16 would lose precision, not bytes.
    """

    def __init__(self, wire_dtype, engine_dtype):
        self.wire_dtype = wire_dtype
        self._engine_dtype = engine_dtype  # the engine's DataType value (common.h)

    def compress(self, tensor):
        if tensor.dtype in (tf.float32, tf.float64):
            return tf.cast(tensor, self.wire_dtype), tensor.dtype
        return tensor, None

    def decompress(self, tensor, original_dtype):
        return tensor if original_dtype is None else tf.cast(tensor, original_dtype)

    def __repr__(self):
        return f"Compression({self.wire_dtype.name})"


class _NoCompression:
    _engine_dtype = None  # each tensor travels in its own dtype

    def compress(self, tensor):
        return tensor, None

    def decompress(self, tensor, _):
        return tensor

    def __repr__(self):
        return "Compression.none"


class Compression:
    """Wire formats for allreduce: ``none``, ``fp16`` or ``bf16`` (floats only).

    Pass one as ``compression=`` to `allreduce` or `grouped_allreduce`, where a list gives each
    tensor of the group its own. ``fp16`` holds values up to +-65504 only: a value beyond that,
    sent or in the sum (a Sum of 40000 on 2 ranks), becomes +-inf without an error. ``bf16`` has
    float32's range (to about 3.4e38) with 8 bits of precision and does not overflow.

    Example:

    ```python
    import tensorflow as tf
    import kerasdist

    kerasdist.init()
    averaged = kerasdist.allreduce(tf.constant([1.0, 2.5]), compression=kerasdist.Compression.fp16)
    print(averaged.dtype.name, averaged.numpy().tolist())  # float32 [1.0, 2.5]
    ```
    """

    none = _NoCompression()
    fp16 = _Cast(tf.float16, engine_dtype=4)
    bf16 = _Cast(tf.bfloat16, engine_dtype=5)


_calls_per_site = collections.defaultdict(itertools.count)
_calls_per_graph_site = weakref.WeakKeyDictionary()
_calls_per_site_lock = threading.Lock()
# Frames that lie between a program's call and the collective: ours and TensorFlow's wrappers.
# The Horovod-compatible API is a pass-through too: a name must come from the user's line. (Code
# AutoGraph converted runs with the globals of the module it came from, so this holds there too.)
_PASS_THROUGH_MODULES = (__name__, "tensorflow.", "kerasdist.horovod")


# AutoGraph leaves these as written: they hold no tensor-dependent Python control flow, and a
# first collective inside a tf.function reaches init(), whose mpi4py calls AutoGraph cannot
# convert and would warn about one by one.
_not_autographed = tf.autograph.experimental.do_not_convert


def _tensor_name(kind, name):
    """The name every rank gives this call, unless `name` is given.

    An unnamed call is named after the line that made it and the number of calls made there
    before: `allreduce@train.py:12#0` eagerly, `allreduce@train_step/train.py:12#0` inside a
    `tf.function` (counted per trace of the function, so every trace names its ops alike). Calls
    from different lines never pair, so an extra call on one rank (say under `if rank == 0:`)
    fails as a mismatch instead of shifting every later pairing by one. Graph node names would
    not do: they hold Keras's automatic layer names, which count every model a process built.
    Eagerly, only the calls of the thread that started kerasdist are counted alike on every rank
    (see `_refuse_unnamed_call_off_the_starting_thread`).
    """
    if name:
        return name
    caller = _calling_frame()
    site = _call_site(caller)
    graph = None if tf.executing_eagerly() else _compat.enclosing_function_graph()
    if graph is None:
        _refuse_unnamed_call_off_the_starting_thread(kind, site, caller)
    where = "" if graph is None else f"{getattr(graph, 'name', 'graph')}/"
    with _calls_per_site_lock:
        if graph is None:
            counts = _calls_per_site
        else:
            counts = _calls_per_graph_site.setdefault(graph, collections.defaultdict(itertools.count))
        count = next(counts[(kind, site)])
    return f"{kind}@{where}{site}#{count}"


_executions_per_graph = weakref.WeakKeyDictionary()
_traced_functions = itertools.count()
_eager_execution = []  # the -1 that eager calls carry, made once


def _execution():
    """What a collective made here carries as its `execution`: inside a `tf.function`, the
    number of earlier calls of that function on this rank; -1 eagerly (and in TF1-style graphs,
    whose runs cannot be counted).

    Names inside a `tf.function` are fixed per trace, so the same name comes back in every call.
    The count tells the engine which call a request belongs to: a collective one rank skipped
    (under `tf.cond`) then fails on every rank instead of pairing with the next call's. The
    count is one stateful op per traced function, placed in the function's own graph even when
    the collective sits in a cond or loop body, so that it runs on every call.
    """
    if tf.executing_eagerly():
        if not _eager_execution:
            _eager_execution.append(tf.constant(-1, tf.int64))
        return _eager_execution[0]
    graph = _compat.enclosing_function_graph()
    if not _compat.is_function_graph(graph):
        return tf.constant(-1, tf.int64)
    with _calls_per_site_lock:
        count = _executions_per_graph.get(graph)
    if count is None:
        # One count per traced function: two functions of one Python name (two lambdas, a train
        # and a test step) would otherwise share a count, and in turns each would skip numbers
        # and leave the fast path on every call.
        with _calls_per_site_lock:
            function = f"{graph.name}#{next(_traced_functions)}"
        with graph.as_default():
            count = _ops().kerasdist_execution_count(function=function)
        with _calls_per_site_lock:
            _executions_per_graph[graph] = count
    return count


def _refuse_unnamed_call_off_the_starting_thread(kind, site, caller):
    """Raises for an unnamed eager call from any thread but the one that started kerasdist.

    Two threads calling one line would take the numbers of that line's calls in whatever order
    they get there, which differs by rank: their calls would pair across threads, silently.
    Refusing the second thread seen at a line would come too late (its first call may already
    have paired wrongly on a rank where the other thread came first), so the rule depends on the
    calling thread alone. The thread that started kerasdist (`init()`, explicit or through the
    first collective or DistributedOptimizer) plays the same part on every rank, since every
    rank runs the same program: the main thread of a script, the worker of a service that trains
    in one (unless the program lets several threads race to start it). A tf.py_function body that
    started it may have run on one of TensorFlow's threads, which differ from call to call: then
    no thread's unnamed calls are allowed.
    """
    owner = runtime.state().thread  # starts kerasdist if needed: then this thread owns the calls
    thread = threading.current_thread()
    if thread is owner:
        return
    if owner is None:
        why = (
            "but kerasdist was started inside a tf.py_function body, on one of TensorFlow's threads (the "
            "next body may run on another), so no thread's unnamed eager collectives match across ranks"
        )
        fit_fix = "call kerasdist.init() first, from the thread that calls fit (or whatever called this)"
        call_fix = "or call kerasdist.init() first, from the thread that makes this call"
    else:
        ended = "" if owner.is_alive() else ", which has ended"
        why = f"not from the thread that started kerasdist ({owner.name!r}{ended})"
        start_there = "call kerasdist.init() there before anything else uses kerasdist"
        fit_fix = (
            f"call fit (or whatever called this) from thread {owner.name!r}, or start kerasdist from the "
            f"thread that calls fit: {start_there}"
        )
        call_fix = (
            f"or make the call from thread {owner.name!r}, or start kerasdist from the thread that makes "
            f"it: {start_there}"
        )
    module = caller.f_globals.get("__name__", "")
    if module.startswith("kerasdist."):
        raise RuntimeError(
            f"kerasdist.{kind} at {site} (in {module}) was called from thread {thread.name!r}, {why}. "
            "kerasdist's own collectives (its callbacks in fit, the Estimator, kerasdist.data) are unnamed, "
            "and unnamed eager collectives match across ranks only when the thread that started kerasdist "
            f"makes them: {fit_fix}."
        )
    if _compat.in_py_function():
        where = (
            f"inside a tf.py_function (or tf.numpy_function), whose body TensorFlow runs on a thread of its "
            f"own ({thread.name!r}), {why}"
        )
        instead = (
            "or make the collective in the tf.function itself, outside the py_function (kerasdist's "
            "collectives run inside tf.function)"
        )
    else:
        where = f"from thread {thread.name!r}, {why}"
        instead = call_fix
    raise RuntimeError(
        f"kerasdist.{kind} at {site} has no name= and was called {where}. An unnamed eager collective is "
        "named after its line and the number of calls made there before, which match across ranks only "
        "for the calls of one thread, the thread that started kerasdist: calls of several threads would "
        "pair by thread scheduling. Pass name=, the same on every rank and used by no other collective "
        f"that may be pending at the same time (for example name=f'stats/{{step}}'), {instead}."
    )


def _calling_frame():
    """The first frame outside kerasdist.ops and TensorFlow's wrappers: the caller's."""
    frame = sys._getframe(1)
    while frame.f_back is not None and frame.f_globals.get("__name__", "").startswith(_PASS_THROUGH_MODULES):
        frame = frame.f_back
    return frame


def _call_site(frame):
    """`file:line` of `frame`. The file's base name, not its path: ranks on different hosts may run
    the same code from different paths. Code AutoGraph converted runs from a temporary file whose
    name differs by rank, while tracing and when it runs later (a `tf.py_function` body): there the
    line it was converted from is used.
    """
    file, line = frame.f_code.co_filename, frame.f_lineno
    file, line = _compat.autograph_origin(file, line) or (file, line)
    return f"{os.path.basename(file)}:{line}"


def _fail(kind, name, error):
    """Raises `error` on this rank; an eager call first tells the other ranks, which then fail
    the same call (naming this rank and the error) instead of waiting for it."""
    if tf.executing_eagerly() and name:
        runtime.state().engine.kerasdist_submit_failure(
            name.encode(), int(kind), f"{type(error).__name__}: {error}".encode()
        )
    raise error


def _refuse_xla(where):
    """Our ops have no XLA kernels: fail at trace time with a fix, not deep inside XLA."""
    if not tf.executing_eagerly() and _compat.in_xla_context():
        raise ValueError(
            f"{where} runs inside an XLA-compiled function (jit_compile=True), but kerasdist's "
            "collectives have no XLA kernels. Compile the model with jit_compile=False (the "
            "callbacks from kerasdist.callbacks() do this for model.fit), or drop jit_compile=True "
            "from your tf.function."
        )


def _check_dtypes(what, kind, name, tensors, allowed):
    for tensor in tensors:
        if tensor.dtype not in allowed:
            _fail(
                kind,
                name,
                TypeError(
                    f"kerasdist.{what} takes tensors of dtype {', '.join(d.name for d in allowed)}; "
                    f"got {tensor.dtype.name}" + (f" for '{name}'" if name else "") + ". Cast it first "
                    "(complex numbers: reduce tf.math.real and tf.math.imag separately)"
                ),
            )


def _ops():
    return runtime.state().ops


def _scale(factor):
    return tf.convert_to_tensor(factor, tf.float64)


def _check_reduce_op(op, kind=_OpKind.ALLREDUCE, name=""):
    try:
        return ReduceOp(op)
    except ValueError:
        _fail(kind, name, ValueError(f"op must be one of kerasdist.Average, Sum, Min, Max, Product; got {op!r}"))


def _check_rank(value, argument, what, kind, name):
    """`value` as a rank of this job, or the error on every rank that makes the call."""
    size = runtime.state().size
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= value < size:
        _fail(
            kind,
            name,
            ValueError(
                f"kerasdist.{what}: {argument}={value!r} is not a rank of this job (an integer from 0 to {size - 1})"
            ),
        )
    return int(value)


@_not_autographed
def grouped_allreduce(
    tensors, op=Average, name=None, prescale_factor=1.0, postscale_factor=1.0, compression=Compression.none
):
    """Reduces a list of tensors across ranks as one negotiation unit.

    The tensors are ready together, so the small ones (up to 256 KiB) share fused MPI calls
    and come back as views of one buffer; larger ones are reduced in their own memory.

    Args:
      tensors: tensors of any supported numeric dtype; dtypes and shapes may differ.
      op: ``Average`` (default), ``Sum``, ``Min``, ``Max`` or ``Product``. Integers as in
        `allreduce`: an exact ``Average`` (the integer tensors of a group travel as int64, in a
        negotiation unit of their own), a ``Sum`` that wraps on overflow.
      name: optional name, equal on every rank; by default one is derived per call.
      prescale_factor: multiplies each input before the reduction (floats only).
      postscale_factor: multiplies each result after it (floats only).
      compression: the wire format of the float32 and float64 tensors: ``Compression.none``
        (default), ``.fp16`` or ``.bf16`` for all of them, or a list of one for each tensor, in
        the order of ``tensors`` (a 16-bit or integer tensor travels as it is, whatever its
        entry). Results come back in each tensor's own dtype. Every rank must pass the same.

    Returns:
      A list of tensors of the same shapes and dtypes.

    Example:

    ```python
    import tensorflow as tf, kerasdist
    kerasdist.init()
    a, b = kerasdist.grouped_allreduce([tf.ones(2), tf.zeros(3)], op=kerasdist.Sum)
    print(float(a[0]) == kerasdist.size())  # True
    # Per tensor: the first in bfloat16 (8 bits of precision), the second exactly.
    near, exact = kerasdist.grouped_allreduce(
        [tf.constant([1.001]), tf.constant([1.001])],
        compression=[kerasdist.Compression.bf16, kerasdist.Compression.none],
    )
    print(float(near[0]), round(float(exact[0]), 6))  # 1.0 1.001
    ```
    """
    _refuse_xla("kerasdist.grouped_allreduce")
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    if not tensors:
        return []
    name = _tensor_name("allreduce", name)
    op = _check_reduce_op(op, _OpKind.ALLREDUCE, name)
    _check_dtypes("allreduce", _OpKind.ALLREDUCE, name, tensors, _REDUCIBLE_DTYPES)
    compressions = _compression_of_each(compression, len(tensors), name)
    if op == Sum and any(t.dtype in _SUMMED_AS_INT32 for t in tensors):
        widened = [tf.cast(t, tf.int32) if t.dtype in _SUMMED_AS_INT32 else t for t in tensors]
        summed = _submit_allreduce(widened, op, name, prescale_factor, postscale_factor, compressions)
        return [tf.cast(out, t.dtype) if out.dtype != t.dtype else out for out, t in zip(summed, tensors)]
    integers = [i for i, t in enumerate(tensors) if t.dtype.is_integer] if op == Average else []
    if not integers:
        return _submit_allreduce(tensors, op, name, prescale_factor, postscale_factor, compressions)
    others = [i for i in range(len(tensors)) if i not in integers]
    results = [None] * len(tensors)
    # The integers go first: their scale factors are refused (as for any integer tensor) before
    # the rest of the group is sent.
    parts = [_integer_average_parts(tensors[i]) for i in integers] + [tf.ones([1], tf.int64)]
    *sums, contributors = _submit_allreduce(
        parts, Sum, f"{name}.integers" if others else name, prescale_factor, postscale_factor
    )
    for i, summed in zip(integers, sums):
        results[i] = _truncated_mean(summed, contributors[0], tensors[i].dtype)
    if others:
        reduced = _submit_allreduce(
            [tensors[i] for i in others],
            op,
            name,
            prescale_factor,
            postscale_factor,
            [compressions[i] for i in others],
        )
        for i, out in zip(others, reduced):
            results[i] = out
    return results


_COMPRESSIONS = (Compression.none, Compression.fp16, Compression.bf16)
# 8-bit sums travel as int32 and wrap in grouped_allreduce, as NumPy's do: Open MPI 4.1's
# vectorised MPI_SUM saturates int8 (100 + 100 gave 127) where MPICH's wraps.
_SUMMED_AS_INT32 = (tf.int8, tf.uint8)


def _compression_of_each(compression, count, name):
    """`grouped_allreduce`'s `compression` as a list of one wire format per tensor, or the error
    on every rank that makes the call."""
    compressions = list(compression) if isinstance(compression, (list, tuple)) else [compression] * count
    if len(compressions) != count or not all(any(c is known for known in _COMPRESSIONS) for c in compressions):
        _fail(
            _OpKind.ALLREDUCE,
            name,
            ValueError(
                f"kerasdist.grouped_allreduce of {count} tensor(s) ('{name}'): compression= takes "
                f"kerasdist.Compression.none, .fp16 or .bf16, or a list of one of those for each tensor; "
                f"got {compression!r}"
            ),
        )
    return compressions


def _submit_allreduce(tensors, op, name, prescale_factor, postscale_factor, compressions=()):
    """One allreduce op for `tensors`, `compressions[i]` the wire format of `tensors[i]` (none
    past its end). The op compresses a prefix of its inputs: the compressed tensors go in first,
    each group in its own order, and the results come back in the order of `tensors`."""
    wire = [c._engine_dtype for c in compressions] + [None] * (len(tensors) - len(compressions))
    order = sorted(range(len(tensors)), key=lambda i: wire[i] is None)
    reduced = _ops().kerasdist_allreduce(
        [tensors[i] for i in order],
        _scale(prescale_factor),
        _scale(postscale_factor),
        tensor_name=name,
        reduce_op=int(op),
        blocking=tf.executing_eagerly(),
        wire_dtypes=[wire[i] for i in order if wire[i] is not None],
        execution=_execution(),
    )
    results = [None] * len(tensors)
    for i, out in zip(order, reduced):
        results[i] = out
    return results


# Integer Average. Summed in its own dtype, a sum of n values can wrap before the divide (int8
# [100] and [100] gave -28), so an integer tensor travels as a Sum of int64 parts that cannot
# overflow, divided here: exact for every integer dtype. Narrower types widen to int64 (their sum
# fits for any number of ranks); int64 splits into its signed high and unsigned low 32 bits, whose
# sums fit for up to 2**30 ranks. An allreduce also sums a 1 from every rank: the number of ranks
# whose data went in, which join() makes smaller than size() while a rank has joined.
_HALF = 2**32


def _integer_average_parts(tensor):
    """The int64 tensor whose Sum over ranks gives the exact sum of `tensor`'s values."""
    if tensor.dtype != tf.int64:
        return tf.cast(tensor, tf.int64)
    high = tf.bitwise.right_shift(tensor, 32)  # arithmetic: keeps the sign
    low = tf.bitwise.bitwise_and(tensor, _HALF - 1)
    return tf.stack([high, low], axis=-1)


def _truncated_mean(summed, count, dtype):
    """`trunc(sum / count)` as `dtype`, from the Sum over `count` ranks of `_integer_average_parts`:
    rounded toward zero, as TensorFlow's integer division does."""
    if dtype != tf.int64:
        return tf.cast(tf.truncatediv(summed, count), dtype)
    # sum = high * 2**32 + low, with 0 <= low < count * 2**32. Dividing high first keeps every
    # intermediate within int64: sum // count = (high // count) * 2**32 + rest // count.
    high, low = summed[..., 0], summed[..., 1]
    high_quotient = tf.math.floordiv(high, count)
    rest = (high - high_quotient * count) * _HALF + low
    rest_quotient = tf.math.floordiv(rest, count)
    floor = high_quotient * _HALF + rest_quotient
    # A negative sum that count does not divide was rounded down: one up rounds it toward zero.
    return floor + tf.cast((floor < 0) & (rest - rest_quotient * count != 0), tf.int64)


@_not_autographed
def allreduce(tensor, op=Average, name=None, prescale_factor=1.0, postscale_factor=1.0, compression=Compression.none):
    """Reduces ``tensor`` across ranks; every rank gets the result.

    ``Average`` divides the sum by ``size()``. On integer tensors it is exact: the mean rounded
    toward zero (as TensorFlow's integer division rounds), with no overflow even at the dtype's
    limits; the tensor travels as int64 for that (twice that for int64). ``Sum`` and ``Product``
    of integers wrap around on overflow, as NumPy's do (int8: 100 + 100 is -56): cast to a wider
    dtype first if the result may not fit. An ``IndexedSlices`` (an embedding gradient) is
    gathered instead of densified.

    Example:

    ```python
    import tensorflow as tf, kerasdist
    kerasdist.init()
    total = kerasdist.allreduce(tf.constant([1.0, 2.0]), op=kerasdist.Sum)
    print(total.numpy().tolist() == [kerasdist.size() * 1.0, kerasdist.size() * 2.0])  # True
    ```
    """
    if isinstance(tensor, tf.IndexedSlices):
        return _allreduce_indexed_slices(
            tensor, _check_reduce_op(op), name, prescale_factor * postscale_factor, compression
        )
    return grouped_allreduce([tensor], op, name, prescale_factor, postscale_factor, compression)[0]


def _allreduce_indexed_slices(slices, op, name, scale, compression):
    if op not in (Sum, Average):
        raise ValueError("IndexedSlices can only be reduced with Sum or Average")
    if slices.values.dtype.is_integer and (op == Average or scale != 1.0):
        # Each row would be divided by itself (cast(1/size) is 0): the sum of rows, not the mean.
        raise ValueError(
            f"allreduce of integer IndexedSlices ({slices.values.dtype.name}) with "
            f"{'Average' if op == Average else 'a scale factor'}: its rows are gathered, not summed, so "
            "they cannot be divided exactly. Pass tf.convert_to_tensor(slices) for an exact integer "
            "Average, or use op=kerasdist.Sum."
        )
    values, original = compression.compress(slices.values)
    values = compression.decompress(allgather(values, name=name and f"{name}.values"), original)
    indices = allgather(slices.indices, name=name and f"{name}.indices")
    if op == Average:
        scale = scale / runtime.state().size
    values = values * tf.cast(scale, values.dtype)
    return tf.IndexedSlices(values, indices, dense_shape=slices.dense_shape)


@_not_autographed
def allgather(tensor, name=None):
    """Concatenates every rank's ``tensor`` along dim 0, in rank order.

    The first dimension may differ between ranks; the others must match.

    Example:

    ```python
    import tensorflow as tf, kerasdist
    kerasdist.init()
    rows = kerasdist.allgather(tf.fill([kerasdist.rank() + 1, 2], kerasdist.rank()))
    print(int(rows.shape[0]) == kerasdist.size() * (kerasdist.size() + 1) // 2)  # True
    ```
    """
    _refuse_xla("kerasdist.allgather")
    tensor = tf.convert_to_tensor(tensor)
    name = _tensor_name("allgather", name)
    _check_dtypes("allgather", _OpKind.ALLGATHER, name, [tensor], _MOVABLE_DTYPES)
    return _ops().kerasdist_allgather(tensor, tensor_name=name, blocking=tf.executing_eagerly(), execution=_execution())


def _member_names(kind, name, count):
    """One name per tensor of a grouped call: the group's name (given, or derived from the
    caller's line) with the tensor's position, so every rank pairs the same members."""
    base = _tensor_name(kind, name)
    return [f"{base}.{i}" for i in range(count)]


@_not_autographed
def grouped_allgather(tensors, name=None):
    """`allgather` of each tensor of a list, submitted together.

    Inside a `tf.function` the gathers are negotiated and run as the engine receives them, in
    one cycle when they are ready together; eagerly they run one after another.

    Example:

    ```python
    import tensorflow as tf, kerasdist
    kerasdist.init()
    rows, labels = kerasdist.grouped_allgather([tf.ones([2, 3]), tf.zeros([2], tf.int32)])
    n = 2 * kerasdist.size()
    print(rows.shape.as_list() == [n, 3], labels.shape.as_list() == [n])  # True True
    ```
    """
    tensors = list(tensors)
    return [allgather(t, name=n) for t, n in zip(tensors, _member_names("allgather", name, len(tensors)))]


@_not_autographed
def broadcast(tensor, root_rank, name=None):
    """Every rank receives ``root_rank``'s ``tensor`` (same shape and dtype on all ranks).

    Example:

    ```python
    import tensorflow as tf, kerasdist
    kerasdist.init()
    print(int(kerasdist.broadcast(tf.constant(kerasdist.rank()), root_rank=0)))  # 0
    ```
    """
    _refuse_xla("kerasdist.broadcast")
    tensor = tf.convert_to_tensor(tensor)
    name = _tensor_name("broadcast", name)
    _check_dtypes("broadcast", _OpKind.BROADCAST, name, [tensor], _MOVABLE_DTYPES)
    if isinstance(root_rank, bool) or not isinstance(root_rank, (int, np.integer)):
        _fail(_OpKind.BROADCAST, name, TypeError(f"kerasdist.broadcast: root_rank={root_rank!r} must be an integer"))
    # Its range is the engine's check, on every rank alike.
    return _ops().kerasdist_broadcast(
        tensor, tensor_name=name, root_rank=int(root_rank), blocking=tf.executing_eagerly(), execution=_execution()
    )


_PACK_BELOW_BYTES = 64 * 1024


@_not_autographed
def broadcast_variables(variables, root_rank=0):
    """Assigns ``root_rank``'s values to ``variables`` on every rank, in place.

    Small variables (biases, normalisation parameters, optimizer counters: most of a model's
    variables by count) travel packed, one broadcast per dtype; each large one goes on its own,
    which avoids copying it into a buffer.

    Example:

    ```python
    import tensorflow as tf, kerasdist
    kerasdist.init()
    v = tf.Variable(float(kerasdist.rank()))
    kerasdist.broadcast_variables([v], root_rank=0)
    print(float(v.numpy()))  # 0.0
    ```
    """
    small_by_dtype = {}
    for variable in variables:
        value = tf.convert_to_tensor(variable)
        if value.shape.num_elements() * value.dtype.size >= _PACK_BELOW_BYTES:
            variable.assign(broadcast(value, root_rank))
        else:
            small_by_dtype.setdefault(value.dtype, []).append((variable, value))
    for group in small_by_dtype.values():
        packed = broadcast(tf.concat([tf.reshape(value, [-1]) for _, value in group], axis=0), root_rank)
        parts = tf.split(packed, [value.shape.num_elements() for _, value in group])
        for (variable, value), part in zip(group, parts):
            variable.assign(tf.reshape(part, value.shape))


@_not_autographed
def reducescatter(tensor, op=Average, name=None, prescale_factor=1.0, postscale_factor=1.0):
    """Reduces across ranks, then rank r keeps its dim-0 shard of the result.

    Rank r gets ``n // size + (1 if r < n % size else 0)`` rows: lower ranks take the remainder.
    Integers as in `allreduce`: an exact ``Average``, a ``Sum`` that wraps on overflow.

    Example:

    ```python
    import tensorflow as tf, kerasdist
    kerasdist.init()
    shard = kerasdist.reducescatter(tf.ones([kerasdist.size() * 2, 3]), op=kerasdist.Sum)
    print(shard.shape.as_list())  # [2, 3]
    ```
    """
    _refuse_xla("kerasdist.reducescatter")
    tensor = tf.convert_to_tensor(tensor)
    name = _tensor_name("reducescatter", name)
    op = _check_reduce_op(op, _OpKind.REDUCESCATTER, name)
    _check_dtypes("reducescatter", _OpKind.REDUCESCATTER, name, [tensor], _REDUCIBLE_DTYPES)
    # A scalar goes as it is, for the engine to refuse (int64 parts would have a dimension).
    exact_integer_average = op == Average and tensor.dtype.is_integer and tensor.shape.rank != 0
    scattered = _ops().kerasdist_reducescatter(
        _integer_average_parts(tensor) if exact_integer_average else tensor,
        _scale(prescale_factor),
        _scale(postscale_factor),
        tensor_name=name,
        reduce_op=int(Sum if exact_integer_average else op),
        blocking=tf.executing_eagerly(),
        execution=_execution(),
    )
    if not exact_integer_average:
        return scattered
    # Every rank's data goes in: a reducescatter fails while a rank has joined.
    return _truncated_mean(scattered, tf.constant(runtime.state().size, tf.int64), tensor.dtype)


@_not_autographed
def grouped_reducescatter(tensors, op=Average, name=None, prescale_factor=1.0, postscale_factor=1.0):
    """`reducescatter` of each tensor of a list, submitted together (see `grouped_allgather`).

    Example:

    ```python
    import tensorflow as tf, kerasdist
    kerasdist.init()
    a, b = kerasdist.grouped_reducescatter([tf.ones([kerasdist.size(), 2]), tf.ones([kerasdist.size()])],
                                           op=kerasdist.Sum)
    print(a.numpy().tolist() == [[kerasdist.size()] * 2], b.shape.as_list())  # True [1]
    ```
    """
    tensors = list(tensors)
    return [
        reducescatter(t, op, n, prescale_factor, postscale_factor)
        for t, n in zip(tensors, _member_names("reducescatter", name, len(tensors)))
    ]


@_not_autographed
def alltoall(tensor, splits=None, name=None, return_received_splits=False):
    """Sends ``splits[j]`` rows of ``tensor`` to rank j; returns the rows received, in rank order.

    Without ``splits``, dim 0 must divide evenly by ``size()``. With
    ``return_received_splits=True`` it returns ``(rows, received_splits)``, where
    ``received_splits[j]`` (int32) is the number of rows that came from rank j: what a caller
    needs to send the rows back, and what Horovod's ``alltoall`` returns.

    Example:

    ```python
    import tensorflow as tf, kerasdist
    kerasdist.init()
    got = kerasdist.alltoall(tf.fill([kerasdist.size()], kerasdist.rank()))
    print(got.numpy().tolist() == list(range(kerasdist.size())))  # True
    # rank r sends r + 1 rows to every rank, so every rank receives j + 1 rows from rank j
    rows, received = kerasdist.alltoall(tf.zeros([kerasdist.size() * (kerasdist.rank() + 1)]),
                                        splits=[kerasdist.rank() + 1] * kerasdist.size(), return_received_splits=True)
    print(received.numpy().tolist() == list(range(1, kerasdist.size() + 1)))  # True
    ```
    """
    _refuse_xla("kerasdist.alltoall")
    output, received_splits = _alltoall(tensor, splits, name)
    return (output, received_splits) if return_received_splits else output


def _alltoall(tensor, splits, name):
    tensor = tf.convert_to_tensor(tensor)
    name = _tensor_name("alltoall", name)
    _check_dtypes("alltoall", _OpKind.ALLTOALL, name, [tensor], _MOVABLE_DTYPES)
    if splits is None:
        splits = tf.zeros([0], tf.int32)
    elif not _integer_splits(splits):
        _fail(
            _OpKind.ALLTOALL,
            name,
            TypeError(f"kerasdist.alltoall: splits must be integers (rows sent to each rank), got {splits!r}"),
        )
    return _ops().kerasdist_alltoall(
        tensor, tf.cast(splits, tf.int32), tensor_name=name, blocking=tf.executing_eagerly(), execution=_execution()
    )


def _integer_splits(splits):
    """True for integer tensors, and for lists and arrays of integers (a float that happens to be
    whole included, but not 2.9: truncating it would silently send other rows)."""
    if isinstance(splits, (tf.Tensor, tf.Variable)):
        return splits.dtype.is_integer
    values = np.asarray(splits)
    if values.dtype.kind in "iu":
        return True
    return values.dtype.kind == "f" and bool(np.all(np.isfinite(values) & (values == np.round(values))))


# Python objects travel pickled, as the bytes of a uint8 allgather: named and negotiated like
# every other collective, so an unmatched call fails as a mismatch instead of pairing with the
# next object collective of another rank. They run eagerly even while a tf.function is traced
# (tf.init_scope), once per trace, as Python code there does.


def _pickled(obj, name):
    try:
        return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as error:  # noqa: BLE001 - any pickling failure; the others must hear of it
        _fail(_OpKind.ALLGATHER, name, error)


def _allgather_bytes(payload, name, what):
    """The bytes of every rank's `payload`, for the object collective `what`, which travels as an
    allgather: the engine's errors name that allgather, so they are said again naming `what`."""
    try:
        gathered = _ops().kerasdist_allgather(
            tf.constant(np.frombuffer(payload, np.uint8)), tensor_name=name, blocking=True, execution=_execution()
        )
    except tf.errors.OpError as error:
        message = error.message.replace(f"allgather '{name}'", f"{what} '{name}'")
        raise type(error)(error.node_def, error.op, message) from None
    return gathered.numpy().tobytes()


@_not_autographed
def broadcast_object(obj, root_rank=0, name=None):
    """Returns ``root_rank``'s picklable ``obj`` on every rank (a collective, run eagerly).

    Every rank unpickles what ``root_rank`` sent: use it between the ranks of one job only.
    If ``root_rank`` cannot pickle ``obj``, it raises that error and every other rank raises
    ``tf.errors.InvalidArgumentError`` naming it.

    Example:

    ```python
    import kerasdist
    kerasdist.init()
    print(kerasdist.broadcast_object({"seed": 40 + kerasdist.rank()}, root_rank=0))  # {'seed': 40}
    ```
    """
    with tf.init_scope():
        name = _tensor_name("broadcast_object", name)
        root_rank = _check_rank(root_rank, "root_rank", "broadcast_object", _OpKind.ALLGATHER, name)
        is_root = runtime.state().rank == root_rank
        payload = _pickled(obj, name) if is_root else b""
        received = _allgather_bytes(payload, name, "broadcast_object")  # the root's bytes: the others send none
    return obj if is_root else pickle.loads(received)


_LENGTH = struct.Struct("<Q")  # each rank's pickle is preceded by its length


@_not_autographed
def allgather_object(obj, name=None):
    """Returns the list of every rank's picklable ``obj``, in rank order (a collective, run eagerly).

    Example:

    ```python
    import kerasdist
    kerasdist.init()
    print(kerasdist.allgather_object(kerasdist.rank()) == list(range(kerasdist.size())))  # True
    ```
    """
    with tf.init_scope():
        name = _tensor_name("allgather_object", name)
        payload = _pickled(obj, name)
        received = _allgather_bytes(_LENGTH.pack(len(payload)) + payload, name, "allgather_object")
    objects, offset = [], 0
    for _ in range(runtime.state().size):
        (length,) = _LENGTH.unpack_from(received, offset)
        offset += _LENGTH.size
        objects.append(pickle.loads(received[offset : offset + length]))
        offset += length
    return objects


@_not_autographed
def barrier(name=None):
    """Returns once every rank has called it.

    Example:

    ```python
    import kerasdist
    kerasdist.init()
    kerasdist.barrier()
    ```
    """
    _refuse_xla("kerasdist.barrier")
    _ops().kerasdist_allreduce(
        [tf.zeros([1], tf.int32)],
        _scale(1.0),
        _scale(1.0),
        tensor_name=_tensor_name("barrier", name),
        reduce_op=int(Sum),
        blocking=tf.executing_eagerly(),
        execution=_execution(),
    )


# The engine's StatusCode values (common.h) as TensorFlow errors.
_ERRORS = {
    1: tf.errors.InvalidArgumentError,
    2: tf.errors.FailedPreconditionError,
    3: tf.errors.AbortedError,
    4: tf.errors.DeadlineExceededError,
    5: tf.errors.InternalError,
}


def join():
    """Declares that this rank has no more data, and returns once every rank has called it.

    A rank whose data runs out first calls ``join()``. Until every rank has joined, the joined
    ranks take part in the other ranks' allreduces with zeros, so those ranks keep training:

    - ``Sum`` adds the values of the ranks that submitted the allreduce;
    - ``Average`` divides that sum by the number of those ranks (not by ``size()``), so averaged
      gradients stay averages over the batches actually seen (integers truncate, as always).
      Horovod divides by ``size()``; ``op=Sum, postscale_factor=1 / size()`` gives its rule;
    - ``Min``, ``Max`` and ``Product``, and every other collective (allgather, broadcast,
      alltoall, reducescatter, the object collectives) fail with
      ``tf.errors.FailedPreconditionError`` naming the op and the joined ranks on every rank that
      called them: a joined rank has nothing to contribute to them.

    Once every rank has joined, nobody is joined any more: call it again at the end of the
    next epoch. It also restarts the per-line counts that name unnamed eager collectives, which
    differ between ranks that ran different numbers of steps. Eager only: inside a
    ``tf.function`` it raises ``RuntimeError``.

    Returns:
      The rank that joined last, as an int (the same on every rank).

    Example:

    ```python
    import tensorflow as tf, kerasdist
    kerasdist.init()
    for step in range(kerasdist.rank() + 1):  # rank r has r + 1 batches
        total = kerasdist.allreduce(tf.constant(1.0), op=kerasdist.Sum)
    last = kerasdist.join()
    print(last == kerasdist.size() - 1)  # True
    print(float(total) == kerasdist.size() - kerasdist.rank())  # True
    ```
    """
    if not tf.executing_eagerly():
        raise RuntimeError(
            "kerasdist.join() runs eagerly only: call it outside tf.function, after this rank's last step"
        )
    state = runtime.state()
    last = ctypes.c_int(-1)
    error = ctypes.create_string_buffer(2048)
    code = state.engine.kerasdist_join(ctypes.byref(last), error, len(error))
    if code:
        raise _ERRORS.get(code, tf.errors.UnknownError)(None, None, error.value.decode(errors="replace"))
    # Every rank is past its last step: unnamed eager calls pair up by their count again.
    with _calls_per_site_lock:
        _calls_per_site.clear()
    return int(last.value)


# Gradients. With loss = sum over ranks of loss_r, each rank's input feeds every rank's output.


@tf.RegisterGradient("KerasdistAllreduce")
def _allreduce_grad(op, *grads):
    reduce_op = ReduceOp(op.get_attr("reduce_op"))
    if reduce_op not in (Sum, Average):
        raise ValueError(f"kerasdist.allreduce with op={reduce_op.name} has no gradient; use Sum or Average")
    prescale, postscale = op.inputs[-4:-2]  # inputs end with prescale, postscale, name, execution
    summed = grouped_allreduce(list(grads), reduce_op, prescale_factor=prescale, postscale_factor=postscale)
    return summed + [None, None, None, None]


@tf.RegisterGradient("KerasdistAllgather")
def _allgather_grad(op, grad):
    summed = allreduce(grad, op=Sum)
    rows = allgather(tf.shape(op.inputs[0], out_type=tf.int64)[:1])
    rank = runtime.state().rank
    start = tf.reduce_sum(rows[:rank])
    return [summed[start : start + rows[rank]], None, None]


@tf.RegisterGradient("KerasdistBroadcast")
def _broadcast_grad(op, grad):
    summed = allreduce(grad, op=Sum)
    if runtime.state().rank != op.get_attr("root_rank"):
        summed = tf.zeros_like(summed)
    return [summed, None, None]


@tf.RegisterGradient("KerasdistReducescatter")
def _reducescatter_grad(op, grad):
    reduce_op = ReduceOp(op.get_attr("reduce_op"))
    if reduce_op not in (Sum, Average):
        raise ValueError(f"kerasdist.reducescatter with op={reduce_op.name} has no gradient; use Sum or Average")
    scale = op.inputs[1] * op.inputs[2]
    if reduce_op == Average:
        scale /= runtime.state().size
    gathered = allgather(grad)
    return [gathered * tf.cast(scale, gathered.dtype), None, None, None, None]


@tf.RegisterGradient("KerasdistAlltoall")
def _alltoall_grad(op, grad, _):
    returned, _ = _alltoall(grad, op.outputs[1], None)
    return [returned, None, None, None]
