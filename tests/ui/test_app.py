"""The JSON API is the command line's --json contract: the same answers, the same error text."""

from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner

from memfit.cli import app as cli
from memfit.ui.app import create_app
from memfit.ui.service import PlannerService

runner = CliRunner()


@pytest.fixture(scope="module")
def client():
    from starlette.testclient import TestClient

    service = PlannerService()
    service.mark_warm()
    with TestClient(create_app(service)) as test_client:
        yield test_client


def cli_json(*args: str) -> dict:
    result = runner.invoke(cli, [*args, "--json"])
    assert result.exit_code in (0, 3), result.output
    return json.loads(result.stdout)


def without_timing(answer: dict) -> dict:
    answer = json.loads(json.dumps(answer))
    answer["details"].pop("plan_seconds", None)
    answer["details"].pop("seconds", None)
    return answer


def upload(client, config_path) -> str:
    response = client.post("/api/model?filename=config.json", content=config_path.read_bytes())
    assert response.status_code == 200, response.text
    return response.json()["model"]


def test_plan_is_memfit_plan_json(client):
    answer = client.get("/api/plan?model=smollm2-135m&method=lora&seq_len=512")
    assert answer.status_code == 200
    assert without_timing(answer.json()) == without_timing(
        cli_json("plan", "smollm2-135m", "--method", "lora", "--seq-len", "512")
    )


def test_plan_of_a_dropped_config_is_memfit_plan_of_the_file(client, tiny_config):
    model = upload(client, tiny_config)
    answer = client.get(f"/api/plan?model={model}&seq-len=128&batch_size=2&gpu=rtx-4090&checkpointing=off")
    expected = cli_json(
        "plan", str(tiny_config), "--seq-len", "128", "--batch-size", "2", "--gpu", "rtx-4090", "--checkpointing", "off"
    )
    assert without_timing(answer.json()) == without_timing(expected)


@pytest.mark.parametrize(
    "query, args",
    [
        ("method=lora&rank=0&seq_len=abc", ["--method", "lora", "--rank", "0", "--seq-len", "abc"]),
        ("model=llama-3.1-8bb", ["llama-3.1-8bb"]),
        ("gpu=rtx-9090", ["--gpu", "rtx-9090"]),
        ("seq_len=999999", ["--seq-len", "999999"]),
    ],
)
def test_a_bad_input_is_a_400_with_the_cli_message(client, query, args):
    answer = client.get(f"/api/plan?{query}")
    assert answer.status_code == 400
    result = runner.invoke(cli, ["plan", *args])
    assert result.exit_code == 2
    message = result.stderr.split("error: ", 1)[1].strip()
    assert " ".join(answer.json()["error"].split()) == " ".join(message.split())


def cli_error(*args: str) -> str:
    result = runner.invoke(cli, list(args))
    assert result.exit_code == 2, result.output
    return " ".join(result.stderr.split("error: ", 1)[1].split())


@pytest.mark.parametrize(
    "query, args",
    [
        ("context_bytes=-1", ["plan", "--context-bytes", "-1"]),
        (
            "context_bytes=2000000000000&seq_len=%C2%B2",
            ["plan", "--context-bytes", "2000000000000", "--seq-len", "\u00b2"],
        ),
        (f"rank={'9' * 5000}", ["plan", "--rank", "9" * 5000]),
        ("targets=q_proj%20v_proj", ["plan", "--targets", "q_proj v_proj"]),
    ],
)
def test_a_value_out_of_range_is_the_cli_message(client, query, args):
    answer = client.get(f"/api/plan?{query}")
    assert answer.status_code == 400
    assert " ".join(answer.json()["error"].split()) == cli_error(*args)


def test_a_long_model_name_is_refused_in_one_line_as_on_the_command_line(client):
    name = "a" * 10_000
    answer = client.get(f"/api/plan?model={name}")
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error.startswith("model: 'aaaa") and "(10,000 characters) is longer than a model name" in error
    assert len(error) < 400 and cli_error("plan", name) == "cannot plan this run: " + error


