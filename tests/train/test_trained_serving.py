"""The shipped trained checkpoint (preset tiny-trained) through the serving paths.

* prefill TP=2 -> decode TP=1 gives the reference generator's tokens exactly (greedy and seeded);
* per-token log-probabilities from the serving prefill (TP=2 workers, paged latent cache, chunked from carried
  state, all logits) give the bits per byte ``k3serve eval`` computes with the reference forward, within 1e-4.
"""

import pytest
import torch

from k3serve.engine.executor import WorkerSpec, make_executor
from k3serve.engine.ops import PoolConfig, PrefillChunk, ResetSlots
from k3serve.disagg.pipeline import LocalPipeline
from k3serve.contracts.requests import PrefillRequest
from k3serve.contracts.sampling import SamplingParams
from k3serve.model.loader import load_model
from k3serve.model.presets import write_preset_checkpoint
from k3serve.train.corpus import eval_windows, load_corpus
from k3serve.train.evaluate import windows_nll
from k3serve.train.step import TokenNLL, byte_nll, count_bytes
from tests.exactness import SEEDS, References

PROMPTS = ("def parse_args(", "import os\n\n\ndef main():\n    ", "class Stack:\n    def push(self, x):\n")


@pytest.fixture(scope="module")
def trained_ckpt(tmp_path_factory):
    return str(write_preset_checkpoint("tiny-trained", tmp_path_factory.mktemp("tiny_trained")))


def test_cluster_path_equals_reference(trained_ckpt):
    refs = References(load_model(trained_ckpt))
    cases = []
    for i, text in enumerate(PROMPTS):  # fixed texts: greedy once, sampled over SEEDS
        ids = list(text.encode())
        cases.append((f"greedy-{i}", ids, SamplingParams(max_tokens=24, ignore_eos=True)))
        for s in SEEDS:
            cases.append((f"seeded-{i}-s{s}", ids, SamplingParams(temperature=0.8, top_p=0.95, seed=7 + i + 100 * s,
                                                                  max_tokens=24, ignore_eos=True)))
    with LocalPipeline(trained_ckpt, prefill_tp=2, decode_tp=1) as pipe:
        outs = pipe.generate([PrefillRequest(rid, tuple(ids), p) for rid, ids, p in cases])
    for rid, ids, params in cases:
        assert outs[rid].error is None, outs[rid].error
        refs.check(ids, params, outs[rid].token_ids, label=rid)  # tests/exactness.py


def test_serving_logprobs_give_eval_bits_per_byte(trained_ckpt):
    windows = eval_windows(load_corpus().heldout, 256, 4 * 256)  # what `k3serve eval --max-bytes 1024` scores
    want = windows_nll(load_model(trained_ckpt), windows)
    pools = PoolConfig(kda_slots=2, mla_pages=8, page_size=64)
    ex = make_executor(WorkerSpec(trained_ckpt, 2, pools))
    try:
        nats, nbytes = 0.0, 0
        for w in windows:
            ids = w.tolist()
            ex.run(ResetSlots((0,)))
            logits = []
            for start, end in ((0, 100), (100, 200), (200, 256)):  # chunked prefill from carried state
                logits.append(ex.run(PrefillChunk(0, tuple(ids[start:end]), start, tuple(range(4)), False,
                                                  all_logits=True))[0])
            nats += float(byte_nll(torch.cat(logits), w).double().sum())
            nbytes += count_bytes(w)
    finally:
        ex.close()
    got = TokenNLL(nats, nbytes)
    assert got.bytes == want.bytes
    assert abs(got.bits_per_byte - want.bits_per_byte) <= 1e-4, (got.bits_per_byte, want.bits_per_byte)
    assert want.bits_per_byte < 3.0  # the shipped model has learned the stdlib's code


def test_checkpoint_make_writes_the_shipped_weights(tmp_path):
    import json

    from typer.testing import CliRunner

    from k3serve.cli.main import app
    from k3serve.model.presets import preset, trained_dir

    runner = CliRunner()
    res = runner.invoke(app, ["checkpoint", "make", "--preset", "tiny-trained", "--out", str(tmp_path / "ck")])
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "ck" / "config.json").read_text()) == preset("tiny-trained").to_hf_dict()
    assert (tmp_path / "ck" / "model.safetensors").read_bytes() == (trained_dir("tiny-trained")
                                                                    / "model.safetensors").read_bytes()
    res = runner.invoke(app, ["checkpoint", "make", "--preset", "tiny-trained", "--out", str(tmp_path / "x"),
                              "--seed", "3"])
    assert res.exit_code == 2 and "--seed" in res.output
