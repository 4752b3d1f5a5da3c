"""TRL GRPOConfig's keys, as a TRL YAML / JSON writes them at its top level and Axolotl in its
``trl:`` block: what they mean for memfit's grpo knobs.

Names and defaults from TRL 1.16's ``trainer/grpo_config.py``: ``num_generations`` (8),
``max_completion_length`` (512), ``temperature`` (1.0), ``top_p`` (1.0), ``beta`` (0.0: no reference
model), ``num_iterations`` (1), ``use_vllm`` (false), ``vllm_mode`` (colocate),
``vllm_gpu_memory_utilization`` (0.3), ``vllm_enable_sleep_mode`` (false). TRL 1.16 has no
``max_prompt_length`` (it does not cut prompts): a config with one is planned at it, one without at
512 tokens a prompt (its former default), and says so. TRL's GRPOTrainer scores completions with a
fused LM head (no ``[tokens x vocabulary]`` logits), as memfit's step does: a GRPO config is planned
with memfit's step (``recipe: memfit``), not the plain Hugging Face one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from memfit.interop.keys import ABSENT, KeyProblem, Planned, as_bool, as_float, as_int

#: Keys only GRPOConfig has (beside the ones it shares with DPOConfig: beta, max_completion_length...).
GRPO_ONLY_KEYS = (
    "num_generations",
    "num_generations_eval",
    "num_iterations",
    "epsilon",
    "epsilon_high",
    "delta",
    "scale_rewards",
    "reward_weights",
    "use_vllm",
    "vllm_mode",
    "vllm_gpu_memory_utilization",
    "vllm_enable_sleep_mode",
    "vllm_server_base_url",
    "vllm_server_host",
    "vllm_server_port",
    "vllm_server_timeout",
    "vllm_tensor_parallel_size",
    "vllm_max_model_length",
    "vllm_model_impl",
    "vllm_importance_sampling_correction",
    "generation_batch_size",
    "steps_per_generation",
    "mask_truncated_completions",
    "top_entropy_quantile",
    "importance_sampling_level",
    "multi_objective_aggregation",
    "use_bias_correction_kl",
    "log_completions",
    "num_completions_to_print",
    "repetition_penalty",
    "min_p",
)

#: GRPOConfig's ``loss_type`` names (TRL 1.16); memfit trains grpo, dr_grpo, dapo and bnpo.
GRPO_LOSSES = ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo")

#: TRL's former ``max_prompt_length`` default: what a GRPO config without one is planned at.
DEFAULT_PROMPT_TOKENS = 512


def is_grpo(raw: Mapping[str, Any]) -> bool:
    """Whether a TRL config (or an Axolotl ``trl:`` block) is a GRPOConfig: one of its own keys is set."""
    return any(key in raw for key in GRPO_ONLY_KEYS)


def _non_negative(value: Any) -> float:
    """0, or a positive number (GRPOConfig's ``beta``: 0 keeps no reference model)."""
    if not isinstance(value, bool) and isinstance(value, (int, float)) and value == 0:
        return 0.0
    return as_float(value)


def _mode(value: Any) -> str:
    text = str(value).strip().lower()
    if text not in ("colocate", "server"):
        raise ValueError(f"{value!r} is not a vLLM mode TRL's GRPOConfig takes (colocate, server)")
    return text


#: knob: (GRPOConfig's key, how its value is read, TRL's default).
KNOB_KEYS: dict[str, tuple[str, Callable[[Any], Any], Any]] = {
    "num_generations": ("num_generations", as_int, 8),
    "max_completion_length": ("max_completion_length", as_int, 512),
    "num_iterations": ("num_iterations", as_int, 1),
    "temperature": ("temperature", as_float, 1.0),
    "top_p": ("top_p", as_float, 1.0),
    "beta": ("beta", _non_negative, 0.0),
    "use_vllm": ("use_vllm", as_bool, False),
    "vllm_mode": ("vllm_mode", _mode, "colocate"),
    "vllm_gpu_memory_utilization": ("vllm_gpu_memory_utilization", as_float, 0.3),
    "vllm_enable_sleep_mode": ("vllm_enable_sleep_mode", as_bool, False),
}


def knob_value(block: Mapping[str, Any], knob: str, *, prefix: str = "") -> Any:
    """The value of grpo knob ``knob`` in ``block`` (TRL's default where it is not set); a bad value
    raises :class:`KeyProblem` naming ``prefix`` + the key. vLLM's settings only with ``use_vllm``."""
    key, read, default = KNOB_KEYS[knob]
    if knob.startswith("vllm_") and not _read(block, "use_vllm", as_bool, False, prefix):
        return None
    return _read(block, key, read, default, prefix)


def _read(block: Mapping[str, Any], key: str, read: Callable[[Any], Any], default: Any, prefix: str) -> Any:
    value = block.get(key, ABSENT)
    if value is ABSENT or value is None:
        return default
    try:
        return read(value)
    except ValueError as err:
        raise KeyProblem(prefix + key, str(err)) from None


def seq_len(
    block: Mapping[str, Any], prompt: Any = ABSENT, *, prefix: str = "", prompt_key: str = "max_prompt_length"
) -> Any:
    """The plan's sequence: the prompt's budget (``prompt``, or ``max_prompt_length`` in ``block``) plus
    ``max_completion_length``; without a prompt length, TRL's former default (listed)."""
    completion = _read(block, "max_completion_length", as_int, 512, prefix)
    if prompt is ABSENT:
        prompt = block.get("max_prompt_length", ABSENT)
        prompt_key = prefix + "max_prompt_length"
    if prompt is ABSENT or prompt is None:
        return Planned(
            DEFAULT_PROMPT_TOKENS + completion,
            f"no max_prompt_length (TRL 1.16 does not cut prompts): planned with prompts of {DEFAULT_PROMPT_TOKENS} "
            "tokens plus max_completion_length; pass --seq-len with the longest prompt's tokens plus it",
            modelled=True,
            key=prefix + "max_completion_length",
        )
    try:
        return as_int(prompt) + completion
    except ValueError as err:
        raise KeyProblem(prompt_key, str(err)) from None


#: What a GRPO config plans with memfit's step, said once.
RECIPE_NOTE = (
    "TRL's GRPOTrainer scores completions with its fused LM head (no [tokens x vocabulary] logits), as memfit's "
    "step does: planned with memfit's step"
)


def unmodelled(block: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(key, why) for GRPOConfig settings that change memory and that memfit does not model."""
    out = []
    if block.get("generation_batch_size") is not None or block.get("steps_per_generation") is not None:
        out.append(
            (
                "generation_batch_size",
                "a generation batch other than batch_size x gradient_accumulation_steps: planned as that",
            )
        )
    loss = block.get("loss_type")
    if loss is not None and str(loss).lower() not in GRPO_LOSSES[:4]:
        out.append(("loss_type", f"{loss}: planned as dapo's step (the same log-probs; another aggregation)"))
    return out
