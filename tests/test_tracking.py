"""Experiment tracking with the real W&B client offline (WANDB_MODE=offline), TensorBoard, and compare_runs.py on
the run files those jobs wrote (the runs: conftest.tracked_runs)."""

from __future__ import annotations

import base64
import hashlib
import json
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import CIFAR_CLASSES as CLASSES
from conftest import CPU_YAML, REPO, TRACKED_JOB, read_summary, run_train, script_env
from PIL import Image

import compare_runs
from utils import UserError
from utils.tracking import last_logged


def compare(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "compare_runs.py"), *map(str, args)], cwd=REPO, env=script_env(),
                          capture_output=True, text=True, timeout=120)


def test_a_two_rank_job_makes_exactly_one_wandb_run(tracked_runs):
    folders = list((tracked_runs["b"] / "wandb").glob("offline-run-*"))
    assert len(folders) == 1 and len(list(folders[0].glob("run-*.wandb"))) == 1
    assert not (REPO / "wandb").exists(), "no process may log to a W&B folder of its own"


def test_wandb_run_holds_config_run_facts_step_and_epoch_metrics_and_the_summary(tracked_runs):
    [run] = compare_runs.load(str(next((tracked_runs["b"] / "wandb").glob("offline-run-*"))))  # W&B's file alone
    s = read_summary(tracked_runs["b"])
    assert (run.name, run.group) == ("b-run", "B")
    assert run.config["lr"] == 0.2 and run.config["world_size"] == 2 and run.config["distributed_type"] == "MULTI_CPU"
    assert run.config["mixed_precision"] == "no" and run.config["versions"]["torch"] and "git_commit" in run.config
    steps = {row["_step"]: row for row in run.history}
    for step in range(2, 17, 2):  # every --log-every optimizer steps
        assert {"train/loss", "train/lr", "train/images_per_sec", "train/grad_norm"} <= steps[step].keys()
        assert steps[step]["train/images_per_sec"] > 0 and steps[step]["train/grad_norm"] > 0
    assert [row["_step"] for row in run.history if "train/grad_norm" in row] == list(range(2, 17, 2))  # only then
    epochs = [row for row in run.history if "eval/top1" in row]
    assert [row["_step"] for row in epochs] == [8, 16]
    for row in epochs:
        assert {"eval/loss", "eval/top5", "eval/top1_cat", "train/epoch_seconds"} <= row.keys()
        assert row["eval/confusion_matrix_table/_type"] == "table-file"  # W&B's confusion-matrix plot, as a table file
        assert row["eval/confusion_matrix_table/nrows"] == 100  # (true, predicted, count) for 10 x 10 classes
        assert row["sys/peak_memory_gb"] > 0.1
    assert epochs[-1]["eval/top1"] == s["eval_top1"]
    table = json.loads((next((tracked_runs["b"] / "wandb").glob("offline-run-*")) / "files" /
                        epochs[-1]["eval/confusion_matrix_table/path"]).read_text())
    assert {(a, p): n for a, p, n in table["data"]} == {
        (CLASSES[t], CLASSES[q]): n for t, row in enumerate(s["eval_confusion"]) for q, n in enumerate(row)}
    for key in ("eval_top1", "best_eval_top1", "global_step", "world_size", "train_images_per_sec"):
        assert run.summary[key] == s[key]  # the run's summary is summary.json
    assert s["eval_confusion"][3][3] * 100 / sum(s["eval_confusion"][3]) == pytest.approx(s["eval_class_top1"]["cat"])
    assert sum(map(sum, s["eval_confusion"])) == 64
    folder = next((tracked_runs["b"] / "wandb").glob("offline-run-*")).name
    assert s["wandb_run"] == {"id": folder.split("-")[-1], "project": "cifar10-accelerate", "url": None}  # offline


def md5_digest(path: Path) -> str:
    """W&B's manifest digest of a file: its MD5, base64."""
    return base64.b64encode(hashlib.md5(path.read_bytes()).digest()).decode()


