"""What lets a model act during GRPO/RLOO rollouts, with no tool code run in the training process: the tool runtime
(:mod:`~hfsdp.builtin.agent.runtime`: the tools and environments a config names, described in a process of their
own into the JSON schemas of the prompts, and :class:`~hfsdp.builtin.agent.runtime.ToolWorkers`, a process per
rollout that resets its environment, runs its tool calls under a time, memory and CPU limit, replays its state after
a crash and reads its reward) and hfsdp's built-in tool and environment ``python`` (:mod:`~hfsdp.builtin.agent.sandbox`:
the model's code run by bubblewrap, with no network, no view of the host's files and no way to outgrow its limits).
Not a plugin: the online objectives' rollouts use it."""
