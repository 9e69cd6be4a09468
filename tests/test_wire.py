"""The sans-I/O frame codec: any split of the byte stream decodes to the same frames."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from arendez import wire
from arendez.errors import ProtocolError


def _stream(frames: list[tuple[object, bytes]]) -> bytes:
    return b"".join(b"".join(bytes(b) for b in wire.encode(h, p or None)) for h, p in frames)


def _feed(decoder: wire.Decoder, data: bytes, cuts: list[int]) -> list[tuple[object, bytes | None]]:
    out = []
    pos = 0
    bounds = sorted({c % (len(data) + 1) for c in cuts} | {len(data)})
    for end in bounds:
        while pos < end:
            buf = decoder.get_buffer()
            n = min(len(buf), end - pos)
            buf[:n] = data[pos : pos + n]
            pos += n
            for header, payload in decoder.feed(n):
                out.append((header, None if payload is None else bytes(payload)))
    return out


ints = st.integers(-(2**63), 2**63 - 1)
headers = st.dictionaries(st.text(max_size=5), ints | st.text(max_size=10), max_size=4) | st.lists(
    ints, max_size=6
)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(headers, st.binary(max_size=3000)), min_size=1, max_size=8),
    st.lists(st.integers(0, 10**6)),
)
def test_any_split_decodes_the_same_frames(frames, cuts):
    data = _stream(frames)
    got = _feed(wire.Decoder(), data, cuts)
    assert got == [(h, p or None) for h, p in frames]


@pytest.mark.timeout(10)
def test_payload_lands_in_the_buffer_the_sink_chose():
    target = np.zeros(1 << 20, np.uint8)
    chosen = []

    def sink(header, nbytes):
        chosen.append(nbytes)
        return memoryview(target)

    dec = wire.Decoder(sink)
    payload = np.arange(1 << 20, dtype=np.uint32).astype(np.uint8)
    data = _stream([({"k": 1}, payload.tobytes())])
    frames = _feed(dec, data, list(range(0, len(data), 70_000)))
    assert chosen == [1 << 20] and len(frames) == 1
    np.testing.assert_array_equal(target, payload)


@pytest.mark.timeout(10)
def test_limits_and_garbage_raise_protocol_error():
    dec = wire.Decoder(limits=wire.Limits(max_header=100, max_payload=10))
    with pytest.raises(ProtocolError, match="header"):
        _feed(dec, wire.PREFIX.pack(101, 0) + b"x" * 101, [])
    with pytest.raises(ProtocolError, match="payload"):
        _feed(wire.Decoder(limits=wire.Limits(max_payload=10)), wire.PREFIX.pack(1, 11) + b"\x90", [])
    with pytest.raises(ProtocolError, match="undecodable"):
        _feed(wire.Decoder(), wire.PREFIX.pack(2, 0) + b"\xc1\xc1", [])


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(headers, st.binary(max_size=3000)), min_size=1, max_size=8),
    st.integers(1100, 9000),
    st.lists(st.integers(0, 10**6)),
)
def test_a_hello_sized_decoder_grows_once_its_limits_are_raised(frames, big, cuts):
    """Before a handshake the scratch is hello-sized; limits raised as the hello is parsed (as the
    server does, mid-read) let the frames after it, large headers included, decode unchanged."""
    hello = wire.Limits(max_header=1024, max_payload=0)
    dec = wire.Decoder(limits=hello)
    assert len(dec._scratch) <= 1024 + wire.PREFIX.size

    def raise_on_hello(header):
        if header == {"hello": 1}:
            dec.set_limits(wire.DEFAULT_LIMITS)
        return header

    dec.set_parser(raise_on_hello)
    sent = [({"hello": 1}, b""), ({"big": "x" * big}, b""), *frames]
    got = _feed(dec, _stream(sent), cuts)
    assert got == [(h, p or None) for h, p in sent]
    with pytest.raises(ProtocolError, match="exceeds 1024"):
        _feed(wire.Decoder(limits=hello), _stream([({"big": "x" * big}, b"")]), cuts)
