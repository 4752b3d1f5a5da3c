"""Mixture-of-experts models train LoRA on their experts on the CPU: the loss falls, the adapter loads
in PEFT and gives the trained model's logits, memfit merge equals PEFT's merge; 4-bit experts train
and their adapter loads in PEFT on the 16-bit model."""

from __future__ import annotations

import json
import warnings

import pytest

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

from trainer_helpers import read_metrics, tiny_config  # noqa: E402

from memfit.train.conformance import TINY_MODELS  # noqa: E402
from memfit.train.recipe import train  # noqa: E402


def _base(folder, name: str):
    """A tiny saved model of ``name`` with the shipped tokenizer (its experts stored apart, as transformers saves them)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from memfit.models.build import make_config
    from memfit.train.data import tiny_tokenizer_path

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(make_config(TINY_MODELS[name]), dtype=torch.float32).save_pretrained(folder)
    AutoTokenizer.from_pretrained(str(tiny_tokenizer_path())).save_pretrained(folder)
    return folder


def _trained(tmp_path, name: str, **changes):
    base = _base(tmp_path / "base", name)
    settings = dict(model=str(base), init="pretrained", model_overrides={}, max_steps=10, lr=1e-2, batch_size=4, rank=4)
    settings.update(changes)
    result = train(tiny_config(tmp_path / "run", **settings), progress=False)
    assert result.status == "completed"
    return base, tmp_path / "run"


def _peft_model(base, adapter):
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return peft.PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), str(adapter)
        ).eval()


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_lora_on_experts_trains_loads_in_peft_and_merges_as_peft(tmp_path, name):
    from safetensors.torch import load_file

    from memfit.infer.loading import load_chat_model
    from memfit.merge import merge

    base, run = _trained(tmp_path, name, targets=["experts", "q_proj", "v_proj"])
    losses = [r["loss"] for r in read_metrics(run) if "loss" in r]
    assert len(losses) == 10 and sum(losses[-3:]) / 3 < sum(losses[:3]) / 3
    setup = json.loads((run / "run.json").read_text())["setup"]
    assert setup["trainable_params"] == setup["expected_trainable_params"]
    saved = json.loads((run / "adapter" / "adapter_config.json").read_text())
    assert sorted(saved["target_parameters"]) == ["experts.down_proj", "experts.gate_up_proj"]

    x = torch.tensor([[0, 5, 17, 33, 64, 100, 7, 9]])
    with torch.no_grad():
        ours = load_chat_model(str(run), device="cpu").model(input_ids=x).logits
        theirs = _peft_model(base, run / "adapter")(input_ids=x).logits
    assert torch.allclose(ours, theirs, atol=1e-5)

    merge(base, run / "adapter", tmp_path / "merged", progress=False)
    reference = tmp_path / "peft-merged"
    _peft_model(base, run / "adapter").merge_and_unload().save_pretrained(reference)
    got, want = (
        load_file(str(tmp_path / "merged" / "model.safetensors")),
        load_file(str(reference / "model.safetensors")),
    )
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_four_bit_experts_train_and_their_adapter_loads_in_peft_on_the_16_bit_model(tmp_path):
    base, run = _trained(tmp_path, "qwen3_moe", method="qlora", precision="bf16", targets=["experts"], max_steps=4)
    setup = json.loads((run / "run.json").read_text())["setup"]
    assert setup["trainable_params"] == setup["expected_trainable_params"] > 0
    model = _peft_model(base, run / "adapter")
    wrapped = [m for m in model.modules() if type(m).__name__ == "ParamWrapper"]
    assert len(wrapped) == 2 * 2  # gate_up_proj and down_proj of each of the two MoE layers
    x = torch.tensor([[0, 5, 17, 33, 64, 100, 7, 9]])
    with torch.no_grad():
        adapted = model(input_ids=x).logits
        with model.disable_adapter():
            plain = model(input_ids=x).logits
    assert not torch.allclose(adapted, plain)
