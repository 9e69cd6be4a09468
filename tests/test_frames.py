"""The peer frames: every kind round-trips through msgpack; malformed headers are named errors."""

from __future__ import annotations

import msgpack
import pytest

from arendez import frames
from arendez.errors import ArendezError, AuthenticationError, CollectiveMismatchError, ProtocolError

EXAMPLES: list[frames.Frame] = [
    frames.Data(1, 2, 3, 4, "all_reduce|<f4|10|SUM"),
    frames.ShmData(0, 7, 1, 0, "broadcast|<i8|3|0", 4096, 24),
    frames.Mismatch(0, 5, "collective #5: this rank runs a, rank 1 runs b"),
    frames.Cancel(0, 6, "all_reduce"),
    frames.TimedOut(0, 7, "all_reduce", 3000),
    frames.Bye({2: "connection lost", 3: "declared failed"}),
    frames.Bye({}),
    frames.Bye({1: "its process ended with an uncaught ValueError"}, {0: 5, 3: 2}),
    frames.Query(0, 11),
    frames.Answer(11, -1),
    frames.P2P(0, 9, "send|<f4|3"),
    frames.ShmHello("host-key"),
    frames.ShmOffer("/dev/shm/arendez-x", 1 << 20, b"c" * 16),
    frames.ShmAnswer(False, "malformed offer"),
    frames.ShmFree([0, 4096]),
    frames.Error("protocol", "bad frame"),
]


@pytest.mark.parametrize("frame", EXAMPLES, ids=lambda f: type(f).__name__)
def test_every_kind_round_trips_through_msgpack(frame):
    wire_bytes = msgpack.packb(frames.encode(frame), use_bin_type=True)
    header = msgpack.unpackb(wire_bytes, raw=False, strict_map_key=False)
    assert frames.decode(header) == frame


def test_every_kind_has_an_example():
    assert {type(f) for f in EXAMPLES} == set(frames._CLASSES)
    assert sorted(int(c.KIND) for c in frames._CLASSES) == sorted(int(k) for k in frames.Kind)


@pytest.mark.parametrize(
    ("header", "match"),
    [
        ([int(frames.Kind.DATA), 0, 1, 2, 3], "Data frame has 4 fields, expected 5"),
        ([int(frames.Kind.DATA), 0, 1, 2, 3, "fp", 99, 100], "Data frame has 7 fields"),  # not ShmData
        ([int(frames.Kind.DATA), 0, "1", 2, 3, "fp"], "Data frame: bad seq"),
        ([int(frames.Kind.QUERY), True, 1], "Query frame: bad gid"),  # a bool is not an int
        ([int(frames.Kind.BYE), {"2": "x"}, {}], "Bye frame: bad failed"),
        ([int(frames.Kind.BYE), {2: "x"}, {0: "3"}], "Bye frame: bad started"),
        ([int(frames.Kind.SHM_FREE), [1, "2"]], "ShmFree frame: bad offsets"),
        ([99, 1], "unknown peer frame kind 99"),
        ({"kind": 0}, "must be \\[kind, \\*fields\\]"),
        ([], "must be"),
    ],
)
def test_malformed_headers_raise_protocol_error_naming_the_problem(header, match):
    with pytest.raises(ProtocolError, match=match):
        frames.decode(header)


def test_remote_errors_are_typed_by_a_stable_code():
    assert frames.Error.of(ProtocolError("x")).code == "protocol"
    assert frames.Error.of(AuthenticationError("x")).code == "authentication"
    assert frames.Error.of(ValueError("x")).code == "other"
    back = frames.Error.of(CollectiveMismatchError("ranks differ")).exception()
    assert type(back) is CollectiveMismatchError and str(back) == "ranks differ"
    unknown = frames.Error("no-such-code", "m").exception()
    assert type(unknown) is ArendezError and str(unknown) == "m"


def test_a_transport_refusal_becomes_an_error_frame():
    got = frames.decode({"error": "AuthenticationError", "message": "wrong token"})
    assert isinstance(got, frames.Error) and got.code == "protocol" and "wrong token" in got.message


def test_the_data_fast_path_encodes_and_decodes_as_the_general_one():
    """``data_header`` builds what ``encode(Data(...))`` does, and ``decode``'s shortcut for data
    frames returns the same frame and still refuses bad fields by name."""
    fields = (1, 2, 3, 4, "all_reduce|<f4|10|SUM")
    assert frames.data_header(*fields) == frames.encode(frames.Data(*fields))
    wire = msgpack.unpackb(msgpack.packb(frames.data_header(*fields)))
    assert frames.decode(wire) == frames.Data(*fields)
    with pytest.raises(ProtocolError, match="Data frame: bad seq True"):
        frames.decode([int(frames.Kind.DATA), 1, True, 3, 4, "fp"])
    with pytest.raises(ProtocolError, match="Data frame: bad fp 5"):
        frames.decode([int(frames.Kind.DATA), 1, 2, 3, 4, 5])
