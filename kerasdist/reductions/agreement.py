"""That every rank hands the reduction the same list of gradients, checked before any travels.

A gradient that is `None` on some ranks only (a layer that a branch uses on some ranks only), or a
variable that is trainable on some ranks only, gives the ranks different lists of gradients: their
collectives would fail with an error naming a library line, not the variable. `GradientLayouts`
compares what each rank is about to reduce (every variable's shape and dtype, and whether its
gradient is missing, dense or `tf.IndexedSlices`) and raises, on every rank, an error that names
the variables, the ranks and the likely fix. Names are not compared: ranks may number Keras's
automatic layer names differently and still train the same model.

Each rank remembers the layouts the ranks agreed on, so the comparison's collective runs once per
traced step (per new layout); after that a step pays one variable read and a comparison.
"""

import hashlib
import json
import re

import numpy as np
import tensorflow as tf

from kerasdist import ops, runtime

_REMEMBERED = 8  # agreed layouts kept, for a custom loop that alternates a few kinds of apply()
_NONE, _DENSE, _SLICES = "none", "dense", "slices"
_NAMED_GROUPS = 4  # more groups of ranks than this: the names say nothing useful


def variable_name(variable):
    """What messages call a variable: its Keras path, or a `tf.Variable`'s name without the ":0"
    (None for an eager tensor, which has no name)."""
    name = getattr(variable, "path", None) or getattr(variable, "name", None)
    return name and name.removesuffix(":0")


def _kind(gradient):
    if gradient is None:
        return _NONE
    return _SLICES if isinstance(gradient, tf.IndexedSlices) else _DENSE


class GradientLayouts:
    """The gradient layouts the ranks agreed on, and the check of a new one (see the module)."""

    def __init__(self):
        self._agreed = None
        if runtime.state().size > 1:
            with tf.init_scope():  # may be made inside a traced step
                self._agreed = tf.Variable(tf.zeros([_REMEMBERED], tf.int64), trainable=False, name="agreed_layouts")

    def check(self, gradients, variables):
        """Ops that raise on every rank unless every rank's `gradients` (with `None` entries) of
        `variables` line up with every other rank's; `[]` in a world of one."""
        if self._agreed is None:
            return []
        entries = [
            [variable_name(v) or f"source {i}", list(v.shape), tf.as_dtype(v.dtype).name, _kind(g)]
            for i, (g, v) in enumerate(zip(gradients, variables))
        ]
        layout = json.dumps([entry[1:] for entry in entries]).encode()
        key = int.from_bytes(hashlib.sha256(layout).digest()[:8], "little", signed=True) or 1  # 0: no layout

        def compare():
            every_key = ops.allgather(tf.constant([key], tf.int64))

            def remember():
                self._agreed.assign(tf.concat([[key], self._agreed[:-1]], 0))
                return tf.constant(True)

            def refuse():
                own = np.frombuffer(json.dumps(entries).encode(), np.uint8)
                lengths = ops.allgather(tf.constant([len(own)], tf.int64))
                described = ops.allgather(tf.constant(own))
                if tf.executing_eagerly():
                    _raise_misaligned(lengths.numpy(), described.numpy())
                return tf.numpy_function(_raise_misaligned, [lengths, described], tf.bool, stateful=True)

            return tf.cond(tf.reduce_all(tf.equal(every_key, key)), remember, refuse)

        known = tf.reduce_any(tf.equal(self._agreed, key))
        return [tf.cond(known, lambda: tf.constant(True), compare)]


def _raise_misaligned(lengths, described):
    """Raises the message for every rank's gathered entries (JSON bytes, `lengths` per rank)."""
    ends = np.cumsum(lengths)
    every_rank = [json.loads(bytes(described[end - length : end])) for length, end in zip(lengths, ends)]
    raise ValueError(misaligned_gradients_message(every_rank))


