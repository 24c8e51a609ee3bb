"""scikit-learn's bundled digits as a TensorFlow Datasets set, prepared offline.

The TFDS tests need a real data set in TFDS's own on-disk format (record files, metadata,
several files per split) without a download: this builder writes the 1,797 digits that ship
with scikit-learn into a local data_dir. It lives with the tests because it exists for them;
the launch tests run it as a script, the way a user prepares a data set before training:

    python tests/tfds_digits.py --data_dir=DIR [--num_shards=6]
    kerasdist-run -np 2 python examples/keras_digits.py --tfds_name=kerasdist_digits --data_dir=DIR

Once prepared, the data set loads by name from DIR (`tfds.load("kerasdist_digits",
data_dir=DIR)`) without importing this module: TFDS reads the features from DIR's metadata.
"""

import argparse

import numpy as np
import tensorflow_datasets as tfds

NAME = "kerasdist_digits"
TEST_FRACTION = 0.25


class KerasdistDigits(tfds.core.GeneratorBasedBuilder):
    """8x8 grey scans of handwritten digits 0-9 (scikit-learn's `load_digits`)."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "scikit-learn's digits, a stratified 75/25 train/test split."}

    def _info(self):
        return tfds.core.DatasetInfo(
            builder=self,
            features=tfds.features.FeaturesDict(
                {
                    # uint8 in 0-255 like mnist's images, so a script normalizes both the same way.
                    "image": tfds.features.Tensor(shape=(8, 8, 1), dtype=np.uint8),
                    "label": tfds.features.ClassLabel(num_classes=10),
                    # The row in load_digits(): lets tests check which examples each rank read.
                    "id": tfds.features.Scalar(dtype=np.int64),
                }
            ),
            supervised_keys=("image", "label"),
            description=self.__doc__,
        )

    def _split_generators(self, dl_manager):
        del dl_manager  # nothing to download: the data ship with scikit-learn
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split

        digits = load_digits()
        rows = np.arange(len(digits.target))
        train_rows, test_rows = train_test_split(rows, test_size=TEST_FRACTION, random_state=0, stratify=digits.target)
        return {
            "train": self._generate_examples(digits, train_rows),
            "test": self._generate_examples(digits, test_rows),
        }

    def _generate_examples(self, digits, rows):
        for row in rows:
            # Scan values are 0-16; 16 maps to 255.
            image = np.round(digits.images[row] * (255 / 16)).astype(np.uint8)[..., None]
            yield int(row), {"image": image, "label": int(digits.target[row]), "id": int(row)}


def prepare(data_dir, num_shards):
    """Writes both splits into `data_dir`, each in `num_shards` record files; returns the builder."""
    builder = KerasdistDigits(data_dir=str(data_dir))
    builder.download_and_prepare(
        download_config=tfds.download.DownloadConfig(num_shards=num_shards, try_download_gcs=False)
    )
    return builder


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data_dir", required=True, help="Where to write the data set.")
    parser.add_argument("--num_shards", type=int, default=6, help="Record files per split.")
    arguments = parser.parse_args()
    prepared = prepare(arguments.data_dir, arguments.num_shards)
    print(
        f"prepared {NAME} in {prepared.data_dir}: "
        + ", ".join(
            f"{name} {split.num_examples} examples in {split.num_shards} files"
            for name, split in prepared.info.splits.items()
        )
    )
