"""The command line of the three scripts (utils/cli.py's FlagParser): whole flag names only, an unknown flag named
with the nearest known ones, `--config FILE.yaml` with the command line winning, and the run's config.yaml that
repeats it; a finished run started again left as it was."""

from __future__ import annotations

import hashlib
import shutil
from dataclasses import asdict
from pathlib import Path

import pytest
import yaml
from conftest import CPU_YAML, TRACKED_JOB, assert_same_parameters, job_args, read_summary, run_train

import train_cifar
import train_minimal
import train_vit
from utils import UserError

SCRIPTS = {"train_cifar.py": train_cifar.parse_config, "train_vit.py": train_vit.parse_config,
           "train_minimal.py": train_minimal.parse_config}


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize(("argv", "line"), [
    (["--epoch", "1"], "--epoch: not a flag of this script; did you mean --epochs?"),  # no abbreviation
    (["--epoks", "1"], "--epoks: not a flag of this script; did you mean --epochs?"),
    (["--num_train_epochs", "3"], "--num_train_epochs: not a flag of this script; did you mean --epochs?"),
    (["--learning-rate", "0.1"], "--learning-rate: not a flag of this script; did you mean --lr?"),
    (["--output_dri=x"], "--output_dri: not a flag of this script; did you mean --output-dir?"),
    (["--qqqq"], "--qqqq: not a flag of this script (--help lists them)."),
])
def test_a_flag_is_taken_by_its_whole_name_only_and_an_unknown_one_names_the_nearest(script, argv, line):
    """In every script an abbreviated or unknown flag, or the transformers examples' name for one of ours, stops
    with one line naming the flag and the nearest flags (our name for theirs)."""
    with pytest.raises(UserError) as e:
        SCRIPTS[script](argv)
    assert str(e.value) == line


@pytest.mark.parametrize("script", SCRIPTS)
def test_flags_spelled_as_config_keys_and_booleans_with_values_parse_as_a_sweep_agent_passes_them(script):
    """A W&B sweep agent's ${args}: every parameter `--key=value`, named as its config key (`--batch_size`), a boolean
    `--flag=True` or `--flag=False` (true/false, 1/0, yes/no); each parses as the flag's own spelling does, and a
    boolean's other value is one line."""
    parse = SCRIPTS[script]
    assert vars(parse(["--batch_size=8", "--output_dir=runs/a_b"])) == vars(parse(["--batch-size", "8", "--output-dir",
                                                                                  "runs/a_b"]))
    if script == "train_minimal.py":
        return  # no boolean flag
    for word, value in [("True", True), ("False", False), ("true", True), ("0", False), ("1", True), ("no", False)]:
        cfg = parse([f"--decay_exemptions={word}", f"--deterministic={word}", f"--overwrite={word}"])
        assert (cfg.decay_exemptions, cfg.deterministic, cfg.overwrite) == (value, value, value)
    assert asdict(parse(["--deterministic", "--no-decay-exemptions"])) == asdict(parse(["--deterministic=True",
                                                                                      "--decay_exemptions=False"]))
    with pytest.raises(UserError) as e:
        parse(["--deterministic=maybe"])
    assert str(e.value) == "--deterministic takes true or false (got 'maybe')."


def test_a_flag_error_under_the_launcher_is_printed_once_and_is_the_reports_root_cause():
    """Under accelerate launch (2 ranks) an unknown flag is one `error:` line on stderr, printed once, the
    launcher exits 1 and its report's root cause quotes the line."""
    result = run_train(["--epoks", "1"], launch=["--config_file", str(CPU_YAML)])
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 1
    assert errors == ["error: --epoks: not a flag of this script; did you mean --epochs?"], result.stderr[-3000:]
    assert "traceback : error: --epoks: not a flag of this script" in result.stderr.split("Root Cause")[1]


