"""One method's search as a job (memfit.planner.search.jobs), and memfit fit --gpus N: the smallest
GPU count (and shard mode) that fits, per rank."""

from __future__ import annotations

from memfit.planner.search.driver import fit
from memfit.planner.search.jobs import gpu_levels
from memfit.planner.search.request import FitRequest


def test_levels_are_fewest_gpus_first():
    assert gpu_levels(1, None) == [(1, "none")]
    levels = gpu_levels(6, "fsdp")
    assert levels == [(1, "none"), (2, "fsdp"), (4, "fsdp"), (6, "fsdp")]
    assert [n for n, _ in gpu_levels(8, None)][:2] == [1, 2]


def test_fit_finds_the_fewest_gpus_for_full_fine_tuning():
    common = dict(budget="5GiB", batch_size=1, seq_len=256, methods=("full",), max_seq_len=False, workers=1)
    assert fit(FitRequest("llama-3.2-1b", **common)).fits == []  # one GPU is not enough
    result = fit(FitRequest("llama-3.2-1b", gpus=4, **common))
    assert result.fits
    best = result.fits[0]
    assert best.spec["gpus"] in (2, 4) and best.plan.details["per_rank"]
    assert best.plan.device_total_bytes <= 5 * 2**30
    row = result.to_dict()["fits"][0]
    assert row["gpus"] == best.spec["gpus"] and row["shard"] == best.plan.details["shard"]
    if best.spec["gpus"] == 4:  # then two GPUs with any mode did not fit
        two = fit(FitRequest("llama-3.2-1b", gpus=2, **common))
        assert two.fits == []


def test_fit_tries_only_modes_the_trainer_runs():
    from memfit.spec import TRAINED_SHARD_MODES as TRAINED

    modes = {mode for _, mode in gpu_levels(8, None)} - {"none"}
    assert modes and modes <= set(TRAINED)
    assert "zero1" not in modes


def test_fit_searches_a_preference_run_on_several_gpus():
    common = dict(
        budget="1700MiB",
        batch_size=1,
        seq_len=128,
        methods=("full",),
        max_seq_len=False,
        workers=1,
        knobs={"objective": "dpo"},
    )
    assert (
        fit(FitRequest("smollm2-135m", **common)).fits == []
    )  # one GPU holds the model, its states and a whole reference copy
    result = fit(FitRequest("smollm2-135m", gpus=4, **common))
    assert result.fits
    best = result.fits[0]
    assert best.spec["gpus"] > 1 and best.spec["objective"] == "dpo" and best.plan.details["per_rank"]
    assert (
        "reference" in best.plan.details["phase_peaks_allocated_bytes"] and best.plan.device_total_bytes <= 1700 * 2**20
    )
