"""The ``grpo:`` section: the online objectives' keys (:class:`hfsdp.builtin.online.schema.OnlineSection`) and
GRPO's loss and advantages, each named and defaulted as TRL 1.16's ``GRPOConfig`` field of the same name (see
docs/guide.md for the whole mapping). Combinations TRL runs are accepted as TRL runs them (TRL warns about three,
said in the descriptions of ``importance_sampling_level`` and ``loss_type``); the one it refuses is refused
(vespo with the importance-sampling correction per completion)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from hfsdp.builtin.online.schema import OnlineSection


class GrpoSection(OnlineSection):
    loss_type: Literal["grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo"] = Field(
        "dapo", description="TRL's definitions: grpo (each completion's token mean), bnpo (the micro-batch's token "
                            "mean), dr_grpo (tokens over max_new_tokens), dapo (the global batch's token mean), "
                            "cispo (the ratio clipped at epsilon_high, detached, times A and the log-prob; token "
                            "mean), sapo (a sigmoid gate of temperature sapo_temperature_pos/neg instead of the clip; "
                            "completion mean), luspo (each completion's token sum, mean over completions; TRL "
                            "advises importance_sampling_level: sequence), vespo (a gamma weight of the completion's "
                            "ratio, detached, times A and the log-prob; token mean)")
    epsilon: float = Field(0.2, gt=0, description="clip range of the probability ratio (low side)")
    epsilon_high: float | None = Field(None, gt=0, description="high side of the clip range (default epsilon; "
                                                               "DAPO: 0.28); cispo: the ratio's cap (ScaleRL: 5.0)")
    delta: float | None = Field(None, gt=0, description="two-sided clipping (INTELLECT-2): the ratio also capped at "
                                                        "delta (grpo, bnpo, dr_grpo, dapo, luspo; None: off)")
    sapo_temperature_neg: float = Field(1.05, gt=0, description="sapo's gate temperature where the advantage is "
                                                                "<= 0")
    sapo_temperature_pos: float = Field(1.0, gt=0, description="sapo's gate temperature where the advantage is > 0")
    vespo_k_pos: float = Field(2.0, description="vespo's power k where the advantage is >= 0")
    vespo_lambda_pos: float = Field(3.0, description="vespo's decay lambda where the advantage is >= 0")
    vespo_k_neg: float = Field(3.0, description="vespo's power k where the advantage is < 0")
    vespo_lambda_neg: float = Field(2.0, description="vespo's decay lambda where the advantage is < 0")
    importance_sampling_level: Literal["token", "sequence"] = Field(
        "token", description="the ratio per token, or per completion (GSPO: exp of the mean log-ratio of its "
                             "tokens); TRL warns that sequence with bnpo, dr_grpo, dapo or cispo weights each "
                             "completion by its length, and that vespo wants token")
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "group", description="divide advantages by the group's reward std, the whole batch's, or not at all")
    multi_objective_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = Field(
        "sum_then_normalize", description="sum the weighted rewards, then normalise as scale_rewards says; or "
                                          "normalise each function's rewards within the group, sum them weighted, "
                                          "then normalise by the batch's (GDPO; scale_rewards unused)")
    top_entropy_quantile: float = Field(
        1.0, ge=0, le=1, description="train on the tokens of the top quantile by entropy only (0.2: the 80/20 "
                                     "paper's; 1: all); the threshold is the quantile of the global batch's "
                                     "entropies, found by a forward without gradient before the step's own")
    off_policy_mask_threshold: float | None = Field(
        None, ge=0, description="DeepSeek-V3.2's off-policy sequence mask: a completion with a negative advantage "
                                "whose mean KL(old || current) exceeds this is left out (None: off; old: the "
                                "sampler's log-probs with the workers engine, as TRL's with vLLM)")
    use_bias_correction_kl: bool = Field(True, description="multiply the KL term by the ratio (DeepSeek-V3.2's "
                                                           "unbiased reverse-KL gradient); beta > 0 only")

    @model_validator(mode="after")
    def _vespo_corrects_per_token(self):
        generation = self.generation
        if (self.loss_type == "vespo" and generation.corrects
                and generation.importance_sampling_mode not in ("token_truncate", "token_mask")):
            raise ValueError("loss_type vespo takes the importance-sampling correction into its weight per token "
                             "(as TRL's): set generation.importance_sampling_mode to token_truncate or token_mask "
                             f"(not {generation.importance_sampling_mode}), or generation."
                             "importance_sampling_correction: false")
        return self
