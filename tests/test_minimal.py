"""train_minimal.py: the same training as train_cifar.py (so the two cannot drift apart), exact resume at an epoch
boundary, and outputs a plain model loads."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from conftest import CPU_YAML, REPO, assert_same_state, read_summary, run_train, script_env
from safetensors.torch import load_file

import compare_runs
import evaluate_checkpoint
from utils.models import named_model

RECORD = REPO / "tests" / "record_losses.py"
FP32_TWO_RANKS = ["--config_file", str(CPU_YAML)]  # cpu.yaml is fp32
# 64 images, 8 per rank per micro-step, 2 micro-steps per optimizer step: 4 micro-steps and 2 optimizer steps per
# epoch on each of 2 ranks; 2 epochs (warmup = the first epoch, then cosine).
JOB = ["--train-subset", "64", "--eval-subset", "48", "--batch-size", "8", "--grad-accum", "2", "--epochs", "2",
       "--lr", "0.2", "--seed", "3", "--tracker", "none"]
# The same job in train_cifar.py: its defaults that the minimal script does not have, switched off or on.
CIFAR_EQUIVALENT = ["--model", "resnet18", "--no-channels-last", "--grad-clip", "0", "--scale-lr"]


def run_recorded(script: str, out: Path, args: list[str], env: dict) -> tuple[list[list[float]], dict]:
    result = run_train([str(REPO / script), *args, "--output-dir", str(out)], launch=FP32_TWO_RANKS, env=env,
                       script=RECORD)
    assert result.returncode == 0, result.stderr[-3000:]
    losses = [json.loads((out / f"losses-rank{r}.json").read_text()) for r in range(2)]
    return losses, read_summary(out)


@pytest.mark.slow
def test_minimal_script_trains_exactly_like_train_cifar_and_resumes_exactly(cifar_dir, cache_dir, tmp_path):
    """`train_minimal.py` and `train_cifar.py --no-channels-last --grad-clip 0 --scale-lr` log the same loss at
    every micro-step to 1e-6 and end with bitwise-equal weights; the minimal script resumes an epoch checkpoint to
    the same weights."""
    # The minimal script has no --cache-dir: with a read-only data folder it caches under $XDG_CACHE_HOME, pointed
    # here at the session's cache so the data is decoded once.
    (tmp_path / "xdg").mkdir()
    (tmp_path / "xdg" / "accelerate-cifar").symlink_to(cache_dir, target_is_directory=True)
    env = script_env(XDG_CACHE_HOME=str(tmp_path / "xdg"))
    data = ["--data-dir", str(cifar_dir)]
    minimal_losses, minimal = run_recorded("train_minimal.py", tmp_path / "minimal",
                                           [*data, *JOB, "--tracker", "wandb"], env)
    cifar_losses, cifar = run_recorded("train_cifar.py", tmp_path / "cifar",
                                       [*data, "--cache-dir", str(cache_dir), *JOB, *CIFAR_EQUIVALENT], env)

    # Same job: 2 epochs x 4 micro-steps on each rank, the same loss at every one, the same final weights.
    assert [len(rank) for rank in minimal_losses] == [8, 8]
    for rank in range(2):
        assert torch.allclose(torch.tensor(minimal_losses[rank]), torch.tensor(cifar_losses[rank]), rtol=0, atol=1e-6)
    assert_same_state(tmp_path / "minimal" / "model.safetensors", tmp_path / "cifar" / "model.safetensors")
    assert minimal["world_size"] == cifar["world_size"] == 2
    assert minimal["effective_lr"] == cifar["effective_lr"] == 0.2 * 32 / 128  # linear scaling from batch 128
    assert minimal["eval_examples"] == cifar["eval_examples"] == 48
    assert minimal["eval_top1"] == cifar["eval_top1"]
    assert minimal["train_images_per_sec"] > 0

    # The exported weights have no 'module.' prefix: they load strictly into a plain model, and the collection's
    # tools read the minimal script's outputs as they read train_cifar.py's.
    weights = load_file(tmp_path / "minimal" / "model.safetensors")
    assert not [k for k in weights if k.startswith("module.")]
    named_model("resnet18").load_state_dict(weights, strict=True)
    evaluated = evaluate_checkpoint.main([str(tmp_path / "minimal" / "model.safetensors"), *data, "--cache-dir",
                                          str(cache_dir)])  # the model and test subset from summary.json
    assert (evaluated["model"]["name"], evaluated["examples"], evaluated["top1"]) == \
        ("resnet18", 48, minimal["eval_top1"])
    kept = yaml.safe_load((tmp_path / "minimal" / "config.yaml").read_text())  # its flags, for --config
    assert kept == {k: minimal["config"][k] for k in kept} and (kept["epochs"], kept["lr"]) == (2, 0.2)
    [run] = compare_runs.load(str(tmp_path / "minimal"))  # its offline W&B run, in its output folder
    assert run.metric(*compare_runs.COLUMNS["final top-1 %"]) == minimal["eval_top1"]
    assert run.metric(*compare_runs.COLUMNS["epochs"]) == 2 and run.config["effective_lr"] == 0.05
    per_epoch = [sum(minimal_losses[0][e:e + 4] + minimal_losses[1][e:e + 4]) / 8 for e in (0, 4)]  # both ranks
    assert [y for _, y in compare_runs.points(run, "epoch", "train/epoch_loss")] == pytest.approx(per_epoch, rel=1e-5)

    # Resume at the epoch boundary: from the first epoch's checkpoint, the second epoch again, to the same weights.
    again = tmp_path / "again"
    (again / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "minimal" / "checkpoints" / "checkpoint_0", again / "checkpoints" / "checkpoint_0")
    resumed_losses, _ = run_recorded("train_minimal.py", again, [*data, *JOB, "--resume", "auto"], env)
    assert [len(rank) for rank in resumed_losses] == [4, 4]
    for rank in range(2):
        assert resumed_losses[rank] == minimal_losses[rank][4:]
    assert_same_state(again / "model.safetensors", tmp_path / "minimal" / "model.safetensors")
    # Resuming the finished run (a requeued job) trains nothing and reports the same test accuracy.
    nothing, finished = run_recorded("train_minimal.py", again, [*data, *JOB, "--resume", "auto"], env)
    assert nothing == [[], []] and (finished["eval_examples"], finished["eval_top1"]) == (48, minimal["eval_top1"])


def test_minimal_script_refuses_to_start_over_an_earlier_run(cifar_dir, tmp_path):
    out = tmp_path / "out"
    (out / "checkpoints" / "checkpoint_0").mkdir(parents=True)
    (out / "checkpoints" / "checkpoint_0" / "model.safetensors").write_bytes(b"earlier")
    result = run_train([*["--data-dir", str(cifar_dir)], *JOB, "--output-dir", str(out)],
                       script=REPO / "train_minimal.py")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"error: {out} holds checkpoints of an earlier run; pass --resume or use another --output-dir."]
    assert (out / "checkpoints" / "checkpoint_0" / "model.safetensors").read_bytes() == b"earlier"


@pytest.mark.slow
def test_minimal_script_refuses_an_fsdp_launch_config_instead_of_running_ddp_silently(cifar_dir, tmp_path):
    result = run_train(["--data-dir", str(cifar_dir), *JOB, "--output-dir", str(tmp_path / "out")],
                       launch=["--config_file", str(REPO / "accelerate_configs" / "fsdp_cpu.yaml")],
                       script=REPO / "train_minimal.py")
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: train_minimal.py runs DDP; for an FSDP launch config use train_cifar.py."]
    assert not (tmp_path / "out" / "checkpoints").exists()
