"""The planner's worker processes: a plan's depths side by side, a search's parts apart; the same
answers as in one process."""

from __future__ import annotations

import memfit
from memfit.planner.search.driver import fit
from memfit.planner.search.request import FitEvents, FitRequest
from memfit.planner.shortcuts.workers import DepthPool


def _without_time(plan) -> dict:
    data = plan.to_dict()
    data["details"].pop("plan_seconds")
    return data


def test_a_plan_whose_depths_are_simulated_side_by_side_is_the_same_plan():
    pool = DepthPool(2)
    try:
        for knobs in (
            dict(method="lora", seq_len=256),
            dict(method="full", seq_len=128, batch_size=2, checkpointing="on"),
        ):
            side_by_side = memfit.plan("smollm2-135m", budget="2GiB", cache=False, sampler=pool, **knobs)
            here = memfit.plan("smollm2-135m", budget="2GiB", cache=False, **knobs)
            assert side_by_side.details["simulated_layers"] == [2, 3]  # two depths: each in a worker
            assert _without_time(side_by_side) == _without_time(here)
    finally:
        pool.close()


def test_a_search_split_into_parts_answers_as_one_process_does(tiny_llama):
    # On one GPU each method's micro-batch search and longest-sequence search are jobs of their own.
    options = dict(budget="2GiB", batch_size=2, seq_len=64, methods=("full", "lora"))
    found: list[str] = []
    parallel = fit(
        FitRequest(tiny_llama, workers=2, **options), FitEvents(found=lambda method, fits: found.append(method))
    )
    alone = fit(FitRequest(tiny_llama, workers=1, **options))
    assert sorted(found) == ["full", "lora"]  # once a method, when its micro-batch search ends
    assert [f.spec for f in parallel.fits] == [f.spec for f in alone.fits]
    assert parallel.max_seq_len == alone.max_seq_len and parallel.max_seq_len_specs == alone.max_seq_len_specs
    assert parallel.plans_made == alone.plans_made


def test_the_worker_server_imports_bitsandbytes_without_a_word():
    # memfit ui's worker server imports bitsandbytes for its workers; on a CPU without its optional
    # kernels bitsandbytes warns at import, which would land in the terminal memfit ui prints its
    # address to.
    import subprocess
    import sys

    import pytest

    pytest.importorskip("bitsandbytes")
    code = "import memfit.planner.shortcuts.server_exit, bitsandbytes"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "bitsandbytes" not in done.stderr.lower() and "kernels" not in done.stderr
