"""Bad input, typed as a new user types it, through the real command line: does each get one clear
message and the documented exit code, and never a traceback?

Every case runs ``python -m memfit ...`` in a fresh process (this checkout's memfit), in an empty
working folder, offline, with the plan cache off. For each the table shows the exit code (and the
one expected), how the error reads on stderr (``one line``: exactly one ``error:`` line; ``list
(N)``: one ``error:`` heading and N indented problems; ``usage``: the command line parser's own
error panel; anything else is named as it is) and whether a traceback appeared.

The cases are those of tests/test_malformed_input.py (imported: one table, not two), the ones
below (huge numbers, numbers that are not numbers, YAML that is wrong in other ways, files and
folders that cannot be used, environment variables that point at the wrong thing) and those of
the modules in ``benchmarks/bad_input_cases/`` (one module a topic, each with its ``CASES`` and the
``make_inputs`` that writes the files they name).

Beyond the exit code, a case may name texts its message must hold (``says``: the field, the value,
the fix) and files of the user's that must come out byte for byte as they went in (``keeps``). A
case that expects a refusal and exits 0 is a *silent acceptance*.

    python benchmarks/bad_inputs.py            # every case; writes benchmarks/results/bad_inputs.json
    python benchmarks/bad_inputs.py --fast     # the subset the test suite runs

Prints the table and a total (``N cases, 0 tracebacks``); exits 1 when a case printed a traceback,
hung, ended with another exit code than the documented one, left out a text its message must
hold, or changed a file of the user's; 0 otherwise.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import os
import pkgutil
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
RESULTS = BENCH / "results" / "bad_inputs.json"
sys.path[:0] = [str(REPO / "src"), str(REPO / "tests"), str(BENCH)]
import test_malformed_input as malformed  # noqa: E402  (its cases and the files they name)
from bad_input_cases._case import Case  # noqa: E402

HUGE = "99999999999999999999"


def _yaml(replace: dict[str, str] | None = None, extra: str = "") -> str:
    """The malformed-input table's valid training config, with text replaced and lines appended."""
    text = malformed.GOOD_YAML
    for old, new in (replace or {}).items():
        assert old in text, old
        text = text.replace(old, new)
    return text + extra


def case_modules() -> list:
    """The modules of ``benchmarks/bad_input_cases/``, by name: each has ``CASES`` and ``make_inputs``."""
    import bad_input_cases

    names = sorted(m.name for m in pkgutil.iter_modules(bad_input_cases.__path__) if not m.name.startswith("_"))
    return [importlib.import_module(f"bad_input_cases.{name}") for name in names]


def make_inputs(root: Path) -> None:
    """The malformed-input table's files, the ones the cases here name, and each case module's."""
    malformed.make_inputs(root)
    for module in case_modules():
        module.make_inputs(root)
    files = {
        "huge_batch.yaml": _yaml({"batch_size: 2": "batch_size: 1.0e+20"}),
        "huge_rank.yaml": _yaml(extra=f"rank: {HUGE}\n"),
        "heads.yaml": _yaml({"hidden_size: 64": "hidden_size: 63"}),
        "text_seq_len.yaml": _yaml({"seq_len: 64": "seq_len: long"}),
        "nan_lr.yaml": _yaml(extra="lr: .nan\n"),
        "negative_steps.yaml": _yaml({"max_steps: 1": "max_steps: -1"}),
        "missing_data.yaml": _yaml({str(malformed.DEMO_DATA): str(root / "missing.jsonl")}),
        "folder_data.yaml": _yaml({str(malformed.DEMO_DATA): str(root / "no_config_dir")}),
        "broken_data.yaml": _yaml({str(malformed.DEMO_DATA): str(root / "broken.jsonl")}),
        "empty_data.yaml": _yaml({str(malformed.DEMO_DATA): str(root / "empty.jsonl")}),
        "tabs.yaml": "model: smollm2-135m\n\tseq_len: 64\n",
        "hub.yaml": "model: memfit-nobody/no-such-model\ndata: " + str(malformed.DEMO_DATA) + "\ndevice: cpu\n",
        "broken.jsonl": '{"instruction": "hi", "output": "hello"}\n{"instruction": "no end\n',
        "empty.jsonl": "",
    }
    for name, text in files.items():
        (root / name).write_text(text)


