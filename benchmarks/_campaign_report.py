"""docs/gpu-results.md and README's "Measured on a GPU" figures, written from the results files.

Everything here is read from benchmarks/results/gpu/<gpu>/ (what ``gpu_campaign.py`` wrote and
``--import-results`` brought home): no figure is typed in. Where a measurement disagrees with the
plan beyond the planner's goal, the page says so in a sentence. Without results, the page says
that nothing has been measured yet and how to measure it.

The page and README's section are two generated blocks of benchmarks/figures.py (``gpu-results-page``
and ``gpu-results``, rendered by :func:`page_block` and :func:`summary_block`), written by
``gpu_campaign.py --report`` and ``figures.py --write`` alike.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

README_BLOCK = "gpu-results"
PAGE_BLOCK = "gpu-results-page"


#: The planner's accuracy goal on peak reserved memory (docs/plan.md).
GOAL_MEDIAN = 0.03
GOAL_P95 = 0.08
#: A measured runtime constant this far from the assumed one is reported as a disagreement.
CONSTANT_TOLERANCE_BYTES = 64 * 2**20

COMMANDS = """On the GPU machine (offline, with the checkout and its `.whl/` folder copied there: `.whl/` is
git-ignored), the same command two or three times, each within the machine's 10-minute limit a
command:

```bash
python3 benchmarks/gpu_campaign.py --install --max-minutes 9 --out $OUT
```

Between commands and at the end, where the returned files are:

```bash
python benchmarks/gpu_campaign.py --import-results DIR   # merge them into benchmarks/results/gpu/<gpu>/
python benchmarks/gpu_campaign.py --report               # this page and README's figures
```

Each command goes on from the results already in benchmarks/results/gpu/<gpu>/ (or `--resume-from
DIR`), skipping what is done. The parts run in priority order (tests, accuracy, context, speed,
constants; `--parts` picks and orders them). Before each configuration, length or run, the campaign
estimates its time (process start and loading, plus the step's FLOPs at a third of the GPU's
datasheet peak, corrected by the runs so far) and starts nothing that would end past
`--max-minutes`; a child still running 45 s past it is stopped. Every unit is written to its part's
file as soon as it ends, so a command cut off returns what it measured. `--out` receives at most
seven files, all at its top level: `campaign.json` (each command's machine, versions, GPU and
outcome per part), `campaign.log`, and one JSON per part.

