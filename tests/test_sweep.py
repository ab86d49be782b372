"""W&B sweeps run as W&B documents them: each trial started by wandb's own agent code (`wandb.wandb_agent.Agent`'s
command for a trial, its environment, `${args}` as `--key=value`), offline, nothing mocked. A trial trains in its own
folder with its own values and W&B run; started again with its run id it continues exactly; sweeps/ holds configs
whose every parameter is a flag of their program."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import yaml
from conftest import CPU_YAML, REPO, assert_same_parameters, read_summary, script_env

import compare_runs
import train_cifar
from utils.cli import build_parser

SWEEP_ID = "sweeptst"
# The trials' fixed values, as a sweep's `parameters: {name: {value: ...}}` give them (the CHECKPOINT_JOB's shape:
# 8 steps an epoch on 2 ranks, a checkpoint every 3 steps), and the grid point each trial adds.
FIXED = {"model": "resnet8", "train_subset": 256, "eval_subset": 50, "batch_size": 16, "global_batch_size": 32,
         "epochs": 2, "checkpoint_every_steps": 3, "deterministic": True, "channels_last": False, "log_every": 1,
         "tta_flip": True}


def grid_command() -> list[str]:
    """sweeps/cifar_grid.yaml's command, on this machine: the CPU launch config and a free port, `accelerate launch` as
    `python -m accelerate.commands.launch` (the console script may not be on PATH)."""
    command = yaml.safe_load((REPO / "sweeps" / "cifar_grid.yaml").read_text())["command"]
    assert command[:3] == ["${env}", "accelerate", "launch"] and command[-2:] == ["${program}", "${args}"]
    return ["${env}", "python", "-m", "accelerate.commands.launch", "--config_file", str(CPU_YAML),
            "--main_process_port", "0", *command[5:]]


class Agent:
    """wandb's sweep agent, its trials started by its own `_command_run` (what `wandb agent` does with each trial the
    server sends: the command with `${args}` expanded, WANDB_RUN_ID, WANDB_SWEEP_PARAM_PATH), in the environment a
    `wandb agent SWEEP_ID` process has (WANDB_SWEEP_ID, WANDB_DIR); W&B offline."""

    def __init__(self, monkeypatch, tmp_path: Path):
        from wandb.wandb_agent import Agent as WandbAgent

        for name in [k for k in os.environ if k.startswith(("WANDB_", "ACCELERATE_"))]:
            monkeypatch.delenv(name)
        for name, value in {**script_env(), "WANDB_SWEEP_ID": SWEEP_ID, "WANDB_DIR": str(tmp_path / "agent"),
                            "WANDB_PROJECT": "sweep-test", "WANDB_RUN_ID": "", "WANDB_SWEEP_PARAM_PATH": ""}.items():
            monkeypatch.setenv(name, value)  # the agent sets the last two per trial: restored after the test
        monkeypatch.chdir(REPO)
        (tmp_path / "agent").mkdir(exist_ok=True)
        self.agent = WandbAgent(None, None, sweep_id=SWEEP_ID)
        self.agent._sweep_command = grid_command()

    def start(self, run_id: str, values: dict) -> psutil.Popen:
        self.agent._command_run({"run_id": run_id, "program": "train_cifar.py",
                                 "args": {k: {"value": v} for k, v in values.items()}})
        return self.agent._run_processes[run_id]._popen

    def run(self, run_id: str, values: dict) -> int:
        return self.start(run_id, values).wait(timeout=600)


def trial_values(cifar_dir, cache_dir, out, **point) -> dict:
    return {"data_dir": str(cifar_dir), "cache_dir": str(cache_dir), "output_dir": str(out), **FIXED, **point}


def wandb_runs(agent_dir: Path, run_id: str) -> list[Path]:
    return sorted((agent_dir / "wandb").glob(f"offline-run-*-{run_id}"))


def run_record(folder: Path):
    records = compare_runs.read_records(next(folder.glob("*.wandb")))
    return next(r.run for r in records if r.WhichOneof("record_type") == "run")


@pytest.fixture(scope="module")
def sweep_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("sweep")


@pytest.mark.slow
def test_each_trial_trains_its_own_values_in_its_own_folder_as_its_agents_w_and_b_run(cifar_dir, cache_dir,
                                                                                        sweep_dir, monkeypatch,
                                                                                        capfd):
    """Two trials of sweeps/cifar_grid.yaml's grid, started as the agent starts them (parameters named as config
    keys, booleans as `--tta_flip=True` and `--channels_last=False`), both with the same --output-dir: each trains in
    <output-dir>/<its run id> and says so, with its own lr and weight decay; each has one offline W&B run, whose id is
    the agent's and whose sweep is the agent's, with the trial's values in its config."""
    agent, out = Agent(monkeypatch, sweep_dir), sweep_dir / "runs"
    points = {"trial0aa": {"lr": 0.05, "weight_decay": 0.0001}, "trial0bb": {"lr": 0.02, "weight_decay": 0.001}}
    for run_id, point in points.items():
        status = agent.run(run_id, trial_values(cifar_dir, cache_dir, out, **point))
        printed = capfd.readouterr()
        assert status == 0, printed.err[-3000:]
        assert f"W&B sweep {SWEEP_ID}: trial {run_id} trains in {out / run_id}" in printed.out
    assert sorted(p.name for p in out.iterdir()) == sorted(points)
    for run_id, point in points.items():
        summary = read_summary(out / run_id)
        assert {k: summary["config"][k] for k in point} == point
        assert (summary["config"]["tta_flip"], summary["config"]["channels_last"]) == (True, False)
        assert summary["global_step"] == 16 and summary["world_size"] == 2
        [folder] = wandb_runs(sweep_dir / "agent", run_id)  # one W&B run: only the main process talks to W&B
        record = run_record(folder)
        assert (record.run_id, record.sweep_id, record.project) == (run_id, SWEEP_ID, "sweep-test")
        [run] = compare_runs.load(str(out / run_id))  # found through the trial folder's wandb_runs.txt
        assert run.id == run_id and {k: run.config[k] for k in point} == point
    losses = [read_summary(out / run_id)["eval_loss"] for run_id in points]
    assert losses[0] != losses[1]  # two trainings, not one run's outputs twice