def test_flags_from_a_config_file_are_defaults_the_command_line_and_its_recipe_order_is_kept(tmp_path):
    """`--config FILE.yaml`: its values replace the defaults and the recipe's presets (its own `recipe` too), flags
    on the command line win (a repeated flag's list is replaced, not extended); a key that is no flag, or a value its
    flag refuses, is one line naming the file."""
    path = tmp_path / "flags.yaml"
    path.write_text("recipe: finetune\nlr: 0.05\nepochs: 3\ncrop_scale: [0.2, 1.0]\nchannels_last: false\n"
                    "metric: [accuracy]\ndata_dir: null\n")
    cfg = train_cifar.parse_config(["--config", str(path), "--epochs", "4", "--metric", "f1"])
    assert (cfg.recipe, cfg.optimizer, cfg.weight_decay) == ("finetune", "adamw", 0.05)  # the recipe's presets
    assert (cfg.lr, cfg.epochs, cfg.crop_scale, cfg.channels_last, cfg.metric) == (0.05, 4, (0.2, 1.0), False, ["f1"])
    assert (cfg.data_dir, cfg.batch_size) == (None, 64)  # batch size: the recipe's, the file naming none
    cfg = train_cifar.parse_config(["--config", str(path), "--recipe", "fast"])
    assert (cfg.recipe, cfg.model, cfg.lr, cfg.epochs) == ("fast", "resnet9", 0.05, 3)
    for text, line in (("lrr: 3\n", "lrr is not a flag of this script; did you mean lr?"),
                       ("epochs: ten\n", "argument --epochs: invalid int value: 'ten'."),
                       ("- 1\n", "is not a mapping of flag names to values."),
                       ("a: [\n", "cannot be read (ParserError: while parsing a flow node).")):
        path.write_text(text)
        with pytest.raises(UserError) as e:
            train_cifar.parse_config(["--config", str(path)])
        assert str(e.value).startswith(f"--config {path}") and str(e.value).endswith(line)


@pytest.mark.slow
def test_a_run_repeated_from_its_config_yaml_ends_with_the_same_weights(cifar_dir, cache_dir, tmp_path):
    """A run's config.yaml holds its whole config (summary.json's); `train_cifar.py --config RUN/config.yaml
    --output-dir NEW` trains the same run: the same config but the output folder, bitwise-equal trainable parameters
    (fp32, --deterministic)."""
    first, again = tmp_path / "first", tmp_path / "again"
    job = ["--model", "resnet8", "--train-subset", "128", "--eval-subset", "64", "--batch-size", "32", "--epochs", "1",
           "--lr", "0.05", "--seed", "5", "--deterministic", "--tracker", "none"]
    result = run_train(job_args(cifar_dir, cache_dir, first, *job))
    assert result.returncode == 0, result.stderr[-3000:]
    kept = yaml.safe_load((first / "config.yaml").read_text())
    assert kept == read_summary(first)["config"] and kept["seed"] == 5 and kept["lr"] == 0.05
    result = run_train(["--config", str(first / "config.yaml"), "--output-dir", str(again)])
    assert result.returncode == 0, result.stderr[-3000:]
    assert read_summary(again)["config"] == {**kept, "output_dir": str(again)}
    assert_same_parameters(first, again)


@pytest.mark.parametrize("script", SCRIPTS)
def test_each_script_reads_back_the_config_yaml_it_writes(script, tmp_path):
    """The config.yaml of each script's parsed flags (as a run writes it) parses back to the same config."""
    from utils.cli import write_config_file

    cfg = SCRIPTS[script](["--epochs", "2", "--lr", "0.3", "--output-dir", str(tmp_path / "run")])
    values = vars(cfg) if script == "train_minimal.py" else asdict(cfg)
    path = write_config_file(values, tmp_path / "run")
    again = SCRIPTS[script](["--config", str(path)])
    if script == "train_minimal.py":  # its namespace records the file it read (--config)
        assert vars(again).pop("config") == str(path) and values.pop("config") is None
    assert (vars(again) if script == "train_minimal.py" else asdict(again)) == values


