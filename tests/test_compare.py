"""compare_runs.py's answer to "does group B beat group A?": the difference of the means with its 95% interval,
paired by seed or Welch's, and the verdict line; the settings that differ between groups and the mis-grouped run; the
group plots. The runs are real offline W&B runs and summary.json folders with known numbers; the expected intervals
are computed here from the textbook formulas and Student's t quantiles typed from a table."""

from __future__ import annotations

import json
import math
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, script_env

import compare_runs

# Student's t, two-sided 95% (the 0.975 quantile), from a table: df 2 and df 4
T_975 = {2: 4.302652729911275, 4: 2.7764451051977987}
METRICS = ("best_eval_top1", "eval_top1", "train_images_per_sec", "wall_seconds")

WRITE_WANDB_RUNS = """
import json, sys, wandb
for spec in json.loads(sys.argv[1]):
    run = wandb.init(mode="offline", dir=spec["dir"], group=spec["group"], name=spec["name"], config=spec["config"])
    for epoch, top1 in enumerate(spec["curve"], start=1):
        run.log({"epoch": epoch, "eval/top1": top1, "train/epoch_loss": 2.0 / epoch}, step=10 * epoch)
    run.summary.update(spec["summary"])
    run.finish()
"""


def summary(best, final, speed=1000.0, wall=60.0) -> dict:
    return dict(zip(METRICS, (best, final, speed, wall)), epochs_completed=2)


def write_wandb_runs(root: Path, specs: dict[str, tuple[str, dict, dict]]) -> list[Path]:
    """One output folder per run (name: (group, config, summary)), each holding one offline W&B run whose eval/top1
    curve ends at the summary's final top-1."""
    rows = []
    for name, (group, config, numbers) in specs.items():
        (root / name).mkdir(parents=True)
        rows.append({"dir": str(root / name), "group": group, "name": name, "config": config, "summary": numbers,
                     "curve": [numbers["eval_top1"] - 5, numbers["eval_top1"]]})
    result = subprocess.run([sys.executable, "-c", WRITE_WANDB_RUNS, json.dumps(rows)], cwd=REPO, env=script_env(),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return [root / name for name in specs]


def write_summary_runs(root: Path, specs: dict[str, tuple[str, dict, dict]]) -> list[Path]:
    """One output folder per run holding only summary.json, as a run with --tracker none leaves it."""
    for name, (group, config, numbers) in specs.items():
        (root / name).mkdir(parents=True)
        (root / name / "summary.json").write_text(json.dumps({**numbers, "config": {**config, "group": group}}))
    return [root / name for name in specs]


def compare(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "compare_runs.py", *map(str, args)], cwd=REPO, env=script_env(),
                          capture_output=True, text=True, timeout=300)


def verdict(stdout: str, head: str) -> str:
    [line] = [line for line in stdout.splitlines() if line.startswith(head)]
    return line


def interval(mean: float, se: float, df: int) -> tuple[float, float]:
    """The t interval: mean +/- t(0.975, df) x standard error."""
    return mean - T_975[df] * se, mean + T_975[df] * se


# Group A at lr 0.1 and group B at lr 0.2, the same three seeds: final top-1 B - A per seed 1.5, 1.0, 1.9
PAIRED_A = {0: 50.0, 1: 52.0, 2: 51.0}
PAIRED_B = {0: 51.5, 1: 53.0, 2: 52.9}


