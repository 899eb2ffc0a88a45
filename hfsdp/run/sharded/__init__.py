"""The optimizers that need each parameter whole, giving one process's update on FSDP2's sharded parameters
(DTensors): :class:`~hfsdp.run.sharded.muon.WholeMatrixMuon` (torch's Muon), :class:`~hfsdp.run.sharded.adamw_8bit.
ShardedAdamW8bit` (bitsandbytes' AdamW8bit) and :class:`~hfsdp.run.sharded.adafactor.ShardedAdafactor` (torch's
Adafactor). Each module imports its base class, so only the chosen one is imported (bitsandbytes is optional; Muon
needs torch >= 2.9): ``hfsdp.rules.optimizers.CHOICES`` names them, :mod:`hfsdp.run.optimizers` builds them."""
