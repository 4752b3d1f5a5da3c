"""The API's query parameters are memfit plan's and memfit fit's options, read the same way."""

from __future__ import annotations

import inspect

import pytest

from memfit.ui import params
from memfit.ui.params import QueryError, fit_call, plan_call


def q(**items):
    return {k: v if isinstance(v, list) else [v] for k, v in items.items()}


def test_names_with_dashes_or_underscores_are_the_same_option():
    assert plan_call(q(model="smollm2-135m", **{"seq-len": "512"})).knobs == {"seq_len": "512"}
    assert plan_call(q(model="smollm2-135m", seq_len="512")).knobs == {"seq_len": "512"}


def test_plan_options_go_where_memfit_plan_puts_them():
    call = plan_call(q(gpu="rtx-4090", budget="20GiB", context_bytes="600", exact="", method="qlora", packing=""))
    assert call.model == params.DEFAULT_MODEL
    assert call.options == {"gpu": "rtx-4090", "budget": "20GiB", "context_bytes": 600, "exact": True, "cache": True}
    assert call.knobs == {"method": "qlora", "packing": "true"}


def test_an_empty_field_leaves_the_option_off():
    assert plan_call(q(seq_len="", gpu="")).knobs == {}


def test_an_unknown_option_names_the_closest():
    with pytest.raises(QueryError, match=r"unknown option --seqlen for memfit plan\. Did you mean --seq-len\?"):
        plan_call(q(seqlen="512"))


def test_an_option_given_twice_is_refused():
    with pytest.raises(QueryError, match="--rank is given more than once"):
        plan_call(q(rank=["8", "16"]))


@pytest.mark.parametrize("model", ["/etc/passwd", "../config.json", "~/models/x", "config.json", "C:\\models\\llama"])
def test_a_model_that_is_a_path_is_refused(model):
    with pytest.raises(QueryError, match="is a path; the page never reads the server's files"):
        plan_call(q(model=model))


@pytest.mark.parametrize("model", ["llama-3.1-8b", "meta-llama/Llama-3.1-8B", "upload-0123456789ab", "not-a-model"])
def test_names_pass_to_the_planner(model):
    assert plan_call(q(model=model)).model == model


def test_fit_options_as_memfit_fit_passes_them():
    call = fit_call(
        q(
            model="llama-3.1-8b",
            gpu="rtx-4090",
            batch_size="16",
            seq_len="4096",
            method=["lora", "qlora"],
            gpus="2",
            shard="fsdp",
            rank="8",
            precision="fp16",
        )
    )
    assert call.options == {
        "gpu": "rtx-4090",
        "batch_size": 16,
        "seq_len": 4096,
        "methods": ("lora", "qlora"),
        "gpus": 2,
    }
    assert call.knobs == {"shard": "fsdp", "rank": "8", "precision": "fp16"}
    assert fit_call(q()).options == {}  # memfit fit's default effective batch (8, or a tool config's own)
    assert fit_call(q(exact="")).options == {"exact": True} and fit_call(q(exact="false")).options == {"exact": False}


def test_fit_refuses_what_writes_files_and_what_the_search_chooses():
    with pytest.raises(QueryError, match="--write: not taken here"):
        fit_call(q(write="/tmp/x.yaml"))
    with pytest.raises(QueryError, match="unknown option --checkpointing for memfit fit"):
        fit_call(q(checkpointing="on"))
    # A whole number that is not one goes on, as memfit fit's does, to the search's checks, which
    # name it with every other problem (tests/ui/test_app.py: the API's 400 is the CLI's message).
    assert fit_call(q(batch_size="x", seq_len="-1")).options == {"batch_size": "x", "seq_len": -1}


def _cli_options(command) -> set[str]:
    """The options of a command, less those it takes only to refuse (hidden: memfit train's settings)."""
    params = inspect.signature(command).parameters.values()
    return {p.name for p in params if not getattr(p.default, "hidden", False)} - {"model", "as_json"}


def test_the_api_takes_every_option_of_the_command_line():
    # A knob or option added to memfit plan or fit must reach the page too (or be refused with why).
    from memfit.cli import DEFAULT_MODEL, fit_command, plan_command

    assert params.DEFAULT_MODEL == DEFAULT_MODEL
    assert _cli_options(plan_command) == set(params.PLAN_OPTIONS) | set(params.KNOBS) | set(params.PLAN_REFUSED)
    fit_taken = set(params.FIT_OPTIONS) | set(params.FIT_KNOBS) | set(params.FIT_REFUSED)
    assert (_cli_options(fit_command) - {"max_target"}) | {"max"} == fit_taken  # --max is max_target in Python
