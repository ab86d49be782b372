"""The SLURM scripts without SLURM: their launch logic runs with the SLURM environment set by the test, and
fake `srun`/`scontrol` commands (srun runs its command once on this machine; scontrol names 127.0.0.1 as
the head node and records a requeue)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time

import psutil
import pytest
from conftest import REPO, read_summary, script_env

SLURM = REPO / "slurm"
JOB = ["--model", "resnet18_imagenet", "--train-subset", "256", "--eval-subset", "50", "--batch-size", "32",
       "--epochs", "2", "--checkpoint-every-steps", "2", "--tracker", "none"]


@pytest.fixture
def fake_slurm(tmp_path) -> dict:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f"""#!/usr/bin/env bash
case "$1 $2" in
  "show hostnames") echo 127.0.0.1 ;;
  *) echo "$@" >> {tmp_path}/scontrol.log ;;
esac
""")
    (bin_dir / "srun").write_text("""#!/usr/bin/env bash
while [[ "$1" == --* ]]; do shift; done   # drop srun's options; run the command once, here
exec "$@"
""")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return script_env(PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_NODELIST="node[1-2]", SLURM_JOB_ID="4242",
                      SLURM_SUBMIT_DIR=str(REPO), MAIN_PORT=str(port), MIXED_PRECISION="no")


@pytest.mark.parametrize("script", sorted(SLURM.iterdir()), ids=lambda p: p.name)
def test_slurm_scripts_parse(script):
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0


@pytest.mark.slow
@pytest.mark.parametrize("script, model", [("train_minimal.py", "resnet18"), ("train_vit.py", "vit_micro")])
def test_launch_logic_starts_two_fake_nodes_as_one_world_of_two_for_the_script_named_in_script(
        script, model, fake_slurm, cifar_dir, cache_dir, tmp_path):
    # SCRIPT= one of the others (the sbatch test below runs the default, train_cifar.py, through the same launch.sh).
    # The minimal script has no --cache-dir: with a read-only data folder it caches under $XDG_CACHE_HOME.
    (tmp_path / "xdg").mkdir()
    (tmp_path / "xdg" / "accelerate-cifar").symlink_to(cache_dir, target_is_directory=True)
    out = tmp_path / "two_nodes"
    model_flag = ["--model", model] if script == "train_vit.py" else []  # the minimal script has one model
    nodes = [subprocess.Popen(["bash", str(SLURM / "launch.sh"), "--", "--data-dir", str(cifar_dir), "--output-dir",
                               str(out), "--train-subset", "64", "--eval-subset", "20", "--batch-size", "16",
                               "--epochs", "1", "--tracker", "none", *model_flag],
                              # static: with c10d both fake nodes, being one host, would each try to host the store
                              env={**fake_slurm, "SLURM_NNODES": "2", "SLURM_NODEID": str(rank), "GPUS_PER_NODE": "1",
                                   "RDZV_BACKEND": "static", "SCRIPT": script,
                                   "XDG_CACHE_HOME": str(tmp_path / "xdg")},
                              cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in (0, 1)]
    results = [n.communicate(timeout=180) for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], results[0][1][-3000:] + results[1][1][-3000:]
    s = read_summary(out)
    assert s["world_size"] == 2 and s["eval_examples"] == 20 and s["config"]["resume"] == "auto"
    assert s["config"]["model"] == model
    checkpoint = "checkpoint_0" if script == "train_minimal.py" else "step-00000002"  # 64 images, 2 x 16 per step
    assert (out / "checkpoints" / checkpoint).is_dir()


@pytest.mark.slow
def test_sbatch_script_checkpoints_and_requeues_on_the_preemption_signal(fake_slurm, cifar_dir, cache_dir, tmp_path):
    out = tmp_path / "preempted"
    env = {**fake_slurm, "SLURM_NNODES": "1", "SLURM_NODEID": "0", "SLURM_GPUS_ON_NODE": "2"}
    args = ["bash", str(SLURM / "train_1node.sbatch"), "--data-dir", str(cifar_dir), "--cache-dir", str(cache_dir),
            "--output-dir", str(out), *JOB]
    job = subprocess.Popen(args, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = out / "checkpoints" / "step-00000002" / "trainer_state.json"
    deadline = time.time() + 300
    while not first.exists():
        assert job.poll() is None and time.time() < deadline, job.communicate()[1][-3000:]
        time.sleep(0.05)
    job.send_signal(signal.SIGUSR1)  # what `#SBATCH --signal=B:USR1@120` delivers to the batch shell
    stdout, stderr = job.communicate(timeout=120)
    assert job.returncode == 0, stderr[-3000:]
    assert (tmp_path / "scontrol.log").read_text().split() == ["requeue", "4242"]
    assert not (out / "summary.json").exists()
    assert any(int(p.name[5:]) > 2 for p in (out / "checkpoints").glob("step-*")), stdout[-2000:]

    again = subprocess.run(args, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)  # the requeued job
    assert again.returncode == 0, again.stderr[-3000:]
    s = read_summary(out)
    assert s["resumed_from"] and s["global_step"] == 2 * 256 // 64 and s["world_size"] == 2


def test_seed_array_gives_each_task_its_seed_group_folder_and_port_and_requeues_on_the_signal(fake_slurm, tmp_path):
    """srun replaced by one that prints what it was asked to run (then sleeps): the array's arguments and its
    requeue, without training."""
    (tmp_path / "bin" / "srun").write_text('#!/usr/bin/env bash\necho "port=$MAIN_PORT $*"\n')
    env = {k: v for k, v in fake_slurm.items() if k != "MAIN_PORT"}
    env |= {"SLURM_ARRAY_TASK_ID": "3", "GROUP": "lr0.1", "RUNS": str(tmp_path / "runs")}
    result = subprocess.run(["bash", str(SLURM / "train_seeds.sbatch"), "--lr", "0.1", "--seed", "9"], env=env,
                            cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == [
        "port=29503", "--kill-on-bad-exit=1", "bash", f"{REPO}/slurm/launch.sh", "--", "--lr", "0.1", "--seed", "9",
        "--seed", "3", "--group", "lr0.1", "--output-dir", f"{tmp_path}/runs/lr0.1/seed-3"]  # the last --seed wins
    # SLURM's signal to the batch shell (the task's own process) requeues the task, as for train_1node.sbatch
    (tmp_path / "bin" / "srun").write_text('#!/usr/bin/env bash\necho started; exec sleep 60\n')
    task = subprocess.Popen(["bash", str(SLURM / "train_seeds.sbatch")], env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert task.stdout.readline() == "started\n"
    task.send_signal(signal.SIGUSR1)
    assert task.wait(timeout=30) == 0 and (tmp_path / "scontrol.log").read_text().split() == ["requeue", "4242"]
    task.stdout.close()
    task.stderr.close()
    del env["SLURM_ARRAY_TASK_ID"]
    result = subprocess.run(["bash", str(SLURM / "train_seeds.sbatch")], env=env, cwd=tmp_path, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode != 0 and "submit as an array: sbatch --array=0-4" in result.stderr


@pytest.mark.slow
def test_a_seed_array_task_trains_its_seed_in_the_group_into_its_own_folder(fake_slurm, cifar_dir, cache_dir,
                                                                            tmp_path):
    env = {**fake_slurm, "SLURM_NNODES": "1", "SLURM_NODEID": "0", "SLURM_GPUS_ON_NODE": "1",
           "SLURM_ARRAY_TASK_ID": "2", "GROUP": "lr0.1", "RUNS": str(tmp_path / "runs")}
    result = subprocess.run(["bash", str(SLURM / "train_seeds.sbatch"), "--data-dir", str(cifar_dir), "--cache-dir",
                             str(cache_dir), "--model", "resnet8", "--train-subset", "64", "--eval-subset",
                             "20", "--batch-size", "32", "--epochs", "1", "--tracker", "none"],
                            env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    s = read_summary(tmp_path / "runs" / "lr0.1" / "seed-2")
    assert (s["config"]["seed"], s["config"]["group"], s["world_size"], s["global_step"]) == (2, "lr0.1", 1, 2)


FAKE_AGENT = """#!/usr/bin/env bash
# `wandb agent ...`: one trial, started as the agent starts it (its environment, --key=value flags), or nothing
[ -n "${FAKE_AGENT_IDLE:-}" ] && exit 0
export WANDB_SWEEP_ID=swp00001 WANDB_RUN_ID=$FAKE_TRIAL
exec python -m accelerate.commands.launch --config_file accelerate_configs/cpu.yaml --main_process_port 0 \\
    train_cifar.py $FAKE_ARGS
