"""Data: raw rows to tokenized datasets through the format hooks (:mod:`~hfsdp.data.prepare`; a file that cannot be
read named with its line and what is wrong there, :mod:`~hfsdp.data.broken_rows`), the per-node preprocessing cache
(:mod:`~hfsdp.data.cache`), and mixtures, the batch plan and collation (:mod:`~hfsdp.data.batches`)."""
