"""grpo: knobs that cannot go together, reward functions that cannot be loaded or return the wrong
thing, data grpo cannot take, other tools' GRPO configs with bad values. Each is one line, exit 2,
before any model loads; what is fine plans (exit 0)."""

from __future__ import annotations

import json
from pathlib import Path

from ._case import Case

#: The prefix of every file these cases name.
_P = "grpo"

_REWARDS = """def short(prompts, completions, **kwargs):
    return [1.0 / (1 + len(c)) for c in completions]


def one_number(prompts, completions, **kwargs):
    return 1.0


def too_many(prompts, completions, **kwargs):
    return [0.0] * (len(completions) + 1)


def words(prompts, completions, **kwargs):
    return ["good" for _ in completions]


def needs_answer(prompts, completions, answer, **kwargs):
    return [float(a) for a in answer]


LIMIT = 3
"""


def _train_yaml(root: Path, **fields) -> str:
    """A grpo training YAML of the tiny model on the files' own prompts, with ``fields`` set (None: left out)."""
    settings = {
        "model": "smollm2-135m",
        "init": "random",
        "data": str(root / f"{_P}-prompts.jsonl"),
        "objective": "grpo",
        "reward_funcs": [f"{_P}-rewards.py:short"],
        "method": "lora",
        "precision": "fp32",
        "num_generations": 2,
        "batch_size": 4,
        "max_completion_length": 8,
        "seq_len": 32,
        "max_steps": 1,
        "device": "cpu",
        "output_dir": str(root / f"{_P}-run"),
        **fields,
    }
    return "".join(f"{key}: {json.dumps(value)}\n" for key, value in settings.items() if value is not None)


def make_inputs(root: Path) -> None:
    """The prompts, a file of reward functions (good ones and wrong ones), grpo training YAMLs that
    are wrong one way each, and TRL and Axolotl GRPO configs."""
    prompts = "".join(
        json.dumps({"prompt": f"Say {word}:", "answer": "1"}) + "\n" for word in ("yes", "no", "maybe", "so")
    )
    files = {
        f"{_P}-prompts.jsonl": prompts,
        f"{_P}-instruct.jsonl": json.dumps({"instruction": "Say yes.", "output": "Yes."}) + "\n",
        f"{_P}-rewards.py": _REWARDS,
        f"{_P}-missing-file.yaml": _train_yaml(root, reward_funcs=[f"{_P}-nowhere.py:short"]),
        f"{_P}-unknown-function.yaml": _train_yaml(root, reward_funcs=[f"{_P}-rewards.py:shortest"]),
        f"{_P}-not-callable.yaml": _train_yaml(root, reward_funcs=[f"{_P}-rewards.py:LIMIT"]),
        f"{_P}-one-number.yaml": _train_yaml(root, reward_funcs=[f"{_P}-rewards.py:one_number"]),
        f"{_P}-too-many.yaml": _train_yaml(root, reward_funcs=[f"{_P}-rewards.py:too_many"]),
        f"{_P}-words.yaml": _train_yaml(root, reward_funcs=[f"{_P}-rewards.py:words"]),
        f"{_P}-no-column.yaml": _train_yaml(
            root, reward_funcs=[f"{_P}-rewards.py:needs_answer"], data=str(root / f"{_P}-instruct-prompts.jsonl")
        ),
        f"{_P}-instruct-prompts.jsonl": json.dumps({"prompt": "Say yes:"}) + "\n",
        f"{_P}-builtin-typo.yaml": _train_yaml(root, reward_funcs=["lenght"]),
        f"{_P}-no-rewards.yaml": _train_yaml(root, reward_funcs=None),
        f"{_P}-weights.yaml": _train_yaml(root, reward_funcs=["length", "think_format"], reward_weights=[1.0]),
        f"{_P}-lengths.yaml": _train_yaml(root, max_prompt_length=40),
        f"{_P}-eval.yaml": _train_yaml(root, eval_split=0.25),
        f"{_P}-sft-data.yaml": _train_yaml(root, data=str(root / f"{_P}-instruct.jsonl"), reward_funcs=["length"]),
        f"{_P}-sft-rewards.yaml": _train_yaml(
            root,
            objective="sft",
            reward_funcs=["length"],
            num_generations=None,
            max_completion_length=None,
            batch_size=2,
        ),
        f"{_P}-sft-prompts.yaml": _train_yaml(
            root, objective="sft", reward_funcs=None, num_generations=None, max_completion_length=None, batch_size=2
        ),
        f"{_P}-trl-mode.yaml": "model_name_or_path: smollm2-135m\nnum_generations: 4\nuse_vllm: true\nvllm_mode: sideways\n",
        f"{_P}-trl-ok.yaml": (
            "model_name_or_path: smollm2-135m\nuse_peft: true\nnum_generations: 4\nper_device_train_batch_size: 4\n"
            "max_prompt_length: 64\nmax_completion_length: 64\n"
        ),
        f"{_P}-axolotl-generations.yaml": (
            "base_model: smollm2-135m\nadapter: lora\nlora_r: 8\nlora_target_linear: true\nrl: grpo\n"
            "sequence_len: 64\nmicro_batch_size: 4\ntrl:\n  num_generations: 3\n"
            "  max_completion_length: 64\ndatasets:\n  - path: org/data\n"
        ),
    }
    for name, text in files.items():
        (root / name).write_text(text)


_YAMLS = (f"{_P}-rewards.py",)

