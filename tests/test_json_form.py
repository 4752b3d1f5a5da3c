"""to_dict() gives a result's dict and to_json() its JSON text; old dict-style reads of to_json() warn."""

from __future__ import annotations

import ast
import copy
import json
import pickle
from pathlib import Path

import pytest

import memfit
from memfit.json_form import JsonForm, JsonText
from memfit.planner.report import MemoryPlan
from memfit.planner.search.results import Fit, FitResult, Miss
from memfit.planner.search.run import RunFit

SRC = Path(memfit.__file__).resolve().parent


def made_up_plan(**changes) -> MemoryPlan:
    categories = {
        "weights": 100,
        "trainable": 10,
        "gradients": 10,
        "optimizer": 20,
        "activations": 30,
        "temporaries": 5,
        "allocator": 3,
        "runtime": 2,
    }
    spec = {
        "method": "lora",
        "rank": 16,
        "optimizer": "adamw",
        "checkpointing": "on",
        "batch_size": 2,
        "grad_accum": 4,
        "seq_len": 512,
        "tiling": "auto",
        "precision": "bf16",
    }
    values = dict(
        model="made-up",
        spec=spec,
        allocated_bytes=170,
        reserved_bytes=175,
        device_total_bytes=180,
        phase="backward",
        categories=categories,
        gpu={"name": "budget", "memory_bytes": 1000},
        fits=True,
        headroom_bytes=820,
        details={"notes": ["a note"]},
    )
    return MemoryPlan(**dict(values, **changes))


def made_up_fit() -> FitResult:
    plan = made_up_plan()
    return FitResult(
        model="made-up",
        gpu=plan.gpu,
        fits=[Fit(spec=plan.spec, plan=plan, relative_speed=1.0)],
        misses=[Miss(spec=plan.spec, device_total_bytes=2000, over_bytes=1000)],
        max_seq_len={"lora": 4096},
        plans_made=3,
        seconds=1.5,
    )


@pytest.mark.parametrize(
    "result",
    [made_up_plan(), made_up_fit(), RunFit(chosen=made_up_plan(), runner_up=None, candidates=2, why="x")],
    ids=["MemoryPlan", "FitResult", "RunFit"],
)
def test_to_json_is_the_json_text_of_to_dict(result, recwarn):
    data = result.to_dict()
    assert isinstance(data, dict) and json.loads(json.dumps(data)) == data  # plain JSON types
    text = result.to_json()
    assert isinstance(text, str) and json.loads(text) == data
    assert text == json.dumps(data) and result.to_json(indent=2) == json.dumps(data, indent=2)
    assert "\n" in result.to_json(indent=2)
    assert not recwarn.list  # used as text, nothing is deprecated


def test_reading_to_json_as_a_dict_still_works_and_warns():
    plan = made_up_plan()
    text = plan.to_json()
    for read in (
        lambda t: t["fits"],
        lambda t: t.get("headroom_bytes"),
        lambda t: list(t.keys()),
        lambda t: dict(t.items()),
        lambda t: list(t.values()),
        lambda t: t == plan.to_dict(),
        lambda t: t["peak"]["device_total_bytes"],
    ):
        with pytest.warns(DeprecationWarning, match=r"MemoryPlan\.to_json\(\) returns JSON text .* call to_dict\(\)"):
            answer = read(text)
        assert answer == read(plan.to_dict())
    with pytest.warns(DeprecationWarning):
        assert dict(text) == plan.to_dict()  # dict(...) reads keys() and [key]
    # As a str it is a str: `in` is a substring test, iteration and length are the text's.
    assert '"fits": true' in text and "fits" in text and len(text) == len(str(text)) and next(iter(text)) == "{"
    assert text[0] == "{" and text[:8] == '{"model"'


def test_json_text_survives_copies_and_pickles():
    text = made_up_plan().to_json()
    for twin in (copy.copy(text), copy.deepcopy(text), pickle.loads(pickle.dumps(text))):
        assert twin == text and isinstance(twin, JsonText)
        with pytest.warns(DeprecationWarning):
            assert twin["model"] == "made-up"
    bare = JsonText('{"a": 1}')  # no dict given: read from the text
    with pytest.warns(DeprecationWarning):
        assert bare["a"] == 1


def test_every_result_object_names_its_json_forms_as_pydantic_does():
    # to_dict() for the dict and to_json() for the text, the latter from JsonForm alone.
    own_to_json, without_base = [], []
    for path in sorted(SRC.rglob("*.py")):
        if path.name == "json_form.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                methods = {n.name for n in node.body if isinstance(n, ast.FunctionDef)}
                bases = {ast.unparse(b) for b in node.bases}
                where = f"{path.relative_to(SRC)}:{node.name}"
                if "to_json" in methods:
                    own_to_json.append(where)
                if "to_dict" in methods and "JsonForm" not in bases:
                    without_base.append(where)
    assert own_to_json == [] and without_base == []


def test_json_form_without_to_dict_is_a_bug():
    with pytest.raises(NotImplementedError):
        JsonForm().to_json()
