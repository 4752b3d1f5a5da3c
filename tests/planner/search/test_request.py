"""What fit is asked and what it tells (memfit.planner.search.request): a FitRequest holds RunSpec
knobs by their names only, memfit.fit's keywords are read into a request and its events, and the
events' stop ends a search before its next plan."""

from __future__ import annotations

import threading

import pytest

import memfit
from memfit.planner.errors import SearchCancelled
from memfit.planner.search.driver import fit
from memfit.planner.search.request import FitEvents, FitRequest, keyword_request
from memfit.spec import SpecError


def test_a_request_keeps_its_own_copy_of_the_knobs_and_the_methods_as_a_tuple():
    knobs = {"rank": 8}
    request = FitRequest("smollm2-135m", methods=["lora", "qlora"], knobs=knobs)
    knobs["rank"] = 64
    assert request.knobs == {"rank": 8} and request.methods == ("lora", "qlora")
    with pytest.raises(AttributeError):
        request.seq_len = 1024  # frozen: a request is what was asked, passed on as it is


def test_an_unknown_knob_is_refused_when_the_request_is_made_as_make_spec_says_it():
    with pytest.raises(SpecError, match=r"unknown knob 'rnak'. Did you mean 'rank'\?"):
        FitRequest("smollm2-135m", knobs={"rnak": 8})


def test_the_request_s_own_fields_are_not_knobs():
    # The effective batch, the length held and "up to N GPUs" mean something of their own in a search.
    for name in ("batch_size", "seq_len", "gpus"):
        with pytest.raises(TypeError, match=f"give {name} as the request's own field"):
            FitRequest("smollm2-135m", knobs={name: 2})


def test_keywords_are_fields_events_and_knobs():
    stop = threading.Event()
    request, events = keyword_request(
        "smollm2-135m",
        gpu="rtx-4090",
        batch_size=4,
        seq_len=512,
        gpus=2,
        methods=("lora",),
        workers=1,
        exact=True,
        rank=16,
        shard="fsdp",
        progress=print,
        stop=stop,
    )
    assert request == FitRequest(
        "smollm2-135m",
        gpu="rtx-4090",
        batch_size=4,
        seq_len=512,
        gpus=2,
        methods=("lora",),
        workers=1,
        exact=True,
        knobs={"rank": 16, "shard": "fsdp"},
    )
    assert events == FitEvents(progress=print, stop=stop)


def test_memfit_fit_takes_keywords(tiny_llama):
    lines: list[str] = []
    result = memfit.fit(
        tiny_llama,
        budget="2GiB",
        batch_size=2,
        seq_len=64,
        methods=("lora",),
        max_seq_len=False,
        workers=1,
        rank=4,
        progress=lines.append,
    )
    assert result.fits and {f.spec["rank"] for f in result.fits} == {4}
    assert len(lines) == result.plans_made > 0
    with pytest.raises(SpecError, match="unknown knob 'rnak'"):
        memfit.fit(tiny_llama, budget="2GiB", rnak=4)


def test_without_events_nothing_is_told():
    assert FitEvents().plan_reporter() is None  # the worker processes then report nothing
    lines: list[str] = []
    assert FitEvents(progress=lines.append).plan_reporter() == lines.append


def test_a_stopped_search_ends_before_its_next_plan(tiny_llama):
    stop, lines = threading.Event(), []
    stop.set()
    request = FitRequest(tiny_llama, budget="2GiB", batch_size=2, seq_len=64, methods=("lora",), workers=1)
    with pytest.raises(SearchCancelled):
        fit(request, FitEvents(progress=lines.append, stop=stop))
    assert lines == []
    reporter = FitEvents(stop=threading.Event()).plan_reporter()
    reporter("lora · checkpointing off")  # not stopped: nothing to say, nothing raised
