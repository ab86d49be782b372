"""Trained weights: where they are (a .safetensors file, a run folder, a Hub model repo a run pushed: `locate_weights`,
which the tools read a run through, utils/runs.py) and --init-from, loading them into a new run's model
(`init_weights`), the head matched to the data's classes. Downloads go through huggingface_hub and torchvision's
weights API, into their own caches; each machine's first process downloads, the others then read the cached file.
Offline (HF_HUB_OFFLINE=1) a Hub repo in the local cache still loads."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from utils import UserError, first_line
from utils.config_groups import REPO_ID
from utils.launch import first_on_each_machine

TORCHVISION = "torchvision:"  # torchvision:IMAGENET1K_V1 -> torchvision.models.ResNet18_Weights.IMAGENET1K_V1
TORCHVISION_MODELS = ("resnet18", "resnet18_imagenet")  # the models torchvision's ResNet-18 weights fit


# --init-from SOURCE ------------------------------------------------------------------------------------------------
def init_weights(model: torch.nn.Module, source: str | None, model_name: str, accelerator, resume_from=None,
                 classes: list[str] | None = None) -> dict:
    """Loads SOURCE's weights into `model` (before prepare(), the same file on every rank), keeping the model's own
    freshly initialised head (its last Linear layer) when the class counts differ, and, from torchvision's ImageNet
    weights into the CIFAR-stem resnet18, its own 3x3 first convolution. Where the source's summary.json names its
    classes and they are not the data's `classes`, the head is matched by name instead (head_by_name). Any other
    missing, unexpected or differently shaped key stops the run with one line. Returns what was loaded, for
    summary.json and the tracker. Nothing when a checkpoint is resumed (`resume_from`): it holds the run's weights."""
    if source is None or resume_from is not None:
        if source is not None:
            accelerator.print(f"--init-from {source}: not loaded, the run continues from {resume_from}")
        return {}
    if source.startswith(TORCHVISION):
        state, origin = first_on_each_machine(lambda: torchvision_weights(source, model_name)), source
        summary = None
        allowed_new = {"conv1.weight"} if model_name == "resnet18" else set()
    else:
        path, summary = first_on_each_machine(lambda: locate_weights(source))
        try:
            state, origin, allowed_new = load_file(path), str(path), set()
        except (SafetensorError, OSError) as e:
            raise UserError(f"--init-from {source}: {path} is not a readable safetensors file ({first_line(e)}).") \
                from None
    own = model.state_dict()
    head = ([name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)] or [None])[-1]
    allowed_new |= {k for k in own if head is not None and k.startswith(head + ".")}
    named = recorded(summary).get("classes")
    others = head is not None and isinstance(named, list) and classes is not None and named != list(classes)
    by_name = head_by_name(own, state, head, named, classes) if others else {}
    source_rows = len(state[f"{head}.weight"]) if f"{head}.weight" in state else None  # the source's class count
    state |= by_name.get("tensors", {})  # the data's shape
    reshaped = sorted(k for k in own.keys() & state.keys() if own[k].shape != state[k].shape)
    new = sorted(k for k in own.keys() & state.keys() if k in allowed_new and  # a head of other classes is new too
                 (k in reshaped or others and not by_name and k.startswith(f"{head}.")))
    problems = {"missing": sorted(own.keys() - state.keys()), "unexpected": sorted(state.keys() - own.keys()),
                "shaped differently": [f"{k} {tuple(state[k].shape)} vs {tuple(own[k].shape)}"
                                       for k in reshaped if k not in allowed_new]}
    if any(problems.values()):
        listed = "; ".join(f"{kind}: {', '.join(keys[:4])}{f' (+{len(keys) - 4} more)' if len(keys) > 4 else ''}"
                           for kind, keys in problems.items() if keys)
        trained = f" (it was trained as {what})" if (what := trained_as(summary)) else ""
        raise UserError(f"--init-from {source} does not hold --model {model_name} weights{trained}: "
                        f"{listed}.")
    model.load_state_dict({k: v for k, v in state.items() if k not in new}, strict=False)
    note = f"; new, freshly initialised: {', '.join(new)}" if new else ""
    if head is not None and head + ".weight" in new:
        note += (f" (a {own[head + '.weight'].shape[0]}-class head for the source's {source_rows}"
                 f"{' other classes' if others else ''})")
    if by_name:
        kept, fresh = by_name["kept"], [c for c in classes if c not in by_name["kept"]]
        note += (f"; {head} by class name: {len(kept)} of the data's {len(classes)} classes' rows from the source"
                 f"{shown(kept)}" + (f", {len(fresh)} fresh{shown(fresh)}" if fresh else ""))
    accelerator.print(f"--init-from {source}: {len(state) - len(new)} tensors loaded from {origin}{note}")
    return {"init_weights": origin, "init_new_keys": new} | ({"init_head_classes": by_name["kept"]} if by_name else {})


