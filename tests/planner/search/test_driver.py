"""memfit fit's search (memfit.planner.search.driver.fit): every answer is a plan that fits, and the
search reaches the conclusions practitioners know (they are not written into it)."""

from __future__ import annotations

import pytest

import memfit
from memfit.planner.api import PlanError
from memfit.planner.search.driver import METHODS, fit
from memfit.planner.search.request import FitEvents, FitRequest
from memfit.planner.throughput import relative_speeds


def test_every_fit_plans_under_the_budget():
    result = fit(FitRequest("smollm2-135m", budget="4GiB", batch_size=4, seq_len=1024, max_seq_len=False))
    assert result.fits
    for f in result.fits:
        again = memfit.plan(
            "smollm2-135m", budget="4GiB", **{k: v for k, v in f.spec.items() if k not in ("gpus", "shard")}
        )
        assert again.fits and again.device_total_bytes <= 4 * 2**30
        assert f.spec["batch_size"] * f.spec["grad_accum"] == 4  # the effective batch is kept
    speeds = [f.relative_speed for f in result.fits]
    assert speeds == sorted(speeds, reverse=True) and speeds[0] == 1.0


def test_full_fine_tuning_of_8b_does_not_fit_a_24gb_card():
    result = fit(FitRequest("llama-3.1-8b", gpu="rtx-4090", batch_size=1, methods=("full",), max_seq_len=False))
    assert result.fits == []
    assert {m.spec["optimizer"] for m in result.misses} == {"adamw", "adamw8bit", "paged-adamw8bit"}


def test_8b_long_context_on_a_24gb_card_needs_qlora_with_offloaded_checkpointing():
    result = fit(
        FitRequest(
            "llama-3.1-8b", gpu="rtx-4090", batch_size=1, seq_len=98304, methods=("lora", "qlora"), max_seq_len=False
        )
    )
    assert [(f.spec["method"], f.spec["checkpointing"]) for f in result.fits] == [("qlora", "offload")]
    assert {(m.spec["method"], m.spec["checkpointing"]) for m in result.misses} >= {
        ("lora", "offload"),
        ("qlora", "on"),
    }


def test_long_sequences_need_checkpointing():
    result = fit(
        FitRequest("llama-3.2-1b", gpu="a100-40gb", batch_size=1, seq_len=131072, methods=("lora",), max_seq_len=False)
    )
    assert result.fits
    assert all(f.spec["checkpointing"] in ("on", "offload") for f in result.fits)
    assert any(m.spec["checkpointing"] == "off" for m in result.misses)


def test_cards_without_bf16_get_fp16_adapters():
    result = fit(FitRequest("smollm2-135m", gpu="t4", batch_size=2, seq_len=512, methods=("lora",), max_seq_len=False))
    assert result.fits and all(f.spec["precision"] == "fp16" for f in result.fits)


def test_a_given_mixed_precision_is_kept_by_every_plan_of_the_search(tiny_llama):
    from rich.console import Console

    from memfit.planner.search.report import render_fit

    result = fit(
        FitRequest(
            tiny_llama,
            budget="2GiB",
            batch_size=2,
            seq_len=64,
            methods=("full", "lora"),
            max_seq_len=False,
            workers=1,
            knobs={"precision": "bf16-mixed"},
        )
    )
    assert result.fits and {f.spec["precision"] for f in result.fits} == {"bf16-mixed"}
    assert {f.plan.details["precision_regime"] for f in result.fits if f.spec["method"] == "full"} == {
        "bf16 mixed: fp32 weights, gradients and optimizer states, bf16 autocast"
    }
    console = Console(record=True, width=120)
    render_fit(result, console)
    assert "2.0 GiB), bf16-mixed" in console.export_text()


def test_json_contract():
    data = fit(FitRequest("smollm2-135m", budget="4GiB", batch_size=2, seq_len=512, methods=("qlora",))).to_dict()
    assert set(data) >= {"model", "gpu", "fits", "max_seq_len"}
    assert set(data["max_seq_len"]) == {"qlora"}  # the methods searched
    assert data["gpu"]["memory_bytes"] == 4 * 2**30
    for f in data["fits"]:
        assert set(f) >= {"spec", "peak", "relative_speed"}
        assert isinstance(f["relative_speed"], float)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({}, "fit needs --gpu NAME or --budget SIZE"),
        ({"gpu": "rtx-4090", "methods": ("dora",)}, "--method: dora is not one of"),
        ({"gpu": "rtx-4090", "knobs": {"checkpointing": "on"}}, "--checkpointing is chosen by the search"),
        (
            {"gpu": "rtx-4090", "methods": ("full", "lora"), "knobs": {"dora": True}},
            "--dora: only with adapters (--method lora",
        ),
        ({"gpu": "rtx-4090", "methods": ("qlora",), "knobs": {"dora": True}}, "--dora: not with --method qlora"),
        ({"gpu": "rtx-4091"}, "Did you mean 'rtx-4090'"),
    ],
)
def test_bad_input(fields, message):
    with pytest.raises(PlanError) as info:
        fit(FitRequest("smollm2-135m", **fields))
    assert message in str(info.value)


