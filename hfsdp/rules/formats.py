"""What the data's formats need of the enabled plugins, from the config alone: a format some plugin registers, an
objective for the formats that only an objective trains on, and generation eval on a format it can split into a
prompt and a reference answer."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hfsdp.config.schema import HfsdpConfig
    from hfsdp.hooks.host import PluginHost

# The formats that only a plugin's objective trains on: what their rows are, and hfsdp's own plugins that train on them.
OBJECTIVE_FORMATS = {
    "preference": ("preference rows train a preference objective", ("dpo", "orpo", "simpo", "reward_model")),
    "unpaired": ("unpaired rows (a completion labelled desirable or not) train an unpaired preference objective",
                 ("kto",)),
    "prompt": ("prompt rows (without answers) train an objective that generates the completions",
               ("grpo", "rloo", "distill_online")),
}


def problems(config: "HfsdpConfig", plugins: "PluginHost") -> list[tuple[str, str]]:
    formats = plugins.dataset_formats()
    named = [("data.format", config.data.format)] + [(f"data.datasets[{i}].format", s.format)
                                                     for i, s in enumerate(config.data.datasets or []) if s.format]
    out = [(key, f"unknown format '{name}'; known: {', '.join(sorted(formats))}")
           for key, name in named if name not in formats]
    replaced = bool(plugins.implementers("hfsdp_objective"))
    for name, (what, builtin) in OBJECTIVE_FORMATS.items():
        if any(given == name for _, given in named) and not replaced:
            sft = ", or use data.format: chat or instruction for supervised fine-tuning" if name != "unpaired" else ""
            named_plugins = [f"[{p}]" for p in builtin]
            listed = named_plugins[0] if len(builtin) == 1 else f"{', '.join(named_plugins[:-1])} or {named_plugins[-1]}"
            out.append(("data.format", f"{what}: enable one (plugins: {listed}){sft}"))
    generated = config.data.sources()[0].format  # its eval rows (or data.eval_path's, read like them)
    if config.generation_eval is not None and generated not in plugins.generation_prompts():
        splits = sorted(plugins.generation_prompts())
        out.append(("generation_eval", f"needs data.format {' or '.join(splits)} (rows with a prompt and a "
                                       f"reference answer), not '{generated}': remove the section"))
    return out
