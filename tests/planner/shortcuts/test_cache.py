"""The on-disk plan cache: a plan from it is the plan made afresh, and any change of input misses."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import memfit
from memfit.planner import api, inputs
from memfit.planner.shortcuts import cache as plan_cache
from memfit.spec import RunSpec

SRC = Path(memfit.__file__).resolve().parents[1]


@pytest.fixture
def cache_on(monkeypatch, tmp_path):
    """The cache switched on (the suite runs with it off), in a folder of this test's own."""
    monkeypatch.setenv("MEMFIT_PLAN_CACHE", "1")
    monkeypatch.setenv("MEMFIT_CACHE", str(tmp_path / "memfit"))
    return tmp_path / "memfit" / "plans"


@pytest.fixture
def count_estimates(monkeypatch):
    """How many plans were made (simulated and extrapolated), not read from the cache."""
    calls = []
    real = api.estimate_step

    def counted(*args, **kwargs):
        calls.append(args[1])
        return real(*args, **kwargs)

    monkeypatch.setattr(api, "estimate_step", counted)
    return calls


def _entries(folder: Path, kind: str = "plan") -> list[Path]:
    """The cache's entries of one kind (plans; inputs that passed validation: "validated")."""
    return [p for p in folder.glob("*.json") if json.loads(p.read_text()).get("kind") == kind]


def _without_time(plan) -> dict:
    data = copy.deepcopy(plan.to_dict())
    assert isinstance(data["details"].pop("plan_seconds"), float)
    return data


CASES = [
    dict(method="lora", seq_len=128, batch_size=2, gpu="rtx-4090"),
    dict(method="qlora", seq_len=64, checkpointing="offload", budget="1GiB"),
    dict(method="full", seq_len=64, optimizer="sgd", precision="fp32"),
    dict(method="lora", seq_len=64, gpus=2, shard="fsdp", gpu="a100-40gb", targets="q_proj,v_proj"),
]


@pytest.mark.parametrize("knobs", CASES, ids=lambda k: "-".join(str(v) for v in k.values()))
def test_cached_plan_equals_fresh_plan(cache_on, count_estimates, tiny_llama, knobs, monkeypatch):
    fresh = memfit.plan(tiny_llama, **knobs)
    assert len(count_estimates) == 1 and len(_entries(cache_on)) == 1 and len(_entries(cache_on, "validated")) == 1
    # The cached plan times this call (a clock of the test's own: a quarter second), not the stored one.
    ticks = iter([100.0, 100.25])
    monkeypatch.setattr(api, "time", SimpleNamespace(perf_counter=lambda: next(ticks)))
    again = memfit.plan(tiny_llama, **knobs)
    assert len(count_estimates) == 1  # from the cache
    assert _without_time(again) == _without_time(fresh)
    assert json.dumps(_without_time(again)) == json.dumps(_without_time(fresh))  # key order too
    assert again.spec == fresh.spec and again.categories == fresh.categories  # tuples stay tuples
    assert again.details["plan_seconds"] == 0.25


def test_catalog_model_and_text_render_from_cache(cache_on, count_estimates):
    from rich.console import Console

    fresh = memfit.plan("smollm2-135m", seq_len=64, gpu="t4")
    again = memfit.plan("smollm2-135m", seq_len=64, gpu="t4")
    assert len(count_estimates) == 1
    texts = []
    for plan in (fresh, again):
        console = Console(record=True, width=100)
        plan.render(console)
        texts.append(console.export_text())
    assert texts[0] == texts[1]


def test_every_input_is_in_the_key(cache_on, count_estimates, tiny_llama):
    memfit.plan(tiny_llama, method="lora", seq_len=64, gpu="rtx-4090")
    changed = [
        (tiny_llama, dict(method="lora", seq_len=64, gpu="rtx-4090", rank=8)),  # a knob
        (tiny_llama, dict(method="lora", seq_len=64, gpu="rtx-4090", grad_accum=2)),
        (dict(tiny_llama, rope_theta=20000.0), dict(method="lora", seq_len=64, gpu="rtx-4090")),  # a config field
        (tiny_llama, dict(method="lora", seq_len=64, gpu="rtx-3090")),  # another card of 24 GiB
        (tiny_llama, dict(method="lora", seq_len=64, gpu="rtx-4090", budget="20GiB")),
        (tiny_llama, dict(method="lora", seq_len=64, gpu="rtx-4090", context_bytes=2**29)),
    ]
    for number, (config, knobs) in enumerate(changed, start=2):
        memfit.plan(config, **knobs)
        assert len(count_estimates) == number, knobs


def test_key_holds_every_runspec_field_and_the_environment(cache_on, monkeypatch, tiny_llama):
    seen = []
    monkeypatch.setattr(plan_cache, "make_key", lambda kind, inputs: seen.append(inputs) or "k" * 64)
    api._plan_key(inputs.resolve(tiny_llama, method="lora", seq_len=64))
    assert set(seen[0]["spec"]) == set(RunSpec.model_fields)
    assert seen[0]["model"]["config"] == tiny_llama


def test_versions_and_source_change_the_key(monkeypatch):
    inputs = {"spec": {"rank": 16}}
    base = plan_cache.make_key("plan", inputs)
    env = plan_cache.environment()
    assert set(env["libraries"]) >= {"torch", "transformers", "peft", "bitsandbytes"}
    assert env["libraries"]["torch"] is not None  # read from metadata
    for change in (
        dict(env, libraries=dict(env["libraries"], peft="0.0.1")),
        dict(env, libraries=dict(env["libraries"], bitsandbytes=None)),
        dict(env, memfit_source="0" * 64),
        dict(env, python="3.99.0"),
    ):
        monkeypatch.setattr(plan_cache, "environment", lambda change=change: change)
        assert plan_cache.make_key("plan", inputs) != base
    monkeypatch.undo()
    assert plan_cache.make_key("plan", inputs) == base
    assert plan_cache.make_key("plan", {"spec": {"rank": 8}}) != base


