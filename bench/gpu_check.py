"""Every GPU-only check of the project in one call (run through bench/gpu_check.sh, which documents the usage).

Parts, one after another, each in its own process with its own time limit, so a failure or a hang in one still
leaves the others' numbers:
  decode      CIFAR-10 decoded once into the cache every later part reads;
  tests       python -m pytest -m cuda: the CUDA cases of the suite (tests/test_cuda.py and the `cuda`
              parametrizations elsewhere);
  race        bench/gpu_race.py: ResNet-18 images/s and MFU, --recipe fast's seconds to 94%, airbench94, the ratio;
  vit         bench/gpu_race.py --parts vit_s: ViT-S images/s and MFU;
  policies    bench/policy_cost.py: --auto-augment's share of a ResNet-18 step (batch 512), and no host sync in it;
  camera      bench/camera_photos.py --gpu: --decode gpu's images/s from 4000 x 3000 JPEGs against one CPU worker;
  vit_memory  bench/fsdp_memory.py --gpus 1: a ViT's memory under DDP/FSDP2, with and without activation
              checkpointing, on one GPU (1 process: what fits, not the sharding ratio).
OUT gets <part>.log for each part, results.json (statuses, seconds, every number) and summary.txt, both rewritten
after each part; at most 8 files, so the device tool brings them all back.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATA_CANDIDATES = (REPO / ".gpu-kit" / "data" / "cifar10", REPO.parent / "shared" / "data" / "cifar10")


@dataclass
class Part:
    name: str
    argv: list[str]
    limit: float  # seconds
    env: dict = field(default_factory=dict)
    results: Path | None = None  # a JSON file the part writes with its numbers


def run_parts(parts: list[Part], out: Path, budget: float, header: dict) -> dict:
    """Runs each part (stdout and stderr into out/<name>.log) within its limit and the budget left; rewrites
    out/results.json and out/summary.txt after each. A part that fails or times out does not stop the next."""
    deadline = time.monotonic() + budget
    results = {**header, "parts": {}}
    for part in parts:
        left = deadline - time.monotonic()
        if left < 5:
            results["parts"][part.name] = {"status": "skipped: the time budget was spent"}
            write_results(out, results)
            continue
        limit = min(part.limit, left)
        started = time.monotonic()
        with open(out / f"{part.name}.log", "w") as log:
            log.write(f"$ {' '.join(part.argv)}\n")
            log.flush()
            proc = subprocess.Popen(part.argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                    env={**os.environ, "PYTHONUNBUFFERED": "1", **part.env})
            try:
                code = proc.wait(timeout=limit)
                status = "passed" if code == 0 else f"failed (exit {code})"
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # the part and everything it started
                proc.wait()
                status = f"timed out after {limit:.0f} s"
        entry = {"status": status, "seconds": round(time.monotonic() - started, 1)}
        if part.results is not None and part.results.is_file():
            entry["numbers"] = json.loads(part.results.read_text())
        if part.name == "tests":
            entry["pytest"] = pytest_outcome((out / "tests.log").read_text())
        results["parts"][part.name] = entry
        write_results(out, results)
    return results


def pytest_outcome(log: str) -> str | None:
    """pytest's last line, e.g. '9 passed, 1 skipped in 95.21s'."""
    found = re.findall(r"^=*\s*(\d+ (?:passed|failed|error|skipped|deselected).*? in [\d.]+s)", log, re.M)
    return found[-1] if found else None


def write_results(out: Path, results: dict) -> None:
    (out / "results.json").write_text(json.dumps(results, indent=2))
    lines = [f"GPU check: {results.get('gpu', '?')}; {results.get('versions', '')}"]
    for name, entry in results["parts"].items():
        seconds = f" in {entry['seconds']} s" if "seconds" in entry else ""
        lines.append(f"{name}: {entry['status']}{seconds}" + (f"; {entry['pytest']}" if entry.get("pytest") else ""))
        for key, value in entry.get("numbers", {}).items():
            lines.append(f"  {key}: {json.dumps(value)}")
    (out / "summary.txt").write_text("\n".join(lines) + "\n")


def cuda_test_files() -> list[str]:
    """The test files with CUDA cases (the others need packages a GPU machine may lack, nbclient or wandb)."""
    return sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").glob("test_*.py")
                  if re.search(r"mark\.cuda|\bDEVICES\b", p.read_text()))


def plan(args) -> list[Part]:
    py, work = sys.executable, Path(args.work)
    data = ["--data-dir", args.data_dir] if args.data_dir else []
    cache = ["--cache-dir", str(work / "decoded")]
    decode = ("import sys; sys.path.insert(0, '.'); from utils.data.decode import load_source; "
              f"load_source({args.data_dir!r}, cache_dir={str(work / 'decoded')!r})")
    test_env = {"TEST_CACHE_DIR": str(work / "decoded"), **({"TEST_DATA_DIR": args.data_dir} if args.data_dir else {})}
    race = [py, "bench/gpu_race.py", *data, *cache, "--work", str(work / "race")]
    return [
        Part("decode", [py, "-c", decode], 120),
        # -v: each test's outcome is in the log as it ends, also when the part runs out of time
        Part("tests", [py, "-m", "pytest", "-m", "cuda", "-v", "-p", "no:cacheprovider", "--basetemp",
                       str(work / "pytest"), *cuda_test_files()], 180, env=test_env),
        Part("race", [*race, "--parts", "resnet18", "fast", "airbench", "--results", str(work / "race.json")], 210,
             results=work / "race.json"),
        Part("vit", [*race, "--parts", "vit_s", "--results", str(work / "vit.json")], 50, results=work / "vit.json"),
        Part("policies", [py, "bench/policy_cost.py", *data, *cache, "--model", "resnet18", "--batch-size", "512"], 45),
        Part("camera", [py, "bench/camera_photos.py", *data, "--images", "32", "--repeats", "2", "--gpu"], 90),
        Part("vit_memory", [py, "bench/fsdp_memory.py", "--gpus", "1", "--models", "vit_s", "vit_b",
                            "--mixed-precision", "bf16", "--batch-size", "256", "--results",
                            str(work / "vit_memory.json")], 60, results=work / "vit_memory.json"),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(prog="bash bench/gpu_check.sh", description=__doc__.splitlines()[0])
    parser.add_argument("out", help="folder for the logs, results.json and summary.txt (created; may exist)")
    parser.add_argument("--data-dir", help="CIFAR-10 parquet folder; default: .gpu-kit/data/cifar10 or "
                        "../shared/data/cifar10 if present, else the Hub")
    parser.add_argument("--work", default="/tmp/gpu_check", help="scratch folder: runs, decoded cache, airbench data")
    parser.add_argument("--budget", type=float, default=470, help="seconds for all parts together")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        sys.exit("bench/gpu_check.sh needs a CUDA GPU, and torch sees none here; nothing was run.")
    if args.data_dir is None:
        args.data_dir = next((str(p) for p in DATA_CANDIDATES if (p / "train-00000-of-00001.parquet").exists()), None)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    Path(args.work).mkdir(parents=True, exist_ok=True)
    header = {"gpu": torch.cuda.get_device_name(0), "data_dir": args.data_dir,
              "versions": f"python {sys.version.split()[0]}, torch {torch.__version__}"}
    print(f"GPU check on {header['gpu']} ({header['versions']}); results in {out.resolve()}", flush=True)
    results = run_parts(plan(args), out, args.budget, header)
    print((out / "summary.txt").read_text(), end="")
    sys.exit(0 if all(p["status"] == "passed" for p in results["parts"].values()) else 1)


if __name__ == "__main__":
    main()
