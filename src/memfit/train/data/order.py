"""The order of the training examples: deterministic, epoch after epoch, resumable mid-epoch.

Turning a batch of examples into tensors is the step's job (:func:`memfit.step.batch.collate`).
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sequence
from typing import Any


class BatchIterator:
    """Endless, deterministic batches of examples, epoch after epoch, that can resume mid-epoch.

    Each epoch visits every example once, in an order that depends only on ``seed`` and the epoch
    number (or in stored order when ``shuffle`` is False). Batches never span two epochs, so the
    last batch of an epoch may be smaller unless ``drop_last``. ``state_dict()`` after any batch,
    passed to ``load_state_dict()`` on a new iterator over the same examples, continues with exactly
    the batches the first one would have produced.
    """

    def __init__(
        self,
        examples: Sequence[Any],
        batch_size: int,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
    ) -> None:
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        if not examples:
            raise ValueError("BatchIterator needs at least one example")
        if drop_last and len(examples) < batch_size:
            raise ValueError(
                f"drop_last with batch_size={batch_size} but only {len(examples)} examples: "
                "every batch would be dropped; lower batch_size or set drop_last=False"
            )
        self.examples = examples
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.epoch = 0
        self.position = 0  # examples of the current epoch's order already handed out
        self.handed_out = 0  # examples handed out by this iterator, whatever the epoch (not saved)
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.examples)))
        if self.shuffle:
            # A fresh generator per epoch, seeded from (seed, epoch): any epoch's order can be
            # rebuilt on resume without replaying the ones before it.
            random.Random(f"memfit-batches-{self.seed}-{epoch}").shuffle(order)
        return order

    def batches_per_epoch(self) -> int:
        """Number of batches in one epoch."""
        full, rest = divmod(len(self.examples), self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def epochs_done(self) -> float:
        """The epochs handed out so far, as the Hugging Face Trainer counts its ``epoch``: whole epochs,
        plus this epoch's batches over its batches (1.0 once the first epoch's last batch is out)."""
        return self.epoch + math.ceil(self.position / self.batch_size) / self.batches_per_epoch()

    def __iter__(self) -> Iterator[list[Any]]:
        return self

    def __next__(self) -> list[Any]:
        remaining = len(self._order) - self.position
        if remaining == 0 or (self.drop_last and remaining < self.batch_size):
            self.epoch += 1
            self.position = 0
            self._order = self._epoch_order(self.epoch)
        indices = self._order[self.position : self.position + self.batch_size]
        self.position += len(indices)
        self.handed_out += len(indices)
        return [self.examples[i] for i in indices]

    def state_dict(self) -> dict[str, int | bool]:
        """Where the iterator stands: ``epoch`` and ``position`` (examples of that epoch already
        handed out), plus the settings that must match on resume."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "batch_size": self.batch_size,
            "drop_last": self.drop_last,
            "num_examples": len(self.examples),
        }

    def load_state_dict(self, state: dict[str, Any], *, rebatch: bool = False) -> None:
        """Continue from a :meth:`state_dict`. Raises ValueError when the examples or the settings
        differ from the run that saved it, since the order would then not be the same.

        ``rebatch``: the batch size may differ from the saved one. The order of the examples does not
        depend on it (each epoch is a permutation, ``position`` counts examples), so the examples
        come in the same order, cut into batches of the new size; the caller keeps the examples per
        optimizer step the same (micro-batch x accumulation).
        """
        settings = [
            ("seed", self.seed),
            ("shuffle", self.shuffle),
            ("drop_last", self.drop_last),
            ("num_examples", len(self.examples)),
        ]
        if not rebatch:
            settings.append(("batch_size", self.batch_size))
        mismatches = [f"{key}: saved {state.get(key)!r}, now {now!r}" for key, now in settings if state.get(key) != now]
        if mismatches:
            raise ValueError(
                "cannot resume the batch order: "
                + "; ".join(mismatches)
                + ". Resume with the same data and batch settings"
            )
        epoch, position = state["epoch"], state["position"]
        if not (
            isinstance(epoch, int) and epoch >= 0 and isinstance(position, int) and 0 <= position <= len(self.examples)
        ):
            raise ValueError(f"invalid batch iterator state: epoch={epoch!r}, position={position!r}")
        self.epoch, self.position = epoch, position
        self._order = self._epoch_order(epoch)