def test_every_problem_is_said_at_once_in_the_order_the_search_checks_them():
    request = FitRequest(
        "smollm2-135m",
        methods=("nope", "full"),
        batch_size="x",
        gpus=-2,
        knobs={"dora": True, "optimizer": "adamw", "rank": 0},
    )
    with pytest.raises(PlanError) as info:
        fit(request)
    problems = info.value.problems
    assert problems[:4] == [
        "fit needs --gpu NAME or --budget SIZE (e.g. --gpu rtx-4090 or --budget 24GiB)",
        "--method: nope is not one of " + ", ".join(METHODS),
        next(p for p in problems if p.startswith("--dora: only with adapters")),
        "--optimizer is chosen by the search; leave it out",
    ]
    # Then each plan's own checks: the knobs the request holds, its batch and its GPU count.
    assert [p.split(":")[0] for p in problems[4:]] == ["--batch-size", "--rank", "--gpus"]


def test_a_huge_batch_is_one_problem_with_fits_bound_beside_the_others():
    with pytest.raises(PlanError) as info:
        fit(FitRequest("smollm2-135m", gpu="rtx-4090", batch_size=10**20, knobs={"rank": 0}))
    batch = [p for p in info.value.problems if p.startswith("--batch-size")]
    assert len(batch) == 1 and "fit plans micro-batch 1" in batch[0]
    assert any(p.startswith("--rank: 0") for p in info.value.problems)


def test_speed_estimate_orders_settings():
    base = {"method": "lora", "checkpointing": "off", "batch_size": 1, "seq_len": 2048}
    full = dict(base, method="full")
    recompute = dict(base, checkpointing="on")
    qlora = dict(base, method="qlora")
    speeds = relative_speeds([base, full, recompute, qlora])
    assert speeds[0] == 1.0 and all(s < 1.0 for s in speeds[1:])


def test_worker_processes_report_every_plan_as_it_is_made(tiny_llama):
    # The methods are searched in worker processes; each plan they make reaches the caller's
    # progress callback, so a long search shows its progress plan by plan, as a one-process one does.
    lines: list[str] = []
    options = dict(budget="2GiB", batch_size=2, seq_len=64, methods=("full", "lora"), max_seq_len=False)
    found: list[tuple[str, int]] = []
    parallel = fit(
        FitRequest(tiny_llama, workers=2, **options),
        FitEvents(progress=lines.append, found=lambda m, fits: found.append((m, len(fits)))),
    )
    assert len(lines) == parallel.plans_made > 2
    assert {line.split(" ")[0] for line in lines} == {"full", "lora"}
    # Each method's fits are told as its search ends, before the ranking.
    assert sorted(found) == sorted((m, sum(f.spec["method"] == m for f in parallel.fits)) for m in ("full", "lora"))
    one_process: list[str] = []
    found_alone: list[tuple[str, int]] = []
    alone = fit(
        FitRequest(tiny_llama, workers=1, **options),
        FitEvents(progress=one_process.append, found=lambda m, fits: found_alone.append((m, len(fits)))),
    )
    assert sorted(one_process) == sorted(lines)
    assert [m for m, _ in found_alone] == ["full", "lora"] and sorted(found_alone) == sorted(found)
    assert [f.spec for f in alone.fits] == [f.spec for f in parallel.fits]


def test_adapter_options_are_searched_only_when_asked():
    from memfit.planner.search.driver import DEFAULT_METHODS, _methods_for

    assert DEFAULT_METHODS == ("full", "lora", "qlora")  # no 8-bit base unless --method lora-8bit
    assert _methods_for(None, {}) == (DEFAULT_METHODS, [])
    assert _methods_for(("lora-8bit", "lora"), {}) == (("lora-8bit", "lora"), [])
    assert _methods_for(None, {"modules_to_save": "lm_head", "rslora": True}) == (("lora", "qlora"), [])
    assert _methods_for(None, {"dora": True}) == (("lora",), [])
    assert _methods_for(None, {"dora": False}) == (DEFAULT_METHODS, [])


def test_every_fit_of_a_dora_search_trains_dora_and_the_modules_asked_for(tiny_llama):
    result = fit(
        FitRequest(
            tiny_llama,
            budget="1GiB",
            batch_size=2,
            seq_len=64,
            max_seq_len=False,
            workers=1,
            knobs={"dora": True, "modules_to_save": "lm_head"},
        )
    )
    assert result.fits and {f.spec["method"] for f in result.fits} == {"lora"}
    for f in result.fits:
        assert f.spec["dora"] is True and f.spec["modules_to_save"] == ["lm_head"]
        assert "DoRA magnitudes" in f.plan.details["category_help"]["trainable"]
