"""kerasdist.data: shards, equal step counts and per-rank seeds, at any world size.

Every rank runs every test; expectations are written in terms of RANK and SIZE and computed
without kerasdist.data (element i belongs to rank i % SIZE), and allgather_object lets each
rank check the union of all shards.
"""

import os
import random
import re

import numpy as np
import pytest
import tensorflow as tf

import kerasdist as kd
from kerasdist import data

kd.init()
RANK, SIZE = kd.rank(), kd.size()

needs_two_ranks = pytest.mark.skipif(SIZE < 2, reason="needs at least 2 ranks (run under mpiexec -n 2)")
EXAMPLE_COUNTS = [0, 1, 7, 12, 1797]


def expected_rows(n, drop_remainder=False):
    """Rows of this rank when n rows are dealt out one at a time in rank order."""
    kept = n - n % SIZE if drop_remainder else n
    return [i for i in range(kept) if i % SIZE == RANK]


def dataset_elements(dataset):
    return [tf.nest.map_structure(lambda t: t.tolist(), element) for element in dataset.as_numpy_iterator()]


@pytest.mark.parametrize("drop_remainder", [False, True])
@pytest.mark.parametrize("n", EXAMPLE_COUNTS)
def test_array_shards_partition_the_rows(n, drop_remainder):
    mine = data.shard(np.arange(n), drop_remainder=drop_remainder)
    assert mine.tolist() == expected_rows(n, drop_remainder)
    everyone = kd.allgather_object(mine.tolist())
    union = sorted(row for rows in everyone for row in rows)
    kept = n - n % SIZE if drop_remainder else n
    assert union == list(range(kept))  # covered, and no row twice


@pytest.mark.parametrize("n", EXAMPLE_COUNTS)
def test_shards_differ_by_at_most_one_element_with_lower_ranks_larger(n):
    counts = kd.allgather_object(len(data.shard(np.arange(n))))
    assert counts == sorted(counts, reverse=True)
    assert counts[0] - counts[-1] <= 1


