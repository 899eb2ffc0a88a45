"""The decided run, torch-free: where each process is and the parallel degrees (:mod:`~hfsdp.setup.degrees`), a
checkpoint's record and the resume point (:mod:`~hfsdp.setup.record`), and :func:`~hfsdp.setup.decide.decide`,
which makes them one :class:`~hfsdp.setup.decide.RunSetup` before any weight loads."""