@pytest.mark.slow
def test_a_trial_killed_and_started_again_with_its_run_id_continues_its_folder_exactly(cifar_dir, cache_dir,
                                                                                      sweep_dir, monkeypatch,
                                                                                      capfd):
    """The first trial's values under a new run id, killed with kill -9 (launcher and ranks) after its step-3
    checkpoint and started again by the agent with the same run id: it resumes from its own folder (--resume auto
    by itself under an agent) and ends with the uninterrupted trial's trainable parameters bitwise; its W&B run is
    the same run id in both lives."""
    agent, out = Agent(monkeypatch, sweep_dir), sweep_dir / "runs"
    values = trial_values(cifar_dir, cache_dir, out, lr=0.05, weight_decay=0.0001)
    first = agent.start("trial0cc", values)
    done = out / "trial0cc" / "checkpoints" / "step-00000003" / "trainer_state.json"
    deadline = time.time() + 300
    while not done.exists():
        assert first.poll() is None and time.time() < deadline, capfd.readouterr().err[-3000:]
        time.sleep(0.02)
    job = [*psutil.Process(first.pid).children(recursive=True), psutil.Process(first.pid)]
    for process in job:
        process.kill()
    first.wait(timeout=60)
    psutil.wait_procs(job, timeout=10)
    assert first.returncode == -signal.SIGKILL
    capfd.readouterr()
    assert agent.run("trial0cc", values) == 0, capfd.readouterr().err[-3000:]
    assert "resumed from" in capfd.readouterr().out
    summary = read_summary(out / "trial0cc")
    assert summary["resumed_from"] is not None and summary["global_step"] == 16
    assert_same_parameters(out / "trial0cc", out / "trial0aa")
    lives = wandb_runs(sweep_dir / "agent", "trial0cc")
    assert len(lives) == 2  # both lives' folders carry the run id; a kill -9 may leave the first without records
    assert (run_record(lives[-1]).run_id, run_record(lives[-1]).sweep_id) == ("trial0cc", SWEEP_ID)


@pytest.mark.parametrize("name", ["cifar_grid.yaml", "finetune_bayes.yaml"])
def test_every_sweep_config_maximises_eval_top1_with_hyperband_over_flags_of_its_program(name):
    """A sweep file names its program, maximises eval/top1 (the key the templates log at each evaluation) with
    hyperband early termination, and each of its parameters is a flag of the program under its config key's name,
    taking each value the sweep can give it (every grid or listed value, a distribution's bounds)."""
    sweep = yaml.safe_load((REPO / "sweeps" / name).read_text())
    assert sweep["program"] == "train_cifar.py" and sweep["metric"] == {"name": "eval/top1", "goal": "maximize"}
    assert sweep["early_terminate"]["type"] == "hyperband" and sweep["early_terminate"]["min_iter"] >= 1
    assert sweep["command"][-2:] == ["${program}", "${args}"]
    keys = {action.dest for action in build_parser(train_cifar.Config, "")._actions}
    for key, spec in sweep["parameters"].items():
        assert key in keys, f"{name}: {key} is not a config key of {sweep['program']}"
        values = spec.get("values") or ([spec["value"]] if "value" in spec else [spec["min"], spec["max"]])
        for value in values:
            train_cifar.parse_config([f"--{key}={value}"])  # as ${args} passes it: refused values raise
    if sweep["method"] == "grid":
        assert all("values" in spec or "value" in spec for spec in sweep["parameters"].values())


def test_the_agent_scripts_parse():
    for script in (REPO / "sweeps" / "agents.sh", REPO / "slurm" / "sweep_agents.sbatch"):
        assert subprocess.run(["bash", "-n", str(script)]).returncode == 0, script
