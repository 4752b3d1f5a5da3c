"""Mixture-of-experts models train LoRA on their experts on the CPU: the loss falls, the adapter loads
in PEFT and gives the trained model's logits, memfit merge equals PEFT's merge; every other family
transformers builds trains, chats and merges the same way; 4-bit experts train and their adapter
loads in PEFT on the 16-bit model."""

from __future__ import annotations

import json
import math
import sys
import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

from trainer_helpers import read_metrics, tiny_config  # noqa: E402

from memfit.train.conformance import TINY_MODELS  # noqa: E402
from memfit.train.recipe import train  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "planner"))
from moe_configs import MOE_CONFIGS  # noqa: E402

#: The families transformers builds that the tests above do not train: each trains two steps, chats and merges.
OTHER_FAMILIES = ["qwen2_moe", "olmoe", "granitemoe", "phimoe", "glm4_moe", "deepseek_v3", "qwen3_next"]

X = torch.tensor([[0, 5, 17, 33, 64, 100, 7, 9]])


def _base(folder, config: dict, layers: tuple[int, ...] | None = None):
    """A tiny saved model of ``config`` (cut to its decoder ``layers``) with the shipped tokenizer (its
    experts stored apart, as transformers saves them)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from memfit.models.build import make_config
    from memfit.train.data import tiny_tokenizer_path

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(make_config(config, layers=layers), dtype=torch.float32)
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(str(tiny_tokenizer_path())).save_pretrained(folder)
    return folder


def _trained(tmp_path, name: str, **changes):
    base = _base(tmp_path / "base", TINY_MODELS[name])
    return base, _train(base, tmp_path / "run", **changes)


def _train(base, run, **changes):
    settings = dict(model=str(base), init="pretrained", model_overrides={}, max_steps=10, lr=1e-2, batch_size=4, rank=4)
    settings.update(changes)
    result = train(tiny_config(run, **settings), progress=False)
    assert result.status == "completed"
    return run


def _peft_model(base, adapter):
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return peft.PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), str(adapter)
        ).eval()


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_lora_on_experts_trains_loads_in_peft_and_merges_as_peft(tmp_path, name):
    base, run = _trained(tmp_path, name, targets=["experts", "q_proj", "v_proj"])
    losses = [r["loss"] for r in read_metrics(run) if "loss" in r]
    assert len(losses) == 10 and sum(losses[-3:]) / 3 < sum(losses[:3]) / 3
    setup = json.loads((run / "run.json").read_text())["setup"]
    assert setup["trainable_params"] == setup["expected_trainable_params"]
    saved = json.loads((run / "adapter" / "adapter_config.json").read_text())
    assert sorted(saved["target_parameters"]) == ["experts.down_proj", "experts.gate_up_proj"]

    _chats_as_peft(base, run)
    _merges_as_peft(base, run, tmp_path)


@pytest.mark.parametrize("model_type", OTHER_FAMILIES)
def test_every_other_moe_family_trains_lora_on_its_experts_chats_and_merges_as_peft(tmp_path, model_type):
    # Two decoder layers keep each family's kinds: a dense first layer beside one of experts
    # (DeepSeek-V3, GLM-4-MoE), linear attention beside full attention (Qwen3-Next).
    base = _base(tmp_path / "base", MOE_CONFIGS[model_type], layers=(0, 1))
    run = _train(base, tmp_path / "run", targets=["all-linear"], max_steps=2, batch_size=2, seq_len=32)
    losses = [r["loss"] for r in read_metrics(run) if "loss" in r]
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses)
    saved = json.loads((run / "adapter" / "adapter_config.json").read_text())
    assert {"experts.down_proj", "experts.gate_up_proj"} <= set(saved["target_parameters"])
    assert (run / "adapter" / "adapter_model.safetensors").is_file()
    _chats_as_peft(base, run)
    _merges_as_peft(base, run, tmp_path)


def _chats_as_peft(base, run) -> None:
    """The run's adapter loaded for chat gives PEFT's logits on the saved base."""
    from memfit.infer.loading import load_chat_model

    with torch.no_grad():
        ours = load_chat_model(str(run), device="cpu").model(input_ids=X).logits
        theirs = _peft_model(base, run / "adapter")(input_ids=X).logits
    assert torch.allclose(ours, theirs, atol=1e-5)


def _merges_as_peft(base, run, tmp_path) -> None:
    """memfit merge writes the weights PEFT's merge_and_unload gives, bit for bit."""
    from safetensors.torch import load_file

    from memfit.merge import merge

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
    with torch.no_grad():
        adapted = model(input_ids=X).logits
        with model.disable_adapter():
            plain = model(input_ids=X).logits
    assert not torch.allclose(adapted, plain)
