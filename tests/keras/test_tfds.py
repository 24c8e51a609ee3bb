"""kerasdist.data.tfds_load on a real TFDS data set: scikit-learn's digits, prepared offline.

Every rank prepares its own copy in 12 record files per split (tests/tfds_digits.py), as each
host of a job would hold its own. The same split then reaches the cases of tfds_load at 1, 2
and 3 ranks: "train" (12 files) is sharded by file; "train[:500]" (5 files, partly read) and
"train[:100]" (1 file) are not divisible by 2 and 3 ranks and are split by example. Expected
examples come from TFDS read directly, by example id, and from scikit-learn for whole splits.
Python-level network access fails and is recorded: the tests fail if anything tries to download.
"""

import socket

import numpy as np
import pytest
import tensorflow_datasets as tfds
import tfds_digits  # tests/ is on sys.path: pytest puts the directory of tests/conftest.py there

import kerasdist as kd
from kerasdist import data

kd.init()
RANK, SIZE = kd.rank(), kd.size()

NUM_FILES = 12
needs_two_ranks = pytest.mark.skipif(SIZE < 2, reason="needs at least 2 ranks (run under mpiexec -n 2)")
SPLITS = ["train", "train[:500]", "train[:100]", "test"]


@pytest.fixture(scope="module")
def network_attempts():
    """Every Python-level connection or name lookup is refused and recorded."""
    attempts = []

    def refuse(what):
        def refused(*args, **kwargs):
            attempts.append(f"{what}{args[1:] if what.startswith('socket.') else args}")
            raise OSError(f"test: network access attempted: {attempts[-1]}")

        return refused

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(socket.socket, "connect", refuse("socket.connect"))
        patch.setattr(socket.socket, "connect_ex", refuse("socket.connect_ex"))
        patch.setattr(socket, "getaddrinfo", refuse("getaddrinfo"))
        yield attempts


@pytest.fixture(autouse=True)
def no_download(network_attempts):
    yield
    # Checked after the test too: a library may catch the refusal and carry on.
    assert network_attempts == [], "something tried to reach the network"


@pytest.fixture(scope="module")
def data_dir(network_attempts, tmp_path_factory):
    directory = tmp_path_factory.mktemp("tensorflow_datasets")
    tfds_digits.prepare(directory, num_shards=NUM_FILES)
    return directory


def ids_read_by_tfds(data_dir, split):
    """The example ids of `split` in TFDS's own order, read without kerasdist."""
    dataset = tfds.load(
        tfds_digits.NAME,
        split=split,
        data_dir=str(data_dir),
        download=False,
        read_config=tfds.ReadConfig(interleave_cycle_length=1),
    )
    return [int(example["id"]) for example in dataset]


def ids_of(dataset):
    return [int(example["id"]) for example in dataset]


def test_the_train_split_has_the_files_the_cases_need(data_dir):
    splits = tfds.builder(tfds_digits.NAME, data_dir=str(data_dir)).info.splits
    assert [len(splits[split].file_instructions) for split in SPLITS] == [NUM_FILES, 5, 1, NUM_FILES]


@pytest.mark.parametrize("split", SPLITS)
def test_the_ranks_read_disjoint_examples_that_make_up_the_split(data_dir, split):
    mine = ids_of(data.tfds_load(tfds_digits.NAME, split, data_dir))
    everyone = kd.allgather_object(mine)
    union = [example for ids in everyone for example in ids]
    assert len(union) == len(set(union))  # no example twice
    assert sorted(union) == sorted(ids_read_by_tfds(data_dir, split))
    if split in ("train", "test"):  # and those are scikit-learn's rows, not whatever TFDS returns
        train_rows, test_rows = _sklearn_rows()
        assert sorted(union) == sorted(train_rows if split == "train" else test_rows)


def _sklearn_rows():
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    target = load_digits().target
    return train_test_split(
        np.arange(len(target)), test_size=tfds_digits.TEST_FRACTION, random_state=0, stratify=target
    )


def test_files_that_divide_among_the_ranks_are_dealt_out_whole(data_dir):
    split_info = tfds.builder(tfds_digits.NAME, data_dir=str(data_dir)).info.splits["train"]
    bounds = np.cumsum([0, *split_info.shard_lengths])
    file_ids = [set(ids_read_by_tfds(data_dir, f"train[{start}:{stop}]")) for start, stop in zip(bounds, bounds[1:])]
    mine = set(ids_of(data.tfds_load(tfds_digits.NAME, "train", data_dir)))
    assert mine == set().union(*file_ids[RANK::SIZE])  # files RANK, RANK + SIZE, ...


