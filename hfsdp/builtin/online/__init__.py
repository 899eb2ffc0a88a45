"""What the online objectives share, GRPO's and the ones beside it: their section's common keys
(:mod:`~hfsdp.builtin.online.schema`), the reward functions resolved torch-free with what such an objective needs of
the config (:mod:`~hfsdp.builtin.online.rewards`), and, with torch, a round at a time: the group plan, which prompts
each rank samples with which seeds (:mod:`~hfsdp.builtin.online.groups`), the sampling
(:mod:`~hfsdp.builtin.online.sampling`), the scoring (:mod:`~hfsdp.builtin.online.scoring`), the round's checkpointed
buffer, its micro-batches and the completions log (:mod:`~hfsdp.builtin.online.rounds`), and the base class that runs
them (:mod:`~hfsdp.builtin.online.objective`). Not a plugin: a plugin's objective subclasses
:class:`~hfsdp.builtin.online.objective.OnlineObjective` and says, through the override points its docstring lists,
how rewards become advantages and what its loss is."""
