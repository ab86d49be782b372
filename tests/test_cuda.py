"""The CUDA paths, on one GPU: skipped without one (bench/gpu_check.sh runs them with `python -m pytest -m cuda`).

Each job is a real `accelerate launch --config_file accelerate_configs/1gpu.yaml` (bf16) of train_cifar.py or of the
probe around it (tests/probe_train.py says what it records). The transform's CUDA ops are checked against the CPU in
tests/test_data.py (the `cuda` cases there)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import (
    GPU_YAML,
    NEEDS_TORCHCODEC,
    PROBE,
    REPO,
    assert_same_state,
    job_args,
    read_summary,
    run_train,
    script_env,
)
from safetensors.torch import load_file

from utils.launch import make_deterministic
from utils.models import named_model
from utils.tracking import peak_memory_gb

pytestmark = pytest.mark.cuda
ONE_GPU = ["--config_file", str(GPU_YAML)]


def read_probe(out: Path) -> dict:
    return json.loads((out / "probe-rank0.json").read_text())


@pytest.mark.slow
def test_a_one_gpu_bf16_job_with_the_data_on_the_gpu_trains_under_bf16_autocast(cifar_dir, cache_dir, tmp_path):
    out = tmp_path / "on_device"
    result = run_train(job_args(cifar_dir, cache_dir, out, "--model", "resnet18", "--data-on-device",
                                "--train-subset", "4096", "--eval-subset", "1000", "--batch-size", "128",
                                "--epochs", "3", "--tracker", "none"), launch=ONE_GPU, script=PROBE)
    assert result.returncode == 0, result.stderr[-4000:]
    s, probe = read_summary(out), read_probe(out)
    assert (s["world_size"], s["distributed_type"], s["mixed_precision"]) == (1, "NO", "bf16")
    assert set(probe["fc_dtypes"]) == {"torch.bfloat16"}  # what autocast really ran in training forwards
    assert probe["dataset_devices"] == ["cuda", "cuda"]  # both splits live on the GPU: no copy per batch
    assert s["global_step"] == 3 * (4096 // 128) and s["eval_examples"] == 1000
    assert s["eval_top1"] > 25, s["eval_top1"]  # chance is 10% (+- 0.9 on 1,000 images); passes on CPU too
    assert 0.05 < s["peak_memory_gb"] < 40, s["peak_memory_gb"]  # the CUDA allocator's peak, not the host's RSS


@pytest.mark.slow
def test_the_fast_recipe_compiled_on_a_gpu_trains_and_exports_weights_without_the_orig_mod_prefix(cifar_dir, cache_dir,
                                                                                                    tmp_path):
    """--recipe fast as the GPU race runs it (ResNet-9, inductor, channels_last, data on the GPU, flip TTA, batch 512:
    the race then finds these graphs in the compile cache), on 4 steps."""
    out = tmp_path / "compiled"
    result = run_train(job_args(cifar_dir, cache_dir, out, "--recipe", "fast", "--train-subset", "2048",
                                "--eval-subset", "512", "--max-steps", "4", "--tracker", "none"), launch=ONE_GPU)
    assert result.returncode == 0, result.stderr[-4000:]
    s = read_summary(out)
    assert s["wrapper"] == "OptimizedModule" and s["global_step"] == 4 and s["eval_examples"] == 512
    assert (s["model"]["name"], s["config"]["compile"], s["config"]["data_on_device"], s["config"]["tta_flip"]) == \
        ("resnet9", True, True, True)
    assert math.isfinite(s["train_loss"]) and s["mixed_precision"] == "bf16"
    state = load_file(out / "model.safetensors")
    assert not [k for k in state if k.startswith(("_orig_mod.", "module."))]
    assert {t.dtype for t in state.values() if t.is_floating_point()} == {torch.float32}  # bf16 was autocast only
    named_model("resnet9").load_state_dict(state, strict=True)


@pytest.mark.slow
def test_sync_batchnorm_converts_and_trains_on_one_gpu(cifar_dir, cache_dir, tmp_path):
    out = tmp_path / "sync_bn"
    result = run_train(job_args(cifar_dir, cache_dir, out, "--model", "resnet18", "--sync-bn", "--train-subset", "1024",
                                "--eval-subset", "256", "--batch-size", "128", "--max-steps", "8", "--tracker", "none"),
                       launch=ONE_GPU, script=PROBE)
    assert result.returncode == 0, result.stderr[-4000:]
    probe, state = read_probe(out), load_file(out / "model.safetensors")
    assert probe["norm_types"] == ["SyncBatchNorm"]
    counts = {k: int(v) for k, v in state.items() if k.endswith("num_batches_tracked")}
    assert len(counts) == 20 and set(counts.values()) == {8}  # every layer normalised the 8 training batches
    means = [v for k, v in state.items() if k.endswith("running_mean")]
    assert all(m.abs().sum() > 0 for m in means)  # and updated its running statistics (they start at zero)
    assert read_summary(out)["global_step"] == 8


def test_deterministic_settings_on_cuda_keep_the_thread_count_and_set_cublas_workspace(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    threads = torch.get_num_threads()
    try:
        make_deterministic()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        assert torch.are_deterministic_algorithms_enabled() and not torch.backends.cudnn.benchmark
        assert torch.get_num_threads() == threads  # 1 thread is the CPU's rule only
    finally:
        torch.use_deterministic_algorithms(False)


@pytest.mark.slow
def test_two_deterministic_gpu_runs_end_with_the_same_weights(cifar_dir, cache_dir, tmp_path):
    """--deterministic on one GPU, bf16: the same job twice gives bitwise the same trained model."""
    outs = [tmp_path / f"run{i}" for i in range(2)]
    for out in outs:
        result = run_train(job_args(cifar_dir, cache_dir, out, "--model", "resnet18", "--deterministic",
                                    "--train-subset", "1024", "--eval-subset", "256", "--batch-size", "128",
                                    "--max-steps", "6", "--tracker", "none"), launch=ONE_GPU)
        assert result.returncode == 0, result.stderr[-4000:]
    assert_same_state(outs[0] / "model.safetensors", outs[1] / "model.safetensors")
    torch.manual_seed(0)  # the script's --seed 0, before it builds the model
    initial = named_model("resnet18").state_dict()["conv1.weight"]
    assert not torch.equal(load_file(outs[0] / "model.safetensors")["conv1.weight"], initial)  # it trained


def test_peak_memory_on_a_gpu_is_the_allocators_peak():
    device = torch.device("cuda")
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device) / 2**30
    block = torch.empty(2**30, dtype=torch.uint8, device=device)  # 1 GiB
    assert before + 1 <= peak_memory_gb(device) < before + 1.01
    del block


def test_the_doctor_on_one_gpu_reports_its_device_and_the_cuda_and_nccl_versions():
    result = subprocess.run([sys.executable, str(REPO / "doctor.py"), "--timeout", "30"], cwd=REPO, env=script_env(),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    [rank] = [line for line in result.stdout.splitlines() if line.strip().startswith("rank 0 ")]
    nccl = ".".join(map(str, torch.cuda.nccl.version()))
    assert ": cuda" in rank and f"CUDA {torch.version.cuda}, NCCL {nccl}" in rank, rank
    assert result.stdout.splitlines()[-1] == "doctor: OK (1 processes, NO)"


@NEEDS_TORCHCODEC
@pytest.mark.slow
def test_a_one_gpu_job_decoding_on_the_gpu_trains_the_same_steps_as_the_cpu_workers(cifar_dir, tmp_path):
    """--decode gpu on a folder of 256 + 64 upscaled CIFAR-10 JPEGs (96-128 px, every 4th a phone photo with EXIF
    orientation 6), --augment resized-crop at 64 px, resnet8, 2 epochs, fp32: the job records decode "gpu", trains the
    same 16 steps as --decode workers --full-decode on the same files, with a finite loss, and its top-1 on the 64
    test images is within 8 images (12.5 points) of the workers job's (their pixels differ by nvJPEG's IDCT only)."""
    from conftest import write_upscaled_cifar

    photos = write_upscaled_cifar(tmp_path / "photos", cifar_dir, n_train=256, n_test=64, photos=4)
    summaries = {}
    for decode in ("gpu", "workers"):
        out = tmp_path / decode
        result = run_train(["--data-dir", str(photos), "--output-dir", str(out), "--decode", decode, "--full-decode",
                            "--augment", "resized-crop", "--image-size", "64", "--model", "resnet8", "--batch-size",
                            "32", "--epochs", "2", "--tracker", "none"], launch=[*ONE_GPU, "--mixed_precision", "no"])
        assert result.returncode == 0, result.stderr[-4000:]
        summaries[decode] = read_summary(out)
    gpu, workers = summaries["gpu"], summaries["workers"]
    assert (gpu["dataset"]["decode"], workers["dataset"]["decode"]) == ("gpu", "workers")
    assert gpu["global_step"] == workers["global_step"] == 16 and math.isfinite(gpu["train_loss"])
    assert abs(gpu["eval_top1"] - workers["eval_top1"]) <= 12.5, (gpu["eval_top1"], workers["eval_top1"])
