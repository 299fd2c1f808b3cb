"""Each formula on hand-computed numbers, and: values at masked positions never change a result."""

from __future__ import annotations

import math

import pytest
import torch

from agentloop.errors import ConfigError
from trainer import algorithms as A
from trainer.algorithms._masked import dense_ids

# Hand-computed expectations (given to 6 decimals: +-5e-7) of fp32 formulas over <= 8 values of size <= 3:
# a few ulps, < 4 * eps * 3 = 1.4e-6; the larger values (30, 450 in the kl test) are exact in fp32
approx = lambda x: pytest.approx(x, abs=1e-5)  # noqa: E731


def t(x: object) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32)


def close(x: torch.Tensor, expected: object) -> None:  # the bound above `approx`
    torch.testing.assert_close(x.detach().float(), t(expected), atol=1e-5, rtol=0)


# ---------------------------------------------------------------- registries


def test_registry_same_function_is_noop_and_different_function_raises() -> None:
    assert A.get_adv_estimator("grpo") is A.grpo
    A.register_adv_estimator("grpo")(A.grpo)  # same function again: fine
    A.register_policy_loss("vanilla")(A.vanilla)
    with pytest.raises(ConfigError, match="'grpo' is already registered"):
        A.register_adv_estimator("grpo")(A.rloo)
    with pytest.raises(ConfigError, match="'pg' is already registered"):
        A.register_policy_loss("pg")(A.vanilla)
    assert A.get_adv_estimator("grpo") is A.grpo  # the failed registration changed nothing


def test_unknown_names_list_the_known_ones() -> None:
    with pytest.raises(ConfigError, match=r"unknown advantage estimator 'ppo'; known: gae, grpo, "):
        A.get_adv_estimator("ppo")
    with pytest.raises(ConfigError, match=r"unknown policy loss 'clip'; known: gspo, pg, vanilla"):
        A.get_policy_loss("clip")


def test_a_registered_estimator_is_usable_by_name() -> None:
    @A.register_adv_estimator("test_constant_one")
    def constant(rewards: torch.Tensor, response_mask: torch.Tensor, **_: object) -> A.AdvantageOutput:
        out = response_mask.float()
        return A.AdvantageOutput(out, out)

    out = A.compute_advantage("test_constant_one", t([1.0]), t([[1, 0]]))
    assert out.advantages.tolist() == [[1.0, 0.0]]
    assert "test_constant_one" in A.known_adv_estimators()


# ---------------------------------------------------------------- advantage estimators


def test_grpo_with_and_without_std_and_singleton_groups() -> None:
    mask = torch.ones(7, 2)
    scores = t([1, 0, 0, 1, 5, 2, 2])
    index = torch.tensor([0, 0, 0, 0, 1, 2, 2])
    adv = A.grpo(scores, mask, index=index).advantages
    # group 0: mean 0.5, unbiased std sqrt(1/3); singleton: 0; equal scores: 0
    close(adv[:, 0], [0.866024, -0.866024, -0.866024, 0.866024, 0.0, 0.0, 0.0])
    assert adv[:, 1].tolist() == adv[:, 0].tolist()
    drgrpo = A.grpo(scores, mask, index=index, norm_adv_by_std=False).advantages
    close(drgrpo[:, 0], [0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 0.0])


def test_grpo_token_level_rewards_sum_and_mask_broadcast() -> None:
    rewards = t([[0, 1.0], [0, 0], [0.5, 0]])  # scores 1, 0, 0.5
    mask = t([[1, 1], [1, 0], [1, 1]])
    adv = A.grpo(rewards, mask, index=torch.tensor([3, 3, 3])).advantages
    # mean 0.5, std 0.5 -> (±0.5) / (0.5 + 1e-6)
    close(adv, [[0.999998, 0.999998], [-0.999998, 0.0], [0.0, 0.0]])


