"""What a plan says of a mixture-of-experts model (``details.experts``): its parameters, total and
active a token, the experts' share of the weights, how they are stored and run, the tokens each
expert gets when routing is balanced and what an imbalanced batch would add, the auxiliary
routing loss, and what LoRA on the experts trains.

Read from the full model built on ``meta`` (no memory): the simulated step is a cut of it.
"""

from __future__ import annotations

from typing import Any

from memfit.spec import RunSpec

#: What the step's memory does when a batch's tokens crowd onto a few experts: nothing. Each
#: MoE layer's grouped matmuls (16-bit or 4-bit) write every routed token's row into one
#: ``[tokens x top-k, width]`` tensor however the tokens spread; Llama 4 runs every expert on
#: every token anyway. An imbalanced batch changes the time, not the memory.
IMBALANCE_BYTES = 0

#: What a trainable parameter holds on the device, as the plan's categories name them: itself, its
#: gradient, its optimizer states.
STATE_KINDS = ("weights", "gradients", "optimizer")


def _mentions_experts(config: Any) -> bool:
    """Whether a config (or a config nested in it) has a key that speaks of experts or of a mixture
    of them (``num_local_experts``, ``n_routed_experts``, ``moe_intermediate_size``...)."""
    if isinstance(config, dict):
        return any(
            "expert" in str(k).lower() or "moe" in str(k).lower() or _mentions_experts(v) for k, v in config.items()
        )
    if isinstance(config, list):
        return any(_mentions_experts(v) for v in config)
    return False


def expert_details(
    config_dict: dict[str, Any],
    spec: RunSpec,
    adapter_bytes: dict[str, dict[str, int]] | None = None,
    *,
    remember: bool = True,
) -> dict[str, Any] | None:
    """``details.experts`` of a plan of the model in ``config_dict`` (None for a model without experts).

    ``adapter_bytes``: the step's trainable parameters on the experts and on the rest, as the plan's
    simulation counted them at full depth (:attr:`memfit.planner.shortcuts.extrapolate.StepEstimate.adapter_bytes`).
    ``remember``: a model found to have no experts is kept in the memo as such (a search plans one
    model many times; the full model built on ``meta`` to look costs a dense 8B model 50 ms a plan).
    """
    from memfit.models.build import DTYPES, build_meta_model, count_parameters, make_config
    from memfit.models.experts import expert_modules, expert_parameter_count, expert_weights, routers
    from memfit.models.experts_nf4 import unsupported_reason
    from memfit.planner.shortcuts.memo import MEMO, config_key

    if not _mentions_experts(config_dict):
        return None  # a dense model's config names no experts: no need to build it to look
    key = (config_key(config_dict), spec.weight_precision)
    if remember and MEMO.expert_free.get(key):
        return None
    model = build_meta_model(make_config(config_dict), DTYPES[spec.weight_precision])
    modules = expert_modules(model)
    if not modules:
        if remember:
            MEMO.keep("expert_free", key, True)
        return None
    first = next(iter(modules.values()))
    experts = expert_weights(first)[0].num_experts
    top_k = _top_k(model, routers(model))
    total, _ = count_parameters(model)
    in_experts = expert_parameter_count(model)
    every_token = type(first).__name__ == "Llama4TextExperts"
    tokens = spec.batch_size * spec.seq_len * (2 if spec.is_preference else 1)
    four_bit = spec.base_bits == 4 and unsupported_reason(first) is None
    details = {
        "moe_layers": len(modules),
        "experts_per_layer": experts,
        "top_k": top_k,
        "total_params": total,
        "expert_params": in_experts,
        "active_params": total - in_experts + in_experts * top_k // experts,
        "experts_share": round(in_experts / total, 4),
        "storage": "nf4" if four_bit else spec.weight_precision,
        "forward": _forward(four_bit, every_token),
        "tokens_per_micro_batch": tokens,
        "tokens_per_expert": tokens if every_token else tokens * top_k // experts,
        "imbalance_bytes": IMBALANCE_BYTES,
        "router_aux_loss": _aux_loss(model.config, spec),
        "checkpoint": checkpoint_note(config_dict),
    }
    if spec.uses_adapters:
        details["adapters"] = _expert_adapters(model, spec, adapter_bytes or {})
    return details


def _top_k(model, found: dict) -> int:
    for router in found.values():
        if getattr(router, "top_k", None):
            return int(router.top_k)
    config = model.config
    for name in ("num_experts_per_tok", "experts_per_token", "num_experts_per_token", "moe_topk"):
        if getattr(config, name, None):
            return int(getattr(config, name))
    return 1


def _forward(four_bit: bool, every_token: bool) -> str:
    if every_token:
        return "every expert on every token (Llama 4's experts), " + (
            "one expert dequantized at a time" if four_bit else "batched matmuls"
        )
    if four_bit:
        return "transformers' grouped experts forward, one expert's NF4 weight dequantized at a time (forward and backward)"
    return "transformers' grouped matmuls (grouped_mm)"


def _aux_loss(config, spec: RunSpec) -> dict[str, Any] | None:
    """The auxiliary load-balancing loss the model adds to its loss, where it defines one: on where
    the config turns router logits on and the step is supervised fine-tuning (memfit's preference
    objectives compute their losses from log-probs alone, without it: ``asked`` says the config's wish)."""
    coef = getattr(config, "router_aux_loss_coef", None)
    if coef is None:
        return None
    asked = bool(getattr(config, "output_router_logits", False))
    return {"coef": float(coef), "on": asked and not spec.is_preference, "asked": asked}


def checkpoint_note(config_dict: dict[str, Any]) -> str | None:
    """What a run does with a checkpoint whose experts are stored quantized (gpt-oss's MXFP4)."""
    quantization = config_dict.get("quantization_config")
    if isinstance(quantization, dict) and quantization.get("quant_method") == "mxfp4":
        return (
            "the checkpoint stores its experts in MXFP4 (quantization_config): the run dequantizes them as it loads "
            "them, as transformers does for training (Mxfp4Config(dequantize=True)), and plans and trains them as stored here"
        )
    return None


def _expert_adapters(model, spec: RunSpec, adapter_bytes: dict[str, dict[str, int]]) -> dict[str, Any]:
    """Where LoRA sits on the experts (``experts.<weight>``), what it trains there and what that costs in
    weights, gradients and optimizer states; beside it, the same of the adapters on the rest of the model."""
    from memfit.models.experts import EXPERTS
    from memfit.step.prepare import model_lora_targets

    adapted = model_lora_targets(model, spec).parameters

    def part(counts: dict[str, int]) -> dict[str, Any]:
        return {
            "trainable_params": counts.get("params", 0),
            "bytes": {key: counts.get(key, 0) for key in STATE_KINDS},
        }

    return {
        "weights": sorted(p for p in adapted if p.startswith(f"{EXPERTS}.")),
        **part(adapter_bytes.get("experts", {})),
        "rest": part(adapter_bytes.get("rest", {})),
    }
