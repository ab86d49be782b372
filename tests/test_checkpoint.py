"""Checkpoints, exact resume and faults, on 2 gloo ranks: kill -9, SIGTERM/SIGUSR1, corrupt checkpoints,
a dead peer, a NaN loss; and bad resume input.

The 2-rank job (cpu.yaml): 256 images, micro-batch 16, global batch 32 -> 8 optimizer steps per epoch, 2 epochs, a
checkpoint and an evaluation every 3 steps (3, 6, 9, 12, 15) and at each epoch end (8, 16), the weights' EMA in every
checkpoint; augmentation on (keyed by sample, so the
same on any process count); fp32 on CPU, so "exact" means bitwise. A kill -9 resumes on the other process count:
2 -> 1 process (2 accumulation steps) and 1 -> 2, each ending on the uninterrupted 2-rank job's parameters.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import time
from pathlib import Path

import conftest
import psutil
import pytest
import torch
from accelerate.commands.launch import launch_command_parser
from conftest import (
    CHECKPOINT_JOB,
    CPU_YAML,
    PROBE,
    REPO,
    Forked,
    assert_same_parameters,
    assert_same_state,
    kill_job,
    read_summary,
    run_python,
    run_train,
    script_env,
    small_tmpfs,
    start,
    wait_for_checkpoint,
    workers,
    write_cifar_dir,
)
from safetensors.torch import load_file
from test_docs import doc_commands

import compare_runs

TWO_RANKS = ["--config_file", str(CPU_YAML)]  # fp32 (cpu.yaml's): exact means bitwise
EVALUATED_AT = [3, 6, 8, 9, 12, 15, 16]  # --eval-every-steps 3 within each 8-step epoch, and each epoch's end
EVALUATION_COUNTERS = ["best_eval_ema_top1", "best_checkpoint", "evals_without_gain", "eval_top1", "eval_ema_top1"]
ONE_PROCESS = ["--num_processes", "1"]


def job_args(cifar_dir, cache_dir, out, *extra):
    return conftest.job_args(cifar_dir, cache_dir, out, *CHECKPOINT_JOB, *extra)


def test_checkpoints_are_rotated_keeping_the_last_two_and_the_best(reference):
    s = read_summary(reference)
    assert s["global_step"] == 16 and s["epochs_completed"] == 2
    kept = sorted(p.name for p in (reference / "checkpoints").iterdir())
    assert kept == sorted({"step-00000015", "step-00000016", s["best_checkpoint"]})
    state = json.loads((reference / "checkpoints" / "step-00000015" / "trainer_state.json").read_text())
    assert state["progress"]["epoch"] == 1 and state["progress"]["batches_in_epoch"] == 7  # mid-epoch position
    assert state["config"]["model"] == "resnet8" and state["world_size"] == 2
    assert state["batch"] == {"micro": 16, "processes": 2, "accumulation": 1, "halvings": 0} and state["format"] == 3
    assert {"model.safetensors", "optimizer.bin", "random_states_0.pkl", "random_states_1.pkl",
            "ema.safetensors"} <= set(state["files"])
    assert not any("rank" in name for name in state["files"])  # no per-rank augmentation stream any more


def held_after(step: int) -> dict:
    """The environment of a probed job (--log-every 1) that _kill_after_checkpoint(..., step) kills: every rank waits
    at its optimizer step `step` + 2 until its launcher is gone (which kill_job kills last)."""
    return script_env(PROBE_HOLD_AT_STEP=str(step + 2))


def _kill_after_checkpoint(out: Path, proc: Forked, step: int) -> None:
    """Waits for checkpoint `step` and for the job to log the step after it (as a real job would before it dies: the
    tracker and history.jsonl, whole), then kills every process of the job (the workers run in sessions of their
    own), as a node loss would. Started with held_after(step), the job cannot log further before the kill, however
    busy the machine."""
    wait_for_checkpoint(out, proc, step)
    _kill_once_logged(out, proc, step + 1)
    assert logged_steps(out)[-1] == step + 1 and not (out / "summary.json").exists()


def _kill_once_logged(out: Path, proc: Forked, step: int) -> None:
    """Waits for history.jsonl's line of step `step`, whole (the tracker has it then), then kills the job (kill_job)."""
    deadline = time.time() + 300
    while step not in logged_steps(out):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.time() < deadline, f"step {step} was not logged (logged: {logged_steps(out)})"
        time.sleep(0.01)
    kill_job(proc)


def logged_steps(out: Path) -> list[int]:
    """The steps of history.jsonl's whole lines, in order."""
    text = (out / "history.jsonl").read_text() if (out / "history.jsonl").is_file() else ""
    return [json.loads(line)["_step"] for line in text[:text.rfind("\n") + 1].splitlines()]