#: The cases of this script beyond tests/test_malformed_input.py's, command by command.
EXTRA_CASES = [
    # plan: huge numbers and numbers that are not numbers
    Case(f"plan llama-3.1-8b --rank {HUGE}", 2),
    Case(f"plan llama-3.1-8b --batch-size {HUGE}", 2),
    Case(f"plan llama-3.1-8b --seq-len {HUGE}", 2),
    Case(f"plan llama-3.1-8b --grad-accum {HUGE}", 2),
    Case(f"plan llama-3.1-8b --gpus {HUGE} --shard fsdp", 2),
    Case(f"plan llama-3.1-8b --budget {HUGE}TiB", 0),  # a budget that big is only generous: it fits
    Case("plan llama-3.1-8b --alpha nan", 2),
    Case("plan llama-3.1-8b --dropout inf", 2),
    Case("plan llama-3.1-8b --context-bytes -1", 2),
    Case("plan llama-3.1-8b --precision fp8", 2, fast=True),
    Case("plan llama-3.1-8b --checkpointing maybe", 2),
    Case("plan llama-3.1-8b --objective foo", 2),
    Case("plan ''", 2),
    Case("plan memfit-nobody/no-such-model", 2, env={"HF_HOME": "{d}/a_file"}),
    Case("plan {d}/tiny.json --seq-len 64", 0, env={"MEMFIT_PLAN_CACHE": "1", "MEMFIT_CACHE": "{d}/a_file"}),
    # fit
    Case("fit llama-3.1-8b --gpu rtx-4090 --batch-size 0", 2),
    Case(f"fit llama-3.1-8b --gpu rtx-4090 --batch-size {HUGE}", 2),
    Case("fit llama-3.1-8b --gpu rtx-4090 --gpus 0", 2),
    Case("fit llama-3.1-8b --gpu rtx-4090 --max foo", 2, fast=True),
    Case("fit llama-3.1-8b --budget 1e30GiB", 2),
    Case(f"fit llama-3.1-8b --gpu rtx-4090 --objective dpo --batch-size {HUGE}", 2),
    # train
    Case("train {d}/good.yaml --gpus 2", 2),
    # preference training: pairs where messages are, a beta that is not a positive number
    Case("train {d}/good.yaml --objective dpo", 2),
    Case("train {d}/good.yaml --objective dpo --set beta=nan", 2),
    Case("train {d}/good.yaml --beta -1", 2),
    Case(f"train {{d}}/good.yaml --rank {HUGE}", 2),
    Case("train {d}/good.yaml --set batch_size=1e20", 2),
    Case(f"train {{d}}/good.yaml --set seq_len={HUGE}", 2),
    Case("train {d}/good.yaml --lr nan", 2),
    Case("train {d}/good.yaml --epochs -1", 2),
    Case("train {d}/good.yaml --max-steps 0", 2),
    Case("train {d}/good.yaml -o {d}/a_file/run", 2),
    Case("train {d}/huge_batch.yaml", 2),
    Case("train {d}/huge_rank.yaml", 2),
    Case("train {d}/heads.yaml", 2),
    Case("train {d}/text_seq_len.yaml", 2),
    Case("train {d}/nan_lr.yaml", 2),
    Case("train {d}/negative_steps.yaml", 2),
    Case("train {d}/missing_data.yaml", 2, fast=True),
    Case("train {d}/folder_data.yaml", 2),
    Case("train {d}/broken_data.yaml", 2),
    Case("train {d}/empty_data.yaml", 2),
    Case("train {d}/tabs.yaml", 2),
    Case("train {d}/hub.yaml", 2, env={"HF_HOME": "{d}/a_file"}),
    # merge
    Case("merge --base {d}/base --adapter {d}/adapter --out {d}/a_file/merged", 2),
    Case(
        "merge --base memfit-nobody/no-such-model --adapter {d}/adapter --out {d}/merged",
        2,
        env={"HF_HOME": "{d}/a_file"},
    ),
    # doctor, report, models, and no command at all
    Case("doctor", 2, fast=True),
    Case("report {d}/missing", 2),
    Case("report {d}/run_ok --out {d}/a_file/r.html", 2),
    Case("models extra", 2, fast=True),
    Case("nosuchcommand", 2),
    Case("", 2),
]

