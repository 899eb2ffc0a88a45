"""hfsdp's RLOO against TRL's ``RLOOTrainer``, step by step, on the same completions (issue 52): the comparison of
benchmarks/trl_grpo.py (read its docstring) on a config whose objective is ``rloo``, the ``rloo`` preset by default.

    python benchmarks/trl_rloo.py [CONFIG] --steps 4 [--set KEY=VALUE ...]
    python benchmarks/trl_rloo.py [CONFIG] --speed --steps 6 --rounds 3 [--set KEY=VALUE ...]

``--set model.name_or_path=smollm2-tiny`` runs it in seconds; ``--set "plugins=[rloo, lora]"`` compares LoRA with the
KL penalty (TRL's default beta 0.05 with lora). Needs TRL: ``pip install -e '.[bench]'``.
"""

from __future__ import annotations

from trl_grpo import main  # benchmarks/, next to this file

if __name__ == "__main__":
    main("rloo")