@pytest.mark.parametrize("n", EXAMPLE_COUNTS)
def test_drop_remainder_gives_every_rank_n_floor_size_elements(n):
    counts = kd.allgather_object(len(data.shard(np.arange(n), drop_remainder=True)))
    assert counts == [n // SIZE] * SIZE


def test_one_process_gets_the_data_back_unchanged():
    x = np.arange(10)
    expected = x if SIZE == 1 else x[RANK::SIZE]
    np.testing.assert_array_equal(data.shard(x), expected)


def test_tuple_keeps_the_same_rows_of_every_array():
    features, labels = np.arange(24).reshape(12, 2), np.arange(12)
    sharded = data.shard((features, labels))
    assert isinstance(sharded, tuple)
    np.testing.assert_array_equal(sharded[1], expected_rows(12))
    np.testing.assert_array_equal(sharded[0], np.stack([2 * sharded[1], 2 * sharded[1] + 1], axis=1))


def test_list_stays_a_list_with_the_same_rows_of_every_array():
    sharded = data.shard([np.arange(12) * 10, np.arange(12), np.arange(24).reshape(12, 2)], batch_size=2)
    assert isinstance(sharded, list) and len(sharded) == 3
    np.testing.assert_array_equal(sharded[1], expected_rows(12))
    np.testing.assert_array_equal(sharded[0], sharded[1] * 10)
    np.testing.assert_array_equal(sharded[2], np.stack([2 * sharded[1], 2 * sharded[1] + 1], axis=1))


def test_dict_keeps_its_keys_and_the_same_rows_of_every_array():
    sharded = data.shard({"image": np.arange(12) * 10, "label": np.arange(12)}, drop_remainder=True)
    assert set(sharded) == {"image", "label"}
    assert sharded["label"].tolist() == expected_rows(12, drop_remainder=True)
    np.testing.assert_array_equal(sharded["image"], sharded["label"] * 10)


def test_arrays_with_different_row_counts_are_rejected():
    with pytest.raises(ValueError, match=r"same number of rows.*\[5, 4\]"):
        data.shard((np.zeros(5), np.zeros(4)))


@pytest.mark.parametrize("drop_remainder", [False, True])
@pytest.mark.parametrize("n", [7, 12])
def test_dataset_and_array_shards_agree(n, drop_remainder):
    features, labels = np.arange(n) * 10, np.arange(n)
    from_arrays = data.shard((features, labels), drop_remainder=drop_remainder)
    dataset = data.shard(tf.data.Dataset.from_tensor_slices((features, labels)), drop_remainder=drop_remainder)
    assert dataset_elements(dataset) == list(zip(from_arrays[0].tolist(), from_arrays[1].tolist()))


@pytest.mark.parametrize("structure", ["single", "tuple", "dict"])
def test_drop_remainder_works_on_a_dataset_of_unknown_cardinality(structure):
    n = 3 * SIZE + SIZE - 1  # leaves a remainder whenever SIZE > 1
    values = np.arange(n)
    slices = {"single": values, "tuple": (values, values * 10), "dict": {"a": values, "b": values * 10}}[structure]
    dataset = tf.data.Dataset.from_tensor_slices(slices).filter(lambda *element: True)
    assert dataset.cardinality() == tf.data.UNKNOWN_CARDINALITY
    expected = dataset_elements(tf.data.Dataset.from_tensor_slices(data.shard(slices, drop_remainder=True)))
    assert dataset_elements(data.shard(dataset, drop_remainder=True)) == expected
    assert len(expected) == 3


def test_an_infinite_dataset_is_sharded():
    dataset = data.shard(tf.data.Dataset.range(5).repeat(), drop_remainder=True, batch_size=2)
    first = [int(v) for v in dataset.take(10)]
    assert first == [i % 5 for i in range(RANK, 10 * SIZE, SIZE)][:10]


def test_batch_size_accepts_unequal_shards_with_equal_steps():
    # 1797 digits: 899 + 898 on 2 ranks, 599 each on 3; ceil(n_rank / 32) agrees either way.
    x_shard = data.shard(np.arange(1797), batch_size=32)
    assert len(x_shard) == len(expected_rows(1797))
    dataset = data.shard(tf.data.Dataset.range(1797), batch_size=32)
    assert int(dataset.cardinality()) == len(expected_rows(1797))


@needs_two_ranks
@pytest.mark.parametrize("kind", ["arrays", "dataset"])
def test_batch_size_rejects_shards_with_different_step_counts_on_every_rank(kind):
    # One example more than 3 per rank: rank 0 gets 4 (2 batches of 3), the others 3 (1 batch).
    n = 3 * SIZE + 1
    examples = np.arange(n) if kind == "arrays" else tf.data.Dataset.range(n)
    with pytest.raises(ValueError) as raised:
        data.shard(examples, batch_size=3)
    message = str(raised.value)
    assert "2 on rank 0;" in message
    assert re.search(r"1 on ranks? " + ", ".join(map(str, range(1, SIZE))) + r"\.", message)
    assert "drop_remainder=True" in message and "steps_per_epoch=1" in message
    assert kd.allgather_object("raised") == ["raised"] * SIZE  # every rank got here: no hang

    equal = data.shard(examples, batch_size=3, drop_remainder=True)
    assert len(list(equal)) == 3


def test_a_dataset_of_unknown_cardinality_is_not_checked():
    n = 3 * SIZE + 1  # would fail the check if the count were known
    dataset = tf.data.Dataset.range(n).filter(lambda v: True)
    assert [int(v) for v in data.shard(dataset, batch_size=3)] == expected_rows(n)


def test_check_equal_steps_returns_the_common_count():
    assert data.check_equal_steps(7) == 7


@needs_two_ranks
def test_check_equal_steps_raises_on_every_rank_naming_each_ranks_count():
    mine = 11 if RANK == SIZE - 1 else 10
    with pytest.raises(ValueError) as raised:
        data.check_equal_steps(mine, what="validation steps")
    message = str(raised.value)
    others = ", ".join(map(str, range(SIZE - 1)))
    assert (
        f"different numbers of validation steps: 10 on rank{'s' if SIZE > 2 else ''} {others}; "
        f"11 on rank {SIZE - 1}." in message
    )
    assert "steps_per_epoch=10" in message
    assert kd.allgather_object("raised") == ["raised"] * SIZE  # every rank got here: no hang


@pytest.mark.parametrize(
    "examples, batch, drop, steps",
    [
        (0, 32, False, 0),
        (899, 32, False, 29),
        (898, 32, False, 29),
        (896, 32, False, 28),
        (899, 32, True, 28),
        (31, 32, True, 0),
        (32, 32, True, 1),
    ],
)
def test_steps_per_epoch(examples, batch, drop, steps):
    assert data.steps_per_epoch(examples, batch, drop_remainder=drop) == steps


@pytest.mark.parametrize("examples, batch", [(-1, 32), (10, 0), (10, 2.5)])
def test_steps_per_epoch_rejects_bad_arguments(examples, batch):
    with pytest.raises((ValueError, TypeError)):
        data.steps_per_epoch(examples, batch)


def test_seed_for_rank_is_distinct_per_rank_and_follows_the_formula():
    seeds = kd.allgather_object(data.seed_for_rank(42))
    assert seeds == [(42 + r * 1_000_003) % 2**32 for r in range(SIZE)]
    assert len(set(seeds)) == SIZE
    assert seeds[0] == 42
    assert data.seed_for_rank(42) == data.seed_for_rank(42)


def test_seed_for_rank_fits_numpy_for_any_base_seed():
    for base_seed in (-5, 2**32 - 1, 2**40):
        seed = data.seed_for_rank(base_seed)
        assert 0 <= seed < 2**32
        np.random.default_rng(seed)


def test_set_random_seed_for_rank_seeds_python_numpy_and_tensorflow_per_rank():
    seed = data.set_random_seed_for_rank(3)
    assert seed == data.seed_for_rank(3)
    draws = (random.random(), float(np.random.random()))
    assert draws == (random.Random(seed).random(), float(np.random.RandomState(seed).random()))
    tf_draw = float(tf.random.uniform([]))
    data.set_random_seed_for_rank(3)
    assert float(tf.random.uniform([])) == tf_draw  # reproducible ...
    everyone = kd.allgather_object(draws + (tf_draw,))
    assert len(set(everyone)) == SIZE  # ... and different on every rank


# ------------------------------------------------ an element order that is the same on every rank

N_ELEMENTS = 100


@pytest.fixture
def no_global_seed():
    """Each case starts without a global seed (an earlier test may have set one per rank) and
    leaves none behind."""
    tf.random.set_seed(None)
    yield
    tf.random.set_seed(None)


def _files(tmp_path):
    for i in range(10):
        (tmp_path / f"part{i}.txt").write_text(str(i))
    return str(tmp_path / "part*.txt")


def _sample_of_two(seed):
    evens, odds = tf.data.Dataset.range(0, N_ELEMENTS, 2), tf.data.Dataset.range(1, N_ELEMENTS, 2)
    return tf.data.Dataset.sample_from_datasets([evens, odds], seed=seed)


def _unordered_options():
    options = tf.data.Options()
    options.deterministic = False
    return tf.data.Dataset.range(N_ELEMENTS).map(lambda x: x, num_parallel_calls=2).with_options(options)


# What makes the order before the shard differ by rank, and what the refusal must name.
_REFUSED = {
    "unseeded_shuffle": (
        lambda files: tf.data.Dataset.range(N_ELEMENTS).shuffle(N_ELEMENTS),
        "Dataset.shuffle without a seed",
    ),
    "list_files_default": (lambda files: tf.data.Dataset.list_files(files), "Dataset.list_files shuffles"),
    "map_not_deterministic": (
        lambda files: tf.data.Dataset.range(N_ELEMENTS).map(lambda x: x, num_parallel_calls=2, deterministic=False),
        "Dataset.map with deterministic=False",
    ),
    "interleave_not_deterministic": (
        lambda files: tf.data.Dataset.range(4).interleave(
            lambda i: tf.data.Dataset.range(i, N_ELEMENTS, 4), num_parallel_calls=2, deterministic=False
        ),
        "Dataset.interleave with deterministic=False",
    ),
    "batch_not_deterministic": (
        lambda files: tf.data.Dataset.range(N_ELEMENTS).batch(10, num_parallel_calls=2, deterministic=False),
        "Dataset.batch with deterministic=False",
    ),
    "options_not_deterministic": (lambda files: _unordered_options(), "tf.data.Options.deterministic = False"),
    "unseeded_sample_from_datasets": (lambda files: _sample_of_two(None), "Dataset.sample_from_datasets"),
    "unseeded_random": (lambda files: tf.data.Dataset.random().take(N_ELEMENTS), "Dataset.random without a seed"),
    "unseeded_shuffle_inside_interleave": (
        lambda files: tf.data.Dataset.range(4).interleave(
            lambda i: tf.data.Dataset.range(i, N_ELEMENTS, 4).shuffle(25)
        ),
        "Dataset.shuffle without a seed",
    ),
    "unseeded_random_filter": (
        lambda files: tf.data.Dataset.range(N_ELEMENTS).filter(lambda x: tf.random.uniform([]) < 0.5),
        "Dataset.filter whose predicate draws unseeded random numbers",
    ),
}


@pytest.mark.parametrize("case", sorted(_REFUSED))
def test_shard_refuses_a_dataset_whose_order_may_differ_by_rank_naming_the_step_and_the_fix(
    case, tmp_path, no_global_seed
):
    make, named = _REFUSED[case]
    dataset = make(_files(tmp_path)).map(lambda x: x)  # the step may lie further up the pipeline
    with pytest.raises(ValueError, match="before the shard") as refusal:
        data.shard(dataset)
    message = str(refusal.value)
    assert named in message, message
    assert "Shard first and shuffle" in message, message


@needs_two_ranks
def test_the_probes_unseeded_shuffle_would_have_overlapping_shards(no_global_seed):
    # What the refusal prevents (issue 49): each rank's every size-th element of its own order.
    dataset = tf.data.Dataset.range(N_ELEMENTS).shuffle(N_ELEMENTS)
    everyone = kd.allgather_object([int(v) for v in dataset.shard(SIZE, RANK)])
    assert len({v for shard in everyone for v in shard}) < N_ELEMENTS
    with pytest.raises(ValueError, match="Dataset.shuffle without a seed"):
        data.shard(dataset)


def _global_seed_shuffle(files):
    tf.random.set_seed(1234)  # alike on every rank, right before the pipeline
    return tf.data.Dataset.range(N_ELEMENTS).shuffle(N_ELEMENTS)


# Orders that are the same on every rank: the shards must partition the elements.
_ACCEPTED = {
    "seeded_shuffle": lambda files: tf.data.Dataset.range(N_ELEMENTS).shuffle(N_ELEMENTS, seed=11),
    "global_seed_shuffle": _global_seed_shuffle,
    "list_files_unshuffled": lambda files: tf.data.Dataset.list_files(files, shuffle=False),
    "list_files_seeded": lambda files: tf.data.Dataset.list_files(files, seed=5),
    "parallel_map_default": lambda files: tf.data.Dataset.range(N_ELEMENTS).map(lambda x: x, num_parallel_calls=2),
    "parallel_interleave_default": lambda files: tf.data.Dataset.range(4).interleave(
        lambda i: tf.data.Dataset.range(i, N_ELEMENTS, 4), num_parallel_calls=2
    ),
    "seeded_sample_from_datasets": lambda files: _sample_of_two(9),
    "seeded_shuffle_inside_interleave": lambda files: tf.data.Dataset.range(4).interleave(
        lambda i: tf.data.Dataset.range(i, N_ELEMENTS, 4).shuffle(25, seed=3)
    ),
    "random_augmentation_in_map": lambda files: tf.data.Dataset.range(N_ELEMENTS).map(
        lambda x: (x, tf.random.uniform([]))
    ),
}


def _first_components(dataset):
    """Each element's first component; a file's base name, since every rank has its own tmp_path."""
    firsts = [tf.nest.flatten(element)[0] for element in dataset.as_numpy_iterator()]
    return [os.path.basename(v) if isinstance(v, bytes) else v for v in firsts]


@pytest.mark.parametrize("case", sorted(_ACCEPTED))
def test_shard_of_a_dataset_in_the_same_order_on_every_rank_partitions_its_elements(case, tmp_path, no_global_seed):
    dataset = _ACCEPTED[case](_files(tmp_path))
    mine = _first_components(data.shard(dataset))
    everyone = kd.allgather_object(mine)
    all_elements = _first_components(dataset)
    assert sorted(v for shard in everyone for v in shard) == sorted(all_elements)


@needs_two_ranks
@pytest.mark.parametrize("seeding", ["seed_for_rank", "set_random_seed_for_rank"])
def test_shard_refuses_random_steps_seeded_differently_on_each_rank_on_every_rank(seeding, no_global_seed):
    if seeding == "seed_for_rank":
        dataset = tf.data.Dataset.range(N_ELEMENTS).shuffle(N_ELEMENTS, seed=data.seed_for_rank(21))
    else:
        data.set_random_seed_for_rank(21)
        dataset = tf.data.Dataset.range(N_ELEMENTS).shuffle(N_ELEMENTS)
    with pytest.raises(ValueError, match="seeded differently on each rank") as refusal:
        data.shard(dataset)
    assert f"rank {SIZE - 1}: Dataset.shuffle seeds" in str(refusal.value)


@pytest.mark.parametrize(
    "function",
    [data.shard, data.steps_per_epoch, data.check_equal_steps, data.seed_for_rank, data.set_random_seed_for_rank],
    ids=lambda f: f.__name__,
)
def test_docstring_example_runs(function):
    block = re.search(r"Example:\s*```python\n(.*?)```", function.__doc__, flags=re.S).group(1)
    lines = block.splitlines()
    indent = min(len(line) - len(line.lstrip()) for line in lines if line.strip())
    exec(compile("\n".join(line[indent:] for line in lines), f"<{function.__name__} example>", "exec"), {})
