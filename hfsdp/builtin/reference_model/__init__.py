"""The reference model of the objectives that pull towards one (DPO, KTO): which route a section asks for, torch-free
(``adapter``: the base with the LoRA adapters disabled; ``precomputed``: log-probs computed once before training and
cached), and the route without lora refused. The routes themselves, with torch:
:class:`~hfsdp.builtin.reference_model.routes.ReferenceRoutes`.
"""

from __future__ import annotations


def reference_route(config, plugin: str = "dpo") -> str:
    """The reference route of ``plugin``'s section (its ``reference``; DPO's, KTO's): adapter with lora, else
    precomputed, unless the section names one."""
    return config.section(plugin).reference or ("adapter" if "lora" in config.plugins else "precomputed")


def reference_problems(config, plugin: str = "dpo") -> list[tuple[str, str]]:
    """The adapter route without lora (``plugin``'s section's ``reference``)."""
    if config.section(plugin).reference == "adapter" and "lora" not in config.plugins:
        return [(f"{plugin}.reference", "adapter: the reference is the base model with the LoRA adapters disabled, "
                                        "but lora is not enabled; add lora to plugins, or use reference: precomputed "
                                        "(full fine-tuning)")]
    return []