def _ranks(ranks):
    ranks = sorted(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(str(r) for r in ranks)


def _names(names):
    return ", ".join(f"'{name}'" for name in names)


def misaligned_gradients_message(every_rank):
    """What differs between the ranks' gradient lists, and what to do: `every_rank[r]` is rank r's
    list of `[variable name, shape, dtype, gradient kind]`."""
    problems = []
    if len({len(entries) for entries in every_rank}) > 1:
        problems.append(_different_variables(every_rank))
    else:
        problems.extend(_different_gradients(every_rank))
    return "kerasdist: the ranks' gradients do not line up, so they cannot be combined. " + " ".join(problems)


def _unnumbered(name):
    """`name` without Keras's automatic numbering ("sequential_12/dense_3/kernel" ->
    "sequential/dense/kernel"), which counts the layers each process has made so far."""
    return re.sub(r"_\d+(?=/|$)", "", name)


def _same_variable_keys(entries):
    """A key per entry that names the same variable on every rank: its unnumbered name and how
    many entries before it share that name."""
    seen = {}
    keys = []
    for name, *_ in entries:
        unnumbered = _unnumbered(name)
        keys.append((unnumbered, seen.get(unnumbered, 0)))
        seen[unnumbered] = seen.get(unnumbered, 0) + 1
    return keys


def _different_variables(every_rank):
    """The ranks list different numbers of trainable variables: say which, by name (as the lowest
    rank that trains it calls it)."""
    everyone = set(range(len(every_rank)))
    holders_of, name_of = {}, {}  # key -> the ranks that train it, keys in first-seen order
    for rank, entries in enumerate(every_rank):
        for key, (name, *_) in zip(_same_variable_keys(entries), entries):
            holders_of.setdefault(key, set()).add(rank)
            name_of.setdefault(key, name)
    names_by_holders = {}
    for key, holders in holders_of.items():
        if holders != everyone:
            names_by_holders.setdefault(frozenset(holders), []).append(name_of[key])
    if 0 < len(names_by_holders) <= _NAMED_GROUPS:
        which = "; ".join(
            f"{_names(names)} {'is' if len(names) == 1 else 'are'} trainable on {_ranks(holders)} "
            f"but not trainable on {_ranks(everyone - holders)}"
            for holders, names in names_by_holders.items()
        )
    else:  # names the ranks gave differently beyond Keras's numbering
        which = "their names differ too"
    counts = ", ".join(f"rank {rank} trains {len(entries)}" for rank, entries in enumerate(every_rank))
    return (
        f"The ranks train different variables ({counts}): {which}. Set `trainable` the same way on "
        "every rank (a layer frozen on some ranks only, or `trainable` changed after compile on some "
        "ranks), and build the same model on every rank."
    )


def _different_gradients(every_rank):
    """The ranks list as many variables: say where their shapes, dtypes or gradients differ."""
    missing, kinds, shapes = {}, [], []
    for entries in zip(*every_rank):
        name = entries[0][0]
        if len({(tuple(e[1]), e[2]) for e in entries}) > 1:
            shapes.append(f"'{name}' is " + "; ".join(f"{e[2]} {e[1]} on rank {r}" for r, e in enumerate(entries)))
        without = frozenset(r for r, e in enumerate(entries) if e[3] == _NONE)
        if without and len(without) < len(entries):
            missing.setdefault(without, []).append(name)
        elif not without and len({e[3] for e in entries}) > 1:
            slices = {r for r, e in enumerate(entries) if e[3] == _SLICES}
            kinds.append(f"'{name}' has a tf.IndexedSlices gradient on {_ranks(slices)} but a dense one elsewhere")
    problems = []
    if shapes:
        problems.append(
            "Their trainable variables differ in shape or dtype: "
            + "; ".join(shapes)
            + ". Build the same model on every rank."
        )
    for without, names in missing.items():
        everyone = set(range(len(every_rank)))
        problems.append(
            f"{_names(names)} {'has' if len(names) == 1 else 'have'} no gradient on {_ranks(without)} but "
            f"{'has' if len(names) == 1 else 'have'} one on {_ranks(everyone - without)}: usually a layer "
            "that some ranks do not use in their loss (a branch taken on some ranks only, under "
            "`if kerasdist.rank() == ...` or Python control flow that depends on the data). Use every "
            "trained layer on every rank (an output multiplied by 0 still has a gradient), or set "
            "`trainable` the same way on every rank."
        )
    if kinds:
        problems.append("; ".join(kinds) + ": compute it the same way on every rank, or pass sparse_as_dense=True.")
    return problems
