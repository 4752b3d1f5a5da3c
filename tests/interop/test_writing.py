"""fit --write: the tool's own config back, only the memory keys changed, the input never touched."""

from __future__ import annotations

import json
import os

import pytest

from memfit.errors import PathError
from memfit.interop import read_tool_config
from memfit.interop.writing import edit_json_text, write_fitted_config

AXOLOTL = """\
# my run: keep this comment
base_model: org/model   # the model
adapter: lora
lora_target_modules:
  - q_proj
  - v_proj
sequence_len: 2048
micro_batch_size: 8      # too large for my card
gradient_accumulation_steps: 1
optimizer: adamw_torch_fused
wandb_project: "runs"
"""


def _spec(**changes):
    spec = {"method": "lora", "batch_size": 8, "grad_accum": 1, "checkpointing": "off", "optimizer": "adamw"}
    spec.update(changes)
    return spec


def test_only_the_memory_keys_change_comments_order_and_quotes_stay(write_config, tmp_path):
    config = write_config("axolotl.yml", AXOLOTL)
    before = config.read_bytes()
    out = tmp_path / "fitted.yml"
    diff = write_fitted_config(config, _spec(batch_size=2, grad_accum=4, checkpointing="on"), out)
    assert config.read_bytes() == before  # the input is never touched
    text = out.read_text()
    assert (
        text
        == AXOLOTL.replace("micro_batch_size: 8      # too large", "micro_batch_size: 2      # too large").replace(
            "gradient_accumulation_steps: 1", "gradient_accumulation_steps: 4"
        )
        + "gradient_checkpointing: true\n"
    )
    changed = [line for line in diff.splitlines() if line[:1] in "+-" and not line.startswith(("+++", "---"))]
    assert changed == [
        "-micro_batch_size: 8      # too large for my card",
        "-gradient_accumulation_steps: 1",
        "+micro_batch_size: 2      # too large for my card",
        "+gradient_accumulation_steps: 4",
        "+gradient_checkpointing: true",
    ]
    # What was written reads back as the fit chose.
    assert {k: read_tool_config(out).knobs[k] for k in ("batch_size", "grad_accum", "checkpointing")} == {
        "batch_size": 2,
        "grad_accum": 4,
        "checkpointing": "on",
    }


def test_a_key_already_saying_it_the_tool_s_way_is_left_alone(write_config, tmp_path):
    # adamw_torch_fused and memfit's adamw are the same: no change written.
    config = write_config("axolotl.yml", AXOLOTL)
    assert write_fitted_config(config, _spec(), tmp_path / "same.yml") == ""
    assert (tmp_path / "same.yml").read_text() == AXOLOTL


def test_each_tool_gets_its_own_keys(write_config, tmp_path):
    lf = write_config(
        "lf.yaml", "model_name_or_path: org/model\nstage: sft\nfinetuning_type: lora\nper_device_train_batch_size: 8\n"
    )
    write_fitted_config(lf, _spec(batch_size=4, grad_accum=2, checkpointing="offload"), tmp_path / "lf-out.yaml")
    text = (tmp_path / "lf-out.yaml").read_text()
    assert "per_device_train_batch_size: 4\n" in text and "gradient_accumulation_steps: 2\n" in text
    assert "use_unsloth_gc: true\n" in text
    trl = write_config(
        "trl.json",
        {
            "model_name_or_path": "org/model",
            "use_peft": True,
            "max_length": 512,
            "per_device_train_batch_size": 8,
            "gradient_checkpointing": False,
            "optim": "adamw_8bit",
        },
    )
    write_fitted_config(
        trl, _spec(batch_size=2, grad_accum=4, checkpointing="on", optimizer="adamw8bit"), tmp_path / "t.json"
    )
    data = json.loads((tmp_path / "t.json").read_text())
    assert list(data) == [
        "model_name_or_path",
        "use_peft",
        "max_length",
        "per_device_train_batch_size",
        "gradient_checkpointing",
        "optim",
        "gradient_accumulation_steps",
    ]
    assert (
        data["per_device_train_batch_size"] == 2
        and data["gradient_checkpointing"] is True
        and data["optim"] == "adamw_8bit"
    )


def test_a_method_change_writes_the_tool_s_method_keys(write_config, tmp_path):
    config = write_config("axolotl.yml", AXOLOTL)
    write_fitted_config(config, _spec(method="qlora"), tmp_path / "q.yml")
    assert read_tool_config(tmp_path / "q.yml").knobs["method"] == "qlora"


@pytest.mark.parametrize(
    "name, text, keys",
    [
        ("axolotl.yml", AXOLOTL, {"adapter": "lora", "load_in_8bit": True}),
        (
            "lf.yaml",
            "model_name_or_path: org/model\nfinetuning_type: lora\nquantization_bit: 4\n",
            {"quantization_bit": 8},
        ),
        ("trl.yaml", "model_name_or_path: org/model\nuse_peft: true\n", {"use_peft": True, "load_in_8bit": True}),
    ],
)
def test_an_8bit_base_is_written_as_each_tool_asks_for_it(write_config, tmp_path, name, text, keys):
    from ruamel.yaml import YAML

    config = write_config(name, text)
    write_fitted_config(config, _spec(method="lora-8bit"), tmp_path / ("8bit-" + name))
    written = YAML(typ="safe").load((tmp_path / ("8bit-" + name)).read_text())
    assert {k: written.get(k) for k in keys} == keys
    assert read_tool_config(tmp_path / ("8bit-" + name)).knobs["method"] == "lora-8bit"
    write_fitted_config(tmp_path / ("8bit-" + name), _spec(method="lora"), tmp_path / ("back-" + name))  # and back
    assert read_tool_config(tmp_path / ("back-" + name)).knobs["method"] == "lora"


