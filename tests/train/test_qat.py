"""QAT (`k3serve train qat`): a few steps from the shipped tiny-trained weights with MXFP4 fake-quantised
routed experts write an MXFP4 serving checkpoint, and the training forward (fake quant, STE) equals the serving
forward on that checkpoint bit for bit (one dequantisation function; the fused CPU kernel within fp32 rounding)."""

import json

import pytest
import torch
from typer.testing import CliRunner

from k3serve.cli.main import app
from k3serve.kernels.mxfp4 import dequantize_mxfp4
from k3serve.model.checkpoint import CheckpointReader, inspect_checkpoint, load_config
from k3serve.model.loader import load_model
from k3serve.model.names import mxfp4_names
from k3serve.model.presets import write_preset_checkpoint
from k3serve.model.quant_config import MXFP4_FORMAT
from k3serve.train.params import model_view
from k3serve.train.qat import MASTER_DIR, fake_quant_view, is_routed_expert
from k3serve.train.step import window_logits

runner = CliRunner()


@pytest.fixture(scope="module")
def qat_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("qat")
    corpus = root / "code.py"
    corpus.write_text("".join(f"def f{i}(x):\n    return x * {i % 7}\n\n" for i in range(2000)))
    target = write_preset_checkpoint("tiny-trained", root / "target")
    out = root / "out"
    res = runner.invoke(app, ["train", "qat", "--target", str(target), "--out", str(out), "--corpus", str(corpus),
                              "--steps", "2", "--batch", "2", "--context", "32", "--eval-tokens", "128",
                              "--warmup", "1", "--quiet", "--json"])
    assert res.exit_code == 0, res.output
    return target, out, json.loads(res.stdout), corpus


def test_qat_writes_an_mxfp4_checkpoint_that_serves(qat_run):
    target, out, summary, _ = qat_run
    assert summary["steps"] == 2
    info = inspect_checkpoint(out)
    assert info["quantization"] == MXFP4_FORMAT and info["quant_scale_rule"] == "ocp"
    assert info["mxfp4_tensors_present"] == 2 * info["mxfp4_weights"] > 0
    assert (info["missing_tensors"], info["unexpected_tensors"], info["shape_mismatches"]) == (0, 0, 0)
    assert load_config(out / MASTER_DIR).quantization == ""
    # the fine-tune moved the weights
    with CheckpointReader(target) as a, CheckpointReader(out / MASTER_DIR) as b:
        name = next(n for n in a.names() if n.endswith("q_proj.weight") or n.endswith("q_a_proj.weight"))
        assert not torch.equal(a.read(name), b.read(name))


def test_training_fake_quant_equals_serving_dequant_bit_exact(qat_run, monkeypatch):
    """The weights bit for bit; the logits bit for bit on the unfused serving path (F.linear on the one
    dequantisation) and within fp32 rounding on the fused CPU kernel (its own fixed summation order)."""
    from k3serve.model.layers import moe_mxfp4

    _, out, _, _ = qat_run
    with CheckpointReader(out / MASTER_DIR) as r:
        master = {n: r.read(n).float() for n in r.names()}
    view = fake_quant_view(master, "ocp")
    with CheckpointReader(out) as r:
        n_experts = 0
        for name, w in view.items():
            if is_routed_expert(name):
                p, s = mxfp4_names(name)
                assert torch.equal(w, dequantize_mxfp4(r.read(p), r.read(s), torch.float32)), name
                n_experts += 1
    assert n_experts > 0
    cfg = load_config(out / MASTER_DIR)
    tokens = torch.tensor([list(b"def main():\n    return 1\n")])
    train_logits = window_logits(model_view(cfg, view), tokens, grad=False)
    fused_logits = window_logits(load_model(out), tokens, grad=False)
    torch.testing.assert_close(fused_logits, train_logits, rtol=1e-4, atol=1e-4)
    assert torch.equal(fused_logits.argmax(-1), train_logits.argmax(-1))
    monkeypatch.setattr(moe_mxfp4, "fused_kernel_error", lambda: "switched off by the test")
    with pytest.warns(UserWarning, match="unfused CPU path"):
        unfused = load_model(out)
    assert torch.equal(train_logits, window_logits(unfused, tokens, grad=False))


def test_qat_refuses_a_quantized_target(qat_run, tmp_path):
    _, out, _, corpus = qat_run
    res = runner.invoke(app, ["train", "qat", "--target", str(out), "--out", str(tmp_path / "x"), "--steps", "1",
                              "--corpus", str(corpus), "--quiet"])
    assert res.exit_code == 2 and "already quantized" in res.output
