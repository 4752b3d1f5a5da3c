"""One switch turns every shortcut off (memfit.planner.shortcuts.switch): an exact plan reads and
keeps nothing, starts no worker process and predicts nothing; memfit plan, memfit fit, the API and
MEMFIT_EXACT all reach it."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

import memfit
from memfit.cli import app
from memfit.errors import UserError
from memfit.planner import api
from memfit.planner.report import EXACT_LINE
from memfit.planner.search import driver, longest, plans
from memfit.planner.search.request import FitRequest
from memfit.planner.shortcuts import extrapolate
from memfit.planner.shortcuts.memo import LIMITS, MEMO
from memfit.planner.shortcuts.switch import ENV_SWITCH, exact_wanted

runner = CliRunner()

TINY = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 512,
}


@pytest.fixture
def cache_on(monkeypatch, tmp_path):
    monkeypatch.setenv("MEMFIT_PLAN_CACHE", "1")
    monkeypatch.setenv("MEMFIT_CACHE", str(tmp_path / "memfit"))
    return tmp_path / "memfit" / "plans"


def test_the_environment_turns_it_on(monkeypatch):
    monkeypatch.delenv(ENV_SWITCH, raising=False)
    assert not exact_wanted() and exact_wanted(True)
    monkeypatch.setenv(ENV_SWITCH, "1")
    assert exact_wanted(False)
    assert memfit.plan(dict(TINY), seq_len=32).details["exact"]
    monkeypatch.setenv(ENV_SWITCH, "maybe")
    with pytest.raises(UserError, match="MEMFIT_EXACT='maybe': set it to 1"):
        memfit.plan(dict(TINY), seq_len=32)


def test_an_exact_plan_reads_and_keeps_nothing(cache_on, monkeypatch):
    memfit.plan(dict(TINY), seq_len=32)  # kept on disk, and its simulations in the memo
    entries = sorted(cache_on.glob("*.json"))
    for store in LIMITS:  # this process's stores (the plans on disk stay)
        getattr(MEMO, store).clear()
    simulated = []
    real = extrapolate.exact_step
    monkeypatch.setattr(extrapolate, "exact_step", lambda *a, **k: simulated.append(a[2]) or real(*a, **k))
    exact = memfit.plan(dict(TINY), seq_len=32, exact=True)
    assert simulated == [None]  # the whole depth, simulated here: not read from the cache
    assert sorted(cache_on.glob("*.json")) == entries  # nothing written (entries left as they were)
    assert not any(MEMO.sizes().values())
    assert exact.details["exact"] and exact.details["simulated_layers"] == [4]


def test_an_exact_plan_starts_no_worker(monkeypatch):
    class Refused:
        def __call__(self, *args):
            raise AssertionError("an exact plan simulates its step here")

        sample_many = __call__

    assert memfit.plan(dict(TINY), seq_len=32, sampler=Refused(), exact=True).details["exact"]


def test_an_exact_plan_is_never_predicted(monkeypatch):
    from memfit.planner.shortcuts.lengths import LengthSampler

    monkeypatch.setenv(ENV_SWITCH, "1")
    with pytest.raises(ValueError, match="exact plan is simulated, never predicted"):
        api.predicted_plan(dict(TINY), LengthSampler((128, 256)), seq_len=384)


def test_an_exact_search_plans_exact_plans_in_one_process(monkeypatch):
    asked = []
    real = plans.plan
    monkeypatch.setattr(plans, "plan", lambda *a, **k: asked.append(k.get("exact")) or real(*a, **k))
    monkeypatch.setattr(driver, "run_parallel", lambda *a, **k: pytest.fail("an exact search starts no worker process"))
    monkeypatch.setattr(
        longest, "_predicted_boundary", lambda *a, **k: pytest.fail("an exact search predicts no length")
    )
    result = driver.fit(
        FitRequest(
            dict(TINY, max_position_embeddings=32768),
            budget="1GiB",
            batch_size=2,
            methods=("lora", "full"),
            max_seq_len=True,
            exact=True,
        )
    )
    assert result.fits and asked and all(asked)


def test_memfit_plan_exact_says_so(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY))
    data = json.loads(runner.invoke(app, ["plan", str(path), "--seq-len", "32", "--exact", "--json"]).stdout)
    assert data["details"]["exact"] is True and data["details"]["simulated_layers"] == [4]
    text = runner.invoke(app, ["plan", str(path), "--seq-len", "32", "--exact"])
    assert text.exit_code == 0 and EXACT_LINE in " ".join(text.stdout.split())
    old = runner.invoke(app, ["plan", str(path), "--seq-len", "32", "--full-sim", "--json"])
    assert old.exit_code == 0 and json.loads(old.stdout)["details"]["exact"] is True
    assert "--full-sim is now --exact" in old.stderr
    assert "--full-sim" not in runner.invoke(app, ["plan", "--help"]).output
    shortcuts = json.loads(runner.invoke(app, ["plan", str(path), "--seq-len", "32", "--json"]).stdout)
    assert "exact" not in shortcuts["details"] and shortcuts["details"]["simulated_layers"] == [2, 3]


def test_memfit_fit_exact_reaches_the_search(monkeypatch, tmp_path):
    seen = {}

    def fake_fit(request, events=None):
        seen["exact"] = request.exact
        raise SystemExit(0)

    monkeypatch.setattr(driver, "fit", fake_fit)
    runner.invoke(app, ["fit", "smollm2-135m", "--budget", "8GiB", "--exact", "--json"])
    assert seen["exact"] is True