def test_source_digest_follows_contents(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text("x = 1\n")
    (tmp_path / "gpus.yaml").write_text("a: 1\n")
    first = plan_cache.folder_digest(tmp_path)
    (tmp_path / "pkg" / "a.py").write_text("x = 2\n")
    second = plan_cache.folder_digest(tmp_path)
    (tmp_path / "gpus.yaml").write_text("a: 2\n")
    assert len({first, second, plan_cache.folder_digest(tmp_path)}) == 3
    (tmp_path / "notes.txt").write_text("not source")
    assert plan_cache.folder_digest(tmp_path) == plan_cache.folder_digest(tmp_path)
    assert plan_cache.source_digest() == plan_cache.folder_digest(SRC / "memfit")


def test_keys_need_canonical_inputs():
    assert plan_cache.make_key("plan", {"config": {"x": object()}}) is None  # no JSON form: not cached
    assert plan_cache.make_key("plan", {"config": {"x": float("nan")}}) is None


def test_unreadable_entries_are_misses_and_replaced(cache_on, count_estimates, tiny_llama):
    fresh = memfit.plan(tiny_llama, seq_len=64)
    (entry,) = _entries(cache_on)
    for garbage in (
        "{not json",
        "",
        json.dumps({"format": plan_cache.FORMAT, "kind": "plan", "key": "other", "value": {}}),
        json.dumps({"format": plan_cache.FORMAT, "kind": "plan", "key": entry.stem, "value": {"model": "x"}}),
    ):
        entry.write_text(garbage)
        again = memfit.plan(tiny_llama, seq_len=64)
        assert _without_time(again) == _without_time(fresh)
        assert json.loads(entry.read_text())["key"] == entry.stem  # rewritten whole
    assert len(count_estimates) == 5


def test_switched_off(monkeypatch, tmp_path, count_estimates, tiny_llama):
    monkeypatch.setenv("MEMFIT_CACHE", str(tmp_path))
    for value in ("0", "off", "false"):
        monkeypatch.setenv("MEMFIT_PLAN_CACHE", value)
        memfit.plan(tiny_llama, seq_len=64)
    monkeypatch.setenv("MEMFIT_PLAN_CACHE", "1")
    memfit.plan(tiny_llama, seq_len=64, cache=False)
    assert not (tmp_path / "plans").exists() and len(count_estimates) == 4


def test_unwritable_cache_is_only_a_miss(cache_on, count_estimates, tiny_llama):
    cache_on.parent.mkdir(parents=True)
    cache_on.write_text("a file where the folder should be")
    memfit.plan(tiny_llama, seq_len=64)
    memfit.plan(tiny_llama, seq_len=64)
    assert len(count_estimates) == 2


def test_values_that_do_not_round_trip_are_not_stored(cache_on):
    assert plan_cache.store("plan", "a" * 64, {"layers": [2, 3]})
    assert plan_cache.load("plan", "a" * 64) == {"layers": [2, 3]}
    assert not plan_cache.store("plan", "b" * 64, {"layers": (2, 3)})
    assert not plan_cache.store("plan", "c" * 64, {1: "int keys come back as strings"})
    assert plan_cache.load("plan", "b" * 64) is None and plan_cache.load("other-kind", "a" * 64) is None


def test_least_recently_used_entries_go_first(cache_on, monkeypatch):
    monkeypatch.setattr(plan_cache, "MAX_ENTRIES", 10)
    keys = [f"{i:064x}" for i in range(10)]
    for age, key in enumerate(keys):
        plan_cache.store("plan", key, {"n": age})
        os.utime(cache_on / f"{key}.json", (1000 + age, 1000 + age))
    assert plan_cache.load("plan", keys[0]) == {"n": 0}  # used now: the newest
    (cache_on / ".x.json.123.tmp").write_text("left by a killed write")
    os.utime(cache_on / ".x.json.123.tmp", (1, 1))
    plan_cache.store("plan", "f" * 64, {"n": 10})  # the eleventh: prunes down to 9
    left = {p.stem for p in cache_on.glob("*.json")}
    assert len(left) == 9 and keys[0] in left and "f" * 64 in left
    assert not {keys[1], keys[2]} & left
    assert not (cache_on / ".x.json.123.tmp").exists()
    assert plan_cache.clear() == 9 and not list(cache_on.glob("*.json"))


def test_cached_plan_imports_no_torch(tmp_path):
    """The second process answers from the cache without importing torch, transformers or PEFT."""
    env = dict(os.environ, MEMFIT_PLAN_CACHE="1", MEMFIT_CACHE=str(tmp_path), PYTHONPATH=str(SRC))
    code = (
        "import json, sys, memfit; p = memfit.plan('smollm2-135m', seq_len=64, gpu='t4').to_dict(); "
        "p['details'].pop('plan_seconds'); "
        "print(json.dumps([p, [m for m in ('torch', 'transformers', 'peft', 'bitsandbytes') if m in sys.modules]]))"
    )
    runs = [
        json.loads(
            subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True)
            .stdout.strip()
            .splitlines()[-1]
        )
        for _ in range(2)
    ]
    assert runs[0][0] == runs[1][0]
    assert {"torch", "transformers", "peft"} <= set(runs[0][1])
    assert runs[1][1] == []