@pytest.mark.slow
def test_groups_that_ran_the_same_seeds_get_the_paired_interval_and_a_verdict(tmp_path):
    """`compare_runs.py` gives two groups that ran the same seeds the paired 95% interval of the difference, equal
    to 2 decimals to the textbook formula with tabled t quantiles."""
    specs = {f"a{s}": ("lr0.1", {"seed": s, "lr": 0.1}, summary(v + 1, v)) for s, v in PAIRED_A.items()}
    specs |= {f"b{s}": ("lr0.2", {"seed": s, "lr": 0.2}, summary(v + 1, v, speed=990.0 + s)) for s, v in
              PAIRED_B.items()}
    folders = write_wandb_runs(tmp_path, specs)
    result = compare(*folders, "--baseline", "lr0.1", "--plots", tmp_path / "plots")
    assert result.returncode == 0, result.stderr[-3000:]

    d = [PAIRED_B[s] - PAIRED_A[s] for s in PAIRED_A]
    mean, sd = statistics.fmean(d), statistics.stdev(d)
    low, high = interval(mean, sd / math.sqrt(3), df=2)
    assert low > 0  # the data were chosen so: B is better
    assert verdict(result.stdout, "lr0.2 - lr0.1: final top-1") == (
        f"lr0.2 - lr0.1: final top-1 {mean:+.2f} points (95% interval {low:+.2f} to {high:+.2f}, 3 paired seeds): "
        f"better")
    # images/s: B's 990, 991, 992 against A's 1000 each: paired differences -10, -9, -8
    low, high = interval(-9.0, 1.0 / math.sqrt(3), df=2)
    assert verdict(result.stdout, "lr0.2 - lr0.1: images/s") == (
        f"lr0.2 - lr0.1: images/s -9 (95% interval {low:+,.0f} to {high:+,.0f}, 3 paired seeds): slower")
    # wall time the same in every run: an interval of width 0 around 0
    assert verdict(result.stdout, "lr0.2 - lr0.1: wall time").endswith("(95% interval +0 to +0, 3 paired seeds): "
                                                                        "not distinguishable")
    assert "warning" not in result.stdout  # 3 runs per group, each differing only in its seed
    differs = result.stdout.split("config keys that differ between the groups:\n")[1].splitlines()
    assert differs[0].split() == ["config", "key", "lr0.1", "lr0.2"] and differs[1].split() == ["lr", "0.1", "0.2"]
    assert (tmp_path / "plots" / "groups_eval_top1_vs_epoch.png").is_file()
    assert (tmp_path / "plots" / "eval_top1_vs_epoch.png").is_file()  # the per-run plots beside them


def test_groups_of_other_seeds_get_welchs_interval(tmp_path):
    # A: seeds 0-2 at 50, 52, 54; B: seeds 3-5 at 51, 53, 55. Equal variances (4) and sizes (3): Welch's degrees of
    # freedom are exactly 2 x (3 - 1) = 4
    specs = {f"a{s}": ("A", {"seed": s}, summary(60.0, 50.0 + 2 * s)) for s in range(3)}
    specs |= {f"b{s}": ("B", {"seed": 3 + s}, summary(60.0, 51.0 + 2 * s)) for s in range(3)}
    result = compare(*write_summary_runs(tmp_path, specs), "--by-group", "--plots", tmp_path / "plots")
    assert result.returncode == 0, result.stderr[-3000:]
    se = math.sqrt(4 / 3 + 4 / 3)
    low, high = interval(1.0, se, df=4)
    assert verdict(result.stdout, "B - A: final top-1") == (
        f"B - A: final top-1 +1.00 points (95% interval {low:+.2f} to {high:+.2f}, unpaired (Welch), 3 and 3 runs): "
        f"not distinguishable")
    assert "groups: the same settings" in result.stdout  # seeds apart, nothing differs


def test_small_groups_are_warned_and_a_group_of_one_run_cannot_be_told(tmp_path):
    specs = {"a0": ("A", {"seed": 0}, summary(51.0, 50.0)), "a1": ("A", {"seed": 1}, summary(53.0, 52.0)),
             "b0": ("B", {"seed": 0}, summary(55.0, 54.0))}
    result = compare(*write_summary_runs(tmp_path, specs), "--baseline", "A", "--plots", tmp_path / "plots")
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert sum(line.startswith("warning: group A has 2 run(s)") for line in lines) == 1
    assert sum(line.startswith("warning: group B has 1 run(s)") for line in lines) == 1
    assert verdict(result.stdout, "B - A: final top-1") == (
        "B - A: final top-1: cannot tell (each group needs 2 runs or more with it)")


