"""Peak memory and wall time of `memfit merge` against PEFT's merge_and_unload, side by side.

Builds a random-weight base from a catalog config (bf16, several shards) and a random LoRA
adapter (r=16, all linear layers) in a scratch folder under /tmp, then runs each merge in its own
subprocess under `/usr/bin/time -v` (peak RSS of the whole process) and writes
benchmarks/results/merge_vs_peft.json. The scratch folder is removed at the end.

`--variant dora` makes it a DoRA adapter (use_dora: a magnitude per output row, rescaled in the
merge); `--variant modules_to_save` adds trained copies of embed_tokens and lm_head (kept tied on a
tied model, as memfit train writes them: ensure_weight_tying), whole tensors as large as the base's.
Their results go to merge_vs_peft-<variant>.json.

    python benchmarks/merge_vs_peft.py [--model qwen2.5-1.5b] [--shard-size 400MB] [--variant lora|dora|modules_to_save]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CATALOG = REPO / "src" / "memfit" / "models" / "catalog"
RESULTS = REPO / "benchmarks" / "results"

BUILD = r"""
import json, sys, torch, warnings
warnings.simplefilter("ignore")
from transformers import AutoConfig, AutoModelForCausalLM
from peft import LoraConfig, get_peft_model
catalog, base, adapter, shard, options = sys.argv[1:6]
config = AutoConfig.for_model(**json.load(open(catalog)))
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
model.save_pretrained(base, max_shard_size=shard)
peft_model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", **json.loads(options)))
with torch.no_grad():
    for name, param in peft_model.named_parameters():
        if "lora_B" in name:
            param.normal_(std=0.01)  # non-zero B, or the merge would be a copy
        elif "modules_to_save" in name:
            param.add_(torch.randn_like(param) * 0.01)  # a trained copy differs from the base
peft_model.save_pretrained(adapter)
"""

#: LoraConfig options of each variant (besides r=16, lora_alpha=32, all linear layers).
VARIANTS = {
    "lora": {},
    "dora": {"use_dora": True},
    "modules_to_save": {"modules_to_save": ["embed_tokens", "lm_head"], "ensure_weight_tying": True},
}

MEMFIT = r"""
import sys
from memfit.merge.command import merge_command
merge_command(base=sys.argv[1], adapter=sys.argv[2], out=sys.argv[3])
"""

PEFT = r"""
import sys, torch, warnings
warnings.simplefilter("ignore")
from transformers import AutoModelForCausalLM
from peft import PeftModel
base, adapter, out = sys.argv[1:4]
model = AutoModelForCausalLM.from_pretrained(base, dtype="auto")  # the base's own dtype, as memfit merge keeps it
merged = PeftModel.from_pretrained(model, adapter).merge_and_unload()
merged.save_pretrained(out)
"""

BASELINE_TORCH = "import torch"
BASELINE_STACK = "import torch, safetensors, transformers, peft, memfit.merge.api"

COMPARE = r"""
import json, sys, torch
from pathlib import Path
from safetensors import safe_open
a, b = Path(sys.argv[1]), Path(sys.argv[2])
def where(folder):
    index = folder / "model.safetensors.index.json"
    if index.exists():
        return {k: folder / v for k, v in json.loads(index.read_text())["weight_map"].items()}
    with safe_open(str(folder / "model.safetensors"), "pt") as h:
        return {k: folder / "model.safetensors" for k in h.keys()}
wa, wb = where(a), where(b)
assert sorted(wa) == sorted(wb), "different tensor names"
differ = []
for name in wa:
    with safe_open(str(wa[name]), "pt") as ha, safe_open(str(wb[name]), "pt") as hb:
        if not torch.equal(ha.get_tensor(name), hb.get_tensor(name)):
            differ.append(name)
