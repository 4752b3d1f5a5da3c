"""fit --write: the tool's own config back, only the memory keys changed, the input never touched."""

from __future__ import annotations

import json
import os

import pytest

from memfit.errors import PathError
from memfit.interop import read_tool_config
from memfit.interop.writing import check_not_the_input, write_fitted_config

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
    assert text == AXOLOTL.replace("micro_batch_size: 8      # too large", "micro_batch_size: 2      # too large").replace(
        "gradient_accumulation_steps: 1", "gradient_accumulation_steps: 4") + "gradient_checkpointing: true\n"
    changed = [line for line in diff.splitlines() if line[:1] in "+-" and not line.startswith(("+++", "---"))]
    assert changed == ["-micro_batch_size: 8      # too large for my card", "-gradient_accumulation_steps: 1",
                       "+micro_batch_size: 2      # too large for my card", "+gradient_accumulation_steps: 4",
                       "+gradient_checkpointing: true"]
    # What was written reads back as the fit chose.
    assert {k: read_tool_config(out).knobs[k] for k in ("batch_size", "grad_accum", "checkpointing")} == {
        "batch_size": 2, "grad_accum": 4, "checkpointing": "on"}


def test_a_key_already_saying_it_the_tool_s_way_is_left_alone(write_config, tmp_path):
    # adamw_torch_fused and memfit's adamw are the same: no change written.
    config = write_config("axolotl.yml", AXOLOTL)
    assert write_fitted_config(config, _spec(), tmp_path / "same.yml") == ""
    assert (tmp_path / "same.yml").read_text() == AXOLOTL


def test_each_tool_gets_its_own_keys(write_config, tmp_path):
    lf = write_config("lf.yaml", "model_name_or_path: org/model\nstage: sft\nfinetuning_type: lora\nper_device_train_batch_size: 8\n")
    write_fitted_config(lf, _spec(batch_size=4, grad_accum=2, checkpointing="offload"), tmp_path / "lf-out.yaml")
    text = (tmp_path / "lf-out.yaml").read_text()
    assert "per_device_train_batch_size: 4\n" in text and "gradient_accumulation_steps: 2\n" in text
    assert "use_unsloth_gc: true\n" in text
    trl = write_config("trl.json", {"model_name_or_path": "org/model", "use_peft": True, "max_length": 512,
                                    "per_device_train_batch_size": 8, "gradient_checkpointing": False, "optim": "adamw_8bit"})
    write_fitted_config(trl, _spec(batch_size=2, grad_accum=4, checkpointing="on", optimizer="adamw8bit"), tmp_path / "t.json")
    data = json.loads((tmp_path / "t.json").read_text())
    assert list(data) == ["model_name_or_path", "use_peft", "max_length", "per_device_train_batch_size",
                          "gradient_checkpointing", "optim", "gradient_accumulation_steps"]
    assert data["per_device_train_batch_size"] == 2 and data["gradient_checkpointing"] is True and data["optim"] == "adamw_8bit"


def test_a_method_change_writes_the_tool_s_method_keys(write_config, tmp_path):
    config = write_config("axolotl.yml", AXOLOTL)
    write_fitted_config(config, _spec(method="qlora"), tmp_path / "q.yml")
    assert read_tool_config(tmp_path / "q.yml").knobs["method"] == "qlora"


@pytest.mark.parametrize(
    "name, text, keys",
    [
        ("axolotl.yml", AXOLOTL, {"adapter": "lora", "load_in_8bit": True}),
        ("lf.yaml", "model_name_or_path: org/model\nfinetuning_type: lora\nquantization_bit: 4\n", {"quantization_bit": 8}),
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


def test_the_input_is_refused_as_the_output_unless_overwrite(write_config):
    config = write_config("axolotl.yml", AXOLOTL)
    with pytest.raises(PathError, match="is the config being fitted"):
        check_not_the_input(config, config, overwrite=False)
    check_not_the_input(config, config, overwrite=True)
    inode = os.stat(config).st_ino
    write_fitted_config(config, _spec(batch_size=4, grad_accum=2), config, overwrite=True)
    # Replaced by renaming a complete new file over it, never rewritten in place.
    assert os.stat(config).st_ino != inode
    assert "micro_batch_size: 4" in config.read_text() and "# my run: keep this comment" in config.read_text()


def test_an_existing_output_is_not_replaced_without_overwrite(write_config, tmp_path):
    config = write_config("axolotl.yml", AXOLOTL)
    out = tmp_path / "taken.yml"
    out.write_text("mine\n")
    with pytest.raises(PathError, match="exists"):
        write_fitted_config(config, _spec(batch_size=2), out)
    assert out.read_text() == "mine\n"
