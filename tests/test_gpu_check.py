"""bench/gpu_check.sh and bench/gpu_race.py on a machine without a GPU: what of them runs without CUDA (arguments,
the CUDA guard, the part runner and its result files, FLOP counting). Their readers of a finished run are tested on
a real run in tests/test_tracking.py (test_tensorboard_tracker_...)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import psutil
import pytest
import torch
from conftest import REPO, run_python, script_env

from bench.gpu_check import Part, cuda_test_files, pytest_outcome, run_parts
from bench.gpu_race import datasheet_tflops, time_to_target, train_flops_per_image, without_compile
from utils.models import named_model

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a GPU")


def gpu_check(*args) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(REPO / "bench" / "gpu_check.sh"), *map(str, args)], cwd=REPO,
                          env=script_env(PYTHON=sys.executable), capture_output=True, text=True, timeout=120)


def test_gpu_check_without_an_output_folder_prints_its_usage_and_exits_2():
    result = gpu_check()
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == "bash bench/gpu_check.sh: error: the following arguments are " \
                                                     "required: out"


@pytest.mark.slow
def test_gpu_check_without_cuda_stops_at_once_with_one_line_and_writes_nothing(tmp_path):
    result = gpu_check(tmp_path / "out", "--work", tmp_path / "work")
    assert result.returncode == 1
    assert result.stderr.strip() == "bench/gpu_check.sh needs a CUDA GPU, and torch sees none here; nothing was run."
    assert not (tmp_path / "out").exists() and not (tmp_path / "work").exists()
    race = run_python([str(REPO / "bench" / "gpu_race.py")], script_env(), timeout=120)
    assert race.returncode == 1 and race.stderr.strip() == "bench/gpu_race.py needs a CUDA GPU."


@pytest.mark.slow
def test_a_failed_or_hung_part_leaves_the_others_results_and_a_spent_budget_skips_the_rest(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    numbers = tmp_path / "numbers.json"
    py = sys.executable
    ok = f"import json; print('measuring'); json.dump({{'images_per_sec': 1234.5}}, open({str(numbers)!r}, 'w'))"
    hang = textwrap.dedent(f"""
        import shutil, subprocess, time
        shutil.copy({str(out / 'results.json')!r}, {str(tmp_path / 'seen.json')!r})  # what the earlier parts left
        open({str(tmp_path / 'child.pid')!r}, 'w').write(str(subprocess.Popen(['sleep', '300']).pid))
        print('hanging', flush=True)
        time.sleep(300)""")
    parts = [Part("ok", [py, "-c", ok], 60, results=numbers),
             Part("fails", [py, "-c", "import sys; print('broken', file=sys.stderr); sys.exit(3)"], 60),
             Part("hangs", [py, "-c", hang], 300),  # stopped when the budget is spent: after about 6 s
             Part("late", [py, "-c", "print('never')"], 60)]
    results = run_parts(parts, out, budget=6, header={"gpu": "test"})
    status = {name: entry["status"] for name, entry in results["parts"].items()}
    assert status["ok"] == "passed" and status["fails"] == "failed (exit 3)"
    assert status["hangs"].startswith("timed out after ") and 4 <= results["parts"]["hangs"]["seconds"] < 60
    assert status["late"] == "skipped: the time budget was spent"
    assert results["parts"]["ok"]["numbers"] == {"images_per_sec": 1234.5}
    assert json.loads((out / "results.json").read_text()) == results
    seen = json.loads((tmp_path / "seen.json").read_text())  # written after each part, not only at the end
    assert {k: v["status"] for k, v in seen["parts"].items()} == {"ok": "passed", "fails": "failed (exit 3)"}
    child = int((tmp_path / "child.pid").read_text())  # what the hung part started was stopped with it
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE
    logs = {p.name: p.read_text() for p in out.glob("*.log")}
    assert set(logs) == {"ok.log", "fails.log", "hangs.log"}
    assert "measuring" in logs["ok.log"] and "broken" in logs["fails.log"] and "hanging" in logs["hangs.log"]
    summary = (out / "summary.txt").read_text().splitlines()
    assert summary[1:4] == [f"ok: passed in {results['parts']['ok']['seconds']} s", "  images_per_sec: 1234.5",
                            f"fails: failed (exit 3) in {results['parts']['fails']['seconds']} s"]
    assert len(list(out.iterdir())) <= 8  # the device tool brings back 8 files at most


@pytest.mark.slow
def test_the_cuda_test_files_collect_without_wandb_or_notebook_packages():
    """The GPU machine lacks wandb and nbclient: the files gpu_check hands to pytest must not need them."""
    files = cuda_test_files()
    assert files == ["tests/test_camera.py", "tests/test_cuda.py", "tests/test_data.py", "tests/test_distributed.py",
                     "tests/test_policies.py"]
    blocked = "import sys; [sys.modules.__setitem__(m, None) for m in ('wandb', 'nbclient', 'nbformat')]; "
    collect = run_python(["-c", blocked + "import pytest; sys.exit(pytest.main(sys.argv[1:]))", "--collect-only", "-q",
                          "-m", "cuda", "-p", "no:cacheprovider", *files], script_env(), timeout=300)
    assert collect.returncode == 0, collect.stdout[-3000:]
    assert pytest_outcome(collect.stdout) is None  # --collect-only prints no "passed" line
    assert "24/" in collect.stdout.splitlines()[-1], collect.stdout[-500:]  # 24 CUDA cases selected


def test_pytest_outcome_is_the_last_summary_line():
    log = "....s\n== 3 passed, 1 skipped in 4.20s ==\nnoise\n======= 9 passed, 1 skipped, 2 deselected in 95.21s ====\n"
    assert pytest_outcome(log) == "9 passed, 1 skipped, 2 deselected in 95.21s"
    assert pytest_outcome("1 failed, 8 passed in 3.00s\n") == "1 failed, 8 passed in 3.00s"
    assert pytest_outcome("Traceback: no tests ran\n") is None


def test_training_flops_per_image_count_each_conv_and_linear_three_times_but_the_first_convs_input_gradient():
    """An independent count: 2 x multiply-adds of every Conv2d and Linear from their shapes (forward hooks); training
    = forward + input gradient + weight gradient, each the forward's cost, except that the first convolution's
    input (the images) needs no gradient."""
    model, forward = named_model("resnet18"), []

    def count(module, inputs, output):
        if isinstance(module, torch.nn.Conv2d):
            k = module.kernel_size[0] * module.kernel_size[1] * module.in_channels // module.groups
            forward.append(2 * output.numel() * k)
        else:
            forward.append(2 * inputs[0].shape[0] * module.in_features * module.out_features)

    for m in model.modules():
        if isinstance(m, torch.nn.Conv2d | torch.nn.Linear):
            m.register_forward_hook(count)
    model(torch.randn(4, 3, 32, 32))
    per_image_forward, first_conv = sum(forward) / 4, forward[0] / 4
    assert per_image_forward == pytest.approx(1.1108e9, rel=1e-4)  # ResNet-18, CIFAR stem: 555 M multiply-adds
    assert train_flops_per_image("resnet18") == 3 * per_image_forward - first_conv


def test_time_to_target_sums_training_seconds_up_to_the_first_epoch_at_the_target_with_or_without_epoch_1():
    epochs = [{"seconds": 1.5, "top1": 80.0}, {"seconds": 1.25, "top1": 94.1}, {"seconds": 1.0, "top1": 93.0}]
    assert time_to_target(epochs, 94.0) == 2.75
    assert time_to_target(epochs, 95.0) is None
    assert time_to_target(without_compile(epochs), 94.0) == 1.125 + 1.25  # epoch 1 at the others' median
    assert without_compile(epochs[:1]) == epochs[:1]
    assert datasheet_tflops("NVIDIA H200", None) == 989.4 and datasheet_tflops("NVIDIA A100-SXM4-80GB", None) == 312
    assert datasheet_tflops("Some GPU", None) is None and datasheet_tflops("NVIDIA H200", 500.0) == 500.0