def test_kill_9_mid_epoch_on_two_processes_then_resume_on_one_matches_the_uninterrupted_run(reference, cifar_dir,
                                                                                            cache_dir, tmp_path):
    """A 2-rank job killed with kill -9 mid-epoch and resumed on 1 process ends with the uninterrupted run's
    trainable parameters and EMA bitwise (fp32, `--deterministic`), each step logged once (to the tracker and to
    history.jsonl, which holds every number the tracker got, line for line), and logs what the uninterrupted run
    logs: the same keys at the same steps, each training value (train/*: losses, the interrupted epoch's mean loss
    included, learning rates, gradient norms) within 1e-5 (relative) of its value there. Timings and memory aside;
    the evaluations differ, by the BatchNorm statistics one process gathers from every micro-batch."""
    out = tmp_path / "killed"
    proc = start(job_args(cifar_dir, cache_dir, out, "--log-every", "1"), TWO_RANKS, script=PROBE, env=held_after(3))
    _kill_after_checkpoint(out, proc, 3)
    first_life = [step for step, _ in map(json.loads, (out / "probe-logs-rank0.jsonl").read_text().splitlines())]
    result = run_train(job_args(cifar_dir, cache_dir, out, "--log-every", "1", "--resume", "auto"),
                       launch=ONE_PROCESS, script=PROBE)
    assert result.returncode == 0, result.stderr[-4000:]
    s = read_summary(out)
    resumed_at = int(Path(s["resumed_from"]).name[5:])
    assert resumed_at % 8 != 0, "the kill should land mid-epoch (8 steps per epoch)"
    assert ("resuming on 1 process(es), the checkpoint's run had 2: accumulation 1 -> 2 micro-batches of 16 per "
            "step, global batch 32") in result.stdout
    epoch, images = resumed_at // 8 + 1, resumed_at % 8 * 32  # the position, in this run's terms
    assert f"epoch {epoch} after {images} of its images, step {resumed_at}" in result.stdout
    assert s["world_size"] == 1 and s["grad_accum"] == 2 and s["global_batch"] == 32
    logs = [json.loads(line) for line in (out / "probe-logs-rank0.jsonl").read_text().splitlines()]
    assert max(first_life) > resumed_at  # the first life logged steps it did not checkpoint ...
    assert [step for step, values in logs if "train/loss" in values] == list(range(1, 17))  # ... logged once each
    assert [step for step, values in logs if "eval/ema_top1" in values] == EVALUATED_AT  # also each evaluation
    assert [step for step, _ in logs] == sorted(step for step, _ in logs)  # the tracker's step never goes back
    history = [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines()]
    assert [[row.pop("_step"), row] for row in history if row.pop("_timestamp")] == logs  # what the tracker got
    assert s["global_step"] == 16 and s["train_images_seen"] == 16 * 32  # the first life's images counted too
    assert_same_parameters(out, reference)  # BatchNorm's running statistics: 1 process saw every micro-batch
    assert_same_parameters(out, reference, file="model_ema.safetensors")  # the EMA resumed from the step-3 checkpoint
    ours, theirs = logged_values(out), logged_values(reference)
    assert ours.keys() == theirs.keys() and "train/epoch_loss" in ours[8]  # the interrupted epoch's end
    for step, values in theirs.items():
        assert values.keys() == ours[step].keys(), step
        assert all(ours[step][k] == pytest.approx(v, rel=1e-5, abs=1e-7) for k, v in values.items()
                   if k.startswith("train/")), step


def test_kill_9_during_an_evaluation_then_resume_logs_that_evaluation_once_as_the_uninterrupted_run_does(
        reference, cifar_dir, cache_dir, tmp_path):
    """A 2-rank job killed with kill -9 during its evaluation at step 6 (after step 6's training log, before that
    evaluation's checkpoint) and resumed from checkpoint 3 on 2 ranks logs what the uninterrupted run logs: each
    step's training numbers once, each evaluation once at its step, the one at step 6 included, with the
    uninterrupted run's values (the same process count: equal); history.jsonl holds what the tracker got, line for
    line, and compare_runs.py draws every evaluation."""
    out = tmp_path / "killed"
    # evaluate() runs twice per evaluation (the weights, then the EMA): its third call starts the evaluation at step 6
    proc = start(job_args(cifar_dir, cache_dir, out), TWO_RANKS, script=PROBE, env=script_env(PROBE_HOLD_AT_EVAL="3"))
    _kill_once_logged(out, proc, 6)  # held there until the launcher is gone
    assert logged_steps(out) == [1, 2, 3, 3, 4, 5, 6] and not (out / "checkpoints" / "step-00000006").exists()
    result = run_train(job_args(cifar_dir, cache_dir, out, "--resume", "auto"), launch=TWO_RANKS, script=PROBE)
    assert result.returncode == 0, result.stderr[-4000:]
    assert Path(read_summary(out)["resumed_from"]).name == "step-00000003"
    logs = [json.loads(line) for line in (out / "probe-logs-rank0.jsonl").read_text().splitlines()]  # both lives
    assert [step for step, values in logs if "train/loss" in values] == list(range(1, 17))
    assert [step for step, values in logs if "eval/ema_top1" in values] == EVALUATED_AT  # 6 too, once
    history = [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines()]
    assert [[row.pop("_step"), row] for row in history if row.pop("_timestamp")] == logs  # what the tracker got
    ours, theirs = logged_values(out), logged_values(reference)
    assert ours.keys() == theirs.keys() and all(ours[step].keys() == theirs[step].keys() for step in theirs)
    evaluated = [{k: v for k, v in values.items() if k.startswith("eval/")} for values in (ours[6], theirs[6])]
    assert evaluated[0] == evaluated[1] and "eval/top1" in evaluated[0]
    [run] = compare_runs.load(str(out))
    line = compare_runs.figure([run], "_step", ("eval/top1",), "eval top-1 (%)", by_group=False).axes[0].lines[0]
    assert list(line.get_xdata()) == EVALUATED_AT
    assert list(line.get_ydata()) == [theirs[step]["eval/top1"] for step in EVALUATED_AT]


