"""Describe the machine a benchmark ran on, for its results file.

A process that describes the GPU creates a CUDA context on it. A parent that then starts measuring
children would hold that context (hundreds of MiB) for their whole run and distort every device
figure they read, so parents call :func:`describe_in_subprocess` instead.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

#: Libraries whose versions go into every results file (read from package metadata: no import).
LIBRARIES = ("torch", "transformers", "peft", "accelerate", "bitsandbytes", "pydantic", "safetensors", "numpy")


def describe_machine() -> dict:
    """CPU, memory, OS and library versions (and the GPU, when there is one)."""
    import psutil
    import torch

    info = {
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "memory_bytes": psutil.virtual_memory().total,
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    for name in ("transformers", "peft", "bitsandbytes"):
        info[name] = library_version(name)
    return info


def describe_environment() -> dict:
    """Everything a GPU results file needs to be read later: versions, the GPU, memfit's source.

    Creates a CUDA context when there is a GPU: call it in a process of its own.
    """
    import torch

    info = describe_machine()
    info["versions"] = {name: library_version(name) for name in LIBRARIES}
    info["versions"]["python"] = info["python"]
    info["cuda_runtime"] = torch.version.cuda
    info["cudnn"] = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    info["memfit"] = memfit_source()
    info["environment"] = {
        key: os.environ.get(key)
        for key in (
            "PYTORCH_CUDA_ALLOC_CONF",
            "PYTORCH_ALLOC_CONF",
            "CUBLAS_WORKSPACE_CONFIG",
            "TORCH_CUBLASLT_UNIFIED_WORKSPACE",
            "CUDA_MODULE_LOADING",
            "CUDA_VISIBLE_DEVICES",
        )
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        free_bytes, total_bytes = torch.cuda.mem_get_info(0)
        info["gpu_details"] = {
            "name": props.name,
            "total_memory_bytes": int(props.total_memory),
            "mem_get_info_total_bytes": int(total_bytes),
            "used_after_context_bytes": int(total_bytes - free_bytes),
            "compute_capability": f"{props.major}.{props.minor}",
            "multiprocessors": props.multi_processor_count,
            "device_count": torch.cuda.device_count(),
            "driver": nvidia_smi_query("driver_version"),
        }
        info["bitsandbytes_cuda"] = _bitsandbytes_on_cuda()
    return info


def _bitsandbytes_on_cuda() -> str | None:
    """ "ok" when bitsandbytes quantizes a tensor on the GPU (its CUDA library loads), else the error;
    None without bitsandbytes. QLoRA and the 8-bit optimizers need it."""
    if library_version("bitsandbytes") is None:
        return None
    try:
        import bitsandbytes.functional as bnbf
        import torch

        weight = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
        bnbf.quantize_4bit(weight, quant_type="nf4")
        torch.cuda.synchronize()
        return "ok"
    except Exception as err:  # noqa: BLE001 - reported, not raised: LoRA and full runs do not need it
        return f"{type(err).__name__}: {err}".splitlines()[0][:300]


def describe_in_subprocess(env: dict | None = None, timeout_s: float = 120) -> dict:
    """:func:`describe_environment` run in a child process (so that this one never touches CUDA)."""
    code = "import json, sys; sys.path.insert(0, sys.argv[1]); import _machine; print(json.dumps(_machine.describe_environment()))"
    proc = subprocess.run(
        [sys.executable, "-c", code, str(Path(__file__).parent)],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout_s,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"describing the machine failed: {proc.stderr.strip().splitlines()[-1:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_json_child(
    command: list[str], *, prefix: str = "", timeout_s: float | None = None, env: dict | None = None
) -> dict:
    """Run ``command`` (a benchmark's own fresh process: its own CUDA context, allocator and peaks)
    and return the JSON object on its last stdout line that starts with ``prefix`` followed by ``{``,
    with ``wall_seconds`` added. Never raises: a child that times out, fails or prints no result gives
    ``{"status": "timeout" | "error", "error": ..., "wall_seconds": ...}`` (the error is the end of
    its stderr)."""
    import time

    started = time.perf_counter()
    try:
        child = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return {
            "status": "timeout",
            "error": f"stopped after {timeout_s:.0f} s",
            "wall_seconds": round(time.perf_counter() - started, 1),
        }
    wall = round(time.perf_counter() - started, 1)
    results = [line[len(prefix) :] for line in child.stdout.splitlines() if line.startswith(prefix + "{")]
    if child.returncode != 0 or not results:
        tail = [line for line in child.stderr.strip().splitlines() if line.strip()][-12:]
        return {"status": "error", "error": "\n".join(tail) or f"exit {child.returncode}", "wall_seconds": wall}
    return {**json.loads(results[-1]), "wall_seconds": wall}


def write_results(path: Path, data: dict) -> Path:
    """Write a results file as indented JSON, whole or not at all (memfit's own atomic write); its
    folder is made if missing."""
    from memfit.files import write_atomic

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_atomic(path, json.dumps(data, indent=2) + "\n")


def write_labeled_run(path: Path, label: str, run: dict, header: dict) -> dict:
    """Keep ``run`` under ``label`` in the results file ``path``, beside the other labels' runs
    (``before``, ``after``...), with ``header`` (benchmark, command, notes) on top; returns the file's
    contents. A file from before results were kept per label is started afresh."""
    out = json.loads(path.read_text()) if path.exists() else {}
    if "runs" not in out:
        out = {}
    out.update(header)
    out.setdefault("runs", {})[label] = run
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    return out


def library_version(name: str) -> str | None:
    """Installed version of distribution ``name`` (from its metadata, without importing it), or None."""
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def memfit_source() -> dict:
    """Which memfit ran: the git commit when the checkout has one, and always a digest of the source.

    A copy of the working tree sent to another machine may have no ``.git``; the digest (sha256 over
    src/ and benchmarks/, paths and contents) then still names the code, and :func:`source_digest`
    on a checkout tells whether it is the same.
    """
    import memfit

    package = Path(memfit.__file__).resolve().parent
    # The checkout memfit is imported from (src/memfit), which need not be this script's: a
    # benchmark may measure an older checkout put first on PYTHONPATH.
    checkout = package.parents[1]
    out = {"path": str(package), "digest": source_digest(checkout), "commit": None, "dirty": None}
    git = shutil.which("git")
    if git and (checkout / ".git").exists():
        head = subprocess.run([git, "-C", str(checkout), "rev-parse", "HEAD"], capture_output=True, text=True)
        if head.returncode == 0:
            out["commit"] = head.stdout.strip()
            status = subprocess.run(
                [git, "-C", str(checkout), "status", "--porcelain", "--", "src"], capture_output=True, text=True
            )
            out["dirty"] = bool(status.stdout.strip()) if status.returncode == 0 else None
    return out


def source_digest(root: Path = REPO) -> str:
    """sha256 over the relative paths and bytes of the source files under src/ and benchmarks/."""
    digest = hashlib.sha256()
    files = sorted(
        p
        for folder in ("src", "benchmarks")
        for p in (root / folder).rglob("*")
        if p.is_file()
        and p.suffix in (".py", ".json", ".yaml", ".md", ".txt", ".sh")
        and "__pycache__" not in p.parts
        and "results" not in p.relative_to(root).parts
    )
    for path in files:
        digest.update(str(path.relative_to(root)).encode())
        digest.update(b"\0")
        digest.update(path.read_bytes())
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def nvidia_smi_query(field: str) -> str | None:
    """One ``nvidia-smi --query-gpu`` field of GPU 0, or None without nvidia-smi."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    proc = subprocess.run(
        [smi, f"--query-gpu={field}", "--format=csv,noheader,nounits", "-i", "0"], capture_output=True, text=True
    )
    return proc.stdout.strip() or None if proc.returncode == 0 else None


def gpu_processes() -> list[dict] | None:
    """Processes holding GPU memory, as nvidia-smi lists them (pid, used bytes); None without nvidia-smi.

    nvidia-smi reads this from the driver: no CUDA context is created.
    """
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    proc = subprocess.run(
        [smi, "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"], capture_output=True, text=True
    )
    if proc.returncode != 0:
        return None
    rows = []
    for line in proc.stdout.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit() and parts[1].isdigit():
            rows.append({"pid": int(parts[0]), "used_bytes": int(parts[1]) * 2**20})
    return rows


def process_gpu_bytes(pid: int | None = None) -> int | None:
    """Device memory nvidia-smi shows for process ``pid`` (this one by default; MiB granularity), or None."""
    rows = gpu_processes()
    if rows is None:
        return None
    pid = os.getpid() if pid is None else pid
    found = [r["used_bytes"] for r in rows if r["pid"] == pid]
    return found[0] if found else None


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"
