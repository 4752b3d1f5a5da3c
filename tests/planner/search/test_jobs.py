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


class _ShardedLinePlanner:
    """Stands in for the search's planner on ``gpus`` GPUs: memory is the model states split over
    the GPUs plus bytes a token of a rank's shard of the row, so each longest length is known by hand."""

    def __init__(self, base: dict):
        self.base, self.count, self.exact = base, 0, True  # plans only: no step learnt over lengths
        self.optimizers = {"lora": ("adamw",)}

    def __call__(self, **knobs):
        from types import SimpleNamespace

        self.count += 1
        gpus, degree = self.base.get("gpus", 1), self.base.get("sequence_parallel", 1)
        total = 1024 * 1024 // gpus + knobs["seq_len"] // degree * 64
        room = 2**20 - total
        return SimpleNamespace(
            spec=dict(knobs), fits=room >= 0, headroom_bytes=room, device_total_bytes=total, details={}
        )

    def cannot_fit(self, **knobs) -> bool:
        return False


def test_with_sequence_parallelism_each_gpu_count_gets_its_longest_sequence_with_and_without_it():
    from memfit.planner.search.jobs import MethodJob

    class Job(MethodJob):
        def planner(self, progress=None, gpus=1, shard="none", **knobs):
            return _ShardedLinePlanner(dict(self.base, gpus=gpus, shard=shard, **knobs))

    levels = [(n, shard) for n, shard in gpu_levels(4, None) if n % 2 == 0]
    job = Job("m", None, {"sequence_parallel": 2}, True, 1, 131072, levels)
    rows, plans = job.longest_by_gpus("lora")
    # a count's most sharded mode; half the states on 2 GPUs, a quarter on 4; a token costs half with 2 ranks a row
    assert [(r["gpus"], r["shard"]) for r in rows] == [(2, levels[-1][1]), (4, levels[-1][1])]
    assert [(r["seq_len"], r["without"]) for r in rows] == [(16384, 8192), (24576, 12288)]
    assert plans > 0
    no_degree = Job("m", None, {}, True, 1, 131072, levels)
    assert no_degree.longest_by_gpus("lora") == ([], 0)  # without sequence parallelism: not searched


def test_fit_reports_the_longest_sequence_per_gpu_count_with_sequence_parallelism():
    import io

    from rich.console import Console

    from memfit.planner.search.report import render_fit
    from memfit.train.conformance import TINY_MODELS

    model = dict(TINY_MODELS["llama"], max_position_embeddings=65536)
    request = FitRequest(
        model, budget="800MiB", gpus=2, batch_size=1, methods=("lora",), workers=1, knobs={"sequence_parallel": 2}
    )
    result = fit(request)
    (row,) = result.to_dict()["max_seq_len_by_gpus"]["lora"]
    assert row["gpus"] == 2 and row["sequence_parallel"] == 2
    assert row["seq_len"] > row["without"] > 0  # half the row per rank: longer rows fit
    assert row["seq_len"] >= result.max_seq_len["lora"]  # its most sharded mode, at least the fastest fit's
    out = io.StringIO()
    render_fit(result, Console(file=out, width=120))
    assert "longest sequence per GPU count" in out.getvalue() and f"{row['seq_len']:,}" in out.getvalue()
