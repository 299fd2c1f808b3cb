"""The official tinker SDK, unchanged, against ``agentloop tinker`` on the tiny model: every call the
cookbook's loops make, with the numbers checked (losses by hand, logprobs against the model and the
engine), and bad requests answered 4xx."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import torch

from tests.tinker.conftest import KEY, MODEL_NAME, RunningServer

tinker = pytest.importorskip("tinker", reason="the tinker SDK is not installed (pip install -e '.[tinker]')")
from tinker import types  # noqa: E402

TEXT = "The quick brown fox jumps over the lazy dog. 12 + 30 = 42."


def _datum(tokens: list[int], **inputs: Any) -> types.Datum:
    """Next-token alignment: the model sees tokens[:-1] and predicts tokens[1:]."""
    n = len(tokens) - 1
    loss_inputs = {
        "target_tokens": torch.tensor(tokens[1:]),
        **{k: torch.as_tensor(v, dtype=torch.float32) for k, v in inputs.items()},
    }
    if "weights" not in inputs and "advantages" not in inputs:
        loss_inputs["weights"] = torch.ones(n)
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=loss_inputs)


@pytest.fixture
def training_client(service_client: Any) -> Any:
    return service_client.create_lora_training_client(base_model=MODEL_NAME, rank=4, seed=0).result()


@pytest.fixture(scope="module")
def tokens(service_client: Any) -> list[int]:
    tc = service_client.create_lora_training_client(base_model=MODEL_NAME, rank=4).result()
    ids: list[int] = tc.get_tokenizer().encode(TEXT)
    return ids


def _reference_logprobs(model_dir: Any, tokens: list[int]) -> torch.Tensor:
    """log p(tokens[t+1] | tokens[:t+1]) straight from the base model (a new LoRA adapter adds 0)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([tokens[:-1]])).logits[0]
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens[1:]).unsqueeze(-1)).squeeze(-1)


def test_info_and_capabilities(service_client: Any, training_client: Any) -> None:
    info = training_client.get_info()
    assert (info.model_data.model_name, info.lora_rank, info.is_lora) == (MODEL_NAME, 4, True)
    caps = (
        tinker.RestClient(base_url=service_client._base_url, api_key=KEY).get_server_capabilities().result()
    )
    assert [m.model_name for m in caps.supported_models] == [MODEL_NAME]


def test_cross_entropy_is_the_hand_computation_on_the_models_logprobs(
    training_client: Any, tokens: list[int], tinker_server: RunningServer
) -> None:
    weights = [0.0] * 5 + [1.0] * (len(tokens) - 6)
    out = training_client.forward_backward([_datum(tokens, weights=weights)], "cross_entropy").result()
    lp = out.loss_fn_outputs[0]["logprobs"].to_torch()
    assert lp.shape == (len(tokens) - 1,)
    assert out.metrics["loss:sum"] == pytest.approx(-(lp * torch.tensor(weights)).sum().item(), rel=1e-5)
    assert torch.allclose(lp, _reference_logprobs(tinker_server.model_dir, tokens), atol=1e-4)


def test_forward_logprobs_equal_the_engines_sampled_logprobs(
    service_client: Any, training_client: Any, tokens: list[int]
) -> None:
    sampler = service_client.create_sampling_client(base_model=MODEL_NAME).result()
    prompt = tokens[:8]
    res = sampler.sample(
        types.ModelInput.from_ints(prompt), 2, types.SamplingParams(max_tokens=6, seed=3)
    ).result()
    assert len(res.sequences) == 2
    for seq in res.sequences:
        assert len(seq.tokens) == len(seq.logprobs) > 0
        full = prompt + list(seq.tokens)
        out = training_client.forward([_datum(full)], "cross_entropy").result()
        lp = out.loss_fn_outputs[0]["logprobs"].to_torch()[len(prompt) - 1 :]
        assert lp.tolist() == pytest.approx(list(seq.logprobs), abs=2e-3)
    # compute_logprobs: the prompt's logprobs through the engine's model
    prompt_lps = sampler.compute_logprobs(types.ModelInput.from_ints(prompt)).result()
    assert prompt_lps[0] is None
    out = training_client.forward([_datum(prompt)], "cross_entropy").result()
    assert prompt_lps[1:] == pytest.approx(out.loss_fn_outputs[0]["logprobs"].to_torch().tolist(), abs=2e-3)


