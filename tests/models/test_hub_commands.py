"""`memfit plan / fit / train / merge` with Hub ids, end to end against the local Hub (tests/models/local_hub.py)."""

from __future__ import annotations

import json

import pytest
import yaml

pytest.importorskip("huggingface_hub")
torch = pytest.importorskip("torch")

from hub_repos import ADAPTER, CATALOG_SOURCE, GATED, LONG_CONTEXT, MODEL, hf_home_is_a_file  # noqa: E402
from local_hub import LocalHub  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from memfit.cli import app  # noqa: E402

runner = CliRunner()


def invoke(*args: str):
    result = runner.invoke(app, list(args))
    assert "Traceback" not in result.output, result.output
    return result


# -- plan and fit: config.json only ----------------------------------------------------------------


def test_plan_a_hub_id_fetches_config_json_alone(hub):
    result = invoke("plan", MODEL, "--seq-len", "64", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["model"] == MODEL
    assert data["details"]["hub"] == {"repo_id": MODEL, "revision": "main", "commit": hub.main}
    assert hub.server.weight_requests() == []
    assert not [r for r in hub.server.requests if r.path.endswith(("tokenizer.json", "model.safetensors.index.json"))]


def test_plan_revision_pins_the_config(hub):
    too_long = invoke("plan", MODEL, "--seq-len", "200")  # main: 128 positions
    assert too_long.exit_code == 2 and "--seq-len: 200 is beyond" in too_long.output
    result = invoke("plan", MODEL, "--revision", "long-context", "--seq-len", "200", "--json")  # 256 positions
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["details"]["hub"]["commit"] == hub.branch
    assert LONG_CONTEXT >= 200


def test_plan_errors_are_one_line_with_exit_code_2(hub):
    missing = invoke("plan", "memfit-test/no-such-model")
    assert missing.exit_code == 2 and "is not a local path and not a model on" in missing.output
    revision = invoke("plan", MODEL, "--revision", "v9")
    assert revision.exit_code == 2 and "revision 'v9' does not exist" in revision.output
    catalog = invoke("plan", "smollm2-135m", "--revision", "main")
    assert catalog.exit_code == 2 and "applies only to a Hugging Face Hub id" in catalog.output
    hub.server.down()
    offline = invoke("plan", MODEL)
    assert offline.exit_code == 2 and "cannot reach" in offline.output and "hf download" in offline.output


def test_plan_with_hf_home_a_file_names_it_and_plans_a_catalog_model_from_its_shipped_config(
    hub, tmp_path, monkeypatch
):
    home = hf_home_is_a_file(monkeypatch, tmp_path / "notes.txt")
    refused = invoke("plan", MODEL)
    assert refused.exit_code == 2
    assert refused.stderr.strip() == (
        f"error: cannot plan this run: model: HF_HOME ({str(home)!r}) is a file, not a folder: "
        "huggingface_hub keeps its cache and your token in that folder. Set HF_HOME to a "
        "folder, or unset it."
    )
    planned = invoke("plan", CATALOG_SOURCE, "--seq-len", "64", "--json")
    assert planned.exit_code == 0, planned.output
    note = json.loads(planned.stdout)["details"]["notes"][0]
    assert note.startswith(f"HF_HOME ({str(home)!r}) is a file, not a folder: planned with memfit's shipped copy")
    assert hub.server.requests == []


def test_fit_fetches_the_config_once_and_writes_a_hub_config(hub, tmp_path):
    best = tmp_path / "best.yaml"
    result = invoke(
        "fit", MODEL, "--budget", "8GiB", "--method", "lora", "--seq-len", "64", "-b", "2", "--write", str(best)
    )
    assert result.exit_code == 0, result.output
    config_heads = [r for r in hub.server.requests if r.path.endswith("/config.json")]
    assert len([r for r in config_heads if r.method == "GET"]) == 1  # every plan of the search used one download
    assert len([r for r in hub.server.requests if r.path.startswith("/api/models/")]) == 1
    written = yaml.safe_load(best.read_text())
    assert written["model"] == MODEL and "init" not in written  # pretrained: memfit train downloads the weights
    from memfit.train.config import load_config

    assert load_config(best).model == MODEL


# -- train -----------------------------------------------------------------------------------------


def _train_yaml(tmp_path, **changes) -> str:
    from trainer_helpers import DEMO_DATA

    settings = {
        "model": MODEL,
        "data": str(DEMO_DATA),
        "method": "lora",
        "rank": 4,
        "precision": "fp32",
        "batch_size": 4,
        "seq_len": 64,
        "max_steps": 2,
        "lr": 5e-3,
        "device": "cpu",
        "output_dir": str(tmp_path / "run"),
        "seed": 0,
    }
    settings.update(changes)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(settings))
    return str(path)


def test_train_a_hub_model(hub, tmp_path):
    result = invoke("train", _train_yaml(tmp_path), "--no-progress")
    assert result.exit_code == 0, result.output
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert run["hub"] == {"repo_id": MODEL, "revision": "main", "commit": hub.main}
    assert run["status"] == "completed" and run["step"] == 2
    assert (tmp_path / "run" / "adapter" / "adapter_model.safetensors").is_file()
    paths = [r.path for r in hub.server.requests]
    first_weights = min(i for i, r in enumerate(hub.server.requests) if r.server == "cdn")
    assert (
        max(i for i, p in enumerate(paths) if p.endswith("tokenizer.json")) < first_weights
    )  # tokenizer, then weights
    assert f"downloading {MODEL}" in result.output


