"""Checkpoints of the concept-bottleneck LM: exact resume without pickle.

    OUT/checkpoint/model.safetensors       weights
    OUT/checkpoint/optimizer.safetensors   AdamW moments and step counts, keyed "<param index>.<name>"
    OUT/checkpoint/state.json              step, model and training config, vocabulary (cl100k id of each model id)

A checkpoint is written into ``OUT/.checkpoint-tmp`` and swapped in by renames, so ``OUT/checkpoint`` is always a
whole checkpoint (after a kill between the two renames, ``OUT/checkpoint.old`` is the whole previous one, and
``load`` takes it). The data position needs no saving: a step's batch and random draws are functions of
(seed, step), see ``TokenData.train_batch`` and the training loop.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from atlas.cblm.model import CBLM, ModelConfig

CHECKPOINT = "checkpoint"


def save(out: Path, model: CBLM, optimizer: torch.optim.Optimizer | None, state: dict) -> None:
    tmp, final, old = out / ".checkpoint-tmp", out / CHECKPOINT, out / f"{CHECKPOINT}.old"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}, tmp / "model.safetensors")
    if optimizer is not None:
        tensors = {}
        for index, param_state in optimizer.state_dict()["state"].items():
            for name, value in param_state.items():
                tensors[f"{index}.{name}"] = torch.as_tensor(value).detach().contiguous().cpu()
        save_file(tensors, tmp / "optimizer.safetensors")
    (tmp / "state.json").write_text(json.dumps(state))
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)


def find(out: Path) -> Path | None:
    """The folder of the newest whole checkpoint under ``out``, or None."""
    for folder in (out / CHECKPOINT, out / f"{CHECKPOINT}.old"):
        if (folder / "state.json").exists():
            return folder
    return None


def load(folder: Path, device: str = "cpu") -> tuple[CBLM, dict]:
    """The model (in eval mode) and the state saved with it; ``folder`` is a run's OUT or its checkpoint folder."""
    found = find(folder) or (folder if (folder / "state.json").exists() else None)
    if found is None:
        raise FileNotFoundError(f"{folder}: no checkpoint (expected {folder / CHECKPOINT}/state.json)")
    state = json.loads((found / "state.json").read_text())
    model = CBLM(ModelConfig(**state["model_config"]))
    weights = load_file(found / "model.safetensors", device=device)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if missing or unexpected:
        raise ValueError(f"{found / 'model.safetensors'}: weights do not match the saved model config "
                         f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    return model.to(device).eval(), state


def load_optimizer(folder: Path, optimizer: torch.optim.Optimizer, device: str = "cpu") -> None:
    """Restore AdamW's moments and step counts into ``optimizer`` (built over the same parameters)."""
    path = folder / "optimizer.safetensors"
    tensors = load_file(path, device=device) if path.exists() else {}
    state: dict[int, dict] = {}
    for key, value in tensors.items():
        index, name = key.split(".", 1)
        state.setdefault(int(index), {})[name] = value.cpu() if name == "step" else value
    optimizer.load_state_dict({"state": state, "param_groups": optimizer.state_dict()["param_groups"]})