def test_trl_s_8bit_key_is_written_only_where_it_says_something(write_config, tmp_path):
    config = write_config("trl.yaml", "model_name_or_path: org/model\nuse_peft: true\n")
    write_fitted_config(config, _spec(method="qlora"), tmp_path / "q.yaml")
    text = (tmp_path / "q.yaml").read_text()
    assert "load_in_4bit: true" in text and "load_in_8bit" not in text


def test_the_input_is_never_the_output_not_even_with_overwrite(write_config, tmp_path):
    config = write_config("axolotl.yml", AXOLOTL)
    before = config.read_bytes()
    link = tmp_path / "link.yml"
    link.symlink_to(config)
    hard = tmp_path / "hard.yml"
    os.link(config, hard)
    for out in (config, link, hard, tmp_path / "." / "axolotl.yml"):
        with pytest.raises(
            PathError, match="is the config being fitted.*memfit never writes over its inputs, --overwrite or not"
        ):
            write_fitted_config(config, _spec(batch_size=4, grad_accum=2), out, overwrite=True)
    assert config.read_bytes() == before


def test_a_json_config_keeps_every_byte_but_the_memory_keys(write_config, tmp_path):
    text = (
        '{"model_name_or_path": "org/model", "use_peft": true, "learning_rate": 2e-5, "gradient_checkpointing": false, '
        '"per_device_train_batch_size": 8}\n'
    )
    config = tmp_path / "trl.json"
    config.write_text(text)
    diff = write_fitted_config(config, _spec(batch_size=2, grad_accum=4), tmp_path / "out.json")
    written = (tmp_path / "out.json").read_text()
    assert written == (
        '{"model_name_or_path": "org/model", "use_peft": true, "learning_rate": 2e-5, "gradient_checkpointing": false, '
        '"per_device_train_batch_size": 2, "gradient_accumulation_steps": 4}\n'
    )  # one line stays one line, 2e-5 stays 2e-5
    assert diff.count("\n-") == 1 and diff.count("\n+{") == 1


def test_json_text_edits_replace_values_in_place_and_add_keys_spaced_as_the_others():
    indented = '{\n    "a": 1e-4,\n    "b": [1, {"c": "}"}],\n    "d": 8\n}\n'
    assert (
        edit_json_text(indented, {"d": 2, "e": True})
        == '{\n    "a": 1e-4,\n    "b": [1, {"c": "}"}],\n    "d": 2,\n    "e": true\n}\n'
    )
    assert edit_json_text('{"a":1}', {"b": "x"}) == '{"a":1,"b":"x"}'
    assert edit_json_text("{}", {"a": 1, "b": 2}) == '{"a": 1, "b": 2}'
    assert edit_json_text('{"a": 1, "a": 2}', {"a": 3}) == '{"a": 1, "a": 3}'  # the value a JSON reader keeps


def test_the_output_s_extension_says_its_format(write_config, tmp_path):
    config = write_config("axolotl.yml", AXOLOTL)
    write_fitted_config(config, _spec(batch_size=2), tmp_path / "fitted.json")
    data = json.loads((tmp_path / "fitted.json").read_text())  # JSON, not YAML in a .json file
    assert data["micro_batch_size"] == 2 and data["lora_target_modules"] == ["q_proj", "v_proj"]
    assert read_tool_config(tmp_path / "fitted.json").knobs["batch_size"] == 2
    trl = write_config(
        "trl.json", {"model_name_or_path": "org/model", "use_peft": True, "per_device_train_batch_size": 8}
    )
    write_fitted_config(trl, _spec(batch_size=2), tmp_path / "trl-out.yaml")
    text = (tmp_path / "trl-out.yaml").read_text()
    assert not text.startswith("{") and "per_device_train_batch_size: 2\n" in text
    write_fitted_config(trl, _spec(batch_size=4), tmp_path / "trl-out.txt")  # no format in the name: the config's own
    assert json.loads((tmp_path / "trl-out.txt").read_text())["per_device_train_batch_size"] == 4


def test_the_output_s_folder_is_made(write_config, tmp_path):
    config = write_config("axolotl.yml", AXOLOTL)
    write_fitted_config(config, _spec(batch_size=2), tmp_path / "new" / "folder" / "fitted.yml")
    assert "micro_batch_size: 2" in (tmp_path / "new" / "folder" / "fitted.yml").read_text()


def test_an_existing_output_is_not_replaced_without_overwrite(write_config, tmp_path):
    config = write_config("axolotl.yml", AXOLOTL)
    out = tmp_path / "taken.yml"
    out.write_text("mine\n")
    with pytest.raises(PathError, match="exists"):
        write_fitted_config(config, _spec(batch_size=2), out)
    assert out.read_text() == "mine\n"
