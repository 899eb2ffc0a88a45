"""The model: built-in models, loading (:mod:`~hfsdp.model.loading`) and the 4-bit base of QLoRA with torch
(:mod:`~hfsdp.model.quantized`; its torch-free rules are :mod:`hfsdp.rules.quantization`)."""
