"""A batch across processes: CPU tensors out of band as NumPy arrays, everything else as it was."""

from __future__ import annotations

import copy
import pickle
import random
from typing import Any

import pytest
import torch

from agentloop.types import Triplet
from trainer.batch import Batch, Calls, build_batch


def _batch() -> Batch:
    rng = random.Random(0)
    lengths = [(rng.randint(3, 12), rng.randint(2, 10)) for _ in range(6)]
    triplets = [
        Triplet(
            prompt_ids=[rng.randrange(3, 500) for _ in range(p)],
            response_ids=[rng.randrange(3, 500) for _ in range(r)],
            reward=float(i % 2),
            response_logprobs=[-0.5] * r,
            metadata={"group_id": i // 2, "note": f"row {i}"},
        )
        for i, (p, r) in enumerate(lengths)
    ]
    batch, _ = build_batch(triplets, max_prompt_length=12, max_response_length=8)
    batch.extras["advantages"] = torch.randn(len(batch), batch.response_length)
    batch.truncated = torch.tensor([True, False] * 3)
    return batch


def _crossed(obj: Any) -> tuple[Any, int, int]:
    """``obj`` pickled as Ray pickles it (protocol 5, buffers out of band) and read back from read-only
    buffers, as a worker reads shared memory; with the in-band bytes and the out-of-band bytes."""
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    views = [memoryview(b).toreadonly() for b in buffers]
    return pickle.loads(data, buffers=views), len(data), sum(v.nbytes for v in views)


def _tensor_fields(obj: Any) -> dict[str, torch.Tensor]:
    out = {}
    for name, value in vars(obj).items():
        if isinstance(value, torch.Tensor):
            out[name] = value
        elif isinstance(value, Calls):
            out.update({f"calls.{k}": v for k, v in _tensor_fields(value).items()})
        elif isinstance(value, dict) and value and all(isinstance(v, torch.Tensor) for v in value.values()):
            out.update({f"{name}.{k}": v for k, v in value.items()})
    return out


def test_every_field_comes_back_equal() -> None:
    batch = _batch()
    back, _, _ = _crossed(batch)
    assert isinstance(back, Batch) and isinstance(back.calls, Calls)
    sent, got = _tensor_fields(batch), _tensor_fields(back)
    assert sent.keys() == got.keys() and len(sent) >= 18
    for name, tensor in sent.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    assert back.prompt_length == batch.prompt_length
    assert back.metadata == batch.metadata and back.host_rows == batch.host_rows
    assert back.engine_logprobs is not None and back.attempt_ids is not None and back.truncated is not None


def test_tensor_bytes_travel_out_of_band() -> None:
    """What lets Ray copy them once into shared memory: with torch's own pickling every byte would
    be inside the pickle and no buffer would go out of band."""
    batch = _batch()
    tensor_bytes = sum(t.numel() * t.element_size() for t in _tensor_fields(batch).values())
    _, in_band, out_of_band = _crossed(batch)
    assert out_of_band == tensor_bytes
    assert in_band < tensor_bytes // 2  # field names, metadata, host rows


def test_read_only_buffers_become_tensors_the_worker_owns() -> None:
    batch = _batch()
    back, _, _ = _crossed(batch)
    back.input_ids.add_(1)  # a read-only view of shared memory would refuse (or crash on) this
    back.extras["advantages"].zero_()
    assert not torch.equal(back.input_ids, batch.input_ids)
    assert batch.extras["advantages"].abs().sum() > 0


def test_tensors_numpy_cannot_hold_are_pickled_by_torch() -> None:
    batch = _batch()
    batch.engine_logprobs = batch.engine_logprobs.to(torch.bfloat16)  # type: ignore[union-attr]
    batch.extras["graded"] = torch.ones(len(batch), requires_grad=True)
    batch.extras["sparse"] = torch.eye(3).to_sparse()
    batch.extras["negated"] = torch._neg_view(torch.arange(4.0))
    back, _, _ = _crossed(batch)
    assert back.engine_logprobs.dtype == torch.bfloat16
    assert torch.equal(back.engine_logprobs, batch.engine_logprobs)
    assert back.extras["graded"].requires_grad and torch.equal(back.extras["graded"], batch.extras["graded"])
    assert back.extras["sparse"].is_sparse and torch.equal(back.extras["sparse"].to_dense(), torch.eye(3))
    assert torch.equal(back.extras["negated"], -torch.arange(4.0))


def test_every_integer_width_and_odd_layouts_come_back_equal() -> None:
    batch = _batch()
    for dtype in (torch.uint8, torch.uint16, torch.uint32, torch.uint64, torch.int8, torch.int16):
        batch.extras[str(dtype)] = torch.arange(6).to(dtype)
    batch.extras["transposed"] = torch.arange(12.0).view(3, 4).t()
    batch.extras["slice"] = torch.arange(100.0)[10:20]
    batch.extras["empty"] = torch.zeros(0, 5)
    back, _, _ = _crossed(batch)
    for name, tensor in batch.extras.items():
        assert back.extras[name].dtype == tensor.dtype and torch.equal(back.extras[name], tensor), name


def test_copies_keep_their_meaning() -> None:
    """``copy.copy`` shares the tensors, ``copy.deepcopy`` copies them and keeps shared ones shared:
    neither takes the out-of-band path."""
    batch = _batch()
    batch.extras["alias"] = batch.input_ids
    shallow = copy.copy(batch)
    assert shallow.input_ids is batch.input_ids and shallow.calls is batch.calls
    deep = copy.deepcopy(batch)
    assert deep.input_ids is not batch.input_ids and torch.equal(deep.input_ids, batch.input_ids)
    deep.input_ids.add_(1)
    assert torch.equal(deep.extras["alias"], deep.input_ids)
    assert isinstance(copy.copy(batch.calls).row, torch.Tensor)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_gpu_batch_stays_on_its_gpu() -> None:
    batch = _batch().to("cuda")
    back, _, _ = _crossed(batch)
    assert back.input_ids.is_cuda and torch.equal(back.input_ids, batch.input_ids)


def test_through_ray(ray_local: None) -> None:
    import ray

    batch = _batch()
    batch.extras["advantages"] = torch.randn(len(batch), 50_000)  # past Ray's inline limit: shared memory
    ref = ray.put(batch)
    back = ray.get(ref)
    assert torch.equal(back.input_ids, batch.input_ids) and back.host_rows == batch.host_rows
    assert torch.equal(back.extras["advantages"], batch.extras["advantages"])
    back.extras["advantages"].add_(1)  # Ray hands zero-copy arrays read-only: the tensors must be copies
    again = ray.get(ref)  # so the object in shared memory is as it was put
    assert torch.equal(again.extras["advantages"], batch.extras["advantages"])
