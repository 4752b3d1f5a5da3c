"""'Copy as CLI' gives the command whose --json is the page's answer; 'copy as YAML' a config memfit train takes."""

from pathlib import Path

import yaml

from memfit.ui.export import command_line, train_yaml


def test_the_command_line_of_the_page_settings():
    params = {
        "model": ["llama-3.1-8b"],
        "gpu": ["rtx-4090"],
        "seq-len": ["4096"],
        "packing": ["true"],
        "exact": ["false"],
    }
    assert command_line("plan", params) == "memfit plan llama-3.1-8b --gpu rtx-4090 --seq-len 4096 --packing"
    assert (
        command_line("fit", {"batch_size": ["16"], "budget": ["20 GiB"]})
        == "memfit fit smollm2-135m --batch-size 16 --budget '20 GiB'"
    )
    assert (
        command_line("plan", {"model": ["upload-0123456789ab"]}, model_file="my config.json")
        == "memfit plan 'my config.json'"
    )


def test_the_yaml_is_a_training_config_memfit_train_accepts(tmp_path):
    from memfit.planner.api import plan
    from memfit.train.config import validate_config

    spec = plan("smollm2-135m", method="qlora", seq_len=512, batch_size=2, grad_accum=4).to_dict()["spec"]
    text = train_yaml("smollm2-135m", spec, gpu="rtx-4090")
    values = yaml.safe_load(text)
    config = validate_config(values)
    assert values["init"] == "random" and Path(values["data"]).is_file()
    assert (config.method, config.seq_len, config.batch_size, config.grad_accum, config.gpu) == (
        "qlora",
        512,
        2,
        4,
        "rtx-4090",
    )
    hub = yaml.safe_load(train_yaml("meta-llama/Llama-3.1-8B", spec))
    assert "init" not in hub  # a Hub model's weights are downloaded by memfit train
