"""Pretrained image classifiers of the two libraries people fine-tune them with, timm and transformers, as a
template's model. A --model that is not one of the ready names (utils/models.py) is one of
  timm:NAME    a timm architecture by name (any name timm.list_models() knows), freshly initialised;
  FOLDER       a model folder in the Hub layout, written by timm (`timm.models.save_for_hf`: config.json with its
               'architecture' and 'pretrained_cfg', model.safetensors) or by transformers (`save_pretrained`:
               config.json with its 'model_type', model.safetensors, maybe preprocessor_config.json);
  OWNER/NAME   a Hub model repo of either layout, downloaded through huggingface_hub's cache (each machine's first
               process downloads; HF_HUB_OFFLINE=1 works with a filled cache), then read as a FOLDER.
The libraries do the work: they build the architecture, load the weights, replace the classifier for the data's
classes (timm's num_classes, transformers' num_labels) and say how the model's inputs were prepared (timm's
pretrained_cfg through resolve_data_config, transformers' AutoImageProcessor). Here is only which library, the one
line that says which tensors are new, and the config.json that hands a finished run back to its library.
The libraries are imported only when such a model is asked for."""

from __future__ import annotations

import copy
import functools
import json
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from utils import UserError, first_line
from utils.config_groups import REPO_ID, is_url
from utils.data.sources import first_image_size
from utils.launch import first_on_each_machine

TIMM = "timm:"  # --model timm:NAME: a timm architecture, no weights
HUB_FILES = ["config.json", "preprocessor_config.json", "model.safetensors",  # what a Hub model repo is read for
             "model.safetensors.index.json", "model-*-of-*.safetensors"]  # transformers' weights in shards
RESAMPLE = {2: "bilinear", 3: "bicubic"}  # PIL's filter numbers (transformers' `resample`) -> the --interpolation


@dataclass(frozen=True)
class Pretrained:
    """Where a pretrained --model comes from: the library that reads it, the folder it is read from (None for
    timm:NAME), and its config.json."""
    name: str  # --model as given
    library: str  # "timm" or "transformers"
    folder: Path | None
    config: dict

    @property
    def weights(self) -> bool:
        return self.folder is not None


def is_pretrained(model: str) -> bool:
    """Whether --model names a pretrained source (timm:NAME, a folder or a Hub id) rather than a ready model."""
    return model.startswith(TIMM) or Path(model).is_dir() or bool(REPO_ID.fullmatch(model.split("@")[0]))


@functools.cache  # asked by apply_preprocessing, then by pretrained_model: one look (and one Hub call) per process
def pretrained_source(model: str) -> Pretrained:
    """The library and folder of a pretrained --model (see the module's docstring); one line when it is neither
    layout, not a timm architecture, not an image classifier, or a Hub repo that cannot be had."""
    if model.startswith(TIMM):
        import timm

        name = model[len(TIMM):]
        if not timm.is_model(name):
            raise UserError(f"--model {model}: timm has no architecture {name!r} (timm.list_models() lists them).")
        return Pretrained(model, "timm", None, {})
    folder = Path(model) if Path(model).is_dir() else hub_snapshot(model)
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"--model {model}: {folder} is not a timm or transformers model folder (its config.json: "
                        f"{first_line(e)}).") from None
    library = layout(config)
    if library == "transformers":
        check_image_classifier(model, folder)
    if library is not None:
        return Pretrained(model, library, folder, config)
    raise UserError(f"--model {model}: {folder}/config.json is neither a timm model's (architecture, pretrained_cfg) "
                    f"nor a transformers model's (model_type).")


def layout(config) -> str | None:
    """The library whose config.json this is: "timm" (architecture, pretrained_cfg), "transformers" (model_type)."""
    if isinstance(config, dict) and "architecture" in config and "pretrained_cfg" in config:
        return "timm"
    return "transformers" if isinstance(config, dict) and "model_type" in config else None


def library_of(folder: Path) -> str | None:
    """"timm" or "transformers" when `folder` is a model folder of that library (its config.json in the library's
    layout, its model.safetensors beside it: what a run's export leaves), else None."""
    try:
        config = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return layout(config) if (Path(folder) / "model.safetensors").is_file() else None