def head_by_name(own: dict, state: dict, head: str, named: list[str], classes: list[str]) -> dict:
    """For a source whose classes (`named`, its summary.json's) are not the data's `classes` (another set, or the same
    count of other names, which a head loaded by shape would silently swap): the head's tensors of the data's shape,
    each class the source also has taking the source's row (weight and bias), the others the model's fresh rows, and
    the classes kept. {} where no class is kept, or the source's head is of another width or count."""
    keys = [k for k in (f"{head}.weight", f"{head}.bias") if k in own]
    if not all(k in state and state[k].shape[1:] == own[k].shape[1:] and len(state[k]) == len(named) for k in keys):
        return {}
    row = {name: i for i, name in enumerate(named)}
    tensors = {k: own[k].clone() for k in keys}
    kept = [name for name in classes if name in row]
    for k in keys:
        for name in kept:
            tensors[k][classes.index(name)] = state[k][row[name]]
    return {"tensors": tensors, "kept": kept} if kept else {}


def shown(names: list[str], most: int = 5) -> str:
    """The names for a line, " (a, b, c)", at most `most` of them; "" for none."""
    return f" ({', '.join(names[:most])}{' ...' if len(names) > most else ''})" if names else ""


def locate_weights(source: str, filename: str = "model.safetensors") -> tuple[Path, Path | None]:
    """The safetensors file SOURCE names and the summary.json that describes it (None: none): a file and the summary
    beside it, a run folder's `filename`, or a Hub model repo's (owner/name, optionally @revision) two files,
    downloaded into the Hugging Face cache. --init-from and the tools (utils/runs.py) read their weights through it."""
    path = Path(source)
    if path.is_dir():
        if not (path / filename).is_file():
            why = "a run without --ema-decay has none" if "ema" in filename else "is it a finished run's folder?"
            raise UserError(f"{source} holds no {filename} ({why}).")
        path = path / filename
    if path.is_file():
        return path, path.parent / "summary.json" if (path.parent / "summary.json").is_file() else None
    if path.suffix == ".safetensors" or not REPO_ID.fullmatch(source.split("@")[0]):
        raise UserError(f"{source}: no such file or folder, nor a Hub model repo id (owner/name).")
    return hub_file(source, filename), hub_file(source, "summary.json", required=False)


def wandb_artifact(spec: str) -> Path:
    """wandb:ENTITY/PROJECT/NAME:ALIAS, a model artifact a run logged (--wandb-log-model: model-<run id>:latest,
    :best, :step-N), downloaded through wandb's API into its artifacts folder: a run folder for the tools. One line
    when it cannot be (no network, no login, no such artifact)."""
    import wandb

    try:
        return Path(wandb.Api().artifact(spec.removeprefix("wandb:"), type="model").download())
    except Exception as e:  # noqa: BLE001 -- whatever the client raises offline or for a bad name: one line
        raise UserError(f"cannot download the W&B model artifact {spec.removeprefix('wandb:')}: "
                        f"{first_line(e) or type(e).__name__}") from None


def hub_file(source: str, filename: str, required: bool = True) -> Path | None:
    """`filename` of the Hub model repo `source` (owner/name[@revision]) through huggingface_hub's cache; None when
    the repo has no such file and it is not `required`."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError

    repo, _, revision = source.partition("@")
    try:
        return Path(hf_hub_download(repo, filename, revision=revision or None))
    except (EntryNotFoundError, OSError, HfHubHTTPError, ValueError) as e:  # EntryNotFound: offline, also uncached
        if not required and isinstance(e, EntryNotFoundError):
            return None
        raise UserError(f"cannot get {filename} of the Hub model repo {source}: {first_line(e)}") from None


def torchvision_weights(source: str, model_name: str) -> dict[str, torch.Tensor]:
    """torchvision's trained ResNet-18 weights (torchvision:IMAGENET1K_V1), through its weights API: downloaded
    once into torch's hub cache ($TORCH_HOME/hub/checkpoints)."""
    import torchvision

    if model_name not in TORCHVISION_MODELS:
        raise UserError(f"--init-from {source}: torchvision's ResNet-18 weights fit --model "
                        f"{' or '.join(TORCHVISION_MODELS)}, not {model_name}.")
    name = source[len(TORCHVISION):]
    try:
        weights = torchvision.models.ResNet18_Weights[name]
    except KeyError:
        known = ", ".join(TORCHVISION + w.name for w in torchvision.models.ResNet18_Weights)
        raise UserError(f"--init-from {source}: torchvision has no such ResNet-18 weights (it has {known}).") from None
    try:
        return weights.get_state_dict(progress=False)
    except OSError as e:  # urllib's URLError without network
        raise UserError(f"--init-from {source}: cannot download {weights.url} ({first_line(e)}); without network, put "
                        f"that file into {torch.hub.get_dir()}/checkpoints/") from None
    except (RuntimeError, EOFError) as e:  # a truncated download in torch's cache
        raise UserError(f"--init-from {source}: the cached {weights.url.split('/')[-1]} in "
                        f"{torch.hub.get_dir()}/checkpoints/ is unreadable ({first_line(e)}); delete it") from None


def recorded(summary: Path | None) -> dict:
    """The summary.json beside the weights; {} for none, or an unreadable one (the weights still load)."""
    try:
        value = json.loads(summary.read_text()) if summary is not None else {}
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def trained_as(summary: Path | None) -> str | None:
    """What built the weights, from the summary.json beside them: "--model M", and "by SCRIPT" when the summary
    records the training script (a copy's build_model: fine-tune with a copy of that script). None: no summary, or
    an unreadable one."""
    if "model" not in (record := recorded(summary)):
        return None
    script = record["script"].get("name") if isinstance(record.get("script"), dict) else None
    return f"--model {record['model']}" + (f" by {script}" if script else "")
