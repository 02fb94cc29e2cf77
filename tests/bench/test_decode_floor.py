"""The batch-1 decode floor of ``bench decode`` (benchmarks/decode_floor.py): which matrices a step reads, and the
figures against a run's own."""

import pytest

from benchmarks.decode import step_bytes
from benchmarks.decode_floor import gemv_floor, step_matrices
from k3serve.model.presets import preset, write_preset_checkpoint


def test_a_batch_1_step_reads_k_experts_per_moe_layer_and_no_embedding_table(tmp_path):
    from k3serve.model.loader import load_weights

    cfg = preset("tiny")
    weights = load_weights(write_preset_checkpoint("tiny", tmp_path))
    mats = step_matrices(cfg, weights)
    picked = [n for n, w in weights.items() if any(w.data_ptr() == m.data_ptr() for m in mats)]
    assert not any(n.endswith("embed_tokens.weight") for n in picked)
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    experts = [n for n in picked if ".experts." in n]
    assert len(experts) == moe_layers * cfg.num_experts_per_token * 3  # w1, w2, w3 of k experts per layer
    assert all(w.dim() == 2 for w in mats)
    # the matrices' bytes are the step-byte model's but for the 1-D weights, the embedding row and the state
    read = sum(m.numel() * 4 for m in mats)
    assert 0.9 * step_bytes(cfg, 1, 0) < read <= step_bytes(cfg, 1, 0)


def test_floor_figures_against_the_run(tmp_path):
    from k3serve.model.loader import load_weights

    cfg = preset("tiny")
    weights = load_weights(write_preset_checkpoint("tiny", tmp_path))
    out = gemv_floor(cfg, weights, step_bytes_1=10**6, copy_gbps=10.0, step_s_1=1.0, repeats=2)
    assert out["fraction_of_copy"] == pytest.approx(10**6 / out["s"] / 1e9 / 10.0)
    assert out["step_over_floor"] == pytest.approx(1.0 / out["s"])
    assert out["weights_gbps"] == pytest.approx(out["weight_bytes"] / out["s"] / 1e9)
    with pytest.raises(ValueError, match="copy_gbps"):
        gemv_floor(cfg, weights, 10**6, copy_gbps=0.0, step_s_1=1.0)
