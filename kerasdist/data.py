"""Per-rank input: data shards, per-rank seeds and equal step counts.

Every rank must run the same number of training steps per epoch: each step allreduces the
gradients, so a rank with one extra batch waits for partners that never come. Shards of
unequal size are fine (1797 examples on 2 ranks are 899 + 898) as long as they batch into
the same number of steps; `shard(..., batch_size=...)` and `check_equal_steps` check that
and fail on every rank with the counts and the fixes instead of hanging.

A TensorFlow Datasets split is loaded per rank with `tfds_load`: each rank reads its own
record files, as TFDS intends for several input pipelines, and every rank gets the same
number of steps. Nothing is downloaded: the data set must already be prepared in `data_dir`.
"""

import math
import operator
import os

import keras
import tensorflow as tf

from kerasdist import _compat, ops, runtime

# Odd, so `rank * stride` is distinct modulo 2**32 for every rank; large, so nearby base
# seeds (0, 1, 2, ...) do not hand one run's rank-0 seed to another run's rank 1.
_RANK_SEED_STRIDE = 1_000_003


def _rank_and_size():
    state = runtime.state()  # starts kerasdist if needed; init() is idempotent
    return state.rank, state.size


def shard(data, *, drop_remainder=False, batch_size=None):
    """Returns this rank's share of `data`: elements `rank, rank + size, rank + 2*size, ...`.

    `data` is a `tf.data.Dataset` (sharded with `Dataset.shard(size, rank)`) or NumPy arrays:
    one array, or a tuple, list or dict of arrays with the same number of rows, of which every
    array keeps the same rows. The two agree: an array and `Dataset.from_tensor_slices` of it
    shard into the same elements. Every rank must pass the same data. With one process the
    data comes back unchanged.

    Without `drop_remainder`, the first `n % size` ranks get one element more than the others.
    That is fine as long as every rank still runs the same number of steps: give `batch_size`
    to have it checked.

    A dataset must give its elements in the same order on every rank up to the shard, or the
    shards overlap and leave elements out. `shard` refuses a dataset in which, before the shard,
    a `shuffle` or `Dataset.random` has no seed (as `Dataset.list_files` shuffles by default,
    and `Dataset.sample_from_datasets` draws), a parallel `map`, `interleave` or `batch` has
    `deterministic=False` (or `tf.data.Options.deterministic` is False), or a `filter` draws
    unseeded random numbers; with several ranks, also random steps seeded differently on each
    rank (by `seed_for_rank`, or after `set_random_seed_for_rank`): comparing their seeds makes
    `shard` a collective whenever a seeded random step comes before it. Shard first, then
    shuffle. A seed given to the step, or a global seed set alike on every rank
    (`tf.random.set_seed`) before the pipeline is built, passes.

    Args:
        data: A `tf.data.Dataset`, a NumPy array, or a tuple, list or dict of NumPy arrays.
        drop_remainder: Whether to drop the last `n % size` elements so that every rank gets
            exactly `n // size`. For a dataset of unknown cardinality (after `filter`, or read
            from files) this groups the elements into windows of `size`, which costs more per
            element than `Dataset.shard`; an infinite dataset has no remainder to drop.
        batch_size: The per-rank batch size the shard will be batched with, keeping the last
            partial batch (the default of `Model.fit` and `Dataset.batch`). When given,
            `shard` checks with `check_equal_steps` that every rank gets the same number of
            batches and raises `ValueError` on every rank otherwise; it is then a collective
            that every rank must call. Datasets of unknown or infinite cardinality are not
            checked. If you batch with `drop_remainder=True`, shard with
            `drop_remainder=True` too: equal shards give equal steps under either rule.

    Returns:
        This rank's shard, of the same kind as `data`.

    Raises:
        ValueError: If the arrays have different numbers of rows, if the dataset's order before
            the shard may differ by rank (naming the step and the fix), or (with `batch_size`)
            the ranks would run different numbers of steps.

    Example:

    ```python
    import numpy as np
    import tensorflow as tf
    import kerasdist

    x, y = np.arange(20.0).reshape(10, 2), np.arange(10)
    x_shard, y_shard = kerasdist.data.shard((x, y), batch_size=4)
    dataset = kerasdist.data.shard(tf.data.Dataset.from_tensor_slices((x, y)), batch_size=4)
    # With 2 ranks, rank 1 gets rows 1, 3, 5, 7, 9 both ways.
    ```
    """
    rank, size = _rank_and_size()
    if isinstance(data, tf.data.Dataset):
        _check_same_order_on_every_rank(data, size)
        sharded, rank_elements = _shard_dataset(data, rank, size, drop_remainder)
    else:
        sharded, rank_elements = _shard_arrays(data, rank, size, drop_remainder)
    if batch_size is not None and rank_elements is not None:
        check_equal_steps(steps_per_epoch(rank_elements, batch_size), what=f"batches of {batch_size} per epoch")
    return sharded