def test_a_run_that_differs_from_its_group_in_more_than_the_seed_is_flagged(tmp_path):
    specs = {f"a{s}": ("A", {"seed": s, "lr": 0.1, "epochs": 2}, summary(51.0, 50.0 + s)) for s in range(3)}
    specs["a2"][1]["lr"] = 0.4  # launched into group A by mistake
    specs |= {f"b{s}": ("B", {"seed": s, "lr": 0.1, "epochs": 3}, summary(51.0, 50.0 + s)) for s in range(3)}
    result = compare(*write_summary_runs(tmp_path, specs), "--baseline", "A", "--plots", tmp_path / "plots")
    assert result.returncode == 0, result.stderr[-3000:]
    warned = [line for line in result.stdout.splitlines() if line.startswith("warning: the runs of group")]
    assert warned == ["warning: the runs of group A differ in more than the seed (lr): a mis-grouped run? Its mean "
                      "mixes settings."]
    rows = {line.split()[0]: line.split()[1:] for line in
            result.stdout.split("config keys that differ between the groups:\n")[1].splitlines()[1:3]}
    assert rows == {"epochs": ["2", "3"], "lr": ["0.1", "|", "0.4", "0.1"]}


def test_an_unknown_baseline_stops_with_one_line_naming_the_groups(tmp_path):
    specs = {"a0": ("A", {"seed": 0}, summary(51.0, 50.0)), "b0": ("B", {"seed": 0}, summary(55.0, 54.0))}
    result = compare(*write_summary_runs(tmp_path, specs), "--baseline", "C", "--plots", tmp_path / "plots")
    assert result.returncode == 2 and result.stderr.strip() == (
        "error: --baseline C: no group of that name; the groups: A, B.")


def test_a_step_trained_in_one_wandb_folder_and_evaluated_in_the_next_keeps_both_in_the_charts():
    """A W&B run resumed in a new offline folder after a kill during an evaluation: its first part holds the step's
    training row, its second that step's evaluation (a row of its own). Merged, the step holds both: the loss chart
    and the top-1 chart each draw it, later values win where both parts hold a key."""
    first = compare_runs.Run("r", "id", history=[{"_step": 5, "train/loss": 2.0, "epoch": 1},
                                                 {"_step": 6, "train/loss": 1.9, "epoch": 1}])
    second = compare_runs.Run("r", "id", history=[{"_step": 6, "eval/top1": 40.0, "epoch": 1},
                                                  {"_step": 7, "train/loss": 1.8, "eval/top1": 41.0, "epoch": 2}])
    run = compare_runs.merge_lives([first, second])
    loss = compare_runs.figure([run], "_step", ("train/loss",), "train loss", by_group=False).axes[0].lines[0]
    assert list(loss.get_xdata()) == [5, 6, 7] and list(loss.get_ydata()) == [2.0, 1.9, 1.8]
    top1 = compare_runs.figure([run], "epoch", ("eval/top1",), "eval top-1 (%)", by_group=False).axes[0].lines[0]
    assert list(top1.get_xdata()) == [1, 2] and list(top1.get_ydata()) == [40.0, 41.0]


def test_the_group_plot_draws_each_groups_mean_in_a_band_from_its_lowest_to_its_highest_run():
    def run(name, group, top1s):
        history = [{"_step": 10 * e, "epoch": e, "eval/top1": v} for e, v in enumerate(top1s, start=1)]
        return compare_runs.Run(name, name, group=group, history=history)

    runs = [run("a0", "A", [10.0, 20.0]), run("a1", "A", [14.0, 30.0]), run("a2", "A", [12.0, 22.0]),
            run("b0", "B", [40.0, 41.0])]
    fig = compare_runs.figure(runs, "epoch", ("eval/top1",), "eval top-1 (%)", by_group=True)
    lines = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in fig.axes[0].lines}
    assert lines["A (mean of 3, band: min to max)"] == ([1, 2], [pytest.approx(12.0), pytest.approx(24.0)])
    assert lines["B"] == ([1, 2], [40.0, 41.0])  # a group of one run: its own curve
    [band] = fig.axes[0].collections
    ys = sorted({round(y, 6) for _, y in band.get_paths()[0].vertices})
    assert ys == [10.0, 14.0, 20.0, 30.0]  # min and max at each epoch


