"""Streamed text is detokenized incrementally: a UTF-8 sequence split across messages is not broken."""

from types import SimpleNamespace

from k3serve.auth import AuthConfig
from k3serve.contracts.sampling import SamplingParams
from k3serve.internal.v1 import cluster_pb2
from k3serve.router import relay
from k3serve.router.validate import ValidRequest
from k3serve.tokenizer import ByteTokenizer
from k3serve.v1 import router_pb2

SNOWMAN = list("a☃b€".encode("utf-8"))  # 1 + 3 + 1 + 3 bytes


def test_stream_decoder_holds_back_split_sequences():
    tok = ByteTokenizer()
    dec = tok.stream_decoder()
    pieces = [SNOWMAN[:2], SNOWMAN[2:6], SNOWMAN[6:]]
    out = [dec.decode(p, final=i == len(pieces) - 1) for i, p in enumerate(pieces)]
    assert out == ["a", "☃b", "€"]
    assert "".join(out) == tok.decode(SNOWMAN)


def test_stream_decoder_flushes_broken_bytes_at_the_end():
    dec = ByteTokenizer().stream_decoder()
    assert dec.decode([0xE2, 0x98]) == ""
    assert dec.decode([257], final=True) == "\ufffd"  # EOS is dropped; the unfinished sequence is replaced


class _FakeCall:
    def __init__(self, pieces):
        self.pieces = pieces

    def __iter__(self):
        for i, p in enumerate(self.pieces):
            # the real message type, so the relay reads exactly the fields a cluster sends
            yield cluster_pb2.ClusterGenerateResponse(token_ids=p, cached_tokens=0,
                                                      finish_reason="length" if i == len(self.pieces) - 1 else "")

    def cancel(self):
        pass


def test_router_stream_text_across_messages(monkeypatch):
    """The router's own streaming path (router/relay.py): each message's text continues the previous one's bytes."""
    pieces = [SNOWMAN[:2], SNOWMAN[2:3], SNOWMAN[3:7], SNOWMAN[7:]]
    stub = SimpleNamespace(Generate=lambda *a, **kw: _FakeCall(pieces))
    watchdog = SimpleNamespace(watch=lambda *a: SimpleNamespace(fault=""), unwatch=lambda w: None)
    progress = SimpleNamespace(advance=lambda n: None)
    monkeypatch.setattr(relay, "sign", lambda *a: ())
    req = ValidRequest("r", "s", (1, 2), SamplingParams(max_tokens=8, ignore_eos=True))
    ctx = SimpleNamespace(add_callback=lambda f: None, is_active=lambda: True, time_remaining=lambda: None)
    msgs = list(relay.stream_attempt(relay.Target("c0", stub, "s", ""), req, relay.Attempts(), progress,
                                     AuthConfig("s" * 32, peer="router"), watchdog, ByteTokenizer(), ctx))
    assert all(isinstance(m, router_pb2.GenerateResponse) for m in msgs)
    texts = [m.text for m in msgs]
    assert "\ufffd" not in "".join(texts)
    assert "".join(texts) == "a☃b€"
    assert texts[0] == "a" and texts[1] == ""
