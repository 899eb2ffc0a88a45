"""Data: raw rows to tokenized datasets through the format hooks (:mod:`~hfsdp.data.prepare`), the per-node
preprocessing cache (:mod:`~hfsdp.data.cache`), and mixtures, the batch plan and collation
(:mod:`~hfsdp.data.batches`)."""