def test_a_bad_fit_option_is_the_cli_message(client):
    answer = client.get("/api/fit?model=smollm2-135m&gpu=rtx-4090&batch_size=x&seq_len=0&gpus=-2")
    assert answer.status_code == 400
    assert " ".join(answer.json()["error"].split()) == cli_error(
        "fit", "smollm2-135m", "--gpu", "rtx-4090", "--batch-size", "x", "--seq-len", "0", "--gpus", "-2"
    )


#: What a parameter may be given by mistake: negative, zero, huge (and with more digits than Python
#: reads), not a number, empty, very long (with and without spaces), another type's text, a NUL, a
#: digit of another script.
ODD_VALUES = [
    "-1",
    "0",
    "99999999999999999999999999",
    "9" * 5000,
    "nan",
    "",
    "x" * 10_000,
    "a b" * 3000,
    "[1]",
    "\x00",
    "\u00b2",
]


def fuzzed(client, route: str, names, base: dict) -> list[str]:
    """Each of ``names`` given each of :data:`ODD_VALUES` over ``base``: what went wrong."""
    import urllib.parse

    from memfit.spec import flag

    wrong = []
    base_error = client.get(f"{route}?{urllib.parse.urlencode(base)}").json().get("error")
    for name in names:
        for value in ODD_VALUES:
            answer = client.get(f"{route}?{urllib.parse.urlencode(dict(base, **{name: value}))}")
            said = f"{route} {name}={value[:20]!r}: {answer.status_code} {answer.text[:300]}"
            if answer.status_code >= 500:
                wrong.append(said)
            elif answer.status_code >= 400:
                error = answer.json()["error"]
                # What the value added to the base's problems (nothing: it was taken) names the parameter.
                new = [p for p in _problems(error) if p not in (base_error or "")]
                unnamed = [
                    p for p in new if not {name, flag(name), name.replace("_", "-")} & set(re.findall(r"[\w-]+", p))
                ]
                if unnamed or len(error) > 2000 or (len(value) > 1000 and value[:500] in error):
                    wrong.append(said)  # the parameter unnamed, or the value shown whole
    return wrong


def _problems(error: str) -> list[str]:
    """The problems an error lists (its heading, "cannot plan this run:", left off)."""
    lines = error.splitlines()
    if len(lines) > 1:
        return [line.strip().removeprefix("- ") for line in lines[1:]]
    return [re.sub(r"^cannot [^:]+: ", "", error)]


def test_no_parameter_value_makes_a_server_error(client, tiny_config):
    from starlette.testclient import TestClient

    from memfit.options import FIT_KNOBS
    from memfit.spec import KNOBS
    from memfit.ui.params import FIT_OPTIONS, PLAN_OPTIONS

    quiet = TestClient(client.app, raise_server_exceptions=False)
    model = upload(client, tiny_config)
    # Each base is refused, by a check that runs after every check of a single value, so that a
    # value that passes costs no plan and no search.
    plan_base = {"model": model, "seq_len": "128", "targets": "no_such_proj"}
    wrong = fuzzed(quiet, "/api/plan", ("model",) + PLAN_OPTIONS + KNOBS, plan_base)
    wrong += fuzzed(quiet, "/api/context", ("model",) + PLAN_OPTIONS + KNOBS, plan_base)
    # No --gpu nor --budget, and no such method: refused, with every other value checked as well.
    wrong += fuzzed(
        quiet, "/api/fit", ("model",) + FIT_OPTIONS + FIT_KNOBS, {"model": model, "method": "no-such-method"}
    )
    wrong += fuzzed(quiet, "/api/export", ("model", "command", "spec") + PLAN_OPTIONS + KNOBS, {"model": model})
    wrong += fuzzed(quiet, "/api/model", ("model",), {})
    assert wrong == []


