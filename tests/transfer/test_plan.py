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
