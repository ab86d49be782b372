"""What a finished run leaves for whoever uses its weights: safetensors files of the full, unwrapped weights; how to
feed them (`preprocessor_config.json`, an image processor that transformers' AutoImageProcessor loads: the
evaluation's resize and crop, the scaling to [0, 1] and the per-channel mean and std the model was trained with);
for a model built by timm or transformers, the config.json that makes the run's folder a model folder of that
library (utils/pretrained.py); and summary.json, every number of the run."""

from __future__ import annotations

import json
from pathlib import Path

from utils.checkpoint import export_weights, write_files
from utils.data.contract import data_facts
from utils.output_dir import LIBRARY_CONFIG, PREPROCESSOR_FILE, SUMMARY_FILE
from utils.pretrained import RESAMPLE, library_config

FILTER = {name: number for number, name in RESAMPLE.items()}  # "bicubic" -> PIL's 3, as image processors take it


def export_model(accelerator, model, ema, data: dict, output_dir: str | Path, summary: dict) -> None:
    """The end of a finished run (collective), in `output_dir`: model.safetensors, model_ema.safetensors (with
    --ema-decay), preprocessor_config.json (from `data`, utils.data.contract.checked_data's dict), for a timm or
    transformers model its library's config.json, and last summary.json (`summary`), whose presence marks the run
    finished (utils.checkpoint.Checkpointer.finished_run). Each file is written atomically, and a failed write is
    one line on every rank (utils.checkpoint.write_files)."""
    output_dir, files = Path(output_dir), {}
    if accelerator.is_main_process:
        files[PREPROCESSOR_FILE] = json.dumps(preprocessing(data), indent=2) + "\n"
        library = library_config(accelerator.unwrap_model(model, keep_torch_compile=False), data_facts(data))
        if library is not None:
            files[LIBRARY_CONFIG] = json.dumps(library, indent=2) + "\n"
        files[SUMMARY_FILE] = json.dumps(summary, indent=2)
    export_weights(accelerator, model, output_dir / "model.safetensors")
    if ema is not None:
        with ema.applied():
            export_weights(accelerator, model, output_dir / "model_ema.safetensors")
    write_files(accelerator, output_dir, files)


def preprocessing(data: dict) -> dict:
    """How an image becomes the model's input, exactly as the run evaluated, as a transformers image processor
    (AutoImageProcessor loads it): converted to RGB; resized to S x S (bicubic: how the decoder resizes images of
    another size; ViTImageProcessor), or, for a resized-crop run, resized to int(S / eval_crop) on the shorter side
    with its --interpolation and centre-cropped to S (CLIPImageProcessor); scaled by 1/255, normalised with the
    run's per-channel mean and std, channels first. Training also crops and flips; evaluation does not."""
    facts = data_facts(data)  # the size, mean, std and classes as summary.json records them
    size = facts["image_size"]
    if "eval_crop" in facts:
        view = {"image_processor_type": "CLIPImageProcessor", "do_resize": True,
                "size": {"shortest_edge": int(size / facts["eval_crop"])}, "do_center_crop": True,
                "crop_size": {"height": size, "width": size}, "resample": FILTER[facts["interpolation"]]}
    else:
        view = {"image_processor_type": "ViTImageProcessor", "do_resize": True, "size": {"height": size, "width": size},
                "resample": FILTER["bicubic"]}
    return {**view, "do_convert_rgb": True, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
            "image_mean": facts["image_mean"], "image_std": facts["image_std"], "data_format": "channels_first",
            "num_classes": len(facts["classes"]), "classes": facts["classes"]}
