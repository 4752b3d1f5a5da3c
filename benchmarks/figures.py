"""Every measured figure in README.md and docs/*.md comes from a results file under benchmarks/results/.

A figure is tied to its results file in one of two ways, both invisible once the Markdown is rendered:

* **inline**, for a figure in a sentence: the number is followed by an HTML comment naming the
  results file (its name under benchmarks/results/, without ``.json``), the key, and optionally a unit::

      memfit reaches **114,688**<!--fig max_context recipes.memfit.max_seq_len--> tokens, and at
      8,192 tokens plans 7.65 GiB<!--fig max_context recipes.memfit.peak_at_8192.device_total_bytes GiB-->

  The key is a dotted path; a list item is picked by its index (``rows.0``) or by a field
  (``rows[mode=packed]``). The unit converts the value before it is compared: ``GiB``, ``MiB``,
  ``KiB`` (powers of 2), ``GB``, ``MB`` (powers of 10) divide bytes, ``%`` multiplies a fraction
  by 100. The quoted number is right when the value, rounded to as many decimals as the quoted
  number shows, is written the same way (``114688`` and ``114,688`` are the same number). A last
  part ``#`` counts the items of a list or mapping (``plans.#``: how many plans the file holds).

* **generated blocks**, for tables and whole sections: the text between
  ``<!-- figures:begin NAME -->`` and ``<!-- figures:end NAME -->`` is what the renderer NAME in
  benchmarks/_figure_blocks.py writes from the results files (the GPU campaign's page and README
  section are two of them).

A figure that is a fact rather than a measurement (a card's 24 GiB, a model's 131,072 positions, a
constant in the code) carries no reference.

    python benchmarks/figures.py            # check: one line per figure or block that differs, exit 1
    python benchmarks/figures.py --write    # rewrite every referenced figure and block from the results

The test suite runs the check (tests/benchmarks/test_figures.py).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from _figure_blocks import BLOCKS
from _figure_results import REPO, FigureError, Results

#: A number, what stands between it and its reference (emphasis, a unit: no digit), the reference.
INLINE = re.compile(
    r"(?<![\w.])(?P<number>\d[\d,]*(?:\.\d+)?)(?P<between>[^\d\n<]{0,16}?)"
    r"<!--fig (?P<file>[\w.-]+) (?P<key>[^\s>]+)(?: (?P<unit>[^\s>]+))?-->"
)
BLOCK = re.compile(
    r"(?P<begin><!-- figures:begin (?P<name>[\w-]+)[^\n]*?-->\n)(?P<body>.*?)(?P<end><!-- figures:end (?P=name) -->)",
    re.DOTALL,
)


def format_like(value: float, quoted: str) -> str:
    """``value`` written as ``quoted`` is: as many decimals, thousands separated when it is."""
    decimals = len(quoted.split(".", 1)[1]) if "." in quoted else 0
    return f"{value:,.{decimals}f}" if "," in quoted else f"{value:.{decimals}f}"


def same_number(value: float, quoted: str) -> bool:
    return format_like(value, quoted).replace(",", "") == quoted.replace(",", "")


# ------------------------------------------------------------------------------------------------
# Checking and writing


@dataclass
class Problem:
    path: Path
    line: int
    message: str

    def __str__(self) -> str:
        path = self.path.resolve()
        shown = path.relative_to(REPO) if path.is_relative_to(REPO) else self.path
        return f"{shown}:{self.line}: {self.message}"


def _outside_blocks(text: str) -> list[tuple[int, int]]:
    """Spans of ``text`` that are not inside a generated block (references there are not read)."""
    spans, start = [], 0
    for block in BLOCK.finditer(text):
        spans.append((start, block.start("body")))
        start = block.end("body")
    spans.append((start, len(text)))
    return spans


def update_text(
    text: str, results: Results, path: Path = Path("-"), names: set[str] | None = None, inline: bool = True
) -> tuple[str, list[Problem]]:
    """``text`` with every referenced figure and every generated block (only ``names``, when
    given) written from the results, and the problems found: a reference that cannot be followed,
    a block no renderer knows. A figure that differs is not a problem here: it is rewritten."""
    problems: list[Problem] = []

    def line_of(offset: int) -> int:
        return text.count("\n", 0, offset) + 1

    def block(match: re.Match) -> str:
        name = match.group("name")
        if names is not None and name not in names:
            return match.group(0)
        if name not in BLOCKS:
            problems.append(
                Problem(
                    path,
                    line_of(match.start()),
                    f"block {name!r}: no renderer of that name in benchmarks/_figure_blocks.py",
                )
            )
            return match.group(0)
        try:
            body = BLOCKS[name](results).rstrip("\n") + "\n"
        except FigureError as err:
            problems.append(Problem(path, line_of(match.start()), f"block {name!r}: {err}"))
            return match.group(0)
        return match.group("begin") + body + match.group("end")

    def figure(match: re.Match, offset: int) -> str:
        try:
            value = results.value(match.group("file"), match.group("key"), match.group("unit"))
        except FigureError as err:
            problems.append(Problem(path, line_of(offset + match.start()), str(err)))
            return match.group(0)
        return format_like(value, match.group("number")) + match.group(0)[len(match.group("number")) :]

    if inline:
        pieces, last = [], 0
        for start, end in _outside_blocks(text):
            pieces.append(text[last:start])
            pieces.append(INLINE.sub(lambda m, s=start: figure(m, s), text[start:end]))
            last = end
        text = "".join(pieces) + text[last:]
    return BLOCK.sub(block, text), problems


def check_text(text: str, results: Results, path: Path = Path("-")) -> list[Problem]:
    """Every figure and block of ``text`` that is not what the results files say, and every
    reference that cannot be followed."""
    problems: list[Problem] = []
    for start, end in _outside_blocks(text):
        for match in INLINE.finditer(text, start, end):
            line = text.count("\n", 0, match.start()) + 1
            quoted = match.group("number")
            try:
                value = results.value(match.group("file"), match.group("key"), match.group("unit"))
            except FigureError as err:
                problems.append(Problem(path, line, str(err)))
                continue
            if not same_number(value, quoted):
                unit = f" {match.group('unit')}" if match.group("unit") else ""
                problems.append(
                    Problem(
                        path,
                        line,
                        f"quotes {quoted}, benchmarks/results/{match.group('file')}.json "
                        f"{match.group('key')} says {format_like(value, quoted)}{unit}",
                    )
                )
    updated, follow = update_text(text, results, path, inline=False)
    problems += follow
    if updated != text:
        for theirs, ours in zip(BLOCK.finditer(text), BLOCK.finditer(updated)):
            if theirs.group("body") != ours.group("body"):
                line = text.count("\n", 0, theirs.start()) + 1
                problems.append(
                    Problem(
                        path,
                        line,
                        f"block {theirs.group('name')!r} is not what its results files give "
                        "(python benchmarks/figures.py --write rewrites it)",
                    )
                )
    return problems


def documents(repo: Path = REPO) -> list[Path]:
    """README.md and every docs/*.md."""
    return [repo / "README.md", *sorted((repo / "docs").glob("*.md"))]


def check(paths: list[Path], results: Results) -> list[Problem]:
    return [problem for path in paths for problem in check_text(path.read_text(), results, path)]


def write(paths: list[Path], results: Results, names: set[str] | None = None, inline: bool = True) -> list[Problem]:
    """Rewrite each file's figures and blocks in place (a temporary file, then a rename); returns
    the references that could not be followed (the file keeps those as they were)."""
    problems = []
    for path in paths:
        text = path.read_text()
        updated, found = update_text(text, results, path, names=names, inline=inline)
        problems += found
        if updated != text:
            tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
            tmp.write_text(updated)
            os.replace(tmp, path)
    return problems


def references(paths: list[Path]) -> list[tuple[Path, str, str]]:
    """(document, results file, key) of every inline reference: which figures come from where."""
    found = []
    for path in paths:
        text = path.read_text()
        for start, end in _outside_blocks(text):
            found += [(path, m.group("file"), m.group("key")) for m in INLINE.finditer(text, start, end)]
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help="rewrite the figures and blocks from the results files")
    parser.add_argument("files", nargs="*", help="Markdown files (default: README.md and docs/*.md)")
    args = parser.parse_args(argv)
    paths = [Path(f) for f in args.files] or documents()
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        parser.error(f"{', '.join(missing)}: no such file; give Markdown files, or nothing for README.md and docs/*.md")
    results = Results()
    problems = write(paths, results) if args.write else check(paths, results)
    for problem in problems:
        print(problem)
    figures = len(references(paths))
    print(
        f"{figures} figures from results files in {len(paths)} documents; "
        + ("written" if args.write else f"{len(problems)} not as the results say")
    )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
