"""The training script a run came from. summary.json and every checkpoint record it (`script_record`: its file name,
its path relative to the output folder and its sha256); the tools find it again and import it (`import_script`), so
that a copier's build_model and load_data rebuild the copier's model on the copier's data.

Safety: importing a script runs its code. A script is imported only when it is the one that trained (same sha256)
and it is found locally: at its recorded path from the run folder, or beside the tools under its recorded name. A
script that lies inside the run folder or came with a Hub repo (a download) is imported only with the tool's
--trust-remote-code; a script the user names (--script PATH) is imported as they say, with a warning when it
differs from the one that trained."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
from pathlib import Path

from utils import UserError

TOOLS = Path(__file__).resolve().parent.parent  # where the templates and the tools live
IMPORTED: dict[str, str] = {}  # the module name and path of each script import_script has imported in this process


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def script_record(cfg) -> dict:
    """The script that defines cfg's Config class (the training script, also when imported or forked rather than
    run as __main__): {"name", "path" (relative to cfg.output_dir), "sha256"}."""
    path = Path(sys.modules[type(cfg).__module__].__file__).resolve()
    return {"name": path.name, "path": os.path.relpath(path, Path(cfg.output_dir).resolve()), "sha256": sha256(path)}


def find_script(record: dict | None, run_dir: Path, downloaded: bool, given: str | None = None,
                trust_remote_code: bool = False, default: str = "train_cifar.py") -> Path:
    """The training script to rebuild a run with. record: summary.json's "script" (None: a run that recorded none,
    which train_cifar.py beside the tools rebuilds). run_dir: the folder of its summary.json; downloaded: it came
    from the Hub. given: --script PATH, which wins. Raises a one-line UserError when no local copy matches."""
    if given is not None:
        path = Path(given)
        if not path.is_file():
            raise UserError(f"--script {given}: no such file.")
        if record is not None and sha256(path) != record["sha256"]:
            print(f"warning: --script {given} differs from the {record['name']} that trained these weights",
                  file=sys.stderr)  # stderr: predict.py may be printing its CSV on stdout
        return path
    if record is None:  # a run that recorded no script: the template its model comes from
        return TOOLS / default
    candidates = [] if downloaded else [(run_dir / record["path"]).resolve()]  # a download's path means nothing
    candidates += [TOOLS / record["name"], (run_dir / record["name"]).resolve()]
    for path in dict.fromkeys(candidates):
        if not path.is_file() or sha256(path) != record["sha256"]:
            continue
        came_with_run = path.is_relative_to(run_dir.resolve()) and path.parent != TOOLS  # or with the Hub repo
        if came_with_run and not trust_remote_code:
            raise UserError(f"{path} came with the run, not from this checkout: importing it runs its code. Read it, "
                            f"then pass --trust-remote-code (or --script PATH to a copy you trust).")
        return path
    changed = [p for p in candidates if p.is_file()]
    why = f"{changed[0]} has changed since" if changed else "no copy of it is found locally"
    raise UserError(f"these weights were trained by {record['name']} (sha256 {record['sha256'][:12]}), but {why}; pass "
                    f"--script PATH to the script that builds this model.")


def import_script(path: Path):
    """Imports a training script as a module (its `if __name__ == "__main__"` block does not run)."""
    spec = importlib.util.spec_from_file_location(f"trained_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    IMPORTED[spec.name] = str(path)
    for name in ("Config", "build_model", "load_data", "compute_loss"):
        if not hasattr(module, name):
            raise UserError(f"{path} defines no {name}: the tools rebuild a run through the training script's Config, "
                            f"build_model(cfg, num_classes), load_data(cfg) and compute_loss(cfg, logits, "
                            f"targets).")
    return module


def new_after_imports(cls, scripts: dict):
    """A bare `cls` object, made after importing each of `scripts` (IMPORTED of the process that pickled it) that this
    process lacks. An object whose class's __reduce__ returns (new_after_imports, (cls, dict(IMPORTED)), state)
    unpickles in a fresh process (a loader worker started by a forkserver, utils/data/images.py) when its state holds
    objects of an imported script's classes (a copy's Dataset, imported by a tool): pickle restores the arguments and
    calls this before it restores the state."""
    for name, path in scripts.items():
        if name not in sys.modules:
            import_script(Path(path))
    return cls.__new__(cls)