def test_rloo_leave_one_out_baseline() -> None:
    adv = A.rloo(t([1.0, 0.0, 0.5, 7.0]), torch.ones(4, 1), index=torch.tensor([0, 0, 0, 1])).advantages
    # 1 - (0 + .5)/2, 0 - (1 + .5)/2, .5 - (1 + 0)/2 ; singleton 0
    close(adv[:, 0], [0.75, -0.75, 0.0, 0.0])


def test_group_estimators_compare_calls_at_the_same_position() -> None:
    """Per-call rows (the module docstring's S[j, k]). Attempt a has calls at positions 0 and 2 (its
    call 1 failed), b at 0, 1, 2, c only at 1. Table by position: a [1.0, 1.0 (its call 0), 0.4],
    b [0.0, 0.3, 0.2], c [0.5 (before its first call: its first), 0.5, 0.5 (ended)].
    RLOO: a@0 1 - (0 + .5)/2 = .75 ; a@2 .4 - (.2 + .5)/2 = .05 ; b@0 0 - (1 + .5)/2 = -.75 ;
    b@1 .3 - (1 + .5)/2 = -.45 ; b@2 .2 - (.4 + .5)/2 = -.25 ; c@1 .5 - (1 + .3)/2 = -.15."""
    scores = t([1.0, 0.4, 0.0, 0.3, 0.2, 0.5])
    attempt = torch.tensor([7, 7, 3, 3, 3, 9])
    position = torch.tensor([0, 2, 0, 1, 2, 1])
    index = torch.zeros(6, dtype=torch.long)
    adv = A.rloo(scores, torch.ones(6, 1), index=index, attempt_index=attempt, call_position=position)
    close(adv.advantages[:, 0], [0.75, 0.05, -0.75, -0.45, -0.25, -0.15])
    # GRPO at position 1: [1.0, 0.3, 0.5], mean 0.6, std sqrt((.16 + .09 + .01) / 2) = 0.36056
    grpo = A.grpo(scores, torch.ones(6, 1), index=index, attempt_index=attempt, call_position=position)
    close(grpo.advantages[3:4, 0], [(0.3 - 0.6) / (math.sqrt(0.13) + 1e-6)])
    # without call_position the rows' order in the attempt is the position: a [1.0, 0.4, 0.4],
    # b [0.0, 0.3, 0.2], c [0.5, 0.5, 0.5]
    by_order = A.rloo(scores, torch.ones(6, 1), index=index, attempt_index=attempt).advantages
    expected = [0.75, 0.4 - (0.3 + 0.5) / 2, -0.75, 0.3 - (0.4 + 0.5) / 2, 0.2 - (0.4 + 0.5) / 2, 0.5 - 0.5]
    close(by_order[:, 0], expected)


@pytest.mark.parametrize("name", ["grpo", "rloo", "reinforce_plus_plus_baseline"])
def test_a_group_of_equal_scores_gets_exactly_zero(name: str) -> None:
    """7 x 0.7: the fp32 mean is not exactly 0.7, and (0.7 - mean) / (std + 1e-6) gave 0.056 (verl
    alike). Scores within float rounding of each other (one ulp apart here) are a tie: exactly 0.
    A real difference of 1e-4 still counts."""
    mask = torch.ones(9, 2)
    seven = torch.full((7,), 0.7)
    ulp = torch.nextafter(torch.tensor(0.3), torch.tensor(1.0))
    scores = torch.cat([seven, torch.tensor([0.3]), ulp.reshape(1)])
    index = torch.tensor([0] * 7 + [1, 1])
    assert A.compute_advantage(name, scores, mask, index=index).advantages.abs().max().item() == 0.0
    apart = A.grpo(t([0.3, 0.3001]), torch.ones(2, 1), index=torch.tensor([0, 0])).advantages
    # 0.5e-4 / (1e-4 / sqrt(2) + 1e-6); fp32 0.3 and 0.3001 are each within 1.5e-8 of their value
    assert apart[1, 0].item() == pytest.approx(0.5e-4 / (1e-4 / math.sqrt(2) + 1e-6), rel=1e-3)


