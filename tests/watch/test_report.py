"""memfit report: a self-contained HTML page with inlined charts, PNGs beside it, written safely."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import pytest
from watch_helpers import GiB, MiB, start_record, step_records, tiny_plan, write_run

pytest.importorskip("matplotlib")

from memfit.watch.report import ReportError, write_report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def cuda_run(tmp_path):
    def devices(s):
        return {
            "cuda:0": {
                "allocated_bytes": 10 * GiB + 3 * MiB * s,
                "reserved_bytes": 14 * GiB,
                "peak_allocated_bytes": 13 * GiB,
                "peak_reserved_bytes": 14 * GiB,
                "process_bytes": 14 * GiB + 500 * MiB,
                "nvml_used_bytes": 15 * GiB,
            }
        }

    attribution = {
        "kind": "attribution",
        "first_step": 1,
        "steps": 2,
        "peak_allocated_bytes": 3 * GiB,
        "categories": {
            "weights": GiB,
            "trainable": 64 * MiB,
            "gradients": 64 * MiB,
            "optimizer": 128 * MiB,
            "activations": 900 * MiB,
            "temporaries": 40 * MiB,
            "runtime": 0,
        },
    }
    records = [
        start_record(("cuda:0",), 1000, plan=tiny_plan(allocated=12 * GiB), capacity={"cuda:0": 80 * GiB}),
        *step_records(100, devices=devices, rss=lambda s: 3 * GiB),
        attribution,
    ]
    return write_run(tmp_path / "run", records, metrics=[{"step": s, "loss": 4.0 - s / 50} for s in range(1, 101)])


def test_report_inlines_every_chart_and_writes_the_pngs(tmp_path):
    run = cuda_run(tmp_path)
    path = write_report(run)
    assert path == run / "report.html"
    page = path.read_text()
    images = re.findall(r'<img alt="([^"]+)" src="data:image/png;base64,([^"]+)"', page)
    assert [alt for alt, _ in images] == ["Loss", "Memory: cuda0", "Host memory", "Plan vs measured"]
    assert all(base64.b64decode(data).startswith(PNG_MAGIC) for _, data in images)
    for name in ("memory-cuda0", "memory-host", "loss", "categories"):
        assert (run / f"report-{name}.png").read_bytes().startswith(PNG_MAGIC)
    assert 'src="http' not in page and "<script" not in page  # nothing fetched from elsewhere
    assert "leak" in page and "activations" in page
    assert not list(run.glob(".*.tmp-*"))
    assert_nothing_empty(page)


def test_gpu_run_compares_the_plans_peaks_with_the_measured_ones(tmp_path):
    page = write_report(cuda_run(tmp_path)).read_text()
    plan_part = section(page, "Plan vs measured")
    # The plan: 12 GiB allocated, 12.1 GiB reserved, 12.6 GiB in all; measured: the counters' peaks and NVML.
    assert (
        "<td>peak allocated</td><td class=num>12.0 GiB</td><td class=num>13.0 GiB</td><td class=num>1.08</td>"
        in plan_part
    )
    assert (
        "<td>peak reserved</td><td class=num>12.1 GiB</td><td class=num>14.0 GiB</td><td class=num>1.16</td>"
        in plan_part
    )
    assert (
        "<td>device total</td><td class=num>12.6 GiB</td><td class=num>14.5 GiB</td><td class=num>1.15</td>"
        in plan_part
    )
    assert "CPU run" not in page and "Plan vs measured" in [alt for alt in re.findall(r'<img alt="([^"]+)"', page)]


def test_report_is_rewritten_but_never_over_someone_elses_file(tmp_path):
    run = cuda_run(tmp_path)
    write_report(run)
    write_report(run)  # its own earlier report: replaced
    mine = tmp_path / "notes.html"
    mine.write_text("<html>my notes</html>")
    with pytest.raises(ReportError, match="not written by memfit report"):
        write_report(run, mine)
    assert mine.read_text() == "<html>my notes</html>"
    with pytest.raises(ReportError, match="does not exist"):
        write_report(run, tmp_path / "missing" / "r.html")


def test_report_is_never_written_over_the_run_s_own_files(tmp_path):
    from memfit.errors import PathError

    run = cuda_run(tmp_path)
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    (tmp_path / "link.jsonl").symlink_to(run / "metrics.jsonl")
    for out in (run / "metrics.jsonl", run / "run.json", tmp_path / "link.jsonl"):
        with pytest.raises(
            PathError, match=r"--out .* is the run's (metrics.jsonl|run.json).*which this command reads"
        ):
            write_report(run, out)
    assert {p.name: p.read_bytes() for p in run.iterdir()} == before


def test_cpu_run_without_plan_or_metrics(tmp_path):
    run = write_run(tmp_path / "run", [start_record(), *step_records(20, rss=lambda s: 400 * MiB + s * MiB)])
    page = write_report(run, tmp_path / "out.html").read_text()
    assert page.count("<img") == 1 and "No memory problems found" in page
    assert (tmp_path / "out-memory-host.png").is_file()
    # Each empty section says why in one line.
    assert "no configuration was recorded" in section(page, "Run configuration")
    assert "metrics.jsonl holds no loss" in section(page, "Training")
    assert "CPU run: memfit plans GPU memory, and no plan was made" in section(page, "Plan vs measured")
    assert_nothing_empty(page)


def test_cpu_run_with_a_plan_says_the_plan_is_of_gpu_memory_and_lists_what_was_measured(tmp_path):
    attribution = {
        "kind": "attribution",
        "first_step": 1,
        "steps": 2,
        "peak_allocated_bytes": 90 * MiB,
        "categories": {"weights": 64 * MiB, "activations": 20 * MiB, "temporaries": 6 * MiB},
    }
    run = write_run(tmp_path / "run", [start_record(plan=tiny_plan()), *step_records(10), attribution])
    plan_part = section(write_report(run).read_text(), "Plan vs measured")
    assert "CPU run: the plan is of GPU memory; the measured host memory is shown instead" in plan_part
    # No plan column: a CPU's temporaries and missing allocator next to a GPU plan would read as misses.
    assert (
        "<th>category</th><th class=num>measured</th></tr><tr><td>weights</td><td class=num>64.0 MiB</td>" in plan_part
    )
    assert "<img" not in plan_part


def test_short_runs_draw_their_points_and_one_step_is_said_in_words(tmp_path):
    # Three steps: lines with a marker on every point. One step: no frame around a dot, the values in words.
    metrics = [{"step": s, "loss": 3.0 - s / 10, "lr": 1e-4} for s in (1, 2, 3)]
    page = write_report(write_run(tmp_path / "three", [start_record(), *step_records(3)], metrics=metrics)).read_text()
    assert [alt for alt in re.findall(r'<img alt="([^"]+)"', page)] == ["Loss", "Learning rate", "Host memory"]
    assert_nothing_empty(page)
    page = write_report(
        write_run(tmp_path / "one", [start_record(), *step_records(1)], metrics=metrics[:1])
    ).read_text()
    assert "<img" not in page
    assert "training loss 2.9000 at step 1" in section(page, "Training")
    assert "one step was recorded, too few for a timeline" in section(page, "Memory")
    assert_nothing_empty(page)


# ---------------------------------------------------------------------------- a memfit train run


RUN_JSON = {
    "config": {
        "model": "HuggingFaceTB/SmolLM2-135M",
        "revision": None,
        "init": "pretrained",
        "model_overrides": {},
        "method": "lora",
        "rank": 8,
        "alpha": None,
        "dropout": 0.05,
        "targets": "all-linear",
        "precision": "fp32",
        "optimizer": "adamw",
        "batch_size": 4,
        "seq_len": 512,
        "grad_accum": 2,
        "checkpointing": "on",
        "data": ["data/train.jsonl"],
        "data_format": "auto",
        "eval_split": 0.1,
        "eval_data": None,
        "eval_every": 20,
        "epochs": None,
        "max_steps": 60,
        "lr": 2e-4,
        "weight_decay": 0.0,
        "schedule": "cosine",
        "warmup_steps": 5,
        "warmup_ratio": None,
        "min_lr_ratio": 0.1,
        "max_grad_norm": 1.0,
        "seed": 7,
        "device": "cpu",
    },
    "spec": {
        "method": "lora",
        "rank": 8,
        "alpha": 16.0,
        "dropout": 0.05,
        "targets": ["all-linear"],
        "precision": "fp32",
        "optimizer": "adamw",
        "batch_size": 4,
        "seq_len": 512,
        "grad_accum": 2,
        "checkpointing": "on",
        "gpus": 1,
        "shard": "none",
        "tiling": "auto",
        "step_in_backward": False,
        "packing": False,
        "padding_free": "auto",
        "max_grad_norm": 1.0,
        "recipe": "memfit",
    },
    "setup": {"total_params": 134_515_008, "trainable_params": 2_442_240, "trainable_percent": 1.8156},
    "device": "cpu",
    "total_steps": 60,
    "plan": None,
    "fit": None,
    "config_changes": [],
    "status": "completed",
    "step": 60,
    "versions": {"torch": "2.6.0", "transformers": "4.51.0"},
}
EVALS = [(20, 2.4311), (40, 2.2875), (60, 2.2519)]


def cpu_train_run(tmp_path):
    """A run folder as memfit train leaves it after a CPU run: run.json, metrics with evaluations, memory."""
    metrics = []
    for step in range(1, 61):
        metrics.append({"step": step, "loss": 3.0 - step / 60, "lr": 2e-4 * (1 - step / 70)})
        metrics += [{"step": s, "eval_loss": v} for s, v in EVALS if s == step]
    records = [
        start_record(("cpu",), 60, peak_rss_bytes=1900 * MiB),
        *step_records(60, rss=lambda s: 1800 * MiB + s * 64 * 1024),
        {
            "kind": "attribution",
            "first_step": 1,
            "steps": 2,
            "device": "cpu",
            "peak_allocated_bytes": 700 * MiB,
            "categories": {"weights": 520 * MiB, "trainable": 10 * MiB, "activations": 170 * MiB},
        },
    ]
    for record in records[1:61]:
        record["peak_rss_bytes"] = 2048 * MiB  # the OS's high-water mark: above every step-end reading
    run = write_run(tmp_path / "run", records, metrics=metrics)
    (run / "run.json").write_text(json.dumps(RUN_JSON))
    return run


def test_report_of_a_cpu_train_run_shows_its_configuration_losses_and_why_no_plan(tmp_path):
    page = write_report(cpu_train_run(tmp_path)).read_text()
    config = dict(re.findall(r"<tr><th>([^<]+)</th><td>([^<]*)</td></tr>", section(page, "Run configuration")))
    assert config["model"] == "HuggingFaceTB/SmolLM2-135M"
    assert config["parameters"] == "134,515,008 (2,442,240 trainable, 1.82%)"
    assert {
        k: config[k]
        for k in (
            "method",
            "rank",
            "alpha",
            "dropout",
            "targets",
            "precision",
            "batch_size",
            "grad_accum",
            "seq_len",
            "checkpointing",
            "lr",
            "max_grad_norm",
            "seed",
        )
    } == {
        "method": "lora",
        "rank": "8",
        "alpha": "16",
        "dropout": "0.05",
        "targets": "all-linear",
        "precision": "fp32",
        "batch_size": "4",
        "grad_accum": "2",
        "seq_len": "512",
        "checkpointing": "on",
        "lr": "0.0002",
        "max_grad_norm": "1",
        "seed": "7",
    }
    assert config["schedule"] == "cosine, warmup 5 steps, down to 0.1 x lr"
    assert config["max_steps"] == "60" and config["eval"] == "10% of the data held out, every 20 steps"
    training = section(page, "Training")
    assert "training loss 2.9833 at step 1" in training
    for step, value in EVALS:
        assert f"<tr><td>{step}</td><td class=num>{value:.4f}</td></tr>" in training
    assert [alt for alt in re.findall(r'<img alt="([^"]+)"', training)] == ["Loss", "Learning rate"]
    plan_part = section(page, "Plan vs measured")
    assert "CPU run: memfit plans GPU memory" in plan_part and "measured host memory is shown instead" in plan_part
    assert "<td>activations</td><td class=num>170.0 MiB</td>" in plan_part  # measured, with no plan column
    assert "2.0 GiB (the process&#x27;s peak RSS from the OS, getrusage ru_maxrss" in page
    assert_nothing_empty(page)


def test_replies_to_eval_prompts_at_the_first_and_last_evaluation(tmp_path):
    run = cpu_train_run(tmp_path)

    def replies(step: int, words: tuple[str, str]) -> dict:
        return {
            "step": step,
            "max_new_tokens": 16,
            "generations": [
                {
                    "messages": [{"role": "user", "content": "Is the sky blue?"}],
                    "generation": words[0],
                    "new_tokens": 2,
                    "stopped": "eos",
                },
                {
                    "messages": [{"role": "user", "content": "Say <hi>"}],
                    "generation": words[1],
                    "new_tokens": 3,
                    "stopped": "max_new_tokens",
                },
            ],
        }

    with (run / "metrics.jsonl").open("a") as f:
        for record in (replies(20, ("maybe", "hmm")), replies(40, ("yes", "hi")), replies(60, ("Yes.", "<hi>"))):
            f.write(json.dumps(record) + "\n")
    page = write_report(run).read_text()
    part = section(page, "Replies to eval_prompts")
    assert "<th>reply at step 20</th><th>reply at step 60</th>" in part and "step 40" not in part
    assert "<tr><td>Is the sky blue?</td><td>maybe</td><td>Yes.</td></tr>" in part
    assert "<tr><td>Say &lt;hi&gt;</td><td>hmm</td><td>&lt;hi&gt;</td></tr>" in part  # escaped, never markup
    assert "3 evaluations" in part
    assert_nothing_empty(page)
    # A run without eval_prompts has no such section.
    assert "Replies to eval_prompts" not in write_report(cpu_train_run(tmp_path / "other")).read_text()


def test_report_of_a_real_memfit_train_run(tmp_path):
    from memfit.train.config import validate_config
    from memfit.train.recipe import train

    data = Path(__file__).resolve().parents[2] / "src" / "memfit" / "assets" / "data" / "tiny-instruct.jsonl"
    overrides = {
        "num_hidden_layers": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 512,
        "max_position_embeddings": 256,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
    }
    config = validate_config(
        {
            "model": "smollm2-135m",
            "init": "random",
            "model_overrides": overrides,
            "data": [str(data)],
            "method": "lora",
            "rank": 4,
            "precision": "fp32",
            "batch_size": 4,
            "seq_len": 64,
            "max_steps": 4,
            "eval_split": 0.05,
            "eval_every": 2,
            "lr": 5e-3,
            "device": "cpu",
            "output_dir": str(tmp_path / "run"),
            "seed": 0,
        }
    )
    result = train(config, progress=False)
    page = write_report(result.run_dir).read_text()
    config_rows = dict(re.findall(r"<tr><th>([^<]+)</th><td>([^<]*)</td></tr>", section(page, "Run configuration")))
    assert config_rows["model"].startswith("smollm2-135m (random weights; overrides: num_hidden_layers=2")
    assert (config_rows["method"], config_rows["rank"], config_rows["alpha"], config_rows["lr"]) == (
        "lora",
        "4",
        "8",
        "0.005",
    )
    training = section(page, "Training")
    for step, value in result.eval_losses:
        assert f"<tr><td>{step}</td><td class=num>{value:.4f}</td></tr>" in training
    assert "CPU run" in section(page, "Plan vs measured")
    assert "<th>category</th><th class=num>measured</th></tr>" in section(page, "Plan vs measured")
    assert "ru_maxrss" in page  # the host peak comes from the OS's high-water mark
    assert_nothing_empty(page)


# ---------------------------------------------------------------------------- helpers


def section(page: str, title: str) -> str:
    """The HTML between ``<h2>title</h2>`` and the next heading (or the end of the body)."""
    start = page.index(f"<h2>{title}</h2>") + len(f"<h2>{title}</h2>")
    end = page.find("<h2>", start)
    return page[start : end if end >= 0 else page.index("</body>")]


def assert_nothing_empty(page: str) -> None:
    """Every section has content, no table or paragraph is empty, every chart is a PNG with ink on it."""
    import io

    import matplotlib.image as mpimg

    for title in re.findall(r"<h2>([^<]+)</h2>", page):
        assert re.sub(r"\s+", "", section(page, title)), f"section {title!r} is empty"
    assert not re.search(r"<(table|p|div)[^>]*>\s*</\1>", page), "an empty table, paragraph or box"
    images = re.findall(r'<img alt="([^"]*)" src="data:image/png;base64,([^"]*)"', page)
    assert len(images) == page.count("<img")
    for alt, data in images:
        png = base64.b64decode(data)
        assert alt and png.startswith(PNG_MAGIC), alt
        pixels = mpimg.imread(io.BytesIO(png), format="png")[..., :3]
        # A chart with lines on it: the frame and labels alone are ~3% of the pixels.
        coloured = ((pixels.max(axis=-1) - pixels.min(axis=-1)) > 0.2).mean()
        assert coloured > 0.001, f"chart {alt!r} has no coloured line or bar"
