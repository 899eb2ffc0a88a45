"""What every online objective's section has (:class:`OnlineSection`): the group of completions sampled per prompt,
how they are sampled, the reward functions that score them, the rounds and the KL reference. A plugin's section
subclasses it (``grpo:``, :class:`hfsdp.builtin.grpo.schema.GrpoSection`) and adds its loss's keys."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from hfsdp.config.schema import DType, Section


class RewardSpec(Section):
    name: str = Field(description="a name a plugin's hfsdp_reward_functions offers, or module:function")
    weight: float = Field(1.0, description="its weight in the summed reward")


class GenerationSection(Section):
    """Where and how the completions are sampled (``<objective>.generation``)."""

    engine: Literal["inline", "workers"] = Field(
        "inline", description="inline: the training ranks sample each round, then train on it; workers: generation "
                              "processes beside the trainer (on the first rank's host) hold a copy of the policy "
                              "and sample rounds ahead while the ranks train (max_staleness), the new weights "
                              "reaching them through shared memory after each round")
    processes: int = Field(1, ge=1, description="generation processes of the workers engine (each samples a share "
                                                "of every round; the completions do not depend on how many)")
    max_staleness: int = Field(0, ge=0, description="round r is sampled by the policy of round max(0, r - "
                                                    "max_staleness), exactly, whatever the timing (TRL's "
                                                    "AsyncGRPO name): 0 samples each round with the weights it "
                                                    "trains from (as inline); k lets sampling run k rounds ahead")
    dtype: DType | None = Field(None, description="the sampling copy's dtype (default the model's): a lower "
                                                  "precision samples faster and brings a train-inference mismatch "
                                                  "(metric sampling/sampling_logp_difference)")
    importance_sampling_correction: bool = Field(True, description="TRL's vllm_importance_sampling_correction: "
                                                                   "weigh each token's GRPO loss by the ratio of "
                                                                   "the trainer's to the sampler's probability "
                                                                   "(the workers engine; inline samples "
                                                                   "with the trained model itself; TRL's RLOO and "
                                                                   "distillation have none)")
    importance_sampling_mode: Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"] = Field(
        "sequence_mask", description="TRL's vllm_importance_sampling_mode: the ratio per token or per completion, "
                                     "clipped to [clip_min, clip_max] (truncate) or set to 0 outside it (mask)")
    importance_sampling_clip_max: float | None = Field(3.0, gt=0, description="TRL's "
                                                                             "vllm_importance_sampling_clip_max "
                                                                             "(formerly _cap)")
    importance_sampling_clip_min: float | None = Field(None, ge=0, description="TRL's "
                                                                              "vllm_importance_sampling_clip_min")

    @property
    def beside(self) -> bool:
        """Whether the completions are sampled by another copy of the policy than the trained model."""
        return self.engine != "inline"

    @property
    def corrects(self) -> bool:
        """Whether GRPO's loss is weighed by the importance-sampling ratio of the trainer's to the sampler's
        probabilities (:mod:`hfsdp.builtin.online.correction`)."""
        return self.beside and self.importance_sampling_correction


class OnlineSection(Section):
    num_generations: int = Field(4, ge=2, description="completions per prompt (the group); divides "
                                                      "train.per_device_batch_size")
    max_new_tokens: int = Field(64, gt=0, description="most tokens a completion has (TRL's max_completion_length)")
    temperature: float = Field(1.0, gt=0, description="sampling temperature (the log-probs are of the tempered logits)")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling: the smallest set of tokens of this mass")
    top_k: int = Field(0, ge=0, description="sample among the k likeliest tokens (0: all)")
    rewards: list[RewardSpec] = Field([], description="the reward functions, summed with their weights (an "
                                                      "environment's get_reward is one more, weight 1)")
    mask_truncated_completions: bool = Field(False, description="leave out of the loss a completion cut at "
                                                                "max_new_tokens (not ending in EOS): no loss, not "
                                                                "counted in the units the loss is divided by")
    beta: float = Field(0.0, ge=0, description="KL to the reference (the base with the LoRA adapters disabled)")
    num_iterations: int = Field(1, ge=1, description="optimizer steps on each generated batch (old log-probs kept)")
    log_completions: int = Field(4, ge=0, description="completions written to completions.jsonl per generation")
    reward_timeout_s: float | None = Field(None, gt=0, description="seconds one call of a reward function may take "
                                                                   "before the run stops, naming it and the rows "
                                                                   "(default: half of train.collective_timeout_s)")
    check_reward_determinism: bool = Field(True, description="every round, each rank scores the round's first "
                                                             "completion again, alone, and the run stops where a "
                                                             "function gives it another value than in its "
                                                             "micro-batch: such rewards break 1 process = N ranks "
                                                             "and resume; false for a reward that samples on "
                                                             "purpose")
    num_generations_eval: int | None = Field(None, ge=1, description="completions sampled per eval prompt (TRL's "
                                                                      "name; default num_generations): eval_reward "
                                                                      "is their mean reward")
    generation: GenerationSection = Field(default_factory=GenerationSection,
                                          description="where and how completions are sampled")
    tools: list[str] = Field([], description="functions the model may call between its turns (TRL's tools): "
                                             "module:function, each with type hints and a docstring (its schema in "
                                             "the prompt), or python (hfsdp's code tool, in a bubblewrap sandbox); "
                                             "they run in worker processes, never in the trainer")
    environment: str | dict[str, str] | None = Field(None, description="TRL's environment_factory: module:Class "
                                                                       "(one instance per rollout: reset(**row), its "
                                                                       "public methods as tools, an optional "
                                                                       "get_reward), or name: module:Class for rows "
                                                                       "choosing theirs by an environment column; "
                                                                       "python: hfsdp's code sandbox")
    max_tool_calling_iterations: int | None = Field(None, ge=0, description="most rounds of tool calls a rollout "
                                                                            "makes (TRL's name; default: until no "
                                                                            "call or max_new_tokens is reached)")
    tool_timeout_s: float = Field(10.0, gt=0, description="wall-clock seconds a tool call (and reset, get_reward) "
                                                          "may take; past it its worker process is stopped and the "
                                                          "model reads an error")
    tool_memory_mb: int = Field(1024, gt=0, description="address space of a tool's worker process, in MiB")
    tool_cpu_s: float = Field(5.0, gt=0, description="CPU seconds a tool call may use (below tool_timeout_s, a "
                                                     "busy loop is stopped by this limit, with the same message "
                                                     "every run, unless the host gives it under half a core)")

    @property
    def acts(self) -> bool:
        """Whether rollouts call tools (``tools`` or an ``environment``): multi-turn."""
        return bool(self.tools or self.environment)

    @model_validator(mode="after")
    def _has_rewards(self):
        if not self.rewards and not self.environment:
            raise ValueError("rewards: name at least one reward function (or an environment whose get_reward "
                             "scores the rollouts)")
        return self