def test_a_run_without_its_summary_yet_compares_by_its_flags_and_its_logged_numbers_so_far(reference, tmp_path,
                                                                                          capsys):
    """A run still training, or stopped before its end, has no summary.json yet (the reference run's folder without
    it): compare_runs.py reads its flags from its config.yaml and its numbers so far from its history.jsonl. Its row
    gives the summary's final top-1 and epochs, the best logged top-1, and "-" for the wall time it has not logged;
    its eval top-1 curve is every logged eval/top1; one line says these are the numbers so far."""
    import compare_runs

    run = tmp_path / "running"
    shutil.copytree(reference, run, ignore=shutil.ignore_patterns("checkpoints", "*.safetensors"))
    s = json.loads((run / "summary.json").read_text())
    (run / "summary.json").unlink()
    top1 = [row["eval/top1"] for row in map(json.loads, (run / "history.jsonl").read_text().splitlines())
            if "eval/top1" in row]
    assert compare_runs.main([str(run), "--plots", str(tmp_path / "plots")]) == 0
    lines = capsys.readouterr().out.splitlines()
    row = next(line.split() for line in lines if line.startswith(str(run)))
    assert row[2:4] == [f"{max(top1):.2f}", f"{s['eval_top1']:.2f}"] and row[-2:] == ["-", str(s["epochs_completed"])]
    assert (f"no final numbers yet of {run} (still training, or stopped before its end): their numbers so far, from "
            f"their logged history") in lines
    [loaded] = compare_runs.load(str(run))
    assert (loaded.config["model"], loaded.config["lr"], loaded.config["tracker"]) == ("resnet8", 0.01, "none")
    fig = compare_runs.figure([loaded], "epoch", ("eval/top1",), "eval top-1 (%)", by_group=False)
    assert [list(line.get_ydata()) for line in fig.axes[0].lines] == [top1]


def logged_values(out: Path) -> dict[int, dict]:
    """The tracker's logged values by step (probe_train's record of rank 0), timings and memory left out."""
    by_step = {}
    for step, values in map(json.loads, (out / "probe-logs-rank0.jsonl").read_text().splitlines()):
        by_step.setdefault(step, {}).update({k: v for k, v in values.items() if not any(
            word in k for word in ("per_sec", "seconds", "memory"))})
    return by_step


def test_kill_9_mid_epoch_on_one_process_then_resume_on_two_matches_the_uninterrupted_run(reference, cifar_dir,
                                                                                            cache_dir, tmp_path):
    """A 1-process job killed with kill -9 mid-epoch and resumed on 2 ranks ends with the uninterrupted run's
    trainable parameters and EMA bitwise (fp32, `--deterministic`)."""
    out = tmp_path / "killed"
    proc = start(job_args(cifar_dir, cache_dir, out, "--log-every", "1"), ONE_PROCESS, script=PROBE,
                 env=held_after(3))
    _kill_after_checkpoint(out, proc, 3)
    result = run_train(job_args(cifar_dir, cache_dir, out, "--log-every", "1", "--resume", "auto"), launch=TWO_RANKS,
                       script=PROBE)
    assert result.returncode == 0, result.stderr[-4000:]
    s = read_summary(out)
    assert int(Path(s["resumed_from"]).name[5:]) % 8 != 0
    assert "resuming on 2 process(es), the checkpoint's run had 1: accumulation 2 -> 1" in result.stdout
    assert s["world_size"] == 2 and s["grad_accum"] == 1 and s["global_step"] == 16
    assert_same_parameters(out, reference)
    assert_same_parameters(out, reference, file="model_ema.safetensors")
    # the new rank 1 (no RNG file of its own in the checkpoint) all-reduced at the same micro-steps as rank 0
    probes = [json.loads((out / f"probe-rank{r}.json").read_text()) for r in (0, 1)]
    assert probes[0]["allreduce_at"] == probes[1]["allreduce_at"] and probes[0]["allreduce_at"]


# docs/reproducibility.md's replay commands, scaled to a CPU job: 2 gloo processes for 8 GPUs, a global batch of 128
# for 512 (2 x 64, accumulation 1; one process accumulates 2), a checkpoint every 2 steps for 500 and the step-2
# checkpoint (mid-epoch 1 of 3 steps) for step 1000. Every other word runs as printed, --keep-last included.
REPLAY_SCALED = {"--num_processes 8": "--num_processes 2", "--global-batch-size 512": "--global-batch-size 128",
                 "--checkpoint-every-steps 500": "--checkpoint-every-steps 2", "step-00001000": "step-00000002"}


@pytest.mark.slow
def test_the_replay_commands_run_as_printed_and_end_with_the_same_weights(cifar_dir, cache_dir, tmp_path):
    """The replay commands of docs/reproducibility.md run as printed (scaled down: 2 processes for 8) and end with
    the original's trainable parameters bitwise."""
    commands = [c for _, c in doc_commands(REPO / "docs" / "reproducibility.md") if "--global-batch-size 512" in c]
    assert len(commands) == 3 and all(any(k in c for c in commands) for k in REPLAY_SCALED), commands
    small = ["--data-dir", str(cifar_dir), "--cache-dir", str(cache_dir), "--model", "resnet8",
             "--train-subset", "384", "--eval-subset", "100", "--epochs", "2", "--deterministic", "--tracker", "none"]
    env = script_env(HF_HOME=str(tmp_path / "hf"))  # no user's default accelerate config for the flag-only launch
    outputs = []
    for command in commands:
        for printed, scaled in REPLAY_SCALED.items():
            command = command.replace(printed, scaled)
        words = shlex.split(command.replace("runs/", f"{tmp_path}/runs/"))
        if words[:2] == ["accelerate", "launch"]:
            script = launch_command_parser().parse_args(words[2:])
            launcher = words[2:words.index(script.training_script)]
            result = run_train([*script.training_script_args, *small], launch=launcher, env=env)
        else:
            assert words[:2] == ["python", "train_cifar.py"], command
            result = run_train([*words[2:], *small], env=env)
        assert result.returncode == 0, f"{command}\n{result.stderr[-3000:]}"
        outputs.append((Path(words[words.index("--output-dir") + 1]), result.stdout))
    (original, _), (replay, _), (continued, said) = outputs
    runs = [read_summary(out) for out, _ in outputs]
    assert [(s["world_size"], s["grad_accum"], s["global_batch"], s["global_step"]) for s in runs] == [
        (2, 1, 128, 6), (1, 2, 128, 6), (1, 2, 128, 6)]
    assert runs[2]["resumed_from"].endswith("step-00000002")
    assert "resuming on 1 process(es), the checkpoint's run had 2: accumulation 1 -> 2" in said
    assert_same_parameters(replay, original)
    assert_same_parameters(continued, original)


