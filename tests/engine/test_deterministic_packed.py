"""Numerics mode ``deterministic`` with its wide linears on oneDNN's packed GEMM (model/packed_gemm.py): the
serving paths give the reference's logits bit for bit, as with MKL tiles.

The defaults (``packed_min_k`` 1024, ``packed_min_elements`` 65536) leave almost every GEMM of the tiny preset on
MKL tiles, so these tests lower them to 64 and 1024: then nearly every linear (projections, row-parallel units,
experts as gate/up pairs, the MLA's per-head GEMMs, the LM head) runs packed, one row padded to 2, and the experts
take the per-expert loop. The reference is a TP=1 model with the same numerics."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from k3serve.contracts.numerics import DETERMINISTIC, NumericsError
from k3serve.disagg.pipeline import LocalPipeline
from k3serve.engine.ops import PoolConfig
from k3serve.model.loader import load_model
from k3serve.model.reference import reference_generate
from k3serve.prefill.engine import PrefillConfig
from tests.engine.test_deterministic_paths import _assert_bitwise, _requests, _serve

PACKED = dataclasses.replace(DETERMINISTIC, packed_min_k=64, packed_min_elements=1024)


@pytest.fixture(scope="module")
def packed_model(tiny_ckpt):
    return load_model(tiny_ckpt, numerics=PACKED)


@pytest.fixture(scope="module")
def det_ref(packed_model):
    done = {}

    def get(prompt, params):
        key = (tuple(prompt), params)
        if key not in done:
            done[key] = reference_generate(packed_model, prompt, params, keep_logits=True)
        return done[key]

    return get


def test_the_packed_gemm_is_taken_and_agrees_with_the_mkl_tiles(tiny_ckpt, packed_model, det_ref):
    """The path under test is really taken (packed copies made); its values are the MKL tiles' to rounding
    (on the AVX-512 CPU of this wave the two even agree in bits at the tiny preset's short reductions)."""
    prompt, params = list(range(5, 45)), _requests([1], 0, "x")[0].params
    ref = det_ref(prompt, params)
    assert len(packed_model.ops.gemm.packed) > 10
    mkl = reference_generate(load_model(tiny_ckpt, numerics=DETERMINISTIC), prompt, params, keep_logits=True)
    torch.testing.assert_close(mkl.logits[0], ref.logits[0], rtol=0, atol=1e-4)


@pytest.mark.parametrize("budget", [64, 100, 4096])  # 4096: every prompt in one shot
def test_prefill_chunk_budgets_give_the_reference_bits(tiny_ckpt, det_ref, budget):
    reqs = _requests([1, 150, 300], 0, f"pb{budget}")
    cfg = PrefillConfig(PoolConfig(kda_slots=16, mla_pages=64), step_token_budget=budget, enable_prefix_cache=False)
    with LocalPipeline(tiny_ckpt, prefill=cfg, numerics=PACKED) as pipe:
        outs, logits = _serve(pipe, reqs)
    _assert_bitwise(det_ref, reqs, outs, logits, f"packed, budget {budget}")


@pytest.mark.parametrize("size", [1, 7, 32])
def test_batch_compositions_give_the_reference_bits(tiny_ckpt, det_ref, size):
    g = torch.Generator().manual_seed(size)
    reqs = _requests(torch.randint(1, 120, (size,), generator=g).tolist(), size, f"pn{size}")
    with LocalPipeline(tiny_ckpt, prefill=PrefillConfig(PoolConfig(kda_slots=40, mla_pages=160)),
                       numerics=PACKED) as pipe:
        outs, logits = _serve(pipe, reqs, together=True)
    _assert_bitwise(det_ref, reqs, outs, logits, f"packed, batch of {size}")


# P > D and P < D on packed GEMMs; the (4, 2) resharding is test_deterministic_paths.py's (shard units have
# TP-invariant shapes, so the GEMM library does not change with TP)
@pytest.mark.parametrize("p,d", [(2, 1), (1, 2)])
def test_prefill_tp_to_decode_tp_gives_the_reference_bits(tiny_ckpt, det_ref, p, d):
    reqs = _requests([1, 130, 200], 1, f"ptp{p}{d}")
    with LocalPipeline(tiny_ckpt, prefill_tp=p, decode_tp=d, numerics=PACKED) as pipe:
        outs, logits = _serve(pipe, reqs)
    _assert_bitwise(det_ref, reqs, outs, logits, f"packed, P={p} D={d}")


def test_packed_min_k_must_be_a_non_negative_integer():
    with pytest.raises(NumericsError, match="numerics.packed_min_k"):
        dataclasses.replace(DETERMINISTIC, packed_min_k=-1)
