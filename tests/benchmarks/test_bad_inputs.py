"""benchmarks/bad_inputs.py: bad input through the real command line. The suite runs its fast
subset (a case or two a command, each a fresh ``python -m memfit`` process); the whole table is
``python benchmarks/bad_inputs.py``."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bad_inputs  # noqa: E402


def test_the_fast_subset_gets_one_message_its_exit_code_and_no_traceback():
    cases = [c for c in bad_inputs.all_cases() if c.fast]
    assert {c.command for c in cases} >= {"plan", "fit", "train", "merge", "doctor", "report", "models"}
    outcomes = bad_inputs.run_all(cases)
    assert len(outcomes) == len(cases)
    wrong = [
        f"{o.line}: exit {o.exit_code} (documented {o.expected_code}), {o.message}, traceback {o.traceback}\n{o.first_error_line}"
        for o in outcomes
        if not o.ok or not bad_inputs.one_message(o)
    ]
    assert not wrong, "\n".join(wrong)


def test_the_table_shares_the_malformed_input_cases_and_covers_every_command():
    import test_malformed_input as malformed

    lines = [c.line for c in bad_inputs.all_cases()]
    assert len(lines) == len(set(lines)) and len(lines) >= 80
    assert {line for line, _, _ in malformed.CASES} <= set(lines)
    assert {c.command for c in bad_inputs.all_cases()} >= {
        "plan",
        "fit",
        "train",
        "merge",
        "doctor",
        "report",
        "models",
    }


@pytest.mark.parametrize(
    ("stderr", "shape"),
    [
        ("error: --rank: 0 must be 1 or more\n", "one line"),
        ("error: cannot plan this run:\n  - model: unknown\n  - --rank: 0\n", "list (2)"),
        ("Usage: memfit plan [OPTIONS]\n╭─ Error ──────╮\n│ No such option │\n╰──────╯\n", "usage"),
        ("", "none"),
        ("error: one\nerror: two\n", "2 error lines"),
        ("error: one\nsomething else\n", "error line and 1 other lines"),
    ],
)
def test_message_shape(stderr, shape):
    assert bad_inputs.message_shape(stderr) == shape


def test_no_command_shows_the_help_and_an_exception_is_named():
    assert bad_inputs.message_shape("", "Usage: memfit [OPTIONS] COMMAND") == "help"
    rich = "│ in _check:88 │\n╰──────╯\nOverflowError: cannot fit 'int' into an index-sized integer\n"
    assert bad_inputs._exception_line(rich) == "OverflowError: cannot fit 'int' into an index-sized integer"


def test_a_traceback_is_found_and_fails_the_run(tmp_path, capsys):
    crash = [sys.executable, "-c", "import sys; print('error: first'); raise RuntimeError(sys.argv[1])"]
    outcome = bad_inputs.run_case(bad_inputs.Case("plan boom", 2), tmp_path, None, prefix=crash)
    assert outcome.traceback and outcome.exit_code == 1 and not outcome.ok
    assert "RuntimeError: plan" in outcome.first_error_line or outcome.first_error_line == "error: first"
    fine = bad_inputs.run_case(
        bad_inputs.Case("x", 2),
        tmp_path,
        None,
        prefix=[sys.executable, "-c", "import sys; sys.stderr.write('error: bad x\\n'); sys.exit(2)"],
    )
    assert fine.ok and fine.message == "one line" and not fine.traceback
    summary = bad_inputs.summary([outcome, fine])
    assert bad_inputs.total_line(summary).startswith("2 cases, 1 tracebacks, 0 hung, 1 with another exit code")
    assert "TRACEBACK" in bad_inputs.table([outcome, fine])


def test_a_case_that_does_not_end_is_stopped_with_its_children_and_reported_hung(tmp_path):
    # The child starts a grandchild and both sleep far past the limit: the whole session is stopped.
    sleeper = [
        sys.executable,
        "-c",
        "import subprocess, sys, time; "
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); time.sleep(600)",
    ]
    outcome = bad_inputs.run_case(bad_inputs.Case("plan slow", 2), tmp_path, None, prefix=sleeper, timeout_s=1)
    assert outcome.message == "hung" and outcome.exit_code is None and not outcome.ok
    assert "HUNG" in bad_inputs.table([outcome]) and bad_inputs.summary([outcome])["hung"] == 1


def test_a_changed_file_a_missing_text_and_a_silent_acceptance_are_each_caught(tmp_path):
    from bad_input_cases._case import Case

    (tmp_path / "mine.jsonl").write_text("{}\n")
    script = tmp_path / "prog.py"
    script.write_text("import sys, pathlib\npathlib.Path(sys.argv[1]).write_text('replaced')\n")
    case = Case("{d}/mine.jsonl", 2, says=("error: mine",), keeps=("mine.jsonl",), prefix=("{python}", str(script)))
    outcome = bad_inputs.run_case(case, tmp_path, None)
    assert outcome.silent and not outcome.ok
    assert outcome.changed_files == ["mine.jsonl"] and outcome.missing_texts == ["error: mine"]
    assert bad_inputs.summary([outcome])["silent_acceptances"] == 1
