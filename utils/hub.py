"""The Hugging Face side of a run: start from trained weights (--init-from), and share a finished run on the Hub
(--push-to-hub) with a generated model card, which evaluate_checkpoint.py and a later --init-from read back.
Downloads go through huggingface_hub and torchvision's weights API, into their own caches; each machine's first
process downloads, the others then read the cached file. Offline (HF_HUB_OFFLINE=1) a Hub repo in the local cache
still loads. (--metric NAME, the `evaluate` metrics: utils/evaluation.py.)"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from utils import UserError, first_line
from utils.config_groups import BUILT_IN, REPO_ID
from utils.export import LIBRARY_CONFIG, PREPROCESSOR_FILE
from utils.launch import first_on_each_machine, raise_if_any
from utils.scripts import sha256

TORCHVISION = "torchvision:"  # torchvision:IMAGENET1K_V1 -> torchvision.models.ResNet18_Weights.IMAGENET1K_V1
TORCHVISION_MODELS = ("resnet18", "resnet18_imagenet")  # the models torchvision's ResNet-18 weights fit
HUB_FOLDER = "hub"  # <output-dir>/hub: what --push-to-hub uploads


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
    for j, name in (pair for pair in enumerate(classes) if pair[1] in row):
        for k in keys:
            tensors[k][j] = state[k][row[name]]
    kept = [name for name in classes if name in row]
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
    script = (record.get("script") or {}).get("name") if isinstance(record.get("script"), dict) else None
    return f"--model {record['model']}" + (f" by {script}" if script else "")


# --push-to-hub REPO_ID -------------------------------------------------------------------------------------------
def check_can_push(repo_id: str | None, accelerator) -> None:
    """Before any training: --push-to-hub needs the Hub and a token; without them the run stops here with one line
    (a finished run whose upload fails keeps its outputs: push_to_hub below)."""
    if repo_id is None:
        return
    error = None
    if accelerator.is_main_process:
        from huggingface_hub import HfApi, constants
        from huggingface_hub.errors import HfHubHTTPError

        if constants.HF_HUB_OFFLINE:
            error = f"--push-to-hub {repo_id} needs the Hub, but HF_HUB_OFFLINE is set; the run did not start."
        else:
            try:
                HfApi().whoami()
            except (OSError, HfHubHTTPError) as e:  # LocalTokenNotFoundError is an OSError
                error = (f"--push-to-hub {repo_id} needs the Hub and a token (`hf auth login` or $HF_TOKEN): "
                         f"{first_line(e)}; the run did not start.")
    raise_if_any(error, long_wait=True)


def push_to_hub(repo_id: str | None, accelerator, output_dir: str, summary: dict) -> None:
    """At the end of a finished run: the main process writes <output-dir>/hub (the exported weights linked, not
    copied; summary.json; config.json; README.md, the model card) and uploads it with huggingface_hub's
    upload_folder. A failed upload stops every process with one line after all outputs are saved."""
    if repo_id is None:
        return
    error = None
    if accelerator.is_main_process:
        from huggingface_hub import HfApi
        from huggingface_hub.errors import HfHubHTTPError

        folder = hub_folder(Path(output_dir), summary, repo_id)
        try:
            api = HfApi()
            api.create_repo(repo_id, exist_ok=True)
            commit = api.upload_folder(repo_id=repo_id, folder_path=folder,
                                       commit_message=f"{network(summary)}: top-1 {summary['eval_top1']:.2f}%")
            print(f"pushed {folder} to {getattr(commit, 'commit_url', repo_id)}", flush=True)
        except (OSError, HfHubHTTPError, ValueError) as e:
            error = (f"the run finished and its outputs are saved, but the upload to {repo_id} failed "
                     f"({first_line(e)}); retry with: hf upload {repo_id} {folder} .")
    raise_if_any(error, long_wait=True)


def hub_folder(output_dir: Path, summary: dict, repo_id: str) -> Path:
    """<output-dir>/hub, what --push-to-hub uploads: model.safetensors (and best.safetensors) linked from the run's
    exports, summary.json, preprocessor_config.json (how to feed the model), config.json (a timm or transformers
    model's own, so its library loads the repo; else the run's flags), the training script that built the weights
    (under its recorded name, when its sha256 still matches) and README.md, the model card."""
    folder = output_dir / HUB_FOLDER
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir()
    script = summary.get("script") or {}
    trained_by = (output_dir / script["path"]).resolve() if script else None
    files = {name: output_dir / name for name in ("model.safetensors", "best.safetensors", "summary.json",
                                                  PREPROCESSOR_FILE, LIBRARY_CONFIG)}
    if trained_by is not None and trained_by.is_file() and sha256(trained_by) == script["sha256"]:
        files[script["name"]] = trained_by
    for name, source in files.items():
        if source.is_file():
            try:
                os.link(source, folder / name)
            except OSError:  # a filesystem without hard links, or another one
                shutil.copy2(source, folder / name)
    if not (folder / LIBRARY_CONFIG).exists():
        (folder / LIBRARY_CONFIG).write_text(json.dumps(summary["config"], indent=2) + "\n")
    (folder / "README.md").write_text(model_card(summary, repo_id))
    return folder


def _per_channel(values: list[float]) -> str:
    return "(" + ", ".join(f"{v:.4f}" for v in values) + ")"


def network(summary: dict) -> str:
    """The network a run trained, as summary.json records it: the name it was built under, else its class."""
    return summary["model"]["name"] or summary["model"]["class"]


def model_card(summary: dict, repo_id: str) -> str:
    """The model card: huggingface_hub's metadata block (ModelCardData), then the model, its data and classes, the
    evaluation, the exact launch command, the library versions and the W&B run."""
    from huggingface_hub import ModelCardData

    dataset, cfg = summary["dataset"], summary["config"]
    source = dataset.get("source") if dataset.get("kind") == "hub" else None
    data = ModelCardData(library_name="pytorch", license=None, datasets=[source] if source else None,
                         metrics=["accuracy"], pipeline_tag="image-classification",
                         tags=["image-classification", "accelerate", "safetensors", network(summary)])
    extra = {k[len("eval_"):]: v for k, v in summary.items()  # the --metric values
             if k.startswith("eval_") and k[len("eval_"):] not in BUILT_IN and isinstance(v, int | float)}
    rows = [("top-1 (%)", summary["eval_top1"]), ("top-5 (%)", summary["eval_top5"]), ("loss", summary["eval_loss"]),
            *extra.items()]
    versions = ", ".join(f"{k} {v}" for k, v in summary.get("versions", {}).items())
    wandb = summary.get("wandb_run") or {}
    recorded = summary.get("script") or {}
    script = recorded.get("name") or ("train_vit.py" if cfg.get("model", "").startswith("vit") else "train_cifar.py")
    name = summary["model"]["name"]  # None: a copy's own network, which --model does not choose
    lines = [
        f"---\n{data.to_yaml()}\n---", "",
        f"# {repo_id.split('/')[-1]}", "",
        f"`{network(summary)}` ({summary['model']['parameters']:,} parameters), an image classifier for "
        f"{summary['image_size']} x {summary['image_size']} px images, trained on "
        f"{source or 'a local dataset'} with HuggingFace Accelerate.", "",
        f"Classes ({len(summary['classes'])}): {', '.join(summary['classes'])}.", "",
        f"## Evaluation ({summary['eval_examples']:,} images)", "", "| metric | value |", "|---|---|",
        *(f"| {name} | {value:.4g} |" for name, value in rows), "",
        "## Training", "",
        f"{summary['global_step']} optimizer steps ({summary['epochs_completed']} epochs) of global batch "
        f"{summary['global_batch']} on {summary['world_size']} process{'es' if summary['world_size'] > 1 else ''} "
        f"({summary['wrapper']}), mixed precision {summary['mixed_precision']}, in "
        f"{summary['wall_seconds'] / 60:.1f} min"
        f"{'; started from ' + cfg['init_from'] if cfg.get('init_from') else ''}. The launch command:", "",
        f"    {summary.get('command', '')}", "",
        f"Library versions: {versions}; code commit {summary.get('git_commit')}.", "",
        *([f"Built by `{script}` (sha256 {recorded['sha256']}), uploaded beside the weights.", ""] if recorded else []),
        *([f"W&B run: {wandb.get('url') or wandb.get('id')} (project {wandb.get('project')}).", ""] if wandb else []),
        "## Use", "",
        *([f"Inputs: RGB, {summary['image_size']} x {summary['image_size']} px, scaled to [0, 1], normalised with the "
           f"per-channel mean {_per_channel(summary['image_mean'])} and std {_per_channel(summary['image_std'])}, "
           f"channels first (`{PREPROCESSOR_FILE}` says the same in the keys of Hugging Face's image processors).", ""]
          if "image_mean" in summary else []),
        f"`model.safetensors` (the final weights; `best.safetensors`: those of the best evaluation) loads into what "
        f"`build_model(cfg, {len(summary['classes'])})` of `{script}` returns with this config (`load_state_dict`); "
        f"evaluate_checkpoint.py rebuilds it so (it imports `{script}` from a checkout with the same sha256, or the "
        f"uploaded copy with --trust-remote-code):", "",
        f"    python evaluate_checkpoint.py {repo_id} --data-dir DATA", f"    python {script} --init-from "
        f"{repo_id}{' --model ' + name if name else ''} --data-dir YOUR_IMAGES   # fine-tune on your own classes", "",
    ]
    return "\n".join(lines)
