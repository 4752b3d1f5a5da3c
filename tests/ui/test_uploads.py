"""Dropped files are read as data, size-limited, and kept by a name made from their content."""

import json

import pytest

from memfit.ui.uploads import MAX_UPLOAD_BYTES, UploadError, UploadStore, is_upload_name


def test_a_config_json_is_kept_under_a_name_from_its_content():
    store = UploadStore()
    config = {"model_type": "llama", "hidden_size": 64}
    first = store.add(json.dumps(config).encode(), "config.json")
    again = store.add(json.dumps(config, indent=2).encode(), "other.json")
    assert is_upload_name(first.name) and first.name == again.name
    assert store.get(first.name).config == config


@pytest.mark.parametrize(
    "data, says",
    [
        (b"{not json", "not valid JSON"),
        (b"[1, 2]", "holds a JSON list, not an object"),
        (b'{"hidden_size": 64}', "has no model_type"),
        (b"\xff\xfe", "not UTF-8 text"),
    ],
)
def test_a_file_that_is_not_a_config_is_one_line(data, says):
    with pytest.raises(UploadError, match=says) as err:
        UploadStore().add(data, "config.json")
    assert "\n" not in str(err.value)


def test_size_and_kind_are_checked_before_reading():
    with pytest.raises(UploadError, match="more than 1 MiB"):
        UploadStore().add(b" " * (MAX_UPLOAD_BYTES + 1), "config.json")
    with pytest.raises(UploadError, match="drop a model's config.json"):
        UploadStore().add(b"x", "model.safetensors")


def test_the_oldest_is_forgotten_and_asking_for_it_says_to_drop_it_again():
    store = UploadStore(max_kept=2)
    names = [store.add(json.dumps({"model_type": "llama", "n": i}).encode(), "config.json").name for i in range(3)]
    assert store.get(names[2]) and store.get(names[1])
    with pytest.raises(UploadError, match="drop the file on the page again"):
        store.get(names[0])
