"""memfit chat on runs that trained the adapter options: DoRA, rsLoRA, modules trained whole, an 8-bit base.

The run folder is loaded as the run loaded its model (its method and options), then the trained
adapter's tensors, DoRA's magnitudes and the trained copies included: the run's own last evaluation
loss comes out to the last bit.
"""

from __future__ import annotations

import json

import pytest
from chat_helpers import train_demo

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from test_chat_loading import _eval_loss  # noqa: E402

from memfit.infer.loading import load_chat_model  # noqa: E402


def _last_eval_loss(run_dir) -> float:
    recorded = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["eval_loss"] for r in recorded if "eval_loss" in r][-1]


@pytest.mark.parametrize(
    "options",
    [
        {"dora": True, "rslora": True, "modules_to_save": ["embed_tokens", "lm_head"]},
        pytest.param({"method": "lora-8bit", "precision": "bf16", "modules_to_save": ["lm_head"]}, id="lora-8bit"),
    ],
    ids=lambda o: "-".join(sorted(o)) if isinstance(o, dict) else None,
)
def test_a_run_with_adapter_options_is_rebuilt_exactly_as_it_trained(tmp_path, options):
    if options.get("method") == "lora-8bit":
        pytest.importorskip("bitsandbytes")
    run = train_demo(tmp_path / "run", eval_prompts=None, **options)
    chat_model = load_chat_model(str(run), device="cpu")
    assert _eval_loss(chat_model, run) == _last_eval_loss(run)
    saved = [name for name, _ in chat_model.model.named_parameters() if "modules_to_save" in name]
    assert saved  # the trained copy answers, not the frozen original
    assert f"{options.get('method', 'lora')} adapter" in chat_model.description


def test_the_trained_copy_is_what_answers(tmp_path):
    # The check above can fail: with the trained copy put back to the base's weights, the loss is another.
    run = train_demo(tmp_path / "run", eval_prompts=None, modules_to_save=["lm_head"])
    chat_model = load_chat_model(str(run), device="cpu")
    with torch.no_grad():
        for name, param in chat_model.model.named_parameters():
            if "modules_to_save" in name:
                param.copy_(chat_model.model.get_parameter(name.replace("modules_to_save.default", "original_module")))
    assert _eval_loss(chat_model, run) != _last_eval_loss(run)
