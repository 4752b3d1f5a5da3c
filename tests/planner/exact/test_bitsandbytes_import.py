"""bitsandbytes is imported only by plans that use it, and the order of plans in a process changes nothing.

Each scenario runs in a process of its own: whether bitsandbytes is imported is per process, and this
test session may have imported it already.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import memfit

pytestmark = pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="needs bitsandbytes")

SRC = Path(memfit.__file__).resolve().parents[1]

LORA = dict(method="lora", seq_len=64, batch_size=2)
FULL = dict(method="full", seq_len=64)
QLORA = dict(method="qlora", seq_len=64, batch_size=2)
FULL_8BIT = dict(method="full", seq_len=64, optimizer="paged-adamw8bit")

# Plans the tiny model with each configuration in turn; prints, per plan, its JSON (the time it
# took left out) and whether bitsandbytes had been imported once it was made.
SCRIPT = """
import json, sys
import memfit
config, runs = json.loads(sys.argv[1]), json.loads(sys.argv[2])
out = []
for knobs in runs:
    plan = memfit.plan(config, **knobs).to_dict()
    plan["details"].pop("plan_seconds")
    out.append([plan, "bitsandbytes" in sys.modules and sys.modules["bitsandbytes"] is not None])
print(json.dumps(out))
"""


def _plans_in_one_process(config: dict, runs: list[dict]) -> list[tuple[dict, bool]]:
    env = dict(os.environ, PYTHONPATH=str(SRC), MEMFIT_PLAN_CACHE="0")
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps(config), json.dumps(runs)],
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )  # a hang guard only
    assert done.returncode == 0, done.stderr[-3000:]
    return [tuple(row) for row in json.loads(done.stdout.strip().splitlines()[-1])]


def test_bitsandbytes_only_where_needed_and_order_changes_nothing(tiny_llama):
    # LoRA and full first: no bitsandbytes; then QLoRA and an 8-bit optimizer import it and work.
    light_first = _plans_in_one_process(tiny_llama, [LORA, FULL, QLORA, FULL_8BIT])
    assert [loaded for _, loaded in light_first] == [False, False, True, True]
    # The other way round: bitsandbytes imported by the first plan, as it always was.
    heavy_first = _plans_in_one_process(tiny_llama, [QLORA, FULL_8BIT, LORA, FULL])
    assert all(loaded for _, loaded in heavy_first)
    plans_a = [plan for plan, _ in light_first]
    plans_b = [plan for plan, _ in heavy_first]
    assert plans_a == plans_b[2:] + plans_b[:2]
    # QLoRA made PEFT's 4-bit LoRA layers after a LoRA plan hid bitsandbytes from PEFT.
    qlora = plans_a[2]
    assert qlora["spec"]["method"] == "qlora" and qlora["categories"]["weights"] < plans_a[0]["categories"]["weights"]