@pytest.mark.parametrize("how", ["SIGTERM to the launcher", "SIGUSR1 to every rank", "SIGUSR1 to rank 1 alone"])
def test_preemption_signal_checkpoints_at_the_next_step_and_resume_is_exact(reference, cifar_dir, cache_dir, tmp_path,
                                                                            how):
    """SIGTERM to the launcher, or SIGUSR1 to every rank, saves a checkpoint and stops the job within 30 s; resumed
    after SIGTERM, the job ends with the uninterrupted run's weights, EMA and best weights bitwise (fp32,
    `--deterministic`). SIGUSR1 to rank 1 alone stops the job too; the printed line names the signal and the first
    rank that saw it (rank 1 when it alone got it)."""
    out = tmp_path / "preempted"
    proc = start(job_args(cifar_dir, cache_dir, out), TWO_RANKS)
    wait_for_checkpoint(out, proc, 3)
    sent = time.time()
    if how.startswith("SIGTERM"):
        proc.send_signal(signal.SIGTERM)  # torchrun forwards it to the workers, as SLURM's to srun's tasks
    else:
        for rank, worker in workers(proc).items():
            if rank == 1 or how.endswith("every rank"):
                worker.send_signal(signal.SIGUSR1)
    printed, stderr = proc.communicate(timeout=60)
    assert time.time() - sent < 30, "the job must stop within seconds"
    number, ranks = (signal.SIGTERM, "[01]") if how.startswith("SIGTERM") else (signal.SIGUSR1, "1" if "alone" in how
                                                                                 else "[01]")
    assert re.search(rf"^preempted \(signal {int(number)}, seen by rank {ranks}\): saved ", printed, re.M), printed
    if how.startswith("SIGUSR1"):  # the processes saved their state and stopped: a success (docs/checkpoints.md)
        assert proc.returncode == 0, stderr[-3000:]
    else:  # torchrun itself, signalled, exits 1 (its SignalException) after its processes saved
        assert proc.returncode == 1 and "SignalException" in stderr, stderr[-3000:]
    saved = [p for p in (out / "checkpoints").glob("step-*") if int(p.name[5:]) > 3]
    assert saved, stderr[-3000:]
    assert not (out / "summary.json").exists()
    if how.startswith("SIGUSR1"):
        return  # the same checkpoint as SIGTERM's (only the delivery differs): its exact resume is checked once, below
    result = run_train(job_args(cifar_dir, cache_dir, out, "--resume", "auto"), launch=TWO_RANKS)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "resumed from" in result.stdout
    for name in ("model.safetensors", "model_ema.safetensors", "best.safetensors"):  # the same process count: bitwise
        assert_same_state(out / name, reference / name)
    s, r = read_summary(out), read_summary(reference)  # resumed after the evaluation at step 3: its counters kept
    assert [s[k] for k in EVALUATION_COUNTERS] == [r[k] for k in EVALUATION_COUNTERS]


def test_workers_whose_launcher_is_killed_checkpoint_and_exit_and_resume_is_exact(reference, cifar_dir, cache_dir,
                                                                                   tmp_path):
    """kill -9 of the launcher's pid alone (torchrun's workers run in sessions of their own, so they outlive it): each
    worker notices within a second that its parent is gone and takes the preemption path at the next check. The
    job is held at optimizer step 4 (after the step-3 checkpoint) until the launcher is gone, so it cannot finish
    first on a busy machine."""
    out = tmp_path / "orphaned"
    proc = start(job_args(cifar_dir, cache_dir, out), TWO_RANKS, script=PROBE, env=script_env(PROBE_HOLD_AT_STEP="4"))
    wait_for_checkpoint(out, proc, 3)
    job = list(workers(proc).values())
    assert len(job) == 2
    killed = time.time()
    proc.kill()
    proc.wait()
    gone, alive = psutil.wait_procs(job, timeout=60)
    assert not alive, "workers outlived their launcher"
    assert time.time() - killed < 60
    printed = proc.stdout.read()  # the workers wrote to the launcher's pipe; all of them have closed it now
    assert re.search(r"^preempted \(the launcher is gone, seen by rank [01]\): saved ", printed, re.M), printed[-3000:]
    saved = [p for p in (out / "checkpoints").glob("step-*") if int(p.name[5:]) > 3]
    assert saved and not (out / "summary.json").exists()
    from utils import checkpoint as ckpt

    assert ckpt.problem(max(saved)) is None
    result = run_train(job_args(cifar_dir, cache_dir, out, "--resume", "auto"), launch=TWO_RANKS)
    assert result.returncode == 0, result.stderr[-4000:]
    assert read_summary(out)["resumed_from"] == str(max(saved))
    for name in ("model.safetensors", "model_ema.safetensors"):
        assert_same_state(out / name, reference / name)


def test_damaged_newest_checkpoint_and_a_crashed_save_are_skipped_and_resuming_in_epoch_two_is_exact(
        reference, cifar_dir, cache_dir, tmp_path):
    """A truncated newest checkpoint and a crashed save are skipped with a warning, and the resume from the one
    before ends bitwise equal. The newest checkpoint (16) truncated, and a newer `.tmp-step-00000017` (a save that
    crashed between Accelerate's save_state and the manifest): resume takes 15. Also the test that needs
    set_epoch(): resuming at step 15 (epoch 2 of 2) in a fresh process must replay epoch 2's shuffle; without the
    call the new loader starts at epoch 0's (checked: 102 tensors differ)."""
    out = tmp_path / "corrupt"
    shutil.copytree(reference, out)
    (out / "summary.json").unlink()
    checkpoints = out / "checkpoints"
    shutil.copytree(checkpoints / "step-00000016", checkpoints / ".tmp-step-00000017")
    (checkpoints / ".tmp-step-00000017" / "trainer_state.json").unlink()
    weights = checkpoints / "step-00000016" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    result = run_train(job_args(cifar_dir, cache_dir, out, "--resume", "auto"), launch=TWO_RANKS)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "warning: skipping checkpoint" in result.stdout and "model.safetensors is truncated" in result.stdout
    assert read_summary(out)["resumed_from"].endswith("step-00000015")
    kept_aside = list(checkpoints.glob("step-00000016.unsound-*"))
    assert len(kept_aside) == 1 and (kept_aside[0] / "model.safetensors").stat().st_size == 1000
    for name in ("model.safetensors", "model_ema.safetensors"):
        assert_same_state(out / name, reference / name)


