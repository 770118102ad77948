"""jdp.config: defaults, YAML files, command-line overrides, validation, saving and finding configs."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

import jdp.config as jc
from jdp.config import (
    Config,
    ConfigError,
    DataConfig,
    Derived,
    ModelConfig,
    OptimConfig,
    TrainConfig,
    load_config,
    resolve_config_path,
    save_config,
    valid_keys,
    validate,
)

REPO = Path(__file__).resolve().parents[1]


def _write(tmp_path: Path, text: str, name: str = "exp.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _without_run_dir(cfg: Config) -> Config:
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, run_dir=""))


def _with(cfg: Config | None = None, **sections) -> Config:
    """A Config with some fields of some sections replaced: _with(model={"d_model": 64})."""
    cfg = cfg or Config()
    return dataclasses.replace(
        cfg, **{s: dataclasses.replace(getattr(cfg, s), **values) for s, values in sections.items()}
    )


# ---------------------------------------------------------------------------------------------- loading


def test_defaults():
    cfg = load_config()
    assert _without_run_dir(cfg) == Config()
    assert cfg.model == ModelConfig() and cfg.data == DataConfig() and cfg.optim == OptimConfig()
    assert cfg.train.batch_size == 32 and cfg.model.vocab_size == 320 and cfg.data.source == "stdlib"
    assert cfg.optim.lr == 1e-3 and cfg.train.progress is True


def test_default_run_dir_is_filled_in(tmp_path):
    cfg = load_config()
    assert cfg.train.run_dir.startswith("runs/default-")
    assert len(cfg.train.run_dir) > len("runs/default-")
    from_file = load_config(_write(tmp_path, "train:\n  steps: 5\n", name="my-exp.yaml"))
    assert from_file.train.run_dir.startswith("runs/my-exp-")
    # A run_dir that is given is kept, from a file or an override.
    assert load_config(overrides=["train.run_dir=/tmp/somewhere"]).train.run_dir == "/tmp/somewhere"
    given = load_config(_write(tmp_path, "train:\n  run_dir: out/run1\n"))
    assert given.train.run_dir == "out/run1"


def test_yaml_values_apply_then_overrides_win(tmp_path):
    path = _write(
        tmp_path,
        """
model:
  d_model: 64
  n_heads: 2
data:
  source: ./corpus.jsonl
  seq_len: 64
optim:
  lr: 3e-4        # YAML 1.1 reads this as a string; it must still become a float
  name: sgd
train:
  steps: 50
  batch_size: 16
  progress: false