def test_wandb_log_model_logs_each_best_checkpoint_and_the_end_as_versions_listing_each_file_with_its_digest(
        tracked_runs, tmp_path):
    """--wandb-log-model checkpoints on 2 ranks: the one W&B run logs versions of its model artifact model-<run id>,
    in order: each new best (aliases best, step-N), each epoch's checkpoint (step-N), then at the end the best
    weights (best) and the whole run folder (step-16), each with latest. Read back from the offline run file, the end
    version lists model.safetensors, best.safetensors, config.yaml, preprocessor_config.json and summary.json with the
    digests of the run folder's files; the end's best version holds best.safetensors as its model.safetensors; the
    step-16 checkpoint's version lists every file of that checkpoint. A W&B artifact the tools cannot reach is one
    line."""
    run_dir = tracked_runs["b"]
    [folder] = (run_dir / "wandb").glob("offline-run-*")
    run_id = folder.name.split("-")[-1]
    records = compare_runs.read_records(next(folder.glob("run-*.wandb")))
    versions = [r.artifact for r in records if r.WhichOneof("record_type") == "artifact" and r.artifact.type == "model"]
    assert {v.name for v in versions} == {f"model-{run_id}"}
    history = json.loads("[" + ",".join((run_dir / "history.jsonl").read_text().splitlines()) + "]")
    top1 = {row["_step"]: row["eval/top1"] for row in history if "eval/top1" in row}  # 8 and 16
    best = [["best", "step-8"], ["step-8"]] + ([["best", "step-16"]] if top1[16] > top1[8] else []) + [["step-16"]]
    assert [sorted(v.aliases) for v in versions] == [sorted([*a, "latest"]) for a in [*best, ["best"], ["step-16"]]]
    manifest = {e.path: e.digest for e in versions[-1].manifest.contents}
    names = ["model.safetensors", "best.safetensors", "config.yaml", "preprocessor_config.json", "summary.json"]
    assert manifest == {name: md5_digest(run_dir / name) for name in names}
    best_end = {e.path: e.digest for e in versions[-2].manifest.contents}
    assert best_end["model.safetensors"] == md5_digest(run_dir / "best.safetensors")
    assert best_end.keys() == {"model.safetensors", "config.yaml", "preprocessor_config.json", "summary.json"}
    checkpoint = run_dir / "checkpoints" / "step-00000016"
    assert {e.path: e.digest for e in versions[-3].manifest.contents} == {
        p.name: md5_digest(p) for p in checkpoint.iterdir() if p.is_file()}
    for tool in (["predict.py", "wandb:team/project/model-x:best", str(tmp_path)],
                 ["evaluate_checkpoint.py", "wandb:team/project/model-x:latest"]):
        result = subprocess.run([sys.executable, *tool], cwd=REPO, env=script_env(WANDB_MODE="online"),
                                capture_output=True, text=True, timeout=300)
        assert result.returncode == 2 and result.stderr.startswith(
            "error: cannot download the W&B model artifact team/project/model-x"), result.stderr[-2000:]
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_without_a_terminal_progress_lines_show_the_logged_loss_and_the_time_left(tracked_runs):
    # b: --progress-every 0, so a line at every log step; a0: the default 60 s, so only the first log step's line
    [run] = compare_runs.load(str(tracked_runs["b"]))
    logged = {row["_step"]: row for row in run.history if "train/loss" in row}
    pattern = (r"^step (\d+)/16 \(epoch ([12])/2\)  loss ([\d.]+)  lr ([\d.e-]+)  ([\d,]+) img/s  "
               r"ETA (\d+)h(\d\d)m(\d\d)s$")
    lines = [re.match(pattern, line) for line in (tracked_runs["b"] / "stdout.txt").read_text().splitlines()]
    lines = [m for m in lines if m]
    assert [int(m[1]) for m in lines] == [2, 4, 6, 8, 10, 12, 14, 16]
    for m in lines:
        step = int(m[1])
        assert int(m[2]) == (step - 1) // 8 + 1
        assert float(m[3]) == pytest.approx(logged[step]["train/loss"], abs=5e-5)  # what the tracker got
        assert float(m[4]) == pytest.approx(logged[step]["train/lr"], rel=1e-3)
        eta = int(m[6]) * 3600 + int(m[7]) * 60 + int(m[8])
        # (16 - step) steps of 32 images at the logged speed
        assert eta == pytest.approx((16 - step) * 32 / logged[step]["train/images_per_sec"], abs=1)
    first = [line for line in (tracked_runs["a0"] / "stdout.txt").read_text().splitlines() if line.startswith("step ")]
    assert len(first) == 1 and first[0].startswith("step 2/16 (epoch 1/2)")


