"""A mix of sources: which source each example comes from, drawn by ``datasets.interleave_datasets``
with the sources' weights as probabilities and the run's seed.

``stopping_strategy`` is the library's: ``all_exhausted`` (memfit's default) ends the mix once
every example of every source has been drawn at least once, so a source that runs out first starts
again from its beginning (oversampled); ``first_exhausted`` ends it when the first source runs
out, so the others are partly left out (undersampled). In memory, the mix is drawn once and is the
run's data: one epoch is one pass over it, in an order shuffled per epoch like any data. A stream
(:func:`mix_streams`) draws as it goes and starts again when the mix ends.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

STOPPING_STRATEGIES = ("all_exhausted", "first_exhausted")


def mix_order(
    lengths: Sequence[int], probabilities: Sequence[float], seed: int, stopping_strategy: str = "all_exhausted"
) -> list[tuple[int, int]]:
    """(source, row) of every example of the mix of sources of ``lengths`` rows, in mix order.

    Only the indices go through ``datasets`` (one column each), so the mix of sources of any
    format is the same, and costs nothing but the draw.
    """
    from datasets import Dataset, interleave_datasets

    parts = [
        Dataset.from_dict({"source": [index] * length, "row": list(range(length))})
        for index, length in enumerate(lengths)
    ]
    mixed = interleave_datasets(
        parts, probabilities=list(probabilities), seed=seed, stopping_strategy=stopping_strategy
    )
    return list(zip(mixed["source"], mixed["row"]))


def mix_records(
    per_source: Sequence[Sequence[Any]],
    probabilities: Sequence[float],
    seed: int,
    stopping_strategy: str = "all_exhausted",
) -> list[Any]:
    """The records of a mix of sources (``per_source``: each source's records), in mix order."""
    order = mix_order([len(records) for records in per_source], probabilities, seed, stopping_strategy)
    return [per_source[source][row] for source, row in order]


def mix_streams(
    streams: Sequence[Any], probabilities: Sequence[float] | None, seed: int, stopping_strategy: str = "all_exhausted"
):
    """One IterableDataset drawing from ``streams`` (IterableDatasets of one shared schema) with
    ``probabilities`` (None: the streams concatenated, one after the other)."""
    from datasets import concatenate_datasets, interleave_datasets

    if len(streams) == 1:
        return streams[0]
    if probabilities is None:
        return concatenate_datasets(list(streams))
    return interleave_datasets(
        list(streams), probabilities=list(probabilities), seed=seed, stopping_strategy=stopping_strategy
    )
