"""The accuracy harness runs end to end as its own command (on a CPU, one tiny configuration) and its
plan matches its run. Both tiny configurations, measured and compared, are in the GPU campaign's dry
run (tests/benchmarks/test_gpu_campaign.py), which calls the same functions."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_harness_on_cpu(tmp_path):
    out = tmp_path / "accuracy.json"
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "planner_accuracy.py"),
            "--tiny",
            "--max-cases",
            "1",
            "--device",
            "cpu",
            "--out",
            str(out),
        ],
        check=True,
        capture_output=True,
    )
    result = json.loads(out.read_text())
    assert len(result["cases"]) == 1 and result["machine"]["cpu_count"]
    assert all(case["measured"]["status"] == "ok" for case in result["cases"])
    # Real CPU tensors, measured by the same tracker: the plan is within 1%.
    assert result["summary"]["allocated"]["median_abs_error"] < 0.01


def _accuracy_module():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import planner_accuracy

    return planner_accuracy


def test_what_landed_after_the_first_cases_is_measured_early():
    from memfit.spec import make_spec

    bench = _accuracy_module()
    ids = [bench.case_id(m, k) for m, k in bench.CASES]
    assert len(set(ids)) == len(ids)
    early = [make_spec(**knobs) for _, knobs in bench.CASES[:30]]
    assert {s.reference for s in early} >= {"disabled-adapters", "frozen-copy"}
    assert {s.objective for s in early} >= {"dpo", "orpo", "simpo"}
    assert any(s.dora for s in early) and any(s.rslora for s in early) and any(s.modules_to_save for s in early)
    assert {s.method for s in early} >= {"lora-8bit"} and {s.precision for s in early} >= {"bf16-mixed"}
    hf = [s for s in early if s.recipe == "hf"]
    assert {s.hf_loss for s in hf} >= {"liger", "chunked-nll", "chunked-output", "chunked-ce"} and any(
        not s.kbit_upcast for s in hf
    )
    assert any(s.adapter_dtype == "compute" for s in hf) and any(s.step_in_backward for s in hf)
    assert any(s.adamw_impl == "foreach" for s in hf)
    assert {s.reentrant_checkpointing for s in hf if s.method == "lora-8bit"} == {True, False}


def test_a_preference_case_is_measured_on_its_pairs_with_its_reference_copy():
    bench = _accuracy_module()
    knobs = dict(method="full", checkpointing="off", batch_size=1, seq_len=32, objective="dpo")
    planned = bench.plan_case(bench.TINY_MODEL, knobs, None, "cpu")
    measured = bench.measure_one(bench.TINY_MODEL, knobs, "cpu", steps=2)
    assert measured["status"] == "ok"
    assert abs(measured["allocated_bytes"] / planned["allocated_bytes"] - 1) < 0.01