"""


def wait_for(path, proc, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while not path.exists():
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.05)


@pytest.mark.slow
def test_a_preempted_sweep_trial_is_marked_and_continued_exactly_by_the_requeued_task_a_stopped_one_is_not(
        fake_slurm, cifar_dir, cache_dir, tmp_path):
    """slurm/sweep_agents.sbatch with a fake `wandb agent` that starts one trial as the agent does: SLURM's USR1 to
    the batch shell marks the running trial (.requeue), stops it after a checkpoint and requeues the task; a trial
    its agent stops itself (SIGTERM, as hyperband's early termination) is not marked. The requeued task continues
    the marked trial alone before its agent starts, and it ends with the trainable parameters of the same trial run
    uninterrupted, bitwise (2 ranks, --deterministic)."""
    from conftest import CPU_YAML, assert_same_parameters, run_train

    (tmp_path / "bin" / "wandb").write_text(FAKE_AGENT)
    (tmp_path / "bin" / "wandb").chmod(0o755)
    trials = tmp_path / "trials"
    flags = ["--data-dir", str(cifar_dir), "--cache-dir", str(cache_dir), "--model", "resnet8", "--train-subset",
             "256", "--eval-subset", "50", "--batch-size", "16", "--global-batch-size", "32", "--epochs", "2",
             "--checkpoint-every-steps", "3", "--deterministic", "--tracker", "none"]
    agent_args = " ".join([*flags, f"--output_dir={trials}"])
    env = {**fake_slurm, "LAUNCH_CONFIG": str(CPU_YAML), "FAKE_ARGS": agent_args}
    task = ["bash", str(SLURM / "sweep_agents.sbatch"), "team/proj/swp00001", "1", str(trials)]

    for trial, stop in (("stopped", "agent"), ("preempted", "slurm")):  # a task's start continues a marked trial
        proc = subprocess.Popen(task, cwd=REPO, env={**env, "FAKE_TRIAL": trial}, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        wait_for(trials / trial / "checkpoints" / "step-00000003" / "trainer_state.json", proc)
        if stop == "slurm":
            proc.send_signal(signal.SIGUSR1)  # --signal=B:USR1@120: to the batch shell
        else:
            [agent] = [p for p in psutil.Process(proc.pid).children() if "accelerate" in " ".join(p.cmdline())]
            agent.send_signal(signal.SIGTERM)  # the agent stopping its trial
        out, err = proc.communicate(timeout=120)
        assert not (trials / trial / "summary.json").exists(), err[-3000:]
    assert (trials / "preempted" / ".requeue").exists() and not (trials / "stopped" / ".requeue").exists()
    assert (tmp_path / "scontrol.log").read_text().splitlines() == ["requeue 4242"]  # the preempted task only

    again = subprocess.run(task, cwd=REPO, env={**env, "FAKE_AGENT_IDLE": "1"}, capture_output=True, text=True,
                           timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"continuing the preempted trial {trials / 'preempted'}" in again.stdout
    assert read_summary(trials / "preempted")["resumed_from"] is not None
    assert not (trials / "preempted" / ".requeue").exists() and not (trials / "stopped" / "summary.json").exists()
    reference = tmp_path / "reference"
    result = run_train([*flags, "--output-dir", str(reference)], launch=["--config_file", str(CPU_YAML)])
    assert result.returncode == 0, result.stderr[-3000:]
    assert_same_parameters(trials / "preempted", reference)
