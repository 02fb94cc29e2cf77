"""Pool capacity from byte budgets."""

import pytest

from k3serve.engine.ops import PoolConfig
from k3serve.model.presets import preset


def test_pools_sized_from_byte_budgets():
    cfg = preset("tiny")
    slot = 6 * 4 * cfg.kda_head_block_floats * 4  # 6 KDA layers x 4 heads, fp32
    page = 3 * 64 * cfg.mla_latent_dim * 4  # 3 MLA layers x 64 tokens
    pools = PoolConfig.from_bytes(cfg, 1, kda_bytes=10 * slot + 5, mla_bytes=7 * page, page_size=64)
    assert (pools.kda_slots, pools.mla_pages) == (10, 7)
    assert PoolConfig.from_bytes(cfg, 2, kda_bytes=10 * slot, mla_bytes=7 * page).kda_slots == 20  # half the heads
    with pytest.raises(ValueError, match="too small"):
        PoolConfig.from_bytes(cfg, 1, kda_bytes=slot - 1, mla_bytes=page)