def test_compare_runs_prints_each_runs_real_final_top1_and_writes_plots(tracked_runs, tmp_path):
    result = compare(tracked_runs["a0"], tracked_runs["b"], "--plots", tmp_path / "plots")
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    # a run is labelled by its name (--run-name), else the output folder it was read from; never by its id twice
    for name, label in (("a0", str(tracked_runs["a0"])), ("b", "b-run")):
        s = read_summary(tracked_runs[name])
        row = next(line for line in lines if line.startswith(label + " "))
        assert f"{s['eval_top1']:.2f}" in row.split() and f"{s['best_eval_top1']:.2f}" in row.split()
        assert _run_id(tracked_runs[name]) not in row
    differ = lines[lines.index("config keys that differ:") + 1:]
    keys = [line.split()[0] for line in differ if line.strip() and not line.startswith("also different")]
    assert "lr" in keys and "world_size" in keys and "epochs" not in keys and "model" not in keys
    assert not {"output_dir", "run_name", "group", "tags"} & set(keys)  # names and paths: not in the table...
    [names] = [line for line in differ if line.startswith("also different")]  # ...but listed after it
    assert names == ("also different (names, paths, logging): command, group, output_dir, progress_every, run_name, "
                     "tags, wandb_log_model")
    for png in ("eval_top1_vs_epoch.png", "eval_top1_vs_wall_clock.png", "train_loss_vs_step.png",
                "train_epoch_loss_vs_epoch.png"):
        image = Image.open(tmp_path / "plots" / png)
        image.verify()
        image = Image.open(tmp_path / "plots" / png).convert("RGB")
        assert image.size == (700, 450) and len(image.getcolors(1 << 16) or range(1 << 16)) > 10  # drawn, not blank


def test_a_run_with_fewer_logged_steps_than_epochs_still_draws_every_chart():
    # 3 epochs of 16 steps with --log-every 50: one train/loss point in all, three epoch rows
    rows = [{"_step": 16 * e, "epoch": e, "train/epoch_loss": 2.3 - 0.2 * e, "eval/top1": 20.0 + 5 * e,
             "_timestamp": 100.0 + 10 * e} for e in (1, 2, 3)]
    run = compare_runs.Run("short", "s1", history=[*rows[:2], {"_step": 40, "train/loss": 1.95}, rows[2]])
    drawn = {}
    for filename, x, y, label in compare_runs.FIGURES:
        fig = compare_runs.figure([run], x, y, label, by_group=False)
        [line] = fig.axes[0].lines
        assert line.get_marker() == "o", filename  # a lone point is visible
        drawn[filename] = (list(line.get_xdata()), list(line.get_ydata()))
    assert drawn["train_loss_vs_step.png"] == ([40], [1.95])
    assert drawn["train_epoch_loss_vs_epoch.png"] == ([1, 2, 3], [pytest.approx(v) for v in (2.1, 1.9, 1.7)])
    assert drawn["eval_top1_vs_wall_clock.png"][0] == [0.0, 10.0, 20.0]


