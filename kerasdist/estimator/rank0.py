"""What rank 0 writes to model_dir: checkpoints by step count or by its clock, and scalar summaries."""

import contextlib
import logging
import time

import tensorflow as tf

from kerasdist import _compat

_logger = logging.getLogger(__package__)  # "kerasdist.estimator", as RunConfig documents

CHECKPOINT_NAME = "model.ckpt"  # checkpoints are model.ckpt-<global step>, as with tf.estimator
# tf.summary.scalar needs the tensorboard package, which TensorFlow 2.21 no longer installs;
# tf.summary.write with this metadata writes the same record TensorBoard's scalars read.
_SCALAR_SUMMARY = _compat.SummaryMetadata(
    plugin_data=_compat.SummaryMetadata.PluginData(plugin_name="scalars"), data_class=_compat.DATA_CLASS_SCALAR
)


class _Rank0Saver:
    """Saves the training state on rank 0 by step count or by rank 0's clock; no collective."""

    def __init__(self, graph, config, saved_step):
        self._manager = tf.train.CheckpointManager(
            graph.checkpoint, config.model_dir, max_to_keep=config.keep_checkpoint_max, checkpoint_name=CHECKPOINT_NAME
        )
        self._every_steps = config.save_checkpoints_steps
        self._every_secs = config.checkpoint_interval_secs
        self._last_step = saved_step
        self._last_time = time.monotonic()

    def save_if_due(self, step, force=False):
        if step == self._last_step:
            return
        due = (
            force
            or (self._every_steps is not None and step % self._every_steps == 0)
            or (self._every_secs is not None and time.monotonic() - self._last_time >= self._every_secs)
        )
        if not due:
            return
        with _without_tensorflow_info():
            path = self._manager.save(checkpoint_number=step)
        self._last_step, self._last_time = step, time.monotonic()
        _logger.info("Saved checkpoint for step %d: %s", step, path)


class _ScalarWriters:
    """One summary writer per directory, each opened at its first scalars."""

    def __init__(self):
        self._writers = {}

    def write(self, directory, step, scalars):
        if not scalars:
            return
        writer = self._writers.get(directory)
        if writer is None:
            writer = self._writers[directory] = tf.summary.create_file_writer(directory)
        with writer.as_default(step=step):
            for name, value in scalars.items():
                tf.summary.write(name, tf.constant(value, tf.float32), metadata=_SCALAR_SUMMARY)
        writer.flush()


class _WarningsOnly(logging.Filter):
    def filter(self, record):
        return record.levelno >= logging.WARNING


@contextlib.contextmanager
def _without_tensorflow_info():
    """Drops TensorFlow's INFO records meanwhile, logged through absl or its own logger: every
    checkpoint save logs "Sharding callback duration", a SavedModel export five more lines, none
    of which tells a user anything."""
    loggers, quiet = [logging.getLogger("absl"), tf.get_logger()], _WarningsOnly()
    for logger in loggers:
        logger.addFilter(quiet)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(quiet)