def test_fit_streams_its_progress_and_ends_with_memfit_fit_json(client, tiny_config):
    model = upload(client, tiny_config)
    with client.stream(
        "GET", f"/api/fit?model={model}&budget=2GiB&batch_size=2&seq_len=64&method=lora&method=full"
    ) as answer:
        assert answer.status_code == 200 and answer.headers["content-type"].startswith("application/x-ndjson")
        events = [json.loads(line) for line in answer.iter_lines() if line]
    kinds = [e["event"] for e in events]
    assert kinds[0] == "expected" and kinds[-1] == "result" and "progress" in kinds  # "plan k of about n"
    assert events[0]["plans"] > 0
    found = [e for e in events if e["event"] == "found"]
    assert sorted(e["method"] for e in found) == ["full", "lora"]
    # Every row the search reported as it went is in the final table.
    result = events[-1]["result"]
    assert sorted(json.dumps(f["spec"], sort_keys=True) for e in found for f in e["fits"]) == sorted(
        json.dumps(f["spec"], sort_keys=True) for f in result["fits"]
    )
    expected = cli_json(
        "fit",
        str(tiny_config),
        "--budget",
        "2GiB",
        "--batch-size",
        "2",
        "--seq-len",
        "64",
        "--method",
        "lora",
        "--method",
        "full",
    )
    assert without_timing(result) == without_timing(expected)
    assert sum(e["event"] == "progress" for e in events) == result["details"]["plans_made"]


def test_a_bad_fit_is_a_400_before_any_search(client):
    answer = client.get("/api/fit?model=smollm2-135m&method=lora")
    assert answer.status_code == 400
    assert "fit needs --gpu NAME or --budget SIZE" in answer.json()["error"]
    assert client.get("/api/fit?write=x.yaml&gpu=rtx-4090").status_code == 400


def test_context_plans_increasing_lengths_and_finds_the_longest(client, tiny_config):
    model = upload(client, tiny_config)
    with client.stream("GET", f"/api/context?model={model}&seq_len=256&budget=300MiB") as answer:
        assert answer.status_code == 200
        events = [json.loads(line) for line in answer.iter_lines() if line]
    points = [e for e in events if "plan" in e]
    assert points[0]["seq_len"] == 256 and sorted(p["seq_len"] for p in points) == [256, 512, 1024]
    totals = [p["plan"]["peak"]["device_total_bytes"] for p in sorted(points, key=lambda p: p["seq_len"])]
    assert totals == sorted(totals)
    assert events[-1]["capacity_bytes"] == 300 * 2**20 and events[-1]["max_positions"] == 1024
    assert client.get("/api/context?seq_len=0").status_code == 400


def test_explain_gives_the_text_memfit_plan_prints(client):
    from memfit.planner.api import plan
    from memfit.planner.report import CATEGORY_HELP, step_features, suggestions

    result = plan("smollm2-135m", gpu="rtx-4090", budget="512MiB", seq_len=512).to_dict()
    answer = client.post("/api/explain", content=json.dumps(result)).json()
    assert answer["category_help"] == {
        **CATEGORY_HELP,
        **result["details"]["category_help"],
    }  # "frozen base weights in bf16"
    assert result["fits"] is False and answer["suggestions"] == suggestions(result["spec"])
    assert answer["features"] == step_features(result["spec"], result["details"])
    assert client.post("/api/explain", content=b"{not json").status_code == 400


@pytest.mark.parametrize("objective", ["dpo", "orpo", "simpo"])
def test_a_preference_plan_gets_the_words_memfit_plan_prints(client, tiny_config, objective):
    # The page shows what the terminal shows of a preference plan: the batch counts pairs, the
    # reference model (or that there is none), the precision, the memory-lean step.
    model = upload(client, tiny_config)
    result = client.get(f"/api/plan?model={model}&seq_len=128&objective={objective}").json()
    answer = client.post("/api/explain", content=json.dumps(result)).json()
    printed = runner.invoke(cli, ["plan", str(tiny_config), "--seq-len", "128", "--objective", objective])
    assert printed.exit_code == 0, printed.output
    lines = printed.stdout.splitlines()
    assert answer["headline"] in lines and answer["headline"].endswith(f"{objective} (batch counts pairs)")
    assert answer["precision"] in lines
    assert answer["lines"] and all(line in lines for line in answer["lines"])
    assert [line.split(":")[0] for line in answer["lines"]] == ["attention", "reference", "memory-lean step"]
    reference = answer["lines"][1]
    assert ("reference: none: " in reference) == (objective != "dpo"), reference


