"""The generated blocks of README.md and docs/*.md (benchmarks/figures.py): tables and sections
written from the results files, one renderer per block name. Each takes a
:class:`_figure_results.Results` and returns the block's Markdown; nothing here is typed in but words.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable

import _campaign_report
from _figure_results import FigureError


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB"


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.2f} MiB"


def _mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:,.0f} MB"


def _seconds(value: float) -> str:
    """Seconds as the docs quote them: two significant decimals under one second, one above."""
    return f"{value:.2f} s" if value < 1 else f"{value:.1f} s"


def _table(header: list[str], rows: list[list[str]], align: list[str] | None = None) -> list[str]:
    align = align or ["---"] * len(header)
    return [
        "| " + " | ".join(header) + " |",
        "| " + " | ".join(align) + " |",
        *("| " + " | ".join(r) + " |" for r in rows),
    ]


def _machine(machine: dict) -> str:
    memory = machine.get("memory_bytes") or machine.get("ram_bytes")
    return (
        f"{machine.get('cpu_count')}-core {machine.get('cpu') or machine.get('processor')}, "
        f"{memory / 2**30:.0f} GiB, "
        + ("no GPU" if not machine.get("gpu") else machine["gpu"])
        + (f", torch {machine['torch']}" if machine.get("torch") else "")
    )


def model_name(key: str) -> str:
    """A catalog name as people write it: llama-3.1-8b -> Llama-3.1-8B, qwen2.5-72b -> Qwen2.5-72B."""
    head, _, size = key.rpartition("-")
    return f"{head[:1].upper()}{head[1:]}-{size.upper()}"


def method_name(method: str) -> str:
    return {"lora": "LoRA", "qlora": "QLoRA"}.get(method, method)


# ------------------------------------------------------------------------------------------------
# Planning speed (docs/plan.md, docs/fit.md)


def _labels(data: dict) -> str:
    runs = data["runs"]
    commits = ", ".join(f"`{label}` is {run['memfit']['commit'][:7]}" for label, run in runs.items())
    machine = next(iter(runs.values()))["machine"]
    return f"Both labels measured in one session on a {_machine(machine)}; {commits}."


def plan_speed(results) -> str:
    data = results.load("plan_speed")
    before, after = data["runs"]["before"], data["runs"]["after"]
    rows = []
    for old, new in zip(before["cases"], after["cases"]):
        knobs = new["knobs"]
        shape = (f"{knobs['batch_size']} x " if knobs.get("batch_size", 1) > 1 else "") + f"{knobs['seq_len']} tokens"
        rows.append(
            [
                f"{model_name(new['model'])} {method_name(knobs['method'])}, {shape}",
                _seconds(new["warm_seconds_median"]),
                _seconds(old["cold_cli_seconds"]),
                _seconds(new["cold_cli_seconds"]),
                _seconds(new["cold_cli_cached_seconds"]),
            ]
        )
    return "\n".join(
        [
            _labels(data),
            "",
            *_table(
                [
                    "model, configuration",
                    "plan, in a process that has planned before",
                    "`memfit plan` in a new process, before",
                    "after",
                    "after, plan cached",
                ],
                rows,
            ),
        ]
    )


def fit_speed(results) -> str:
    data = results.load("fit_speed")
    before, after = data["runs"]["before"], data["runs"]["after"]
    rows = [
        [
            f"`{new['command'].removesuffix(' --json')}`",
            _seconds(old["cold_cache_wall_seconds"]),
            _seconds(new["cold_cache_wall_seconds"]),
            _seconds(new["warm_cache_wall_seconds"]),
            f"{old['plans_made']} / {new['plans_made']}",
        ]
        for old, new in zip(before["cases"], after["cases"])
    ]
    return "\n".join(
        [
            _labels(data),
            "",
            *_table(["search", "before", "after, empty cache", "after, cached", "plans before / after"], rows),
        ]
    )


# ------------------------------------------------------------------------------------------------
# The memory-lean step (docs/memory-lean.md)


def batch_layouts(results) -> str:
    data = results.load("batch_layouts")
    names = {
        "padded": "padded (`--padding-free off`)",
        "padding-free": "padding-free (default)",
        "packed": f"packed, {data['setup']['packed_rows_per_micro_batch']} rows of {data['setup']['seq_len']}",
    }
    rows = [
        [
            names.get(r["mode"], r["mode"]),
            f"{r['tokens_per_step']}",
            _mib(r["measured_peak_bytes"]),
            _mib(r["planned_peak_bytes"]),
            f"{r['tokens_per_second']:,.0f}",
        ]
        for r in data["rows"]
    ]
    return "\n".join(_table(["batches", "tokens a step", "peak of the steps", "plan", "tokens/s (CPU)"], rows))


def max_context(results) -> str:
    data = results.load("max_context")
    recipes = data["recipes"]
    names = {
        "memfit": "memfit",
        "hf": "hf, as `fit` picks it",
        "hf-checkpointing-on": "hf, checkpointing on (the usual set-up)",
    }
    rows = []
    for key, recipe in recipes.items():
        settings = recipe["settings_at_max"]
        words = {
            "offload": "offloaded checkpointing" if key == "memfit" else "transformers' offload",
            "on": "checkpointing",
            "off": "no checkpointing",
        }[settings["checkpointing"]]
        words += ", tiling" if settings.get("tiling") == "on" else ""
        words += ", " + {"adamw": "AdamW", "adamw8bit": "8-bit AdamW", "paged-adamw8bit": "paged 8-bit AdamW"}.get(
            settings["optimizer"], settings["optimizer"]
        )
        longest = f"{recipe['max_seq_len']:,}" + (f" ({recipe['plans_made']} plans)" if key == "memfit" else "")
        peak = _gib(recipe["peak_at_8192"]["device_total_bytes"])
        if key == "memfit":
            longest, peak = f"**{longest.split(' ')[0]}**" + longest[len(longest.split(" ")[0]) :], f"**{peak}**"
        rows.append([names.get(key, key), longest, words, peak])
    return "\n".join(_table(["recipe", "longest context", "settings at the longest", "peak at 8,192 tokens"], rows))


# ------------------------------------------------------------------------------------------------
# Merge (docs/merge.md)


def merge_vs_peft(results) -> str:
    """benchmarks/merge_vs_peft.py's three adapters (LoRA, DoRA, LoRA + modules_to_save): peak RSS and wall, each side."""
    rows = []
    for name, label in (
        ("merge_vs_peft", "LoRA"),
        ("merge_vs_peft-dora", "DoRA"),
        ("merge_vs_peft-modules_to_save", "LoRA + `modules_to_save`"),
    ):
        data = results.load(name)
        mine, peft = data["memfit"], data["peft"]
        rows.append(
            [
                f"{label} ({_mb(data['model']['adapter_bytes'])})",
                f"{_mb(mine['peak_rss_bytes'])} ({_mb(mine['peak_rss_minus_baseline_bytes'])})",
                f"{_mb(peft['peak_rss_bytes'])} ({_mb(peft['peak_rss_minus_baseline_bytes'])})",
                _seconds(mine["wall_s"]),
                _seconds(peft["wall_s"]),
            ]
        )
    return "\n".join(
        _table(
            [
                "adapter (file size)",
                "memfit peak RSS (minus baseline)",
                "PEFT peak RSS (minus baseline)",
                "memfit wall",
                "PEFT wall",
            ],
            rows,
        )
    )