def test_chart_legends_name_each_run_with_the_settings_that_differ_and_epochs_are_whole_numbers(tracked_runs):
    """Two plain runs (no --run-name) that differ in lr and process count: each curve's legend is the run's output
    folder and the differing settings' values; the epoch axis has whole-number ticks only."""
    runs = [*compare_runs.load(str(tracked_runs["a0"])), *compare_runs.load(str(tracked_runs["b"]))]
    fig = compare_runs.figure(runs, "epoch", ("eval/top1",), "eval top-1 (%)", by_group=False)
    legend = [text.get_text() for text in fig.axes[0].get_legend().get_texts()]
    assert legend[0].startswith(f"{tracked_runs['a0']} (") and "lr 0.05" in legend[0] and "world_size 1" in legend[0]
    assert legend[1].startswith("b-run (") and "lr 0.2" in legend[1] and "world_size 2" in legend[1]
    ticks = [t for t in fig.axes[0].get_xticks() if fig.axes[0].get_xlim()[0] <= t <= fig.axes[0].get_xlim()[1]]
    assert ticks and all(float(t).is_integer() for t in ticks), ticks


def _run_id(out: Path) -> str:
    return next((out / "wandb").glob("offline-run-*")).name.split("-")[-1]


def test_compare_runs_by_group_gives_mean_and_std_over_seeds(tracked_runs, tmp_path):
    a0, a1, b = (tracked_runs[name] for name in ("a0", "a1", "b"))
    result = compare(a0, a1, b, "--by-group", "--plots", tmp_path / "plots")
    assert result.returncode == 0, result.stderr[-3000:]
    finals = [read_summary(tracked_runs[name])["eval_top1"] for name in ("a0", "a1")]
    row = next(line for line in result.stdout.splitlines() if line.startswith("A "))
    assert row.split()[1] == "2"
    assert f"{statistics.fmean(finals):.2f} +/- {statistics.stdev(finals):.2f}" in row
    assert next(line for line in result.stdout.splitlines() if line.startswith("B ")).split()[1] == "1"
    # what sets the groups apart: B's lr and its 2 processes (names, paths and seeds left out); A's two runs, one
    # grouped by --group and one by $WANDB_RUN_GROUP, differ only in their seed
    rows = result.stdout.split("config keys that differ between the groups:\n")[1].splitlines()
    rows = {line.split()[0]: line.split()[1:] for line in rows[1:] if line.split()[0] in ("effective_lr", "world_size")}
    assert rows == {"effective_lr": ["0.05", "0.2"], "world_size": ["1", "2"]}
    assert "warning: the runs of group" not in result.stdout
    assert "B - A: final top-1: cannot tell (each group needs 2 runs or more with it)" in result.stdout  # 1 run in B