""",
    )
    cfg = load_config(path)
    assert cfg.model.d_model == 64 and cfg.model.n_heads == 2
    assert cfg.data.source == "./corpus.jsonl" and cfg.data.seq_len == 64
    assert cfg.optim.lr == pytest.approx(3e-4) and isinstance(cfg.optim.lr, float)
    assert cfg.optim.name == "sgd"
    assert cfg.train.steps == 50 and cfg.train.batch_size == 16 and cfg.train.progress is False
    # Everything not in the file keeps its default.
    assert cfg.model.n_layers == ModelConfig().n_layers and cfg.optim.b2 == OptimConfig().b2
    assert cfg.data.tokenizer == "byte"

    cfg = load_config(path, ["train.steps=7", "optim.lr=1e-2", "model.n_layers=2", "train.steps=9"])
    assert cfg.train.steps == 9  # the last override of a key wins
    assert cfg.optim.lr == pytest.approx(1e-2)
    assert cfg.model.n_layers == 2
    assert cfg.train.batch_size == 16 and cfg.model.d_model == 64  # the file still applies


def test_override_type_parsing():
    cfg = load_config(
        overrides=[
            "train.batch_size=64",
            "train.steps=1_000",
            "optim.lr=3e-4",
            "optim.eps=1e-6",
            "optim.grad_clip=2",
            "optim.b1=0.85",
            "train.progress=false",
            "data.name=123",
            "data.source=/data/x=y.jsonl",
            "data.split=",
        ]
    )
    assert cfg.train.batch_size == 64 and type(cfg.train.batch_size) is int
    assert cfg.train.steps == 1000
    assert cfg.optim.lr == pytest.approx(3e-4) and type(cfg.optim.lr) is float
    assert cfg.optim.eps == pytest.approx(1e-6)
    assert cfg.optim.grad_clip == 2.0 and type(cfg.optim.grad_clip) is float
    assert cfg.optim.b1 == pytest.approx(0.85)
    assert cfg.train.progress is False
    assert cfg.data.name == "123" and type(cfg.data.name) is str
    assert cfg.data.source == "/data/x=y.jsonl"  # only the first '=' separates key and value
    assert cfg.data.split == ""


@pytest.mark.parametrize(
    "text, value",
    [("true", True), ("True", True), ("1", True), ("yes", True), ("false", False), ("0", False), ("no", False)],
)
def test_override_bool_spellings(text, value):
    assert load_config(overrides=[f"train.progress={text}"]).train.progress is value


def test_yaml_int_for_float_and_str_fields(tmp_path):
    cfg = load_config(_write(tmp_path, "optim:\n  lr: 1\ndata:\n  name: 2024\n"))
    assert cfg.optim.lr == 1.0 and type(cfg.optim.lr) is float
    assert cfg.data.name == "2024"


# ---------------------------------------------------------------------------------------------- bad input


def test_unknown_key_in_override_lists_valid_keys():
    with pytest.raises(ConfigError) as e:
        load_config(overrides=["train.zzz=8"])  # nothing like it: every key is listed
    msg = str(e.value)
    assert "train.zzz" in msg and "train.batch_size" in msg and "optim.lr" in msg and "did you mean" not in msg


@pytest.mark.parametrize(
    "override, hint",
    [
        ("train.step=10", "did you mean train.steps"),  # a letter missing
        ("train.batchsize=8", "did you mean train.batch_size?"),
        ("model.dmodel=64", "did you mean model.d_model?"),
        ("data.steps=10", "did you mean train.steps?"),  # the right key in the wrong section
        ("trian.steps=10", "did you mean train?"),
    ],
)
def test_a_near_miss_key_gets_did_you_mean_first_not_every_key(override, hint):
    with pytest.raises(ConfigError) as e:
        load_config(overrides=[override])
    first, *rest = str(e.value).split("\n")
    assert hint in first, str(e.value)
    assert len(rest) == 1 and rest[0].count(".") < 40  # then one line of the section's keys (train: 31), not all 136


def test_the_model_keys_are_shown_by_family_and_a_run_records_its_familys_only(tmp_path):
    """A Llama user never reads GPT's keys as Llama's, nor the reverse: an unknown model key lists each family's keys
    apart, and the config a run saves (config.yaml, the checkpoint record) holds its own family's keys only."""
    with pytest.raises(ConfigError) as e:
        load_config(overrides=["model.zzz=1"])
    msg = str(e.value)
    assert "every family's vocab_size" in msg and "GPT's (model.arch=gpt) mlp_ratio, bias;" in msg
    assert "Llama's (model.arch=llama) n_kv_heads" in msg and "data.source" not in msg
    for arch, own, foreign in (("llama", "rope_theta", "mlp_ratio"), ("gpt", "mlp_ratio", "rope_theta")):
        cfg = load_config(overrides=[f"model.arch={arch}", f"train.run_dir={tmp_path / arch}"])
        saved = yaml.safe_load(save_config(cfg, tmp_path / arch).read_text())["model"]
        assert own in saved and foreign not in saved and "d_model" in saved and cfg.to_dict()["model"] == saved
        assert load_config(tmp_path / arch / "config.yaml") == cfg  # the keys left out come back as their defaults