#: tests/test_malformed_input.py's lines run here too; its table repeats a line to check two texts
#: in one message, here each line runs once. These are in the fast subset.
FAST_MALFORMED = {
    "plan nope-model",
    "train {d}/broken.yaml",
    "merge --base {d}/base",
    "doctor {d}/run_binary",
    "report {d}/run_ok --out {d}/mine.yaml",
}


def all_cases() -> list[Case]:
    seen: dict[str, Case] = {}
    for line, code, _says in malformed.CASES:
        seen.setdefault(line, Case(line, code, fast=line in FAST_MALFORMED))
    for case in EXTRA_CASES + [c for module in case_modules() for c in module.CASES]:
        seen.setdefault(case.line, case)
    return list(seen.values())


# ------------------------------------------------------------------------------------------------
# Reading what a command printed


_TRACEBACK = re.compile(r"Traceback \(most recent call last\)|^\s*╭─+ Traceback", re.MULTILINE)


def message_shape(stderr: str, stdout: str = "") -> str:
    """How the error reads: ``one line``, ``list (N)``, ``usage`` (the parser's panel), ``help`` (no
    command: the help, on stdout), ``none``, or ``N error lines`` / ``error line and N other lines``
    when it is neither one message nor a list."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    errors = [i for i, line in enumerate(lines) if line.startswith("error:")]
    if not errors:
        if any("─ Error ─" in line for line in lines):
            return "usage"
        if not lines and "Usage:" in stdout:
            return "help"
        return "none"
    if len(errors) > 1:
        return f"{len(errors)} error lines"
    after = lines[errors[0] + 1 :]
    items = [line for line in after if line.startswith("  - ")]
    if not after:
        return "one line"
    if len(items) == len(after):
        return f"list ({len(items)})"
    return f"error line and {len(after)} other lines"


def has_traceback(text: str) -> bool:
    return bool(_TRACEBACK.search(text))


#: The last line of a Python traceback: the exception's (qualified) name, then a colon and its message.
_EXCEPTION = re.compile(r"^\s*(?:[\w.]+\.)?\w*(?:Error|Exception|Interrupt|Exit)(?:: .*)?$", re.MULTILINE)


def _exception_line(stderr: str) -> str:
    """The line that names the exception at the end of a traceback (the last non-empty line without one)."""
    found = _EXCEPTION.findall(stderr)
    if found:
        return found[-1].strip()
    return next((line for line in reversed(stderr.splitlines()) if line.strip()), "")


@dataclass
class Outcome:
    line: str
    command: str
    expected_code: int
    exit_code: int | None
    message: str
    traceback: bool
    seconds: float
    first_error_line: str
    env: dict
    stderr_tail: str = ""  # what a traceback ended with, for whoever fixes it
    missing_texts: list = field(default_factory=list)  # of the case's ``says``, those stderr did not hold
    changed_files: list = field(default_factory=list)  # of the case's ``keeps``, those that changed

    @property
    def silent(self) -> bool:
        """A refusal expected, and the command went ahead (exit 0)."""
        return self.expected_code != 0 and self.exit_code == 0

    @property
    def ok(self) -> bool:
        return (
            not self.traceback
            and self.exit_code == self.expected_code
            and not self.missing_texts
            and not self.changed_files
        )


def _digest(path: Path) -> str:
    """A file's bytes, or a folder's names and files' bytes, as one digest ("missing" when it is not there)."""
    if not path.exists():
        return "missing"
    h = hashlib.sha256()
    for item in sorted([path, *path.rglob("*")]) if path.is_dir() else [path]:
        h.update(str(item.relative_to(path.parent)).encode())
        if item.is_file():
            h.update(item.read_bytes())
    return h.hexdigest()


