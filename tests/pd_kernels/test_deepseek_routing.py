"""DeepSeek's MoE routing in ``pd_kernels.select_experts``: against HF's own router modules (V3's bias-corrected
sigmoid ``noaux_tc``, V2's softmax ``greedy`` and ``group_limited_greedy``), the bias steering the choice but
never the weights, and the argument checks."""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV2Config, DeepseekV3Config
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

import pd_kernels

HIDDEN, NUM_EXPERTS, NUM_GROUPS, TOPK_GROUP, TOP_K, SCALING = 32, 16, 4, 2, 4, 2.5
NUM_TOKENS = 64


def _config_kwargs() -> dict:
    return dict(hidden_size=HIDDEN, n_routed_experts=NUM_EXPERTS, n_group=NUM_GROUPS, topk_group=TOPK_GROUP,
                num_experts_per_tok=TOP_K, routed_scaling_factor=SCALING)


def _randomise(router: torch.nn.Module, seed: int) -> torch.Tensor:
    """Random router weights giving logits of unit scale (sigmoid scores spread over (0, 1), far from ties);
    returns the hidden states to route, [NUM_TOKENS, HIDDEN]."""
    torch.manual_seed(seed)
    with torch.no_grad():
        router.weight.copy_(torch.randn(NUM_EXPERTS, HIDDEN) / HIDDEN ** 0.5)
    return torch.randn(NUM_TOKENS, HIDDEN)


def _assert_same_routing(weights, ids, hf_weights, hf_ids):
    """HF picks with ``sorted=False``, so the same experts may come in another order: compare per row the
    sets of ids, and the weights matched by id."""
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    assert weights.shape == ids.shape == hf_ids.shape
    ids_sorted, order = ids.sort(dim=-1)
    hf_ids_sorted, hf_order = hf_ids.sort(dim=-1)
    assert torch.equal(ids_sorted, hf_ids_sorted)
    torch.testing.assert_close(weights.gather(1, order), hf_weights.gather(1, hf_order), rtol=0, atol=1e-6)


