"""hfsdp's reference-free preference objectives against TRL 1.16, step by step: ``orpo`` against
``ORPOTrainer``, ``simpo`` against ``CPOTrainer(loss_type="simpo")``, and the reward model (``reward_model``)
against ``RewardTrainer``, ``kto`` against ``KTOTrainer``, and ``distill`` (with ``distill.alpha: 1``) against
``GKDTrainer`` without on-policy samples (issue 36).

As benchmarks/trl_dpo.py: the same model folder, the same pairs in the same order per step (hfsdp's
``BatchPlan``, read sequentially by TRL), the same hyper-parameters (AdamW, LR schedule, clipping), fp32, one
process, full fine-tuning. TRL's CPO and ORPO trainers tokenize by older conventions than its DPOTrainer (a BOS and
an EOS appended, the prompt cut where the tokenizations first differ by one token), so TRL is given hfsdp's tokens of
the same rows (its ``tokenize_row`` replaced): what is compared is the loss, its gradient and the optimizer step.
``RewardTrainer`` is given hfsdp's token ids of each pair (its pre-tokenized ``chosen_ids``/``rejected_ids``, which
its own tokenization gives too: prompt + completion, EOS appended) and the same sequence-classification model
(hfsdp's ``sequence_classifier`` of the causal LM: the same seeded score head). ``KTOTrainer`` tokenizes the same
rows itself (TRL's own tokenization, which hfsdp's ``unpaired`` format follows) and runs its reference model (a
second copy of the model) where hfsdp precomputes the reference log-probs; its KL rows are replaced by hfsdp's (each
row's prompt with the completion of the row before it in file-order chunks of the batch: TRL rotates within its
step's batch, which is hfsdp's only where the plan does not shuffle), so that the same loss is compared.
Prints, per step, each side's loss and every logged metric both trainers share, their largest relative
difference (target 1e-5; KTO's rewards and KL relative to the log-probs they are differences of: :func:`scale`), and
the step-time ratio (median, first step left out).

    python benchmarks/trl_preference.py orpo [CONFIG] --steps 6 [--set KEY=VALUE ...]
    python benchmarks/trl_preference.py simpo --steps 6 --set simpo.nll_weight=1.0
    python benchmarks/trl_preference.py reward_model --steps 6 [--set reward_model.center_rewards_coefficient=0.01]
    python benchmarks/trl_preference.py reward_model --steps 6 --float64-clip   # TRL clips by hfsdp's norm
    python benchmarks/trl_preference.py kto --steps 6 [--set kto.undesirable_weight=1.33]
    python benchmarks/trl_preference.py distill --steps 6 --set distill.alpha=1

CONFIG defaults to the objective's preset (``orpo``, ``simpo``, ``rm``, ``kto``, ``distill``). Needs TRL:
``pip install -e '.[bench]'``.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from trl_dpo import in_plan_order, run_hfsdp, speed  # benchmarks/, next to this file
from trl_sft import float64_norms, step_times, training_args

# hfsdp's metric -> TRL's (both trainers log these)
SHARED = {"rewards/chosen": "rewards/chosen", "rewards/rejected": "rewards/rejected",
          "rewards/margins": "rewards/margins", "rewards/accuracy": "rewards/accuracies",
          "logps/chosen": "logps/chosen", "logps/rejected": "logps/rejected", "nll_loss": "nll_loss"}
OWN = {"orpo": {"log_odds_ratio": "log_odds_ratio", "log_odds_chosen": "log_odds_chosen"}, "simpo": {}}
# the reward model's metrics (hfsdp's -> RewardTrainer's)
REWARD = {"rewards/accuracy": "accuracy", "rewards/margins": "margin", "rewards/mean": "mean_reward",
          "rewards/min": "min_reward", "rewards/max": "max_reward"}
PRESETS = {"orpo": "orpo", "simpo": "simpo", "reward_model": "rm", "kto": "kto", "distill": "distill"}
# KTO's metrics (the same names on both sides)
KTO = {name: name for name in ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen",
                               "logps/rejected", "kl")}


def trl_trainer(objective: str, cfg):
    """(trainer class, config class, the objective's TRL arguments)."""
    if objective == "orpo":
        from trl.experimental.orpo import ORPOConfig, ORPOTrainer

        return ORPOTrainer, ORPOConfig, {"beta": cfg.section("orpo").beta}
    from trl.experimental.cpo import CPOConfig, CPOTrainer

    s = cfg.section("simpo")
    return CPOTrainer, CPOConfig, {"loss_type": "simpo", "beta": s.beta, "simpo_gamma": s.gamma,
                                   "cpo_alpha": s.nll_weight}


def run_trl_reward(cfg, host, steps: int, float64_clip: bool) -> tuple[list[float], list[dict], list[float]]:
    """TRL's ``RewardTrainer`` on hfsdp's token ids of the same pairs, in hfsdp's order, from the same model."""
    import datasets
    import torch
    from torch.utils.data import SequentialSampler
    from trl import RewardConfig, RewardTrainer

    from hfsdp.builtin.reward_model.model import sequence_classifier
    from hfsdp.model import loading

    t, section = cfg.train, cfg.section("reward_model")
    path, tokenizer, raw, train_set, order = in_plan_order(cfg, host, steps)
    rows = [{"chosen_ids": train_set[i]["input_ids"], "rejected_ids": train_set[i]["rejected_input_ids"],
             **({"margin": train_set[i]["margin"]} if section.margin else {})} for i in order]
    losses: list[float] = []
    metrics: list[dict] = []
    times: list[float] = []

    class InPlanOrder(RewardTrainer):
        def _get_train_sampler(self, *unused, **unused_kw):
            return SequentialSampler(self.train_dataset)

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            losses.append(float((loss[0] if return_outputs else loss).detach()))
            metrics.append({k: v[-1] for k, v in self._metrics["train"].items()})
            return loss

    torch.manual_seed(t.seed)
    model = sequence_classifier(loading.load_model(path, cfg.model), tokenizer.pad_token_id, seed=t.seed)
    with tempfile.TemporaryDirectory() as out:
        args = RewardConfig(**training_args(t, out, steps), max_length=cfg.data.max_seq_len,
                            center_rewards_coefficient=section.center_rewards_coefficient)
        trainer = InPlanOrder(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows),
                              processing_class=tokenizer, callbacks=[step_times(times)])
        if float64_clip:
            float64_norms(trainer, [], [], clip_by_them=True)
        trainer.train()
    return losses, metrics, times