def test_checkpoint_with_one_flipped_byte_is_found_corrupt_and_skipped(reference, tmp_path):
    from utils import checkpoint as ckpt

    checkpoints = tmp_path / "checkpoints"
    for step in ("step-00000015", "step-00000016"):
        shutil.copytree(reference / "checkpoints" / step, checkpoints / step)
    weights = checkpoints / "step-00000016" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit of one weight: same size, same name
    weights.write_bytes(bytes(data))
    assert ckpt.problem(checkpoints / "step-00000016") == "model.safetensors is corrupt (checksum mismatch)"
    warnings = []
    assert ckpt.newest_sound(checkpoints, warn=warnings.append) == checkpoints / "step-00000015"
    assert len(warnings) == 1 and "checksum mismatch" in warnings[0] and weights.read_bytes() == bytes(data)


def test_resume_from_a_named_checkpoint_continues_from_it_and_keeps_the_newer_one(reference, cifar_dir, cache_dir,
                                                                                  tmp_path):
    out = tmp_path / "named"
    shutil.copytree(reference, out)
    (out / "summary.json").unlink()
    older = out / "checkpoints" / "step-00000015"
    result = run_train(job_args(cifar_dir, cache_dir, out, "--resume", str(older)), launch=TWO_RANKS)
    assert result.returncode == 0, result.stderr[-4000:]
    assert read_summary(out)["resumed_from"] == str(older)
    assert_same_state(out / "model.safetensors", reference / "model.safetensors")
    replaced = list((out / "checkpoints").glob("step-00000016.replaced-*"))  # the step it saved again, kept aside
    assert len(replaced) == 1 and (replaced[0] / "trainer_state.json").is_file()


def test_rotation_keeps_the_best_checkpoint_when_it_is_older_than_the_last_ones(tmp_path):
    from utils import checkpoint as ckpt

    for step in range(1, 7):
        folder = tmp_path / f"step-{step:08d}"
        folder.mkdir()
        if step != 6:  # step 6: a save still running (or crashed): never finished, never deleted by rotation
            (folder / "trainer_state.json").write_text("{}")
    ckpt.rotate(tmp_path, keep_last=2, keep={"step-00000002"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000002", "step-00000004", "step-00000005",
                                                          "step-00000006"]


@pytest.mark.slow
def test_dead_peer_fails_the_job_instead_of_hanging(cifar_dir, cache_dir, tmp_path):
    out = tmp_path / "dead_peer"
    proc = start(job_args(cifar_dir, cache_dir, out, "--dist-timeout", "30"), TWO_RANKS)
    wait_for_checkpoint(out, proc, 3)
    victim = workers(proc)[1]
    victim.kill()
    started = time.time()
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode != 0
    assert time.time() - started < 60
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "a peer process died" in errors[0] and "(rank 0)" in errors[0], stderr[-3000:]


@pytest.mark.slow
def test_nan_loss_stops_naming_the_step_and_keeps_the_last_good_checkpoint(cifar_dir, cache_dir, tmp_path):
    out = tmp_path / "nan"
    result = run_train(job_args(cifar_dir, cache_dir, out), launch=TWO_RANKS, script=PROBE,
                       env=script_env(PROBE_NAN_AT_FORWARD="5"))
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode != 0
    assert len(errors) == 1 and "not finite (nan or inf) at optimizer step 5" in errors[0], result.stderr[-3000:]
    assert "step-00000003" in errors[0]
    from utils import checkpoint as ckpt

    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-00000003"]
    assert ckpt.problem(out / "checkpoints" / "step-00000003") is None
    assert not (out / "model.safetensors").exists()


def test_exported_weights_evaluate_to_the_reported_top1(reference, cifar_dir, cache_dir):
    s = read_summary(reference)
    expected = {"model.safetensors": s["eval_top1"], "best.safetensors": s["best_eval_ema_top1"],
                "model_ema.safetensors": s["eval_ema_top1"]}
    # One single-threaded process evaluates the three files through the tool's main(), as its command line would.
    argv = [[str(reference / name), "--data-dir", str(cifar_dir), "--cache-dir", str(cache_dir), "--batch-size", "50"]
            for name in expected]
    code = ("import json, sys, evaluate_checkpoint; "
            "print(json.dumps([evaluate_checkpoint.main(args) for args in json.loads(sys.argv[1])]))")
    result = run_python(["-c", code, json.dumps(argv)], script_env(OMP_NUM_THREADS="1"), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    for name, got in zip(expected, json.loads(result.stdout.strip().splitlines()[-1]), strict=True):
        assert got["examples"] == 50 and got["top1"] == expected[name], (name, got, expected[name])


# Bad resume input: one line, exit 2, nothing deleted --------------------------------------------------
@pytest.fixture(scope="module")
def small_run(tmp_path_factory) -> tuple[Path, Path]:
    data = write_cifar_dir(tmp_path_factory.mktemp("small") / "data", n_train=64, n_test=16)
    out = data.parent / "run"
    result = run_train(["--data-dir", str(data), "--output-dir", str(out), "--model", "resnet8",
                        "--batch-size", "16", "--epochs", "1", "--tracker", "none", "--cache-dir",
                        str(data.parent / "cache")])
    assert result.returncode == 0, result.stderr[-3000:]
    return data, out


def _tree(folder: Path) -> dict:
    return {p.relative_to(folder).as_posix(): p.stat().st_size for p in folder.rglob("*") if p.is_file()}


@pytest.mark.parametrize(("extra", "message"), [
    (["--resume", "/nonexistent/step-1"], "--resume /nonexistent/step-1 does not exist"),
    (["--resume", "{data}"], "is not a usable checkpoint: no trainer_state.json: not a checkpoint"),
    (["--resume", "{ckpt}", "--model", "resnet18"],
     'was trained with other values (model "resnet8" there, "resnet18" here)'),
    (["--keep-last", "0"], "--keep-last must be positive (got 0)"),
    (["--model", "resnet8", "--lr", "0.2"], "holds checkpoints of an earlier run trained with other values (lr 0.1 "
     "there, 0.2 here); use another --output-dir, or --overwrite to delete it and start over."),
])
def test_bad_resume_input_stops_with_one_line_and_deletes_nothing(small_run, extra, message):
    data, out = small_run
    checkpoint = next((out / "checkpoints").glob("step-*"))
    args = [a.format(data=data, ckpt=checkpoint) for a in extra]
    before = _tree(out)
    result = run_train(["--data-dir", str(data), "--output-dir", str(out), "--batch-size", "16", "--epochs", "1",
                        "--tracker", "none", "--cache-dir", str(data.parent / "cache"), *args])
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], result.stderr[-3000:]
    assert _tree(out) == before


def test_a_resume_with_other_values_stops_in_one_line_naming_them_and_rewrites_nothing(small_run):
    """Not only in sweeps: --resume auto on a finished run's folder with another lr and weight decay stops with one
    line naming both values (never 'nothing to train' for a config it did not train); the folder is unchanged."""
    data, out = small_run
    before = _tree(out)
    result = run_train(["--data-dir", str(data), "--output-dir", str(out), "--model", "resnet8", "--batch-size", "16",
                        "--epochs", "1", "--tracker", "none", "--cache-dir", str(data.parent / "cache"),
                        "--resume", "auto", "--lr", "0.05", "--weight-decay", "0.001"])
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: --resume auto: {out / 'checkpoints' / 'step-00000004'} was trained with other values "
                      f"(lr 0.1 there, 0.05 here; weight_decay 0.0005 there, 0.001 here); give the same values to "
                      f"continue it, or start another run in another --output-dir."], result.stderr[-3000:]
    assert "nothing to train" not in result.stdout and _tree(out) == before


