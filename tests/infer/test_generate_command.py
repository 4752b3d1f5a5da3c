"""``memfit generate``: a file of prompts in, the same records with their replies out."""

from __future__ import annotations

import json

import pytest
from chat_helpers import EVAL_MAX_NEW_TOKENS, EVAL_PROMPTS
from typer.testing import CliRunner

from memfit.cli import app
from memfit.infer.batch import PromptsError, read_prompts

runner = CliRunner()


def _jsonl(path, values):
    path.write_text("".join(json.dumps(v) + "\n" for v in values))
    return path


def test_prompt_lines_are_strings_or_records(tmp_path):
    messages = [{"role": "user", "content": "Hi"}]
    path = _jsonl(
        tmp_path / "p.jsonl", ["Hello", {"prompt": "Hey", "id": 7}, {"messages": messages}, {"prompt": messages}]
    )
    items = read_prompts(path)
    assert [record for record, _ in items] == [
        {"prompt": "Hello"},
        {"prompt": "Hey", "id": 7},
        {"messages": messages},
        {"prompt": messages},
    ]
    assert [m for _, m in items] == [
        [{"role": "user", "content": "Hello"}],
        [{"role": "user", "content": "Hey"}],
        messages,
        messages,
    ]


def test_every_bad_line_is_named(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(
        '"ok"\n\nnot json\n3\n{"text": "x"}\n{"prompt": ""}\n{"prompt": "a", "generation": "b"}\n'
        '{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}\n'
    )
    with pytest.raises(PromptsError) as err:
        read_prompts(path)
    lines = str(err.value).splitlines()
    assert lines[0] == f"--prompts {path}:"
    assert [line.split(":")[0].strip("- ") for line in lines[1:]] == [
        "line 3",
        "line 4",
        "line 5",
        "line 6",
        "line 7",
        "... and 1 more",
    ]
    assert "not JSON" in lines[1] and "a int: write a JSON string" in lines[2] and "one of prompt" in lines[3]
    assert "empty text" in lines[4] and "already has a generation" in lines[5]
    with pytest.raises(PromptsError, match="holds no prompt"):
        read_prompts(_jsonl(tmp_path / "empty.jsonl", []))
    with pytest.raises(PromptsError, match="does not exist"):
        read_prompts(tmp_path / "missing.jsonl")


def test_generate_writes_the_records_with_their_replies(demo_run, tmp_path):
    prompts = _jsonl(tmp_path / "prompts.jsonl", [{"prompt": p, "id": i} for i, p in enumerate(EVAL_PROMPTS)])
    out = tmp_path / "out" / "replies.jsonl"
    result = runner.invoke(
        app,
        [
            "generate",
            str(demo_run),
            "--prompts",
            str(prompts),
            "--out",
            str(out),
            "--max-new-tokens",
            str(EVAL_MAX_NEW_TOKENS),
            "--device",
            "cpu",
        ],
    )
    assert result.exit_code == 0, result.output
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert [{k: r[k] for k in ("prompt", "id")} for r in written] == [
        {"prompt": p, "id": i} for i, p in enumerate(EVAL_PROMPTS)
    ]
    # The same model, template and greedy decoding as the run's own replies at its last step.
    metrics = [json.loads(line) for line in (demo_run / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in metrics if "generations" in r][-1]
    assert [r["generation"] for r in written] == [g["generation"] for g in last["generations"]]
    assert [(r["new_tokens"], r["stopped"]) for r in written] == [
        (g["new_tokens"], g["stopped"]) for g in last["generations"]
    ]
    assert [p.name for p in out.parent.iterdir()] == ["replies.jsonl"]  # no temporary file left


def test_generate_never_overwrites_without_being_asked(demo_run, tmp_path):
    prompts = _jsonl(tmp_path / "prompts.jsonl", ["Hi"])
    out = tmp_path / "replies.jsonl"
    out.write_text("mine\n")
    result = runner.invoke(app, ["generate", str(demo_run), "--prompts", str(prompts), "--out", str(out)])
    assert result.exit_code == 2
    assert "--out" in result.output and "exists; choose another file name or pass --overwrite" in result.output
    assert out.read_text() == "mine\n"
    result = runner.invoke(
        app,
        [
            "generate",
            str(demo_run),
            "--prompts",
            str(prompts),
            "--out",
            str(out),
            "--overwrite",
            "--max-new-tokens",
            "3",
            "--device",
            "cpu",
        ],
    )
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["prompt"] == "Hi"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--max-new-tokens", "0"], "--max-new-tokens 0: must be 1 or more"),
        (["--do-sample", "--temperature", "0"], "--temperature 0.0: must be more than 0"),
    ],
)
def test_bad_options_and_files_fail_before_the_model_is_read(tmp_path, args, message):
    # The source does not exist: these errors come first, without loading anything.
    prompts = _jsonl(tmp_path / "prompts.jsonl", ["Hi"])
    result = runner.invoke(
        app,
        ["generate", str(tmp_path / "no-model"), "--prompts", str(prompts), "--out", str(tmp_path / "o.jsonl"), *args],
    )
    assert result.exit_code == 2 and message in result.output
    assert "Traceback" not in result.output and not (tmp_path / "o.jsonl").exists()


def test_bad_prompts_fail_before_the_model_is_read(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("not json\n")
    result = runner.invoke(
        app, ["generate", str(tmp_path / "no-model"), "--prompts", str(prompts), "--out", str(tmp_path / "o.jsonl")]
    )
    assert result.exit_code == 2 and "line 1: not JSON" in result.output


def test_the_prompts_file_is_never_the_output_not_even_with_overwrite(tmp_path, monkeypatch):
    import os

    prompts = _jsonl(tmp_path / "p.jsonl", ["Hi"])
    before = prompts.read_bytes()
    (tmp_path / "link.jsonl").symlink_to(prompts)
    os.link(prompts, tmp_path / "hard.jsonl")
    monkeypatch.chdir(tmp_path)
    for out in ("p.jsonl", str(prompts), "link.jsonl", "hard.jsonl", "./sub/../p.jsonl"):
        result = runner.invoke(
            app, ["generate", str(tmp_path / "run"), "--prompts", "p.jsonl", "--out", out, "--overwrite"]
        )
        assert result.exit_code == 2, result.output
        assert result.output.count("error:") == 1 and "is the --prompts file" in result.output
        assert "memfit never writes over its inputs" in " ".join(result.output.split())
    assert prompts.read_bytes() == before


def test_a_run_without_an_adapter_ends_with_one_line(demo_run, tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(demo_run, run, ignore=shutil.ignore_patterns("adapter"))
    prompts = _jsonl(tmp_path / "prompts.jsonl", ["Hi"])
    result = runner.invoke(app, ["generate", str(run), "--prompts", str(prompts), "--out", str(tmp_path / "o.jsonl")])
    assert result.exit_code == 2
    assert result.output.count("error:") == 1 and "has no adapter/ although the run completed" in result.output
    assert not (tmp_path / "o.jsonl").exists()