def test_best_top1_is_the_best_weights_top1_of_either_the_model_or_its_ema_else_the_best_logged():
    """The "best top-1 %" column: best_eval_top1 (--best-metric top1), else best_eval_ema_top1 (the default with
    --ema-decay), else the highest logged eval/top1 (a run whose best weights follow another metric)."""
    spec = compare_runs.COLUMNS["best top-1 %"]
    assert compare_runs.Run("a", "a", summary={"best_eval_top1": 51.0, "eval_top1": 50.0}).metric(*spec) == 51.0
    assert compare_runs.Run("e", "e", summary={"best_eval_ema_top1": 52.5, "eval_top1": 50.0}).metric(*spec) == 52.5
    by_loss = compare_runs.Run("l", "l", summary={"best_eval_loss": 1.2, "eval_top1": 50.0},
                               history=[{"_step": 8, "eval/top1": 47.0}, {"_step": 16, "eval/top1": 49.5}])
    assert by_loss.metric(*spec) == 49.5


def test_each_chart_names_its_metric_and_draws_every_run_under_a_legend_naming_its_model_first(tmp_path):
    """Every chart compare_runs.py writes, for two runs (a resnet8 at lr 0.001 logging its loss every 2 steps; a
    copy's own network, which has a class and no name, at lr 0.1, shorter than --log-every: epoch losses only): its
    y axis names the chart's metric, its legend names each run's model first and then the lr, the one setting else
    that differs, and each run's line holds exactly the points it logged (the short run's loss from its epoch
    means). The PNG files are the figures drawn here."""
    ft = compare_runs.Run("ft", "id-ft", config={"model": {"name": "resnet8", "class": "ResNet", "parameters": 78042},
                                                 "lr": 0.001, "epochs": 2}, history=[
        {"_step": 2, "train/loss": 2.0, "_timestamp": 100.0}, {"_step": 4, "train/loss": 1.5, "_timestamp": 101.0},
        {"_step": 4, "epoch": 1, "eval/top1": 40.0, "train/epoch_loss": 1.8, "_timestamp": 102.0},
        {"_step": 6, "train/loss": 1.2, "_timestamp": 103.0}, {"_step": 8, "train/loss": 1.0, "_timestamp": 104.0},
        {"_step": 8, "epoch": 2, "eval/top1": 55.0, "train/epoch_loss": 1.1, "_timestamp": 105.0}])
    own = compare_runs.Run("own", "id-own", config={"model": {"class": "MyNet", "parameters": 1000}, "lr": 0.1,
                                                    "epochs": 2}, history=[
        {"_step": 3, "epoch": 1, "eval/top1": 20.0, "train/epoch_loss": 2.2, "_timestamp": 50.0},
        {"_step": 6, "epoch": 2, "eval/top1": 30.0, "train/epoch_loss": 2.0, "_timestamp": 60.0}])
    legends = ["ft (resnet8; lr 0.001)", "own (MyNet; lr 0.1)"]
    expected = {  # file -> (y label, {legend: (xs, ys)})
        "eval_top1_vs_epoch.png": ("eval top-1 (%)", {legends[0]: ([1, 2], [40.0, 55.0]),
                                                      legends[1]: ([1, 2], [20.0, 30.0])}),
        "eval_top1_vs_wall_clock.png": ("eval top-1 (%)", {legends[0]: ([2.0, 5.0], [40.0, 55.0]),
                                                           legends[1]: ([0.0, 10.0], [20.0, 30.0])}),
        "train_loss_vs_step.png": ("train loss (every --log-every steps; else epoch means)",
                                   {legends[0]: ([2, 4, 6, 8], [2.0, 1.5, 1.2, 1.0]),
                                    legends[1]: ([3, 6], [2.2, 2.0])}),
        "train_epoch_loss_vs_epoch.png": ("train loss (epoch mean)", {legends[0]: ([1, 2], [1.8, 1.1]),
                                                                      legends[1]: ([1, 2], [2.2, 2.0])}),
    }
    assert [f[0] for f in compare_runs.FIGURES] == list(expected)
    for filename, x, y, y_label in compare_runs.FIGURES:
        fig = compare_runs.figure([ft, own], x, y, y_label, by_group=False)
        ax = fig.axes[0]
        drawn = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.lines}
        assert (ax.get_ylabel(), drawn) == expected[filename], filename
        assert [t.get_text() for t in ax.get_legend().get_texts()] == legends
        assert all(line.get_marker() == "o" for line in ax.lines)  # few points: each one drawn
    written = compare_runs.plot([ft, own], tmp_path, by_group=False)
    assert sorted(p.name for p in written) == sorted(expected) and all(p.stat().st_size > 0 for p in written)