def run_trl_kto(cfg, host, steps: int, float64_clip: bool) -> tuple[list[float], list[dict], list[float]]:
    """TRL's ``KTOTrainer`` on the same rows in hfsdp's order, from the same model, with hfsdp's KL rows."""
    import datasets
    import torch
    from torch.utils.data import SequentialSampler
    from trl import KTOConfig, KTOTrainer

    from hfsdp import IGNORE_INDEX
    from hfsdp.model import loading

    t, section = cfg.train, cfg.section("kto")
    path, tokenizer, raw, train_set, order = in_plan_order(cfg, host, steps)
    chunk = t.per_device_batch_size  # hfsdp's KL chunks: the global batch (one process, no accumulation)

    def completion(i: int) -> list[int]:
        row = train_set[i]
        return row["input_ids"][next(k for k, label in enumerate(row["labels"]) if label != IGNORE_INDEX):]

    def partner(i: int) -> int:  # hfsdp.builtin.kto.loss.with_kl_rows: the row before, within file-order chunks
        first = i - i % chunk
        return i - 1 if i > first else min(first + chunk, len(train_set)) - 1

    ordered = datasets.Dataset.from_list([{**raw[i], "hfsdp_row": i} for i in order])
    losses: list[float] = []
    metrics: list[dict] = []
    times: list[float] = []

    class InPlanOrder(KTOTrainer):
        def _prepare_dataset(self, dataset, *rest, **kw):
            dataset = super()._prepare_dataset(dataset, *rest, **kw)
            return dataset.map(lambda row: {"KL_completion_ids": completion(partner(row["hfsdp_row"]))})

        def _get_train_sampler(self, *unused, **unused_kw):
            return SequentialSampler(self.train_dataset)

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            before = {k: len(v) for k, v in self._metrics["train"].items()}
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            losses.append(float((loss[0] if return_outputs else loss).detach()))
            metrics.append({k: v[-1] for k, v in self._metrics["train"].items() if len(v) > before.get(k, 0)})
            return loss

    torch.manual_seed(t.seed)
    model, ref_model = loading.load_model(path, cfg.model), loading.load_model(path, cfg.model)
    with tempfile.TemporaryDirectory() as out:
        args = KTOConfig(**training_args(t, out, steps), max_length=cfg.data.max_seq_len, beta=section.beta,
                         desirable_weight=section.desirable_weight, undesirable_weight=section.undesirable_weight,
                         train_sampling_strategy="sequential", remove_unused_columns=False)
        trainer = InPlanOrder(model=model, ref_model=ref_model, args=args, train_dataset=ordered,
                              processing_class=tokenizer, callbacks=[step_times(times)])
        if float64_clip:
            float64_norms(trainer, [], [], clip_by_them=True)
        trainer.train()
    return losses, metrics, times


