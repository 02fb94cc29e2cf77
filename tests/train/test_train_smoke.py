"""A few seconds of training: held-out loss goes down, the checkpoint reloads for serving, --resume continues."""

import json

import pytest
from typer.testing import CliRunner

from k3serve.cli.main import app
from k3serve.model.checkpoint import inspect_checkpoint
from k3serve.model.loader import load_model
from k3serve.model.presets import preset
from k3serve.train.corpus import CorpusError, load_corpus, unigram_entropy_bits
from k3serve.train.loop import STATE_FILE, TrainConfig, TrainError, run_training
from k3serve.train.plot import PNG_NAME

runner = CliRunner()


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("corpus") / "code.py"
    p.write_text("".join(f"def f{i}(x):\n    return x + {i % 10}\n\n" for i in range(3000)))
    return p


def _cfg(out, corpus, **kw):
    base = dict(corpus=str(corpus), steps=6, batch=4, context=32, lr=5e-3, warmup_steps=2, eval_tokens=256,
                eval_every_s=1e9, measure_matmul=False)
    base.update(kw)
    return TrainConfig(preset("tiny-trained"), "tiny-trained", str(out), **base)


def test_training_lowers_heldout_loss_and_reloads(tmp_path, text_file):
    out = tmp_path / "run"
    res = run_training(_cfg(out, text_file), progress=False)
    hist = json.loads((out / "train_log.json").read_text())["history"]
    assert res.steps == 6 and hist[0]["step"] == 0 and hist[-1]["step"] == 6
    assert hist[-1]["heldout_bpb"] < hist[0]["heldout_bpb"] - 0.5
    assert (out / PNG_NAME).stat().st_size > 0 and (out / STATE_FILE).is_file()
    info = inspect_checkpoint(out)
    assert info["missing_tensors"] == 0 and info["unexpected_tensors"] == 0 and info["shape_mismatches"] == 0
    load_model(out)  # the serving loader takes it as it is

    again = run_training(_cfg(out, text_file, steps=8, resume=True), progress=False)
    assert again.steps == 8 and again.tokens == 8 * 4 * 32

    with pytest.raises(TrainError, match="--resume"):
        run_training(_cfg(out, text_file), progress=False)


def test_eval_cli_reports_bits_per_byte(tmp_path, text_file, tiny_ckpt):
    res = runner.invoke(app, ["eval", "--checkpoint", tiny_ckpt, "--corpus", str(text_file), "--max-bytes", "300",
                              "--context", "64", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["bytes"] == 4 * 63 and 0 < out["bits_per_byte"] < 30


def test_corpus_split_and_flag_errors(tmp_path, text_file):
    c = load_corpus(text_file)
    assert c.train.numel() > 10 * c.heldout.numel() > 0
    assert 1.0 < unigram_entropy_bits(c.train) < 8.0
    with pytest.raises(CorpusError, match="--corpus"):
        load_corpus(tmp_path / "missing")
    with pytest.raises(TrainError, match="--steps and --minutes"):
        TrainConfig(preset("tiny"), "tiny", str(tmp_path), steps=3, minutes=1.0)
