"""What a finished run leaves for whoever uses its weights: safetensors files of the full, unwrapped weights, and how
to feed them (`preprocessor_config.json`, in the Hugging Face image processors' keys: the input size, the scaling to
[0, 1] and the per-channel mean and std the model was trained with)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from utils.batches import data_facts
from utils.checkpoint import WRITE_ERRORS, raise_if_write_failed, write_error

PREPROCESSOR_FILE = "preprocessor_config.json"


def export_model(accelerator, model, ema, data: dict, output_dir: str | Path) -> None:
    """The end of a finished run (collective): model.safetensors, model_ema.safetensors (with --ema-decay) and
    preprocessor_config.json (from `data`, utils.batches.checked_data's dict), in `output_dir`."""
    output_dir = Path(output_dir)
    export_weights(accelerator, model, output_dir / "model.safetensors")
    if ema is not None:
        with ema.applied():
            export_weights(accelerator, model, output_dir / "model_ema.safetensors")
    if accelerator.is_main_process:
        (output_dir / PREPROCESSOR_FILE).write_text(json.dumps(preprocessing(data), indent=2) + "\n")


def preprocessing(data: dict) -> dict:
    """How an image becomes the model's input, in the keys of transformers' image processors: converted to RGB,
    resized to S x S (bicubic: how the decoder resizes images of another size), scaled by 1/255, normalised with the
    training images' per-channel mean and std, channels first. Training also crops and flips; evaluation does not."""
    facts = data_facts(data)  # the size, mean, std and classes as summary.json records them
    size = facts["image_size"]
    return {"do_convert_rgb": True, "do_resize": True, "size": {"height": size, "width": size},
            "resample": 3,  # PIL.Image.Resampling.BICUBIC
            "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
            "image_mean": facts["image_mean"], "image_std": facts["image_std"], "data_format": "channels_first",
            "num_classes": len(facts["classes"]), "classes": facts["classes"]}


def export_weights(accelerator, model, path: Path) -> None:
    """Full, unwrapped weights (no 'module.' or '_orig_mod.' prefix) as safetensors, written by the main process
    (atomically; a failed write stops every rank with one line naming the last good checkpoint). Collective."""
    state = accelerator.get_state_dict(accelerator.unwrap_model(model, keep_torch_compile=False))
    write_weights(accelerator, state, path, root=Path(path).parent / "checkpoints")


def write_weights(accelerator, state: dict[str, torch.Tensor], path: Path, root: Path) -> None:
    """Exported weights as safetensors, written by the main process to a temporary name and renamed, so a failed
    write leaves the previous file whole; a failure raises the same UserError on every rank (collective)."""
    path, error = Path(path), None
    tmp = path.with_name(f".tmp-{path.name}")
    if accelerator.is_main_process:
        try:
            save_file({k: v.contiguous() for k, v in state.items()}, tmp)
            os.replace(tmp, path)
        except WRITE_ERRORS as e:
            error = write_error(e)
    raise_if_write_failed(accelerator, error, path, root, remove=tmp)