def _digest(folder: Path) -> dict:
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_a_finished_run_started_again_says_so_and_leaves_every_file_as_it_was(tracked_runs, cifar_dir, cache_dir,
                                                                               tmp_path):
    """A finished 2-process W&B run started again with --resume auto as one `python` process: it says the run is
    finished, trains nothing and builds no model (no "freshly initialised"), and every file of its folder
    (summary.json, the weights, config.yaml, the W&B run) is as it was, and none is added."""
    out = tmp_path / "b"
    shutil.copytree(tracked_runs["b"], out, symlinks=True)
    before = _digest(out)
    result = run_train([*job_args(cifar_dir, cache_dir, out, *TRACKED_JOB), "--lr", "0.2", "--group", "B",
                        "--resume", "auto"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"the run in {out} is finished (epoch 2 of 2, step 16): nothing to train" in result.stdout
    assert "freshly initialised" not in result.stdout + result.stderr
    assert _digest(out) == before


@pytest.mark.slow
@pytest.mark.parametrize("summary", ["missing", "damaged"])
def test_a_finished_run_without_its_summary_writes_its_outputs_again_from_its_last_checkpoint(tracked_runs, cifar_dir,
                                                                                              cache_dir, tmp_path,
                                                                                              summary):
    """A run stopped after its last checkpoint but before summary.json was written (which is written last), or whose
    summary.json was damaged since (with a warning line), is not finished: --resume auto says its epochs are trained,
    trains nothing, and writes summary.json again with the same top-1 and model.safetensors again with the same
    bytes."""
    out = tmp_path / "a0"
    shutil.copytree(tracked_runs["a0"], out, symlinks=True)
    original = read_summary(out)
    weights = (out / "model.safetensors").read_bytes()
    if summary == "missing":
        (out / "summary.json").unlink()
    else:
        (out / "summary.json").write_text('{"eval_top1": ')
    (out / "model.safetensors").unlink()
    result = run_train([*job_args(cifar_dir, cache_dir, out, *TRACKED_JOB), "--lr", "0.05", "--group", "A",
                        "--resume", "auto"])
    assert result.returncode == 0, result.stderr[-3000:]
    damaged = f"warning: {out / 'summary.json'} does not read (JSONDecodeError); the run's outputs are written again"
    assert (damaged in result.stdout) == (summary == "damaged")
    assert "changed config" not in result.stdout  # a run folder moved elsewhere: its output_dir is not a change
    assert f"resumed from {out / 'checkpoints' / 'step-00000016'}: its 2 epochs are trained (step 16); writing the " \
           f"run's outputs" in result.stdout
    assert "epoch 1/2" not in result.stdout and "epoch 2/2" not in result.stdout  # nothing trained
    summary = read_summary(out)
    assert summary["eval_top1"] == original["eval_top1"] and summary["global_step"] == 16
    assert (out / "model.safetensors").read_bytes() == weights


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_trial_of_a_sweep_agent_trains_in_its_run_ids_folder_and_one_without_a_run_id_is_one_line(script,
                                                                                                    monkeypatch):
    """Under a W&B sweep agent (WANDB_SWEEP_ID set) the output folder is <--output-dir>/<WANDB_RUN_ID>, continued
    (--resume auto) unless --resume says otherwise; WANDB_SWEEP_ID without a run id is one line."""
    monkeypatch.setenv("WANDB_SWEEP_ID", "sweeptst")
    monkeypatch.setenv("WANDB_RUN_ID", "abc123xy")
    cfg = SCRIPTS[script](["--output_dir=runs/sweep"])
    assert (cfg.output_dir, cfg.resume) == (str(Path("runs/sweep/abc123xy")), "auto")
    monkeypatch.setenv("WANDB_SWEEP_ID", "sweeptst")
    monkeypatch.delenv("WANDB_RUN_ID", raising=False)
    with pytest.raises(UserError, match="WANDB_SWEEP_ID is set, but WANDB_RUN_ID is '', not a W&B run id"):
        SCRIPTS[script]([])
