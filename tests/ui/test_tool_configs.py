"""Other tools' training configs dropped on the page: read as memfit plan reads them, with the
DeepSpeed JSON they name dropped beside them, and never a file of the server's that they name."""

from __future__ import annotations

import json
import textwrap

import pytest

from memfit.ui.uploads import UploadError, UploadStore, is_upload_name

AXOLOTL = textwrap.dedent("""\
    base_model: smollm2-135m
    adapter: lora
    lora_r: 8
    lora_alpha: 16
    lora_target_linear: true
    sequence_len: 64
    micro_batch_size: 1
    gradient_accumulation_steps: 2
    gradient_checkpointing: true
    bf16: true
""")
ZERO2 = json.dumps({"zero_optimization": {"stage": 2}})


def test_an_axolotl_yaml_is_read_as_memfit_plan_reads_it():
    store = UploadStore()
    upload = store.add(AXOLOTL.encode(), "axolotl.yml")
    assert is_upload_name(upload.name) and store.get(upload.name) is upload
    assert upload.tool.title == "Axolotl" and upload.tool.model == "smollm2-135m"
    # The form shows the config's knobs as the command line's option text.
    assert upload.tool.knobs["method"] == "lora" and upload.tool.knobs["rank"] == "8"
    assert upload.tool.knobs["seq_len"] == "64" and upload.tool.knobs["grad_accum"] == "2"
    assert upload.describe()["base_model"] == "smollm2-135m" and upload.planned == str(upload.tool.path)


def test_the_deepspeed_json_it_names_must_be_dropped_with_it():
    config = AXOLOTL + "deepspeed: /home/someone/configs/ds_z2.json\n"
    with pytest.raises(
        UploadError, match=r"deepspeed: names '/home/someone/configs/ds_z2.json'; drop that file together"
    ) as err:
        UploadStore().add(config.encode(), "axolotl.yml")
    assert "\n" not in str(err.value)

    # Dropped together, the file is found by its name, wherever the config says it was.
    store = UploadStore()
    upload = store.add_files({"axolotl.yml": config.encode(), "ds_z2.json": ZERO2.encode()})
    folder = upload.tool.path.parent
    assert sorted(p.name for p in folder.iterdir()) == ["axolotl.yml", "ds_z2.json"]
    assert "deepspeed: ds_z2.json" in upload.tool.path.read_text()
    assert upload.tool.knobs.get("shard") is None  # one GPU: ZeRO shards nothing (as memfit plan says)


def test_a_model_folder_on_the_server_is_refused():
    config = AXOLOTL.replace("base_model: smollm2-135m", "base_model: /srv/models/llama")
    with pytest.raises(
        UploadError, match=r"base_model: '/srv/models/llama' is a folder on this machine.*memfit plan axolotl.yml"
    ):
        UploadStore().add(config.encode(), "axolotl.yml")


@pytest.mark.parametrize(
    "files, says",
    [
        ({"ds_z2.json": ZERO2}, "is a DeepSpeed config: pass the training config that names it"),
        ({"a.yml": AXOLOTL, "b.yml": AXOLOTL}, "a.yml, b.yml: drop one config at a time"),
        ({"config.json": json.dumps({"model_type": "llama"}), "ds_z2.json": ZERO2}, "drop one config at a time"),
        ({"axolotl.yml": "base_model: [unclosed"}, "axolotl.yml: not valid YAML"),
        ({"axolotl.yml": "- a list"}, "holds a list, not a config of keys and values"),
        ({"axolotl.yml": AXOLOTL.replace("lora_r: 8", "lora_r: eight")}, "cannot plan axolotl.yml"),
    ],
)
def test_what_cannot_be_planned_is_one_clear_error(files, says):
    store = UploadStore()
    with pytest.raises(UploadError, match=says) as err:
        store.add_files({name: text.encode() for name, text in files.items()})
    assert "memfit-ui-configs" not in str(err.value)  # the server's folder is never shown
    if store._folder is not None:  # and nothing of a config that cannot be planned is kept
        assert list(store._folder.iterdir()) == []


def test_the_server_s_copies_go_with_the_oldest_upload_and_the_store():
    store = UploadStore(max_kept=1)
    first = store.add(AXOLOTL.encode(), "axolotl.yml")
    folder = first.tool.path.parent
    store.add(AXOLOTL.replace("lora_r: 8", "lora_r: 4").encode(), "axolotl.yml")
    assert not folder.exists()
    root = folder.parent
    del store, first
    import gc

    gc.collect()
    assert not root.exists()
