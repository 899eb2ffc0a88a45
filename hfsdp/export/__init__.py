"""Export: one pipeline from a trained model or a checkpoint to a Hugging Face folder (:mod:`~hfsdp.export.pipeline`),
the safetensors folder writer (:mod:`~hfsdp.export.hf_folder`), the GGUF writer for llama.cpp
(:mod:`~hfsdp.export.gguf_file`), the model card every export gets (:mod:`~hfsdp.export.card`), and staging into
place without losing what was there (:mod:`~hfsdp.export.staging`)."""
