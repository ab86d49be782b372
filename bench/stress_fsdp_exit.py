"""Stress check for a clean exit of finished FSDP2 jobs: runs the FSDP job of tests/test_fsdp.py's fixture
(fsdp_cpu.yaml, 2 gloo ranks, fp32, through tests/probe_train.py) N times in a row and counts exit statuses.
Not part of the test suite: about 20 s a job on 2 cores.

    python bench/stress_fsdp_exit.py --runs 30 [--data-dir ../shared/data/cifar10] [--keep-going]

Prints one line per job and a final `exit statuses: {0: 30}`; exits 1 when any job failed, after writing the
failed jobs' stderr to <work-dir>/run-<i>.stderr.
"""

from __future__ import annotations

import argparse
import collections
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[1] / "tests")]
from conftest import CHECKPOINT_JOB, FSDP_CPU_YAML, PROBE, REPO, SHARED_CIFAR, job_args, script_env  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--data-dir", default=str(SHARED_CIFAR))
    parser.add_argument("--work-dir", default=None,
                        help="where outputs and failed jobs' stderr go (default: a temp dir)")
    parser.add_argument("--keep-going", action="store_true", help="do not stop at the first failed job")
    args = parser.parse_args()
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="fsdp-exit-"))
    statuses: collections.Counter[int] = collections.Counter()
    for i in range(args.runs):
        out = work / f"run-{i}"
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(FSDP_CPU_YAML),
               "--mixed_precision", "no", "--main_process_port", "0", str(PROBE),
               *job_args(args.data_dir, work / "cache", out, *CHECKPOINT_JOB, "--grad-clip", "0", "--log-every", "1")]
        started = time.time()
        result = subprocess.run(cmd, cwd=REPO, env=script_env(), capture_output=True, text=True)
        statuses[result.returncode] += 1
        finished = (out / "summary.json").exists()
        print(f"run {i + 1}/{args.runs}: exit {result.returncode}, "
              f"summary.json {'written' if finished else 'missing'}, "
              f"{time.time() - started:.0f} s", flush=True)
        if result.returncode != 0:
            (work / f"run-{i}.stderr").write_text(result.stderr)
            print(result.stderr[-1500:], flush=True)
            if not args.keep_going:
                break
    print(f"exit statuses: {dict(statuses)}  (outputs in {work})")
    return 0 if set(statuses) == {0} else 1


if __name__ == "__main__":
    sys.exit(main())
