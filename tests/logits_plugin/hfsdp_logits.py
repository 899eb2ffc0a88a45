"""Test-only hfsdp plugin: at the end of training, the trained model's logits on fixed token ids, saved by rank 0
as ``<output_dir>/trained_logits.pt`` (every rank runs the forward: under FSDP it is collective).

Enable it with ``plugins: [hfsdp_logits]`` and this folder on PYTHONPATH. :data:`IDS` are the ids the test feeds
the exported model.
"""

import torch

from hfsdp import hookimpl

__version__ = "0.0.1"
IDS = torch.arange(1, 17).reshape(2, 8) * 997 % 49152


@hookimpl
def hfsdp_on_train_end(run, metrics):
    from hfsdp.data.batches import reshard

    model = run.model
    was_training = model.training
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=IDS.to(run.accelerator.device)).logits.float().cpu()
    model.train(was_training)
    reshard(model)
    if run.is_main_process:
        torch.save(logits, run.output_dir / "trained_logits.pt")