def hub_snapshot(repo: str) -> Path:
    """The Hub model repo `repo` (owner/name[@revision]) as a folder of huggingface_hub's cache: its config,
    image processor and weights (downloaded unless cached; offline, the cached copy)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError

    name, _, revision = repo.partition("@")
    try:
        return Path(snapshot_download(name, revision=revision or None, allow_patterns=HUB_FILES))
    except (OSError, HfHubHTTPError, ValueError) as e:  # LocalEntryNotFoundError (offline, not cached) is an OSError
        raise UserError(f"--model {repo}: neither a folder nor a Hub model repo that can be had here "
                        f"({first_line(e)}).") from None


def check_image_classifier(model: str, folder: Path) -> None:
    from transformers import MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING, AutoConfig

    try:
        config = AutoConfig.from_pretrained(folder)
    except (OSError, ValueError, KeyError) as e:
        raise UserError(f"--model {model}: transformers cannot read {folder}/config.json ({first_line(e)}).") from None
    if type(config) not in MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING:
        raise UserError(f"--model {model} is a transformers {type(config).__name__[:-len('Config')]} model, not an "
                        f"image classifier (AutoModelForImageClassification takes none of its kind).")


# Preprocessing: from the model, flags win -----------------------------------------------------------------------
def model_preprocessing(source: Pretrained) -> dict:
    """How the pretrained model's inputs were prepared, as far as its library says: image_size, eval_crop (the
    centre crop's share of the resized shorter side), interpolation, mean and std; absent keys: not said (a timm
    architecture without weights says nothing: the data's own values hold)."""
    if not source.weights:
        return {}
    if source.library == "timm":
        from timm.data import resolve_data_config

        c = resolve_data_config({}, pretrained_cfg=source.config["pretrained_cfg"])
        return {"image_size": c["input_size"][-1], "eval_crop": c["crop_pct"], "interpolation": c["interpolation"],
                "mean": tuple(c["mean"]), "std": tuple(c["std"])}
    if not (source.folder / "preprocessor_config.json").is_file():
        size = source.config.get("image_size")
        return {"image_size": size} if isinstance(size, int) else {}
    from transformers import AutoImageProcessor

    p = AutoImageProcessor.from_pretrained(source.folder)
    size, crop = dict(getattr(p, "size", None) or {}), dict(getattr(p, "crop_size", None) or {})
    out = {"mean": tuple(p.image_mean), "std": tuple(p.image_std)} if getattr(p, "do_normalize", True) else {}
    out["interpolation"] = RESAMPLE.get(int(getattr(p, "resample", 2) or 2), "bilinear")
    if getattr(p, "do_center_crop", False) and crop.get("height") and size.get("shortest_edge"):
        out |= {"image_size": crop["height"], "eval_crop": crop["height"] / size["shortest_edge"]}
    elif size.get("shortest_edge") and getattr(p, "crop_pct", None):  # ConvNeXt's: resize to S / crop_pct, crop S
        out |= {"image_size": size["shortest_edge"], "eval_crop": p.crop_pct}
    elif size.get("height"):
        out |= {"image_size": size["height"], "eval_crop": 1.0}
    return out


def apply_preprocessing(cfg, say) -> dict:
    """For a pretrained --model: its input size becomes --image-size, and under --augment resized-crop its crop
    fraction and interpolation --eval-crop and --interpolation (bilinear or bicubic; another filter is not taken),
    where those flags are unset; says which values and from where (one line). Returns the mean and std the model
    was trained with ({} when it says none, or for a ready model), which win over the data's. A model of a fixed
    input size given another --image-size: one line."""
    if not is_pretrained(cfg.model):
        return {}
    source = first_on_each_machine(lambda: pretrained_source(cfg.model))  # downloads a Hub repo once per machine
    values = model_preprocessing(source)
    if not values:
        say(f"--model {cfg.model}: no pretrained preprocessing (no weights), the data's size, mean and std")
        return {}
    fixed = source.library == "timm" and source.config["pretrained_cfg"].get("fixed_input_size")
    if fixed and cfg.image_size not in (None, values["image_size"]):
        raise UserError(f"--model {cfg.model} takes {values['image_size']} x {values['image_size']} px images only "
                        f"(timm's fixed_input_size); drop --image-size {cfg.image_size} or give that size.")
    cropped = cfg.augment == "resized-crop"
    taken, fields = [], ("image_size", "eval_crop", "interpolation") if cropped else ("image_size",)
    if values.get("interpolation") not in ("bilinear", "bicubic"):  # the filters --interpolation offers
        values.pop("interpolation", None)
    for field in fields:
        if field in values and getattr(cfg, field) is None:
            setattr(cfg, field, values[field])
            taken.append(f"--{field.replace('_', '-')} {values[field]:g}" if field != "interpolation"
                         else f"--interpolation {values[field]}")
    stats = {k: values[k] for k in ("mean", "std") if k in values}
    shown = ", ".join(taken + [f"{k} ({', '.join(f'{v:.4f}' for v in stats[k])})" for k in stats]) or "nothing"
    where = "timm's pretrained_cfg" if source.library == "timm" else "its image processor"
    say(f"--model {cfg.model}: preprocessing from {where} in {source.folder}: {shown}; flags given win")
    found = first_image_size(cfg.data_dir, cfg.image_column) if cfg.data_dir and not is_url(cfg.data_dir) else None
    if taken and taken[0].startswith("--image-size"):
        say_size(cfg, found, say)
    check_input_size(cfg, source, cfg.image_size or (found[0] if found and found[0] == found[1] else None))
    return stats if len(stats) == 2 else {}