def test_a_legend_names_the_flags_that_differ_not_the_settings_derived_from_them():
    """Two runs at lr 0.1 and 0.05, whose effective_lr and optimizer record (derived from the lr) differ too: each
    label names the model and the lr alone; two runs whose flags are the same but whose global batch differs (a
    derived setting) are told apart by it."""
    import compare_runs

    def run(name, lr, global_batch=128):
        optimizer = {"class": "SGD", "groups": [{"name": "all", "tensors": 9, "parameters": 77000, "lr": lr,
                                                 "weight_decay": 5e-4}]}
        return compare_runs.Run(name, f"id-{name}", config={"model": {"name": "resnet8", "class": "ResNet"}, "lr": lr,
                                                            "effective_lr": lr,
                                                            "optimizer": optimizer, "global_batch": global_batch})

    assert compare_runs.labels([run("a", 0.1), run("b", 0.05)]) == ["a (resnet8; lr 0.1)", "b (resnet8; lr 0.05)"]
    assert compare_runs.labels([run("a", 0.1), run("b", 0.1, 256)]) == ["a (resnet8; global_batch 128)",
                                                                       "b (resnet8; global_batch 256)"]


def test_runs_without_a_history_get_no_empty_chart_and_a_line_naming_them(tmp_path, capsys):
    """Two folders of summary.json alone: compare_runs.py prints their table, one line naming both as without
    curves, and writes no chart (an empty chart would claim a comparison it cannot draw). Given a history.jsonl (the
    one a --tracker none run writes; its last line cut short by a kill), a run's curve is drawn from it. Beside a run
    that logged a history, the charts are written with that run's curve alone in the legend."""
    import compare_runs

    folders = write_summary_runs(tmp_path, {"a": ("g", {"lr": 0.1}, summary(50.0, 49.0)),
                                            "b": ("g", {"lr": 0.2}, summary(52.0, 51.0))})
    assert compare_runs.main([*map(str, folders), "--plots", str(tmp_path / "plots")]) == 0
    out = capsys.readouterr().out
    assert f"no curves of {folders[0]}, {folders[1]}: neither a tracker's run nor a history.jsonl (a run's logged " \
           f"numbers, which the templates write) in the folder; summary.json holds the final numbers only" in \
           out.splitlines()
    assert "wrote" not in out and not (tmp_path / "plots").exists()
    (folders[1] / "history.jsonl").write_text('{"_step": 4, "_timestamp": 5.0, "epoch": 1, "eval/top1": 45.5}\n'
                                              '{"_step": 8, "_timestamp": 9.0, "epoch": 2, "eval/top1": 51.0}\n'
                                              '{"_step": 9, "_tim')
    fig = compare_runs.figure([compare_runs.load_summary(folder) for folder in folders], "epoch", ("eval/top1",),
                              "eval top-1 (%)", by_group=False)
    assert [(line.get_label(), list(line.get_xdata()), list(line.get_ydata())) for line in fig.axes[0].lines] == [
        ("b (lr 0.2)", [1, 2], [45.5, 51.0])]
    logged = compare_runs.Run("logged", "id-1", config={"lr": 0.3}, history=[
        {"_step": 4, "epoch": 1, "eval/top1": 40.0, "train/epoch_loss": 1.8, "_timestamp": 10.0}])
    runs = [logged, compare_runs.load_summary(folders[0])]
    written = compare_runs.plot(runs, tmp_path / "mixed", by_group=False)
    assert sorted(p.name for p in written) == sorted(f[0] for f in compare_runs.FIGURES)
    fig = compare_runs.figure(runs, "epoch", ("eval/top1",), "eval top-1 (%)", by_group=False)
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert legend == ["logged (lr 0.3)"] and [list(line.get_ydata()) for line in fig.axes[0].lines] == [[40.0]]


