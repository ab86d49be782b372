"""Every shipped accelerate config: loaded by Accelerate's own loader, consistent, documented, and the
CPU-runnable ones launched (cpu.yaml runs in most tests; the multi-node file runs here as 2 machines on loopback)."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest
from accelerate.commands.config.config_args import load_config_from_file
from conftest import (
    CPU_YAML,
    LAUNCHER,
    REPO,
    Forked,
    cpu_bf16_native_here,
    launch_argv,
    read_summary,
    run_python,
    script_env,
)

CONFIGS = sorted((REPO / "accelerate_configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_loads_with_accelerates_loader_and_is_consistent(path):
    config = load_config_from_file(str(path))  # unknown keys raise
    assert config.num_processes >= config.num_machines >= 1
    assert config.num_processes % config.num_machines == 0, "processes must split evenly over machines"
    assert 0 <= config.machine_rank < config.num_machines
    if config.num_processes > 1:
        assert config.distributed_type.value in ("MULTI_GPU", "FSDP"), "only a multi-process type starts N processes"
    lines = path.read_text().splitlines()
    assert lines[0].startswith("# Hardware: "), "each file opens with the hardware it is for"
    assert any(f"accelerate launch --config_file accelerate_configs/{path.name}" in line for line in lines[:6]), \
        "and the exact launch command"


# What each file's name and "# Hardware:" line promise: machines, GPUs per machine (0: CPU only), wrapper, precision.
HARDWARE = {
    "1gpu.yaml": (1, 1, "NO", "bf16"),
    "4gpu.yaml": (1, 4, "MULTI_GPU", "bf16"),
    "8gpu.yaml": (1, 8, "MULTI_GPU", "bf16"),
    "2node_16gpu.yaml": (2, 8, "MULTI_GPU", "bf16"),
    "fsdp_4gpu.yaml": (1, 4, "FSDP", "bf16"),
    "fsdp_8gpu.yaml": (1, 8, "FSDP", "bf16"),
    "cpu.yaml": (1, 0, "MULTI_GPU", "no"),
    "fsdp_cpu.yaml": (1, 0, "FSDP", "no"),
}
WORDS = {"one": 1, "2": 2, "4": 4, "8": 8}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_process_count_and_precision_match_the_hardware_the_file_names(path):
    machines, gpus, kind, precision = HARDWARE[path.name]  # a new YAML must be added here
    config = load_config_from_file(str(path))
    hardware = path.read_text().splitlines()[0].lower()
    assert (config.num_machines, config.distributed_type.value, config.mixed_precision) == (machines, kind, precision)
    assert config.num_processes == (machines * gpus if gpus else 2)  # CPU files: 2 gloo processes
    assert not config.use_cpu  # use_cpu starts a single process (see cpu.yaml)
    if gpus:
        # "... 4 NVIDIA GPUs", "one NVIDIA GPU", "2 machines x 8 NVIDIA"
        said = hardware.split("nvidia gpu")[0].split()[-1]
        assert WORDS[said] == gpus and "bf16" in hardware, hardware
        assert path.stem.endswith(f"{machines * gpus}gpu")
        assert machines == 1 or hardware.startswith(f"# hardware: {machines} machines x {gpus}")
    else:
        assert "no gpu" in hardware and path.stem.endswith("cpu")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_two_machines(script: Path, args: list[str], num_processes=(2, 2), timeout=300) -> list[tuple[int, str, str]]:
    """Two launcher processes = two machines on loopback from the shipped multi-node YAML, with command-line
    overrides for ip, counts and device; num_processes is what each machine's command says. Returns
    (exit status, stdout, stderr) per machine."""
    port, launchers = _free_port(), []
    for rank, processes in enumerate(num_processes):
        cmd = [*LAUNCHER, "--config_file",
               str(REPO / "accelerate_configs" / "2node_16gpu.yaml"),
               "--num_machines", "2", "--num_processes", str(processes), "--machine_rank", str(rank),
               "--main_process_ip", "127.0.0.1",
               "--main_process_port", str(port), "--mixed_precision", "no", str(script), *args]
        launchers.append(Forked(cmd, script_env()))
    return [(p.wait(timeout), *p.communicate()) for p in launchers]


@pytest.mark.slow
def test_two_machines_on_loopback_train_together_from_the_multinode_config(cifar_dir, cache_dir, tmp_path):
    out = tmp_path / "two_nodes"
    results = launch_two_machines(REPO / "train_cifar.py", [
        "--data-dir", str(cifar_dir), "--cache-dir", str(cache_dir), "--output-dir", str(out),
        "--model", "resnet8", "--train-subset", "256", "--eval-subset", "50", "--batch-size", "32",
        "--epochs", "1", "--tracker", "none"])
    assert [r[0] for r in results] == [0, 0], results[0][2][-3000:] + results[1][2][-3000:]
    s = read_summary(out)
    assert (s["world_size"], s["distributed_type"], s["wrapper"]) == (2, "MULTI_CPU", "DistributedDataParallel")
    assert s["global_step"] == 256 // 64 and s["eval_examples"] == 50


@pytest.mark.slow
def test_machines_launched_with_different_process_counts_stop_training(cifar_dir, cache_dir, tmp_path):
    # 2 processes in all on one machine's command, 4 on the other's: torchrun forms a world of 1 + 2 = 3.
    results = launch_two_machines(REPO / "train_cifar.py",
                                  ["--data-dir", str(cifar_dir), "--output-dir", str(tmp_path / "o"),
                                                            "--tracker", "none"], num_processes=(2, 4))
    assert [r[0] for r in results] != [0, 0]
    errors = [line for r in results for line in r[2].splitlines() if line.startswith("error:")]
    assert errors == ["error: the machines were launched with different process counts: this machine runs 1, so 2 "
                      "machines make 2, but 3 joined; use the same --num_processes and --num_machines on every machine "
                      "(MULTI_CPU)."]
    assert not (tmp_path / "o").exists() or not any((tmp_path / "o").iterdir())


@pytest.mark.slow
def test_doctor_reports_a_healthy_two_rank_cpu_setup():
    result = run_python(launch_argv(["--config_file", str(CPU_YAML)], REPO / "doctor.py",
                                    ["--timeout", "30", "--size-mb", "8"]), script_env(), timeout=120)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    lines = result.stdout.splitlines()
    assert sum(line.strip().startswith("rank ") and "gloo" in line for line in lines) == 2
    bf16 = {True: "native", False: "emulated (use fp32)", None: "unknown"}[cpu_bf16_native_here()]
    assert sum(line.endswith(f"CPU bf16 {bf16}") for line in lines) == 2, lines
    bandwidth = next(line for line in lines if "bus bandwidth" in line)
    assert float(bandwidth.split("bus bandwidth ")[1].split(" GB/s")[0]) > 0
    assert lines[-1] == "doctor: OK (2 processes, MULTI_CPU)"


def test_doctor_names_a_torchvision_that_does_not_import_beside_torch_and_the_fix(tmp_path):
    """A torchvision built for another torch or CUDA fails at import with "operator torchvision::nms does not exist"
    (the words of a CPU torch 2.13 beside a CUDA torchvision 0.28): one process of doctor.py in a fresh interpreter,
    with such a torchvision first on its path, prints it as broken, one problem line naming it with the fix, and
    exits 1."""
    import subprocess
    import sys

    import torch

    (tmp_path / "torchvision").mkdir()
    (tmp_path / "torchvision" / "__init__.py").write_text(
        'raise RuntimeError("operator torchvision::nms does not exist")\n')
    result = subprocess.run([sys.executable, str(REPO / "doctor.py"), "--timeout", "30"], cwd=REPO,
                            env=script_env(PYTHONPATH=str(tmp_path)), capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-2000:]
    lines = result.stdout.splitlines()
    assert ", torchvision broken, " in lines[1]
    assert lines[2:4] == [
        f"doctor: PROBLEM: torchvision does not import beside torch {torch.__version__} on rank(s) 0 (RuntimeError: "
        f"operator torchvision::nms does not exist): a build for another torch or CUDA",
        "  fix: install the two as a pair from one index: pip install --force-reinstall torch torchvision (for the CPU "
        "build, with --index-url https://download.pytorch.org/whl/cpu)"]


@pytest.mark.slow
def test_doctor_diagnoses_machines_launched_with_different_process_counts():
    results = launch_two_machines(REPO / "doctor.py", ["--timeout", "30", "--size-mb", "1"], num_processes=(2, 4))
    assert results[0][0] == 1, results[0][2][-3000:]
    problems = [line for line in results[0][1].splitlines() if line.startswith("doctor: PROBLEM")]
    assert problems == [
        "doctor: PROBLEM: world-size mismatch on rank(s) 0: the machines were launched with different process counts: "
        "this machine runs 1, so 2 machines make 2, but 3 joined; use the same --num_processes and --num_machines on "
        "every machine",
        "doctor: PROBLEM: world-size mismatch on rank(s) 1, 2: the machines were launched with different process "
        "counts: this machine runs 2, so 2 machines make 4, but 3 joined; use the same --num_processes and "
        "--num_machines on every machine"]


def _doctor_alone(port: int, timeout: float, rank: int = 0):
    """One rank of 2 started without its peer (as srun or a hand launch does when the other task never starts)."""
    env = script_env(RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    started = time.time()
    result = run_python([str(REPO / "doctor.py"), "--timeout", str(timeout)], env, timeout=120)
    return result, time.time() - started


@pytest.mark.slow
def test_doctor_diagnoses_a_missing_process_within_its_timeout():
    result, seconds = _doctor_alone(_free_port(), timeout=5)
    assert result.returncode == 1
    assert seconds < 5 + 30, "reported within the timeout (plus start-up), not hung"
    lines = [line for line in result.stderr.splitlines() if line.startswith(("doctor: PROBLEM", "  fix:"))]
    assert lines[0].startswith("doctor: PROBLEM on rank 0: "), result.stderr[-2000:]
    assert "1/2 clients joined" in lines[0], result.stderr[-2000:]
    assert lines[1].startswith("  fix: a process is missing: every machine must run the launch command")


@pytest.mark.slow
def test_doctor_diagnoses_a_busy_port():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        result, seconds = _doctor_alone(busy.getsockname()[1], timeout=5)
    assert result.returncode == 1 and seconds < 5 + 30
    lines = [line for line in result.stderr.splitlines() if line.startswith(("doctor: PROBLEM", "  fix:"))]
    assert lines and lines[-1].startswith("  fix: the port is busy"), result.stderr[-2000:]


@pytest.mark.slow
def test_doctor_diagnoses_an_unreachable_head_node():
    result, seconds = _doctor_alone(_free_port(), timeout=5, rank=1)  # nothing listens at the head's address
    assert result.returncode == 1 and seconds < 5 + 30
    lines = [line for line in result.stderr.splitlines() if line.startswith(("doctor: PROBLEM", "  fix:"))]
    assert lines and lines[-1].startswith("  fix: this process cannot reach the head node"), result.stderr[-2000:]

