"""Llama 4's forward run module by module: the logits its own forward hands its language model, and
the loss memfit's chunked path computes from them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "planner"))
from vision_configs import vision_config  # noqa: E402

from memfit.step.losses import causal_lm_loss  # noqa: E402
from memfit.step.vision_forward import model_forward, module_backbone, runs_by_modules  # noqa: E402


def _llama4():
    from transformers import AutoConfig, AutoModelForImageTextToText

    data = vision_config("llama4")
    config = AutoConfig.for_model(data.pop("model_type"), **data)
    torch.manual_seed(0)
    return AutoModelForImageTextToText.from_config(config).eval()


def _batch():
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 900, (2, 20), generator=generator)
    ids[:, 1:5] = 990  # one 56 x 56 image an example: 4 tokens
    labels = ids.masked_fill(ids == 990, -100)
    return {"input_ids": ids, "pixel_values": torch.randn(2, 3, 56, 56, generator=generator), "labels": labels}


def test_the_module_forward_gives_the_logits_llama4s_own_forward_computes():
    model, batch = _llama4(), _batch()
    seen = {}
    model.language_model.register_forward_hook(lambda module, args, out: seen.update(logits=out.logits))
    try:  # transformers' forward fails after its language model has run (image_outputs); a fixed one returns
        model(input_ids=batch["input_ids"], pixel_values=batch["pixel_values"])
    except AttributeError:
        pass
    inputs = {"input_ids": batch["input_ids"], "pixel_values": batch["pixel_values"]}
    assert runs_by_modules(model)
    assert torch.equal(model_forward(model, inputs).logits, seen["logits"])


def test_the_chunked_loss_of_llama4_is_its_language_models_loss():
    model, batch = _llama4(), _batch()
    inputs = {"input_ids": batch["input_ids"], "pixel_values": batch["pixel_values"]}
    own = model_forward(model, inputs, labels=batch["labels"]).loss
    assert module_backbone(model) is not None
    assert torch.allclose(causal_lm_loss(model, batch), own, atol=1e-5)


def test_other_vision_models_run_their_own_forward():
    from transformers import AutoConfig, AutoModelForImageTextToText

    data = vision_config("llava")
    model = AutoModelForImageTextToText.from_config(AutoConfig.for_model(data.pop("model_type"), **data))
    assert not runs_by_modules(model) and module_backbone(model) is None