def _check_same_order_on_every_rank(dataset, size):
    """Raises ValueError on every rank if, before the shard, `dataset` may give its elements in
    another order (or other elements) on each rank: each rank would then take its every size-th
    element of another sequence, so the shards would overlap and leave elements out, silently.

    What may differ is found in the pipeline itself: random steps without a seed, parallel steps
    allowed to reorder, a filter that draws unseeded random numbers. Seeded random steps are
    compared across ranks (a collective, made only when there are some: the pipeline, and so the
    decision, is the same on every rank), since a seed can differ by rank too.
    """
    causes, seeds = _order_dependencies(dataset)
    if causes:
        raise ValueError(
            "kerasdist.data.shard: before the shard, this dataset can give its elements in a different "
            "order (or different elements) on each rank, so the ranks' shards would overlap and leave "
            f"elements out, without an error. It has {'; '.join(causes)}. Shard first and shuffle the "
            "shard (kerasdist.data.shard(dataset).shuffle(...), seeded per rank with "
            "kerasdist.data.seed_for_rank if you like), or make the steps before the shard "
            "deterministic as said."
        )
    if size == 1 or not seeds:
        return
    every_rank = ops.allgather_object(seeds)
    if all(theirs == seeds for theirs in every_rank):
        return
    listing = "; ".join(
        f"rank {rank}: " + ", ".join(f"{what} seeds {seed}, {seed2}" for what, seed, seed2 in theirs)
        for rank, theirs in enumerate(every_rank)
    )
    raise ValueError(
        "kerasdist.data.shard: the random steps before the shard are seeded differently on each rank, "
        "so each rank would take its shard from another order of the elements and the shards would "
        f"overlap and leave elements out ({listing}). Seed them alike on every rank: not with "
        "kerasdist.data.seed_for_rank (it is for after the shard), and not after "
        "kerasdist.data.set_random_seed_for_rank, which sets a different global seed on each rank "
        "(tf.data derives its seeds from it). Or shard first and shuffle after."
    )


# Ops of datasets built inside a tf.data function (say an interleave's), by type: what the user
# called, and the position of its `seed` input (`seed2` follows it).
_RANDOM_DATASET_OPS = {
    "ShuffleDataset": ("Dataset.shuffle", 2),
    "ShuffleDatasetV3": ("Dataset.shuffle", 2),
    "ShuffleAndRepeatDataset": ("Dataset.shuffle", 2),
    "ShuffleAndRepeatDatasetV2": ("Dataset.shuffle", 2),
    "RandomDataset": ("Dataset.random", 0),
    "RandomDatasetV2": ("Dataset.random", 0),
    "GlobalShuffleDataset": ("tf.data.experimental.global_shuffle", 1),
}
_PARALLEL_DATASET_OPS = {
    "ParallelMapDatasetV2": "Dataset.map",
    "ParallelInterleaveDatasetV4": "Dataset.interleave",
    "ParallelBatchDataset": "Dataset.batch",
    "ParallelFilterDataset": "Dataset.filter",
    "LegacyParallelInterleaveDatasetV2": "tf.data.experimental.parallel_interleave",
}
# Stateful random ops: with seed and seed2 attributes both 0, each run draws afresh.
_RANDOM_OPS = frozenset(
    [
        "RandomUniform",
        "RandomUniformInt",
        "RandomStandardNormal",
        "TruncatedNormal",
        "Multinomial",
        "RandomShuffle",
        "RandomGamma",
        "RandomPoisson",
        "RandomPoissonV2",
    ]
)