def test_group_estimators_check_positions() -> None:
    one = torch.ones(2, 1)
    with pytest.raises(ValueError, match="call_position must be"):
        A.grpo(t([1.0, 0.0]), one, index=torch.tensor([0, 0]), call_position=torch.tensor([0]))
    with pytest.raises(ValueError, match="same call_position"):
        A.grpo(
            t([1.0, 0.0]),
            one,
            index=torch.tensor([0, 0]),
            attempt_index=torch.tensor([4, 4]),
            call_position=torch.tensor([1, 1]),
        )
    with pytest.raises(ValueError, match="same group"):
        A.grpo(t([1.0, 0.0]), one, index=torch.tensor([0, 1]), attempt_index=torch.tensor([4, 4]))


def test_group_estimators_need_an_index() -> None:
    with pytest.raises(ValueError, match="pass index"):
        A.grpo(t([1.0]), torch.ones(1, 1))


def test_reinforce_plus_plus_discounted_and_whitened() -> None:
    out = A.reinforce_plus_plus(t([[0, 0, 1.0]]), torch.ones(1, 3), gamma=0.5)
    close(out.returns, [[0.25, 0.5, 1.0]])
    close(out.advantages, [[-0.872872, -0.218218, 1.091089]])


def test_reinforce_plus_plus_skips_tool_tokens() -> None:
    # the tool token (mask 0) neither adds its reward nor costs a discount step
    out = A.reinforce_plus_plus(t([[0, 9.0, 0, 1.0]]), t([[1, 0, 1, 1]]), gamma=0.5)
    close(out.returns, [[0.25, 0.0, 0.5, 1.0]])
    close(out.advantages, [[-0.872872, 0.0, -0.218218, 1.091089]])


def test_reinforce_plus_plus_takes_scores_on_the_last_token() -> None:
    out = A.reinforce_plus_plus(t([1.0]), t([[1, 1, 1, 0]]), gamma=0.5)
    close(out.returns, [[0.25, 0.5, 1.0, 0.0]])


def test_reinforce_plus_plus_baseline() -> None:
    mask = t([[1, 1], [1, 0], [1, 1]])
    out = A.reinforce_plus_plus_baseline(t([1.0, 0.0, 3.0]), mask, index=torch.tensor([0, 0, 1]))
    # token values 0.5, 0.5, -0.5, 0, 0 (singleton 0): mean 0.1, unbiased std sqrt(0.2)
    close(out.advantages, [[0.956183, 0.956183], [-1.434274, 0.0], [-0.239046, -0.239046]])


def test_gae_by_hand() -> None:
    out = A.gae(t([[0, 0, 1.0]]), torch.ones(1, 3), values=t([[0.5, 0.6, 0.7]]), gamma=0.9, lam=0.8)
    # deltas backwards: 1 - .7 = .3 ; .9*.7 - .6 = .03 -> .03 + .72*.3 = .246 ; .54 - .5 -> .04 + .72*.246
    close(out.returns, [[0.71712, 0.846, 1.0]])
    close(out.advantages, [[-0.885512, -0.199034, 1.084547]])
    with pytest.raises(ValueError, match="gae needs values"):
        A.gae(t([[1.0]]), torch.ones(1, 1))


def test_scores_to_token_rewards() -> None:
    out = A.scores_to_token_rewards(t([1.0, 2.0, 3.0]), t([[1, 1, 0], [1, 0, 1], [0, 0, 0]]))
    assert out.tolist() == [[0, 1, 0], [0, 0, 2], [0, 0, 0]]


# ---------------------------------------------------------------- losses


def _ppo_case() -> tuple[torch.Tensor, ...]:
    # ratios 1.5, 0.5, 0.5 | 5, masked, masked ; advantages 1, 1, -1 | -1
    logp = torch.log(t([[1.5, 0.5, 0.5], [5.0, 1.0, 1.0]])).requires_grad_()
    old = torch.zeros(2, 3)
    adv = t([[1, 1, -1], [-1, 0, 0]])
    mask = t([[1, 1, 1], [1, 0, 0]])
    return logp, old, adv, mask


