"""The machinery under the training scripts, a stack without import cycles (tests/test_structure.py), bottom up: the
user-error type and the process-count check (here); the command line (utils.cli) and the shared flag groups
(utils.config_groups); how processes start and end (utils.launch); the batch plan (utils.plan); the data layer
(utils.data: sources, decoding, the kinds of images and their protocol, the contract, the loaders and the batch
transform); pretrained timm and transformers models (utils.pretrained) and the ready models (utils.models); the
output folder (utils.output_dir); progress (utils.progress); checkpoints (utils.checkpoint); the EMA (utils.ema);
evaluation (utils.evaluation); trained weights and --init-from (utils.weights); sharing on the Hub (utils.hub); the
guards around the loop (utils.guard); tracking and the summary (utils.tracking); the training script a run came from
(utils.scripts). A copier edits the script, not these."""

from __future__ import annotations

import os


class UserError(Exception):
    """A mistake in the user's input. Scripts print it as one line and exit with status 2."""


def process_count_problem(accelerate_world: int) -> str | None:
    """What is wrong with the number of processes, judged from the launcher's environment; None if nothing.
    Catches two silent failures: processes that each train alone, and machines launched with different counts
    (torchrun then forms a world of their sum, which no machine's config asked for)."""
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched != accelerate_world:  # e.g. N processes launched without cpu=True on a CPU: N separate 1-process runs
        return (f"the launcher started {launched} processes but Accelerate runs {accelerate_world}: they would train "
                f"separately")
    here, machines = os.environ.get("LOCAL_WORLD_SIZE"), os.environ.get("GROUP_WORLD_SIZE")  # torchrun sets both
    if here and machines and int(here) * int(machines) != launched:
        return (f"the machines were launched with different process counts: this machine runs {here}, so {machines} "
                f"machines make {int(here) * int(machines)}, but {launched} joined; use the same --num_processes and "
                f"--num_machines on every machine")
    return None


def write_atomically(path, content) -> None:
    """`content` into `path` (a str, written as text; or write(tmp), a function that writes the file it is given),
    through a temporary file beside it renamed over it: a process killed mid-write (kill -9 lands anywhere) leaves
    the old file or the new one, never a part, and a failed write leaves no temporary file. Every file utils/ writes
    whole goes through here (a checkpoint folder is renamed whole by utils/checkpoint.py; the decode cache is
    reserved and mapped before its rename, utils/data/decode.py)."""
    from pathlib import Path

    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(content) if isinstance(content, str) else content(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def first_line(error: BaseException) -> str:
    """An exception as one line, its type and its message's first line, for a UserError that quotes a library."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__