def test_random_init_from_a_hub_config_downloads_config_json_alone(hub, tmp_path):
    result = invoke("train", _train_yaml(tmp_path, init="random", max_steps=1), "--no-progress")
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "run" / "run.json").read_text())["hub"]["commit"] == hub.main
    assert hub.server.weight_requests() == []
    assert {r.path.rsplit("/", 1)[-1] for r in hub.server.requests if "/resolve/" in r.path} == {"config.json"}


def test_a_run_that_does_not_fit_stops_before_any_weights_are_downloaded(hub, tmp_path):
    result = invoke("train", _train_yaml(tmp_path, budget="1MiB"))
    assert result.exit_code == 3 and "preflight" in result.output
    assert hub.server.weight_requests() == []


def test_train_errors_before_work(hub, tmp_path):
    gated = invoke("train", _train_yaml(tmp_path, model=GATED))
    assert (
        gated.exit_code == 2
        and "model: memfit-test/gated-llama is gated" in gated.output
        and "HF_TOKEN" in gated.output
    )
    assert hub.server.weight_requests() == []


def test_train_config_with_a_hub_id_validates_without_network(hub, tmp_path):
    from memfit.train.config import ConfigError, load_config

    hub.server.down()
    assert load_config(_train_yaml(tmp_path, revision="long-context")).revision == "long-context"
    with pytest.raises(ConfigError) as info:
        load_config(_train_yaml(tmp_path, model="smollm2-135m", init="random", revision="main", trust_remote_code=True))
    text = str(info.value)
    assert "revision: 'main' applies only to a Hugging Face Hub model" in text
    assert "trust_remote_code: memfit does not run Python code from model repos" in text
    assert load_config(_train_yaml(tmp_path, trust_remote_code=False)).model == MODEL


def test_resume_uses_the_commit_the_run_started_from(hub, built, tmp_path):
    from rich.console import Console

    from memfit.train.config import load_config
    from memfit.train.hub_model import fetch_small_files, recorded_commit
    from memfit.train.world import make_world

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "run.json").write_text(json.dumps({"hub": {"repo_id": MODEL, "revision": "main", "commit": hub.main}}))
    assert recorded_commit(run_dir, MODEL) == hub.main and recorded_commit(run_dir, "other/model") is None
    moved = hub.server.add_commit(
        MODEL, dict(LocalHub.folder_files(built.model), **{"README.md": b"new"})
    )  # main moves on
    config = load_config(_train_yaml(tmp_path))
    options = {"world": make_world({}), "console": Console(stderr=True, quiet=True), "run_dir": run_dir}
    resumed, snapshot = fetch_small_files(config, resume=True, **options)
    assert snapshot.record() == {"repo_id": MODEL, "revision": "main", "commit": hub.main}
    assert resumed.model == str(snapshot.folder) and resumed.revision is None
    assert fetch_small_files(config, resume=False, **options)[1].commit == moved


# -- merge -----------------------------------------------------------------------------------------


def test_merge_hub_base_and_adapter_equals_merging_the_local_folders(hub, built, tmp_path):
    from merge_helpers import load_tensors

    from memfit.merge import merge

    out = tmp_path / "merged"
    result = invoke("merge", "--base", MODEL, "--adapter", ADAPTER, "--out", str(out))
    assert result.exit_code == 0, result.output
    reference = merge(built.model, built.adapter, tmp_path / "reference", progress=False).out_dir
    merged, expected = load_tensors(out), load_tensors(reference)
    assert merged.keys() == expected.keys()
    for name in expected:
        assert torch.equal(merged[name], expected[name]), name
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in reference.iterdir())
    snapshot = hub.cache / "models--memfit-test--tiny-llama" / "snapshots" / hub.main
    assert sorted(p.name for p in snapshot.iterdir()) == sorted(
        p.name for p in built.model.iterdir()
    )  # read, not written


def test_merge_refusals_come_before_any_download(hub, tmp_path):
    inside = invoke("merge", "--base", MODEL, "--adapter", ADAPTER, "--out", str(hub.cache / "merged"))
    assert inside.exit_code == 2 and "is inside the Hugging Face cache" in inside.output
    local = invoke(
        "merge", "--base", str(tmp_path), "--adapter", ADAPTER, "--out", str(tmp_path / "o"), "--revision", "main"
    )
    assert (
        local.exit_code == 2 and "--revision 'main' applies only when --base is a Hugging Face Hub id" in local.output
    )
    assert hub.server.requests == []
    revision = invoke(
        "merge", "--base", MODEL, "--adapter", ADAPTER, "--adapter-revision", "v9", "--out", str(tmp_path / "o")
    )
    assert (
        revision.exit_code == 2
        and "--adapter memfit-test/tiny-adapter: revision 'v9' does not exist" in revision.output
    )
    gated = invoke("merge", "--base", GATED, "--adapter", ADAPTER, "--out", str(tmp_path / "o"))
    assert gated.exit_code == 2 and "--base memfit-test/gated-llama: memfit-test/gated-llama is gated" in gated.output
    assert not (tmp_path / "o").exists()
    assert [r for r in hub.server.weight_requests() if "gated" in r.path] == []
