"""The model: built-in models, loading (:mod:`~hfsdp.model.loading`), the files beside its weights
(:mod:`~hfsdp.model.metadata`), its token loss, plain or chunked through the output head
(:mod:`~hfsdp.model.token_loss`), and the 4-bit base of QLoRA with torch (:mod:`~hfsdp.model.quantized`; its
torch-free rules are :mod:`hfsdp.rules.quantization`)."""