def test_optim_step_trains_and_the_sampler_samples_the_new_weights(
    training_client: Any, tokens: list[int]
) -> None:
    datum = _datum(tokens)
    before = training_client.forward([datum], "cross_entropy").result().metrics["loss:sum"]
    for _ in range(3):
        fb = training_client.forward_backward([datum], "cross_entropy")
        opt = training_client.optim_step(types.AdamParams(learning_rate=2e-2))
        fb.result()
        assert "optim/grad_norm" in opt.result().metrics
    after = training_client.forward([datum], "cross_entropy").result().metrics["loss:sum"]
    assert after < before - 1.0, (before, after)

    sampler = training_client.save_weights_and_get_sampling_client().result()
    prompt = tokens[:6]
    res = sampler.sample(
        types.ModelInput.from_ints(prompt), 1, types.SamplingParams(max_tokens=5, seed=1)
    ).result()
    seq = res.sequences[0]
    lp = training_client.forward([_datum(prompt + list(seq.tokens))], "cross_entropy").result()
    assert lp.loss_fn_outputs[0]["logprobs"].to_torch()[len(prompt) - 1 :].tolist() == pytest.approx(
        list(seq.logprobs), abs=2e-3
    )


def test_save_and_load_state(service_client: Any, training_client: Any, tokens: list[int]) -> None:
    datum = _datum(tokens)
    training_client.forward_backward([datum], "cross_entropy").result()
    training_client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    loss = training_client.forward([datum], "cross_entropy").result().metrics["loss:sum"]
    saved = training_client.save_state("test-ckpt").result()
    assert saved.path.startswith("tinker://") and saved.path.endswith("/weights/test-ckpt")

    for make in (
        service_client.create_training_client_from_state_with_optimizer,
        service_client.create_training_client_from_state,
    ):
        restored = make(saved.path).result()
        assert restored.forward([datum], "cross_entropy").result().metrics["loss:sum"] == pytest.approx(
            loss, rel=1e-5
        )
    # a named sampler checkpoint, sampled by path
    path = training_client.save_weights_for_sampler("test-sampler").result().path
    sampler = service_client.create_sampling_client(model_path=path).result()
    assert (
        len(
            sampler.sample(types.ModelInput.from_ints(tokens[:4]), 1, types.SamplingParams(max_tokens=2))
            .result()
            .sequences
        )
        == 1
    )


def test_policy_gradient_losses_are_the_hand_computation(training_client: Any, tokens: list[int]) -> None:
    n = len(tokens) - 1
    q = [-1.0] * n
    adv = [1.0 if i % 2 else -0.5 for i in range(n)]
    lp = (
        training_client.forward([_datum(tokens)], "cross_entropy")
        .result()
        .loss_fn_outputs[0]["logprobs"]
        .to_torch()
    )
    ratio = torch.exp(lp - torch.tensor(q))
    a = torch.tensor(adv)
    out = training_client.forward(
        [_datum(tokens, logprobs=q, advantages=adv)], "importance_sampling"
    ).result()
    assert out.metrics["loss:sum"] == pytest.approx(-(ratio * a).sum().item(), rel=1e-4)
    out = training_client.forward(
        [_datum(tokens, logprobs=q, advantages=adv)],
        "ppo",
        {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1},
    ).result()
    clipped = torch.minimum(ratio * a, ratio.clamp(0.9, 1.1) * a)
    assert out.metrics["loss:sum"] == pytest.approx(-clipped.sum().item(), rel=1e-4)


def test_forward_backward_custom(training_client: Any, tokens: list[int]) -> None:
    def loss_fn(
        data: list[types.Datum], logprobs: list[torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, float]]:
        loss = sum((lp**2).sum() for lp in logprobs)
        return loss, {"custom/n": float(len(logprobs))}  # type: ignore[return-value]

    out = training_client.forward_backward_custom([_datum(tokens)], loss_fn).result()
    lp = (
        training_client.forward([_datum(tokens)], "cross_entropy")
        .result()
        .loss_fn_outputs[0]["logprobs"]
        .to_torch()
    )
    assert out.metrics["loss:sum"] == pytest.approx((lp**2).sum().item(), rel=1e-4)
    assert out.metrics["custom/n"] == 1.0


def test_bad_sdk_requests_are_4xx(training_client: Any, tokens: list[int]) -> None:
    with pytest.raises(tinker.BadRequestError, match="not supported"):
        training_client.forward_backward([_datum(tokens)], "dro").result()
    short = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:4]),
        loss_fn_inputs={"target_tokens": torch.tensor(tokens[1:4]), "weights": torch.ones(3)},
    )
    with pytest.raises(tinker.BadRequestError, match="shape"):
        training_client.forward_backward([short], "cross_entropy").result()
    with pytest.raises(tinker.BadRequestError, match="lacks"):
        training_client.forward_backward([_datum(tokens)], "importance_sampling").result()