@pytest.mark.parametrize("split", ["train[:500]", "train[:100]"])
def test_files_that_do_not_divide_are_split_by_example_into_near_equal_parts(data_dir, split):
    mine = ids_of(data.tfds_load(tfds_digits.NAME, split, data_dir))
    counts = kd.allgather_object(len(mine))
    assert max(counts) - min(counts) <= 1
    in_order = ids_read_by_tfds(data_dir, split)
    start = sum(counts[:RANK])
    assert sorted(mine) == sorted(in_order[start : start + len(mine)])  # a contiguous 1/SIZE


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("drop_remainder", [False, True])
def test_every_rank_runs_the_same_number_of_steps_and_knows_it(data_dir, split, drop_remainder):
    dataset = data.tfds_load(tfds_digits.NAME, split, data_dir, batch_size=32, drop_remainder=drop_remainder)
    examples = len(ids_of(dataset))
    assert int(dataset.cardinality()) == examples  # known before reading: fit can count its steps
    steps = kd.allgather_object(len(list(dataset.batch(32))))
    assert steps == [steps[0]] * SIZE
    if drop_remainder:
        assert kd.allgather_object(examples) == [examples] * SIZE


@needs_two_ranks
def test_shares_with_different_step_counts_raise_on_every_rank(data_dir):
    split = f"train[:{3 * SIZE + 1}]"  # one file: rank 0 gets 4 examples (2 batches of 3), the others 3 (1)
    with pytest.raises(ValueError, match=r"different numbers of batches of 3 per epoch: 2 on rank 0;"):
        data.tfds_load(tfds_digits.NAME, split, data_dir, batch_size=3)
    assert kd.allgather_object("raised") == ["raised"] * SIZE  # every rank got here: no hang
    equal = data.tfds_load(tfds_digits.NAME, split, data_dir, batch_size=3, drop_remainder=True)
    assert len(ids_of(equal)) == 3


def test_shuffled_file_order_is_reproducible_and_follows_the_seed(data_dir):
    def shuffled(seed):
        return ids_of(data.tfds_load(tfds_digits.NAME, "train", data_dir, shuffle_files=True, seed=seed))

    first = shuffled(5)
    assert first == shuffled(5)
    # Four files per rank at 3 ranks: two seeds can give one order, three almost never do.
    assert len({tuple(first), tuple(shuffled(6)), tuple(shuffled(7))}) > 1
    assert sorted(first) == sorted(ids_of(data.tfds_load(tfds_digits.NAME, "train", data_dir)))


@needs_two_ranks
def test_each_rank_shuffles_its_files_with_its_own_seed(data_dir):
    # With one seed everywhere, ranks holding the same number of files would visit them in the
    # same order of positions (1st, 3rd, 2nd, ...); with seed_for_rank they do not.
    split_info = tfds.builder(tfds_digits.NAME, data_dir=str(data_dir)).info.splits["train"]
    bounds = np.cumsum([0, *split_info.shard_lengths])
    file_of_id = {}
    for file, (start, stop) in enumerate(zip(bounds, bounds[1:])):
        file_of_id.update((example, file) for example in ids_read_by_tfds(data_dir, f"train[{start}:{stop}]"))
    files_in_visiting_order = list(
        dict.fromkeys(
            file_of_id[example]
            for example in ids_of(data.tfds_load(tfds_digits.NAME, "train", data_dir, shuffle_files=True, seed=5))
        )
    )
    my_files = list(range(RANK, NUM_FILES, SIZE))
    positions = [my_files.index(file) for file in files_in_visiting_order]
    everyone = kd.allgather_object(positions)
    assert sorted(positions) == list(range(NUM_FILES // SIZE))
    assert len(set(map(tuple, everyone))) > 1, f"every rank visited its files in the order {positions}"


@pytest.mark.parametrize(
    "name, split, where, message",
    [
        ("no_such_data_set", "train", "prepared", r"Dataset no_such_data_set not found"),
        ("mnist", "train", "prepared", r"'mnist' is not prepared in data_dir"),
        (tfds_digits.NAME, "validation", "prepared", r"Unknown split 'validation'"),
        (tfds_digits.NAME, "train", "missing", r"is not a directory"),
    ],
)
def test_bad_input_raises_on_every_rank(data_dir, tmp_path, name, split, where, message):
    # The same path on every rank, so that the ranks' messages agree.
    directory = data_dir if where == "prepared" else kd.broadcast_object(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match=rf"failed on ranks? {', '.join(map(str, range(SIZE)))}: .*{message}"):
        data.tfds_load(name, split, directory)
    assert kd.allgather_object("raised") == ["raised"] * SIZE  # every rank got here: no hang


def test_a_failure_on_one_rank_raises_on_every_rank(data_dir, tmp_path):
    # As when one host lacks the data: the others must not wait for it in a collective.
    directory = tmp_path / "missing" if RANK == SIZE - 1 else data_dir
    with pytest.raises(ValueError, match=rf"failed on rank {SIZE - 1}: ValueError: data_dir .* is not a directory"):
        data.tfds_load(tfds_digits.NAME, "train", directory, batch_size=32)
    assert kd.allgather_object("raised") == ["raised"] * SIZE