Before going to the machine, with PyPI reachable: `python benchmarks/gpu_campaign.py --fetch-wheels`
(bitsandbytes and pydantic, pinned to the versions installed here, into `.whl/`). The dry run on a
CPU, every part's logic on tiny models (the test suite runs it):
`python benchmarks/gpu_campaign.py --tiny --device cpu --out /tmp/campaign`."""


def gib(nbytes: float | None) -> str:
    """GiB with two decimals (MiB or KiB below one GiB: tiny dry-run figures stay readable)."""
    if nbytes is None:
        return "–"
    if abs(nbytes) >= 2**30:
        return f"{nbytes / 2**30:.2f} GiB"
    if abs(nbytes) >= 2**20:
        return f"{nbytes / 2**20:.1f} MiB"
    return f"{nbytes / 2**10:.1f} KiB"


def mib(nbytes: float | None) -> str:
    return "–" if nbytes is None else f"{nbytes / 2**20:.0f} MiB"


def pct(value: float | None) -> str:
    return "–" if value is None else f"{value:+.1%}"


def _load(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def load_results(root: Path, include_tiny: bool = False) -> list[dict]:
    """Each results folder under ``root`` (one per GPU): its campaign file and part files."""
    found = []
    for folder in sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []:
        campaign = _load(folder / "campaign.json")
        if campaign is None or (campaign.get("mode") != "gpu" and not include_tiny):
            continue
        found.append(
            {
                "folder": folder,
                "campaign": campaign,
                **{
                    part: _load(folder / f"{part}.json")
                    for part in ("tests", "accuracy", "context", "speed", "constants")
                },
            }
        )
    return found


# ------------------------------------------------------------------------------------------------
# Sections


def section_machine(result: dict, root: Path) -> list[str]:
    campaign = result["campaign"]
    invocations = campaign.get("invocations", [])
    env = invocations[-1]["environment"] if invocations else {}
    versions = env.get("versions", {})
    details = env.get("gpu_details") or {}
    lines = []
    if campaign.get("mode") != "gpu":
        lines += [
            "> A dry run on a CPU with tiny models (`--tiny`): it checks the campaign's logic, its figures are not",
            "> GPU measurements.",
            "",
        ]
    if details:
        lines.append(
            f"- GPU: {details.get('name')}, {gib(details.get('total_memory_bytes'))}, compute capability "
            f"{details.get('compute_capability')}, driver {details.get('driver')}"
        )
    lines.append(
        f"- CPU: {env.get('cpu')} ({env.get('cpu_count')} cores), {gib(env.get('memory_bytes'))} of memory; {env.get('platform')}"
    )
    lines.append(
        f"- Versions: Python {versions.get('python')}, torch {versions.get('torch')} (CUDA {env.get('cuda_runtime')}), "
        f"transformers {versions.get('transformers')}, peft {versions.get('peft')}, bitsandbytes {versions.get('bitsandbytes')}"
    )
    source = env.get("memfit") or {}
    lines.append(
        f"- memfit: commit {source.get('commit') or 'unknown (no .git on the machine)'}, source digest {source.get('digest')}"
    )
    folder = result["folder"].resolve()
    lines.append(f"- Results: `{folder.relative_to(REPO) if folder.is_relative_to(REPO) else folder}/`")
    lines += ["", "| started | command | parts | seconds |", "| --- | --- | --- | ---: |"]
    for inv in invocations:
        parts = ", ".join(f"{name}: {info['status']}" for name, info in inv.get("parts", {}).items()) or "none"
        lines.append(
            f"| {inv.get('started_at', '')} | `{inv.get('command', '')}` | {parts} | {inv.get('seconds', '–')} |"
        )
    return lines


def section_tests(data: dict | None) -> list[str]:
    unit = (data or {}).get("units", {}).get("pytest")
    if not unit:
        return ["Not run yet."]
    counts = unit.get("counts", {})
    lines = [
        f"`{unit.get('command')}`: "
        + (", ".join(f"{n} {k}" for k, n in sorted(counts.items())) or "no test ran")
        + f" (exit {unit.get('exit_code')}, {unit.get('seconds')} s)."
    ]
    failing = [t for t in unit.get("tests", []) if t["outcome"] in ("failed", "error")]
    if unit.get("status") == "timeout":
        lines.append("The run was stopped by the time limit before it ended.")
    if failing:
        lines += ["", f"**{len(failing)} GPU test(s) fail:**", ""]
        for test in failing:
            lines += [
                f"<details><summary><code>{test['id']}</code>: {(test.get('message') or '').splitlines()[0][:200] if test.get('message') else test['outcome']}</summary>",
                "",
                "```",
                (test.get("traceback") or "")[-6000:],
                "```",
                "</details>",
                "",
            ]
    elif counts.get("passed"):
        lines.append("Every GPU test passes.")
    return lines


def section_accuracy(data: dict | None) -> list[str]:
    if not data or not data.get("units"):
        return ["Not run yet."]
    units = data["units"]
    order = data.get("info", {}).get("cases") or list(units)
    rows = [units[cid] for cid in order if cid in units]
    summary = data.get("summary", {})
    lines = [
        f"{len(rows)} of {len(order)} configurations measured, each in a fresh process, "
        f"{data.get('info', {}).get('steps_per_case', 3)} training steps (random-init weights, nothing downloaded). "
        "Error = (planned − measured) / measured: positive when the plan says more than the run used.",
        "",
    ]
    reserved = summary.get("reserved")
    if reserved:
        met = reserved["median_abs_error"] <= GOAL_MEDIAN and reserved["p95_abs_error"] <= GOAL_P95
        verdict = "met" if met else "**not met**"
        lines.append(
            f"Peak reserved: median |error| {reserved['median_abs_error']:.1%}, p95 {reserved['p95_abs_error']:.1%}, "
            f"worst {reserved['max_abs_error']:.1%} over {reserved['n']} runs; the goal (median ≤ {GOAL_MEDIAN:.0%}, "
            f"p95 ≤ {GOAL_P95:.0%}) is {verdict}."
        )
    for key, label in (("allocated", "Peak allocated"), ("device_total", "Device total (mem_get_info)")):
        if summary.get(key):
            s = summary[key]
            lines.append(
                f"{label}: median |error| {s['median_abs_error']:.1%}, p95 {s['p95_abs_error']:.1%}, worst {s['max_abs_error']:.1%} ({s['n']} runs)."
            )
    lines += [
        "",
        "| configuration | planned reserved | measured reserved | error | allocated error | device total error | status |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for row in rows:
        m, p, e = row["measured"], row["plan"], row["error"]
        lines.append(
            f"| `{row['id']}` | {gib(p.get('reserved_bytes'))} | {gib(m.get('reserved_bytes'))} | {pct(e.get('reserved'))} | "
            f"{pct(e.get('allocated'))} | {pct(e.get('device_total'))} | {m.get('status')} |"
        )
    notes = []
    for row in rows:
        m, p, e = row["measured"], row["plan"], row["error"]
        metric = "reserved" if e.get("reserved") is not None else "allocated"
        err = e.get(metric)
        if err is not None and abs(err) > GOAL_P95:
            notes.append(
                f"- `{row['id']}`: the plan says {gib(p.get(metric + '_bytes'))} {metric}, the run {metric} "
                f"{gib(m.get(metric + '_bytes'))} ({pct(err)}): the plan is {'above' if err > 0 else 'below'} the measurement by more than {GOAL_P95:.0%}."
            )
        if m.get("status") == "oom":
            notes.append(
                f"- `{row['id']}`: ran out of memory, where the plan said {gib(p.get('device_total_bytes'))} at the peak."
            )
        elif m.get("status") not in ("ok", None):
            notes.append(
                f"- `{row['id']}`: {m.get('status')}: {(m.get('error') or '').splitlines()[-1][:300] if m.get('error') else ''}"
            )
    if notes:
        lines += ["", "Where the measurement disagrees with the plan:", "", *notes]
    outside = [
        row["measured"]["outside_allocator_bytes"]
        for row in rows
        if row["measured"].get("outside_allocator_bytes") is not None
    ]
    assumed = [row["plan"].get("context_bytes") for row in rows if row["plan"].get("context_bytes") is not None]
    if outside and assumed:
        median_outside = statistics.median(outside)
        lines += [
            "",
            f"Memory outside the caching allocator after the steps (CUDA context and library handles), median over "
            f"{len(outside)} runs: {mib(median_outside)}; the planner assumes {mib(assumed[0])}."
            + (
                " **They differ by more than 64 MiB**: the device-total plans are off by that much."
                if abs(median_outside - assumed[0]) > CONSTANT_TOLERANCE_BYTES
                else ""
            ),
        ]
    return lines


def section_context(data: dict | None) -> list[str]:
    if not data or not data.get("units"):
        return ["Not run yet."]
    info = data.get("info", {})
    lines = [
        f"{info.get('model')}, QLoRA r={info.get('knobs', {}).get('rank')}, batch 1, {info.get('steps_per_length')} "
        f"training steps a length. "
        + (
            f"The caching allocator is capped where the plan puts the limit of the {info.get('card')} "
            f"(the card's memory less the CUDA context the planner assumes), cuBLAS workspaces as on that card "
            f"(`CUBLAS_WORKSPACE_CONFIG={info.get('cublas_workspace_config')}`)."
            if info.get("card")
            else "On a CPU the cap is the plan's own allocated bytes at fit's answer (a harness check)."
        ),
        "",
        "| recipe | planned (`memfit fit --max seq-len`) | longest that ran | first out of memory | step | tokens/s at the longest | cap |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    notes = []
    for recipe in ("memfit", "hf"):
        unit = data["units"].get(recipe)
        if not unit:
            continue
        planned = unit.get("planned_max_seq_len")
        longest, first_oom, step = unit.get("longest_ran"), unit.get("first_oom"), unit.get("step_tokens")
        at_longest = next(
            (p for p in unit.get("probes", []) if p.get("tokens") == longest and p.get("status") == "ok"), {}
        )
        cap = (unit.get("cap") or {}).get("cap_bytes")
        lines.append(
            f"| {recipe} | {_tokens(planned)} | {_tokens(longest)} | {_tokens(first_oom)} | {_tokens(step)} | "
            f"{at_longest.get('tokens_per_second', '–')} | {gib(cap)} |"
        )
        if not unit.get("finished"):
            notes.append(
                f"- {recipe}: the search is unfinished ({unit.get('conclusion')}); a later run goes on from these probes."
            )
        elif planned and longest is not None and first_oom is not None and step:
            if longest < planned:
                notes.append(
                    f"- {recipe}: **the plan's answer ran out of memory**: {planned:,} tokens planned, {longest:,} ran "
                    f"({(longest - planned) / planned:+.1%}); the plan is too optimistic here."
                )
            elif longest >= planned + step:
                notes.append(
                    f"- {recipe}: the plan is cautious: {longest:,} tokens ran, {longest - planned:,} ({(longest - planned) / planned:+.1%}) "
                    f"beyond the plan's {planned:,}."
                )
            else:
                notes.append(
                    f"- {recipe}: the plan's {planned:,} tokens ran and {first_oom:,} did not: the plan is right to within one step ({step:,} tokens)."
                )
        elif unit.get("conclusion"):
            notes.append(f"- {recipe}: {unit['conclusion']}.")
    mine, theirs = data["units"].get("memfit", {}).get("longest_ran"), data["units"].get("hf", {}).get("longest_ran")
    if mine and theirs:
        notes.append(
            f"- memfit's step trained {mine / theirs:.1f}x the context of the plain Hugging Face + PEFT step under the same cap."
        )
    return lines + ([""] + notes if notes else [])


def _tokens(value) -> str:
    return "–" if value is None else f"{value:,}"


def section_speed(data: dict | None) -> list[str]:
    if not data or not data.get("units"):
        return ["Not run yet."]
    lines = [
        "Tokens per second after the first (warm-up) step, peak memory from the training loop's start, both sides "
        "on the same synthetic rows of exactly the sequence length, each in a fresh process. The planned column is "
        "memfit's plan of that side's recipe (`--recipe memfit` / `--recipe hf`).",
        "",
        "| configuration | side | tokens/s | peak allocated | peak reserved | planned reserved | reserved error |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    notes = []
    for uid, unit in data["units"].items():
        result, plan = unit.get("result", {}), unit.get("plan", {})
        if result.get("status") != "ok":
            lines.append(
                f"| {unit.get('config')} | {unit.get('side')} | {result.get('status')} | – | – | {gib(plan.get('reserved_bytes'))} | – |"
            )
            notes.append(
                f"- {uid}: {result.get('status')}: {(result.get('error') or '').splitlines()[-1][:300] if result.get('error') else ''}"
            )
            continue
        measured, planned = result.get("peak_reserved_bytes"), plan.get("reserved_bytes")
        error = (planned - measured) / measured if measured and planned else None
        speed = result.get("tokens_per_second_after_warmup")
        lines.append(
            f"| {unit.get('config')} | {unit.get('side')} | {speed:,.0f} | {gib(result.get('peak_allocated_bytes'))} | "
            f"{gib(measured)} | {gib(planned)} | {pct(error)} |"
            if speed
            else f"| {unit.get('config')} | {unit.get('side')} | – | {gib(result.get('peak_allocated_bytes'))} | {gib(measured)} | {gib(planned)} | {pct(error)} |"
        )
        if error is not None and abs(error) > GOAL_P95:
            notes.append(
                f"- {uid}: planned {gib(planned)} reserved, measured {gib(measured)} ({pct(error)}): beyond the planner's "
                f"{GOAL_P95:.0%} goal"
                + (
                    " (the Trainer's own step, e.g. its bf16 autocast, is not what the hf recipe plans)"
                    if unit.get("side") != "memfit"
                    else ""
                )
                + "."
            )
    for config, row in (data.get("summary") or {}).items():
        if row.get("speed_ratio") is not None:
            notes.append(
                f"- {config}: memfit train at {row['speed_ratio']:.2f}x the Trainer's tokens/s"
                + (f", {row['reserved_ratio']:.2f}x its peak reserved memory." if row.get("reserved_ratio") else ".")
            )
    return lines + ([""] + notes if notes else [])


def section_constants(data: dict | None, accuracy: dict | None) -> list[str]:
    unit = (data or {}).get("units", {}).get("constants")
    if not unit:
        return ["Not run yet."]
    if unit.get("status") != "ok":
        return [f"The measurement failed: {unit.get('error', '')[-500:]}"]
    assumed = unit.get("assumed", {})
    measured = unit.get("measured")
    if measured is None:
        return [
            f"Assumed: CUDA context {mib(assumed.get('cuda_context_bytes'))}, cuBLAS workspaces "
            f"{', '.join(mib(b) for b in assumed.get('cublas_workspace_allocs_bytes', []))}. Nothing measured: {unit.get('reason')}."
        ]
    lines = [
        f"Architecture {unit.get('arch')}; the planner's assumptions for it next to what this GPU does.",
        "",
        "| constant | assumed | measured |",
        "| --- | ---: | ---: |",
    ]
    notes = []
    context = assumed.get("cuda_context_bytes")
    after_init = measured.get("after_init", {}).get("context_bytes")
    lines.append(f"| CUDA context after the first CUDA call | {mib(context)} | {mib(after_init)} |")
    for stage in unit.get("training_steps", []):
        lines.append(
            f"| CUDA context after {stage['method']} training steps | {mib(context)} | {mib(stage.get('context_bytes'))} |"
        )
        if stage.get("context_bytes") is not None and abs(stage["context_bytes"] - context) > CONSTANT_TOLERANCE_BYTES:
            notes.append(
                f"- The CUDA context of a {stage['method']} training process measures {mib(stage['context_bytes'])}, the planner assumes "
                f"{mib(context)}: every device total it plans is off by {mib(stage['context_bytes'] - context)} on this GPU "
                "(`CUDA_CONTEXT_BYTES_BY_ARCH` in src/memfit/planner/exact/runtime.py takes a measured value)."
            )
    allocs = assumed.get("cublas_workspace_allocs_bytes", [])
    lines.append(
        f"| cuBLAS workspace of the first forward matmul | {mib(allocs[0] if allocs else None)} | {mib(measured.get('first_forward_matmul_bytes'))} |"
    )
    lines.append(
        f"| cuBLAS workspace added by the first backward | {mib(allocs[1] if len(allocs) > 1 else None)} | {mib(measured.get('first_backward_bytes_beyond_grad'))} |"
    )
    lines.append(
        f"| all cuBLAS workspaces (freed by clearing them) | {mib(assumed.get('cublas_workspace_bytes'))} | {mib(measured.get('cublas_workspaces_freed_bytes'))} |"
    )
    if measured.get("cublas_workspaces_freed_bytes") not in (None, assumed.get("cublas_workspace_bytes")):
        notes.append(
            f"- cuBLAS workspaces: {mib(measured['cublas_workspaces_freed_bytes'])} measured, {mib(assumed.get('cublas_workspace_bytes'))} "
            "assumed: the plans' allocated and reserved bytes differ by that much."
        )
    singles = unit.get("single_requests", [])
    matching = measured.get("single_requests_matching")
    lines.append(
        f"| allocator: single requests whose block and segment match the model | {len(singles)} of {len(singles)} | {matching} of {len(singles)} |"
    )
    replay = unit.get("replay", {})
    lines.append(
        f"| allocator: events of a seeded replay where reserved and allocated differ from the model | 0 of {replay.get('events')} | "
        f"{replay.get('mismatched_events')} of {replay.get('events')} |"
    )
    for row in singles:
        if row.get("allocated_bytes") != row.get("model_allocated_bytes") or row.get("reserved_bytes") != row.get(
            "model_reserved_bytes"
        ):
            notes.append(
                f"- A request of {row['request_bytes']:,} B: the allocator gave a {row.get('allocated_bytes'):,} B block in "
                f"{row.get('reserved_bytes'):,} B of new segments, the model {row['model_allocated_bytes']:,} B in {row['model_reserved_bytes']:,} B."
            )
    if replay.get("mismatched_events"):
        notes.append(
            f"- The replay differs from the allocator model at {replay['mismatched_events']} events; first: {replay.get('first_mismatches', [])[:1]}."
        )
    return lines + ([""] + notes if notes else [])


# ------------------------------------------------------------------------------------------------
# The page and README's block


def render(results: list[dict], root: Path) -> str:
    """The page under its title."""
    lines: list[str] = []
    if not results:
        lines += [
            "**No GPU measurements yet.** Every GPU memory and speed figure memfit publishes (README, docs/plan.md,",
            "docs/memory-lean.md, benchmarks/results/) is a plan or a CPU measurement so far. `benchmarks/gpu_campaign.py`",
            "measures them all on a GPU machine: the CUDA tests, planner accuracy on 48 configurations, the longest",
            "context under a 24 GB cap, memfit train against Hugging Face Trainer + PEFT, and the runtime constants the",
            "planner assumes. This page is then written from its results files.",
            "",
            "## How to measure",
            "",
            COMMANDS,
            "",
        ]
        return "\n".join(lines)
    lines += [
        "Written from the results files of `benchmarks/gpu_campaign.py`; every figure is read from them. Where a",
        "measurement disagrees with the plan beyond the planner's goal (median 3%, p95 8% on peak reserved), a",
        "sentence says so.",
        "",
    ]
    for result in results:
        invocations = result["campaign"].get("invocations", [])
        name = (
            (invocations[-1]["environment"].get("gpu_details") or {}).get("name") if invocations else None
        ) or result["campaign"].get("gpu_key")
        lines += [
            f"## {name}",
            "",
            *section_machine(result, root),
            "",
            "### 1. CUDA tests",
            "",
            *section_tests(result["tests"]),
            "",
            "### 2. Planner accuracy",
            "",
            *section_accuracy(result["accuracy"]),
            "",
            "### 3. Longest context under a 24 GB cap",
            "",
            *section_context(result["context"]),
            "",
            "### 4. memfit train against Hugging Face Trainer + PEFT",
            "",
            *section_speed(result["speed"]),
            "",
            "### 5. Runtime constants",
            "",
            *section_constants(result["constants"], result["accuracy"]),
            "",
        ]
    lines += ["## How to measure", "", COMMANDS, ""]
    return "\n".join(lines)


def readme_block(results: list[dict]) -> str:
    """The figures README shows: headline measurements per GPU, or the plain statement that there are none."""
    if not results:
        body = [
            "No GPU measurements yet: every GPU memory and speed figure in this README is a plan. One command",
            "on a GPU machine, `benchmarks/gpu_campaign.py`, measures them all (CUDA tests, planner accuracy,",
            "longest context, speed against Hugging Face Trainer, runtime constants); results and how to",
            "produce them: [docs/gpu-results.md](docs/gpu-results.md).",
        ]
    else:
        body = []
        for result in results:
            key = result["campaign"].get("gpu_key")
            parts = []
            reserved = ((result["accuracy"] or {}).get("summary") or {}).get("reserved")
            if reserved:
                parts.append(
                    f"planner error on peak reserved {reserved['median_abs_error']:.1%} median, {reserved['p95_abs_error']:.1%} p95 "
                    f"over {reserved['n']} configurations"
                )
            units = (result["context"] or {}).get("units", {})
            for recipe in ("memfit", "hf"):
                unit = units.get(recipe)
                if unit and unit.get("longest_ran") is not None:
                    parts.append(
                        f"{recipe} step: longest context {unit['longest_ran']:,} tokens under a 24 GB cap (planned {unit.get('planned_max_seq_len'):,})"
                    )
            for config, row in ((result["speed"] or {}).get("summary") or {}).items():
                if row.get("speed_ratio") is not None:
                    parts.append(f"{config}: memfit train {row['speed_ratio']:.2f}x the Trainer's tokens/s")
            tests = ((result["tests"] or {}).get("units", {}).get("pytest") or {}).get("counts")
            if tests:
                parts.append("CUDA tests: " + ", ".join(f"{n} {k}" for k, n in sorted(tests.items())))
            body.append(f"- {key}: " + ("; ".join(parts) if parts else "campaign started, nothing finished yet") + ".")
        body += [
            "",
            "Every figure, with the machine, versions and commands, and where a measurement disagrees with the plan:",
            "[docs/gpu-results.md](docs/gpu-results.md).",
        ]
    return "\n".join(body)


def page_block(figures_results) -> str:
    """The ``gpu-results-page`` block of benchmarks/figures.py: docs/gpu-results.md under its title."""
    root = figures_results.gpu_root or figures_results.root / "gpu"
    return render(load_results(root, include_tiny=figures_results.include_tiny), root)


def summary_block(figures_results) -> str:
    """The ``gpu-results`` block of benchmarks/figures.py: README's section."""
    root = figures_results.gpu_root or figures_results.root / "gpu"
    return readme_block(load_results(root, include_tiny=figures_results.include_tiny))