def test_a_summary_only_run_gives_the_model_and_optimizer_it_built_as_a_wandb_run_does(tmp_path):
    """A --tracker none run's config, read from summary.json, holds the model and optimizer records where its flags
    were and the run's facts (world size, precision, versions), as the tracker's config (a W&B run's) does; its other
    flags stay."""
    import compare_runs

    model = {"name": "resnet8", "class": "ResNet8", "parameters": 78042}
    optimizer = {"class": "SGD", "groups": [{"name": "all", "tensors": 9, "parameters": 77000, "lr": 0.1,
                                             "weight_decay": 5e-4}]}
    [folder] = write_summary_runs(tmp_path, {"run": ("g", {"model": "resnet8", "optimizer": "sgd", "lr": 0.1},
                                                     {**summary(50.0, 49.0), "model": model, "optimizer": optimizer,
                                                      "world_size": 2, "mixed_precision": "no",
                                                      "versions": {"torch": "2.14.1"}})})
    run = compare_runs.load_summary(folder)
    assert (run.config["model"], run.config["optimizer"], run.config["lr"]) == (model, optimizer, 0.1)
    assert (run.config["world_size"], run.config["mixed_precision"], run.config["versions"]) == (
        2, "no", {"torch": "2.14.1"})
    assert "eval_top1" not in run.config


def test_an_optimizer_record_differs_by_its_groups_lr_and_decay_not_by_the_models_parameter_counts():
    """Two runs of different models whose optimizers are SGD with the same lr and weight decay per group: the config
    table lists the model, not the optimizer; a third run with another lr in a group lists the optimizer too."""
    def sgd(parameters: int, lr: float) -> dict:
        return {"class": "SGD", "groups": [{"name": "all", "tensors": 9, "parameters": parameters, "lr": lr,
                                            "weight_decay": 5e-4},
                                           {"name": "all/no_decay", "tensors": 4, "parameters": parameters // 100,
                                            "lr": lr, "weight_decay": 0.0}]}

    runs = [compare_runs.Run(name, name, config={"model": {"name": name, "class": "ResNet"}, "optimizer": optimizer})
            for name, optimizer in (("resnet8", sgd(77_000, 0.1)), ("resnet18", sgd(11_000_000, 0.1)),
                                    ("resnet9", sgd(6_000_000, 0.05)))]
    assert compare_runs.differing(runs[:2]) == ["model"]
    assert compare_runs.differing(runs) == ["model", "optimizer"]


def test_the_group_table_names_each_groups_model_whole():
    """The settings table of two groups shows the model record's name whole (a timm name of 44 characters), not cut
    at the table's width; an optimizer record shows its class and each group's lr and weight decay."""
    name = "vit_small_patch16_224.augreg_in21k_ft_in1k_x"
    runs = [compare_runs.Run(f"{g}{s}", f"{g}{s}", group=g, config={"seed": s, "model": record})
            for g, record in (("A", {"name": name, "class": "VisionTransformer", "parameters": 21_000_000}),
                              ("B", {"class": "VisionTransformer", "parameters": 21_000_000}))
            for s in (0, 1)]
    text, notes = compare_runs.group_differences(compare_runs.by_group_of(runs))
    assert notes == []
    [row] = [line for line in text.splitlines() if line.startswith("model")]
    assert row.split() == ["model", name, "VisionTransformer"]
    sgd = {"class": "SGD", "groups": [{"tensors": 62, "parameters": 11, "lr": 0.1, "weight_decay": 5e-4},
                                      {"tensors": 2, "parameters": 3, "lr": 0.01, "weight_decay": 0.0}]}
    assert compare_runs._cell(sgd, 48) == "SGD (lr 0.1 wd 0.0005 / lr 0.01 wd 0)"  # an optimizer: its groups' lr, wd