# ------------------------------------------------------------------------------------------------
# Command output recorded by benchmarks/cli_examples.py


def _example(results, name: str) -> dict:
    examples = results.load("cli_examples")["examples"]
    if name not in examples:
        raise FigureError(f"cli_examples has no example {name!r} (python benchmarks/cli_examples.py --only {name})")
    return examples[name]


def plan_example(results) -> str:
    """``memfit plan``'s table for README: the command, then what it printed."""
    example = _example(results, "plan")
    lines = [line.rstrip() for line in example["stdout"].rstrip("\n").splitlines()]
    return "```\n$ " + example["command"] + "\n" + "\n".join(lines) + "\n```"


def train_fit_example(results) -> str:
    """What ``memfit train --fit`` says about its choice (docs/train.md): the ``fit: chose`` line and
    its continuation, up to the ``plan:`` line."""
    example = _example(results, "train-fit")
    lines = (example["stdout"] + example["stderr"]).splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("fit: chose"))
    end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("plan:"))
    return "```\n$ " + example["command"] + "\n" + "\n".join(line.rstrip() for line in lines[start:end]) + "\n```"


# ------------------------------------------------------------------------------------------------
# A real model end to end (docs/chat.md) and other tools' configs (docs/interop.md)


def real_model(results) -> str:
    """benchmarks/real_model.py's steps and what each gave, one row a step."""
    data = results.load("real_model")
    model, conf, plan, train, probes, merge = (
        data[k] for k in ("model", "configuration", "plan", "training", "probes", "merge")
    )
    before, after = probes["before"], probes["after"]
    # What the untrained model says instead of the one word: its replies' commonest first four words.
    start, times = Counter(" ".join(re.findall(r"\w+", r["generation"])[:4]) for r in before["replies"]).most_common(1)[
        0
    ]

    def trained(side: dict) -> str:
        return (
            f"loss {side['first_loss']:.3f} -> {side['last_loss']:.4f}, {side['tokens_per_second']:.1f} tokens/s, "
            f"peak RSS {side['peak_rss_bytes'] / 2**20:,.0f} MiB"
        )

    identical = (
        f"all {merge['comparison']['tensors']} tensors bit-identical"
        if merge["bit_identical"]
        else f"{merge['comparison']['differ_count']} of {merge['comparison']['tensors']} tensors differ"
    )
    doctor = next((line.strip() for line in reversed(data["doctor"]["output"]) if line.strip()), "")
    rows = [
        [
            f"convert the GGUF file ({_mb(model['gguf_bytes'])}) to safetensors",
            f"{model['shards']} shards, {_mb(model['safetensors_bytes'])} fp32, {model['convert_s']:.0f} s",
        ],
        [
            f"`memfit plan` (batch {conf['batch_size']} x {conf['seq_len']} tokens, LoRA r={conf['rank']}, {conf['precision']}, "
            "checkpointing)",
            f"{plan['peak']['device_total_bytes'] / 1e9:.2f} GB on a CUDA device (weights {_mb(plan['categories']['weights'])}, "
            f"runtime {_mb(plan['categories']['runtime'])})",
        ],
        [
            "probes before training",
            f"{before['exact']} of {before['count']} answered with the word ({before['lenient']} of "
            f'{before["count"]} lenient; {times} of {before["count"]} replies begin "{start}")',
        ],
        [f"{train['memfit']['steps']} LoRA steps, memfit", trained(train["memfit"])],
        [f"{train['hf-trainer']['steps']} LoRA steps, `Trainer` + PEFT", trained(train["hf-trainer"])],
        ["probes after training (`memfit generate RUN_DIR`)", f"{after['exact']} of {after['count']}"],
        [
            "`memfit merge` / PEFT `merge_and_unload`",
            f"{merge['memfit']['peak_rss_bytes'] / 2**20:,.0f} / {merge['peft']['peak_rss_bytes'] / 2**20:,.0f} MiB peak RSS, "
            f"{merge['memfit']['wall_s']:.1f} / {merge['peft']['wall_s']:.1f} s; {identical}",
        ],
        ["`memfit doctor`", f"exit {data['doctor']['exit_code']}: {doctor[:1].lower()}{doctor[1:].rstrip('.')}"],
    ]
    return "\n".join(_table(["step", "result"], rows))