def check_input_size(cfg, source: Pretrained, size: int | None) -> None:
    """Before any image is read: the model's skeleton, built on the meta device (no weights, no memory, no compute),
    given one image of the size the run will feed it (--image-size, else the data's first image's: `size`, None when
    unknown); a model that refuses it (a shape check of its own: ValueError, AssertionError) stops with one line, as
    check_logits would only after decoding. A model the meta device cannot run is left to that check."""
    if size is None:
        return
    try:
        with torch.device("meta"):
            if source.library == "timm":
                import timm

                location = f"local-dir:{source.folder}" if source.weights else source.name[len(TIMM):]
                skeleton = timm.create_model(location, pretrained=False, num_classes=2)
            else:
                from transformers import AutoConfig, AutoModelForImageClassification

                config = AutoConfig.from_pretrained(source.folder, num_labels=2)
                skeleton = AutoModelForImageClassification.from_config(config)
            skeleton.eval()(torch.zeros(1, 3, size, size))
    except (ValueError, AssertionError) as e:
        raise UserError(f"--model {cfg.model} does not take the data's {size} x {size} px images "
                        f"({first_line(e)}).") from None
    except Exception:  # noqa: BLE001 - an op without a meta kernel, say: check_logits decides after the data
        return


def say_size(cfg, found: tuple[int, int] | None, say) -> None:
    """When the model's input size (now --image-size) is larger than the data's own (`found`: its first image's
    (width, height), None when unknown; its shorter side smaller), one line: which size is used, why, what it costs in
    pixels per image against the data's size, and how to choose that one instead. Larger images (photos) are cut down
    to the model's size, as fine-tuning does: nothing to say."""
    if found is None or min(found) >= cfg.image_size:
        return
    (w, h), s = found, cfg.image_size
    ratio = s * s / (w * h)
    say(f"--model {cfg.model}: trains at its input size, {s} x {s} px, where the data's first image is {w} x {h} px: "
        f"{ratio:.1f}x its pixels per image, and about that much more compute per image than at {min(w, h)} px; "
        f"--image-size {min(w, h)} trains at the data's size (the model then sees another size than it was "
        f"pretrained at)")


# Building ---------------------------------------------------------------------------------------------------------
def pretrained_model(model: str, num_classes: int, drop_path: float = 0.0) -> torch.nn.Module:
    """The model --model names (a timm or transformers model, see the module's docstring) with a fresh classifier
    for `num_classes`, built by its library. A transformers model answers logits (a forward hook takes them out of
    its output), so it fits a template's loop as it is. Declared for the model (`built_from`): the library, whose
    config.json the run's export writes (library_config), and the names of its freshly initialised tensors (all of
    them without weights), which the optimizer gives the head's learning rate (utils/optim.py)."""
    from accelerate import PartialState

    source = pretrained_source(model)
    try:
        built, new = (_timm_model if source.library == "timm" else _transformers_model)(source, num_classes, drop_path)
    except (OSError, ValueError, RuntimeError, KeyError, TypeError) as e:  # no or unreadable weights, a broken config
        # (TypeError: a timm model that takes no drop_path_rate)
        raise UserError(f"--model {model}: {source.library} cannot build it ({first_line(e)}).") from None
    BUILT[built] = BuiltFrom(source.library, tuple(new))
    if not source.weights:
        said = f"timm {type(built).__name__}, no weights: all {len(new)} tensors freshly initialised"
    else:
        listed = ", ".join(new[:4]) + (f" (+{len(new) - 4} more)" if len(new) > 4 else "")
        said = f"{source.library} {type(built).__name__} from {source.folder}" + (
            f"; new, freshly initialised: {listed}" if new else "")
        saved = source.config.get("architectures") or []  # what transformers saved: a backbone, or a classifier
        if source.library == "transformers" and saved and not any(a.endswith("ForImageClassification") for a in saved):
            said += f" (the folder holds a {saved[0]}, a backbone without a classification head: the head is new)"
    PartialState().print(f"--model {model}: {said}")
    return built


def _timm_model(source: Pretrained, num_classes: int, drop_path: float) -> tuple[torch.nn.Module, list[str]]:
    """timm's model with a new classifier when the class count differs from its config's (timm drops the old one
    on loading): that classifier's tensors are the new ones, as its pretrained_cfg names it. `drop_path`: its
    drop_path_rate."""
    import timm

    location = f"local-dir:{source.folder}" if source.weights else source.name[len(TIMM):]
    rate = {"drop_path_rate": drop_path} if drop_path else {}
    built = timm.create_model(location, pretrained=source.weights, num_classes=num_classes, **rate)
    classifier = built.pretrained_cfg.get("classifier") or ()
    heads = [classifier] if isinstance(classifier, str) else list(classifier)
    replaced = source.weights and built.pretrained_cfg.get("num_classes") != num_classes
    return built, [n for n in built.state_dict() if not source.weights or (replaced and n.rsplit(".", 1)[0] in heads)]


