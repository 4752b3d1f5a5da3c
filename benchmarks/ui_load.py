"""A bounded load test of `memfit ui`: mixed requests against a started server, no 5xx, memory flat.

Starts the real server (``python -m memfit ui --port 0``, this interpreter, a private empty
MEMFIT_CACHE), drops a tiny model's config.json on it, then sends the same mix of requests twice,
each time from several threads at once: valid plans (of the dropped model at several lengths and
of a catalog model), memory against sequence length, the form and the page's files, exports,
explanations, and invalid ones (a bad knob, an unknown option, a server path as the model, a
forgotten upload, a file over the size limit, a body that is not JSON, a search without a card).
The first pass warms the server; the server's RSS after it and after the second pass tell whether
memory grows with requests. A search (fit) is in each pass too; a search past the server's limit
answers 429 (a client error, counted).

    python benchmarks/ui_load.py                # 200 requests a pass, writes benchmarks/results/ui_load.json
    python benchmarks/ui_load.py --total 40     # what tests/ui/test_load.py runs
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

TINY = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 1024,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 2,
    "_name_or_path": "tiny",
}
#: A growth of the server's RSS from after the warm-up pass to after the load pass above this is a leak.
MAX_GROWTH_BYTES = 64 * 2**20


def request(url: str, method: str = "GET", body: bytes | None = None) -> tuple[int, bytes]:
    """(status, body) of one request; a refused or broken connection is status 0."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=body, method=method), timeout=600) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return 0, b""


def mix(base: str, model: str, total: int) -> list[tuple[str, str, str, bytes | None]]:
    """``total`` requests (kind, method, url, body): valid and invalid ones interleaved, one search."""
    big = b" " * (2**20 + 1)
    plan = json.dumps(
        {
            "model": "tiny",
            "spec": {
                "method": "lora",
                "rank": 16,
                "precision": "bf16",
                "checkpointing": "on",
                "batch_size": 1,
                "seq_len": 64,
                "grad_accum": 1,
                "optimizer": "adamw",
            },
            "details": {},
            "fits": False,
        }
    ).encode()
    kinds = [
        ("valid", "GET", f"{base}api/plan?model={model}&seq_len=64", None),
        ("valid", "GET", f"{base}api/plan?model={model}&seq_len=128&gpu=rtx-4090", None),
        ("valid", "GET", f"{base}api/plan?model={model}&seq_len=256&method=full&optimizer=sgd", None),
        ("valid", "GET", f"{base}api/plan?model=smollm2-135m&seq_len=256", None),
        ("valid", "GET", f"{base}api/context?model={model}&seq_len=256&budget=300MiB", None),
        ("valid", "GET", f"{base}api/form", None),
        ("valid", "GET", f"{base}", None),
        ("valid", "GET", f"{base}static/vendor/chart.umd.min.js", None),
        ("valid", "GET", f"{base}api/export?command=plan&model={model}&seq_len=64", None),
        ("valid", "POST", f"{base}api/explain", plan),
        ("valid", "POST", f"{base}api/model?filename=config.json", json.dumps(TINY).encode()),
        ("invalid", "GET", f"{base}api/plan?model={model}&rank=0&seq_len=abc", None),
        ("invalid", "GET", f"{base}api/plan?model={model}&seqlen=64", None),
        ("invalid", "GET", f"{base}api/plan?model=/etc/passwd", None),
        ("invalid", "GET", f"{base}api/plan?model=upload-000000000000", None),
        ("invalid", "GET", f"{base}api/plan?model=llama-3.1-8bb", None),
        ("invalid", "POST", f"{base}api/model?filename=config.json", big),
        ("invalid", "POST", f"{base}api/model?filename=config.json", b"{not json"),
        ("invalid", "POST", f"{base}api/explain", b"{not json"),
        ("invalid", "GET", f"{base}api/fit?model={model}", None),
    ]
    chosen = [kinds[i % len(kinds)] for i in range(total - 1)]
    chosen.insert(
        total // 2,
        ("valid", "GET", f"{base}api/fit?model={model}&budget=1GiB&batch_size=2&seq_len=64&method=lora", None),
    )
    return chosen