def interop_accuracy(results) -> str:
    """benchmarks/interop_accuracy.py's cases, then the medians."""
    result = results.load("interop_accuracy")
    lines = [
        "| case | kind | published | planned | planned / published | not modelled |",
        "| --- | --- | ---: | ---: | ---: | --- |",
    ]
    for row in result["cases"]:
        unmodelled = "; ".join(item.split(":")[0] for item in row["not_modelled"]) or ""
        lines.append(
            f"| [{row['id']}]({row['source']}) | {row['kind']} | {row['published_gib']:g} GiB | "
            f"{row['planned_gib']:.2f} GiB | {row['ratio']:.3f} | {unmodelled} |"
        )
    lines += ["", "| cases | count | median of \\|planned / published - 1\\| |", "| --- | ---: | ---: |"]
    for group in result["summary"].values():
        median = "" if group["median_abs_error"] is None else f"{group['median_abs_error']:.1%}"
        lines.append(f"| {group['label']} | {group['cases']} | {median} |")
    return "\n".join(lines) + "\n"


def precision_plans(results) -> str:
    """The four plans of benchmarks/precision_plans.py, as the commands with their device totals."""
    data = results.load("precision_plans")
    width = max(len(row["command"]) for row in data["plans"])
    lines = []
    for row in data["plans"]:
        total = row["peak"]["device_total_bytes"]
        shown = f"{total / 2**30:.1f} GiB" if total >= 50 * 2**30 else _gib(total)
        lines.append(f"{row['command']:<{width}}   # device total {shown} ({total:,} B)")
    return (
        f"Planned on a {_machine(data['machine'])} (the plan is a simulation, not a CUDA run):\n\n"
        "```bash\n" + "\n".join(lines) + "\n```"
    )


