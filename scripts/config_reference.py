"""Print the configuration reference (Markdown) from the pydantic schema: python scripts/config_reference.py"""

import typing

from pydantic import BaseModel

from hfsdp.config import HfsdpConfig


def _type_name(annotation) -> str:
    text = str(annotation).replace("typing.", "").replace("hfsdp.config.", "")
    return text.replace("<class '", "").replace("'>", "").replace("NoneType", "null")


def section(name: str, model: type[BaseModel]) -> list[str]:
    lines = [f"#### `{name}`", "", "| key | type | default | meaning |", "|---|---|---|---|"]
    for key, field in model.model_fields.items():
        default = "required" if field.is_required() else repr(field.get_default(call_default_factory=True))
        lines.append(f"| `{name}.{key}` | `{_type_name(field.annotation)}` | `{default}` | {field.description or ''} |")
    return lines + [""]


def main() -> None:
    out = []
    for key, field in HfsdpConfig.model_fields.items():
        if key == "plugin_config":
            continue
        annotation = field.annotation
        model = next((a for a in typing.get_args(annotation) if isinstance(a, type) and issubclass(a, BaseModel)),
                     annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None)
        if model is not None:
            out += section(key, model)
        else:
            out += [f"#### `{key}`", "", f"`{_type_name(annotation)}`: {field.description}", ""]
    print("\n".join(out))


if __name__ == "__main__":
    main()
