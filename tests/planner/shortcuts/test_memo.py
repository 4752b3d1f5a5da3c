"""Everything the planner remembers is in one memo with one clear() (memfit.planner.shortcuts.memo)."""

from __future__ import annotations

import memfit
from memfit.planner.shortcuts import cache as plan_cache
from memfit.planner.shortcuts.memo import LIMITS, MEMO, Memo
from memfit.spec import make_spec

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


def test_a_plan_fills_the_stores_and_clear_empties_every_one(monkeypatch, tmp_path):
    monkeypatch.setenv("MEMFIT_PLAN_CACHE", "1")
    monkeypatch.setenv("MEMFIT_CACHE", str(tmp_path))
    MEMO.clear()
    memfit.plan(dict(TINY), seq_len=32, gpus=2, shard="fsdp", tiling="on")
    sizes = MEMO.sizes()
    assert sizes["samples"] == 2 and sizes["depth_plans"] == 1 and sizes["layouts"] == 1 and sizes["templates"] == 1
    assert sizes["series"] == 2  # each sample's categories after every event, for one rank's peak
    assert list((tmp_path / "plans").glob("*.json"))
    assert MEMO.clear() >= 1  # the plans on disk
    assert not any(MEMO.sizes().values()) and not list((tmp_path / "plans").glob("*.json"))
    assert plan_cache.environment.cache_info().currsize == 0


def test_each_store_keeps_its_newest_entries():
    memo = Memo()
    for n in range(LIMITS["depth_plans"] + 5):
        memo.keep("depth_plans", n, n)
    assert len(memo.depth_plans) == LIMITS["depth_plans"] and min(memo.depth_plans) == 5


def test_templates_are_kept_by_kind_of_plan_not_by_shapes():
    memo = Memo()
    short, long = make_spec(seq_len=128), make_spec(seq_len=4096, batch_size=2, grad_accum=4)
    assert memo.templates_for(TINY, short, None) is memo.templates_for(TINY, long, None)
    assert memo.templates_for(TINY, make_spec(seq_len=128, rank=8), None) is not memo.templates_for(TINY, short, None)
    assert memo.templates_for(TINY, short, "hopper") is not memo.templates_for(TINY, short, None)
    for n in range(LIMITS["templates"] + 1):
        memo.templates_for(dict(TINY, vocab_size=256 + n), short, None)
    assert len(memo.templates) == LIMITS["templates"]
