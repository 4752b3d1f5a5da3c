"""memfit train with a preference objective: DPO, ORPO and SimPO runs, their metrics, the reference."""

from __future__ import annotations

import json

import pytest
from trainer_helpers import REPO, tiny_config

from memfit.train.recipe import train

PAIRS = REPO / "src" / "memfit" / "assets" / "data" / "tiny-preferences.jsonl"


def _quiet():
    from rich.console import Console

    return Console(stderr=True, quiet=True)


def _metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_dpo_on_the_demo_pairs_learns_to_prefer_the_chosen_answers(tmp_path):
    config = tiny_config(
        tmp_path / "run",
        data=[str(PAIRS)],
        objective="dpo",
        batch_size=8,
        seq_len=96,
        max_steps=16,
        lr=2e-2,
        warmup_steps=0,
        rank=8,
        log_every=1,
    )
    result = train(config, progress=False, console=_quiet())
    steps = [m for m in _metrics(result.run_dir) if "loss" in m]
    assert len(steps) == 16
    for name in (
        "rewards/chosen",
        "rewards/rejected",
        "rewards/accuracies",
        "rewards/margins",
        "logps/chosen",
        "logps/rejected",
        "logits/chosen",
        "logits/rejected",
    ):
        assert all(name in m for m in steps), name
    # A fresh adapter is the reference: the first step's rewards are all 0, its loss log 2.
    assert steps[0]["rewards/accuracies"] == 0.0 and steps[0]["loss"] == pytest.approx(0.6931, abs=1e-3)
    late = [m["rewards/accuracies"] for m in steps[-4:]]
    assert sum(late) / len(late) > 0.5
    assert sum(m["rewards/margins"] for m in steps[-4:]) > 0
    record = json.loads((result.run_dir / "run.json").read_text())
    assert record["spec"]["objective"] == "dpo" and record["pairs"]["pairs"] == 320
    assert (result.output_dir / "adapter_model.safetensors").is_file()


def _short(tmp_path, name="run", **changes):
    settings = dict(data=[str(PAIRS)], batch_size=2, seq_len=64, max_steps=2, log_every=1)
    settings.update(changes)
    return tiny_config(tmp_path / name, **settings)


PAIR_NAMES = [
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
]
#: What each objective logs besides, as TRL's trainer for it does.
EXTRA_NAMES = {
    "dpo": ["logits/chosen", "logits/rejected"],
    "orpo": ["nll_loss", "log_odds_ratio", "log_odds_chosen"],
    "simpo": ["nll_loss"],
}


@pytest.mark.parametrize(
    "objective, extra", [("orpo", {"beta": 0.2}), ("simpo", {"beta": 2.0, "simpo_gamma": 0.3, "cpo_alpha": 0.5})]
)
def test_orpo_and_simpo_train_without_a_reference(tmp_path, objective, extra):
    result = train(_short(tmp_path, objective=objective, method="full", **extra), progress=False, console=_quiet())
    steps = [m for m in _metrics(result.run_dir) if "loss" in m]
    assert len(steps) == 2 and all(set(PAIR_NAMES + EXTRA_NAMES[objective]) <= set(m) for m in steps)
    assert not any(name.startswith("logits/") for name in steps[0])  # TRL's ORPO / CPO logits/* average the padding
    assert (result.output_dir / "model.safetensors").is_file()


@pytest.mark.parametrize("objective", ["dpo", "orpo"])
def test_evaluation_records_hold_the_metrics_under_trls_eval_names(tmp_path, objective):
    result = train(
        _short(tmp_path, objective=objective, eval_split=0.02, eval_every=1, batch_size=4),
        progress=False,
        console=_quiet(),
    )
    records = _metrics(result.run_dir)
    evals = [m for m in records if "eval_loss" in m]
    assert [m["step"] for m in evals] == [1, 2]
    names = PAIR_NAMES + EXTRA_NAMES[objective]
    for record in evals:
        assert list(record) == ["step", "epoch", "eval_loss"] + [f"eval_{name}" for name in names]
        assert 0.0 <= record["eval_rewards/accuracies"] <= 1.0
    train_names = [k for k in records[0] if "/" in k or k in EXTRA_NAMES[objective]]
    assert train_names == names  # the training records hold the same metrics, unprefixed


def test_full_fine_tuning_dpo_keeps_a_frozen_copy_and_says_so(tmp_path):
    from io import StringIO

    from rich.console import Console

    out = StringIO()
    result = train(
        _short(tmp_path, objective="dpo", method="full"), progress=False, console=Console(file=out, width=200)
    )
    assert "reference: a frozen copy of the model's" in out.getvalue()
    assert result.status == "completed"


