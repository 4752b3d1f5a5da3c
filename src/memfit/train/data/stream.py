"""Batches from a stream (``streaming: true``): data larger than memory, read as training goes, and a
run that resumes at exactly the example where it stopped.

The rows come from a ``datasets`` IterableDataset (one source, or a mix of them). Each row is
encoded by :func:`encode_rows` as one JSON string, so the sources of a mix share one schema and a
row can be kept in a checkpoint as it is. Then, in this order:

1. a shuffle buffer of ``shuffle_buffer_size`` rows, memfit's own (seeded with the run's seed):
   each batch draws rows at random from the buffer, which is refilled from the stream. Only rows
   within that distance of each other trade places: a stream sorted by topic stays roughly sorted.
   The buffer is refilled from one pass (epoch) at a time, so every pass hands out each row once.
   ``datasets``' own ``shuffle(buffer_size=...)`` is not used because its
   ``state_dict()`` does not hold the buffer (a resumed run would lose the rows in it and draw
   others); this buffer's rows are saved with the checkpoint;
2. each row becomes an example (normalized and tokenized by the caller's ``to_example``; a row
   that is not valid is skipped with a warning: a stream cannot be checked before it is read);
3. with packing, examples are packed into rows of ``seq_len`` tokens as they come
   (:class:`~memfit.train.data.tokenization.Packer`).

When the stream ends it starts again (``set_epoch``: the mix draws anew, a sharded dataset reads
its shards in another order), so the run goes on for its ``max_steps``. ``state_dict()`` holds the
stream's position (``IterableDataset.state_dict()``), the buffer's rows and its random state, and
the examples made but not yet handed out: :meth:`StreamBatches.load_state_dict` on a new
``StreamBatches`` over the same data continues with exactly the batches the first would have made.
"""

from __future__ import annotations

import json
import random
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from memfit.train.data.errors import DataError

#: The key of the one column of an encoded stream (see :func:`encode_rows`).
ENCODED = "memfit"
#: Skipped rows that each get a warning of their own; later ones are only counted.
WARNED_ROWS = 3


def encode_rows(dataset, source_index: int, columns: dict[str, str], fields: Sequence[str]):
    """``dataset`` (an IterableDataset) with each row as one JSON string ``[source, values]``: the
    source's index in the mix and the values of memfit's ``fields``, after ``columns`` renamed the
    dataset's columns. (A row's place in its source is not kept: after the first pass a dataset
    of several files reads them in another order, so it would not name the row.)"""

    def encode(row: dict[str, Any]) -> dict[str, str]:
        renamed = dict(row)
        for field_name, column in columns.items():
            if column in row:
                renamed.pop(column, None)
                renamed[field_name] = row[column]
        kept = {key: renamed[key] for key in fields if key in renamed}
        return {ENCODED: json.dumps([source_index, kept], default=str, ensure_ascii=False)}

    return dataset.map(encode).select_columns([ENCODED])


