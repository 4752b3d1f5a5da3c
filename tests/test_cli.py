"""The command line: what a user types, what they read. Bad input exits 2 with a message, no traceback."""

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from memfit.cli import app

runner = CliRunner()


def test_plan_default_model_runs():
    result = runner.invoke(app, ["plan"])
    assert result.exit_code == 0, result.output
    assert "smollm2-135m" in result.output and "device total" in result.output


def test_plan_json(tmp_path):
    config = {
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 256,
        "max_position_embeddings": 512,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    result = runner.invoke(app, ["plan", str(path), "--method", "lora", "--rank", "8", "--seq-len", "64", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["spec"]["rank"] == 8 and data["spec"]["method"] == "lora"
    assert sum(data["categories"].values()) == data["peak"]["device_total_bytes"]


def test_plan_against_gpu_says_fit():
    result = runner.invoke(app, ["plan", "smollm2-135m", "--method", "qlora", "--seq-len", "512", "--gpu", "rtx-4090"])
    assert result.exit_code == 0, result.output
    assert "fits rtx-4090" in result.output


def test_plan_bad_input_is_one_clear_error():
    result = runner.invoke(app, ["plan", "lama-3-8b", "--rank", "0"])
    assert result.exit_code == 2
    assert "Did you mean" in result.output and "--rank: 0 must be 1 or more" in result.output
    assert "Traceback" not in result.output


#: Runs the command line as `memfit` does, and says on stderr, as the process ends (after any error
#: was printed), which of the heavy libraries it imported.
_IMPORT_PROBE = (
    "import atexit, sys\n"
    "atexit.register(lambda: print('heavy:', *[m for m in ('torch', 'transformers', 'peft') if m in sys.modules], file=sys.stderr))\n"
    "sys.argv = ['memfit', *sys.argv[1:]]\n"
    "from memfit.cli import main\n"
    "main()\n"
)


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["plan", "--rank", "0"], "--rank: 0 must be 1 or more"),
        (["plan", "--rank", "99999999999999999999"], "must be at most 65536"),
        (["plan", "--gpu", "rtx-4091"], "Did you mean 'rtx-4090'"),
        (["plan", "--budget", "lots"], "--budget"),
        (["fit", "--budget", "24GiB", "--rank", "0"], "--rank: 0 must be 1 or more"),
        (["fit", "--gpu", "rtx-4090", "--method", "lorra"], "--method: lorra"),
        (["plan", "--modules-to-save", ",,"], "--modules-to-save: ',,' has an empty item"),
        (["plan", "--simpo-gamma", "0.2"], "--simpo-gamma 0.2: simpo_gamma is a training-config field"),
        (["plan", "--beta", "0.2"], "--beta: applies to the preference objectives and grpo (got --objective sft)"),
    ],
)
def test_bad_input_is_reported_without_importing_torch_transformers_or_peft(args, says):
    # Seconds of imports on a busy machine: a mistake in an option must not wait for them.
    result = subprocess.run([sys.executable, "-c", _IMPORT_PROBE, *args], capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr
    assert says in result.stderr and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == "heavy:", result.stderr


def test_the_import_probe_sees_the_heavy_imports():
    # The probe itself: a command that plans imports torch and transformers, and it says so.
    result = subprocess.run(
        [sys.executable, "-c", _IMPORT_PROBE, "plan", "--seq-len", "64", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert {"torch", "transformers"} <= set(result.stderr.strip().splitlines()[-1].split()[1:])


def test_plan_bad_choice():
    result = runner.invoke(app, ["plan", "--method", "lorra"])
    assert result.exit_code == 2
    assert "lorra" in result.output


def test_models_lists_catalogs():
    result = runner.invoke(app, ["models", "--json"])
    assert result.exit_code == 0
    data = json.loads(result.stdout)
    assert any(m["name"] == "llama-3.1-8b" for m in data["models"])
    assert any(g["name"] == "h100-80gb" for g in data["gpus"])


def test_plan_with_a_gpu_and_a_smaller_budget_says_both(tmp_path, monkeypatch):
    result = runner.invoke(
        app,
        [
            "plan",
            "smollm2-135m",
            "--method",
            "qlora",
            "--seq-len",
            "512",
            "--gpu",
            "t4",
            "--budget",
            "10GiB",
            "--precision",
            "fp16",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "fits t4, budget 10GiB (10.0 GiB)" in result.output
    refused = runner.invoke(app, ["plan", "smollm2-135m", "--gpu", "t4", "--budget", "24GiB"])
    assert refused.exit_code == 2 and "24GiB is more than t4's 15.0 GiB" in refused.output


def test_plan_that_does_not_fit_exits_3_for_scripts():
    result = runner.invoke(app, ["plan", "smollm2-135m", "--seq-len", "512", "--budget", "100MiB", "--json"])
    assert result.exit_code == 3
    assert json.loads(result.stdout)["fits"] is False


def test_models_never_cuts_a_name_at_80_columns(monkeypatch):
    from memfit.models.catalog import catalog_names
    from memfit.models.gpus import load_gpus

    monkeypatch.setenv("COLUMNS", "80")  # as on an 80-column terminal
    result = runner.invoke(app, ["models"])
    assert result.exit_code == 0
    assert "…" not in result.stdout
    words = set(result.stdout.replace("│", " ").split())
    assert set(catalog_names()) <= words and set(load_gpus()) <= words
    assert max(len(line) for line in result.stdout.splitlines()) <= 80


def test_plan_to_a_pipe_writes_whole_lines(monkeypatch):
    # On a terminal the table reads at its width; to a pipe or a file no line is wrapped or cut, so
    # that grep and scripts see the header, every row and every note whole.
    from memfit.planner.api import plan
    from memfit.planner.report import CATEGORY_HELP

    monkeypatch.delenv("COLUMNS", raising=False)
    result = runner.invoke(app, ["plan", "smollm2-135m", "--seq-len", "256", "--gpu", "rtx-4090"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0] == "smollm2-135m · lora r=16 · bf16 · adamw · batch 1 x 256 tokens · checkpointing on"
    # each row says what its category holds in this plan (the frozen base's dtype, what trains)
    helps = {**CATEGORY_HELP, **plan("smollm2-135m", seq_len=256, gpu="rtx-4090").details["category_help"]}
    for name, help in helps.items():
        assert any(name in line and help in line for line in lines), (name, result.stdout)
    assert any(
        line.startswith("attention: memfit: each micro-batch's examples in one row") and line.endswith("tensor")
        for line in lines
    )
    assert "…" not in result.stdout and max(len(line) for line in lines) > 80


def test_models_to_a_pipe_writes_whole_rows():
    import os
    import subprocess
    import sys

    from memfit.models.gpus import load_gpus

    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    result = subprocess.run(
        [sys.executable, "-m", "memfit", "models"], capture_output=True, text=True, env=env, timeout=300
    )
    assert result.returncode == 0, result.stderr
    rows = [line.split("│")[1:-1] for line in result.stdout.splitlines() if line.startswith("│")]
    by_name = {cells[0].strip(): [c.strip() for c in cells] for cells in rows}
    assert by_name["llama-3.1-8b"] == ["llama-3.1-8b", "llama", "32", "4096", "128256", "131072"]  # one line a row
    for gpu in load_gpus().values():
        assert by_name[gpu.name][1] == gpu.display_name
    assert result.stdout.splitlines()[-1] == (
        "Any causal LM works too: pass a Hugging Face Hub id (org/name), a config.json or a local model folder."
    )


def test_plan_cache_and_no_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMFIT_PLAN_CACHE", "1")
    monkeypatch.setenv("MEMFIT_CACHE", str(tmp_path))
    args = ["plan", "smollm2-135m", "--seq-len", "64", "--json"]
    fresh = runner.invoke(app, [*args, "--no-cache"])
    assert fresh.exit_code == 0, fresh.output
    assert not (tmp_path / "plans").exists()  # --no-cache neither reads nor writes
    runner.invoke(app, args)
    cached = runner.invoke(app, args)
    kinds = sorted(json.loads(p.read_text())["kind"] for p in (tmp_path / "plans").glob("*.json"))
    assert kinds == ["plan", "validated"]
    first, second = (json.loads(r.stdout) for r in (fresh, cached))
    for data in (first, second):
        data["details"].pop("plan_seconds")
    assert first == second


def test_a_training_setting_given_to_plan_or_fit_says_what_it_is(tmp_path):
    result = runner.invoke(app, ["plan", "--simpo-gamma", "0.2"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert result.stderr.strip() == (
        "error: --simpo-gamma 0.2: simpo_gamma is a training-config field (simpo_gamma: in memfit "
        "train's YAML) that does not change memory, so memfit plan does not take it. Drop "
        "--simpo-gamma."
    )
    # Every setting of memfit train that is not a plan's: its own options and its config's fields, the flags too.
    result = runner.invoke(
        app, ["fit", "--gpu", "rtx-4090", "--lr", "1e-4", "--force", "--resume", "--warmup-steps", "10"]
    )
    assert result.exit_code == 2
    assert [line.split(":")[0] for line in result.stderr.splitlines()[1:]] == [
        "  - --resume",
        "  - --lr 1e-4",
        "  - --force",
        "  - --warmup-steps 10",
    ]
    assert "does not change memory, so memfit fit does not take it" in result.stderr
    result = runner.invoke(app, ["plan", "--data", str(tmp_path / "d.jsonl")])
    assert result.exit_code == 2 and "the sequence length planned is --seq-len" in " ".join(result.stderr.split())
    # A mistyped option is never pointed to one that is refused.
    result = runner.invoke(app, ["plan", "--rnak", "8"])
    assert result.exit_code == 2 and "--rank" in result.output and "--lr" not in result.output
    assert "--simpo-gamma" not in runner.invoke(app, ["plan", "--help"]).output


def test_every_training_setting_that_is_not_a_plan_s_is_refused_by_plan():
    from memfit.spec import KNOBS
    from memfit.train.command import training_settings
    from memfit.train.config import TrainConfig

    settings = training_settings()
    assert {"simpo_gamma", "lr", "resume", "set_", "warmup_steps", "output_dir", "report_to"} <= set(settings)
    assert not set(settings) & {*KNOBS, "gpu", "budget", "revision", "model"}
    assert set(TrainConfig.model_fields) - set(KNOBS) - {"gpu", "budget", "revision", "model"} <= set(settings)


def test_a_plan_tells_a_terminal_what_it_is_doing_and_leaves_nothing_behind(tmp_path, monkeypatch):
    import io

    from memfit import cli
    from memfit.console import make_console

    config = {
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 256,
        "max_position_embeddings": 512,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    terminal = io.StringIO()
    plain = cli.make_console
    monkeypatch.setattr(
        cli,
        "make_console",
        lambda stderr=False, **options: (
            make_console(file=terminal, force_terminal=True, width=200) if stderr else plain(**options)
        ),
    )
    monkeypatch.setattr(cli, "PLAN_STATUS_DELAY_S", 0.0)  # shown at once: no waiting for a second to pass
    result = runner.invoke(app, ["plan", str(path), "--seq-len", "64", "--no-cache"])
    assert result.exit_code == 0, result.output
    shown = terminal.getvalue()
    assert f"planning {path}: building the model from its config and simulating one training step" in shown
    assert shown.endswith("\x1b[1A\x1b[2K")  # erased before the plan is printed
    assert "device total" in result.stdout and "planning" not in result.stdout


def test_a_plan_says_nothing_on_a_stderr_that_is_not_a_terminal():
    from memfit import cli

    assert cli.PLAN_STATUS_DELAY_S == 1.0  # on a terminal, once a plan has taken a second
    result = runner.invoke(app, ["plan", "--seq-len", "64", "--no-cache"])
    assert result.exit_code == 0 and result.stderr == ""