print(json.dumps({"tensors": len(wa), "differ": differ[:5], "differ_count": len(differ)}))
"""


def timed(code: str, *args: str) -> dict:
    """Run `python -c code args` under /usr/bin/time -v; peak RSS and wall time of that process."""
    cmd = [sys.executable, "-c", code, *args]
    started = time.perf_counter()
    if Path("/usr/bin/time").exists():
        proc = subprocess.run(["/usr/bin/time", "-v", *cmd], capture_output=True, text=True)
        wall_s = time.perf_counter() - started
        match = re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr)
        peak_rss_bytes = int(match.group(1)) * 1024 if match else None
        method = "/usr/bin/time -v (Maximum resident set size)"
    else:  # getrusage of waited-for children: the largest child so far, so run baselines first
        import resource

        proc = subprocess.run(cmd, capture_output=True, text=True)
        wall_s = time.perf_counter() - started
        peak_rss_bytes = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
        method = "resource.getrusage(RUSAGE_CHILDREN).ru_maxrss"
    if proc.returncode != 0:
        raise SystemExit(f"command failed ({proc.returncode}): {' '.join(cmd[:3])}...\n{proc.stderr[-3000:]}")
    return {"peak_rss_bytes": peak_rss_bytes, "wall_s": round(wall_s, 2), "method": method, "stdout": proc.stdout}


def folder_bytes(folder: Path, pattern: str) -> int:
    return sum(p.stat().st_size for p in folder.glob(pattern))


def held_adapter_bytes(path: Path) -> int:
    """Bytes of the adapter tensors memfit holds in memory through a merge: LoRA's A and B and DoRA's
    magnitudes (copies of whole modules are read one at a time, like base tensors)."""
    from safetensors import safe_open

    from memfit.merge.adapter import _split_key

    total = 0
    with safe_open(str(path), "pt") as handle:
        for key in handle.keys():
            if _split_key(key) is not None:
                piece = handle.get_slice(key)
                count = 1
                for n in piece.get_shape():
                    count *= n
                total += count * {"F32": 4, "BF16": 2, "F16": 2}.get(piece.get_dtype(), 4)
    return total


def machine() -> dict:
    import psutil

    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "ram_bytes": psutil.virtual_memory().total,
        "processor": platform.processor() or platform.machine(),
        # other work on the machine slows both merges' wall time (the peaks are per process)
        "load_average_at_end_1_5_15_min": [round(x, 2) for x in os.getloadavg()],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-1.5b", help="catalog config name")
    parser.add_argument("--shard-size", default="400MB", help="max_shard_size for the random base")
    parser.add_argument(
        "--variant",
        default="lora",
        choices=sorted(VARIANTS),
        help="the adapter: plain LoRA, DoRA, or LoRA with trained embed_tokens and lm_head",
    )
    parser.add_argument(
        "--out", default=None, help="results file (default: benchmarks/results/merge_vs_peft[-VARIANT].json)"
    )
    args = parser.parse_args()
    if args.out is None:
        args.out = str(
            RESULTS / ("merge_vs_peft.json" if args.variant == "lora" else f"merge_vs_peft-{args.variant}.json")
        )

    import peft
    import torch
    import transformers

    work = Path(tempfile.mkdtemp(prefix="memfit-merge-bench-", dir="/tmp"))
    try:
        base, adapter = work / "base", work / "adapter"
        started = time.perf_counter()
        timed(
            BUILD,
            str(CATALOG / f"{args.model}.json"),
            str(base),
            str(adapter),
            args.shard_size,
            json.dumps(VARIANTS[args.variant]),
        )
        build_s = time.perf_counter() - started
        shards = sorted(base.glob("*.safetensors"))
        largest_shard_bytes = max(p.stat().st_size for p in shards)
        adapter_bytes = (adapter / "adapter_model.safetensors").stat().st_size
        adapter_held_bytes = held_adapter_bytes(adapter / "adapter_model.safetensors")

        baseline_torch = timed(BASELINE_TORCH)
        baseline_stack = timed(BASELINE_STACK)
        ours = timed(MEMFIT, str(base), str(adapter), str(work / "merged_memfit"))
        theirs = timed(PEFT, str(base), str(adapter), str(work / "merged_peft"))
        same = json.loads(timed(COMPARE, str(work / "merged_memfit"), str(work / "merged_peft"))["stdout"])

        stream_bytes = largest_shard_bytes + adapter_held_bytes
        baseline = baseline_stack["peak_rss_bytes"]
        result = {
            "benchmark": "memfit merge vs PEFT merge_and_unload + save_pretrained",
            "command": f"python benchmarks/merge_vs_peft.py --model {args.model} --shard-size {args.shard_size}"
            + (f" --variant {args.variant}" if args.variant != "lora" else ""),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "machine": machine(),
            "versions": {
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "peft": peft.__version__,
            },
            "model": {
                "catalog_config": f"{args.model}.json",
                "dtype": "bfloat16",
                "base_bytes": folder_bytes(base, "*.safetensors"),
                "shard_count": len(shards),
                "largest_shard_bytes": largest_shard_bytes,
                "adapter": "LoRA r=16, lora_alpha=32, all linear layers, random non-zero B, fp32"
                + "".join(f", {k}={v}" for k, v in VARIANTS[args.variant].items()),
                "adapter_bytes": adapter_bytes,
                "adapter_held_bytes": adapter_held_bytes,
                "build_s": round(build_s, 1),
            },
            "rss_method": ours["method"],
            "baseline": {
                "python_import_torch_rss_bytes": baseline_torch["peak_rss_bytes"],
                "python_import_torch_transformers_peft_memfit_rss_bytes": baseline,
                "note": "peak RSS of an interpreter that only imports these modules; both merges import the second set",
            },
            "memfit": {
                "how": "memfit.merge.command.merge_command (the `memfit merge` command function), own subprocess",
                "peak_rss_bytes": ours["peak_rss_bytes"],
                "peak_rss_minus_baseline_bytes": ours["peak_rss_bytes"] - baseline,
                "wall_s": ours["wall_s"],
            },
            "peft": {
                "how": "AutoModelForCausalLM.from_pretrained(bf16) + PeftModel.from_pretrained + merge_and_unload + save_pretrained, own subprocess",
                "peak_rss_bytes": theirs["peak_rss_bytes"],
                "peak_rss_minus_baseline_bytes": theirs["peak_rss_bytes"] - baseline,
                "wall_s": theirs["wall_s"],
            },
            "outputs_bit_identical": same["differ_count"] == 0,
            "output_comparison": same,
            "ratios": {
                "peft_over_memfit_peak_rss": round(theirs["peak_rss_bytes"] / ours["peak_rss_bytes"], 2),
                "peft_over_memfit_peak_rss_minus_baseline": round(
                    (theirs["peak_rss_bytes"] - baseline) / (ours["peak_rss_bytes"] - baseline), 2
                ),
                "memfit_rss_minus_baseline_over_largest_shard_plus_held_adapter": round(
                    (ours["peak_rss_bytes"] - baseline) / stream_bytes, 2
                ),
                "memfit_over_peft_wall": round(ours["wall_s"] / theirs["wall_s"], 2),
            },
            "goals": {
                "memfit_rss_within_1.2x_shard_plus_held_adapter_plus_baseline": ours["peak_rss_bytes"]
                <= 1.2 * stream_bytes + baseline,
                "memfit_rss_at_least_4x_lower_than_peft": theirs["peak_rss_bytes"] >= 4 * ours["peak_rss_bytes"],
                "memfit_wall_no_worse_than_peft": ours["wall_s"] <= theirs["wall_s"],
            },
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("memfit", "peft", "ratios", "goals", "outputs_bit_identical")}, indent=2))


if __name__ == "__main__":
    main()