def test_vanilla_ppo_clip_and_dual_clip() -> None:
    logp, old, adv, mask = _ppo_case()
    kw = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0}
    # token losses: -1.28 (clipped high), -0.5, 0.8 (clipped low), 3 (dual clip caps 5 at 3)
    out = A.vanilla(logp, old, adv, mask, **kw)
    assert out.loss.item() == approx((-1.28 - 0.5 + 0.8 + 3.0) / 4)
    assert out.clip_frac.item() == approx(0.5)
    assert out.clip_frac_lower.item() == approx(0.25)
    assert out.approx_kl.item() == approx(-math.log(1.5 * 0.5 * 0.5 * 5.0) / 4)
    out.loss.backward()
    # only the unclipped token (ratio 0.5, A=1) has a gradient: d(-A r)/d logp = -A r / 4
    close(logp.grad, [[0.0, -0.125, 0.0], [0.0, 0.0, 0.0]])
    seq_sum = A.vanilla(logp, old, adv, mask, loss_agg_mode="seq-mean-token-sum", **kw).loss
    assert seq_sum.item() == approx(((-1.28 - 0.5 + 0.8) + 3.0) / 2)
    seq_mean = A.vanilla(logp, old, adv, mask, loss_agg_mode="seq-mean-token-mean", **kw).loss
    assert seq_mean.item() == approx(((-1.28 - 0.5 + 0.8) / 3 + 3.0) / 2)


def test_gspo_uses_the_geometric_mean_ratio_of_the_sequence() -> None:
    logp = t([[math.log(2.0), 0.0]]).requires_grad_()
    old, adv, mask = torch.zeros(1, 2), t([[1.0, 1.0]]), torch.ones(1, 2)
    out = A.gspo(logp, old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.2)
    # sequence ratio sqrt(2) = 1.414 is clipped at 1.2 for both tokens
    assert out.loss.item() == approx(-1.2)
    assert out.clip_frac.item() == approx(1.0)
    wide = A.gspo(logp, old, adv, mask, clip_ratio_low=0.9, clip_ratio_high=1.0)
    assert wide.loss.item() == approx(-math.sqrt(2.0))
    wide.loss.backward()
    # each token's gradient is -A * s / T with s the sequence ratio, not its own ratio
    close(logp.grad, [[-math.sqrt(2.0) / 2, -math.sqrt(2.0) / 2]])


def test_plain_policy_gradient() -> None:
    logp = t([[-1.0, -2.0]]).requires_grad_()
    out = A.pg(logp, t([[-1.5, -2.0]]), t([[1.0, -1.0]]), torch.ones(1, 2))
    assert out.loss.item() == approx((1.0 - 2.0) / 2)
    assert out.approx_kl.item() == approx(-0.25)
    out.loss.backward()
    close(logp.grad, [[-0.5, 0.5]])


def test_agg_loss_modes_and_denominator() -> None:
    loss = t([[1, 2, 3], [4, 0, 0], [9, 9, 9]])
    mask = t([[1, 1, 1], [1, 0, 0], [0, 0, 0]])  # the third sequence has no valid token
    assert A.agg_loss(loss, mask, "token-mean").item() == approx(10 / 4)
    assert A.agg_loss(loss, mask, "seq-mean-token-sum").item() == approx((6 + 4) / 2)
    assert A.agg_loss(loss, mask, "seq-mean-token-mean").item() == approx((2 + 4) / 2)
    assert A.agg_loss(loss, mask, "token-mean", denominator=8).item() == approx(10 / 8)
    assert A.agg_loss(loss, torch.zeros(3, 3)).item() == 0.0
    with pytest.raises(ConfigError, match="loss_agg_mode must be one of token-mean"):
        A.agg_loss(loss, mask, "sum")


