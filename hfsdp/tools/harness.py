"""lm-evaluation-harness on an exported model, sharded over the job's ranks as training shards it (:func:`evaluate`).

Every rank loads the folder and FSDP2 shards its transformer blocks and the rest over all ranks, so a rank keeps
1/N of the weights. lm-eval splits each task's requests over the ranks and pads them to the same count
(its own data-parallel mode); hfsdp keeps the ranks' forwards in lock-step, which FSDP's gathers need: a fixed
batch size, no request grouping (``logits_cache``), and generation that runs until every rank is done
(``synced_gpus``). The results are lm-eval's own, gathered on rank 0.
"""

from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import Any

from hfsdp.errors import UserError
from hfsdp.disk.durable import write_atomic
from hfsdp.disk.lock import put_back_abandoned
from hfsdp.export.card import add_evals
from hfsdp.export.staging import add_to_record
from hfsdp.layout.degrees import World

BUNDLED_TASKS = Path(__file__).with_name("eval_tasks")
INSTALL_HINT = "pip install 'hfsdp[eval]' (lm-eval==0.4.13)"


def model_folder(path: Path) -> Path:
    """The Hugging Face folder to evaluate: ``path`` itself, or a run's ``final/`` export (the run's earlier run put
    back first where a run killed before its first step left it set aside)."""
    for run in (path, path.parent):
        put_back_abandoned(run)
    if (path / "config.json").is_file():
        return path
    if (path / "final" / "config.json").is_file():
        return path / "final"
    for adapters in (path, path / "final"):
        if (adapters / "adapter_config.json").is_file():
            raise UserError(f"{adapters} holds LoRA adapters only; lm-eval needs the whole model: export the run's "
                            "checkpoint again with `hfsdp export CHECKPOINT OUT --merge-lora` and evaluate OUT")
    if not path.exists():
        raise UserError(f"{path} does not exist: give an exported model folder (a run's final/) or a run folder")
    raise UserError(f"{path} is not a model folder (no config.json in it or in its final/): give a run folder or "
                    "what `hfsdp export` wrote")


def task_manager(include_paths: list[Path]):
    """lm-eval's tasks, hfsdp's bundled ones (``contacts_mc``) and those under ``include_paths``."""
    for folder in include_paths:
        if not folder.is_dir():
            raise UserError(f"--include-path {folder}: not a folder (it should hold lm-eval task YAML files)")
    try:
        from lm_eval.tasks import TaskManager
    except ImportError as err:
        raise UserError(f"hfsdp eval runs lm-evaluation-harness, which is not installed: {INSTALL_HINT}") from err
    return TaskManager(include_path=[str(BUNDLED_TASKS), *map(str, include_paths)])


def check_tasks(manager, tasks: list[str]) -> None:
    """Every name is a task, group or tag lm-eval knows (here, offline: its own and the included ones)."""
    known = manager.all_tasks
    for name in tasks:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=3)
            raise UserError(f"--tasks {name}: no such lm-eval task" + (f" (close: {', '.join(close)})" if close else "")
                            + "; a task of your own: --include-path FOLDER with its YAML; bundled: contacts_mc")


def check_task_data(manager, tasks: list[str]) -> None:
    """Every task's documents load here (lm-eval reads them again, from the datasets cache, when it evaluates): a
    task whose data is on the hub, offline, is refused before any weight loads."""
    from lm_eval.tasks import get_task_dict

    try:
        get_task_dict(tasks, manager)
    except Exception as err:  # noqa: BLE001 (datasets' and lm-eval's errors are many; the message says which)
        raise UserError(f"--tasks {','.join(tasks)}: a task's documents could not be loaded ({type(err).__name__}: "
                        f"{str(err)[:300]}). Tasks whose data is on the Hugging Face hub need the network (or "
                        "HF_DATASETS_OFFLINE=1 with the data in its cache); a task of your own reads local files "
                        "(--include-path FOLDER; the bundled contacts_mc does)") from err


