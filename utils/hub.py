"""Share a finished run on the Hub (--push-to-hub): its exports, summary, config and a generated model card, which
evaluate_checkpoint.py, predict.py and a later --init-from read back (utils/weights.py). (--metric NAME, the
`evaluate` metrics: utils/evaluation.py.)"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from utils import first_line
from utils.config_groups import BUILT_IN
from utils.launch import raise_if_any
from utils.output_dir import LIBRARY_CONFIG, PREPROCESSOR_FILE, SUMMARY_FILE
from utils.scripts import sha256

HUB_FOLDER = "hub"  # <output-dir>/hub: what --push-to-hub uploads


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
    files = {name: output_dir / name for name in ("model.safetensors", "best.safetensors", SUMMARY_FILE,
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
