"""`memfit fit` end to end: the table, JSON, and a --write YAML that `memfit train` runs unchanged."""

import json
from pathlib import Path

from typer.testing import CliRunner

from memfit.cli import app

runner = CliRunner()

TINY = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 512,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 2,
}


def test_fit_json_and_write_trains(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY))
    out = tmp_path / "best.yaml"
    result = runner.invoke(
        app,
        [
            "fit",
            str(config),
            "--budget",
            "2GiB",
            "--batch-size",
            "2",
            "--seq-len",
            "64",
            "--method",
            "lora",
            "--json",
            "--write",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["fits"] and data["max_seq_len"]["lora"] == 512  # capped by max_position_embeddings
    assert out.exists()
    # No --data: the demo dataset installed with the package, not a copy beside a source checkout.
    import yaml

    import memfit
    from memfit.train.config import demo_dataset_path

    data_path = Path(yaml.safe_load(out.read_text())["data"])
    assert data_path == demo_dataset_path() and data_path.is_file()
    assert Path(memfit.__file__).resolve().parent in data_path.resolve().parents

    from memfit.train.config import load_config
    from memfit.train.recipe import train

    cfg = load_config(
        out,
        overrides={
            "max_steps": 2,
            "device": "cpu",
            "output_dir": str(tmp_path / "run"),
            "precision": "fp32",
            "budget": None,
        },
    )
    assert cfg.method == "lora" and cfg.batch_size * cfg.grad_accum == 2
    train(cfg, progress=False)
    assert (tmp_path / "run" / "adapter" / "adapter_config.json").exists()


def test_write_refuses_to_overwrite(tmp_path):
    out = tmp_path / "best.yaml"
    out.write_text("mine\n")
    result = runner.invoke(
        app,
        [
            "fit",
            "smollm2-135m",
            "--budget",
            "4GiB",
            "--batch-size",
            "1",
            "--seq-len",
            "128",
            "--method",
            "qlora",
            "--write",
            str(out),
        ],
    )
    assert result.exit_code == 2
    assert "exists" in result.output
    assert out.read_text() == "mine\n"


def test_fit_without_target_is_a_clear_error():
    result = runner.invoke(app, ["fit", "smollm2-135m"])
    assert result.exit_code == 2 and "--gpu NAME or --budget SIZE" in result.output


def test_fit_lists_every_bad_number_with_the_other_problems():
    # --batch-size, --seq-len and --gpus are read as the knobs are: text that is not a whole number is
    # one line among the others, not a parser error that hides them.
    result = runner.invoke(
        app,
        [
            "fit",
            "smollm2-135m",
            "--budget",
            "2GiB",
            "--batch-size",
            "x",
            "-s",
            "1.5",
            "--gpus",
            "two",
            "--method",
            "nope",
        ],
    )
    assert result.exit_code == 2
    for line in (
        "--batch-size: 'x' is not a whole number",
        "--seq-len: '1.5' is not a whole number",
        "--gpus: 'two' is not a whole number",
        "--method: nope is not one of",
    ):
        assert line in result.output


def test_fit_at_80_columns_cuts_nothing_and_a_log_shows_progress(tmp_path, monkeypatch):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY))
    monkeypatch.setenv("COLUMNS", "80")  # as on an 80-column terminal
    result = runner.invoke(
        app,
        [
            "fit",
            str(config),
            "--budget",
            "2GiB",
            "--batch-size",
            "4",
            "--seq-len",
            "64",
            "--method",
            "lora",
            "--method",
            "full",
        ],
    )
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert "…" not in result.stdout and max(len(line) for line in lines) <= 80, result.stdout
    assert any("adamw" in line and "GiB" in line for line in lines)  # a whole row: settings and figures
    # stderr is not a terminal here: the estimate, then one plain line per plan, with where the search stands
    log = result.stderr.splitlines()
    assert log[0] == "fit: about 14 plans to make, each is one line"  # 2 methods x (2 + log2(3 splits) + 3)
    plans = [line for line in log if line.startswith("plan ")]
    assert len(plans) >= 5 and plans[0].startswith("plan 1 of ~14, ") and " s elapsed: " in plans[0]
    assert plans[4].startswith("plan 5 of ~14, ") and " left: " in plans[4]  # once three plans are made