def test_bad_http_requests_are_4xx_with_a_reason(tinker_server: RunningServer) -> None:
    url, auth = tinker_server.url, {"X-API-Key": KEY}
    with httpx.Client(base_url=url, timeout=30) as http:
        cases = [
            (http.get("/api/v1/get_server_capabilities"), 401),
            (http.get("/api/v1/get_server_capabilities", headers={"X-API-Key": "tml-wrong"}), 401),
            (http.post("/api/v1/create_session", headers=auth, content=b"{}"), 200),
            (http.post("/api/v1/create_model", headers=auth, content=b"not json"), 400),
            (http.post("/api/v1/create_model", headers=auth, json={"session_id": "nope"}), 400),
            (http.post("/api/v1/get_info", headers=auth, json={"model_id": "nope:train:0"}), 404),
            (http.post("/api/v1/retrieve_future", headers=auth, json={"request_id": "nope"}), 404),
            (
                http.post(
                    "/api/v1/optim_step",
                    headers=auth,
                    json={"model_id": "x", "adam_params": {"learning_rate": -1}},
                ),
                400,
            ),
            (
                http.post(
                    "/api/v1/forward_backward",
                    headers={**auth, "Content-Type": "application/x-protobuf"},
                    content=b"\x0a\xff",
                ),
                400,
            ),
            (http.post("/api/v1/forward_backward", headers=auth, json={}), 415),
            (http.post("/api/v1/no_such_route", headers=auth, json={}), 404),
        ]
        for response, status in cases:
            assert response.status_code == status, (response.request.url, response.text)
            if status >= 400:
                assert response.json()["detail"], response.text
        session = cases[2][0].json()["session_id"]
        wrong_base = http.post(
            "/api/v1/create_model",
            headers=auth,
            json={
                "session_id": session,
                "model_seq_id": 0,
                "base_model": "Qwen/Qwen3-8B",
                "lora_config": {"rank": 4},
            },
        )
        assert wrong_base.status_code == 400 and "not served here" in wrong_base.json()["detail"]


def test_a_wrong_key_is_refused_by_the_sdk(tinker_server: RunningServer) -> None:
    client = tinker.ServiceClient(base_url=tinker_server.url, api_key="tml-wrong-key")
    with pytest.raises(tinker.AuthenticationError):
        client.create_lora_training_client(base_model=MODEL_NAME, rank=4).result()


def test_closing_a_service_client_frees_its_models(tinker_server: RunningServer) -> None:
    client = tinker.ServiceClient(base_url=tinker_server.url, api_key=KEY)
    training = client.create_lora_training_client(base_model=MODEL_NAME, rank=2).result()
    assert training.model_id in tinker_server.service.models
    client.close("success").result()
    assert training.model_id not in tinker_server.service.models


def test_training_models_are_capped_over_every_client(tinker_server: RunningServer) -> None:
    """Each training model is a copy of the weights, gradients and Adam's moments: past ``--max-models``
    a client gets a 400 saying so (not the server's memory), and closing a client frees its share."""
    service = tinker_server.service
    saved = service.max_models
    service.max_models = len(service.models) + 1  # room for one more
    client = tinker.ServiceClient(base_url=tinker_server.url, api_key=KEY)
    try:
        client.create_lora_training_client(base_model=MODEL_NAME, rank=2).result()
        other = tinker.ServiceClient(base_url=tinker_server.url, api_key=KEY)
        with pytest.raises(tinker.BadRequestError, match=r"at most \d+ training models"):
            other.create_lora_training_client(base_model=MODEL_NAME, rank=2).result()
        other.close("success").result()
        client.close("success").result()
        again = tinker.ServiceClient(base_url=tinker_server.url, api_key=KEY)
        again.create_lora_training_client(base_model=MODEL_NAME, rank=2).result()  # the freed room
        again.close("success").result()
    finally:
        service.max_models = saved


def test_a_silent_clients_models_make_room_for_a_new_one(tinker_server: RunningServer) -> None:
    """A client that died without closing stops its heartbeats; when the cap is reached, its session is
    taken for dead (``SESSION_SILENT_S`` without one) and its models are freed for the new client."""
    from agentloop.tinker.service import SESSION_SILENT_S

    service = tinker_server.service
    saved = service.max_models
    service.max_models = len(service.models) + 1
    dead = tinker.ServiceClient(base_url=tinker_server.url, api_key=KEY)
    try:
        gone = dead.create_lora_training_client(base_model=MODEL_NAME, rank=2).result()
        session = next(s for s in service.sessions.values() if gone.model_id.startswith(f"{s.session_id}:"))
        session.last_heartbeat -= SESSION_SILENT_S + 1  # as if its process had died that long ago
        fresh = tinker.ServiceClient(base_url=tinker_server.url, api_key=KEY)
        fresh.create_lora_training_client(base_model=MODEL_NAME, rank=2).result()
        assert gone.model_id not in service.models and session.finished
        fresh.close("success").result()
    finally:
        service.max_models = saved
