"""Wheels carried to an offline GPU machine, and installing them there without a network.

The GPU machines memfit is measured on come with PyTorch, transformers, PEFT, accelerate and the
rest of memfit's dependencies, but without bitsandbytes (QLoRA, 8-bit optimizers) and pydantic
(memfit's knob validation), and they have no network. :func:`fetch` runs on a machine that reaches
PyPI and downloads exactly the wheels to carry, pinned to the versions installed here, for
CPython 3.12 on x86-64 Linux; :func:`install` runs on the GPU machine and installs the carried
wheels that it lacks (or has older) into a folder of their own, with ``--no-index --no-deps``.
"""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WHEEL_DIR = REPO / ".whl"


class WheelError(ValueError):
    """Fetching or installing the carried wheels cannot go on: one line, naming the option and the fix."""


#: What the GPU machine lacks, and why each is carried.
CARRIED = {
    "bitsandbytes": "QLoRA's 4-bit layers and the 8-bit optimizers (not on the GPU image)",
    "pydantic": "memfit's RunSpec and TrainConfig validation (not on the GPU image)",
    "pydantic-core": "pydantic's compiled core, pinned exactly by pydantic",
    "annotated-types": "a dependency of pydantic",
    "typing-inspection": "a dependency of pydantic",
    "typing-extensions": "pydantic needs a newer one than some PyTorch images have; installed only where older",
}

#: The GPU machine's interpreter and platform (torch wheels for CUDA 13 are manylinux_2_28).
PYTHON_VERSION = "3.12"
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)

#: What the carried wheels may weigh in all: the GPU machine takes 64 MiB of files copied beside the checkout.
MAX_TOTAL_BYTES = 60 * 2**20


def pinned_requirements() -> list[str]:
    """``name==version`` for each carried distribution, at the version installed in this environment."""
    from importlib import metadata

    missing = []
    pins = []
    for name in CARRIED:
        try:
            pins.append(f"{name}=={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            missing.append(name)
    if missing:
        raise WheelError(
            f"--fetch-wheels: {', '.join(missing)} not installed here; install memfit with its test "
            "extras first (pip install -e '.[test]') so that the versions to carry are known"
        )
    return pins


def fetch(dest: Path = WHEEL_DIR) -> list[Path]:
    """Download the carried wheels for the GPU machine into ``dest`` (pip download, binary only)."""
    dest.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        PYTHON_VERSION,
        "--implementation",
        "cp",
        *[arg for p in PLATFORMS for arg in ("--platform", p)],
        "-d",
        str(dest),
        *pinned_requirements(),
    ]
    print(" ".join(command), flush=True)
    subprocess.run(command, check=True)
    wheels = sorted(dest.glob("*.whl"))
    total = sum(w.stat().st_size for w in wheels)
    for wheel in wheels:
        print(f"  {wheel.stat().st_size / 2**20:6.1f} MiB  {wheel.name}")
    print(f"  {total / 2**20:6.1f} MiB  in all ({len(wheels)} wheels, limit {MAX_TOTAL_BYTES / 2**20:.0f} MiB)")
    if total > MAX_TOTAL_BYTES:
        raise WheelError(
            f"--fetch-wheels: {total / 2**20:.1f} MiB of wheels is over the {MAX_TOTAL_BYTES / 2**20:.0f} MiB "
            f"the GPU machine takes; remove old versions from {dest}"
        )
    return wheels


_WHEEL_NAME = re.compile(r"^(?P<name>[^-]+)-(?P<version>[^-]+)-")


def wheel_name_version(path: Path) -> tuple[str, str]:
    """(distribution name normalised with dashes, version) from a wheel's file name."""
    match = _WHEEL_NAME.match(path.name)
    if match is None:
        raise ValueError(f"{path.name} is not a wheel file name")
    return match["name"].replace("_", "-").lower(), match["version"]


def _version_key(version: str) -> tuple:
    return tuple(int(part) if part.isdigit() else 0 for part in re.split(r"[.+-]", version))


def plan_install(wheels: list[Path]) -> tuple[list[Path], list[str]]:
    """(wheels to install, lines saying what is kept): a wheel is installed where its distribution is
    missing or older here; a newer or equal installed one is kept."""
    from importlib import metadata

    chosen, kept = [], []
    for wheel in wheels:
        name, version = wheel_name_version(wheel)
        try:
            installed = metadata.version(name)
        except metadata.PackageNotFoundError:
            chosen.append(wheel)
            continue
        if _version_key(installed) < _version_key(version):
            chosen.append(wheel)
        else:
            kept.append(f"{name} {installed} (installed; carried {version})")
    return chosen, kept


def install(site: Path, wheel_dir: Path = WHEEL_DIR) -> dict:
    """Install the carried wheels this machine lacks into ``site`` (no network, no dependencies).

    Uses pip (``--no-index --no-deps --target``); without pip, unpacks the wheels (plain wheels are
    zip files laid out for site-packages). Returns what was installed and kept, for the results.
    """
    wheels = sorted(wheel_dir.glob("*.whl"))
    if not wheels:
        raise WheelError(
            f"--install: no wheels in {wheel_dir}; on a machine with network run "
            "python benchmarks/gpu_campaign.py --fetch-wheels, and carry the .whl folder along"
        )
    chosen, kept = plan_install(wheels)
    site.mkdir(parents=True, exist_ok=True)
    method = "none needed"
    if chosen:
        command = [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-index",
            "--no-deps",
            "--quiet",
            "--target",
            str(site),
            "--upgrade",
            *map(str, chosen),
        ]
        proc = subprocess.run(command, capture_output=True, text=True)
        method = "pip install --no-index --no-deps --target"
        if proc.returncode != 0:
            if "No module named pip" not in proc.stderr:
                raise WheelError(f"--install: pip failed: {proc.stderr.strip().splitlines()[-1:]}")
            for wheel in chosen:
                with zipfile.ZipFile(wheel) as archive:
                    archive.extractall(site)
            method = "unpacked (no pip)"
    return {"site": str(site), "method": method, "installed": [w.name for w in chosen], "kept": kept}
