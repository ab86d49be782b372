"""The two templates cannot drift apart. train_cifar.py and train_vit.py share their data, checkpoints and logging
flags, defined once in utils/config_groups.py, and their main(), written out in each script so that a copier reads
the whole loop in one file. This test holds the two main()s to each other: as normalised code (ast.unparse: no
comments, one layout) they may differ only where ALLOWED says, each difference with its reason. A change made to one
script's loop alone fails here: make it in both, or list it below with its reason."""

from __future__ import annotations

import ast
import difflib
from dataclasses import fields
from pathlib import Path

import pytest
from conftest import CPU_YAML, FSDP_CPU_YAML, REPO, job_args, read_summary, run_train, script_env

import train_cifar
import train_vit
from utils.config_groups import CheckpointConfig, DataConfig, EvaluationConfig, HubConfig, LoggingConfig

# (train_cifar.py's lines, train_vit.py's lines, why they differ): whole statements as ast.unparse writes them.
ALLOWED = [
    (["fsdp = fsdp_plugin_from_launcher()"],
     ["fsdp = fsdp_plugin_from_launcher(bf16_params=True)"],
     "the ViT, having no BatchNorm, can gather bf16 parameters"),
    (["check_world(accelerator, fsdp_asked=fsdp is not None, sync_bn=cfg.sync_bn)"],
     ["check_world(accelerator, fsdp_asked=fsdp is not None)"],
     "the ViT has no BatchNorm, so no --sync-bn"),
    (["model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model) if cfg.sync_bn else model"], [],
     "the ResNet may convert its BatchNorms to SyncBatchNorm; the ViT has none"),
    (["channels_last = cfg.channels_last and fsdp is None",
      "if channels_last:",
      "model = model.to(memory_format=torch.channels_last)",
      "optimizer = build_optimizer(cfg, model, lr, fused=fsdp is None)"],
     ["if cfg.activation_checkpointing:",
      "checkpoint_blocks(model)",
      "optimizer = build_optimizer(cfg, model, lr)"],
     "the ResNet runs channels-last (not under FSDP2) with fused SGD; the ViT may checkpoint its blocks, and uses "
     "its own AdamW parameter groups"),
    (["transform = BatchTransform(accelerator.device, channels_last=channels_last, "
      "pad=crop_padding(data['image_size']), mean=data['mean'], std=data['std'], num_classes=len(data['classes']))",
      "run_eval = partial(evaluate, model, eval_loader, transform, accelerator, tta_flip=cfg.tta_flip, "
      "classes=data['classes'], metrics=load_metrics(cfg.metric, data['classes'], accelerator))"],
     ["transform = BatchTransform(accelerator.device, channels_last=False, pad=crop_padding(data['image_size']), "
      "mean=data['mean'], std=data['std'], num_classes=len(data['classes']))",
      "run_eval = partial(evaluate, model, eval_loader, transform, accelerator, tta_flip=False, "
      "classes=data['classes'], metrics=load_metrics(cfg.metric, data['classes'], accelerator))"],
     "the ViT's patch embedding takes NCHW; flip test-time augmentation is the ResNet recipes' (the ViT has no "
     "--tta-flip)"),
    (["run_info = {**run_facts(accelerator, cfg, model, plan, total_steps, lr), 'channels_last': channels_last, "
      "**init}"],
     ["run_info = {**run_facts(accelerator, cfg, model, plan, total_steps, lr), 'fsdp_param_dtype': "
      "_param_dtype(fsdp), **init}"],
     "each run records its own layout fact: channels-last for the ResNet, FSDP's parameter dtype for the ViT"),
]
# train_vit.py's Config redefines these fields of the shared groups, with these reasons.
REDEFINED = {"output_dir": "its own default folder, so a ViT run never lands in a ResNet run's folder"}


def main_statements(script: str) -> list[str]:
    tree = ast.parse((REPO / script).read_text())
    main = next(node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "main")
    return [line.strip() for line in ast.unparse(main).splitlines()]


def differences(a: list[str], b: list[str]) -> list[tuple[list[str], list[str]]]:
    matcher = difflib.SequenceMatcher(a=a, b=b, autojunk=False)
    return [(a[i1:i2], b[j1:j2]) for tag, i1, i2, j1, j2 in matcher.get_opcodes() if tag != "equal"]


def unexplained(found: list[tuple[list[str], list[str]]]) -> tuple[list, list]:
    """(differences ALLOWED does not list, ALLOWED entries that no longer occur)."""
    allowed = [(a, b) for a, b, _ in ALLOWED]
    return [d for d in found if d not in allowed], [a for a in allowed if a not in found]


def test_the_two_templates_main_differ_only_where_the_test_lists_a_reason():
    cifar, vit = main_statements("train_cifar.py"), main_statements("train_vit.py")
    extra, stale = unexplained(differences(cifar, vit))
    shown = "\n".join(f"- train_cifar.py: {a}\n  train_vit.py:   {b}" for a, b in extra)
    assert not extra, f"main() differs between the templates where ALLOWED gives no reason:\n{shown}"
    assert not stale, f"ALLOWED lists differences that are gone (delete them): {stale}"
    own = sum(len(a) for a, _, _ in ALLOWED)
    assert len(cifar) - own >= 0.85 * len(cifar), f"only {len(cifar) - own} of main()'s {len(cifar)} lines shared"