def test_export_names_a_dropped_config_by_its_file(client, tiny_config):
    model = upload(client, tiny_config)
    answer = client.get(
        f"/api/export?command=plan&model={model}&seq_len=128&spec={json.dumps({'method': 'lora'})}"
    ).json()
    assert answer["cli"] == "memfit plan config.json --seq-len 128"
    assert "model: config.json" in answer["yaml"]


def test_a_dropped_training_config_is_memfit_plan_of_the_file(client, tmp_path):
    # An Axolotl YAML and the DeepSpeed JSON it names, dropped together, as `memfit plan` reads them side by side.
    config = (
        "base_model: smollm2-135m\nadapter: lora\nlora_r: 8\nlora_alpha: 16\nlora_target_linear: true\n"
        "sequence_len: 64\nmicro_batch_size: 1\ngradient_accumulation_steps: 2\nbf16: true\ndeepspeed: ds_z2.json\n"
    )
    deepspeed = json.dumps({"zero_optimization": {"stage": 2}})
    (tmp_path / "axolotl.yml").write_text(config)
    (tmp_path / "ds_z2.json").write_text(deepspeed)
    dropped = client.post("/api/model", content=json.dumps({"files": {"axolotl.yml": config, "ds_z2.json": deepspeed}}))
    assert dropped.status_code == 200, dropped.text
    upload = dropped.json()
    assert (upload["tool_title"], upload["base_model"], upload["knobs"]["seq_len"]) == ("Axolotl", "smollm2-135m", "64")
    assert client.get(f"/api/model?model={upload['model']}").json() == upload

    answer = client.get(f"/api/plan?model={upload['model']}&gpu=rtx-4090&checkpointing=off")
    assert answer.status_code == 200, answer.text
    expected = without_timing(
        cli_json("plan", str(tmp_path / "axolotl.yml"), "--gpu", "rtx-4090", "--checkpointing", "off")
    )
    # The command line names the files by the paths it was given; the page by the names they were dropped under.
    expected["details"]["config"]["path"] = "axolotl.yml"
    expected["details"]["config"]["deepspeed"]["path"] = "ds_z2.json"
    assert without_timing(answer.json()) == expected
    assert str(tmp_path) not in answer.text

    exported = client.get(
        f"/api/export?command=plan&model={upload['model']}&gpu=rtx-4090&spec={json.dumps({'method': 'lora'})}"
    ).json()
    assert exported["cli"] == "memfit plan axolotl.yml --gpu rtx-4090"
    assert "model: smollm2-135m" in exported["yaml"]  # trained on the model the config names


def test_the_form_is_runspec(client):
    from memfit.spec import KNOBS, default

    form = client.get("/api/form").json()
    assert [k["name"] for k in form["knobs"]][:3] == ["method", "rank", "seq_len"]
    assert sorted(k["name"] for k in form["knobs"]) == sorted(KNOBS)
    seq = next(k for k in form["knobs"] if k["name"] == "seq_len")
    assert seq["default"] == default("seq_len") and seq["kind"] == "int" and seq["flag"] == "--seq-len"
    assert any(m["name"] == "llama-3.1-8b" for m in form["models"]) and any(
        g["name"] == "rtx-4090" for g in form["gpus"]
    )


def test_the_page_and_its_files_are_served_offline(client):
    page = client.get("/")
    assert page.status_code == 200 and "/static/vendor/chart.umd.min.js" in page.text
    assert "http" not in page.text.replace("http-equiv", "")  # nothing is fetched from the network
    assert client.get("/static/vendor/chart.umd.min.js").status_code == 200
    assert client.get("/static/app.js").status_code == 200