def _unseeded(transformation):
    fix = "give it seed=, the same on every rank, or call tf.random.set_seed alike on every rank before building it"
    if transformation == "Dataset.shuffle":
        fix += "; Dataset.list_files shuffles this way unless given shuffle=False or seed="
    elif transformation == "Dataset.random":
        fix += "; Dataset.sample_from_datasets draws from one unless given seed="
    return f"{transformation} without a seed ({fix})"


def _reordering(transformation):
    return f"{transformation} with deterministic=False (leave it out: the default keeps the order)"


_RANDOM_FILTER = (
    "a Dataset.filter whose predicate draws unseeded random numbers (it keeps other elements on each "
    "rank: seed the draw alike on every rank, or filter after the shard)"
)


def _order_dependencies(dataset):
    """What in `dataset` and the datasets it reads from can give elements in another order on each
    rank (phrases naming the step and its fix), and every seeded random step as
    `(transformation, seed, seed2)`, in the pipeline's order."""
    causes, seeds = [], []
    if dataset.options().deterministic is False:
        causes.append(
            "tf.data.Options.deterministic = False (it lets every parallel step reorder elements: "
            "leave it at its default)"
        )
    pending, seen = [dataset], set()
    while pending:
        step = pending.pop()
        if id(step) in seen:  # a dataset read twice (a zip of it with itself)
            continue
        seen.add(id(step))
        random = _compat.dataset_random_seeds(step)
        if random is not None:
            if random[1:] == (0, 0):
                causes.append(_unseeded(random[0]))
            else:
                seeds.append(random)
        parallel = _compat.dataset_determinism(step)
        if parallel is not None and parallel[1] == "false":
            causes.append(_reordering(parallel[0]))
        for graph in _compat.dataset_function_graphs(step):
            graph_def = graph.as_graph_def()
            _order_dependencies_in_graph(graph_def, causes, seeds)
            if _compat.is_filter(step) and _draws_unseeded(graph_def.node):
                causes.append(_RANDOM_FILTER)
        pending.extend(reversed(_compat.dataset_inputs(step)))
    return list(dict.fromkeys(causes)), seeds


def _order_dependencies_in_graph(graph_def, causes, seeds):
    """`_order_dependencies` for the datasets built inside a tf.data function, from its graph and
    the functions it calls."""
    functions = {function.signature.name: function.node_def for function in graph_def.library.function}
    for nodes in [graph_def.node, *functions.values()]:
        by_name = {node.name: node for node in nodes}
        for node in nodes:
            if node.op in _RANDOM_DATASET_OPS:
                transformation, position = _RANDOM_DATASET_OPS[node.op]
                seed, seed2 = (_constant(by_name, node.input[position + i]) for i in (0, 1))
                if (seed, seed2) == (0, 0):
                    causes.append(_unseeded(transformation))
                else:
                    seeds.append((transformation, seed, seed2))
            elif node.op in _PARALLEL_DATASET_OPS and node.attr["deterministic"].s == b"false":
                causes.append(_reordering(_PARALLEL_DATASET_OPS[node.op]))
            elif node.op == "FilterDataset" and _draws_unseeded(functions.get(node.attr["predicate"].func.name, [])):
                causes.append(_RANDOM_FILTER)


