import pytest
import torch

from k3serve.transfer.plan import PlanError, head_routes, page_senders, reshard_kda


@pytest.mark.parametrize("p,d", [(1, 1), (2, 1), (1, 2), (2, 4), (4, 2), (4, 1), (8, 2)])
def test_reshard_is_the_head_split_of_the_full_state(p, d):
    heads, layers, block = 8, 3, 10
    full = torch.arange(layers * heads * block, dtype=torch.float32).view(layers, heads, block)
    parts = list(full.chunk(p, dim=1))
    out = reshard_kda(parts, d)
    assert len(out) == d
    torch.testing.assert_close(torch.cat(out, dim=1), full, rtol=0, atol=0)


def test_routes_land_at_local_offsets():
    routes = head_routes(8, 2, 4)
    assert [(r.src_rank, r.src_local, r.dst_rank, r.dst_local) for r in routes[3:6]] == [
        (0, 3, 1, 1), (1, 0, 2, 0), (1, 1, 2, 1)]


def test_non_divisible_layout_is_a_clear_error():
    with pytest.raises(PlanError, match="divisible"):
        head_routes(6, 4, 1)
    with pytest.raises(PlanError, match="decode TP=4"):
        head_routes(6, 2, 4)


def test_page_senders_round_robin():
    assert page_senders(5, 2) == [[0, 2, 4], [1, 3]]
    assert page_senders(2, 4) == [[0], [1], [], []]


# ------------------------------------------------------------------------------ spans, ranges, chunk plans
from k3serve.transfer.chunks import KDA, stream_plan  # noqa: E402
from k3serve.transfer.plan import head_spans, page_ranges  # noqa: E402
from k3serve.transfer.spec import StateGeometry, TransferSpec  # noqa: E402


def test_head_spans_merge_routes_per_rank_pair():
    assert [(s.src_rank, s.dst_rank, s.start, s.count) for s in head_spans(8, 2, 4)] == [
        (0, 0, 0, 2), (0, 1, 2, 2), (1, 2, 4, 2), (1, 3, 6, 2)]
    assert [(s.src_rank, s.dst_rank, s.start, s.count) for s in head_spans(8, 4, 2)] == [
        (0, 0, 0, 2), (1, 0, 2, 2), (2, 1, 4, 2), (3, 1, 6, 2)]
    assert [(s.start, s.count) for s in head_spans(4, 1, 1)] == [(0, 4)]


def test_page_ranges_round_robin():
    assert page_ranges(5, 2, 2) == [[(0, 2), (4, 1)], [(2, 2)]]
    assert page_ranges(5, 2, 1) == [[(p, 1) for p in ps] for ps in page_senders(5, 2)]
    assert page_ranges(0, 3, 4) == [[], [], []]


GEOMETRY = StateGeometry(kda_layers=3, kda_heads=8, kda_block_floats=1312, mla_layers=2, num_tokens=700,
                         mla_dim=80, mla_dtype="bfloat16")


@pytest.mark.parametrize("p,d", [(1, 1), (2, 1), (1, 2), (2, 4), (4, 2), (4, 1), (8, 8)])
@pytest.mark.parametrize("chunk_bytes", [4096, 16384, 1 << 20])
def test_stream_plans_cover_every_byte_exactly_once(p, d, chunk_bytes):
    """Per decode rank: the P senders' chunks tile the staging exactly; per sender: each source byte it owns is
    read once per decode rank that needs it (KDA once overall, MLA once per decode rank)."""
    spec = TransferSpec("t", "r", GEOMETRY, p, d, page_tokens=64, chunk_bytes=chunk_bytes)
    kda_dst, mla_bytes = 3 * (8 // d) * 1312 * 4, 2 * 700 * 80 * 2
    kda_src_seen = [0] * p
    for dst in range(d):
        cover = {KDA: bytearray(kda_dst), "mla": bytearray(mla_bytes)}
        for src in range(p):
            plan = stream_plan(spec, src, dst)
            assert [c.seq for c in plan] == list(range(len(plan)))
            for c in plan:
                assert 0 < c.length <= chunk_bytes
                for i in range(c.dst_byte, c.dst_byte + c.length):
                    cover[c.kind][i] += 1
                if c.kind == KDA:
                    kda_src_seen[src] += c.length
                    assert c.start // (8 // p) == src and c.start // (8 // d) == dst  # routed per head_routes
        assert all(v == 1 for v in cover[KDA]) and all(v == 1 for v in cover["mla"])
    assert kda_src_seen == [3 * (8 // p) * 1312 * 4] * p


def test_rows_larger_than_a_chunk_are_split_with_offsets():
    spec = TransferSpec("t", "r", GEOMETRY, 1, 1, chunk_bytes=4096)  # a head block is 5248 bytes
    kda = [c for c in stream_plan(spec, 0, 0) if c.kind == KDA and c.layer == 0 and c.start == 0]
    assert [(c.offset, c.length, c.count) for c in kda] == [(0, 4096, 1), (4096, 1152, 1)]


def test_non_divisible_transfer_spec_is_a_configuration_error():
    with pytest.raises(PlanError, match="divisible"):
        TransferSpec("t", "r", GEOMETRY.__class__(**{**GEOMETRY.__dict__, "kda_heads": 6}), 4, 1)
    with pytest.raises(PlanError, match="transfer_id"):
        TransferSpec("bad id", "r", GEOMETRY, 1, 1)
    with pytest.raises(PlanError, match="mla_dtype"):
        StateGeometry(1, 1, 1, 1, 1, 1, "int8")


def test_ids_with_a_trailing_newline_are_refused():
    from k3serve.transfer.spec import check_id

    check_id("transfer_id", "t-1:a/b@c+d")
    for bad in ("t-1\n", "", "a b", "x" * 129):
        with pytest.raises(PlanError, match="transfer_id"):
            check_id("transfer_id", bad)