def test_kl_estimators() -> None:
    logp, ref = t([[-1.0, -2.0, 0.0]]), t([[-2.0, -1.0, -30.0]])
    close(A.kl_penalty(logp, ref, "kl"), [[1.0, -1.0, 30.0]])
    close(A.kl_penalty(logp, ref, "k1"), [[1.0, -1.0, 30.0]])
    close(A.kl_penalty(logp, ref, "abs"), [[1.0, 1.0, 30.0]])
    close(A.kl_penalty(logp, ref, "mse"), [[0.5, 0.5, 450.0]])
    # k3 = e^r - r - 1, r = ref - logp: e^-1 + 1 - 1, e - 1 - 1, and r=-30 clamps to -20 then 19 clamps to 10
    k3 = [[math.exp(-1.0), math.e - 2.0, 10.0]]
    close(A.kl_penalty(logp, ref, "low_var_kl"), k3)
    close(A.kl_penalty(logp, ref, "k3"), k3)
    with pytest.raises(ConfigError, match="kl estimator must be one of"):
        A.kl_penalty(logp, ref, "full")


def test_kl_in_reward() -> None:
    rewards, kl_mean = A.apply_kl_in_reward(t([[0, 0, 1.0]]), t([[0.1, 0.2, 0.3]]), 0.5, torch.ones(1, 3))
    close(rewards, [[-0.05, -0.1, 0.85]])
    assert kl_mean.item() == approx(0.2)


def test_entropy_from_logits_is_exact_and_stable() -> None:
    logits = t([[[0.0, 0.0], [0.0, math.log(3.0)], [1000.0, 0.0], [1e4, 1e4]]])  # (1, 4, 2)
    h = A.entropy_from_logits(logits)
    assert h.shape == (1, 4)
    close(h, [[math.log(2), -(0.25 * math.log(0.25) + 0.75 * math.log(0.75)), 0.0, math.log(2)]])


