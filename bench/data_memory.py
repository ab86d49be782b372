"""P6: host memory of the decoded data. Runs a short train_cifar.py job on 2 gloo ranks twice, first with an empty
cache folder (a machine's first process decodes the source into the cache) and then again (every process reads
the cache), on the whole source and on a tenth of it (its first rows: the same job, the same activations), and
samples each worker's memory from /proc/PID/smaps_rollup every 0.2 s:
  - anon: anonymous memory (heap, tensors the process made itself): what grows if a process holds its own copy of
    the data;
  - uss: private pages (anonymous, plus pages of a mapped file that no other process maps);
  - pss: the process's share of every page, shared ones divided among the processes mapping them.
The decoded images are 60,000 x 3 x S x S bytes (2.95 GB at --image-size 128): a process that holds them shows
it in anon, as the difference between the whole source and its tenth. With --memory-limit-mib the launcher and
its workers run in a new memory cgroup with that limit (root, cgroup v2's memory.max or v1's
memory.limit_in_bytes), which counts the page cache too.

    python bench/data_memory.py --data-dir ../shared/data/cifar10 --image-size 128
    python bench/data_memory.py --data-dir ../shared/data/cifar10 --image-size 128 --memory-limit-mib 2048
    python bench/data_memory.py ... --code-dir /tmp/other-checkout   # the same job on another version's scripts
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import header  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
FIELDS = ("Anonymous", "Private_Clean", "Private_Dirty", "Pss")


def smaps(pid: int) -> dict[str, int] | None:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            rows = (line.split() for line in f)
            kib = {r[0].rstrip(":"): int(r[1]) for r in rows if len(r) == 3 and r[0].rstrip(":") in FIELDS}
    except (OSError, ValueError):
        return None
    return {"anon": kib["Anonymous"], "uss": kib["Private_Clean"] + kib["Private_Dirty"], "pss": kib["Pss"]}


def make_cgroup(limit_mib: int) -> tuple[Path, str]:
    """A new memory cgroup with that limit: (its folder, the file that holds its peak usage)."""
    v2 = Path("/sys/fs/cgroup")
    if (v2 / "cgroup.controllers").exists() and "memory" in (v2 / "cgroup.controllers").read_text():
        group = v2 / f"bench-data-memory-{os.getpid()}"
        group.mkdir()
        (group / "memory.max").write_text(str(limit_mib * 2**20))
        (group / "memory.swap.max").write_text("0")
        return group, "memory.peak"
    group = Path("/sys/fs/cgroup/memory") / f"bench-data-memory-{os.getpid()}"
    group.mkdir()
    (group / "memory.limit_in_bytes").write_text(str(limit_mib * 2**20))
    return group, "memory.max_usage_in_bytes"


def tenth(source: Path, folder: Path) -> Path:
    """A parquet folder with the first tenth of each split's rows of the source's (rows are shuffled: a prefix is
    class-balanced)."""
    import pyarrow.parquet as pq

    folder.mkdir()
    for split in ("train", "test"):
        table = pq.read_table(sorted(source.rglob(f"{split}-*.parquet")))
        pq.write_table(table.slice(0, len(table) // 10), folder / f"{split}-00000-of-00001.parquet")
    return folder


def run(code: Path, args, data: Path, cache: Path, out: Path, cgroup: Path | None) -> dict:
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(code / "accelerate_configs" / "cpu.yaml"), "--main_process_port", "0", str(code / "train_cifar.py"),
               "--data-dir", str(data), "--cache-dir", str(cache), "--image-size", str(args.image_size),
               "--model", "resnet18_imagenet", "--train-subset", str(args.train_images), "--eval-subset", "256",
               "--batch-size", "16", "--epochs", "1", "--tracker", "none", "--output-dir", str(out), "--overwrite",
               *args.extra]

    def enter():  # runs in the child before exec: the launcher, and so its workers, join the cgroup
        if cgroup is not None:
            (cgroup / "cgroup.procs").write_text(str(os.getpid()))

    start = time.perf_counter()
    launcher = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                preexec_fn=enter, env={**os.environ, "WANDB_MODE": "disabled"})
    peaks: dict[int, dict[str, int]] = {}
    ranks: dict[int, int] = {}  # pid -> RANK of the launcher's children; their own children are decode workers
    while launcher.poll() is None:
        try:
            for child in psutil.Process(launcher.pid).children():
                if child.pid not in ranks and "RANK" in (env := child.environ()):
                    ranks[child.pid] = int(env["RANK"])
            workers = [p.pid for p in psutil.Process(launcher.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            break
        for pid in workers:
            if (m := smaps(pid)) is not None:
                peaks[pid] = {k: max(v, peaks.get(pid, {}).get(k, 0)) for k, v in m.items()}
        time.sleep(0.2)
    output = launcher.stdout.read()
    seconds = time.perf_counter() - start
    if launcher.returncode != 0:
        print(output[-3000:])
        raise SystemExit(f"the job exited {launcher.returncode}")
    helpers = [peaks[pid]["anon"] for pid in peaks if pid not in ranks]
    workers = [peaks[pid] for pid in sorted(ranks, key=ranks.get) if pid in peaks]
    return {"workers": workers, "helpers": helpers, "seconds": seconds, "output": output}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", required=True, help="CIFAR-10 parquet folder (or an image folder)")
    parser.add_argument("--image-size", type=int, default=128, help="decode at S x S (128: 2.95 GB for CIFAR-10)")
    parser.add_argument("--train-images", type=int, default=256, help="--train-subset of the job (a prefix); 50000: "
                        "one epoch touches every training image")
    parser.add_argument("--memory-limit-mib", type=int, default=None, help="run in a memory cgroup with this limit")
    parser.add_argument("--code-dir", default=str(REPO), help="the checkout whose train_cifar.py runs")
    parser.add_argument("--whole-only", action="store_true", help="only the whole source, not its tenth")
    parser.add_argument("extra", nargs="*", help="more train_cifar.py flags, after --")
    args = parser.parse_args()
    header("P6: host memory of the decoded data, 2 gloo ranks")
    cgroup, peak_file = make_cgroup(args.memory_limit_mib) if args.memory_limit_mib else (None, None)
    work = Path(tempfile.mkdtemp(prefix="data-memory-"))
    sources = {"whole": Path(args.data_dir)}
    if not args.whole_only:
        sources["tenth"] = tenth(Path(args.data_dir), work / "tenth")
    try:
        anon = {}
        for name, data in sources.items():
            cache = work / f"cache-{name}"
            for phase in ("first run (decodes)", "second run (cache)"):
                if cgroup is not None:
                    with open(cgroup / peak_file, "w") as f:  # a new peak for each run (v1; v2 kernels from 6.12)
                        try:
                            f.write("0")
                        except OSError:
                            pass
                result = run(Path(args.code_dir), args, data, cache, work / "out", cgroup)
                workers = result["workers"]
                anon[name, phase] = [w["anon"] / 1024 for w in workers]
                ranks = "; ".join(f"rank {k}: anon {w['anon'] / 1024:,.0f}, uss {w['uss'] / 1024:,.0f}, pss "
                                  f"{w['pss'] / 1024:,.0f}" for k, w in enumerate(workers))
                if result["helpers"]:
                    ranks += (f"; {len(result['helpers'])} decode workers: anon at most "
                              f"{max(result['helpers']) / 1024:,.0f} each")
                group = f"; cgroup peak {int((cgroup / peak_file).read_text()) / 2**20:,.0f} MiB" if cgroup else ""
                print(f"{name} source, {phase}: {result['seconds']:.0f} s; peak MiB per process, {ranks}{group}",
                      flush=True)
            size = sum(f.stat().st_size for f in cache.glob("images-*.safetensors"))
            print(f"{name} source: cache file {size / 2**20:,.0f} MiB" + (
                f"; memory limit {args.memory_limit_mib:,} MiB" if cgroup else ""), flush=True)
        if "tenth" in sources:
            for phase in ("first run (decodes)", "second run (cache)"):
                grown = [f"{a - b:+,.0f}" for a, b in zip(anon["whole", phase], anon["tenth", phase])]
                print(f"{phase}: anon of the whole source minus its tenth, per process (MiB): {', '.join(grown)}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if cgroup is not None:
            cgroup.rmdir()


if __name__ == "__main__":
    main()