# ------------------------------------------------------------------------------------------------
# Preference training (docs/preference.md)


def dpo_plan(results) -> str:
    """benchmarks/dpo_vs_trl.py --part plan: memfit's DPO step against the plain stack's, per seq_len."""
    recipes = results.load("dpo_vs_trl-plan")["recipes"]
    mine, plain = recipes["memfit"], recipes["hf"]
    rows = []
    for seq_len in mine["peaks"]:
        cells = []
        for recipe in (mine, plain):
            peak = recipe["peaks"][seq_len]
            cells.append(_gib(peak["device_total_bytes"]) + ("" if peak["fits"] else " (does not fit)"))
        rows.append([f"{int(seq_len):,}", *cells])

    def settings(recipe: dict) -> str:
        at_max = recipe["settings_at_max"]
        words = [f"checkpointing {at_max['checkpointing']}"] + (["tiling on"] if at_max.get("tiling") == "on" else [])
        return ", ".join(words)

    rows.append(
        [
            "longest that fits (`memfit fit --objective dpo --max seq-len`)",
            f"{mine['max_seq_len']:,} tokens a sequence ({settings(mine)})",
            f"{plain['max_seq_len']:,} ({settings(plain)})",
        ]
    )
    return "\n".join(_table(["`seq_len`", "memfit", "`--recipe hf`"], rows, ["---", "---:", "---:"]))


def dpo_vs_trl_cpu(results) -> str:
    """benchmarks/dpo_vs_trl.py --part cpu: speed, peak RSS and last loss of the two sides."""
    data = results.load("dpo_vs_trl-cpu")
    sides = ("memfit", "trl-dpo")
    repeats = len(data["runs"]["memfit"])
    speed = [f"{data['summary'][side]['tokens_per_second_median']:,.0f}" for side in sides]
    rss = [f"{data['summary'][side]['peak_rss_bytes_median'] / 2**20:,.0f} MiB" for side in sides]
    steps = data["runs"]["memfit"][0]["steps"]
    losses = [f"{data['runs'][side][0]['last_loss']:.4f}" for side in sides]
    return "\n".join(
        _table(
            ["", "memfit", "TRL `DPOTrainer` + PEFT"],
            [
                [f"tokens/s (median of {repeats})", *speed],
                [f"peak RSS (median of {repeats})", *rss],
                [f"loss after {steps} steps", *losses],
            ],
            ["---", "---:", "---:"],
        )
    )