def _sharded_lm_class():
    import torch
    import torch.distributed as dist
    from lm_eval.models.huggingface import HFLM

    class ShardedLM(HFLM):
        """lm-eval's HF model on a model already sharded over the process group; the group's rank and size are
        lm-eval's (it splits the requests), its collectives torch.distributed's (no second Accelerator)."""

        def __init__(self, model, tokenizer, world: World, batch_size: int):
            super().__init__(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, logits_cache=False)
            self._rank, self._world_size = world.rank, world.size

        def all_gather(self, tensor):
            if self.world_size <= 1:
                return tensor
            parts = [torch.empty_like(tensor.reshape(-1)) for _ in range(self.world_size)]
            dist.all_gather(parts, tensor.reshape(-1).contiguous())
            return torch.cat(parts)

        def barrier(self):
            if self.world_size > 1:
                dist.barrier()

        def _model_generate(self, context, max_length, stop, **generation_kwargs):
            # a rank whose answers ended keeps stepping until every rank's have: FSDP gathers in each forward
            return super()._model_generate(context, max_length, stop,
                                           **generation_kwargs, synced_gpus=self.world_size > 1)

    return ShardedLM


def join(world: World) -> None:
    """This process into the launcher's group (gloo on CPU, NCCL on GPUs), when there are several."""
    import torch
    import torch.distributed as dist

    if not world.on_cpu:
        torch.cuda.set_device(world.rank % world.local_size)
    if world.size > 1 and not dist.is_initialized():
        dist.init_process_group("gloo" if world.on_cpu else "nccl")


def leave(world: World) -> None:
    import torch.distributed as dist

    if world.size > 1 and dist.is_initialized():
        dist.destroy_process_group()


def load_sharded(folder: Path, world: World):
    """The folder's model as lm-eval's HF backend loads it (``dtype="auto"``), sharded (:func:`shard`); and its
    tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = torch.device("cpu") if world.on_cpu else torch.device("cuda", torch.cuda.current_device())
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype="auto").to(device).eval()
    return shard(model, world), AutoTokenizer.from_pretrained(str(folder))


def shard(model, world: World):
    """``model`` with FSDP2 over every rank when there are several: each transformer block (the model class's
    ``_no_split_modules``, as training wraps them), then the rest."""
    if world.size == 1:
        return model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from hfsdp.model.loading import default_layer_classes

    mesh = init_device_mesh(model.device.type, (world.size,))
    blocks = set(default_layer_classes(model.config))
    for module in model.modules():
        if type(module).__name__ in blocks:
            fully_shard(module, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def evaluate(folder: Path, tasks: list[str], manager, world: World, *, batch_size: int,
             num_fewshot: int | None = None, limit: float | None = None) -> dict[str, Any] | None:
    """lm-eval's ``simple_evaluate`` on the sharded model: its results dict on rank 0 (None elsewhere)."""
    import lm_eval

    model, tokenizer = load_sharded(folder, world)
    lm = _sharded_lm_class()(model, tokenizer, world, batch_size)
    return lm_eval.simple_evaluate(model=lm, tasks=tasks, num_fewshot=num_fewshot, limit=limit,
                                   task_manager=manager, batch_size=batch_size)


def scores(results: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Each task's metrics and their standard errors, by lm-eval's ``metric,filter`` names (``acc,none``)."""
    return {task: {k: v for k, v in values.items() if "," in k and isinstance(v, (int, float))}
            for task, values in results["results"].items()}


def record(folder: Path, results: dict[str, Any], tasks: list[str], world: World) -> list[Path]:
    """What the evaluation found, written beside the model (``eval_results.json``, the model card's evaluation
    section and metadata) and, for a run's ``final/``, into the run's summary.json (``lm_eval``); the export's
    record lists the files it changed as hfsdp's. Returns the files written."""
    entry = {"tasks": tasks, "scores": scores(results), "n_samples": results.get("n-samples", {}),
             "versions": results.get("versions", {}), "n_shot": results.get("n-shot", {}),
             "lm_eval_version": _lm_eval_version(), "ranks": world.size, "model": str(folder)}
    written = [folder / "eval_results.json"]
    write_atomic(written[0], _json(entry))
    card = add_evals(folder, entry)
    add_to_record(folder, [p.name for p in written] + ([card.name] if card else []))
    written += [card] if card else []
    summary = folder.parent / "summary.json"
    if folder.name == "final" and summary.is_file():
        data = json.loads(summary.read_text())
        data["lm_eval"] = entry
        write_atomic(summary, _json(data))
        written.append(summary)
    return written


def _lm_eval_version() -> str:
    from importlib.metadata import version

    return version("lm-eval")


def _json(data: dict[str, Any]) -> str:
    return json.dumps(data, indent=2, default=str) + "\n"