def _constant(by_name, input_name):
    """The int value of the Const node an input names (`name`, `name:0` or `name:output:0`); None
    for anything else."""
    node = by_name.get(input_name.lstrip("^").split(":")[0])
    if node is not None and node.op == "SelectV2":
        # tf.data's seed2 inside a function: where(seed == 0 and seed2 == 0, 2**31 - 1, seed2).
        # Its seed2 is what tells ranks apart.
        return _constant(by_name, node.input[2])
    if node is None or node.op != "Const":
        return None
    value = tf.make_ndarray(node.attr["value"].tensor)
    return int(value) if value.size == 1 else None


def _draws_unseeded(nodes):
    return any(node.op in _RANDOM_OPS and node.attr["seed"].i == 0 and node.attr["seed2"].i == 0 for node in nodes)


def _shard_dataset(dataset, rank, size, drop_remainder):
    """The shard and its number of elements (None when unknown or infinite)."""
    total = int(dataset.cardinality())
    if total < 0:  # tf.data.UNKNOWN_CARDINALITY or tf.data.INFINITE_CARDINALITY
        if drop_remainder and size > 1 and total == tf.data.UNKNOWN_CARDINALITY:
            dataset = _whole_windows(dataset, size)
        return dataset.shard(size, rank), None
    if drop_remainder:
        dataset = dataset.take(total // size * size)
        return dataset.shard(size, rank), total // size
    return dataset.shard(size, rank), len(range(rank, total, size))


def _whole_windows(dataset, size):
    """`dataset` without its last `n % size` elements, for a dataset whose n is unknown."""
    element_is_tuple = isinstance(dataset.element_spec, tuple)

    def rejoin(*window):
        # tf.data passes a tuple element's components as separate arguments.
        return tf.data.Dataset.zip(window if element_is_tuple else window[0])

    return dataset.window(size, drop_remainder=True).flat_map(rejoin)


def _shard_arrays(arrays, rank, size, drop_remainder):
    leaves = tf.nest.flatten(arrays)
    lengths = [len(leaf) for leaf in leaves]
    if len(set(lengths)) > 1:
        raise ValueError(
            f"kerasdist.data.shard: the arrays must have the same number of rows to be sharded together; got {lengths}"
        )
    total = lengths[0] if lengths else 0
    stop = total // size * size if drop_remainder else total
    rows = slice(rank, stop, size)  # strided like Dataset.shard, so the two agree
    return tf.nest.map_structure(lambda array: array[rows], arrays), len(range(rank, stop, size))


def steps_per_epoch(num_examples, batch_size, *, drop_remainder=False):
    """The number of batches of `batch_size` in `num_examples` examples.

    Args:
        num_examples: Non-negative int, the examples in one epoch (of one rank's shard).
        batch_size: Positive int.
        drop_remainder: Whether the last partial batch is dropped (as with
            `Dataset.batch(..., drop_remainder=True)`); by default it counts as a step, as in
            `Model.fit`.

    Example:

    ```python
    import kerasdist

    assert kerasdist.data.steps_per_epoch(899, 32) == 29
    assert kerasdist.data.steps_per_epoch(899, 32, drop_remainder=True) == 28
    ```
    """
    num_examples, batch_size = operator.index(num_examples), operator.index(batch_size)
    if num_examples < 0 or batch_size <= 0:
        raise ValueError(f"need num_examples >= 0 and batch_size > 0; got {num_examples} and {batch_size}")
    if drop_remainder:
        return num_examples // batch_size
    return math.ceil(num_examples / batch_size)


def check_equal_steps(steps, what="steps per epoch"):
    """Checks that every rank will run `steps` steps; a collective, every rank must call it.

    Ranks that ran different numbers of steps would pair one rank's gradient allreduce with
    another's next-epoch step, or wait for a partner that never comes. This compares the
    counts before training starts and raises the same error on every rank.

    Args:
        steps: Int, this rank's count.
        what: What is counted, for the error message.

    Returns:
        `steps`, the same on every rank.

    Raises:
        ValueError: On every rank, if the ranks' counts differ; the message lists each
            count with its ranks and how to make them equal.

    Example:

    ```python
    import kerasdist

    shard_size = 899 if kerasdist.rank() == 0 else 898  # e.g. 1797 examples on 2 ranks
    steps = kerasdist.data.check_equal_steps(kerasdist.data.steps_per_epoch(shard_size, 32))
    ```
    """
    counts = ops.allgather_object(steps)
    if len(set(counts)) == 1:
        return steps
    ranks_by_count = {}
    for rank, count in enumerate(counts):
        ranks_by_count.setdefault(count, []).append(rank)
    listing = "; ".join(
        f"{count} on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
        for count, ranks in ranks_by_count.items()
    )
    raise ValueError(
        f"kerasdist: the ranks would run different numbers of {what}: {listing}. Every rank must run "
        f"the same number, or the gradient allreduces pair up wrongly or hang. To fix: shard with "
        f"kerasdist.data.shard(..., drop_remainder=True) (every rank then gets n // size examples), "
        f"or repeat() the data and pass steps_per_epoch={min(counts)} to fit, or let fit run unequal "
        f"epochs with kerasdist.callbacks(uneven_steps=True) (the Join callback)."
    )


def seed_for_rank(base_seed):
    """A seed for this rank: `(base_seed + rank * 1_000_003) % 2**32`.

    Distinct on every rank and the same from run to run; rank 0 keeps `base_seed`, so a
    single-process run draws what the same script without kerasdist draws. Use it where ranks
    should differ: shuffling each rank's shard, random augmentation; not for a shuffle before
    `shard`, which must order the elements alike on every rank (`shard` refuses it).

    Args:
        base_seed: Int, the same on every rank.

    Example:

    ```python
    import tensorflow as tf
    import kerasdist

    dataset = kerasdist.data.shard(tf.data.Dataset.range(100))
    dataset = dataset.shuffle(50, seed=kerasdist.data.seed_for_rank(42))
    ```
    """
    rank, _ = _rank_and_size()
    return (operator.index(base_seed) + rank * _RANK_SEED_STRIDE) % 2**32


def set_random_seed_for_rank(base_seed):
    """`keras.utils.set_random_seed(seed_for_rank(base_seed))`: seeds Python's `random`,
    NumPy and the backend with this rank's seed, and returns that seed.

    Draws made after the call differ across ranks: shuffles, augmentation, the dropout masks
    of layers created after it, and the initial weights of models built after it. So do the
    seeds tf.data derives for a pipeline built after it, seeded or not: shuffle such a pipeline
    after `shard` only (`shard` refuses a random step before it). Broadcast
    those weights from rank 0 (kerasdist's broadcast callback in `fit`, or
    `kerasdist.broadcast_variables`) so that the replicas start equal.

    Args:
        base_seed: Int, the same on every rank.

    Example:

    ```python
    import keras
    import kerasdist

    kerasdist.data.set_random_seed_for_rank(7)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    kerasdist.broadcast_variables(model.weights, root_rank=0)  # equal replicas
    ```
    """
    seed = seed_for_rank(base_seed)
    keras.utils.set_random_seed(seed)
    return seed


def tfds_load(
    name,
    split,
    data_dir,
    *,
    batch_size=None,
    drop_remainder=False,
    shuffle_files=False,
    seed=0,
    as_supervised=False,
    decoders=None,
):
    """This rank's share of the TensorFlow Datasets split `split` of `name`, prepared in `data_dir`.

    A collective: every rank calls it with the same arguments. Nothing is downloaded: the data
    set must already be prepared in `data_dir` (`tfds.builder(name, data_dir=...)
    .download_and_prepare()` on a machine with network access; a data set written there loads
    by name even when its builder code is not importable).

    How the split is divided depends on its record files (`info.splits[split].num_shards`):

    * When their number is a multiple of the number of ranks, each rank reads whole files, as
      TFDS does for several input pipelines (`tfds.ReadConfig(input_context=...)`): rank `r`
      reads files `r, r + size, ...`. Files differ by at most one example, so the ranks' counts
      differ by at most one per file read.
    * Otherwise TFDS's own file sharding would give some ranks a whole file more than others
      (or, with fewer files than ranks, refuse with "Cannot shard the pipeline"), so each rank
      reads its 1/size of the examples instead (`tfds.even_splits`; counts differ by at most
      one), skipping to its first example in a shared file. The same happens when whole files
      would give the ranks different numbers of batches of `batch_size`.

    Every rank then runs the same number of steps under the rule of `shard`: with
    `drop_remainder`, each rank keeps as many examples as the smallest share; with
    `batch_size`, `check_equal_steps` raises on every rank if the batch counts differ. The
    returned dataset's cardinality is this rank's example count (TFDS leaves it unknown when
    it shards by file), so `Model.fit` knows the epoch's length.

    Unknown names, missing directories and splits, and data sets not prepared in `data_dir`
    raise `ValueError` on every rank, also when only some ranks cannot read the data.

    Args:
        name: The TFDS name, optionally with config and version (`"mnist"`, `"mnist:3.0.1"`).
        split: A split or sub-split (`"train"`, `"train[:90%]"`).
        data_dir: The directory the data set is prepared in.
        batch_size: The per-rank batch size the examples will be batched with (keeping the
            last partial batch); when given, the ranks' step counts are checked as in `shard`.
        drop_remainder: Whether every rank keeps only as many examples as the smallest share.
        shuffle_files: Whether each rank reads its files in a shuffled order, reshuffled every
            epoch. Examples are not shuffled: shuffle them after loading, with
            `seed_for_rank`.
        seed: Int, the same on every rank: the file order is shuffled with
            `seed_for_rank(seed)`, different on every rank and the same from run to run.
        as_supervised: Whether elements are `(input, label)` tuples (the data set's
            `supervised_keys`) instead of feature dicts.
        decoders: Passed to `tfds.core.DatasetBuilder.as_dataset` (custom feature decoding).

    Returns:
        A `tf.data.Dataset` of this rank's examples, unbatched.

    Raises:
        ValueError: On every rank, if some rank cannot load the split, or (with `batch_size`)
            the ranks would run different numbers of steps.

    Example:

    Rank 0 first writes a small data set, so that the example needs no network; yours is
    prepared once, before training. Every rank then reads its share, and together they read
    every example once.

    ```python
    import numpy as np
    import tensorflow as tf
    import tensorflow_datasets as tfds
    import kerasdist

    kerasdist.init()
    if kerasdist.rank() == 0:
        numbers = {"x": np.arange(12, dtype=np.float32), "y": np.arange(12) % 2}
        tfds.dataset_builders.store_as_tfds_dataset(
            name="twelve_numbers", version="1.0.0", data_dir="tfds",
            features=tfds.features.FeaturesDict({"x": np.float32, "y": np.int64}),
            split_datasets={"train": tf.data.Dataset.from_tensor_slices(numbers)},
        )
    kerasdist.barrier()
    train = kerasdist.data.tfds_load("twelve_numbers", "train", "tfds", batch_size=3, shuffle_files=True)
    print(sum(kerasdist.allgather_object(int(train.cardinality()))))  # 12
    train = train.shuffle(12, seed=kerasdist.data.seed_for_rank(0)).batch(3)
    mine = np.concatenate([batch["x"].numpy() for batch in train])
    print(sorted(np.concatenate(kerasdist.allgather_object(mine)).tolist()) == list(range(12)))  # True
    ```
    """
    rank, size = _rank_and_size()
    try:
        dataset, examples_per_rank = _tfds_rank_dataset(
            name, split, data_dir, rank, size, shuffle_files, seed, as_supervised, decoders, batch_size, drop_remainder
        )
        failure = None
    except Exception as error:  # gathered below, so that every rank raises and none waits
        dataset, failure = None, error
    _raise_on_every_rank_if_any_failed(
        failure, f"kerasdist.data.tfds_load({name!r}, {split!r}, data_dir={os.fspath(data_dir)!r})"
    )
    rank_examples = examples_per_rank[rank]
    if drop_remainder:
        rank_examples = min(examples_per_rank)
        dataset = dataset.take(rank_examples)
    if batch_size is not None:
        check_equal_steps(steps_per_epoch(rank_examples, batch_size), what=f"batches of {batch_size} per epoch")
    return dataset


def _tfds_rank_dataset(
    name, split, data_dir, rank, size, shuffle_files, seed, as_supervised, decoders, batch_size, drop_remainder
):
    """This rank's dataset and the number of examples of every rank."""
    try:
        import tensorflow_datasets as tfds  # optional: only this function needs it
    except ImportError as error:
        raise ImportError("tensorflow-datasets is not installed: pip install tensorflow-datasets") from error
    if not os.path.isdir(data_dir):
        raise ValueError(f"data_dir {os.fspath(data_dir)!r} is not a directory")
    try:
        builder = tfds.builder(name, data_dir=os.fspath(data_dir), try_gcs=False)
    except tfds.core.registered.DatasetNotFoundError as error:
        # TFDS appends every data set it knows by code; the first line is the news.
        raise ValueError(
            f"{str(error).splitlines()[0]} It is neither prepared in data_dir nor importable as a TFDS builder."
        ) from None
    if not builder.is_prepared():
        raise ValueError(
            f"{name!r} is not prepared in data_dir (nothing is downloaded here): prepare it with "
            f"tfds.builder({name!r}, data_dir=...).download_and_prepare() and copy it there"
        )
    files = builder.info.splits[split].file_instructions  # raises ValueError for an unknown split
    # TFDS deals the files out as Dataset.shard does: rank r reads files r, r + size, ...
    examples_per_rank = [sum(file.take for file in files[r::size]) for r in range(size)]
    by_whole_files = len(files) >= size and len(files) % size == 0
    if by_whole_files and batch_size is not None and not drop_remainder:
        # A few examples more on one rank can be one batch more; shares by example cannot be.
        by_whole_files = len({steps_per_epoch(examples, batch_size) for examples in examples_per_rank}) == 1
    if by_whole_files:
        rank_split = split
        input_context = tf.distribute.InputContext(num_input_pipelines=size, input_pipeline_id=rank)
    else:
        rank_splits = tfds.even_splits(split, n=size)
        rank_split, input_context = rank_splits[rank], None
        examples_per_rank = [builder.info.splits[part].num_examples for part in rank_splits]
    read_config = tfds.ReadConfig(input_context=input_context, shuffle_seed=seed_for_rank(seed))
    dataset = builder.as_dataset(
        split=rank_split,
        shuffle_files=shuffle_files,
        read_config=read_config,
        as_supervised=as_supervised,
        decoders=decoders,
    )
    return dataset.apply(tf.data.experimental.assert_cardinality(examples_per_rank[rank])), examples_per_rank


def _raise_on_every_rank_if_any_failed(failure, what):
    """A collective: raises on every rank when `failure` (an exception or None) is set on any."""
    failures = ops.allgather_object(None if failure is None else f"{type(failure).__name__}: {failure}")
    if not any(failures):
        return
    ranks_by_failure = {}
    for rank, message in enumerate(failures):
        if message is not None:
            ranks_by_failure.setdefault(message, []).append(rank)
    listing = "; ".join(
        f"on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: {message}"
        for message, ranks in ranks_by_failure.items()
    )
    raise ValueError(f"{what} failed {listing}") from failure