def test_fit_to_a_pipe_writes_whole_lines(tmp_path, monkeypatch):
    config = tmp_path / "tiny-llama.json"
    config.write_text(json.dumps(TINY))
    monkeypatch.delenv("COLUMNS", raising=False)
    result = runner.invoke(
        app,
        [
            "fit",
            str(config),
            "--budget",
            "2GiB",
            "--batch-size",
            "2",
            "--seq-len",
            "64",
            "--method",
            "lora",
            "--method",
            "qlora",
            "--gpus",
            "2",
            "--shard",
            "ddp",
        ],
    )
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    title = "tiny-llama on budget 2GiB (2.0 GiB), up to 2 GPUs (fewest that fit; memory per GPU), bf16, 64 tokens a sequence"
    assert lines[0] == title, result.stdout
    assert any(line.startswith("1 lora ") and line.rstrip().endswith(("1.00",)) for line in lines), result.stdout
    assert "…" not in result.stdout


def test_nothing_fits_exits_3_and_writes_nothing(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY))
    out = tmp_path / "best.yaml"
    result = runner.invoke(
        app, ["fit", str(config), "--budget", "1KiB", "--seq-len", "64", "--method", "lora", "--write", str(out)]
    )
    assert result.exit_code == 3, result.output
    assert "no configuration fits" in result.output and not out.exists()


def test_fit_no_cache_writes_no_plans(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMFIT_PLAN_CACHE", "1")
    monkeypatch.setenv("MEMFIT_CACHE", str(tmp_path / "cache"))
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY))
    args = [
        "fit",
        str(config),
        "--budget",
        "8GiB",
        "--seq-len",
        "64",
        "--method",
        "lora",
        "--batch-size",
        "2",
        "--json",
    ]
    result = runner.invoke(app, [*args, "--no-cache"])
    assert result.exit_code == 0, result.output
    assert not (tmp_path / "cache" / "plans").exists()
    monkeypatch.setenv("MEMFIT_PLAN_CACHE", "1")  # --no-cache switched it off for the process
    again = runner.invoke(app, args)
    assert again.exit_code == 0, again.output
    assert list((tmp_path / "cache" / "plans").glob("*.json"))
    first, second = json.loads(result.stdout), json.loads(again.stdout)
    assert first["fits"] and first["fits"] == second["fits"] and first["max_seq_len"] == second["max_seq_len"]


def test_write_json_writes_json_into_a_folder_it_makes(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY))
    out = tmp_path / "new" / "folder" / "best.json"
    result = runner.invoke(
        app,
        [
            "fit",
            str(config),
            "--budget",
            "2GiB",
            "--batch-size",
            "2",
            "--seq-len",
            "64",
            "--method",
            "lora",
            "--write",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    written = json.loads(out.read_text())  # the format the name says: JSON, not YAML in a .json file
    assert written["method"] == "lora" and written["batch_size"] * written["grad_accum"] == 2
    from memfit.train.config import load_config

    assert load_config(out, overrides={"device": "cpu", "budget": None}).method == "lora"  # memfit train reads it
    assert [p.name for p in out.parent.iterdir()] == ["best.json"]  # no temporary file left


def test_write_never_replaces_an_input_not_even_with_overwrite(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY))
    data = tmp_path / "data.jsonl"
    data.write_text('{"instruction": "hi", "output": "hello"}\n')
    (tmp_path / "link.json").symlink_to(config)
    for write, input_ in (
        ("config.json", "config being fitted"),
        ("link.json", "config being fitted"),
        ("data.jsonl", "--data file"),
    ):
        result = runner.invoke(
            app,
            [
                "fit",
                str(config),
                "--budget",
                "2GiB",
                "--seq-len",
                "64",
                "--method",
                "lora",
                "--data",
                str(data),
                "--write",
                str(tmp_path / write),
                "--overwrite",
            ],
        )
        assert result.exit_code == 2, result.output
        assert f"is the {input_}" in result.stderr and "memfit never writes over its inputs" in result.stderr
        assert "plan 1" not in result.output  # before the search
    assert json.loads(config.read_text()) == TINY and data.read_text().startswith('{"instruction"')
    result = runner.invoke(
        app,
        [
            "fit",
            str(config),
            "--budget",
            "2GiB",
            "--data",
            str(tmp_path / "missing.jsonl"),
            "--write",
            str(tmp_path / "best.yaml"),
        ],
    )
    assert result.exit_code == 2 and "--data" in result.stderr and "does not exist" in result.stderr
