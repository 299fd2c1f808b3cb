"""Our hand-written protobuf codec against the SDK's own generated messages: what the SDK writes we
read, what we write the SDK reads."""

from __future__ import annotations

import math

import numpy as np
import pytest

from agentloop.tinker._proto import (
    ProtoError,
    decode_forward_backward_request,
    encode_forward_backward_output,
    encode_sample_response,
)

tinker = pytest.importorskip("tinker", reason="the tinker SDK is not installed (pip install -e '.[tinker]')")

from tinker import types  # noqa: E402
from tinker.proto.request_conv import forward_backward_request_to_proto  # noqa: E402
from tinker.proto.response_conv import (  # noqa: E402
    deserialize_forward_backward_output,
    deserialize_sample_response,
)


def _request_bytes(data: list[types.Datum], loss_fn: str, config: dict | None, forward_only: bool) -> bytes:
    req = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn=loss_fn, loss_fn_config=config),
        model_id="s:train:3",
        seq_id=7,
    )
    msg = forward_backward_request_to_proto(req)
    msg.forward_only = forward_only
    return msg.SerializeToString()


def test_reads_what_the_sdk_writes_dense_and_sparse() -> None:
    import torch

    dense = types.Datum(
        model_input=types.ModelInput.from_ints([5, 6, 7]),
        loss_fn_inputs={"target_tokens": torch.tensor([6, 7, 8]), "weights": torch.tensor([0.0, 1.0, 0.5])},
    )
    sparse = types.Datum(  # 2-D targets and weights go out sparse (CSR)
        model_input=types.ModelInput.from_ints([1, 2]),
        loss_fn_inputs={
            "target_tokens": torch.tensor([[9, 0], [0, 0]]),
            "weights": torch.tensor([[1.0, 0], [0, 0]]),
        },
    )
    raw = decode_forward_backward_request(
        _request_bytes([dense, sparse], "ppo", {"clip_low_threshold": 0.7, "note": "x"}, forward_only=True)
    )
    assert (raw.model_id, raw.seq_id, raw.loss_fn, raw.forward_only) == ("s:train:3", 7, "ppo", True)
    assert raw.loss_fn_config == {"clip_low_threshold": 0.7, "note": "x"}
    assert [d.tokens for d in raw.data] == [[5, 6, 7], [1, 2]]
    assert raw.data[0].loss_fn_inputs["target_tokens"].to_numpy("t").tolist() == [6, 7, 8]
    assert raw.data[0].loss_fn_inputs["weights"].to_numpy("w").tolist() == [0.0, 1.0, 0.5]
    assert raw.data[1].loss_fn_inputs["target_tokens"].to_numpy("t").tolist() == [[9, 0], [0, 0]]


def test_the_sdk_reads_what_we_write() -> None:
    body = encode_forward_backward_output(
        [{"logprobs": np.array([-1.0, -2.5])}, {"logprobs": np.array([-0.25])}], {"loss:sum": 3.75}
    )
    out = deserialize_forward_backward_output(body)
    assert [o["logprobs"].tolist() for o in out.loss_fn_outputs] == [[-1.0, -2.5], [-0.25]]
    assert out.metrics == {"loss:sum": 3.75}

    sample = deserialize_sample_response(
        encode_sample_response([("length", [3, 4], [-0.5, -1.0]), ("stop", [2], None)], [math.nan, -2.0])
    )
    assert [s.tokens for s in sample.sequences] == [[3, 4], [2]]
    assert [s.stop_reason for s in sample.sequences] == ["length", "stop"]
    assert sample.sequences[0].logprobs == [-0.5, -1.0]
    assert sample.prompt_logprobs == [None, -2.0]


@pytest.mark.parametrize("body", [b"\x0a\xff", b"\x1a\x05\x0a\x03", b"\x0f"])
def test_garbage_is_a_proto_error(body: bytes) -> None:
    with pytest.raises(ProtoError):
        decode_forward_backward_request(body)
