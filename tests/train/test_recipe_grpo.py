"""memfit train with objective grpo: the examples/grpo-tiny.yaml run (its reward rises), TRL's metric
names, the reference pass, num_iterations, a resumed run, the run's memory phases."""

from __future__ import annotations

import json

import pytest
from trainer_helpers import REPO, tiny_settings

from memfit.train.config import load_config, validate_config
from memfit.train.recipe import train

PROMPTS = REPO / "examples" / "data" / "grpo-prompts-example.jsonl"

#: What every grpo step logs, under TRL's names.
STEP_NAMES = (
    "loss",
    "grad_norm",
    "reward",
    "reward_std",
    "rewards/length/mean",
    "rewards/length/std",
    "frac_reward_zero_std",
    "completions/mean_length",
    "completions/min_length",
    "completions/max_length",
    "completions/clipped_ratio",
    "completions/mean_terminated_length",
    "entropy",
    "clip_ratio/low_mean",
    "clip_ratio/high_mean",
    "clip_ratio/region_mean",
    "clip_ratio/low_min",
    "clip_ratio/high_max",
)


def _quiet():
    from rich.console import Console

    return Console(stderr=True, quiet=True)


def _steps(run_dir) -> list[dict]:
    return [
        m for m in (json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()) if "reward" in m
    ]


def _grpo(tmp_path, name="run", **changes):
    settings = tiny_settings(
        tmp_path / name,
        data=[str(PROMPTS)],
        objective="grpo",
        reward_funcs=["length"],
        num_generations=4,
        batch_size=8,
        max_completion_length=12,
        seq_len=28,
        max_steps=2,
        log_every=1,
        lr=1e-2,
    )
    settings.update(changes)
    return validate_config(settings)


@pytest.mark.slow
def test_the_grpo_example_raises_its_reward_within_a_few_minutes(tmp_path):
    config = load_config(
        REPO / "examples" / "grpo-tiny.yaml", {"output_dir": str(tmp_path / "run"), "max_steps": 40, "log_every": 1}
    )
    result = train(config, progress=False, console=_quiet())
    steps = _steps(result.run_dir)
    assert len(steps) == 40 and all(set(STEP_NAMES) <= set(s) for s in steps)
    first, last = [s["reward"] for s in steps[:5]], [s["reward"] for s in steps[-5:]]
    assert sum(last) / 5 > sum(first) / 5 + 0.2  # from about 0.6 to above 0.9
    assert steps[-1]["entropy"] < steps[0]["entropy"]


def test_a_grpo_run_logs_trls_names_and_records_its_prompts(tmp_path):
    result = train(_grpo(tmp_path), progress=False, console=_quiet())
    steps = _steps(result.run_dir)
    assert len(steps) == 2 and all(set(STEP_NAMES) <= set(s) for s in steps)
    assert all(1 <= s["completions/mean_length"] <= 12 and 0 <= s["reward"] <= 1 for s in steps)
    record = json.loads((result.run_dir / "run.json").read_text())
    assert record["spec"]["objective"] == "grpo" and record["prompts"]["prompts"] == 64
    assert (result.output_dir / "adapter_model.safetensors").is_file()
    memory = [json.loads(line) for line in (result.run_dir / "memory.jsonl").read_text().splitlines()]
    phases = {p["phase"] for m in memory if m.get("kind") == "step" for p in m["phases"]}
    assert {"generation", "forward", "backward", "optimizer"} <= phases
    longest = [m["extra"]["longest_sequence"] for m in memory if m.get("kind") == "step"]
    assert all(0 < n <= 28 for n in longest)


def test_beta_logs_the_kl_and_num_iterations_reuses_a_generation(tmp_path):
    config = _grpo(tmp_path, method="full", beta=0.05, num_iterations=2, max_steps=4, epsilon=0.1)
    result = train(config, progress=False, console=_quiet())
    steps = _steps(result.run_dir)
    assert all("kl" in s for s in steps) and steps[0]["kl"] == pytest.approx(
        0.0, abs=1e-6
    )  # the policy starts as its reference
    # Two steps on each generation batch: the same completions, so the same rewards.
    assert steps[0]["reward"] == steps[1]["reward"] and steps[2]["reward"] == steps[3]["reward"]
    assert steps[1]["clip_ratio/region_mean"] >= 0.0


def test_a_grpo_run_resumes_from_its_checkpoint(tmp_path):
    first = train(_grpo(tmp_path, max_steps=2, save_every=1), progress=False, console=_quiet())
    resumed = train(_grpo(tmp_path, max_steps=3), resume=True, progress=False, console=_quiet())
    assert first.status == resumed.status == "completed" and resumed.step == 3
    assert len(_steps(resumed.run_dir)) == 3
