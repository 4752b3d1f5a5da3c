"""Every command, fed malformed input: one clear ``error:`` message, the documented exit code, no
traceback, and no output file or folder left behind.

Each case is (command line, expected exit code, text the message must hold); the files a case
names are made by :func:`make_inputs` in a fresh folder. Cases stop at validation (nothing trains
or merges), so the whole table runs in well under a minute.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from typer.testing import CliRunner

from memfit.cli import app

ROOT = Path(__file__).resolve().parents[1]
DEMO_DATA = ROOT / "src" / "memfit" / "assets" / "data" / "tiny-instruct.jsonl"

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

#: A training config that is valid as it is: each case adds one mistake.
GOOD_YAML = f"""\
model: smollm2-135m
init: random
model_overrides: {{num_hidden_layers: 2, hidden_size: 64, intermediate_size: 128, num_attention_heads: 4,
                  num_key_value_heads: 2, vocab_size: 512, max_position_embeddings: 512,
                  bos_token_id: 0, eos_token_id: 1, pad_token_id: 2}}
data: {DEMO_DATA}
seq_len: 64
batch_size: 2
max_steps: 1
precision: fp32
device: cpu
"""

#: Memory records of a run folder memfit's recorder would write (doctor and report read them).
START = {"kind": "start", "schema": 1, "expected_devices": ["cpu"], "total_steps": 3}


def _steps(n: int) -> list[dict]:
    return [{"kind": "step", "step": i, "rss_bytes": 100 * 2**20, "devices": {}} for i in range(1, n + 1)]


def _write_run(folder: Path, records: list, run_json=None, raw: bytes | None = None) -> None:
    folder.mkdir(parents=True)
    data = raw if raw is not None else "".join(json.dumps(r) + "\n" for r in records).encode()
    (folder / "memory.jsonl").write_bytes(data)
    if run_json is not None:
        (folder / "run.json").write_text(json.dumps(run_json))


def make_inputs(root: Path) -> None:
    """The files and folders the cases name, each wrong in its own way."""
    (root / "tiny.json").write_text(json.dumps(TINY))
    (root / "lama.json").write_text(json.dumps(dict(TINY, model_type="lama")))
    (root / "binary.json").write_bytes(bytes(range(256)) * 4)
    (root / "list.json").write_text("[1, 2, 3]")
    (root / "empty.json").write_text("")
    (root / "no_config_dir").mkdir()
    (root / "a_file").write_text("not a folder\n")
    (root / "mine.yaml").write_text("my own notes\n")
    (root / "good.yaml").write_text(GOOD_YAML)
    (root / "empty.yaml").write_text("")
    (root / "list.yaml").write_text("- model: x\n- data: y\n")
    (root / "binary.yaml").write_bytes(b"\xff\xfe\x00garbage\x80\x81")
    (root / "broken.yaml").write_text("model: [smollm2-135m\n")
    (root / "dup.yaml").write_text(GOOD_YAML + "seq_len: 32\n")
    (root / "huge.yaml").write_text(GOOD_YAML + "grad_accum: 1.0e+20\n")
    (root / "typo.yaml").write_text(GOOD_YAML + "learning_rate: 1e-4\nlora_r: 8\n")
    (root / "lama.yaml").write_text(GOOD_YAML.replace("model_overrides: {", "model_overrides: {model_type: lama, "))
    (root / "huge_batch.yaml").write_text(GOOD_YAML.replace("batch_size: 2", "batch_size: 1.0e+20"))
    (root / "odd_width.yaml").write_text(GOOD_YAML.replace("hidden_size: 64,", "hidden_size: 63,"))
    (root / "config_dir.yaml").mkdir()
    (root / "empty_run").mkdir()
    # merge inputs: folders that exist (checked before anything is read) and bad ones
    (root / "base").mkdir()
    (root / "base" / "config.json").write_text(json.dumps(TINY))
    (root / "adapter").mkdir()
    (root / "adapter" / "adapter_config.json").write_text("{not json")
    (root / "adapter" / "adapter_model.safetensors").write_bytes(b"\x00" * 16)
    (root / "users_folder").mkdir()
    (root / "users_folder" / "main.py").write_text("print('mine')\n")
    (root / "users_folder" / ".ssh").mkdir()
    (root / "users_folder" / ".ssh" / "id_ed25519").write_text("secret\n")
    # run folders for doctor and report
    _write_run(root / "run_ok", [START, *_steps(3)])
    _write_run(root / "run_binary", [], raw=b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 8 + b"\n{}\n")
    _write_run(root / "run_step_text", [START, {"kind": "step", "step": "three"}, *_steps(2)])
    _write_run(root / "run_bytes_text", [START, {"kind": "step", "step": 1, "rss_bytes": "lots"}, *_steps(2)])
    _write_run(root / "run_devices_list", [START, {"kind": "step", "step": 1, "devices": ["cuda:0"]}, *_steps(2)])
    _write_run(root / "run_bad_finding", [START, {"kind": "finding", "finding": {"severity": "fatal"}}, *_steps(2)])
    _write_run(root / "run_expected_text", [dict(START, expected_devices="cpu"), *_steps(2)])
    _write_run(root / "run_no_start", _steps(3))
    _write_run(root / "run_json_list", [START, *_steps(3)], run_json=[1, 2])
    _write_run(root / "run_plan_text", [START, *_steps(3)], run_json={"plan": "big"})
    (root / "run_memory_dir").mkdir()
    (root / "run_memory_dir" / "memory.jsonl").mkdir()


def _unwritable_folder() -> str | None:
    """A folder this process cannot create files in: /sys (even for root), else None."""
    for candidate in ("/sys", "/proc"):
        try:
            fd, probe = tempfile.mkstemp(dir=candidate)
        except OSError:
            return candidate
        os.close(fd)
        os.unlink(probe)
    return None


UNWRITABLE = _unwritable_folder()

#: (command line, exit code, text the message holds). {d} is the folder make_inputs filled;
#: {u} a folder nobody may write in.
CASES = [
    # plan
    ("plan nope-model", 2, "unknown model"),
    ("plan lama-3-8b", 2, "Did you mean"),
    ("plan {d}/tiny.json --rank 0 --batch-size -3 --method foo", 2, "--rank: 0"),
    ("plan {d}/tiny.json --rank 0 --batch-size -3 --method foo", 2, "--batch-size: -3"),
    ("plan {d}/lama.json", 2, "Did you mean 'llama'"),
    ("plan {d}/lama.json --rank 0", 2, "--rank: 0"),
    ("plan {d}/tiny.json --seq-len 100000 --budget 24GiB", 2, "max_position_embeddings (512)"),
    ("plan {d}/tiny.json --targets foo_proj", 2, "--targets: foo_proj match no linear layer"),
    ("plan {d}/tiny.json --modules-to-save wte", 2, "--modules-to-save: wte match no module of this model"),
    ("plan {d}/tiny.json --method full --dora", 2, "--dora: only with adapters"),
    ("plan {d}/tiny.json --method qlora --dora", 2, "--dora: not with --method qlora"),
    ("plan {d}/tiny.json --method lora8bit", 2, "Did you mean 'lora-8bit'?"),
    ("plan {d}/tiny.json --budget lots", 2, "--budget"),
    ("plan {d}/tiny.json --budget 0", 2, "more than 0 bytes"),
    ("plan {d}/tiny.json --budget -5GiB", 2, "--budget"),
    ("plan {d}/tiny.json --gpu nonsense", 2, "unknown GPU"),
    ("plan {d}/tiny.json --budget 24GiB --gpu t4", 2, "a budget can only be lower"),
    ("plan {d}/tiny.json --gpus abc", 2, "--gpus: 'abc' is not a whole number"),
    ("plan {d}/tiny.json --seq-len 1e9x", 2, "--seq-len: '1e9x' is not a whole number"),
    ("plan {d}/tiny.json --dropout 2", 2, "--dropout"),
    ("plan {d}/tiny.json --shard zero3", 2, "--shard: zero3 needs --gpus 2"),
    ("plan {d}/no_config_dir", 2, "has no config.json"),
    ("plan {d}/binary.json", 2, "not a text file"),
    ("plan {d}/list.json", 2, "must hold a JSON object"),
    ("plan {d}/empty.json", 2, "not valid JSON"),
    ("plan {d}/missing.json", 2, "does not exist"),
    ("plan --no-such-flag", 2, "No such option"),
    ("plan --rank 99999999999999999999", 2, "--rank: 99999999999999999999 must be at most 65536 (e.g. --rank 16)"),
    ("plan --batch-size 99999999999999999999", 2, "--batch-size: 99999999999999999999 must be at most 65536"),
    ("plan --seq-len 99999999999999999999", 2, "--seq-len: 99999999999999999999 must be at most 16777216"),
    ("plan --grad-accum 99999999999999999999", 2, "--grad-accum: 99999999999999999999 must be at most 4096"),
    ("plan --gpus 99999999999999999999", 2, "--gpus: 99999999999999999999 must be at most 65536"),
    ("plan --batch-size 4096 --seq-len 8192", 2, "is 33,554,432 tokens a micro-batch: must be at most 16,777,216"),
    ("plan --context-bytes -5", 2, "--context-bytes: -5 must be 0 to"),
    ("plan --context-bytes 99999999999999999999", 2, "--context-bytes: 99999999999999999999 must be 0 to"),
    ("plan {d}/tiny.json --seq-len 64 --budget 1KiB", 3, ""),  # does not fit: the plan, then exit 3
    # fit
    ("fit {d}/tiny.json", 2, "--gpu NAME or --budget SIZE"),
    ("fit {d}/tiny.json --budget 2GiB --method nope", 2, "--method: nope"),
    ("fit {d}/tiny.json --budget 2GiB --rank 0", 2, "--rank: 0"),
    ("fit {d}/tiny.json --budget 2GiB --rank 99999999999999999999", 2, "--rank: 99999999999999999999 must be at most"),
    (
        "fit {d}/tiny.json --budget 2GiB --batch-size 99999999999999999999",
        2,
        "--batch-size: 99999999999999999999 must be at most 4096",
    ),
    (
        "fit {d}/tiny.json --budget 2GiB --seq-len 99999999999999999999",
        2,
        "--seq-len: 99999999999999999999 must be at most",
    ),
    (
        "fit {d}/tiny.json --budget 2GiB --gpus 99999999999999999999",
        2,
        "--gpus: 99999999999999999999 must be at most 65536",
    ),
    ("fit {d}/tiny.json --budget 2GiB --write {d}/no_config_dir", 2, "is a folder"),
    ("fit {d}/tiny.json --budget 2GiB --write {d}/a_file/best.yaml", 2, "is a file, not a folder"),
    ("fit {d}/tiny.json --budget 2GiB --write {d}/mine.yaml", 2, "exists"),
    ("fit {d}/tiny.json --budget 2GiB --write {u}/best.yaml", 2, "cannot write in"),
    ("fit {d}/tiny.json --budget 1KiB --seq-len 64 --method lora", 3, ""),  # nothing fits
    # train
    ("train {d}/missing.yaml", 2, "does not exist"),
    ("train {d}/config_dir.yaml", 2, "is a folder"),
    ("train {d}/binary.yaml", 2, "not a text file"),
    ("train {d}/empty.yaml", 2, "model: required"),
    ("train {d}/list.yaml", 2, "must hold a mapping"),
    ("train {d}/broken.yaml", 2, "not valid YAML at line 2"),
    ("train {d}/dup.yaml", 2, "'seq_len' is given twice"),
    ("train {d}/typo.yaml", 2, "learning_rate: unknown setting. Did you mean 'lr'?"),
    ("train {d}/typo.yaml", 2, "lora_r: unknown setting. Did you mean 'rank'?"),
    ("train {d}/lama.yaml", 2, "Did you mean 'llama'"),
    ("train {d}/good.yaml --set lr", 2, "--set 'lr': write KEY=VALUE"),
    ("train {d}/good.yaml --set lr=[1,", 2, "--set 'lr=[1,'"),
    ("train {d}/good.yaml --rank 0", 2, "rank: 0 must be 1 or more (e.g. rank: 16)"),
    ("train {d}/good.yaml --set dora=maybe", 2, "dora: 'maybe' is not true or false"),
    ("train {d}/good.yaml --set modules_to_save=all-linear", 2, "modules_to_save: all-linear names LoRA targets"),
    ("train {d}/good.yaml --seq-len 100000", 2, "seq_len: 100000 is beyond"),
    (
        "train {d}/good.yaml --rank 99999999999999999999",
        2,
        "rank: 99999999999999999999 must be at most 65536 (e.g. rank: 16)",
    ),
    ("train {d}/huge.yaml", 2, "grad_accum: 100000000000000000000 must be at most 4096 (e.g. grad_accum: 8)"),
    ("train {d}/good.yaml --budget lots", 2, "budget: 'lots'"),
    ("train {d}/good.yaml --gpu nope", 2, "unknown GPU"),
    ("train {d}/good.yaml --device tpu", 2, "device: 'tpu'"),
    ("train {d}/good.yaml --nproc 0", 2, "--nproc: 0"),
    ("train {d}/good.yaml --gpus 2", 2, "shard: 'none' with gpus: 2"),
    ("train {d}/good.yaml --set gpus=2", 2, "--nproc 2"),
    ("train {d}/good.yaml --gpus 2 --shard fsdp", 2, "gpus: 2, but this is a single process"),
    ("train {d}/huge_batch.yaml", 2, "batch_size: 100000000000000000000"),
    ("train {d}/odd_width.yaml", 2, "model_overrides.hidden_size: 63"),
    ("train {d}/good.yaml -o {d}/a_file", 2, "is a file, not a folder"),
    ("train {d}/good.yaml -o {u}/run", 2, "cannot write in"),
    ("train {d}/good.yaml -o {d}/new_run/deeper --targets foo_proj", 2, "targets: foo_proj match no linear layer"),
    ("train {d}/good.yaml -o {d}/empty_run --resume", 2, "holds no run to resume"),
    ("train", 2, "Missing argument"),
    # merge
    ("merge --base {d}/missing --adapter {d}/adapter --out {d}/merged", 2, "--base"),
    ("merge --base {d}/base --adapter {d}/missing --out {d}/merged", 2, "--adapter"),
    ("merge --base {d}/a_file --adapter {d}/adapter --out {d}/merged", 2, "is not a folder"),
    ("merge --base {d}/base --adapter {d}/adapter --out {d}/a_file", 2, "is not a folder"),
    ("merge --base {d}/base --adapter {d}/adapter --out {d}/merged --dtype int3", 2, "--dtype"),
    ("merge --base {d}/base --adapter {d}/adapter --out {d}/merged --device tpu", 2, "--device 'tpu'"),
    ("merge --base {d}/base --adapter {d}/adapter --out {d}/users_folder", 2, "is not empty"),
    (
        "merge --base {d}/base --adapter {d}/adapter --out {d}/users_folder --overwrite",
        2,
        "not written by memfit merge",
    ),
    ("merge --base {d}/base --adapter {d}/adapter --out {u}/merged", 2, "cannot write in"),
    ("merge --base {d}/base --adapter {d}/adapter --out {d}/merged", 2, "has neither model.safetensors"),
    ("merge --base {d}/base", 2, "Missing option"),
    # doctor
    ("doctor {d}/missing", 2, "does not exist"),
    ("doctor {d}/a_file", 2, "is a file"),
    ("doctor {d}/empty_run", 2, "has no memory.jsonl"),
    ("doctor {d}/run_memory_dir", 2, "is a folder, not the memory file"),
    ("doctor {d}/run_binary", 2, "not UTF-8"),
    ("doctor {d}/run_step_text", 2, "line 2: step is 'three'"),
    ("doctor {d}/run_bytes_text", 2, "rss_bytes is 'lots'"),
    ("doctor {d}/run_devices_list", 2, "devices is ['cuda:0'], not a mapping"),
    ("doctor {d}/run_bad_finding", 2, "not a finding"),
    ("doctor {d}/run_expected_text", 2, "expected_devices is 'cpu'"),
    ("doctor {d}/run_no_start", 2, "no start record"),
    ("doctor {d}/run_json_list", 2, "not a JSON object"),
    ("doctor {d}/run_plan_text", 2, "plan is 'big', not a mapping"),
    # report
    ("report {d}/run_binary", 2, "not UTF-8"),
    ("report {d}/run_ok --out {d}/no_config_dir", 2, "is a folder"),
    ("report {d}/run_ok --out {d}/missing_folder/r.html", 2, "does not exist"),
    ("report {d}/run_ok --out {d}/mine.yaml", 2, "not written by memfit report"),
    ("report {d}/run_ok --out {u}/r.html", 2, "cannot write in"),
    # models
    ("models --no-such-flag", 2, "No such option"),
    # ui: checked before the server starts
    ("ui --port 70000", 2, "--port: 70000 is not a port number"),
    ("ui --port abc", 2, "Invalid value for '--port'"),
    ("ui --host no-such-host.invalid", 2, "is not an address of this machine"),
    ("ui --run {d}/no_config_dir", 2, "has no memory.jsonl"),
    ("ui --run {d}/a_file", 2, "is a file, not a run folder"),
    ("ui --run {d}/run_binary", 2, "not UTF-8"),
]

#: (command line, environment, exit code, text the message holds): each runs as a new process, which
#: reads the environment as it is set for memfit. {d} as above.
ENV_CASES = [
    ("plan org/some-model", {"HF_HOME": "{d}/a_file"}, 2, "model: HF_HOME ('{d}/a_file') is a file, not a folder"),
    (
        "plan org/some-model",
        {"HF_HUB_CACHE": "{d}/a_file/hub"},
        2,
        "HF_HUB_CACHE ('{d}/a_file/hub') is under '{d}/a_file'",
    ),
    ("fit org/some-model --gpu t4", {"HF_HOME": "{d}/a_file"}, 2, "Set HF_HOME to a folder, or unset it."),
]

#: Paths a failing case must not leave behind (relative to the inputs folder).
MUST_NOT_EXIST = ("merged", "new_run", "best.yaml", "a_file/best.yaml", "missing_folder", "run_ok/report.html")


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("inputs")
    make_inputs(root)
    return root


@pytest.mark.parametrize(("line", "code", "says"), CASES, ids=[f"{c[0].split()[0]}-{i}" for i, c in enumerate(CASES)])
def test_malformed_input_gets_one_message_and_its_exit_code(inputs, line, code, says, tmp_path, monkeypatch):
    if "{u}" in line and UNWRITABLE is None:
        pytest.skip("no folder here refuses writes to this user")
    args = [part.format(d=inputs, u=UNWRITABLE) for part in line.split()]
    before = _tree(inputs)
    monkeypatch.chdir(tmp_path)  # default output folders (runs/...) would land here
    result = CliRunner().invoke(app, args)
    assert result.exception is None or isinstance(result.exception, SystemExit), (
        f"{line}: raised {type(result.exception).__name__}: {result.exception}"
    )
    assert "Traceback" not in result.output
    assert result.exit_code == code, result.output
    if code == 2:
        assert "error" in result.stderr.lower(), result.output
    assert says in " ".join(result.output.split()), result.output  # Rich may wrap a long line
    for name in MUST_NOT_EXIST:
        assert not (inputs / name).exists(), f"{line} left {name} behind"
    assert _tree(inputs) == before, f"{line} changed the files it was given"
    assert list(tmp_path.iterdir()) == [], f"{line} left files in the working folder"


@pytest.mark.parametrize(
    ("line", "env", "code", "says"), ENV_CASES, ids=[f"{c[0].split()[0]}-env-{i}" for i, c in enumerate(ENV_CASES)]
)
def test_a_bad_environment_gets_one_message_and_its_exit_code(inputs, line, env, code, says, tmp_path):
    variables = {k: v for k, v in os.environ.items() if k not in ("HF_HOME", "HF_HUB_CACHE", "HF_TOKEN_PATH")}
    variables.update({k: v.format(d=inputs) for k, v in env.items()})
    variables["HF_ENDPOINT"] = "http://127.0.0.1:9"  # nothing listens there: no case may need the network
    before = _tree(inputs)
    result = subprocess.run(
        [sys.executable, "-m", "memfit", *line.split()],
        capture_output=True,
        text=True,
        env=variables,
        cwd=tmp_path,
        timeout=300,
    )
    assert "Traceback" not in result.stderr
    assert result.returncode == code, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and says.format(d=inputs) in lines[0], result.stderr
    assert _tree(inputs) == before and list(tmp_path.iterdir()) == []


def test_an_error_is_one_line_and_lists_every_problem(inputs):
    result = CliRunner().invoke(app, ["plan", str(inputs / "missing.json"), "--rank", "0", "--batch-size", "-3"])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert lines[0] == "error: cannot plan this run:" and len(lines) == 4, lines  # heading + 3 problems
    assert "missing.json" in lines[1]  # the model first
    unknown_type = CliRunner().invoke(app, ["plan", str(inputs / "lama.json")])
    assert unknown_type.exit_code == 2
    (line,) = unknown_type.stderr.strip().splitlines()  # one short line (not every known type)
    assert "model_type 'lama'" in line and len(line) < 300


def _tree(root: Path) -> dict[str, bytes | None]:
    """Every path under ``root`` with its content (None for folders): a case must change nothing."""
    return {str(p.relative_to(root)): (None if p.is_dir() else p.read_bytes()) for p in sorted(root.rglob("*"))}


def test_the_models_checks_wait_for_the_knobs_to_be_right(inputs):
    # A bad knob is reported on its own, before transformers is imported for the checks that need
    # the model's architecture; "2048 is beyond..." is never said of a length the user did not ask for.
    result = CliRunner().invoke(app, ["plan", str(inputs / "tiny.json"), "--seq-len", "1e9x", "--targets", "foo_proj"])
    assert result.exit_code == 2
    text = " ".join(result.stderr.split())
    assert "--seq-len: '1e9x' is not a whole number" in text and "is beyond" not in text and "--targets" not in text
    fixed = CliRunner().invoke(app, ["plan", str(inputs / "tiny.json"), "--seq-len", "64", "--targets", "foo_proj"])
    assert fixed.exit_code == 2
    assert "--targets: foo_proj match no linear layer" in " ".join(fixed.stderr.split())