def test_a_change_to_one_templates_loop_alone_is_caught():
    cifar, vit = main_statements("train_cifar.py"), main_statements("train_vit.py")
    at = next(i for i, line in enumerate(vit) if line.startswith("optimizer.zero_grad"))
    drifted = [*vit[:at], "optimizer.zero_grad()", *vit[at + 1:]]  # set_to_none dropped in one script only
    extra, _ = unexplained(differences(cifar, drifted))
    assert extra == [([cifar[cifar.index(vit[at])]], ["optimizer.zero_grad()"])]


@pytest.mark.parametrize("module", [train_cifar, train_vit], ids=["train_cifar", "train_vit"])
def test_each_templates_config_takes_the_shared_groups_as_defined_once(module):
    shared = (DataConfig, EvaluationConfig, CheckpointConfig, LoggingConfig, HubConfig)
    assert all(issubclass(module.Config, group) for group in shared)
    mine = {f.name: f for f in fields(module.Config)}
    for group in shared:
        for f in fields(group):
            same = (mine[f.name].default, mine[f.name].metadata) == (f.default, f.metadata)
            assert same or (module is train_vit and f.name in REDEFINED), f"{module.__name__} redefines {f.name}"


# ----------------------------------------------------------------------------------------------------
# The copier's contracts: a copy of train_cifar.py with its own model or its own loader, run for real
# ----------------------------------------------------------------------------------------------------
SMALL_JOB = ["--model", "resnet8", "--train-subset", "256", "--eval-subset", "64", "--batch-size", "32",
             "--epochs", "1", "--tracker", "none"]  # the model where the copy keeps build_model: the cheapest
OWN_MODEL = {"import torch\n": "import torch\nimport torchvision\n",
             'model = named_model(cfg.model, len(data["classes"]), sync_bn=cfg.sync_bn)':
             'model = torchvision.models.mobilenet_v3_small(num_classes=len(data["classes"]))'}
BUILT_LOADERS = "train_loader, eval_loader, data = build_loaders(cfg, accelerator, plan)"


def own_loader(dtype: str) -> dict[str, str]:
    """The copier's own training loader: a plain DataLoader of (images, labels) pairs, shuffled by torch."""
    pairs = (f"pairs = torch.utils.data.TensorDataset(train_loader.dataset.images.to(torch.{dtype}), "
             "train_loader.dataset.labels)")
    loader = "train_loader = torch.utils.data.DataLoader(pairs, batch_size=plan.micro, shuffle=True, drop_last=True)"
    return {BUILT_LOADERS: f"{BUILT_LOADERS}\n    {pairs}\n    {loader}"}


def copy_of_train_cifar(tmp_path, replacements: dict[str, str]) -> Path:
    """train_cifar.py as a copier edits it, saved outside the repository (it imports utils/ through PYTHONPATH)."""
    text = (REPO / "train_cifar.py").read_text()
    for old, new in replacements.items():
        assert old in text, f"train_cifar.py no longer has {old!r}: update this test"
        text = text.replace(old, new)
    path = tmp_path / "my_train.py"
    path.write_text(text)
    return path


def run_copy(script: Path, cifar_dir, cache_dir, out: Path, launch=None):
    env = script_env(PYTHONPATH=str(REPO))
    return run_train(job_args(cifar_dir, cache_dir, out, *SMALL_JOB), launch=launch, env=env, script=script)


@pytest.mark.slow
def test_a_copy_with_its_own_model_trains_under_ddp_and_stops_under_fsdp_naming_the_block_setting(
        cifar_dir, cache_dir, tmp_path):
    script = copy_of_train_cifar(tmp_path, OWN_MODEL)
    result = run_copy(script, cifar_dir, cache_dir, tmp_path / "ddp", launch=["--config_file", str(CPU_YAML)])
    assert result.returncode == 0, result.stderr[-3000:]
    s = read_summary(tmp_path / "ddp")
    assert (s["world_size"], s["wrapper"], s["global_step"]) == (2, "DistributedDataParallel", 256 // 64)
    result = run_copy(script, cifar_dir, cache_dir, tmp_path / "fsdp", launch=["--config_file", str(FSDP_CPU_YAML)])
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 1 and len(errors) == 1, result.stderr[-3000:]
    assert "blocks of class BasicBlock" in errors[0] and "fsdp_transformer_layer_cls_to_wrap" in errors[0]
    assert "Could not find the transformer layer class" not in result.stderr  # Accelerate's traceback never comes


@pytest.mark.slow
def test_a_copy_with_a_loader_of_images_and_labels_trains_without_augmentation(cifar_dir, cache_dir, tmp_path):
    script = copy_of_train_cifar(tmp_path, own_loader("uint8"))
    result = run_copy(script, cifar_dir, cache_dir, tmp_path / "out")
    assert result.returncode == 0, result.stderr[-3000:]
    s = read_summary(tmp_path / "out")
    assert s["global_step"] == 256 // 32 and s["train_images_seen"] == 256 and s["eval_examples"] == 64


@pytest.mark.slow
def test_a_copy_whose_loader_gives_float_images_stops_with_one_line_naming_uint8(cifar_dir, cache_dir, tmp_path):
    script = copy_of_train_cifar(tmp_path, own_loader("float32"))
    result = run_copy(script, cifar_dir, cache_dir, tmp_path / "out")
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2 and errors == [
        "error: the loader gave float32 images; the transform takes uint8 images (0-255), as utils/batches.py's "
        "loaders give them (docs/customizing.md)."], result.stderr[-3000:]
    assert "Traceback" not in result.stderr
