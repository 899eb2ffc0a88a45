"""``hfsdp plan``: the model's facts (:mod:`~hfsdp.tools.plan.facts`), the traced activations
(:mod:`~hfsdp.tools.plan.trace`), the torch-free byte arithmetic per rank (:mod:`~hfsdp.tools.plan.estimate`), the
planner over setups and changes (:mod:`~hfsdp.tools.plan.planner`) and its table (:mod:`~hfsdp.tools.plan.table`)."""
