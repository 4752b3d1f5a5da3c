"""The bytes of a fixed set of plans, to show that a change to memfit's code leaves plans as they were.

Each configuration is planned with ``memfit.plan`` (the same function ``memfit plan --json`` calls)
and its JSON is written down, the time it took left out: peak allocated, reserved and device
total, every category, the host and paged peaks, the per-phase peaks and the notes. The set covers
the benchmark configurations (plan_speed, max_context) and the methods, checkpointing modes,
tiling, optimizers, recipes and multi-GPU modes.

    python benchmarks/plan_bytes.py                    # writes benchmarks/results/plan_bytes.json
    python benchmarks/plan_bytes.py --check            # compares with that file; exit 1 on a difference
    python benchmarks/plan_bytes.py --check --only 3   # the first three configurations only
    python benchmarks/plan_bytes.py --exact-cases 1-4,10   # the exact column for these cases only

Each plan is also made exact (``memfit.plan(..., exact=True)``: every layer simulated, every chunk and
micro-batch run, nothing from a cache) and compared with it, figure by figure: the ``exact`` column,
kept with each plan (``exact: null`` for a case left out with ``--exact-cases``; the file lists the
cases compared). The exact plans of the big models take minutes each.

A change that is meant to change plans regenerates the file in the same commit, so its diff shows
which plans moved and by how much.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "plan_bytes.json"

# (model, knobs): plan_speed's cases, max_context's, then one of each knob's values.
CASES: list[tuple[str, dict]] = [
    ("llama-3.1-8b", dict(method="qlora", seq_len=4096, batch_size=2, checkpointing="on")),
    ("llama-3.1-8b", dict(method="lora", seq_len=2048, batch_size=1, checkpointing="off")),
    ("llama-3.1-8b", dict(method="full", seq_len=2048, batch_size=1, checkpointing="on")),
    ("qwen2.5-7b", dict(method="qlora", seq_len=8192, batch_size=1, checkpointing="on")),
    ("llama-3.1-70b", dict(method="qlora", seq_len=4096, batch_size=1, checkpointing="on")),
    ("qwen2.5-72b", dict(method="qlora", seq_len=2048, batch_size=1, checkpointing="on")),
    (
        "llama-3.1-8b",
        dict(method="qlora", rank=32, seq_len=8192, batch_size=1, checkpointing="offload", gpu="rtx-4090"),
    ),
    (
        "llama-3.1-8b",
        dict(method="qlora", rank=32, seq_len=8192, batch_size=1, checkpointing="offload", recipe="hf", gpu="rtx-4090"),
    ),
    (
        "llama-3.1-8b",
        dict(method="qlora", rank=32, seq_len=65536, batch_size=1, checkpointing="offload", gpu="rtx-4090"),
    ),
    ("llama-3.2-1b", dict(method="full", seq_len=1024, batch_size=2, checkpointing="off")),
    ("llama-3.2-1b", dict(method="full", seq_len=1024, batch_size=2, checkpointing="on", step_in_backward=True)),
    ("llama-3.2-1b", dict(method="full", seq_len=2048, batch_size=1, optimizer="adamw8bit", precision="fp32")),
    ("llama-3.2-1b", dict(method="lora", seq_len=2048, batch_size=4, grad_accum=4, optimizer="paged-adamw8bit")),
    ("llama-3.2-1b", dict(method="lora", seq_len=4096, batch_size=1, tiling="on", checkpointing="offload")),
    ("llama-3.2-1b", dict(method="lora", seq_len=2048, batch_size=2, recipe="hf", checkpointing="on")),
    ("qwen2.5-1.5b", dict(method="qlora", seq_len=2048, batch_size=2, precision="fp16", optimizer="sgd")),
    ("qwen2.5-1.5b", dict(method="lora", seq_len=1024, batch_size=1, targets="q_proj,v_proj", rank=8, dropout=0.05)),
    ("gemma-2-2b", dict(method="lora", seq_len=2048, batch_size=1, checkpointing="on")),
    ("smollm2-135m", dict(method="full", seq_len=512, batch_size=8, checkpointing="off", precision="fp32")),
    ("llama-3.1-8b", dict(method="full", seq_len=2048, batch_size=1, gpus=4, shard="fsdp")),
    ("llama-3.1-8b", dict(method="full", seq_len=2048, batch_size=1, gpus=2, shard="zero2", optimizer="adamw8bit")),
    ("llama-3.1-8b", dict(method="lora", seq_len=4096, batch_size=1, gpus=2, shard="ddp")),
    ("llama-3.1-8b", dict(method="qlora", seq_len=4096, batch_size=1, gpus=2, shard="fsdp-offload")),
    ("llama-3.1-70b", dict(method="lora", seq_len=2048, batch_size=1, gpus=8, shard="zero3", checkpointing="on")),
]


def plan_figures(model: str, knobs: dict, exact: bool = False) -> dict:
    """One plan as ``memfit plan --json`` reports it, without the time it took to make."""
    import memfit

    data = memfit.plan(model, exact=exact, **knobs).to_dict()
    data["details"].pop("plan_seconds", None)
    return {"model": model, "knobs": knobs, **data}


#: What says how a plan was made, not what it plans: left out of the exact column's comparison.
HOW_MADE = ("simulated_layers", "exact")


def _flat(value, prefix: str = "") -> dict:
    if not isinstance(value, dict):
        return {prefix[:-1]: value}
    return {k: v for key, inner in value.items() for k, v in _flat(inner, f"{prefix}{key}.").items()}


def exact_column(row: dict) -> dict:
    """The exact plan of ``row``'s configuration against ``row`` (its plan with shortcuts): every
    figure that differs, ``{name: [with shortcuts, exact]}`` (names flat: ``peak.reserved_bytes``)."""
    exact = plan_figures(row["model"], row["knobs"], exact=True)
    short, made = (
        _flat(
            {k: v for k, v in r.items() if k != "details"}
            | {"details": {k: v for k, v in r["details"].items() if k not in HOW_MADE}}
        )
        for r in (row, exact)
    )
    differences = {
        name: [short.get(name), made.get(name)]
        for name in sorted(set(short) | set(made))
        if short.get(name) != made.get(name)
    }
    return {"equal": not differences, "differences": differences}


def _describe_exact(column: dict | None) -> str:
    if column is None:
        return "exact: not compared"
    if column["equal"]:
        return "exact: equal"
    said = []
    for name, (short, made) in column["differences"].items():
        if isinstance(short, int) and isinstance(made, int) and made:
            said.append(f"{name} {short - made:+,} B ({(short - made) / made:+.2%})")
        else:
            said.append(name)
    return "exact: " + "; ".join(said)


def parse_cases(text: str, count: int) -> list[int]:
    """``all``, ``none`` or numbers and ranges (``1-4,10``) of the cases, 1-based."""
    if text == "all":
        return list(range(1, count + 1))
    if text == "none":
        return []
    chosen = set()
    for part in text.split(","):
        first, _, last = part.strip().partition("-")
        chosen.update(range(int(first), int(last or first) + 1))
    if not chosen <= set(range(1, count + 1)):
        raise SystemExit(f"--exact-cases {text}: the cases are numbered 1 to {count}")
    return sorted(chosen)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="compare with the results file instead of writing it")
    parser.add_argument("--only", type=int, default=None, help="only the first N configurations")
    parser.add_argument(
        "--exact-cases",
        default="all",
        help="the cases also planned exact: all (default), none, or numbers and ranges, 1-based (1-4,10)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()

    cases = CASES[: args.only] if args.only else CASES
    exact_cases = parse_cases(args.exact_cases, len(cases))
    started = time.perf_counter()
    rows = []
    for number, (model, knobs) in enumerate(cases, start=1):
        rows.append(plan_figures(model, knobs))
        rows[-1]["exact"] = exact_column(rows[-1]) if number in exact_cases else None
        print(
            f"{number:2d} {model:14s} {json.dumps(knobs)}: {rows[-1]['peak']['device_total_bytes']:,} B; "
            f"{_describe_exact(rows[-1]['exact'])}",
            flush=True,
        )
    seconds = time.perf_counter() - started
    if not args.check:
        payload = {
            "benchmark": "plan_bytes",
            "command": "python benchmarks/plan_bytes.py",
            "exact_cases": exact_cases,
            "plans": rows,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(payload, indent=2) + "\n")
        print(f"wrote {args.out} ({len(rows)} plans, {seconds:.0f} s)")
        return 0
    expected = {
        json.dumps([r["model"], r["knobs"]], sort_keys=True): r for r in json.loads(args.out.read_text())["plans"]
    }
    differences = 0
    for row in rows:
        old = expected.get(json.dumps([row["model"], row["knobs"]], sort_keys=True))
        if old is None:
            print(f"new configuration (not in {args.out.name}): {row['model']} {row['knobs']}")
            differences += 1
            continue
        # The exact column is compared where this run made it.
        changed = sorted(
            key
            for key in row
            if row[key] != old.get(key) and not (key == "exact" and (row[key] is None or old.get(key) is None))
        )
        if changed:
            differences += 1
            print(f"DIFFERENT {row['model']} {row['knobs']}:")
            for key in changed:
                print(f"  {key}: {old.get(key)} -> {row[key]}")
    print(f"{len(rows) - differences} of {len(rows)} plans unchanged ({seconds:.0f} s)")
    return 1 if differences else 0


if __name__ == "__main__":
    sys.exit(main())