def test_a_checkpoint_from_before_sample_keyed_augmentation_is_refused_in_one_line_and_kept(small_run, tmp_path):
    data, out = small_run
    old = tmp_path / "old"
    shutil.copytree(out, old)
    for state_file in (old / "checkpoints").glob("step-*/trainer_state.json"):  # as the per-rank-stream format wrote
        state = json.loads(state_file.read_text())
        del state["format"], state["batch"]
        state_file.write_text(json.dumps(state))
    before = _tree(old)
    result = run_train(["--data-dir", str(data), "--output-dir", str(old), "--model", "resnet8",
                        "--batch-size", "16", "--epochs", "1", "--tracker", "none", "--cache-dir",
                        str(data.parent / "cache"), "--resume", "auto"])
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "was written by an earlier version of this template" in errors[0], errors
    assert _tree(old) == before


def test_overwrite_deletes_the_earlier_runs_checkpoints_and_starts_fresh(small_run, tmp_path):
    """--overwrite over a finished run: a fresh run (none of the earlier checkpoints left, its history.jsonl begun
    anew)."""
    data, earlier = small_run
    out = tmp_path / "overwritten"
    shutil.copytree(earlier, out)
    result = run_train(["--data-dir", str(data), "--output-dir", str(out), "--model", "resnet8",
                        "--batch-size", "16", "--epochs", "1", "--tracker", "none", "--cache-dir",
                        str(data.parent / "cache"), "--lr", "0.3", "--overwrite"])
    assert result.returncode == 0, result.stderr[-3000:]
    s = read_summary(out)
    assert s["resumed_from"] is None and s["config"]["lr"] == 0.3 and s["global_step"] == 4  # 64 images / 16
    states = [json.loads((p / "trainer_state.json").read_text()) for p in (out / "checkpoints").iterdir()]
    assert states and all(state["config"]["lr"] == 0.3 for state in states)  # none of the earlier run's is left
    history = [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines()]
    assert [row["_step"] for row in history] == [4, 4]  # this run's evaluation and epoch: the earlier run's are gone