CASES = [
    # plan: the knobs grpo needs, in the command line's spelling
    Case(
        "plan smollm2-135m --objective grpo --num-generations 3 --batch-size 4",
        2,
        fast=True,
        says=("--batch-size 4 x --grad-accum 1 = 4 completions a step must hold whole groups of --num-generations 3",),
    ),
    Case(
        "plan smollm2-135m --objective grpo --seq-len 256 --max-completion-length 512",
        2,
        says=("--seq-len 256 leaves no room for a prompt beside --max-completion-length 512",),
    ),
    Case("plan smollm2-135m --num-generations 4", 2, says=("--num-generations: applies to --objective grpo",)),
    Case(
        "plan smollm2-135m --objective grpo --num-generations 1 --batch-size 2",
        2,
        says=("--num-generations 1: grpo needs 2 or more completions of each prompt",),
    ),
    Case("plan smollm2-135m --objective grpo --top-p 1.5", 2, says=("--top-p: 1.5 must be in (0, 1]",)),
    Case("plan smollm2-135m --objective grpo --temperature 0", 2, says=("--temperature: 0.0 must be more than 0",)),
    Case(
        "plan smollm2-135m --objective grpo --vllm-mode server",
        2,
        says=("--vllm-mode: applies with --use-vllm. Add --use-vllm, or drop --vllm-mode.",),
    ),
    Case(
        "plan smollm2-135m --objective grpo --use-vllm --vllm-gpu-memory-utilization 1.5",
        2,
        says=("--vllm-gpu-memory-utilization: 1.5 must be in (0, 1]",),
    ),
    Case(
        "plan smollm2-135m --objective grpo --gpus 2 --shard fsdp",
        2,
        says=("--objective grpo: planned and trained on one GPU",),
    ),
    Case(
        "plan smollm2-135m --objective grpo --recipe hf",
        2,
        says=("--recipe hf: plans sft and the preference objectives",),
    ),
    Case("plan smollm2-135m --objective grpo --beta -1", 2, says=("--beta: -1.0 must be 0 or more for grpo",)),
    Case("plan smollm2-135m --beta 0.1", 2, says=("--beta: applies to the preference objectives and grpo",)),
    Case("plan smollm2-135m --objective dpo --beta 0", 2, says=("--beta: 0.0 must be a positive number",)),
    Case(
        "fit smollm2-135m --objective grpo --num-generations 4 --batch-size 6 --gpu rtx-4090",
        2,
        says=("whole groups of --num-generations 4",),
    ),
    # train: reward functions, found wrong before the model loads, each named by its entry
    Case(
        f"train {{d}}/{_P}-missing-file.yaml",
        2,
        fast=True,
        says=("reward_funcs[0]:", f"{_P}-nowhere.py", "is not a file"),
        keeps=(f"{_P}-missing-file.yaml",),
    ),
    Case(
        f"train {{d}}/{_P}-unknown-function.yaml",
        2,
        says=("reward_funcs[0]:", "defines no 'shortest'", "short"),
        keeps=(f"{_P}-unknown-function.yaml",) + _YAMLS,
    ),
    Case(f"train {{d}}/{_P}-not-callable.yaml", 2, says=("reward_funcs[0]:", "LIMIT is a int, not a function")),
    Case(
        f"train {{d}}/{_P}-one-number.yaml",
        2,
        says=(
            "reward_funcs[0]:",
            "returned a float: return a list of 1 numbers",
        ),
    ),
    Case(f"train {{d}}/{_P}-too-many.yaml", 2, says=("returned 2 rewards for 1 completions",)),
    Case(f"train {{d}}/{_P}-words.yaml", 2, says=("returned 'good' among its rewards",)),
    Case(f"train {{d}}/{_P}-no-column.yaml", 2, says=("reward_funcs[0]:", "raised TypeError", "answer")),
    Case(f"train {{d}}/{_P}-builtin-typo.yaml", 2, says=("reward_funcs[0]: 'lenght' is not a built-in reward",)),
    Case(f"train {{d}}/{_P}-no-rewards.yaml", 2, says=("reward_funcs: objective: grpo needs reward functions",)),
    Case(f"train {{d}}/{_P}-weights.yaml", 2, says=("reward_weights: 1 weights for 2 reward_funcs",)),
    Case(
        f"train {{d}}/{_P}-lengths.yaml",
        2,
        says=("max_prompt_length: 40 + max_completion_length: 8 is more than seq_len: 32",),
    ),
    Case(f"train {{d}}/{_P}-eval.yaml", 2, says=("objective: grpo has no evaluation loss",)),
    Case(f"train {{d}}/{_P}-sft-data.yaml", 2, says=("prompt", "missing (required)")),
    Case(f"train {{d}}/{_P}-sft-rewards.yaml", 2, says=("reward_funcs: applies to objective: grpo",)),
    Case(f"train {{d}}/{_P}-sft-prompts.yaml", 2, says=("holds prompts alone", "objective: grpo")),
    # other tools' GRPO configs
    Case(
        f"plan {{d}}/{_P}-trl-mode.yaml", 2, says=("vllm_mode: 'sideways' is not a vLLM mode TRL's GRPOConfig takes",)
    ),
    Case(f"plan {{d}}/{_P}-axolotl-generations.yaml", 2, says=("whole groups of",)),
    Case(f"plan {{d}}/{_P}-trl-ok.yaml", 0),
]