def _transformers_model(source: Pretrained, num_classes: int, drop_path: float) -> tuple[torch.nn.Module, list[str]]:
    """AutoModelForImageClassification with num_labels; the tensors it reports missing or reshaped are the new ones.
    Its forward returns an output object; a hook answers its logits instead. `drop_path`: its config's
    drop_path_rate, refused for a model whose config has none (transformers would keep the value and not use it)."""
    from transformers import AutoModelForImageClassification
    from transformers.utils import logging

    logging.set_verbosity_error()  # its load report and progress bars: the start line says what matters
    logging.disable_progress_bar()
    if drop_path and "drop_path_rate" not in source.config:
        raise UserError(f"--drop-path: transformers' {source.config.get('model_type')} model has no drop_path_rate "
                        f"(stochastic depth) in its config.json.")
    rate = {"drop_path_rate": drop_path} if drop_path else {}
    built, info = AutoModelForImageClassification.from_pretrained(
        source.folder, num_labels=num_classes, ignore_mismatched_sizes=True, output_loading_info=True, **rate)
    built.register_forward_hook(lambda module, inputs, output: output.logits)
    return built, sorted({*info["missing_keys"], *(k[0] for k in info["mismatched_keys"])})


@dataclass(frozen=True)
class BuiltFrom:
    """What pretrained_model declares of a model it built: its library ("timm" or "transformers") and the names of
    its freshly initialised tensors (its new head; every tensor of a model without weights)."""
    library: str
    new_tensors: tuple[str, ...]


BUILT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> BuiltFrom, for the models built here


def built_from(model: torch.nn.Module) -> BuiltFrom | None:
    """What pretrained_model declared of `model` (unwrapped: the object it returned); None for any other model (a
    ready one, a copy's own)."""
    return BUILT.get(model)


def freeze_backbone(model: torch.nn.Module) -> torch.nn.Module:
    """--backbone-lr-factor 0, a linear probe: of a model pretrained_model built, only the new head trains. Its
    pretrained parameters stop training (requires_grad False: no gradients, and utils/optim.py leaves them out of the
    optimizer) and its batch norms keep their pretrained statistics in training too (timm's FrozenBatchNorm2d, as
    timm's own freeze makes them). The same model, changed in place."""
    from timm.layers import freeze_batch_norm_2d

    built = built_from(model)
    new = set(built.new_tensors) if built else set()
    if not new or new.issuperset(model.state_dict()):
        why = "it holds no new head (the data's classes are its own)" if built and not new else \
            "it holds no pretrained tensors"
        raise UserError(f"--backbone-lr-factor 0 trains a pretrained model's new head alone; {why}.")
    for name, tensor in model.named_parameters():
        tensor.requires_grad_(name in new)
    for name, module in list(model.named_modules()):
        if isinstance(module, torch.nn.BatchNorm2d) and not any(f"{name}.{k}" in new for k in module.state_dict()):
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, freeze_batch_norm_2d(module))
    return model


# Handing the result back -------------------------------------------------------------------------------------------
def library_config(model: torch.nn.Module, facts: dict) -> dict | None:
    """The config.json that makes a run's folder (its model.safetensors beside it) a model folder of the library
    that built `model` (unwrapped; the library pretrained_model declares, built_from), with the run's classes and
    evaluation view: timm's config as timm's save_for_hf writes it, or the transformers model's config with
    id2label; None for any other model. `facts`: utils.data.contract.data_facts of the run's data."""
    built, classes = built_from(model), list(facts["classes"])
    library = built.library if built else None
    if library == "timm":
        import tempfile

        from timm.models._hub import save_config_for_hf  # what timm.models.save_for_hf writes, weights aside

        size = facts["image_size"]
        view = {"input_size": (3, size, size), "interpolation": facts.get("interpolation", "bicubic"),
                "crop_pct": facts.get("eval_crop", 1.0), "crop_mode": "center",
                "mean": tuple(facts["image_mean"]), "std": tuple(facts["image_std"])}
        with tempfile.TemporaryDirectory() as tmp:
            save_config_for_hf(model, f"{tmp}/config.json", model_config={"label_names": classes}, data_config=view)
            return json.loads(Path(f"{tmp}/config.json").read_text())
    if library == "transformers":
        config = copy.deepcopy(model.config)
        config.id2label, config.label2id = dict(enumerate(classes)), {c: i for i, c in enumerate(classes)}
        return json.loads(config.to_json_string(use_diff=False))
    return None
