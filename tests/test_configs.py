"""Every shipped accelerate config: loaded by Accelerate's own loader, consistent, documented, and the
CPU-runnable ones launched (cpu.yaml runs in most tests; the multi-node file runs here as 2 machines on loopback)."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest
from accelerate.commands.config.config_args import load_config_from_file
from conftest import REPO, read_summary, script_env

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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_machines_on_loopback_train_together_from_the_multinode_config(cifar_dir, cache_dir, tmp_path):
    port, out = _free_port(), tmp_path / "two_nodes"
    launchers = []
    for rank in (0, 1):  # two launcher processes = two machines, one process each
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(REPO / "accelerate_configs" / "2node_16gpu.yaml"),
               "--num_machines", "2", "--num_processes", "2", "--machine_rank", str(rank), "--main_process_ip", "127.0.0.1",
               "--main_process_port", str(port), "--mixed_precision", "no",
               str(REPO / "train_cifar.py"), "--data-dir", str(cifar_dir), "--cache-dir", str(cache_dir), "--output-dir", str(out),
               "--model", "resnet18_imagenet", "--train-subset", "256", "--eval-subset", "50", "--batch-size", "32",
               "--epochs", "1", "--tracker", "none"]
        launchers.append(subprocess.Popen(cmd, cwd=REPO, env=script_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = [p.communicate(timeout=300) for p in launchers]
    assert [p.returncode for p in launchers] == [0, 0], results[0][1][-3000:] + results[1][1][-3000:]
    s = read_summary(out)
    assert (s["world_size"], s["distributed_type"], s["wrapper"]) == (2, "MULTI_CPU", "DistributedDataParallel")
    assert s["global_step"] == 256 // 64 and s["eval_examples"] == 50


def test_doctor_reports_a_healthy_two_rank_cpu_setup():
    result = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(REPO / "accelerate_configs" / "cpu.yaml"),
                             "--main_process_port", "0", str(REPO / "doctor.py"), "--timeout", "30", "--size-mb", "8"],
                            cwd=REPO, env=script_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    lines = result.stdout.splitlines()
    assert sum(line.strip().startswith("rank ") and "gloo" in line for line in lines) == 2
    bandwidth = next(line for line in lines if "bus bandwidth" in line)
    assert float(bandwidth.split("bus bandwidth ")[1].split(" GB/s")[0]) > 0
    assert lines[-1] == "doctor: OK (2 processes, MULTI_CPU)"