def run_trl_distill(cfg, host, steps: int, float64_clip: bool) -> tuple[list[float], list[dict], list[float]]:
    """TRL's ``GKDTrainer`` off-policy (``lmbda`` 0, no sequence-level KD: the dataset's completions, as hfsdp's
    distill) on hfsdp's token ids of the same rows in hfsdp's order, the same student and teacher folders; its loss
    is the divergence alone (hfsdp's ``distill.alpha: 1``) at temperature 1. Logged per step: the gradient norm."""
    import datasets
    import torch
    from torch.utils.data import SequentialSampler
    from transformers import TrainerCallback
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    from hfsdp.builtin.distill.loss import BETA_OF
    from hfsdp.cli import cache_dir
    from hfsdp.model import loading

    t, section = cfg.train, cfg.section("distill")
    path, tokenizer, raw, train_set, order = in_plan_order(cfg, host, steps)
    rows = [{"input_ids": train_set[i]["input_ids"], "labels": train_set[i]["labels"]} for i in order]
    pad = tokenizer.pad_token_id

    def collate(features):  # right-padded as hfsdp pads; labels -100 on the prompt and the padding
        width = max(len(f["input_ids"]) for f in features)
        fill = lambda values, v: [list(x) + [v] * (width - len(x)) for x in values]  # noqa: E731
        ids = [f["input_ids"] for f in features]
        return {"input_ids": torch.tensor(fill(ids, pad)),
                "attention_mask": torch.tensor(fill([[1] * len(x) for x in ids], 0)),
                "labels": torch.tensor(fill([f["labels"] for f in features], -100))}

    losses: list[float] = []
    metrics: list[dict] = []
    times: list[float] = []

    class InPlanOrder(GKDTrainer):
        def _get_train_sampler(self, *unused, **unused_kw):
            return SequentialSampler(self.train_dataset)

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            losses.append(float((loss[0] if return_outputs else loss).detach()))
            return loss

    class GradNorms(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "grad_norm" in logs:
                metrics.append({"grad_norm": float(logs["grad_norm"])})

    torch.manual_seed(t.seed)
    student = loading.load_model(path, cfg.model)
    teacher_cfg = cfg.model.model_copy(update={"name_or_path": section.teacher, "revision": None})
    teacher = loading.load_model(loading.resolve_model_path(section.teacher, cache_dir()), teacher_cfg)
    with tempfile.TemporaryDirectory() as out:
        args = GKDConfig(**training_args(t, out, steps), lmbda=0.0, seq_kd=False, temperature=section.temperature,
                         beta=BETA_OF.get(section.loss, section.beta), max_length=None,
                         remove_unused_columns=False, dataset_kwargs={"skip_prepare_dataset": True})
        trainer = InPlanOrder(model=student, teacher_model=teacher, args=args,
                              train_dataset=datasets.Dataset.from_list(rows), data_collator=collate,
                              processing_class=tokenizer, callbacks=[step_times(times), GradNorms()])
        if float64_clip:
            float64_norms(trainer, [], [], clip_by_them=True)
        trainer.train()
    return losses, metrics, times


def run_trl(objective: str, cfg, host, steps: int, float64_clip: bool) -> tuple[list[float], list[dict], list[float]]:
    import datasets
    import torch
    from torch.utils.data import SequentialSampler

    from hfsdp import IGNORE_INDEX
    from hfsdp.model import loading

    t = cfg.train
    path, tokenizer, raw, train_set, order = in_plan_order(cfg, host, steps)
    ordered = datasets.Dataset.from_list([{**raw[i], "hfsdp_row": i} for i in order])

    def hfsdp_tokens(feature, model=None):
        row = train_set[feature["hfsdp_row"]]
        start = next(k for k, label in enumerate(row["labels"]) if label != IGNORE_INDEX)
        out = {"prompt_input_ids": row["input_ids"][:start], "prompt_attention_mask": [1] * start}
        for side, ids, labels in (("chosen", "input_ids", "labels"),
                                  ("rejected", "rejected_input_ids", "rejected_labels")):
            out |= {f"{side}_input_ids": row[ids], f"{side}_attention_mask": [1] * len(row[ids]),
                    f"{side}_labels": row[labels]}
        return out

    losses: list[float] = []
    metrics: list[dict] = []
    times: list[float] = []
    trainer_cls, config_cls, own_args = trl_trainer(objective, cfg)

    class InPlanOrder(trainer_cls):
        tokenize_row = staticmethod(hfsdp_tokens)

        def _get_train_sampler(self, *unused, **unused_kw):
            return SequentialSampler(self.train_dataset)

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss, logged = super().compute_loss(model, inputs, True, num_items_in_batch)
            losses.append(float(loss.detach()))
            metrics.append(logged)
            return (loss, logged) if return_outputs else loss

    torch.manual_seed(t.seed)
    model = loading.load_model(path, cfg.model)
    with tempfile.TemporaryDirectory() as out:
        args = config_cls(**training_args(cfg.train, out, steps), max_length=cfg.data.max_seq_len,
                          remove_unused_columns=False, **own_args)
        trainer = InPlanOrder(model=model, args=args, train_dataset=ordered, processing_class=tokenizer,
                              callbacks=[step_times(times)])
        if float64_clip:
            float64_norms(trainer, [], [], clip_by_them=True)
        trainer.train()
    return losses, metrics, times


def scale(objective: str, cfg, name: str, logged: dict) -> float:
    """What a difference is relative to, at least: KTO's rewards and KL are differences of log-probs of hundreds
    (float32 sums of other orders differ by about 1e-7 of those), so they are compared relative to the log-probs
    they are differences of (times beta for rewards), not to their own value near 0; else nothing."""
    if objective != "kto" or not name.startswith(("rewards/", "kl")):
        return 0.0
    logps = max((abs(v) for k, v in logged.items() if k.startswith("logps/")), default=0.0)
    return logps * (cfg.section("kto").beta if name.startswith("rewards/") else 1.0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("objective", choices=sorted(PRESETS))
    parser.add_argument("config", nargs="?", help="default: the objective's preset")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--float64-clip", action="store_true",
                        help="TRL clips by the float64 norm of its gradients, as hfsdp (torch's float32 norm, which it "
                             "clips by otherwise, is about 3e-5 off on the real model): compares clipped updates")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()

    from hfsdp.config.files import load_config

    config = args.config or PRESETS[args.objective]
    overrides = [f"train.max_steps={args.steps}", "train.eval_every=null",
                 "train.eval_at_start=false", "train.log_every=1", "train.export_final=false", "data.eval_path=null",
                 *args.overrides]
    cfg, host = load_config(config, overrides)
    if cfg.train.gradient_accumulation_steps != 1 or cfg.fsdp.mixed_precision != "no" or cfg.plugins != [args.objective]:
        raise SystemExit("trl_preference.py compares one process, fp32, full fine-tuning, without gradient "
                         "accumulation")
    if args.objective == "distill" and (cfg.section("distill").alpha != 1 or cfg.section("distill").temperature != 1):
        raise SystemExit("GKDTrainer's loss is the divergence alone at temperature 1: --set distill.alpha=1 "
                         "(and distill.temperature=1)")
    with tempfile.TemporaryDirectory() as out:
        ours = run_hfsdp(config, overrides, Path(out) / "run")
    if args.objective == "reward_model":
        trl_losses, trl_metrics, trl_times = run_trl_reward(cfg, host, args.steps, args.float64_clip)
        names, trainer = REWARD, "RewardTrainer"
    elif args.objective == "kto":
        trl_losses, trl_metrics, trl_times = run_trl_kto(cfg, host, args.steps, args.float64_clip)
        names, trainer = KTO, "KTOTrainer"
    elif args.objective == "distill":
        trl_losses, trl_metrics, trl_times = run_trl_distill(cfg, host, args.steps, args.float64_clip)
        names, trainer = {"grad_norm": "grad_norm"}, "GKDTrainer (lmbda 0)"
    else:
        trl_losses, trl_metrics, trl_times = run_trl(args.objective, cfg, host, args.steps, args.float64_clip)
        names, trainer = {**SHARED, **OWN[args.objective]}, trl_trainer(args.objective, cfg)[0].__name__
        if "nll_loss" not in ours[0]:
            names.pop("nll_loss")
    print(f"\n{args.objective} on {cfg.model.name_or_path} against TRL's {trainer}"
          f", {cfg.train.per_device_batch_size} pairs per step, {cfg.plugin_config.get(args.objective) or {}}, "
          f"lr {cfg.train.learning_rate}, fp32, one process")
    print(f"{'step':>4} {'metric':>16} {'hfsdp':>13} {'TRL':>13} {'rel diff':>9}")
    worst = 0.0
    for step, (m, loss, logged) in enumerate(zip(ours, trl_losses, trl_metrics), start=1):
        # (KTO: a step without desirable, or undesirable, rows logs no chosen, or rejected, metrics on either side)
        shared = [(n, m[n], logged[t]) for n, t in names.items() if n in m or t in logged]
        for name, a, b in [("loss", m["loss"], loss)] + shared:
            rel = abs(a - b) / max(abs(b), scale(args.objective, cfg, name, logged), 1e-12) if a != b else 0.0
            worst = max(worst, rel)
            print(f"{step:>4} {name:>16} {a:>13.7f} {b:>13.7f} {rel:>9.2e}")
    steps = min(len(ours), len(trl_losses))
    print(f"largest relative difference {worst:.2e} (target 1e-5) over {steps} steps, loss and {len(names)} metrics: "
          f"{'MET' if worst <= 1e-5 and steps >= 6 else 'NOT MET'}")
    print(speed(ours, trl_times))


if __name__ == "__main__":
    main()