def test_runs_evaluated_on_other_images_are_warned_in_one_line_and_runs_on_the_same_images_are_not(tmp_path, capsys):
    """Two runs on the test split's 10,000 images (one an offline W&B run, one a summary.json folder) and one on the
    first 1,000 of them (--eval-subset): one warning line after the table names each group of runs (the W&B run by
    its name) and what it evaluated on. The two on the same images alone get no warning; nor does a run with no final
    numbers yet."""
    on = {"a": ("test", 10000), "b": ("test", 10000), "c": ("test", 1000)}
    specs = {name: ("g", {"lr": 0.1, "eval_subset": n if n < 10000 else None},
                    {**summary(50.0, 49.0), "dataset": {"source": "cifar10", "eval_split": split}, "eval_examples": n})
             for name, (split, n) in on.items()}
    folders = [*write_wandb_runs(tmp_path / "wandb", {"a": specs["a"]}),
               *write_summary_runs(tmp_path, {k: specs[k] for k in "bc"})]
    assert compare_runs.main([*map(str, folders), "--plots", str(tmp_path / "plots")]) == 0
    warned = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning")]
    assert warned == [f"warning: the runs were evaluated on different images (a, {folders[1]} on test: "
                      f"10,000 images; {folders[2]} on test: 1,000 images): their top-1 are not comparable"]
    (folders[2] / "summary.json").unlink()
    (folders[2] / "history.jsonl").write_text('{"_step": 4, "_timestamp": 5.0, "epoch": 1, "eval/top1": 45.5}\n')
    assert compare_runs.main([*map(str, folders), "--plots", str(tmp_path / "plots")]) == 0
    assert not [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning")]


def test_a_folder_of_trial_folders_is_ranked_by_eval_top1_and_the_best_setting_is_judged_against_the_runner_up(
        tmp_path):
    """A sweep's output folder (one folder per trial, as <output-dir>/<run id>): the trials ranked by their final
    eval/top1, highest first; lr 0.2 (best mean) against lr 0.1 (runner-up), each 3 seeds, gets the paired verdict; a
    setting run once, or an unreachable W&B sweep, is one line."""
    specs = {f"t{lr}-{seed}": (None, {"lr": lr, "seed": seed}, summary(60.0, top1))
             for lr, runs in ((0.1, PAIRED_A), (0.2, PAIRED_B)) for seed, top1 in runs.items()}
    specs["t0.05-0"] = (None, {"lr": 0.05, "seed": 0}, summary(60.0, 40.0))
    write_summary_runs(tmp_path / "sweep", specs)
    result = compare(tmp_path / "sweep", "--plots", tmp_path / "plots")
    assert result.returncode == 0, result.stderr[-3000:]
    ranked = [line.split(". ", 1)[1] for line in result.stdout.splitlines() if re.match(r"^\s+\d+\. ", line)]
    by_top1 = sorted(specs, key=lambda name: -specs[name][2]["eval_top1"])
    assert [line.split(" (")[0] for line in ranked] == [str(tmp_path / "sweep" / name) for name in by_top1]
    assert [float(line.rsplit(" ", 1)[1]) for line in ranked] == [specs[name][2]["eval_top1"] for name in by_top1]
    diffs = [PAIRED_B[s] - PAIRED_A[s] for s in range(3)]
    low, high = interval(statistics.fmean(diffs), statistics.stdev(diffs) / math.sqrt(3), df=2)
    assert "best setting by mean eval/top1: lr 0.2; against the runner-up, lr 0.1:" in result.stdout
    assert verdict(result.stdout, "lr 0.2 - lr 0.1: final top-1") == (
        f"lr 0.2 - lr 0.1: final top-1 {statistics.fmean(diffs):+.2f} points (95% interval {low:+.2f} to {high:+.2f}, "
        f"3 paired seeds): better")
    once = compare(*(tmp_path / "sweep" / name for name in ("t0.1-0", "t0.05-0")), "--rank-by", "eval/top1",
                   "--plots", tmp_path / "plots")
    assert "the best setting (lr 0.1) and the runner-up (lr 0.05) ran 1 and 1 seed(s)" in once.stdout
    offline = compare("wandb:team/project/sweeps/abc123", "--plots", tmp_path / "plots")
    assert offline.returncode == 2 and offline.stderr.startswith("error: cannot read W&B sweep team/project/sweeps/")
    assert len(offline.stderr.strip().splitlines()) == 1