#: A bad input is refused before any work: a case still running after this long is taken for hung
#: (on a machine so busy that a refusal takes minutes, raise it with --hang-minutes).
HANG_S = 600.0


def run_case(
    case: Case, inputs: Path, unwritable: str | None, *, prefix: list[str] | None = None, timeout_s: float = HANG_S
) -> Outcome:
    """``case`` in a fresh process (``prefix`` + its arguments; ``python -m memfit`` by default), in an
    empty working folder of its own, stopped after ``timeout_s`` (the message then says ``hung``)."""
    args = [part.format(d=inputs, u=unwritable) for part in shlex.split(case.line)]
    kept = {name: _digest(inputs / name) for name in case.keeps}
    env = dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        MEMFIT_PLAN_CACHE="0",
        TOKENIZERS_PARALLELISM="false",
        COLUMNS="100",
        NO_COLOR="1",
        TERM="dumb",
        PYTHONPATH=os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")]),
    )
    env.update({key: value.format(d=inputs, u=unwritable) for key, value in case.env.items()})
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="memfit-bad-input-") as cwd:
        # A session of its own, so that a hung case is stopped with every process it started.
        program = [part.format(d=inputs, python=sys.executable, bench=BENCH) for part in case.prefix]
        proc = subprocess.Popen(
            [*(program or prefix or [sys.executable, "-m", "memfit"]), *args],
            cwd=cwd,
            env=env,
            text=True,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        try:
            stdout, stderr = proc.communicate(timeout=timeout_s)
            code = proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
            code = None
    if code is None:
        return Outcome(
            line=case.line,
            command=case.command,
            expected_code=case.code,
            exit_code=None,
            message="hung",
            traceback=has_traceback(stdout + stderr),
            seconds=round(time.perf_counter() - started, 2),
            first_error_line=f"still running after {timeout_s:.0f} s",
            env=dict(case.env),
        )
    first = next((line for line in stderr.splitlines() if line.startswith("error:")), "")
    if not first and has_traceback(stdout + stderr):
        first = _exception_line(stderr)
    traceback = has_traceback(stdout + stderr)
    missing = [text for text in case.says if text.format(d=inputs) not in stderr]
    changed = [name for name, digest in kept.items() if _digest(inputs / name) != digest]
    return Outcome(
        line=case.line,
        command=case.command,
        expected_code=case.code,
        exit_code=code,
        message=message_shape(stderr, stdout),
        traceback=traceback,
        seconds=round(time.perf_counter() - started, 2),
        first_error_line=first[:300],
        env=dict(case.env),
        stderr_tail=stderr[-1500:] if traceback or missing else "",
        missing_texts=missing,
        changed_files=changed,
    )


def run_all(
    cases: list[Case], *, jobs: int = 2, prefix: list[str] | None = None, timeout_s: float = HANG_S
) -> list[Outcome]:
    """Every case, ``jobs`` at a time, each with a fresh copy of the inputs (a case must not see what
    another changed); returned in the order given."""
    with tempfile.TemporaryDirectory(prefix="memfit-bad-inputs-") as scratch:
        root = Path(scratch)

        def one(index_case):
            index, case = index_case
            inputs = root / f"case-{index:03d}"
            inputs.mkdir()
            make_inputs(inputs)
            return run_case(case, inputs, malformed.UNWRITABLE, prefix=prefix, timeout_s=timeout_s)

        todo = [(i, c) for i, c in enumerate(cases) if "{u}" not in c.line or malformed.UNWRITABLE is not None]
        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            return list(pool.map(one, todo))


# ------------------------------------------------------------------------------------------------
# The table, the total, the results file


def table(outcomes: list[Outcome], width: int = 64) -> str:
    rows = [f"{'command line':<{width}} {'exit':>4} {'want':>4}  {'message':<14} traceback"]
    for o in outcomes:
        line = o.line if len(o.line) <= width else o.line[: width - 1] + "…"
        env = " ".join(f"{k}={v}" for k, v in o.env.items())
        shown = (env + " " + line).strip() if env and len(env) + len(line) < width else line
        flag = (
            "TRACEBACK"
            if o.traceback
            else "HUNG"
            if o.message == "hung"
            else "SILENT"
            if o.silent
            else "wrong exit code"
            if o.exit_code != o.expected_code
            else "FILE CHANGED"
            if o.changed_files
            else "message lacks: " + ", ".join(o.missing_texts)
            if o.missing_texts
            else ""
        )
        code = "-" if o.exit_code is None else str(o.exit_code)
        rows.append(f"{shown:<{width}} {code:>4} {o.expected_code:>4}  {o.message:<14} {flag}")
    return "\n".join(rows)


def one_message(outcome: Outcome) -> bool:
    """Whether a refusal reads as one message: one ``error:`` line, a heading and its list, the
    parser's usage panel, or (no command given) the help."""
    return outcome.message in ("one line", "usage", "help") or outcome.message.startswith("list")


def summary(outcomes: list[Outcome]) -> dict:
    return {
        "cases": len(outcomes),
        "tracebacks": sum(o.traceback for o in outcomes),
        "hung": sum(o.message == "hung" for o in outcomes),
        "wrong_exit_code": sum(o.exit_code != o.expected_code for o in outcomes),
        "silent_acceptances": sum(o.silent for o in outcomes),
        "files_changed": sum(bool(o.changed_files) for o in outcomes),
        "messages_lacking_a_text": sum(bool(o.missing_texts) for o in outcomes),
        "not_one_message": sum(o.expected_code == 2 and not one_message(o) for o in outcomes),
        "commands": sorted({o.command for o in outcomes}),
    }


def total_line(s: dict) -> str:
    return (
        f"{s['cases']} cases, {s['tracebacks']} tracebacks, {s['hung']} hung, {s['wrong_exit_code']} with another exit "
        f"code than documented ({s['silent_acceptances']} silent acceptances), {s['files_changed']} files of the "
        f"user's changed, {s['messages_lacking_a_text']} messages lacking a text, {s['not_one_message']} bad "
        f"inputs without one error message"
    )


def write_results(path: Path, outcomes: list[Outcome], command: str) -> None:
    sys.path.insert(0, str(BENCH))
    from _machine import memfit_source, write_results

    data = {
        "benchmark": "bad_inputs",
        "command": command,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "memfit": memfit_source(),
        "summary": summary(outcomes),
        "cases": [asdict(o) for o in outcomes],
    }
    write_results(path, data)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fast", action="store_true", help="only the subset the test suite runs (no results file)")
    parser.add_argument("--jobs", type=int, default=2, help="cases run at once (default 2)")
    parser.add_argument("--out", default=str(RESULTS), help="results file (default benchmarks/results/bad_inputs.json)")
    parser.add_argument(
        "--hang-minutes",
        type=float,
        default=HANG_S / 60,
        help="a case still running after this long is stopped as hung (default 10)",
    )
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs: {args.jobs} must be 1 or more")
    if args.hang_minutes <= 0:
        parser.error(f"--hang-minutes: {args.hang_minutes:g} must be more than 0")
    cases = [c for c in all_cases() if c.fast or not args.fast]
    outcomes = run_all(cases, jobs=args.jobs, timeout_s=60 * args.hang_minutes)
    print(table(outcomes))
    s = summary(outcomes)
    print(total_line(s))
    if not args.fast:
        write_results(Path(args.out), outcomes, "python benchmarks/bad_inputs.py")
        print(f"wrote {args.out}")
    return 1 if s["tracebacks"] or s["wrong_exit_code"] or s["files_changed"] or s["messages_lacking_a_text"] else 0


if __name__ == "__main__":
    sys.exit(main())
