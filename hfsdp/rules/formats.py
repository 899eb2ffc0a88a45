"""What the data's formats need of the enabled plugins, from the config alone: a format some plugin registers, an
objective for the formats that only an objective trains on (as their plugins declare them; the plugins to enable are
those whose objective declares it trains on the format), and generation eval on a format it can split into a prompt
and a reference answer."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hfsdp.hooks.host import installed_trainers

if TYPE_CHECKING:
    from hfsdp.config.schema import HfsdpConfig
    from hfsdp.hooks.host import PluginHost

def problems(config: "HfsdpConfig", plugins: "PluginHost") -> list[tuple[str, str]]:
    formats = plugins.dataset_formats()
    named = [("data.format", config.data.format)] + [(f"data.datasets[{i}].format", s.format)
                                                     for i, s in enumerate(config.data.datasets or []) if s.format]
    out = [(key, f"unknown format '{name}'; known: {', '.join(sorted(formats))}")
           for key, name in named if name not in formats]
    replaced = bool(plugins.implementers("hfsdp_objective"))
    for name, (_, refusal) in plugins.objective_formats().items():
        if any(given == name for _, given in named) and not replaced:
            trainers = [f"[{p}]" for p in installed_trainers(name)]
            listed = (f"{', '.join(trainers[:-1])} or {trainers[-1]}" if len(trainers) > 1 else "".join(trainers)
                      or "none is installed")
            out.append(("data.format", refusal.format(plugins=f"plugins: {listed}")))
    generated = config.data.sources()[0].format  # its eval rows (or data.eval_path's, read like them)
    if config.generation_eval is not None and generated not in plugins.generation_prompts():
        splits = sorted(plugins.generation_prompts())
        out.append(("generation_eval", f"needs data.format {' or '.join(splits)} (rows with a prompt and a "
                                       f"reference answer), not '{generated}': remove the section"))
    return out
