"""TRL's vision format read and tokenized: image parts in the messages, an images column of paths
(relative to the data file) or of datasets Image features; labels on the assistant turns."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from memfit.step.labels import IGNORE_INDEX
from memfit.train.data import DataError, load_records
from memfit.train.data.vision import tokenize_vision_records

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "vlm-tiny"


def _record(images: list, parts: int = 1, answer: str = "A red circle.") -> dict:
    content = [{"type": "image"}] * parts + [{"type": "text", "text": "What is it?"}]
    return {
        "messages": [{"role": "user", "content": content}, {"role": "assistant", "content": answer}],
        "images": images,
    }


def _write(folder: Path, records: list[dict]) -> Path:
    path = folder / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture(scope="module")
def processor():
    from memfit.models.build import make_config
    from memfit.train.processor import tiny_processor

    return tiny_processor(make_config(json.loads((EXAMPLE / "config.json").read_text())))


def _tokenize(records, processor, **changes):
    knobs = dict(seq_len=64, max_images=1, max_pixels=768 * 768, model_type="llava") | changes
    return tokenize_vision_records(records, processor, **knobs)


def test_image_parts_and_relative_paths_are_read(tmp_path):
    (tmp_path / "pics").mkdir()
    path = _write(tmp_path, [_record(["pics/a.png"])])
    records, fmt = load_records(path)
    assert fmt == "messages"
    assert records[0]["images"] == [str(tmp_path / "pics" / "a.png")]
    assert records[0]["messages"][0]["content"][0] == {"type": "image"}


def test_images_that_do_not_match_the_image_parts_are_refused_naming_the_line(tmp_path):
    path = _write(tmp_path, [_record(["a.png"]), _record(["a.png"], parts=2)])
    with pytest.raises(DataError, match=r"data.jsonl, line 2: images: 1 image\(s\) but 2 image part\(s\)"):
        load_records(path)


def test_a_text_only_list_of_parts_is_a_string_turn(tmp_path):
    record = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
            {"role": "assistant", "content": "Yo"},
        ]
    }
    records, _ = load_records(_write(tmp_path, [record]))
    assert records[0]["messages"][0]["content"] == "Hi" and "images" not in records[0]


def test_labels_are_the_assistant_turns_and_never_an_image_token(processor):
    records, _ = load_records(EXAMPLE / "data.jsonl")
    example = _tokenize(records[:2], processor)[0]
    ids, labels = example["input_ids"], example["labels"]
    assert ids.count(512) == 16 and example["pixel_values"].shape == (1, 3, 56, 56)
    trained = processor.tokenizer.decode([t for t, label in zip(ids, labels) if label != IGNORE_INDEX])
    assert trained.startswith("A ") and trained.rstrip().endswith("<|end|>")
    assert all(label == IGNORE_INDEX for token, label in zip(ids, labels) if token == 512)


def test_images_from_a_datasets_image_feature_are_read(tmp_path, processor):
    import datasets

    rows = [_record([str(EXAMPLE / "images" / "red-circle.png")])]
    rows[0]["messages"][1]["content"] = [{"type": "text", "text": "A red circle."}]  # one column type for arrow
    dataset = datasets.Dataset.from_list(rows).cast_column("images", datasets.Sequence(datasets.Image()))
    dataset.to_parquet(str(tmp_path / "train.parquet"))
    records, _ = load_records(tmp_path / "train.parquet")
    assert _tokenize(records, processor)[0]["input_ids"].count(512) == 16


def test_a_missing_image_names_the_record_and_the_fix(tmp_path, processor):
    records, _ = load_records(_write(tmp_path, [_record(["gone.png"])]))
    with pytest.raises(DataError, match=r"line 1: images\[0\]: no file .*gone.png; give the image's path"):
        _tokenize(records, processor)


def test_an_unreadable_image_names_the_record(tmp_path, processor):
    (tmp_path / "bad.png").write_text("not a picture")
    records, _ = load_records(_write(tmp_path, [_record(["bad.png"])]))
    with pytest.raises(DataError, match=r"line 1: images\[0\]: cannot read .*bad.png as an image"):
        _tokenize(records, processor)


def test_image_tokens_past_seq_len_and_too_many_images_are_refused(tmp_path, processor):
    shutil.copy(EXAMPLE / "images" / "red-circle.png", tmp_path / "a.png")
    records, _ = load_records(_write(tmp_path, [_record(["a.png"])]))
    with pytest.raises(DataError, match=r"seq_len: 10 cuts its image tokens .* raise seq_len to \d+"):
        _tokenize(records, processor, seq_len=10)
    two, _ = load_records(_write(tmp_path, [_record(["a.png", "a.png"], parts=2)]))
    with pytest.raises(DataError, match=r"2 images, more than images: 1 .*set images: 2"):
        _tokenize(two, processor)
