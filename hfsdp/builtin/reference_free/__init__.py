"""What ORPO and SimPO share (plugins ``orpo`` and ``simpo``), preference objectives without a reference model: one
forward of the chosen and rejected rows gives each completion's per-token average log-prob, and the chosen rows' NLL
a token mean over the global batch (its tokens counted over the ranks); each objective adds its own term. Not a
plugin: the objectives and their losses are :mod:`hfsdp.builtin.reference_free.loss` (with torch, imported when a
run trains).
"""
