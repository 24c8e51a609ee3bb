"""fit on one data set sharded by kerasdist.data, with Rank0Checkpoint(resume=True), for a job
given notice to leave in the middle of an epoch, or offered more hosts while it trains.

    notice_training.py DIR [--notice-ranks R ...] [--slow] [--hosts-file PATH
                       [--after-notice TEXT] [--offer TEXT --offer-attempt A]]

    --notice-ranks    on the first attempt these ranks send themselves the notice signal
                      (SIGUSR1) at the end of batch 1 of epoch 2
    --hosts-file      the file a test's discovery program prints
    --after-notice    the first of those ranks writes TEXT there right after its notice: the
                      noticed hosts go away
    --offer           on attempt A (KERASDIST_RESTART), rank 0 writes TEXT there when epoch 2
                      begins (or resumes), and batches from then on take 0.3 s, so that the
                      launcher finds the hosts while the job trains
    --slow            on the first attempt, batches from epoch 2 on take 0.3 s, so that a test
                      can send a notice from outside while the job trains

Each rank prints STARTED_AT=<time.time() once kerasdist is up>, ATTEMPT=<attempt> SIZE=<ranks>
RESUMED_FROM=<epoch>/<batch> and, on the first attempt, BATCH_END=<rank> <epoch> <batch> after
each batch (and NOTICE_AT=<time> before the signal); TRAINED_AT=<time> once fit has returned; at
the end rank 0 prints ITERATIONS=<updates> and MAX_DIFFERENCE=<largest weight difference from
plain Keras in one process on the planned global batch, computed here>.
"""

import argparse
import os
import signal
import time

import keras
import numpy as np

import kerasdist as kd

kd.init()
print(f"STARTED_AT={time.time():.3f}", flush=True)
parser = argparse.ArgumentParser()
parser.add_argument("directory")
parser.add_argument("--notice-ranks", type=int, nargs="+", default=[])
parser.add_argument("--hosts-file")
parser.add_argument("--after-notice")
parser.add_argument("--offer")
parser.add_argument("--offer-attempt", type=int, default=0)
parser.add_argument("--slow", action="store_true")
args = parser.parse_args()
attempt = int(os.environ.get("KERASDIST_RESTART", "0"))
EPOCHS, PER_RANK_BATCH, NOTICE_EPOCH, UPDATES_PER_EPOCH = 4, 4, 2, 6
GLOBAL_BATCH = PER_RANK_BATCH * kd.planned_size()


def write_hosts(text):
    # Whole or not at all: the launcher's discovery program may read it at any moment.
    partial = f"{args.hosts_file}.{os.getpid()}"
    with open(partial, "w") as hosts:
        hosts.write(text.replace(",", "\n") + "\n")
    os.replace(partial, args.hosts_file)


class Notice(keras.callbacks.Callback):
    offering = args.offer is not None and attempt == args.offer_attempt
    slow = offering or (args.slow and attempt == 0)

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        if self.offering and epoch == NOTICE_EPOCH and kd.rank() == 0:
            write_hosts(args.offer)

    def on_train_batch_end(self, batch, logs=None):
        if self.slow and self._epoch >= NOTICE_EPOCH:
            time.sleep(0.3)
        if attempt == 0:
            print(f"BATCH_END={kd.rank()} {self._epoch} {batch}", flush=True)
            if kd.rank() in args.notice_ranks and self._epoch == NOTICE_EPOCH and batch == 1:
                print(f"NOTICE_AT={time.time():.3f}", flush=True)
                os.kill(os.getpid(), signal.SIGUSR1)
                if args.after_notice is not None and kd.rank() == min(args.notice_ranks):
                    write_hosts(args.after_notice)


def make_model():
    keras.utils.set_random_seed(7)
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(1)])


rng = np.random.default_rng(7)
x = rng.normal(size=(UPDATES_PER_EPOCH * GLOBAL_BATCH, 6)).astype("float32")
y = (np.sin(x) @ np.linspace(-1, 1, 6).reshape(6, 1)).astype("float32")
model = make_model()
model.compile(kd.DistributedOptimizer(keras.optimizers.Adam(0.01)), loss="mse")
checkpoint = kd.callbacks.Rank0Checkpoint(args.directory, resume=True)
resumed = checkpoint.resumed_from
print(
    f"ATTEMPT={attempt} SIZE={kd.size()} RESUMED_FROM={checkpoint.initial_epoch}/"
    f"{resumed.batches_of_all_ranks // kd.size() if resumed else 0}",
    flush=True,
)
x_shard, y_shard = kd.data.shard((x, y), batch_size=PER_RANK_BATCH)
model.fit(
    x_shard,
    y_shard,
    batch_size=PER_RANK_BATCH,
    epochs=EPOCHS,
    shuffle=False,
    verbose=0,
    callbacks=[Notice(), checkpoint, *kd.callbacks()],
)
print(f"TRAINED_AT={time.time():.3f}", flush=True)
if kd.rank() == 0:
    reference = make_model()
    reference.compile(keras.optimizers.Adam(0.01), loss="mse")
    reference.fit(x, y, batch_size=GLOBAL_BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    difference = max(float(np.abs(a - b).max()) for a, b in zip(model.get_weights(), reference.get_weights()))
    print(f"ITERATIONS={int(model.optimizer.iterations.numpy())}", flush=True)
    print(f"MAX_DIFFERENCE={difference:.3g}", flush=True)