def plan_dpo_example(results) -> str:
    """The end of ``memfit plan --objective dpo``'s output (docs/preference.md): from the reference line on."""
    example = _example(results, "plan-dpo")
    lines = [line.rstrip() for line in example["stdout"].rstrip("\n").splitlines()]
    start = next(i for i, line in enumerate(lines) if line.startswith("reference:"))
    return "```\n$ " + example["command"] + "\n...\n" + "\n".join(lines[start:]) + "\n```"


# ------------------------------------------------------------------------------------------------
# Adapter options (docs/plan.md)


def _size(nbytes: float) -> str:
    """Bytes as a plan's table shows them: MiB under a GiB, GiB above, one decimal."""
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


#: Why a category grows, per option of benchmarks/adapter_plans.py (words only; the figures are the file's).
_WHY = {
    "--dora": {"temporaries": "the weight norms"},
    "--method lora-8bit": {"activations": "the 8-bit layers' inputs, kept through checkpointing"},
}
_AFTER = {"--modules-to-save embed_tokens,lm_head": " (the embeddings train: they stay on the device)"}


def adapter_plans(results) -> str:
    """Each option's device total and the categories it changes against plain LoRA (by 1% and 16 MiB or more)."""
    data = results.load("adapter_plans")
    base = data["plans"][0]
    rows = [
        [
            base["option"],
            _gib(base["peak"]["device_total_bytes"]),
            f"(the frozen input embeddings, {_size(base['host_peak_bytes'])}, in host memory)"
            if base.get("host_peak_bytes")
            else "",
        ]
    ]
    for plan in data["plans"][1:]:
        changes = []
        for name, value in plan["categories"].items():
            before = base["categories"][name]
            if abs(value - before) < max(16 * 2**20, 0.01 * before):
                continue
            words = f"{name} {_size(value)} at the peak" if before == 0 else f"{name} {_size(before)} to {_size(value)}"
            why = _WHY.get(plan["option"], {}).get(name)
            changes.append(words + (f" ({why})" if why else ""))
        rows.append(
            [
                f"`{plan['option']}`",
                _gib(plan["peak"]["device_total_bytes"]),
                "; ".join(changes) + _AFTER.get(plan["option"], ""),
            ]
        )
    return "\n".join(_table(["option", "device total", "what changes (against LoRA)"], rows))


#: Block name -> renderer.
def sequence_parallel(results) -> str:
    """The longest sequence per GPU count, FSDP alone and with sequence parallelism (planned)."""
    data = results.load("sequence_parallel")
    limit = data["setup"]["max_tokens"]
    by_count: dict[int, dict[int, dict]] = {}
    for row in data["rows"]:
        by_count.setdefault(row["gpus"], {})[row["sequence_parallel"]] = row

    def cell(row: dict | None) -> str:
        if row is None:
            return "-"
        words = f"{row['max_seq_len']:,}" + (" (the positions' limit)" if row["max_seq_len"] >= limit else "")
        return f"{words}, {_gib(row['device_total_bytes'])}"

    rows = [
        [str(gpus), cell(rows.get(1)), cell(rows.get(gpus) if gpus > 1 else None)]
        for gpus, rows in sorted(by_count.items())
    ]
    header = ["H100s", "FSDP alone: longest, peak per GPU", "sequence parallel = GPUs: longest, peak per GPU"]
    return "\n".join(_table(header, rows))


BLOCKS: dict[str, Callable] = {
    _campaign_report.README_BLOCK: _campaign_report.summary_block,
    _campaign_report.PAGE_BLOCK: _campaign_report.page_block,
    "plan-speed": plan_speed,
    "fit-speed": fit_speed,
    "batch-layouts": batch_layouts,
    "max-context": max_context,
    "merge-vs-peft": merge_vs_peft,
    "plan-example": plan_example,
    "train-fit-example": train_fit_example,
    "real-model": real_model,
    "interop-accuracy": interop_accuracy,
    "precision-plans": precision_plans,
    "dpo-plan": dpo_plan,
    "dpo-vs-trl-cpu": dpo_vs_trl_cpu,
    "plan-dpo-example": plan_dpo_example,
    "adapter-plans": adapter_plans,
    "sequence-parallel": sequence_parallel,
}
