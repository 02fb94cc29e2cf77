"""The CUDA check's harness on the CPU (CI has no GPU; scripts/cuda_check.sh runs it on one): its comparisons,
its refusals, and the model part end to end with the CPU as "the device" (the same code, so zero error)."""

import pytest

from benchmarks import cuda_check
from benchmarks.cuda_model import check_preset, first_divergence


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2


def test_unknown_part_is_refused_naming_the_option(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        cuda_check.main(["--out", str(tmp_path), "--parts", "roofline,bogus"])
    assert exc.value.code == 2 and "--parts" in capsys.readouterr().err


def test_no_cuda_device_exits_2_and_says_so(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(cuda_check.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exc:
        cuda_check.main(["--out", str(tmp_path)])
    assert exc.value.code == 2 and "no CUDA device" in capsys.readouterr().err
    assert not (tmp_path / "cuda_check.json").exists()


def test_model_part_on_the_cpu_compares_equal_paths_as_equal(tmp_path, one_thread):
    from k3serve.model.presets import write_preset_checkpoint

    ckpt = str(write_preset_checkpoint("tiny-trained", tmp_path / "tt"))
    r = check_preset(ckpt, "cpu", prompt_tokens=24, max_tokens=4, engine_prompts=2)
    assert r["fp32"]["max_abs_logit_err"] == 0.0 and r["fp32"]["greedy_equal"]
    # the engine path against the reference: reported per request (equality itself, with the near-tie rule, is
    # the exactness suite's claim: tests/engine/test_pipeline.py)
    engine = r["engine_fp32"]
    assert engine["requests"] == 2 and set(engine["first_divergence"]) == {"r0", "r1"}
    assert engine["equal"] == sum(d is None for d in engine["first_divergence"].values())
    # bf16 is a different computation: an error is reported, never zero, and compared against both references
    assert 0 < r["bf16"]["max_abs_logit_err"] and 0 < r["bf16"]["vs_fp32_weights"]["max_abs_logit_err"]
