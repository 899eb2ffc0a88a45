"""The reward model of plugin ``reward_model``: the causal LM turned into its architecture's
``*ForSequenceClassification`` model (:func:`sequence_classifier`) and exported as a folder that
``AutoModelForSequenceClassification.from_pretrained`` loads (:func:`write_reward_model`)."""

from __future__ import annotations

import copy
from pathlib import Path

import torch


def reward_config(model_config, pad_token_id: int | None):
    """The sequence-classification config of the causal LM's ``model_config``: one output, its pad token (where
    transformers' pooling finds each sequence's last token), the architecture named."""
    from transformers import AutoModelForSequenceClassification

    config = copy.deepcopy(model_config)
    config.num_labels = 1
    if pad_token_id is not None:
        config.get_text_config().pad_token_id = pad_token_id
    cls = AutoModelForSequenceClassification._model_mapping.get(type(config), None)
    if cls is None:
        from hfsdp.errors import UserError

        raise UserError(f"reward_model: transformers has no sequence-classification model for "
                        f"{type(config).__name__} ('{config.model_type}')")
    config.architectures = [cls.__name__]
    return config, cls


def sequence_classifier(causal, pad_token_id: int | None, seed: int):
    """The ``*ForSequenceClassification`` model over ``causal``'s base model (its own modules, no copy) with a new
    one-output head, initialised as transformers initialises it (normal, std ``initializer_range``) from ``seed``:
    every rank, and a resumed run before its checkpoint loads, builds the same head. On the meta device (``hfsdp
    plan``, the start-up estimate) the head stays there."""
    config, cls = reward_config(causal.config, pad_token_id if pad_token_id is not None else
                                causal.config.get_text_config().pad_token_id)
    dtype = next(p.dtype for p in causal.parameters() if p.is_floating_point())
    with torch.device("meta"):
        model = cls(config).to(dtype)
    prefix = model.base_model_prefix
    base = getattr(causal, causal.base_model_prefix)
    setattr(model, prefix, base)
    device = next(base.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    std = getattr(config.get_text_config(), "initializer_range", 0.02)
    for name, head in model.named_children():
        if name == prefix:
            continue
        head.to_empty(device=device)
        if device.type == "meta":
            continue
        with torch.no_grad():
            for pname, param in sorted(head.named_parameters()):
                if param.dim() > 1:
                    param.copy_(torch.empty(param.shape, dtype=torch.float32).normal_(0.0, std, generator=generator))
                else:
                    param.zero_()
    model.train(causal.training)
    return model


def write_reward_model(state_dict, model_config, tokenizer, out_dir, *, max_shard_bytes=None) -> Path:
    """The trained reward model as a Hugging Face folder: its weights (the causal LM's base and the head), checked
    against the sequence-classification architecture's shapes, its config and the tokenizer."""
    from hfsdp.export.hf_folder import write_hf_weights

    out_dir = Path(out_dir)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id  # as training
    config, cls = reward_config(model_config, pad_id)
    with torch.device("meta"):
        expected = {name: tuple(t.shape) for name, t in cls(config).state_dict().items()}
    write_hf_weights(state_dict.items(), out_dir, expected=expected, max_shard_bytes=max_shard_bytes)
    config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir
