"""Every figure README.md and docs/*.md quote is the one in its results file (benchmarks/figures.py)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import figures  # noqa: E402


def test_every_quoted_figure_and_block_is_what_its_results_file_says():
    problems = figures.check(figures.documents(ROOT), figures.Results())
    assert not problems, "\n".join(map(str, problems)) + "\n(python benchmarks/figures.py --write rewrites them)"


def test_the_docs_quote_figures_from_results_files():
    refs = figures.references(figures.documents(ROOT))
    named = {name for _, name, _ in refs}
    # The headline figures of README and the benchmark pages come through the mechanism.
    assert {
        "fit_answers",
        "max_context",
        "merge_vs_peft",
        "plan_speed",
        "fit_speed",
        "conformance",
        "interop_accuracy",
        "real_model",
        "precision_plans",
        "dpo_vs_trl-plan",
        "dpo_vs_trl-cpu",
        "merge_vs_peft-dora",
    } <= named
    assert all((ROOT / "benchmarks" / "results" / f"{name}.json").is_file() for name in named)


def test_every_block_renderer_writes_a_block_of_the_docs():
    from _figure_blocks import BLOCKS

    text = "".join(path.read_text() for path in figures.documents(ROOT))
    used = {match.group("name") for match in figures.BLOCK.finditer(text)}
    assert set(BLOCKS) <= used, set(BLOCKS) - used


@pytest.fixture
def results(tmp_path) -> figures.Results:
    (tmp_path / "fit.json").write_text(
        json.dumps(
            {
                "cases": [
                    {"model": "llama-3.1-8b", "max_seq_len": {"lora": 58880, "qlora": 118400}, "peak_bytes": 8218851328}
                ],
                "rows": [{"mode": "padded", "ratio": 0.2934}, {"mode": "packed", "ratio": 1.0}],
            }
        )
    )
    return figures.Results(root=tmp_path)


def test_a_figure_that_is_not_in_its_results_file_is_reported(results):
    # README once said QLoRA reaches 131,072 tokens on a 24 GB card; the results say 118,400.
    text = (
        "On a 24 GB card QLoRA reaches the model's whole\n"
        "131,072<!--fig fit cases.0.max_seq_len.qlora-->-token context.\n"
    )
    problems = figures.check_text(text, results)
    assert [str(p) for p in problems] == [
        "-:2: quotes 131,072, benchmarks/results/fit.json cases.0.max_seq_len.qlora says 118,400"
    ]
    fixed, found = figures.update_text(text, results)
    assert not found and "118,400<!--fig fit cases.0.max_seq_len.qlora-->" in fixed
    assert figures.check_text(fixed, results) == []


@pytest.mark.parametrize(
    ("quoted", "ok"),
    [
        ("**118,400**<!--fig fit cases[model=llama-3.1-8b].max_seq_len.qlora-->", True),
        ("118400<!--fig fit cases.0.max_seq_len.qlora-->", True),
        ("7.65 GiB<!--fig fit cases.0.peak_bytes GiB-->", True),
        ("7.7 GiB<!--fig fit cases.0.peak_bytes GiB-->", True),  # as many decimals as quoted
        ("7.66 GiB<!--fig fit cases.0.peak_bytes GiB-->", False),
        ("8.2 GB<!--fig fit cases.0.peak_bytes GB-->", True),
        ("29.3%<!--fig fit rows[mode=padded].ratio %-->", True),
        ("2<!--fig fit rows.#-->", True),
        ("3<!--fig fit rows.#-->", False),
    ],
)
def test_units_selectors_and_rounding(results, quoted, ok):
    assert (figures.check_text(quoted, results) == []) is ok


@pytest.mark.parametrize(
    ("reference", "says"),
    [
        ("1<!--fig nothing cases.0-->", "no results file"),
        ("1<!--fig fit cases.7.model-->", "has no 'cases.7.model'"),
        ("1<!--fig fit cases.0.model-->", "is 'llama-3.1-8b', not a number"),
        ("1<!--fig fit rows[mode=nope].ratio-->", "0 items with mode=nope"),
        ("1<!--fig fit rows.0.ratio furlongs-->", "unit 'furlongs'"),
    ],
)
def test_a_reference_that_leads_nowhere_is_reported(results, reference, says):
    (problem,) = figures.check_text(reference, results)
    assert says in problem.message


def test_blocks_are_rewritten_and_checked(results, monkeypatch):
    import _figure_blocks

    monkeypatch.setitem(
        _figure_blocks.BLOCKS, "longest", lambda r: f"QLoRA: {r.load('fit')['cases'][0]['max_seq_len']['qlora']:,}"
    )
    text = "a\n<!-- figures:begin longest (written by a script) -->\nQLoRA: 131,072\n<!-- figures:end longest -->\nb 9<!--fig fit rows.#-->\n"
    problems = figures.check_text(text, results)
    assert [p.line for p in problems] == [5, 2] and "block 'longest'" in problems[1].message
    fixed, _ = figures.update_text(text, results)
    assert "QLoRA: 118,400\n<!-- figures:end longest -->" in fixed and "b 2<!--fig" in fixed
    # A reference inside a block is the renderer's text, not read as a figure.
    assert figures.check_text(fixed, results) == []
    unknown = figures.check_text("<!-- figures:begin nobody -->\nx\n<!-- figures:end nobody -->\n", results)
    assert "no renderer of that name" in unknown[0].message


def test_the_script_checks_and_writes(tmp_path):
    doc = tmp_path / "doc.md"
    original = "merge peak 999 MB<!--fig merge_vs_peft memfit.peak_rss_bytes MB-->\n"
    doc.write_text(original)
    check = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "figures.py"), str(doc)], capture_output=True, text=True
    )
    assert check.returncode == 1 and "quotes 999" in check.stdout and doc.read_text() == original
    write = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "figures.py"), "--write", str(doc)], capture_output=True, text=True
    )
    assert write.returncode == 0, write.stdout + write.stderr
    assert "999" not in doc.read_text() and list(tmp_path.iterdir()) == [doc]  # no temporary file left
    again = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "figures.py"), str(doc)], capture_output=True, text=True
    )
    assert again.returncode == 0, again.stdout