def test_a_run_resumed_with_ema_decay_from_a_checkpoint_without_one_starts_the_ema_from_its_weights(small_run,
                                                                                                    tmp_path):
    data, earlier = small_run
    out = tmp_path / "with_ema"
    shutil.copytree(earlier, out)
    result = run_train(["--data-dir", str(data), "--output-dir", str(out), "--model", "resnet8",
                        "--batch-size", "16", "--epochs", "2", "--tracker", "none", "--cache-dir",
                        str(data.parent / "cache"), "--resume", "auto", "--ema-decay", "0.5"],
                       script=PROBE, env=script_env(PROBE_RECORD_WEIGHTS="fc.weight"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "holds no EMA (saved without --ema-decay); the EMA starts from its weights" in result.stdout
    s = read_summary(out)
    assert s["global_step"] == 8 and "eval_ema_top1" in s
    assert json.loads((out / "checkpoints" / "step-00000008" / "ema.json").read_text()) == {"updates": 4}
    # the EMA of steps 5-8 (recorded as this life's steps 1-4), from the weights of checkpoint 4, warmed up afresh
    ema = load_file(earlier / "checkpoints" / "step-00000004" / "model.safetensors")["fc.weight"].double()
    recorded = load_file(out / "probe-weights-rank0.safetensors")
    for t in range(1, 5):
        decay = min(0.5, (1 + t) / (10 + t))
        ema = decay * ema + (1 - decay) * recorded[f"fc.weight@{t}"].double()
    torch.testing.assert_close(load_file(out / "model_ema.safetensors")["fc.weight"].double(), ema, rtol=1e-5,
                               atol=1e-7)


def test_no_torch_load_without_weights_only():
    sources = [p for p in REPO.rglob("*.py") if ".venv" not in p.parts]
    for path in sources:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if "torch.load(" in line and "weights_only=True" not in line and "torch.load(\" in line" not in line:
                pytest.fail(f"{path.relative_to(REPO)}:{number} calls torch.load without weights_only=True")


def test_resumed_run_continues_the_same_wandb_run(small_run, tmp_path):
    data, _ = small_run
    out = tmp_path / "tracked"
    common = ["--data-dir", str(data), "--output-dir", str(out), "--model", "resnet8", "--batch-size", "16",
              "--tracker", "wandb", "--cache-dir", str(data.parent / "cache"), "--log-every", "1"]
    first = run_train([*common, "--epochs", "1"])
    assert first.returncode == 0, first.stderr[-3000:]
    second = run_train([*common, "--epochs", "2", "--resume", "auto"])
    assert second.returncode == 0, second.stderr[-3000:]
    runs = sorted((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and runs[0].name.split("-")[-1] == runs[1].name.split("-")[-1]  # one W&B run id
    [run] = compare_runs.load(str(out))  # the two offline folders read back as one run
    assert [row["_step"] for row in run.history if "train/loss" in row] == list(range(1, 9))  # each step once, in order
    assert run.summary["eval_top1"] == read_summary(out)["eval_top1"]
    assert read_summary(out)["global_step"] == 8 and read_summary(out)["resumed_from"].endswith("step-00000004")


# Faults a cluster job meets: a full disk, a second job in the same folder, a hung peer -------------------
@pytest.fixture
def small_disk(tmp_path):
    """A 2 MiB tmpfs: room for best.safetensors (0.3 MiB) and one checkpoint of this job (1.0 MiB, its EMA's 0.3
    included), not for a second."""
    with small_tmpfs(tmp_path / "small_disk", "2m") as folder:
        yield folder


def test_full_disk_stops_every_rank_with_one_line_and_the_last_good_checkpoint_resumes_exactly(
        reference, small_disk, cifar_dir, cache_dir, tmp_path):
    """A full disk while saving stops every rank with one line naming the last good checkpoint, which resumes
    bitwise equal."""
    out = small_disk / "run"
    result = run_train(job_args(cifar_dir, cache_dir, out), launch=TWO_RANKS)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode != 0 and len(errors) == 1, result.stderr[-3000:]
    good = out / "checkpoints" / "step-00000003"
    partial = out / "checkpoints" / ".tmp-step-00000006"
    assert errors[0].startswith(f"error: no space left on device writing {partial} (")
    assert errors[0].endswith(f"; last good checkpoint: {good}"), errors[0]
    assert not [line for line in result.stderr.splitlines() if "[rank" in line and "Traceback" in line]  # no rank's
    assert "warning: only" in result.stdout and "less than one checkpoint" in result.stdout  # after step 3
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000003"]  # the partial one removed
    from utils import checkpoint as ckpt

    assert ckpt.problem(good) is None
    moved = tmp_path / "bigger_disk"
    shutil.copytree(out, moved)
    resumed = run_train(job_args(cifar_dir, cache_dir, moved, "--resume", "auto"), launch=TWO_RANKS)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert read_summary(moved)["resumed_from"] == str(moved / "checkpoints" / "step-00000003")
    for name in ("model.safetensors", "model_ema.safetensors"):
        assert_same_state(moved / name, reference / name)


def _fill(disk: Path) -> Path:
    """Fills `disk` to its last byte with one file, as another job's output would; returns the file."""
    filler = disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    for size in (65536, 4096, 1):
        with contextlib.suppress(OSError):
            while True:
                os.write(fd, b"x" * size)
    os.close(fd)
    return filler


def test_a_full_disk_at_the_end_of_a_run_keeps_its_previous_files_whole_and_is_one_line(small_disk):
    """The end of a run on a full disk: the exported weights, preprocessor_config.json and summary.json each stop
    with one line naming the file and the last good checkpoint, and each file a previous run left there is kept
    whole, byte for byte (nothing truncated, no temporary file left)."""
    from accelerate import Accelerator

    from utils import UserError
    from utils.checkpoint import export_weights
    from utils.export import export_model

    accelerator = Accelerator(cpu=True)
    data = {"dataset": {"source": "test"}, "classes": ("cat", "dog"), "image_size": 8, "mean": (0.5,) * 3,
            "std": (0.25,) * 3, "stats_from": "the training images"}
    model = torch.nn.Linear(3, 2)
    export_model(accelerator, model, None, data, small_disk, {"eval_top1": 50.0})  # the previous run's files
    export_weights(accelerator, model, small_disk / "best.safetensors")
    before = {p.name: p.read_bytes() for p in small_disk.iterdir()}
    assert sorted(before) == ["best.safetensors", "model.safetensors", "preprocessor_config.json", "summary.json"]
    assert json.loads(before["summary.json"]) == {"eval_top1": 50.0}
    filler = _fill(small_disk)
    big = {**data, "classes": tuple(f"class {k}" for k in range(1000))}  # new files longer than the old ones
    summary = {"eval_top1": 60.0, "classes": big["classes"]}
    # each write meets the full disk at file `name`; the files it writes before that (the same bytes as before) get
    # the room they had
    best = small_disk / "best.safetensors"
    for name, write, room in (
            ("best.safetensors", lambda: export_weights(accelerator, torch.nn.Linear(64, 64), best), []),
            ("preprocessor_config.json", lambda: export_model(accelerator, model, None, big, small_disk, summary),
             ["model.safetensors"]),
            ("summary.json", lambda: export_model(accelerator, model, None, data, small_disk, summary),
             ["model.safetensors", "preprocessor_config.json"])):
        for taken in room:
            (small_disk / taken).unlink()
        with pytest.raises(UserError) as raised:
            write()
        assert str(raised.value).startswith(f"no space left on device writing {small_disk / name} ("), raised.value
        assert str(raised.value).endswith("; last good checkpoint: none")
    filler.unlink()
    assert {p.name: p.read_bytes() for p in small_disk.iterdir()} == before  # rewritten ones: the same bytes


@pytest.mark.slow
def test_second_job_in_a_busy_output_dir_stops_naming_the_first_and_a_dead_jobs_lock_is_taken_over(
        cifar_dir, cache_dir, tmp_path):
    """A second job in a busy output folder stops with one line naming the first job."""
    import socket

    out = tmp_path / "busy"
    first = start(job_args(cifar_dir, cache_dir, out), TWO_RANKS)
    wait_for_checkpoint(out, first, 3)
    holder = workers(first)[0]
    for worker in workers(first).values():
        worker.suspend()  # alive and holding the lock, but it cannot finish while the second job starts
    second = run_train(job_args(cifar_dir, cache_dir, out, "--resume", "auto"), launch=TWO_RANKS)
    errors = [line for line in second.stderr.splitlines() if line.startswith("error:")]
    assert second.returncode != 0 and len(errors) == 1, second.stderr[-3000:]
    assert f"is in use by another job (host {socket.gethostname()}, pid {holder.pid}," in errors[0], errors[0]
    assert first.poll() is None and not (out / "summary.json").exists()
    job = [*psutil.Process(first.pid).children(recursive=True), psutil.Process(first.pid)]
    for process in job:
        process.kill()  # the first job dies without releasing its lock
    first.wait()
    psutil.wait_procs(job, timeout=10)
    assert (out / ".lock").is_file()
    # the third job resumes from step 3 or 6 and stops at step 7 (enough to see the lock taken over and released)
    third = run_train(job_args(cifar_dir, cache_dir, out, "--resume", "auto", "--max-steps", "7"), launch=TWO_RANKS)
    assert third.returncode == 0, third.stderr[-3000:]
    gone = f"host {socket.gethostname()}, pid {holder.pid},"
    assert f"note: took over the lock of a job that is gone ({gone}" in third.stdout
    assert read_summary(out)["global_step"] == 7 and not (out / ".lock").exists()  # released at the end


@pytest.mark.slow
def test_every_form_of_a_collective_timeout_reads_as_the_dist_timeout_in_one_line():
    """gloo's and NCCL's timeout messages carry the limit; gloo's broadcast (DDP's buffer sync at a forward) says only
    "Application timeout caused pair closure", so the limit comes from the process group (here a 1-process gloo group
    with a 7 s timeout, in a process of its own)."""
    code = """
import datetime, os, torch.distributed as dist
from utils.launch import peer_failure
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="0", RANK="0", WORLD_SIZE="1")
print(peer_failure("RuntimeError: Application timeout caused pair closure"))
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=7))
print(peer_failure("RuntimeError: Application timeout caused pair closure"))
print(peer_failure("[../gloo/transport/tcp/pair.cc:534] Timed out waiting 12000ms for recv operation to complete"))
print(peer_failure("Watchdog caught collective operation timeout: WorkNCCL(OpType=ALLREDUCE, Timeout(ms)=600000)"))
print(peer_failure("CUDA out of memory"))
dist.destroy_process_group()
"""
    result = run_python(["-c", code], script_env(), timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    tail = "(it hangs, or its machine is unreachable)"
    assert result.stdout.splitlines() == [
        f"a peer process did not answer within --dist-timeout {tail}",  # no group yet: the limit is unknown
        f"a peer process did not answer within --dist-timeout 7 s {tail}",
        f"a peer process did not answer within --dist-timeout 12 s {tail}",
        f"a peer process did not answer within --dist-timeout 600 s {tail}",
        "None"]


@pytest.mark.slow
def test_hung_peer_stops_the_others_after_dist_timeout_with_one_line(cifar_dir, tmp_path):
    """A cache of its own: rank 0 first decodes all of CIFAR-10 (about 20 s) while rank 1 waits for it, longer than
    --dist-timeout 10, which that wait must not be subject to; then rank 1 hangs and rank 0 stops after 10 s."""
    out = tmp_path / "hung"
    proc = start(job_args(cifar_dir, tmp_path / "cache", out, "--dist-timeout", "10"), TWO_RANKS)
    wait_for_checkpoint(out, proc, 3)
    ranks = workers(proc)
    ranks[1].suspend()  # SIGSTOP: alive, holding its connections, answering nothing
    stopped = time.time()
    psutil.wait_procs([ranks[0]], timeout=60)
    waited = time.time() - stopped
    for process in [*psutil.Process(proc.pid).children(recursive=True)]:
        process.kill()
    _, stderr = proc.communicate(timeout=60)
    # --dist-timeout 10 s plus a little (measured 11 s), far from the 600 s default; a collective already waiting
    # on the slower rank when it was stopped may time out a moment sooner
    assert 5 <= waited < 25, waited
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "did not answer within --dist-timeout 10 s" in errors[0], stderr[-3000:]
    from utils import checkpoint as ckpt

    # nothing half-written
    assert all(ckpt.problem(folder) is None for folder in ckpt.step_folders(out / "checkpoints"))