def test_unknown_key_in_file_lists_valid_keys(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(_write(tmp_path, "train:\n  stepz: 10\n"))
    msg = str(e.value)
    assert "train.stepz" in msg and "train.batch_size" in msg and "train.steps" in msg


def test_unknown_section(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(_write(tmp_path, "trainer:\n  steps: 10\n"))
    assert "'trainer': did you mean train?" in str(e.value)
    with pytest.raises(ConfigError) as e:
        load_config(overrides=["trainer.steps=10"])
    assert "'trainer': did you mean train?" in str(e.value)
    with pytest.raises(ConfigError) as e:
        load_config(overrides=["optimizer.lr=10"])  # no near section: every key
    assert "'optimizer'" in str(e.value) and "train.batch_size" in str(e.value)


@pytest.mark.parametrize("override", ["train.steps=abc", "train.steps=3.5", "train.steps=", "optim.lr=fast"])
def test_wrong_type_override_names_the_key(override):
    with pytest.raises(ConfigError) as e:
        load_config(overrides=[override])
    key = override.split("=")[0]
    assert key in str(e.value) and "expected" in str(e.value)


def test_bad_bool_override():
    with pytest.raises(ConfigError) as e:
        load_config(overrides=["train.progress=maybe"])
    assert "train.progress" in str(e.value) and "bool" in str(e.value)


@pytest.mark.parametrize(
    "text, key",
    [
        ('train:\n  steps: "100"\n', "train.steps"),  # a quoted string is not an int
        ("train:\n  steps: abc\n", "train.steps"),
        ("train:\n  batch_size: true\n", "train.batch_size"),  # a bool is not an int
        ("train:\n  steps: 1.5\n", "train.steps"),
        ("train:\n  progress: 1\n", "train.progress"),  # in a file, a bool must be a YAML bool
        ("optim:\n  lr: [1, 2]\n", "optim.lr"),
        ("data:\n  source: [a, b]\n", "data.source"),
    ],
)
def test_wrong_type_in_file_names_the_key(tmp_path, text, key):
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert key in str(e.value) and "expected" in str(e.value)


def test_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="mapping of sections"):
        load_config(_write(tmp_path, "- a\n- b\n"))
    with pytest.raises(ConfigError, match="'train' must be a mapping"):
        load_config(_write(tmp_path, "train: 5\n"))
    assert _without_run_dir(load_config(_write(tmp_path, "# only a comment\n"))) == Config()


@pytest.mark.parametrize("override", ["train.steps", "train.steps:5", "steps=5", "train.steps.x=5"])
def test_malformed_override(override):
    with pytest.raises(ConfigError) as e:
        load_config(overrides=[override])
    assert "section.key" in str(e.value)


# ---------------------------------------------------------------------------------------------- validate


def test_validate_returns_derived_numbers():
    cfg = _with(train={"batch_size": 32, "grad_accum": 4}, data={"seq_len": 64})
    d = validate(cfg, n_devices=2)
    assert isinstance(d, Derived)
    assert (d.n_devices, d.n_processes) == (2, 1)
    assert d.per_device_batch == 16
    assert d.micro_batch == 4
    assert d.tokens_per_step == 32 * 64
    assert "tokens/step 2,048" in d.describe()

    d = validate(_with(train={"batch_size": 48}), n_devices=8, n_processes=2)
    assert (d.n_devices, d.n_processes, d.per_device_batch, d.micro_batch) == (8, 2, 6, 6)
    assert d.tokens_per_step == 48 * DataConfig().seq_len

    d = validate(Config(), n_devices=1)
    assert (d.per_device_batch, d.micro_batch, d.tokens_per_step) == (32, 32, 32 * 128)


def test_validate_batch_not_divisible_suggests_a_multiple():
    with pytest.raises(ConfigError) as e:
        validate(_with(train={"batch_size": 30}), n_devices=4)
    msg = str(e.value)
    assert "train.batch_size=30" in msg and "multiple of 4" in msg and "28 or 32" in msg
    with pytest.raises(ConfigError) as e:
        validate(_with(train={"batch_size": 6, "grad_accum": 2}), n_devices=2)
    msg = str(e.value)
    assert "train.grad_accum" in msg and "multiple of 4" in msg and "4 or 8" in msg
    # Fewer sequences than devices.
    with pytest.raises(ConfigError, match="multiple of 8, e.g. 8 or 16"):
        validate(_with(train={"batch_size": 4}), n_devices=8)
    # Each suggestion really is valid.
    validate(_with(train={"batch_size": 28}), n_devices=4)
    validate(_with(train={"batch_size": 8, "grad_accum": 2}), n_devices=2)


def test_validate_seq_len_longer_than_model():
    with pytest.raises(ConfigError) as e:
        validate(_with(data={"seq_len": 512}, model={"max_seq_len": 256}), n_devices=1)
    msg = str(e.value)
    assert "data.seq_len=512" in msg and "model.max_seq_len=256" in msg
    validate(_with(data={"seq_len": 256}, model={"max_seq_len": 256}), n_devices=1)


def test_validate_heads_must_divide_d_model():
    with pytest.raises(ConfigError) as e:
        validate(_with(model={"d_model": 100, "n_heads": 3}), n_devices=1)
    assert "model.d_model=100" in str(e.value) and "model.n_heads=3" in str(e.value)


def test_validate_optimizer_name():
    with pytest.raises(ConfigError) as e:
        validate(_with(optim={"name": "adam"}), n_devices=1)
    assert "optim.name='adam'" in str(e.value) and "adamw" in str(e.value) and "sgd" in str(e.value)
    validate(_with(optim={"name": "sgd"}), n_devices=1)


@pytest.mark.parametrize("key", ["dtype", "param_dtype"])
def test_validate_dtype(key):
    with pytest.raises(ConfigError) as e:
        validate(_with(model={key: "float64"}), n_devices=1)
    assert f"model.{key}='float64'" in str(e.value) and "bfloat16" in str(e.value)
    validate(_with(model={key: "bfloat16"}), n_devices=1)


@pytest.mark.parametrize(
    "sections, needle",
    [
        ({"train": {"steps": 0}}, "train.steps=0 must be positive"),
        ({"train": {"grad_accum": 0}}, "train.grad_accum=0 must be positive"),
        ({"model": {"vocab_size": -1}}, "model.vocab_size=-1 must be positive"),
        ({"model": {"attention": "flash"}}, "model.attention='flash'"),
        ({"data": {"val_tokens": -1}}, "data.val_tokens"),
        ({"optim": {"lr": 0.0}}, "optim.lr=0.0 must be positive"),
        ({"optim": {"min_lr_ratio": 1.5}}, "optim.min_lr_ratio=1.5 must be in [0, 1]"),
    ],
)
def test_validate_other_problems(sections, needle):
    with pytest.raises(ConfigError) as e:
        validate(_with(**sections), n_devices=1)
    assert needle in str(e.value)


def test_validate_reports_every_problem_at_once():
    bad = _with(model={"dtype": "int8", "d_model": 10, "n_heads": 3}, optim={"name": "lion"}, train={"batch_size": 3})
    with pytest.raises(ConfigError) as e:
        validate(bad, n_devices=2)
    msg = str(e.value)
    for needle in ("model.dtype", "model.d_model=10", "optim.name", "train.batch_size=3"):
        assert needle in msg


def test_tiny_config_is_valid():
    cfg = load_config("tiny")
    d = validate(cfg, n_devices=1)
    assert d.tokens_per_step == cfg.train.batch_size * cfg.data.seq_len


# ---------------------------------------------------------------------------------------------- save / find


def test_save_config_round_trip(tmp_path):
    cfg = load_config(
        overrides=[
            "optim.lr=3e-4",
            "optim.eps=1e-9",
            "train.progress=false",
            "data.name=123",  # a str that looks like an int must come back as a str
            "data.split=true",  # ... and one that looks like a bool
            "data.source=/data/*.jsonl",
            "model.d_model=64",
            f"train.run_dir={tmp_path / 'run'}",
        ]
    )
    path = save_config(cfg, tmp_path / "run")
    assert path == tmp_path / "run" / "config.yaml" and path.is_file()
    assert yaml.safe_load(path.read_text())["optim"]["lr"] == pytest.approx(3e-4)
    back = load_config(path)
    assert back == cfg
    assert back.data.name == "123" and back.data.split == "true" and back.train.progress is False


def test_save_config_round_trip_defaults(tmp_path):
    cfg = load_config()
    back = load_config(save_config(cfg, tmp_path / "nested" / "dir"))
    assert back == cfg  # including the generated run_dir


def test_resolve_config_path():
    tiny = REPO / "configs" / "tiny.yaml"
    assert resolve_config_path("tiny").resolve() == tiny
    assert resolve_config_path("tiny.yaml").resolve() == tiny
    assert resolve_config_path(str(tiny)) == tiny
    cfg = load_config("tiny")
    raw = yaml.safe_load(tiny.read_text())
    assert cfg.model.max_seq_len == raw["model"]["max_seq_len"]
    assert cfg.optim.lr == pytest.approx(float(raw["optim"]["lr"]))
    assert cfg.train.steps == raw["train"]["steps"]
    assert cfg.train.run_dir.startswith("runs/tiny-")


def test_resolve_config_path_prefers_an_existing_path(tmp_path):
    own = _write(tmp_path, "train:\n  steps: 3\n", name="tiny.yaml")
    assert resolve_config_path(str(own)) == own
    assert load_config(own).train.steps == 3


def test_missing_config_file():
    with pytest.raises(ConfigError) as e:
        resolve_config_path("no-such-config")
    msg = str(e.value)
    assert "'no-such-config'" in msg and "not found" in msg and "no-such-config.yaml" in msg


def test_valid_keys_cover_every_field():
    keys = valid_keys()
    assert len(keys) == len(set(keys))
    for section, cls in [("model", ModelConfig), ("data", DataConfig), ("optim", OptimConfig), ("train", TrainConfig)]:
        for f in dataclasses.fields(cls):
            assert f"{section}.{f.name}" in keys
            assert f.type in jc._TYPES, f"{section}.{f.name} has a type the override parser does not know"


def test_validate_parallel_options():
    with pytest.raises(ConfigError, match="single-process master pattern"):
        validate(_with(parallel={"strategy": "dp"}), n_devices=4, n_processes=2)
    validate(_with(parallel={"strategy": "dp"}), n_devices=4, n_processes=1)
    with pytest.raises(ConfigError, match="must be one of ddp, zero1, fsdp, hsdp, dp"):
        validate(_with(parallel={"strategy": "zero3"}), n_devices=1)
    with pytest.raises(ConfigError, match="bucket_mb=-1.0 must be >= 0"):
        validate(_with(parallel={"bucket_mb": -1.0}), n_devices=1)
    with pytest.raises(ConfigError, match="reduce_dtype='float16' must be one of float32, bfloat16"):
        validate(_with(parallel={"reduce_dtype": "float16"}), n_devices=1)
    cfg = load_config(None, ["parallel.bucket_mb=0.5", "parallel.reduce_dtype=bfloat16"])
    assert cfg.parallel.bucket_mb == 0.5 and cfg.parallel.reduce_dtype == "bfloat16"


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "NaN"])
def test_non_finite_numbers_are_refused_before_anything_runs(value):
    with pytest.raises(ConfigError) as e:
        validate(load_config("tiny", [f"optim.lr={value}", f"parallel.bucket_mb={value}"]), n_devices=1)
    assert "optim.lr=" in str(e.value) and "parallel.bucket_mb=" in str(e.value) and "finite" in str(e.value)


