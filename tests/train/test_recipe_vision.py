"""memfit train on a vision-language model: the examples/vlm-tiny.yaml run (its loss falls, its
adapter loads in PEFT beside the processor it saved), and its step equal to its plan to the byte with
the tower frozen and trained."""

from __future__ import annotations

import json

import pytest
from trainer_helpers import REPO

from memfit.train.config import load_config
from memfit.train.conformance import MATRIX, measure
from memfit.train.recipe import train


def _quiet():
    from rich.console import Console

    return Console(stderr=True, quiet=True)


def test_the_vision_example_trains_and_its_adapter_loads_in_peft(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText, AutoProcessor

    config = load_config(
        REPO / "examples" / "vlm-tiny.yaml",
        {"output_dir": str(tmp_path / "run"), "max_steps": 12, "log_every": 1, "batch_size": 4, "warmup_steps": 1},
    )
    result = train(config, progress=False, console=_quiet())
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [s["loss"] for s in steps if "loss" in s and "step" in s]
    assert result.status == "completed" and len(losses) == 12
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.3  # falling, not noise
    adapter = tmp_path / "run" / "adapter"
    processor = AutoProcessor.from_pretrained(str(adapter))  # saved beside the adapter: chat reads it
    assert processor.tokenizer.convert_tokens_to_ids("<image>") == 512
    model = AutoModelForImageTextToText.from_config(result.model.get_base_model().config)
    loaded = PeftModel.from_pretrained(model, str(adapter))
    assert any("lora_A" in name for name, _ in loaded.named_parameters())


@pytest.mark.parametrize("name", ["llava lora bf16 tower frozen", "llava lora fp32 tower trained padded"])
def test_a_vision_run_peaks_at_its_plan_to_the_byte(name, tmp_path):
    cell = measure(name, dict(MATRIX)[name], tmp_path)
    assert not cell.error, cell.error
    assert cell.measured_bytes == cell.planned_bytes > 0, (cell.measured_categories, cell.planned_categories)
