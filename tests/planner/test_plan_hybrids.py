"""State-space and hybrid models plan: every such model type transformers builds, with LoRA, QLoRA and
full fine-tuning; cut to a few layers of each kind, the plan equals the plan of the whole depth."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hybrid_configs import HYBRID_CONFIGS

import memfit
from memfit.errors import UserError

#: Model types whose forward cannot run on fake tensors: the plan says so in one line.
NOT_PLANNABLE = {"qwen4_exp_text": "aten.nonzero"}
#: Model types that cannot run on a quantized base (transformers' Mamba multiplies by dt_proj's weight).
NO_QUANTIZED_BASE = {"mamba"}
#: Multimodal configs whose causal LM is their text_config (planned under the text model's type).
NESTED = {"qwen3_5", "qwen3_5_moe", "qwen4_exp"}
#: Models whose cuts are checked against their whole depth, one of each way of cutting: by kind
#: (Mamba beside attention; Mamba, MLP, experts and attention; gated delta rule beside attention),
#: by whole periods (Jamba), and one kind (Mamba-2).
CUT_CHECKED = ["granitemoehybrid", "nemotron_h", "qwen3_next", "jamba", "mamba2"]


def test_every_state_space_model_type_transformers_builds_has_a_tiny_config():
    """transformers binds mamba-ssm's, causal-conv1d's or fla's kernels in each of these models'
    modules; a new one there must be planned here too."""
    import transformers
    from transformers.models.auto.configuration_auto import model_type_to_module_name
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    models = Path(transformers.__file__).parent / "models"
    binding = re.compile(r'use_kernel_func_from_hub_with_fallback\(\s*"[^"]+",\s*"(?:mamba_ssm|causal_conv1d|fla)"')
    found = set()
    for model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        folder = model_type_to_module_name(model_type)
        source = models / folder / f"modeling_{folder}.py"
        if source.exists() and binding.search(source.read_text(encoding="utf-8")):
            found.add(model_type)
    assert found, "no model binds the kernels any more: the check below would pass on nothing"
    assert found - set(HYBRID_CONFIGS) - NESTED == set()


@pytest.mark.slow
@pytest.mark.parametrize("model_type", sorted(HYBRID_CONFIGS))
def test_plans_with_lora_qlora_and_full(model_type):
    """No traceback: a plan, or (for what cannot be planned) one line that says why."""
    config = HYBRID_CONFIGS[model_type]
    if model_type in NOT_PLANNABLE:
        with pytest.raises(UserError, match=NOT_PLANNABLE[model_type]):
            memfit.plan(dict(config), seq_len=32, cache=False)
        return
    for method in ("lora", "qlora", "full"):
        if method == "qlora" and model_type in NO_QUANTIZED_BASE:
            with pytest.raises(UserError, match="dt_proj weight directly"):
                memfit.plan(dict(config), method=method, seq_len=32, cache=False)
            continue
        result = memfit.plan(dict(config), method=method, seq_len=32, cache=False)
        assert result.allocated_bytes > 0
        assert sum(k["layers"] for k in result.details["layer_kinds"]) == result.details["num_layers"]
        assert result.details["sequence_mixers"] is None or result.details["sequence_mixers"]["simulated"] == "pytorch"


def test_all_linear_adapts_the_mamba_projections_peft_allows():
    """PEFT refuses LoRA on a Mamba mixer's out_proj in Mamba-2 (its fused kernel reads the weight);
    all-linear adapts in_proj, and attention and MLP projections beside it."""
    mamba2 = memfit.plan(dict(HYBRID_CONFIGS["mamba2"]), seq_len=32, cache=False)
    assert mamba2.details["adapters"]["modules"] == ["in_proj"]
    falcon = memfit.plan(dict(HYBRID_CONFIGS["falcon_h1"]), seq_len=32, cache=False)
    assert {"in_proj", "q_proj", "o_proj", "down_proj"} <= set(falcon.details["adapters"]["modules"])
    assert "out_proj" not in falcon.details["adapters"]["modules"]
    bamba = memfit.plan(dict(HYBRID_CONFIGS["bamba"]), seq_len=32, cache=False)
    assert {"in_proj", "out_proj"} <= set(bamba.details["adapters"]["modules"])  # PEFT allows it there


@pytest.mark.parametrize(
    "model_type, method", [(m, "lora") for m in CUT_CHECKED] + [("nemotron_h", "full"), ("jamba", "full")]
)
def test_a_cut_plan_equals_the_whole_depth(model_type, method):
    """Within the tolerance of the extrapolation test for one kind of layer
    (tests/planner/exact/test_simulate.py::test_extrapolation_matches_full_simulation)."""
    config = HYBRID_CONFIGS[model_type]
    cut = memfit.plan(dict(config), method=method, seq_len=64, batch_size=2, cache=False)
    whole = memfit.plan(dict(config), method=method, seq_len=64, batch_size=2, exact=True)
    assert (
        sum(cut.details["simulated_layers"]) > 0 and max(cut.details["simulated_layers"]) < whole.details["num_layers"]
    )
    assert whole.details["simulated_layers"] == [whole.details["num_layers"]]
    assert cut.phase == whole.phase
    assert cut.allocated_bytes == pytest.approx(whole.allocated_bytes, rel=0.005)
    for name in ("weights", "trainable", "gradients", "optimizer", "activations", "temporaries"):
        assert cut.categories[name] == pytest.approx(whole.categories[name], rel=0.005, abs=4096), name
    assert cut.details["total_params"] == whole.details["total_params"]
    assert cut.details["trainable_params"] == whole.details["trainable_params"]
    assert cut.reserved_bytes == pytest.approx(whole.reserved_bytes, rel=0.10)


def test_each_kind_is_counted_by_its_number():
    granite = memfit.plan(dict(HYBRID_CONFIGS["granitemoehybrid"]), seq_len=32, cache=False)
    assert granite.details["layer_kinds"] == [
        {"kind": "linear_attention", "layers": 4},
        {"kind": "full_attention", "layers": 2},
    ]
    assert granite.details["simulated_layers"] == [3, 4, 4]


def test_a_multimodal_config_names_its_language_model():
    config = {"model_type": "qwen3_5", "text_config": dict(HYBRID_CONFIGS["qwen3_5_text"])}
    with pytest.raises(UserError, match="text_config.*'qwen3_5_text'"):
        memfit.plan(config, seq_len=32, cache=False)


def test_xlstm_in_inference_mode_is_refused_with_16_bit_weights():
    config = {k: v for k, v in HYBRID_CONFIGS["xlstm"].items() if k != "mode"}
    with pytest.raises(UserError, match='"mode": "train"'):
        memfit.plan(config, seq_len=32, cache=False)
    assert memfit.plan(config, seq_len=32, precision="fp32", cache=False).allocated_bytes > 0
