"""Batches from a stream (memfit.train.data.stream): a resumed stream hands out exactly the batches
an uninterrupted one does, through a mix, the shuffle buffer, epoch ends and packing."""

from __future__ import annotations

import io
import json
import warnings

import pytest

datasets = pytest.importorskip("datasets")
torch = pytest.importorskip("torch")

from memfit.train.data.errors import DataError  # noqa: E402
from memfit.train.data.mixing import mix_streams  # noqa: E402
from memfit.train.data.stream import StreamBatches, encode_rows  # noqa: E402
from memfit.train.data.tokenization import Packer  # noqa: E402


def stream(sizes=(37, 11), weights=(0.7, 0.3), shards=(3, 2)):
    """Sources of ``sizes`` rows (``{"text": ...}``), as IterableDatasets of several shards, mixed."""
    parts = []
    for index, (size, num_shards) in enumerate(zip(sizes, shards)):
        rows = [{"text": f"s{index}-r{i}", "extra": i} for i in range(size)]
        dataset = datasets.Dataset.from_list(rows).to_iterable_dataset(num_shards=num_shards)
        parts.append(encode_rows(dataset, index, {}, ["text"]))
    return mix_streams(parts, list(weights) if weights else None, seed=5)


def decoded(encoded: str):
    """A row as an 'example' whose tokens say which row it is (what the tests compare)."""
    source, values = json.loads(encoded)
    row = int(values["text"].split("-r")[1])
    return {"input_ids": [source, row, len(values["text"])], "labels": [source, row, 1]}, None


def batches(buffer: int = 8, batch_size: int = 3, packer=None, to_example=decoded, **kwargs) -> StreamBatches:
    return StreamBatches(
        stream(**kwargs),
        to_example,
        batch_size,
        seed=1,
        shuffle_buffer_size=buffer,
        packer=packer,
        settings={"sources": ["a", "b"]},
    )


def through_a_checkpoint(state: dict) -> dict:
    """``state`` as a resumed run reads it: saved with torch.save, loaded with weights_only=True."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def drawn(count: int, stop: int | None = None, make=batches, **kwargs) -> list:
    it = make(**kwargs)
    out = []
    for index in range(count):
        if index == stop:
            state = through_a_checkpoint(it.state_dict())
            it = make(**kwargs)
            it.load_state_dict(state)
        out.append(next(it))
    return out


@pytest.mark.parametrize("buffer", [0, 8])
def test_a_resumed_stream_continues_with_the_same_batches(buffer):
    want = drawn(45, buffer=buffer)  # 135 rows: the mix (about 53 rows a pass) ends twice
    for stop in (0, 1, 7, 17, 18, 30, 44):
        assert drawn(45, stop, buffer=buffer) == want, stop


def test_every_epoch_hands_out_every_row_of_each_source():
    it = batches(buffer=8, batch_size=1, weights=None)  # concatenated: a pass is every row once
    passes = []
    for _ in range(2):
        rows = [tuple(next(it)[0]["input_ids"][:2]) for _ in range(48)]
        passes.append(rows)
        assert sorted(rows) == sorted([(0, i) for i in range(37)] + [(1, i) for i in range(11)])
    assert passes[0] != passes[1]  # each pass in another order
    assert it.epoch == 1


def test_the_buffer_shuffles_nearby_rows_only():
    it = batches(buffer=4, batch_size=1, weights=None, sizes=(40,), shards=(1,))
    rows = [next(it)[0]["input_ids"][1] for _ in range(40)]
    assert sorted(rows) == list(range(40)) and rows != list(range(40))
    # The k-th row drawn was read at most a buffer's length (4 rows) after the k-th row of the stream.
    assert max(row - index for index, row in enumerate(rows)) <= 3


def test_packing_a_stream_resumes_with_the_tokens_that_wait_for_a_row():
    def make(**kwargs):
        return batches(buffer=8, batch_size=2, packer=Packer(seq_len=5, eos_id=9), **kwargs)

    want = drawn(30, make=make)
    assert all(len(row["input_ids"]) == 5 for batch in want for row in batch)
    for stop in (1, 11, 29):
        assert drawn(30, stop, make=make) == want, stop


def test_rows_that_are_not_valid_are_skipped_with_a_warning_and_counted():
    def some_invalid(encoded: str):
        example, _ = decoded(encoded)
        if example["input_ids"][1] % 5 == 0:
            return None, f"row {example['input_ids'][1]}: text: empty text"
        return example, None

    it = batches(buffer=0, batch_size=4, to_example=some_invalid, weights=None, sizes=(40,), shards=(1,))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rows = [example["input_ids"][1] for _ in range(8) for example in next(it)]
    assert rows == [i for i in range(40) if i % 5][:32]
    messages = [str(w.message) for w in caught]
    assert len(messages) == 3 and "skipped a row of the training stream: row 0: text: empty text" in messages[0]
    assert "later skipped rows are counted" in messages[2]
    assert it.state_dict()["skipped"] == 8


def test_a_stream_of_no_usable_rows_stops_with_a_clear_error():
    with pytest.raises(DataError, match="makes an example with a trained token"):
        next(batches(to_example=lambda encoded: (None, None)))
    empty = datasets.Dataset.from_list([{"text": "x"}]).to_iterable_dataset().filter(lambda row: False)
    with pytest.raises(DataError, match="stream has no rows"):
        next(StreamBatches(encode_rows(empty, 0, {}, ["text"]), decoded, 2))


def test_a_state_from_other_data_or_settings_is_refused():
    state = through_a_checkpoint(batches().state_dict())
    other = StreamBatches(stream(), decoded, 3, seed=2, shuffle_buffer_size=8, settings={"sources": ["a", "c"]})
    with pytest.raises(ValueError, match=r"seed: saved 1, now 2"):
        other.load_state_dict(state)
    with pytest.raises(ValueError, match="settings: saved"):
        StreamBatches(
            stream(), decoded, 3, seed=1, shuffle_buffer_size=8, settings={"sources": ["a", "c"]}
        ).load_state_dict(state)
    with pytest.raises(ValueError, match="batch_size: saved 3, now 4"):
        batches(batch_size=4).load_state_dict(state)
    rebatched = batches(batch_size=4)
    rebatched.load_state_dict(state, rebatch=True)  # another micro-batch size, the same examples in the same order
    with pytest.raises(ValueError, match="not of a stream"):
        batches().load_state_dict({"epoch": 0, "position": 3})


def test_a_stream_has_no_length():
    assert batches().batches_per_epoch() is None and batches().epochs_done() is None


def test_a_stream_counts_the_examples_it_handed_out():
    stream_batches = batches()
    sizes = [len(next(stream_batches)) for _ in range(4)]
    assert stream_batches.handed_out == sum(sizes) == 12


@pytest.mark.slow
@pytest.mark.parametrize("settings", [{}, {"packing": True, "batch_size": 2}], ids=["padding-free", "packing"])
def test_a_streamed_run_peaks_at_its_plan(settings, tmp_path):
    # Plan equals run (memfit.train.conformance): the trainer reads the data as a stream, the plan is
    # made at seq_len, and every example of the harness's data is seq_len tokens long.
    from memfit.train.conformance import measure

    cell = measure(
        "llama lora streaming",
        {"model": "llama", "method": "lora", "precision": "bf16", "streaming": True, **settings},
        tmp_path,
    )
    assert not cell.error, cell.error
    assert cell.measured_bytes > 0 and cell.difference_bytes == 0, (cell.measured_categories, cell.planned_categories)
    assert cell.measured_phase == cell.planned_phase