def _kept_groups(ids: torch.Tensor) -> list[set[int]]:
    group_size = NUM_EXPERTS // NUM_GROUPS
    return [{expert // group_size for expert in row} for row in ids.tolist()]


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_v3_noaux_tc_matches_hf(norm_topk_prob):
    router = DeepseekV3TopkRouter(DeepseekV3Config(**_config_kwargs(), norm_topk_prob=norm_topk_prob))
    hidden = _randomise(router, seed=0)
    bias = torch.randn(NUM_EXPERTS) * 0.3  # nonzero and on the scores' scale, so it moves choices
    router.e_score_correction_bias.copy_(bias)
    with torch.no_grad():
        logits, hf_weights, hf_ids = router(hidden)
    weights, ids = pd_kernels.select_experts(
        logits, TOP_K, norm_topk_prob, scoring="sigmoid", score_bias=bias, topk_method="noaux_tc",
        num_groups=NUM_GROUPS, topk_group=TOPK_GROUP, routed_scaling_factor=SCALING)
    _assert_same_routing(weights, ids, hf_weights, hf_ids)
    assert all(len(groups) <= TOPK_GROUP for groups in _kept_groups(ids))
    # The groups limit the choice somewhere: a plain top-k over the biased scores would differ.
    plain = torch.topk(logits.sigmoid() + bias, TOP_K).indices.sort(-1).values
    assert not torch.equal(plain, ids.sort(-1).values)


@pytest.mark.parametrize("topk_method", ["greedy", "group_limited_greedy"])
def test_v2_matches_hf(topk_method):
    router = DeepseekV2TopkRouter(DeepseekV2Config(**_config_kwargs(), topk_method=topk_method))
    hidden = _randomise(router, seed=1)
    with torch.no_grad():
        logits, hf_weights, hf_ids = router(hidden)
    weights, ids = pd_kernels.select_experts(
        logits, TOP_K, False, scoring="softmax", topk_method=topk_method, num_groups=NUM_GROUPS,
        topk_group=TOPK_GROUP, routed_scaling_factor=SCALING)
    _assert_same_routing(weights, ids, hf_weights, hf_ids)
    if topk_method == "group_limited_greedy":
        assert all(len(groups) <= TOPK_GROUP for groups in _kept_groups(ids))


def test_v2_renormalises_before_scaling_when_asked():
    router = DeepseekV2TopkRouter(DeepseekV2Config(**_config_kwargs(), topk_method="group_limited_greedy"))
    hidden = _randomise(router, seed=2)
    with torch.no_grad():
        logits, hf_weights, hf_ids = router(hidden)
    weights, ids = pd_kernels.select_experts(
        logits, TOP_K, True, topk_method="group_limited_greedy", num_groups=NUM_GROUPS, topk_group=TOPK_GROUP,
        routed_scaling_factor=SCALING)
    _assert_same_routing(weights, ids, hf_weights / hf_weights.sum(-1, keepdim=True) * SCALING, hf_ids)
    torch.testing.assert_close(weights.sum(-1), torch.full((NUM_TOKENS,), SCALING))


def test_score_bias_steers_the_choice_but_not_the_weights():
    torch.manual_seed(3)
    logits = torch.randn(NUM_TOKENS, NUM_EXPERTS)
    steered = 13
    logits[:, steered] = -4.0  # sigmoid ~ 0.018: never among the best unbiased
    routing = dict(scoring="sigmoid", topk_method="noaux_tc", num_groups=NUM_GROUPS, topk_group=TOPK_GROUP,
                   routed_scaling_factor=SCALING)
    _, unbiased_ids = pd_kernels.select_experts(logits, TOP_K, False, **routing)
    assert not (unbiased_ids == steered).any()
    bias = torch.zeros(NUM_EXPERTS)
    bias[steered] = 10.0
    weights, ids = pd_kernels.select_experts(logits, TOP_K, False, score_bias=bias, **routing)
    chosen = ids == steered
    assert chosen.sum(-1).tolist() == [1] * NUM_TOKENS
    expected = torch.sigmoid(logits[:, steered]) * SCALING
    torch.testing.assert_close(weights[chosen], expected, rtol=0, atol=1e-7)
    # The other choices' weights are their unbiased scores too.
    torch.testing.assert_close(weights, torch.sigmoid(logits).gather(1, ids) * SCALING, rtol=0, atol=1e-7)


def test_plain_routing_is_untouched_by_a_unit_scaling():
    torch.manual_seed(4)
    logits = torch.randn(NUM_TOKENS, NUM_EXPERTS, dtype=torch.bfloat16)
    weights, ids = pd_kernels.select_experts(logits, TOP_K, True)
    expected_weights, expected_ids = torch.topk(torch.softmax(logits.float(), -1), TOP_K)
    assert torch.equal(ids, expected_ids)
    assert torch.equal(weights, expected_weights / expected_weights.sum(-1, keepdim=True))


def test_no_tokens_route_to_nothing():
    weights, ids = pd_kernels.select_experts(
        torch.zeros(0, NUM_EXPERTS), TOP_K, True, scoring="sigmoid", score_bias=torch.zeros(NUM_EXPERTS),
        topk_method="noaux_tc", num_groups=NUM_GROUPS, topk_group=TOPK_GROUP, routed_scaling_factor=SCALING)
    assert weights.shape == ids.shape == (0, TOP_K)


V3 = dict(scoring="sigmoid", topk_method="noaux_tc", num_groups=NUM_GROUPS, topk_group=TOPK_GROUP)
V2 = dict(topk_method="group_limited_greedy", num_groups=NUM_GROUPS, topk_group=TOPK_GROUP)


@pytest.mark.parametrize("top_k, routing, named", [
    (TOP_K, {"scoring": "tanh"}, "scoring"),
    (TOP_K, {"topk_method": "random"}, "topk_method"),
    (TOP_K, {**V3, "topk_method": "greedy"}, "topk_method"),  # sigmoid scores route by noaux_tc only
    (TOP_K, {**V2, "topk_method": "noaux_tc"}, "topk_method"),  # noaux_tc scores by sigmoid only
    (TOP_K, {**V2, "num_groups": 3}, "num_groups"),  # 16 experts in 3 groups
    (TOP_K, {**V3, "num_groups": 0}, "num_groups"),
    (TOP_K, {**V3, "num_groups": 16, "topk_group": 8}, "num_groups"),  # noaux_tc sums each group's top 2
    (TOP_K, {**V2, "topk_group": 5}, "topk_group"),
    (TOP_K, {**V2, "topk_group": 0}, "topk_group"),
    (9, V2, "top_k"),  # the 2 kept groups of 4 hold 8 experts
    (9, V3, "top_k"),
    (TOP_K, {"score_bias": torch.zeros(NUM_EXPERTS)}, "score_bias"),  # the bias is for sigmoid scores
    (TOP_K, {**V3, "score_bias": torch.zeros(NUM_EXPERTS - 1)}, "score_bias"),
    (TOP_K, {**V3, "score_bias": torch.zeros(NUM_EXPERTS, dtype=torch.bfloat16)}, "score_bias"),
    (TOP_K, {**V3, "routed_scaling_factor": 0.0}, "routed_scaling_factor"),
    (17, {}, "top_k"),
])
def test_bad_routing_arguments_name_the_argument(top_k, routing, named):
    with pytest.raises(ValueError, match=f"^{named}"):
        pd_kernels.select_experts(torch.zeros(2, NUM_EXPERTS), top_k, True, **routing)
