"""Issue 65, what users still hit: each mistake's first error is its real cause, one `jdp: error:` line with a fix
that works, exit 2, nothing made. In-process and before any compile (test_live.py's own run only where torchft is)."""

import importlib.util

from jdp.cli import main


def _error(capsys, *args) -> str:
    code = main(list(args))
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("jdp: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_live_without_torchft_says_to_install_it_first(tmp_path, capsys, monkeypatch):
    """It said to start torchft_lighthouse, which comes with torchft: not installed either."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchft" else real(name, *a))
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    err = _error(capsys, "train", "train.live=true", f"train.run_dir={tmp_path / 'run'}")
    assert "train.live=true needs torchft, which this Python" in err and "-m pip install 'torchft==0.2.0' torch" in err
    assert err.index("pip install") < err.index("torchft_lighthouse") and not (tmp_path / "run").exists()


def test_a_fine_tuning_config_without_a_model_asks_for_train_init_from_not_about_seq_len(tmp_path, capsys):
    """`jdp train sft-chat` as shipped said data.seq_len=2048 was longer than model.max_seq_len=256: jdp's default
    model, which the config never meant. The command line's own windows still get validate's words."""
    for config, data in [("sft-chat", "conversations"), ("hf-finetune", "text")]:
        err = _error(capsys, "train", config, f"train.run_dir={tmp_path / 'run'}")
        assert f"jdp: error: this config fine-tunes a model on {data} (data.seq_len=2048, no model shape" in err, err
        assert "give train.init_from=DIR data.tokenizer=DIR (a Hugging Face model directory" in err
    assert main(["train", "sft-chat", "data.seq_len=4096", f"train.run_dir={tmp_path / 'run'}"]) == 2
    assert "data.seq_len=4096 is longer than the model supports" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
