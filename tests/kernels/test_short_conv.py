import pytest
import torch

from k3serve.kernels.short_conv import short_conv, short_conv_step

B, C, W = 2, 20, 4


def _data(T, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, C, generator=gen).to(dtype)
    w = torch.randn(C, W, generator=gen)
    win = torch.randn(B, W - 1, C, generator=gen).to(dtype)
    return x, w, win


def test_naive_matches_definition():
    x, w, win = _data(5)
    y, new = short_conv(x, w, win, backend="naive")
    full = torch.cat((win, x), dim=1)
    t = 4                                          # position 4 sees raw inputs 1..4 of x
    pre = (full[:, t:t + W] * w.T).sum(1)
    torch.testing.assert_close(y[:, t], pre * torch.sigmoid(pre))
    torch.testing.assert_close(new, x[:, -(W - 1):])


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("T", [1, 2, 3, 37])
@pytest.mark.parametrize("with_window", [False, True])
def test_matches_naive(backend, T, with_window):
    x, w, win = _data(T, seed=T)
    win = win if with_window else None
    ref_y, ref_w = short_conv(x, w, win, backend="naive")
    y, nw = short_conv(x, w, win, backend=backend)
    torch.testing.assert_close(y, ref_y, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(nw, ref_w)
    if win is not None:
        assert nw.data_ptr() != win.data_ptr()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_sequence_equals_steps_and_splits(backend):
    T = 13
    x, w, win = _data(T, seed=5)
    y_full, w_full = short_conv(x, w, win, backend=backend)
    # Token by token with short_conv_step.
    cur, ys = win, []
    for t in range(T):
        y, cur = short_conv_step(x[:, t], w, cur, backend=backend)
        ys.append(y)
    torch.testing.assert_close(torch.stack(ys, 1), y_full, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(cur, w_full)
    # Arbitrary split points (including pieces shorter than the window) with a carried window.
    for cuts in ([1, 2, 7], [3], [5, 6, 12]):
        cur, ys, prev = win, [], 0
        for c in cuts + [T]:
            y, cur = short_conv(x[:, prev:c], w, cur, backend=backend)
            ys.append(y)
            prev = c
        torch.testing.assert_close(torch.cat(ys, 1), y_full, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(cur, w_full)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_bf16_and_non_contiguous(backend):
    x, w, win = _data(9, seed=7, dtype=torch.bfloat16)
    xt = x.transpose(0, 1).contiguous().transpose(0, 1)      # same values, other strides
    ref_y, ref_w = short_conv(x, w, win, backend="naive")
    y, nw = short_conv(xt, w, win, backend=backend)
    assert y.dtype == torch.bfloat16 and nw.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), ref_y.float(), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(nw, ref_w)