def test_reader_refuses_files_it_cannot_read_with_one_line(tracked_runs, tmp_path):
    bad = tmp_path / "not-a-run"
    bad.mkdir()
    (bad / "run-x.wandb").write_bytes(b"garbage" * 10)
    result = compare(bad, "--plots", tmp_path / "p")
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
    assert result.stderr.startswith(f"error: {bad / 'run-x.wandb'} is not a W&B run file")
    real = next((tracked_runs["a0"] / "wandb").glob("offline-run-*/run-*.wandb")).read_bytes()
    flipped = bytearray(real)
    flipped[len(real) // 2] ^= 0xFF
    (bad / "run-x.wandb").write_bytes(bytes(flipped))
    with pytest.raises(UserError, match="is corrupt at byte"):
        compare_runs.load_local(bad)


def test_reader_keeps_the_records_before_a_cut_off_end(tracked_runs, tmp_path):
    source = next((tracked_runs["a0"] / "wandb").glob("offline-run-*"))
    whole = compare_runs.load_local(source)
    cut = tmp_path / "offline-run-cut"
    cut.mkdir()
    data = next(source.glob("run-*.wandb")).read_bytes()
    (cut / "run-cut.wandb").write_bytes(data[: len(data) * 2 // 3])  # a run killed while writing
    part = compare_runs.load_local(cut)
    assert part.id == whole.id and 0 < len(part.history) < len(whole.history)
    assert part.history == whole.history[: len(part.history)]


def test_a_run_folders_curves_come_from_its_history_where_wandbs_file_lost_its_last_records(tracked_runs, tmp_path):
    """A run folder whose W&B file a kill -9 cut short (its last third gone) but whose history.jsonl is whole:
    compare_runs.py's curves are the history's, every logged step (--log-every 2 of 16 steps; evaluations at 8 and
    16), and the train-loss chart draws each of them; the W&B file's records still give the run's name, config and
    the table's wall time (its last runtime: the run's summary was cut off)."""
    run_dir = tmp_path / "a0"
    shutil.copytree(tracked_runs["a0"], run_dir, ignore=shutil.ignore_patterns("checkpoints", "*.safetensors"))
    wandb_file = next(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
    data = wandb_file.read_bytes()
    wandb_file.write_bytes(data[: len(data) * 2 // 3])
    cut = compare_runs.load_local(wandb_file.parent)
    assert [row["_step"] for row in cut.history if "train/loss" in row] != list(range(2, 17, 2))  # steps lost
    [run] = compare_runs.load(str(run_dir))
    assert [row["_step"] for row in run.history if "train/loss" in row] == list(range(2, 17, 2))
    assert [row["_step"] for row in run.history if "eval/top1" in row] == [8, 16]
    assert run.id == cut.id and run.config["lr"] == 0.05
    runtime = [row["_runtime"] for row in cut.history if "_runtime" in row]
    assert "wall_seconds" not in cut.summary and runtime[-1] > 0
    assert run.metric(*compare_runs.COLUMNS["wall s"]) == runtime[-1]
    loss = compare_runs.figure([run], "_step", ("train/loss",), "train loss", by_group=False).axes[0].lines[0]
    history = [json.loads(line) for line in (run_dir / "history.jsonl").read_text().splitlines()]
    assert list(loss.get_ydata()) == [row["train/loss"] for row in history if "train/loss" in row]


@pytest.mark.slow
def test_tensorboard_tracker_logs_the_same_metrics_and_the_gpu_race_reads_them_without_wandb(cifar_dir, cache_dir,
                                                                                             tmp_path):
    """bench/gpu_race.py reads a finished run without W&B (the GPU machine has none): from its TensorBoard files and
    from its console lines."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from bench.gpu_race import epoch_lines, epochs_from_tensorboard

    out = tmp_path / "tb"
    result = run_train(["--data-dir", str(cifar_dir), "--cache-dir", str(cache_dir), "--output-dir", str(out),
                        *TRACKED_JOB,
                        "--tracker", "tensorboard", "--epochs", "2"])
    assert result.returncode == 0, result.stderr[-3000:]
    events = EventAccumulator(str(out / "cifar10-accelerate")).Reload()
    assert [e.step for e in events.Scalars("train/loss")] == list(range(2, 17, 2))
    assert {f"eval/top1_{c}" for c in CLASSES} <= set(events.Tags()["scalars"])  # 10 classes: per-class keys too
    summary = read_summary(out)
    assert events.Scalars("eval/top1")[-1].value == pytest.approx(summary["eval_top1"])
    assert not (out / "wandb").exists()
    epochs, lines = epochs_from_tensorboard(out), epoch_lines(result.stdout)
    assert [(e["epoch"], e["step"]) for e in epochs] == [(1, 8), (2, 16)] and [e["epoch"] for e in lines] == [1, 2]
    assert epochs[-1]["top1"] == pytest.approx(summary["eval_top1"])
    assert lines[-1]["top1"] == pytest.approx(summary["eval_top1"], abs=0.0051)  # printed with 2 decimals
    train_seconds = summary["train_images_seen"] / summary["train_images_per_sec"]
    assert sum(e["seconds"] for e in epochs) == pytest.approx(train_seconds, rel=1e-5)
    for tb, console in zip(epochs, lines):
        assert 0 < tb["seconds"] and abs(tb["seconds"] - console["seconds"]) <= 0.05 + 1e-6  # printed with 0.1 s
        assert console["images_per_sec"] == pytest.approx(256 / tb["seconds"], rel=1e-5, abs=0.5)  # printed rounded


def test_run_comparison_refuses_an_argument_that_is_neither_folder_nor_wandb_path(tmp_path):
    result = compare(tmp_path / "missing" / "folder", "--plots", tmp_path / "p")
    assert result.returncode == 2
    missing = tmp_path / "missing" / "folder"
    assert result.stderr.strip() == (f"error: {missing} is neither a folder, a W&B run path (entity/project/run_id) "
                                     f"nor a W&B sweep (wandb:entity/project/sweeps/id).")


@pytest.mark.slow
def test_wandb_dir_is_honoured_and_compare_runs_still_finds_the_run(cifar_dir, cache_dir, tmp_path):
    """Cluster users point $WANDB_DIR at scratch space: the run goes there, the output folder lists it."""
    out, scratch = tmp_path / "out", tmp_path / "scratch"
    scratch.mkdir()
    result = run_train(["--data-dir", str(cifar_dir), "--cache-dir", str(cache_dir), "--output-dir", str(out),
                        *TRACKED_JOB, "--epochs", "1"], env=script_env(WANDB_DIR=str(scratch)))
    assert result.returncode == 0, result.stderr[-3000:]
    folders = list((scratch / "wandb").glob("offline-run-*"))
    assert len(folders) == 1 and not (out / "wandb").exists()
    assert (out / "wandb_runs.txt").read_text().split() == [str(folders[0].resolve())]
    [run] = compare_runs.load(str(out))
    assert run.summary["eval_top1"] == read_summary(out)["eval_top1"]
    assert [row["_step"] for row in run.history if "train/loss" in row] == [2, 4, 6, 8]  # --log-every 2, 8 steps


def test_a_history_line_cut_short_by_a_kill_is_cut_off_and_the_last_whole_steps_numbers_are_known(tmp_path):
    """What a resumed job reads of history.jsonl (utils.tracking.last_logged): the last step of its whole lines and
    the names of every number logged at that step (its training log and its evaluation, two lines); a last line cut
    short by a kill is cut off the file by the main process (the next line then starts whole) and left in place by
    the others."""
    rows = [{"_step": 1, "_timestamp": 1.0, "train/loss": 2.5}, {"_step": 2, "_timestamp": 2.0, "train/loss": 2.0,
            "epoch": 1}, {"_step": 2, "_timestamp": 2.5, "eval/top1": 31.0, "epoch": 1}]
    whole = "".join(json.dumps(row) + "\n" for row in rows)
    history = tmp_path / "history.jsonl"
    history.write_text(whole + '{"_step": 3, "_timestamp": 3.0, "train/lo')
    assert last_logged(history, main=False) == (2, {"train/loss", "epoch", "eval/top1"})
    assert history.read_text().endswith('"train/lo')
    assert last_logged(history, main=True) == (2, {"train/loss", "epoch", "eval/top1"})
    assert history.read_text() == whole
    assert last_logged(tmp_path / "none.jsonl", main=True) == (0, set())


def test_profile_writes_each_ranks_chrome_trace_of_steps_6_to_8_and_prints_the_top_ops_once(tracked_runs):
    b = tracked_runs["b"]  # 2 ranks, 16 optimizer steps, --profile
    for rank in (0, 1):
        events = json.loads((b / "profile" / f"profile_{rank}.json").read_text())["traceEvents"]
        steps = sorted({e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")})
        assert steps == ["ProfilerStep#5", "ProfilerStep#6", "ProfilerStep#7"]  # torch counts from 0: steps 6-8
        assert any(e.get("name") == "aten::convolution_backward" for e in events)
    out = (b / "stdout.txt").read_text()
    heading = "--profile: the ten most expensive ops of optimizer steps 6-8, by self_cpu_time_total:\n"
    assert out.count(heading) == 1  # the main process only
    table = out.split(heading)[1].splitlines()
    assert table[0].startswith("---") and "Self CPU" in table[1] and table[2].startswith("---")
    assert all(row.strip() and not row.startswith("---") for row in table[3:13]) and table[13].startswith("---")
    assert not (tracked_runs["a0"] / "profile").exists()  # without --profile: no profiler at all


def test_a_meter_resumed_from_its_checkpointed_sums_logs_what_the_uninterrupted_meter_logs():
    """Four micro-batch losses, each with a named term `reg`, a log window after the second and a mid-epoch
    checkpoint after the third (its window open): a meter resumed from the sums the checkpoint stored (so_far,
    through JSON) logs the window of the third and fourth values as their mean and the epoch as the mean of all four,
    for the loss and the term, as the uninterrupted meter does (to 1e-7), and as computed here by hand."""
    from accelerate import Accelerator

    from utils.tracking import TrainMeter

    accelerator = Accelerator(cpu=True)
    losses = [torch.tensor(v) for v in (2.5, 2.25, 2.0, 1.5)]
    terms = [{"reg": torch.tensor(v)} for v in (0.5, 0.25, 0.0, 1.0)]
    whole, first = TrainMeter(torch.device("cpu"), 16), TrainMeter(torch.device("cpu"), 16)
    logged = {"whole": [], "resumed": []}
    for k, loss in enumerate(losses):
        whole.add(loss, terms[k])
        if k < 3:
            first.add(loss, terms[k])
        if k == 1:
            logged["whole"].append(whole.window(accelerator)[0])
            logged["resumed"].append(first.window(accelerator)[0])
    resumed = TrainMeter(torch.device("cpu"), 16, json.loads(json.dumps(first.so_far(accelerator))))
    resumed.add(losses[3], terms[3])
    for name, meter in (("whole", whole), ("resumed", resumed)):
        logged[name] += [meter.window(accelerator)[0], meter.end_epoch(accelerator)[0]]
    for name in ("whole", "resumed"):
        assert [means["loss"] for means in logged[name]] == pytest.approx([2.375, 1.75, 2.0625], abs=1e-7)
        assert [means["reg"] for means in logged[name]] == pytest.approx([0.375, 0.5, 0.4375], abs=1e-7)


def test_loss_terms_with_a_taken_name_another_shape_or_new_names_stop_with_one_line():
    """A loss term named like a train/* key of the loop's own, or not a one-element tensor, is one line at the first
    micro-batch; so are terms whose names change within the run, or differ from those a resumed checkpoint carried."""
    from utils import UserError
    from utils.tracking import TrainMeter

    one = torch.tensor(1.0)
    for terms, message in (({"lr": one}, "loss term 'lr': a term's name is an identifier, not one of loss, lr"),
                           ({"epoch_ce": one}, "not starting with epoch_"),
                           ({"ce": torch.ones(3)}, "loss term 'ce' must be a one-element tensor, as the loss is (got "
                                                   "Tensor(3,))"),
                           ({"ce": 0.5}, "(got float)")):
        with pytest.raises(UserError) as error:
            TrainMeter(torch.device("cpu"), 16).add(one, terms)
        assert message in str(error.value)
    meter = TrainMeter(torch.device("cpu"), 16)
    meter.add(one, {"ce": one})
    with pytest.raises(UserError, match="the loss terms changed names within the run"):
        meter.add(one, {"ce": one, "l2": one})
    carried = {"names": ["ce"], "epoch": [[1.0, 1.0], 1], "window": [[1.0, 1.0], 1]}
    with pytest.raises(UserError, match="the checkpoint resumed from has ce: resume with the script that saved it"):
        TrainMeter(torch.device("cpu"), 16, carried).add(one, {"focal": one})


def table_rows(run_dir: Path) -> list[dict]:
    """The last eval/predictions table of the run's (one) offline W&B run, read from the run_table artifact W&B
    staged for it: each row's cells by column, the image as an RGB array."""
    import numpy as np

    [folder] = (run_dir / "wandb").glob("offline-run-*")
    records = compare_runs.read_records(next(folder.glob("run-*.wandb")))
    [*_, table] = [r.artifact for r in records if r.WhichOneof("record_type") == "artifact"
                   and r.artifact.type == "run_table" and "evalpredictions" in r.artifact.name]
    files = {e.path: Path(e.local_path) for e in table.manifest.contents}
    [table_file] = [path for name, path in files.items() if name.endswith(".table.json")]
    content = json.loads(table_file.read_text())
    rows = [dict(zip(content["columns"], data)) for data in content["data"]]
    for row in rows:
        row["image"] = np.asarray(Image.open(files[row["image"]["path"]]).convert("RGB"))
    return rows


@pytest.mark.slow
def test_the_predictions_table_shows_the_misclassified_most_confident_first_as_predict_py_predicts_them_on_any_world(
        tmp_path):
    """--log-predictions 12 on a folder of 4 classes x 10 test PNGs: the end's table of a 2-rank run, and that of its
    last checkpoint evaluated again on 1 process (the same weights, its outputs written anew), hold the same 12 rows
    (index, true, predicted; probabilities to 1e-5). Each row's image is a test image's pixels; its true class is
    that image's folder, its predicted class and probability are predict.py's for that file (to 1e-4), and the rows
    are predict.py's 40 predictions sorted misclassified first, most confident first, cut at 12."""
    import numpy as np

    rng, classes = np.random.default_rng(0), ["ant", "bee", "cat", "dog"]
    for split, count in (("train", 24), ("test", 10)):
        for k, name in enumerate(classes):
            folder = tmp_path / "data" / split / name
            folder.mkdir(parents=True)
            for i in range(count):
                pixels = rng.integers(0, 120, (32, 32, 3)) + np.array([40 * k, 100 - 20 * k, 30])
                Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(folder / f"{i}.png")
    common = ["--data-dir", str(tmp_path / "data"), "--cache-dir", str(tmp_path / "cache"), "--model", "resnet8",
              "--batch-size", "8", "--global-batch-size", "16", "--epochs", "2", "--deterministic",
              "--no-channels-last", "--tracker", "wandb", "--log-predictions", "12"]
    result = run_train([*common, "--output-dir", str(tmp_path / "two")], launch=["--config_file", str(CPU_YAML)])
    assert result.returncode == 0, result.stderr[-3000:]
    shutil.copytree(tmp_path / "two", tmp_path / "one", ignore=lambda folder, names: [] if "checkpoints" in folder
                    else [n for n in names if n not in ("checkpoints", "config.yaml")])  # the checkpoints alone
    result = run_train([*common, "--output-dir", str(tmp_path / "one"), "--resume", "auto"])
    assert result.returncode == 0 and "its 2 epochs are trained" in result.stdout, result.stderr[-3000:]
    two, one = table_rows(tmp_path / "two"), table_rows(tmp_path / "one")
    assert len(two) == 12 and [(r["index"], r["true"], r["predicted"]) for r in two] == [
        (r["index"], r["true"], r["predicted"]) for r in one]
    assert [r["probability"] for r in two] == pytest.approx([r["probability"] for r in one], rel=1e-5)
    predicted = subprocess.run([sys.executable, "predict.py", str(tmp_path / "two"), str(tmp_path / "data" / "test"),
                                "--output", str(tmp_path / "p.jsonl")], cwd=REPO, env=script_env(),
                               capture_output=True, text=True, timeout=300)
    assert predicted.returncode == 0, predicted.stderr[-3000:]
    by_path = {row["path"]: row for row in map(json.loads, (tmp_path / "p.jsonl").read_text().splitlines())}
    pixels = {path: np.asarray(Image.open(tmp_path / "data" / "test" / path).convert("RGB")) for path in by_path}
    shown = [next(path for path, image in pixels.items() if np.array_equal(image, row["image"])) for row in two]
    for row, path in zip(two, shown, strict=True):
        assert row["true"] == path.split("/")[0]
        assert (row["predicted"], row["probability"]) == (by_path[path]["prediction"],
                                                         pytest.approx(by_path[path]["probability"], abs=1e-4))
    ranked = sorted(by_path, key=lambda p: (by_path[p]["prediction"] == p.split("/")[0], -by_path[p]["probability"]))
    assert shown == ranked[:12]