def test_logprobs_from_logits_is_log_softmax_of_raw_logits() -> None:
    logits = t([[[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]]])  # (1, 2, 3)
    lp = A.logprobs_from_logits(logits, torch.tensor([[2, 0]]))
    close(lp, [[3.0 - math.log(math.e + math.e**2 + math.e**3), -math.log(3.0)]])
    g = torch.Generator().manual_seed(0)
    big = torch.randn(2, 5, 11, generator=g) * 5
    ids = torch.randint(0, 11, (2, 5), generator=g)
    ref = torch.log_softmax(big, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    # logit - logsumexp vs log_softmax: eps * (2M + log2 V) = 8e-6 with M = logit range (~30) + log2 V (V = 11)
    assert torch.allclose(
        A.logprobs_from_logits(big.bfloat16(), ids),
        torch.log_softmax(big.bfloat16().float(), -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1),
        atol=1e-5,
    )
    assert torch.allclose(A.logprobs_from_logits(big, ids), ref, atol=1e-5)


def test_shape_mismatches_are_named() -> None:
    with pytest.raises(ValueError, match=r"old_log_prob has shape \(1, 3\), log_prob has \(1, 2\)"):
        A.vanilla(torch.zeros(1, 2), torch.zeros(1, 3), torch.zeros(1, 2), torch.ones(1, 2))
    with pytest.raises(ValueError, match="response_mask"):
        A.agg_loss(torch.zeros(2, 2), torch.ones(2, 3))


# ---------------------------------------------------------------- masked positions never matter


def _random_case(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    b, n = 6, 7
    mask = (torch.rand(b, n, generator=g) > 0.35).float()
    mask[:, 0] = 1.0  # every row has a valid token
    mask[1, 4:] = 0.0  # right padding
    mask[2, 2] = 0.0  # a tool token in the middle
    return {
        "mask": mask,
        "rewards": torch.randn(b, n, generator=g),
        "values": torch.randn(b, n, generator=g),
        "logp": -torch.rand(b, n, generator=g) * 2,
        "old": -torch.rand(b, n, generator=g) * 2,
        "adv": torch.randn(b, n, generator=g),
        "index": torch.tensor([0, 0, 0, 1, 1, 2]),
    }


def _scramble(x: torch.Tensor, mask: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.where(mask.bool(), x, torch.randn(x.shape, generator=g) * 1e3)


@pytest.mark.parametrize(
    "name", ["grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "gae"]
)
def test_estimators_ignore_masked_values(name: str) -> None:
    c = _random_case(1)
    kw = {"index": c["index"], "gamma": 0.9, "lam": 0.95}
    out1 = A.compute_advantage(name, c["rewards"], c["mask"], values=c["values"], **kw)
    out2 = A.compute_advantage(
        name,
        _scramble(c["rewards"], c["mask"], 2),
        c["mask"],
        values=_scramble(c["values"], c["mask"], 3),
        **kw,
    )
    assert out1.advantages.abs().sum() > 0  # the case is not trivially zero
    # the same fp32 ops on the same unmasked values: equal bit for bit; a leaked masked value (~1e3) is not
    assert torch.allclose(out1.advantages, out2.advantages, atol=1e-5)
    assert torch.allclose(out1.returns, out2.returns, atol=1e-5)
    assert (out1.advantages[c["mask"] == 0] == 0).all()


@pytest.mark.parametrize("loss_name", ["vanilla", "gspo", "pg"])
@pytest.mark.parametrize("mode", A.LOSS_AGG_MODES)
def test_policy_losses_ignore_masked_values(loss_name: str, mode: str) -> None:
    c = _random_case(4)
    m = c["mask"]

    def run(
        logp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor
    ) -> tuple[A.PolicyLossOutput, torch.Tensor]:
        leaf = logp.clone().requires_grad_()
        out = A.compute_policy_loss(loss_name, leaf, old, adv, m, loss_agg_mode=mode, clip_ratio_low=0.1)
        out.loss.backward()
        return out, leaf.grad

    out1, grad1 = run(c["logp"], c["old"], c["adv"])
    out2, grad2 = run(_scramble(c["logp"], m, 5), _scramble(c["old"], m, 6), _scramble(c["adv"], m, 7))
    for a, b in zip(out1, out2, strict=True):
        assert torch.allclose(a, b, atol=1e-5)
    assert torch.allclose(grad1, grad2, atol=1e-6)
    assert (grad1[m == 0] == 0).all()
    assert grad1.abs().sum() > 0


@pytest.mark.parametrize("mode", A.LOSS_AGG_MODES)
def test_agg_and_kl_ignore_masked_values(mode: str) -> None:
    c = _random_case(8)
    m = c["mask"]
    assert A.agg_loss(c["adv"], m, mode).item() == approx(
        A.agg_loss(_scramble(c["adv"], m, 9), m, mode).item()
    )
    for kind in A.KL_KINDS:
        kl1 = A.kl_penalty(c["logp"], c["old"], kind)
        kl2 = A.kl_penalty(_scramble(c["logp"], m, 10), _scramble(c["old"], m, 11), kind)
        r1, mean1 = A.apply_kl_in_reward(c["rewards"], kl1, 0.1, m)
        r2, mean2 = A.apply_kl_in_reward(_scramble(c["rewards"], m, 12), kl2, 0.1, m)
        assert torch.allclose(r1, r2) and torch.allclose(mean1, mean2)
        assert A.agg_loss(kl1, m, mode).item() == approx(A.agg_loss(kl2, m, mode).item())


@pytest.mark.parametrize("seed", range(5))
def test_dense_ids_number_as_torch_unique_does(seed: int) -> None:
    """The advantages group rows without reading their ids back; the numbering is unique's."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(-(2**40), 2**40, (6,), generator=g)[torch.randint(0, 6, (33,), generator=g)]
    assert torch.equal(dense_ids(ids), torch.unique(ids, return_inverse=True)[1])
    assert dense_ids(torch.tensor([7])).tolist() == [0]
    assert dense_ids(torch.tensor([5, 5, 2, 9, 2])).tolist() == [1, 1, 0, 2, 0]
    assert dense_ids(torch.zeros(0, dtype=torch.long)).tolist() == []


def test_dense_ids_take_one_dimension() -> None:
    with pytest.raises(ValueError, match=r"ids must be \(B,\)"):
        dense_ids(torch.zeros(2, 2, dtype=torch.long))
