"""The search's plans (memfit.planner.search.plans): it plans less without answering differently:
the floor it prunes with is under every plan, and a search with pruning answers exactly what the
search without it answers."""

from __future__ import annotations

import pytest

import memfit
from memfit.models.catalog import resolve_model
from memfit.planner import layout
from memfit.planner.exact.runtime import DEFAULT_CUDA_CONTEXT_BYTES
from memfit.planner.layout import memory_lower_bound
from memfit.planner.search import plans
from memfit.planner.search.driver import fit
from memfit.planner.search.request import FitRequest
from memfit.spec import make_spec

#: Wide enough that the model states weigh something beside the CUDA context; six layers, so that
#: plans extrapolate over depth (2 and 3 layers simulated).
WIDE = {
    "model_type": "llama",
    "hidden_size": 512,
    "intermediate_size": 1376,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 32768,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
}


def _needs(plan) -> int:
    """What the search counts a plan as needing: device total and paged optimizer states."""
    return plan.device_total_bytes + int(plan.details.get("paged_peak_bytes") or 0)


@pytest.mark.parametrize(
    "knobs",
    [
        dict(optimizer="adamw", precision="bf16"),
        dict(optimizer="adamw", precision="fp32", checkpointing="on"),
        dict(optimizer="adamw8bit", precision="bf16", checkpointing="offload"),
        dict(optimizer="paged-adamw8bit", precision="bf16", grad_accum=3),
        dict(optimizer="paged-adamw8bit", precision="fp32", tiling="on"),
        dict(optimizer="sgd", precision="bf16"),
        dict(optimizer="adamw", precision="bf16", step_in_backward=True),
        dict(optimizer="adamw", precision="bf16", recipe="hf", checkpointing="on"),
        dict(optimizer="adamw", precision="bf16-mixed"),
        dict(optimizer="adamw8bit", precision="fp16-mixed", tiling="on"),
    ],
)
@pytest.mark.parametrize("exact", [False, True])
def test_floor_is_under_every_full_plan(knobs, exact):
    plan = memfit.plan(WIDE, method="full", seq_len=128, batch_size=2, exact=exact, **knobs)
    floor = memory_lower_bound(
        WIDE, make_spec(method="full", seq_len=128, batch_size=2, **knobs), DEFAULT_CUDA_CONTEXT_BYTES
    )
    assert floor <= _needs(plan)
    # And it is the model states: at least weights + states (+ gradients), not just the context.
    assert floor - DEFAULT_CUDA_CONTEXT_BYTES >= plan.categories["trainable"]


def test_floor_of_mixed_precision_is_sixteen_bytes_a_parameter():
    # bf16-mixed: fp32 weights (4 bytes a parameter), fp32 gradients (4), two fp32 AdamW states (8).
    config = resolve_model("llama-3.1-8b").config
    assert memory_lower_bound(config, make_spec(method="full", precision="bf16-mixed"), 0) == 16 * 8_030_261_248
    # 8-bit AdamW keeps at least 2 bytes an element whatever the parameters' format.
    assert (
        memory_lower_bound(config, make_spec(method="full", precision="bf16-mixed", optimizer="adamw8bit"), 0)
        == 10 * 8_030_261_248
    )


def test_floor_only_where_it_is_proven():
    for knobs in (dict(method="lora"), dict(method="qlora"), dict(method="full", gpus=2, shard="ddp")):
        assert memory_lower_bound(WIDE, make_spec(**knobs), 0) is None


def test_floor_rules_out_full_fine_tuning_of_8b_on_24gb():
    # Pure bf16: 2 bytes a parameter of weights, 2 of gradients, 4 of AdamW states, 8,030,261,248 parameters.
    floor = memory_lower_bound(resolve_model("llama-3.1-8b").config, make_spec(method="full"), 0)
    assert floor == 8 * 8_030_261_248
    assert layout.proven_over_budget("llama-3.1-8b", gpu="rtx-4090", method="full", optimizer="paged-adamw8bit")
    assert not layout.proven_over_budget("llama-3.1-8b", gpu="h200", method="full", optimizer="sgd")
    assert not layout.proven_over_budget("llama-3.1-8b", gpu="rtx-4090", method="lora")


def _answer(result) -> dict:
    data = result.to_dict()
    data["details"].pop("seconds")
    data["details"].pop("plans_made")
    return {"json": data, "plans": [f.plan.to_dict()["categories"] for f in result.fits]}


def _fit_both_ways(monkeypatch, **options):
    pruned = fit(FitRequest(WIDE, workers=1, **options))
    with monkeypatch.context() as patch:
        patch.setattr(plans, "proven_over_budget", lambda *a, **k: False)  # the search as it was
        unpruned = fit(FitRequest(WIDE, workers=1, **options))
    return pruned, unpruned


def test_pruning_changes_no_answer(monkeypatch):
    # A budget between what LoRA needs and the floor of full fine-tuning: full is pruned, LoRA fits.
    lora = memfit.plan(WIDE, method="lora", seq_len=128, batch_size=1, grad_accum=2)
    floor = memory_lower_bound(WIDE, make_spec(method="full", optimizer="paged-adamw8bit"), DEFAULT_CUDA_CONTEXT_BYTES)
    assert lora.device_total_bytes < floor
    budget = (lora.device_total_bytes + floor) // 2
    pruned, unpruned = _fit_both_ways(monkeypatch, budget=budget, batch_size=2, seq_len=128, methods=("full", "lora"))
    assert _answer(pruned) == _answer(unpruned)
    assert pruned.fits and {f.spec["method"] for f in pruned.fits} == {"lora"} and pruned.max_seq_len["full"] == 0
    assert pruned.plans_made < unpruned.plans_made


def test_pruned_misses_are_planned_when_reported(monkeypatch):
    # Nothing fits: every miss is reported with its figures, those proven without a plan too.
    pruned, unpruned = _fit_both_ways(monkeypatch, budget="500MiB", batch_size=1, seq_len=128, methods=("full",))
    assert pruned.fits == [] and len(pruned.misses) == 9
    assert all(m.device_total_bytes and m.over_bytes > 0 for m in pruned.misses)
    assert _answer(pruned) == _answer(unpruned)