def test_precomputed_reference_is_kept_in_the_run_folder_and_a_stopped_pass_continues(tmp_path, monkeypatch):
    from memfit.train import reference as reference_module
    from memfit.train.reference import reference_file

    config = _short(tmp_path, objective="dpo", precompute_reference=True, eval_split=0.05, max_steps=2, batch_size=64)
    real = reference_module.starting_logps
    calls = []

    def stop_after_two(*args, **kwargs):
        calls.append(1)
        if len(calls) > 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(reference_module, "starting_logps", stop_after_two)
    with pytest.raises(KeyboardInterrupt):
        train(config, progress=False, console=_quiet())
    path = reference_file(tmp_path / "run", "train")
    assert len(path.read_text().splitlines()) == 1 + 2 * 64  # the header, then two micro-batches of pairs
    monkeypatch.setattr(reference_module, "starting_logps", real)
    from io import StringIO

    from rich.console import Console

    out = StringIO()
    result = train(config, resume=True, progress=False, console=Console(file=out, width=200))
    assert result.status == "completed"
    said = out.getvalue()
    assert "resuming the reference pass" in said and "(128 already in reference_logps-train.jsonl)" in said
    assert len(path.read_text().splitlines()) == 1 + 304
    assert reference_file(tmp_path / "run", "eval").is_file()
    # A later resume reads the stored values (the weights have moved: they could not be computed again).
    longer = config.model_copy(update={"max_steps": 3})
    out = StringIO()
    assert train(longer, resume=True, progress=False, console=Console(file=out, width=200)).step == 3
    assert "computing" not in out.getvalue()


def test_the_dpo_adapter_merges_like_an_sft_adapter(tmp_path):
    import warnings

    import peft
    import torch
    import transformers
    from safetensors.torch import load_file
    from trainer_helpers import save_tiny_pretrained

    from memfit.merge import merge

    base = save_tiny_pretrained(tmp_path / "base")
    config = _short(
        tmp_path, objective="dpo", model=str(base), init="pretrained", model_overrides={}, lr=5e-2, max_steps=3
    )
    result = train(config, progress=False, console=_quiet())
    merge(base, result.output_dir, tmp_path / "merged", progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        peft.PeftModel.from_pretrained(model, result.output_dir).merge_and_unload().save_pretrained(tmp_path / "peft")
    ours, theirs = (
        load_file(tmp_path / "merged" / "model.safetensors"),
        load_file(tmp_path / "peft" / "model.safetensors"),
    )
    assert sorted(ours) == sorted(theirs) and all(torch.equal(ours[name], theirs[name]) for name in theirs)
    trained = load_file(result.output_dir / "adapter_model.safetensors")
    assert any(name.endswith("lora_B.weight") and tensor.abs().sum() > 0 for name, tensor in trained.items())


def test_the_planned_length_of_pairs_is_their_longest_micro_batch():
    from memfit.step.batch import DOCUMENTS, PADDED
    from memfit.train.fitting import planned_seq_len

    def pair(c, r):
        return {
            "chosen": {"input_ids": [0] * c, "labels": [0] * c},
            "rejected": {"input_ids": [0] * r, "labels": [0] * r},
        }

    pairs = [pair(10, 30), pair(20, 20), pair(5, 7)]
    assert planned_seq_len(pairs, 2, 64, PADDED, False) == 30  # the longest sequence
    assert planned_seq_len(pairs, 2, 64, DOCUMENTS, False) == 20  # (40 + 40) tokens in 4 sequences
    assert planned_seq_len(pairs, 1, 16, PADDED, False) == 16


def test_fit_searches_preference_runs_with_the_batch_in_pairs(tmp_path):
    from trainer_helpers import tiny_model_dict

    from memfit.planner.search.run import RunPlanner
    from memfit.planner.target import target_from_options

    knobs = {**_short(tmp_path, objective="dpo", batch_size=4, grad_accum=1).spec.knobs(), "seq_len": 64}
    found = RunPlanner(tiny_model_dict(), target_from_options(None, "1GiB")).fit(knobs)
    assert found is not None
    chosen = found.knobs()
    assert chosen["batch_size"] * chosen["grad_accum"] == 4 and found.chosen.spec["objective"] == "dpo"


def test_a_resumed_full_fine_tuning_dpo_run_ends_where_an_uninterrupted_one_does(tmp_path):
    import torch
    from safetensors.torch import load_file

    # The frozen reference copy must hold the starting weights after a resume, not the checkpoint's.
    straight = train(
        _short(tmp_path, "straight", objective="dpo", method="full", max_steps=4, lr=5e-3),
        progress=False,
        console=_quiet(),
    )
    first = _short(tmp_path, "resumed", objective="dpo", method="full", max_steps=2, lr=5e-3)
    train(first, progress=False, console=_quiet())
    resumed = train(first.model_copy(update={"max_steps": 4}), resume=True, progress=False, console=_quiet())
    assert [m["loss"] for m in _metrics(resumed.run_dir) if "loss" in m] == [
        m["loss"] for m in _metrics(straight.run_dir) if "loss" in m
    ]
    ours, theirs = (
        load_file(resumed.output_dir / "model.safetensors"),
        load_file(straight.output_dir / "model.safetensors"),
    )
    assert all(torch.equal(ours[name], theirs[name]) for name in theirs)
