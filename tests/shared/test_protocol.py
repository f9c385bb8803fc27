"""The wire protocol: every message survives a round trip; bad frames are refused."""

from __future__ import annotations

import msgspec
import pytest

from shared import protocol

TO_WORKER = [
    protocol.Generate(
        request_id="r1",
        model="m",
        kind="chat",
        params={"messages": [{"role": "user", "content": "hi"}], "n": 2},
        deadline=123.5,
    ),
    protocol.Generate(request_id="r2", model="m", kind="completion", params={"prompt": [1, 2]}),
    protocol.Abort(request_ids=["r1", "r2"]),
    protocol.Ping(gateway_id="gw-1", sent_at=1.5),
]

TO_GATEWAY = [
    protocol.Deltas(
        items=[
            protocol.Delta(request_id="r1", index=0, text="Hel", num_tokens=1),
            protocol.Delta(
                request_id="r1",
                index=1,
                text="lo",
                num_tokens=1,
                finish_reason="stop",
                stop_reason="\n",
                logprobs=[
                    protocol.TokenLogprob(
                        "lo",
                        -0.1,
                        [
                            protocol.TopLogprob("lo", -0.1, 7, 1),
                            protocol.TopLogprob("la", -2.0, 8, 2),
                        ],
                        token_id=7,
                        rank=1,
                    )
                ],
            ),
            protocol.Delta(request_id="r1", index=0, usage=protocol.Usage(5, 2)),
        ]
    ),
    protocol.Failed(request_id="r2", status=400, message="bad", param="max_tokens"),
    protocol.Failed(
        request_id="r3", status=503, message="worker is draining", cause=protocol.WORKER_DRAINING
    ),
    protocol.Heartbeat(
        worker_id="w0",
        incarnation="abc",
        models=["m"],
        running=3,
        capacity=256,
        max_model_len=8192,
        draining=True,
    ),
]


@pytest.mark.parametrize("message", TO_WORKER, ids=lambda m: type(m).__name__)
def test_messages_to_the_worker_round_trip(message: protocol._Message) -> None:
    wire = protocol.encoder().encode(message)
    assert protocol.worker_decoder().decode(wire) == message


@pytest.mark.parametrize("message", TO_GATEWAY, ids=lambda m: type(m).__name__)
def test_messages_to_the_gateway_round_trip(message: protocol._Message) -> None:
    wire = protocol.encoder().encode(message)
    assert protocol.gateway_decoder().decode(wire) == message


def test_the_kind_is_the_first_array_element() -> None:
    wire = protocol.encoder().encode(protocol.Abort(request_ids=["x"]))
    assert msgspec.msgpack.decode(wire) == ["abort", ["x"]]


def test_frames_carry_no_field_names() -> None:
    wire = protocol.encoder().encode(protocol.Delta(request_id="r", index=0, text="a"))
    assert msgspec.msgpack.decode(wire)[:3] == ["r", 0, "a"]
    assert b"request_id" not in wire


def test_heartbeat_carries_the_protocol_version() -> None:
    beat = protocol.Heartbeat(worker_id="w", incarnation="i", models=[])
    assert beat.protocol_version == protocol.PROTOCOL_VERSION


@pytest.mark.parametrize(
    "wire",
    [
        b"\xc1",  # not msgpack
        msgspec.msgpack.encode(["nope", 1]),  # unknown kind
        msgspec.msgpack.encode(["abort", "not-a-list"]),  # wrong field type
        msgspec.msgpack.encode({"k": "abort"}),  # not an array
    ],
)
def test_bad_frames_raise_decode_errors(wire: bytes) -> None:
    with pytest.raises(msgspec.DecodeError):
        protocol.worker_decoder().decode(wire)


def test_a_gateway_does_not_accept_worker_bound_messages() -> None:
    wire = protocol.encoder().encode(protocol.Ping(gateway_id="g", sent_at=0.0))
    with pytest.raises(msgspec.DecodeError):
        protocol.gateway_decoder().decode(wire)


def test_a_failed_without_a_cause_still_decodes() -> None:
    # As a worker before `cause` sends it: the field is optional and last.
    wire = msgspec.msgpack.encode(["failed", "r4", 503, "busy", None])
    assert protocol.gateway_decoder().decode(wire) == protocol.Failed("r4", 503, "busy")
