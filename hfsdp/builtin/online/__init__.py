"""What the online objectives share, GRPO's and the ones beside it: their section's common keys
(:mod:`~hfsdp.builtin.online.schema`), the reward functions resolved torch-free with what such an objective needs of
the config (:mod:`~hfsdp.builtin.online.rewards`), and the sampler: seeded rounds of completions, scored and kept in a
checkpointed buffer, the reward eval and the completions log (:mod:`~hfsdp.builtin.online.sampler`). Not a plugin:
a plugin's objective subclasses :class:`~hfsdp.builtin.online.sampler.OnlineObjective` and says how rewards become
advantages and what its loss is."""