@pytest.mark.parametrize(
    "override, needle",
    [
        ("optim.b2=1.0", "optim.b2=1.0 must be in [0, 1)"),
        ("optim.eps=0", "optim.eps=0.0 must be positive"),
        ("optim.weight_decay=-0.1", "optim.weight_decay=-0.1 must be >= 0"),
        ("data.encoding_errors=lenient", "data.encoding_errors='lenient' must be one of strict, replace, ignore"),
    ],
)
def test_out_of_range_numbers_and_unknown_choices_are_refused(override, needle):
    with pytest.raises(ConfigError) as e:
        validate(load_config("tiny", [override]), n_devices=1)
    assert needle in str(e.value)


def test_every_shipped_config_is_valid():
    from jdp.config import resolve_config_path

    for name in ("tiny", "gpt2-small"):
        cfg = load_config(name)
        validate(cfg, n_devices=8 if name != "tiny" else 1)
        assert resolve_config_path(name).is_file()


def test_a_yaml_syntax_error_names_the_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  steps: [1, 2\n")
    with pytest.raises(ConfigError, match="bad.yaml: not valid YAML"):
        load_config(bad)


def test_a_key_given_twice_is_refused_with_its_line_not_kept_last(tmp_path):
    """PyYAML keeps the last of two equal keys: a second `train:` section dropped the first's batch size, and
    `d_model` twice trained the second. Refused, with the file, the line and the key, in a file and in data.sources."""
    twice = _write(tmp_path, "model:\n  d_model: 32\n  n_layers: 2\n  d_model: 64\n", "twice.yaml")
    with pytest.raises(ConfigError, match=r"twice.yaml, line 4: 'd_model' is given twice .*\(first at line 2\)"):
        load_config(twice)
    sections = _write(tmp_path, "train:\n  batch_size: 8\nmodel:\n  d_model: 32\ntrain:\n  steps: 3\n", "sec.yaml")
    with pytest.raises(ConfigError, match=r"sec.yaml, line 5: 'train' is given twice .*\(first at line 1\)"):
        load_config(sections)
    with pytest.raises(ConfigError, match=r"data.sources=.*'source' is given twice"):
        load_config(overrides=["data.sources=[{source: a, source: b}]"])
    assert load_config(_write(tmp_path, "model:\n  d_model: 32\ntrain:\n  steps: 3\n")).model.d_model == 32


def test_a_config_file_that_is_not_utf8_is_one_error_line_for_train_and_plan(tmp_path):
    import subprocess
    import sys

    latin = tmp_path / "latin.yaml"
    latin.write_bytes(b"train:\n  steps: 3  # caf\xe9\n")
    for command in (["train", str(latin)], ["plan", str(latin), "--devices", "2"]):
        out = subprocess.run([sys.executable, "-m", "jdp.cli", *command], capture_output=True, text=True, timeout=120)
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
        assert out.stderr.strip().splitlines() == [f"jdp: error: {latin}: not UTF-8 text (invalid continuation byte "
                                                   f"at byte 24); save it as UTF-8"], out.stderr  # fmt: skip


def test_an_option_the_strategy_does_not_read_and_an_infinite_weight_are_named_as_such():
    """parallel.shard_size (hsdp's) under fsdp was ignored without a word; `weight: inf` was told it must be > 0."""
    cases = {
        ("parallel.strategy=fsdp", "parallel.shard_size=2"):
            "parallel.shard_size=2 is an option of hsdp, which parallel.strategy=fsdp does not read",
        ("parallel.strategy=zero1", "parallel.reshard_after_forward=false"):
            "parallel.reshard_after_forward=False is an option of fsdp and hsdp, which parallel.strategy=zero1 does "
            "not read: leave it out, or set parallel.strategy=fsdp",
        ("data.sources=[{source: a, weight: .inf}, {source: b}]",): "has weight inf; weights must be > 0 and finite",
    }  # fmt: skip
    for overrides, message in cases.items():
        with pytest.raises(ConfigError) as e:
            validate(load_config(None, [*overrides, "train.run_dir=x"]), 4)
        assert message in str(e.value), (overrides, str(e.value))
    validate(load_config(None, ["parallel.strategy=hsdp", "parallel.shard_size=2", "train.run_dir=x"]), 4)


def test_bad_input_ends_jdp_train_with_exit_2_and_the_message_not_a_traceback(tmp_path):
    """What a user sees: `jdp train` exits 2 with one clear message, before any compilation, for a bad number, a
    file that is not UTF-8, and a data path that does not exist."""
    import os
    import subprocess
    import sys

    (tmp_path / "latin1.txt").write_bytes(b"ok\n" * 100 + b"caf\xe9\n")
    cases = {
        "optim.lr=nan": "optim.lr=nan must be a finite number",
        f"data.source={tmp_path / 'latin1.txt'}": "is not valid UTF-8: byte 0xe9 at offset 303 (line 101)",
        f"data.source={tmp_path / 'missing'}/corpus.txt": "no such file or directory",
    }
    for override, message in cases.items():
        out = subprocess.run(
            [sys.executable, "-m", "jdp.cli", "train", "tiny", override, f"train.run_dir={tmp_path / 'run'}"],
            capture_output=True, text=True, timeout=300, env={**os.environ, "JDP_CACHE": str(tmp_path / "cache")},
        )  # fmt: skip
        assert out.returncode == 2, (override, out.stderr[-2000:])
        assert message in out.stderr and "Traceback" not in out.stderr, (override, out.stderr[-2000:])
        assert "compil" not in out.stdout.lower()


def test_jdp_version_prints_the_version_and_exits_0():
    import subprocess
    import sys

    import jdp

    out = subprocess.run([sys.executable, "-m", "jdp.cli", "--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"jdp {jdp.__version__}"


def test_the_quick_start_trains_without_the_test_tools_and_agrees_with_tiny_yaml_on_time():
    """README's first quick-start command installs what training needs, not pytest and ruff; its time for the
    tiny run is the one configs/tiny.yaml states."""
    import re

    root = Path(__file__).resolve().parents[1]
    block = root.joinpath("README.md").read_text().split("## Quick start", 1)[1].split("```bash\n", 1)[1]
    train_line, test_line = block.split("```", 1)[0].strip().splitlines()
    assert train_line.startswith("pip install -e . && jdp train "), train_line
    assert "[test]" in test_line and "pytest" in test_line
    said = re.search(r"~(\d+) min", train_line).group(1)
    tiny = root.joinpath("configs", "tiny.yaml").read_text().splitlines()[1]
    words = {"1": "About a minute", "2": "About two minutes"}
    assert words[said] in tiny, (train_line, tiny)