class StreamBatches:
    """Endless batches of examples from an encoded stream (see the module docstring), resumable.

    Args:
        dataset: an IterableDataset of :func:`encode_rows` rows.
        to_example: one encoded row -> (a training example or None, why the row is not valid or
            None). A row that is not valid is skipped with a warning, an example with no trained
            token silently; :class:`DataError` is raised for a problem no later row can be free of.
        batch_size: examples (or packed rows) per batch.
        seed: the shuffle buffer's seed.
        shuffle_buffer_size: rows in the shuffle buffer (0 or 1: the stream's order).
        packer: packs examples into rows of ``seq_len`` tokens (None: no packing).
        settings: what must not change on resume (the sources, their formats, packing).
        examples: the examples read when the data was checked (what a rank takes when it has no
            example of its own in a batch).
    """

    def __init__(
        self,
        dataset,
        to_example: Callable[[str], tuple[dict | None, str | None]],
        batch_size: int,
        *,
        seed: int = 0,
        shuffle_buffer_size: int = 1000,
        packer=None,
        settings: dict[str, Any] | None = None,
        examples: Sequence[Any] = (),
    ) -> None:
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        self.dataset = dataset
        self.to_example = to_example
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle_buffer_size = shuffle_buffer_size
        self.packer = packer
        self.settings = dict(settings or {})
        self.examples = list(examples)
        self.epoch = 0
        self.rows_read = 0  # rows taken from the stream this epoch
        self.made = 0  # examples made this epoch
        self.ended = False  # this epoch's rows are all read (the buffer holds the last of them)
        self.skipped = 0
        self.handed_out = 0  # examples (or packed rows) handed out by this object, whatever the epoch (not saved)
        self.buffer: list[str] = []
        self.ready: list[dict[str, Any]] = []  # examples made, not yet handed out
        self._rng = random.Random(f"memfit-stream-{seed}")
        self._rows = None  # the iterator over the stream, started on first use
        self._loaded: dict[str, Any] | None = None  # the stream position loaded, until the stream is read again

    def batches_per_epoch(self) -> None:
        """None: a stream has no length (a streamed run counts ``max_steps``)."""
        return None

    def epochs_done(self) -> None:
        """None: a stream has no length to count epochs in."""
        return None

    def __iter__(self):
        return self

    def __next__(self) -> list[dict[str, Any]]:
        while len(self.ready) < self.batch_size:
            example, problem = self.to_example(self._next_row())
            if problem is not None:
                self._skipped(problem)
            if example is None:
                continue
            self.made += 1
            self.ready += self.packer.add(example) if self.packer is not None else [example]
        batch, self.ready = self.ready[: self.batch_size], self.ready[self.batch_size :]
        self.handed_out += len(batch)
        return batch

    def _next_row(self) -> str:
        # The buffer is refilled from this pass over the stream only: the rows of one epoch are all
        # drawn before the next epoch's first, so every epoch hands out every row once.
        while len(self.buffer) < max(1, self.shuffle_buffer_size) and not self.ended:
            row = self._pull()
            if row is None:
                self.ended = True
            else:
                self.buffer.append(row)
        if not self.buffer:
            self._next_epoch()
            return self._next_row()
        # A random row, with the last one moved into its place: O(1), and the buffer stays a list
        # (its order is part of the state, restored as saved).
        index = self._rng.randrange(len(self.buffer)) if self.shuffle_buffer_size > 1 else 0
        row = self.buffer[index]
        self.buffer[index] = self.buffer[-1]
        self.buffer.pop()
        return row

    def _pull(self) -> str | None:
        """The stream's next row (None at its end)."""
        if self._rows is None:
            self._set_epoch()
            self._rows, self._loaded = iter(self.dataset), None
        row = next(self._rows, None)
        if row is None:
            return None
        self.rows_read += 1
        return row[ENCODED]

    def _set_epoch(self) -> None:
        # Only when it changes: datasets keeps the epoch in a shared torch tensor (for DataLoader
        # workers) and sets it with tensor arithmetic, which the memory recorder of a CPU run (whose
        # device is the host) counted as 512 B more than the plan when it was set before step 1.
        if self.dataset.epoch != self.epoch:
            self.dataset.set_epoch(self.epoch)

    def _next_epoch(self) -> None:
        if self.rows_read == 0:
            raise DataError("the training data stream has no rows: check the sources' split and data files")
        if self.made == 0:
            raise DataError(
                f"no row of the training data stream ({self.rows_read} rows) makes an example with a trained "
                "token: raise seq_len, or check the rows (the warnings say why rows were skipped)"
            )
        self.epoch, self.rows_read, self.made, self.ended, self._rows = self.epoch + 1, 0, 0, False, None

    def _skipped(self, message: str) -> None:
        """Say that a row was skipped: the first few each with their reason; later ones are counted
        (``skipped`` in the state, and in the run's checkpoints)."""
        self.skipped += 1
        if self.skipped <= WARNED_ROWS:
            more = " (later skipped rows are counted, not listed)" if self.skipped == WARNED_ROWS else ""
            warnings.warn(f"skipped a row of the training stream: {message}{more}", stacklevel=2)

    def state_dict(self) -> dict[str, Any]:
        """Where the stream stands (plain lists, numbers and strings: it goes into a checkpoint)."""
        state = {
            "stream": True,
            "epoch": self.epoch,
            "rows_read": self.rows_read,
            "made": self.made,
            "ended": self.ended,
            "skipped": self.skipped,
            "dataset": self.dataset.state_dict() if self._rows is not None else self._loaded,
            "buffer": list(self.buffer),
            "rng": self._rng.getstate(),
            "ready": [dict(example) for example in self.ready],
            "packer": self.packer.state_dict() if self.packer is not None else None,
            "seed": self.seed,
            "batch_size": self.batch_size,
            "shuffle_buffer_size": self.shuffle_buffer_size,
            "settings": self.settings,
        }
        return _plain(state)

    def load_state_dict(self, state: dict[str, Any], *, rebatch: bool = False) -> None:
        """Continue from a :meth:`state_dict`. Raises ValueError when the data or the settings differ
        from the run that saved it. ``rebatch``: the batch size may differ (the examples come in the
        same order, cut into batches of the new size)."""
        if not state.get("stream"):
            raise ValueError(
                "the checkpoint's data position is of data read in memory, not of a stream: "
                "resume with the same streaming setting"
            )
        now = {"seed": self.seed, "shuffle_buffer_size": self.shuffle_buffer_size, "settings": _plain(self.settings)}
        if not rebatch:
            now["batch_size"] = self.batch_size
        mismatches = [
            f"{key}: saved {state.get(key)!r}, now {value!r}" for key, value in now.items() if state.get(key) != value
        ]
        if mismatches:
            raise ValueError(
                "cannot resume the stream: " + "; ".join(mismatches) + ". Resume with the same data and batch settings"
            )
        self.epoch, self.rows_read, self.made = int(state["epoch"]), int(state["rows_read"]), int(state["made"])
        self.ended, self.skipped = bool(state["ended"]), int(state["skipped"])
        self.buffer = list(state["buffer"])
        version, internal, gauss = state["rng"]
        self._rng.setstate((version, tuple(internal), gauss))
        self.ready = [dict(example) for example in state["ready"]]
        if self.packer is not None and state["packer"] is not None:
            self.packer.load_state_dict(state["packer"])
        self._set_epoch()
        if state["dataset"] is not None:
            self.dataset.load_state_dict(state["dataset"])
        self._rows, self._loaded = None, state["dataset"]


def _plain(value: Any) -> Any:
    """``value`` with tuples as lists and numpy numbers as Python's: what a checkpoint may hold and
    ``torch.load(weights_only=True)`` reads back."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
        return _plain(value.tolist())
    return value