def run_pass(base: str, model: str, total: int, threads: int) -> dict:
    """Send :func:`mix` from ``threads`` threads at once; statuses by kind, 5xx counted."""
    requests = mix(base, model, total)
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=threads) as pool:
        statuses = list(pool.map(lambda r: request(r[2], r[1], r[3])[0], requests))
    by_kind: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for (kind, _, _, _), status in zip(requests, statuses):
        by_kind[kind][str(status)] += 1
    return {
        "requests": total,
        "seconds": round(time.perf_counter() - started, 2),
        "statuses": {kind: dict(sorted(counts.items())) for kind, counts in sorted(by_kind.items())},
        "server_errors": sum(1 for s in statuses if s >= 500 or s == 0),
        "valid_not_ok": sum(
            1 for (kind, _, _, _), s in zip(requests, statuses) if kind == "valid" and s not in (200, 429)
        ),
        "invalid_not_4xx": sum(
            1 for (kind, _, _, _), s in zip(requests, statuses) if kind == "invalid" and not 400 <= s < 500
        ),
    }


def load_test(total: int = 200, threads: int = 8, env: dict | None = None) -> dict:
    """Start a server, warm it with one pass, load it with another; the two passes and the RSS."""
    import psutil

    with tempfile.TemporaryDirectory(prefix="memfit-ui-load-") as cache:
        server = subprocess.Popen(
            [sys.executable, "-m", "memfit", "ui", "--port", "0"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "MEMFIT_CACHE": cache, **(env or {})},
        )
        try:
            base = server.stdout.readline().split()[2]
            status, body = request(f"{base}api/model?filename=config.json", "POST", json.dumps(TINY).encode())
            assert status == 200, body
            model = json.loads(body)["model"]
            process = psutil.Process(server.pid)
            warm = run_pass(base, model, total, threads)
            rss_warm = process.memory_info().rss
            loaded = run_pass(base, model, total, threads)
            rss_loaded = process.memory_info().rss
            alive = server.poll() is None and request(f"{base}api/status")[0] == 200
        finally:
            server.terminate()
            try:
                _, log = server.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()
                _, log = server.communicate()
    return {
        "warm_up": warm,
        "load": loaded,
        "rss_after_warm_up_bytes": rss_warm,
        "rss_after_load_bytes": rss_loaded,
        "rss_growth_bytes": rss_loaded - rss_warm,
        "max_growth_bytes": MAX_GROWTH_BYTES,
        "server_alive_after": alive,
        "tracebacks_in_server_log": log.count("Traceback"),
    }


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _machine import describe_machine, memfit_source, write_labeled_run

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--total", type=int, default=200, help="requests a pass (one warm-up pass, one load pass)")
    parser.add_argument("--threads", type=int, default=8, help="requests in flight at once")
    parser.add_argument("--label", default="after")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "ui_load.json")
    args = parser.parse_args()
    load_before = os.getloadavg()
    result = load_test(args.total, args.threads)
    run = {
        "memfit": memfit_source(),
        "machine": describe_machine(),
        "threads": args.threads,
        "load_average_1_5_15_min": {
            "start": [round(x, 2) for x in load_before],
            "end": [round(x, 2) for x in os.getloadavg()],
        },
        **result,
    }
    write_labeled_run(
        args.out,
        args.label,
        run,
        {
            "benchmark": "ui_load",
            "command": f"python benchmarks/ui_load.py --total {args.total} --threads {args.threads}",
            "notes": (
                "two passes of the same mix of valid and invalid requests against `memfit ui --port 0` (a private empty "
                "plan cache), each from several threads at once; RSS is the server process's after each pass."
            ),
        },
    )
    print(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
