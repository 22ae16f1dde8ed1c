"""Train a concept-bottleneck LM on a run's token shards: ``atlas cblm train RUN``.

nanoGPT-style: the whole training loop is ``train`` below, read top to bottom. It writes ``RUN/cblm/<name>/``:

    checkpoint/     weights, optimizer and state (see ``checkpoint.py``); a rerun resumes from it exactly
    log.jsonl       one line per evaluation: step, learning rate, teacher forcing, train and validation metrics;
                    a resume cuts it back to the checkpoint's step, so a step trained again is logged once
    metrics.json    the final validation metrics (``metrics.evaluate``)
    _lock           while a process trains the model (``atlas.core.lock``): a second trainer of it is refused

Schedules (``seeds/NOTES.md`` 1.8-1.9), as functions of the step so a resumed run follows them exactly:

- learning rate: warmup-stable-decay, warmup min(2000 steps, ``warmup_frac``), linear decay to 0 over the last
  ``decay_frac`` of the steps;
- teacher forcing, convention: alpha is the probability that a position uses the ground truth (the true concepts'
  k_hat, and for the unknown part h - true k_hat) instead of the model's prediction. alpha_known goes 1 -> floor with
  a cosine and alpha_unknown 1 -> floor linearly over the first ``alpha_warm_frac`` of the steps; both stay at the
  floor (0.5) and anneal linearly to 0 during the learning-rate decay, so training ends as evaluation runs: with no
  teacher forcing (the true labels of a chunk would leak its future tokens);
- steering training (``steering``, paper 10.2.4): ``steering_phases`` phases of ``steering_phase_frac`` of the steps,
  front-loaded between the teacher-forcing warm-up and the decay, train L_LM + L_respond + L_express with concepts
  injected at their tokens (``losses.compute_steering``) instead of the usual losses.

Where the recipe leaves the paper, and why (measured in the issue that built it; README "The concept-bottleneck LM"):
the paper's OR-aggregated concept loss is met by one active token per chunk, so it trains k_t ~ 1/chunk length and the
known part k_hat = k K is ~1% of what teacher forcing feeds; nothing else ties K to words, since the unknown head
reconstructs whatever h - k_hat_GT is. So the concept loss is per token (``concept_aggregation="token"``), the known
readout (``lambda_known``) makes W K_c the log-lift of c's words, and K, like every embedding, is not weight-decayed.
Once K carries words, the unknown head must subtract them from h, which it did only with the reconstruction loss
at the paper's scale (summed over d, Eq. 11; it was divided by d); otherwise the residual eps took a third of h.

Dropout, diffusion masks and teacher-forcing draws are seeded from (seed, step), and a step's batch comes from
``TokenData.train_batch(step)``: an interrupted and resumed run reaches the same weights as an uninterrupted one
(on as many threads; no step uses a kernel whose sums follow thread timing, see ``losses.compute_steering``).
"""

from __future__ import annotations

import difflib
import fnmatch
import json
import logging
import math
import os
import re
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
from safetensors.torch import load_file

from atlas.cblm import checkpoint
from atlas.cblm.data import SteeringData, TokenData
from atlas.cblm.losses import compute, compute_steering
from atlas.cblm.metrics import evaluate
from atlas.cblm.model import CBLM, ModelConfig, injection_layer
from atlas.core.files import InputError
from atlas.core.lock import LOCK_NAME, run_lock
from atlas.core.ownership import NotOwned, foreign_files, require_owned
from atlas.models.tokenizer import MASK

logger = logging.getLogger("atlas.cblm.train")  # steps, losses, resumes: `atlas cblm train` prints them


@dataclass
class TrainConfig:
    run_dir: str = ""
    name: str = "cblm"  # output folder: RUN/cblm/<name>
    # the head on the backbone: "concepts" (the concept bottleneck), "prism" (PRISM prototypes, prism.py) or "none"
    # (the baseline: the same backbone and budget, plain logits)
    head: str = "concepts"
    # model
    objective: str = "ar"  # "ar" | "diffusion"
    mixer: str = "attention"  # "attention" | "prototype" (the ProtoT mixer, mixer.py; AR only)
    mixer_channels: int = 32
    rope: str = "standard"  # "standard" | "pi" (signal/noise head pairs)
    prototypes: int = 256  # head=prism: K prototypes, top-k routed
    prototype_topk: int = 16
    seq_len: int = 128
    n_layer: int = 2
    n_head: int = 4
    d_model: int = 64
    block_size: int = 32
    unknown_ratio: int = 3
    unknown_rank: int = 32
    topk_known: int = 0
    # residual dropout: 0.7, not the paper's 0.3 (its scaling runs; 0.1 at 8B). On the cpu preset of bench_cblm, 0.3
    # left the known concepts 15% of the concept contribution (0.79 in all); 0.7 gives 27% (0.88) and steers better
    p_eps: float = 0.7
    p_known_drop: float = 0.1
    compact_vocab: bool = True
    # optimization
    max_steps: int = 300
    batch_size: int = 8
    lr: float = 3e-3
    warmup_frac: float = 0.02
    decay_frac: float = 0.2
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    # concept losses and teacher forcing
    lambda_concept: float = 1.0
    lambda_rec: float = 1.0
    lambda_indep: float = 1.0
    # head=prism: the weight of L_R1 + L_R2 + L_RES. The source's is 1 (GPT-2 widths, one epoch of 10B tokens); on the
    # cpu preset of bench_cblm (d 128, 600 steps) 1 cost +10.6% validation loss over the baseline, 0.1 +0.9%
    lambda_prism: float = 0.1
    # head=prism: the weight of the diversity loss L_DIV, optional in the source; without it, 150 of 256 prototypes sat
    # on the same end-of-chunk state (cpu preset, 600 steps); with it, no name is shared by more than 9
    lambda_div: float = 1.0
    concept_aggregation: str = "token"  # "token" | "or" (the paper's): how the concept loss reads a chunk's labels
    lambda_known: float = 1.0  # the known readout (losses.known_readout_loss): W K_c learns c's words' log-lift
    alpha_floor_known: float = 0.5
    alpha_floor_unknown: float = 0.5
    alpha_warm_frac: float = 0.1
    # steering training (paper 10.2.4): phases of L_LM + L_respond + L_express with concept injection
    steering: bool = True
    steering_phases: int = 4
    steering_phase_frac: float = 0.05  # each phase's share of max_steps
    steering_tau: float = 4.0  # injected strength tau (gamma_c = tau / peak_c), as `atlas cblm generate --strength`
    steering_lifted: int = 50  # |T_c|: the lifted tokens a concept's steering should express
    steer_layer: int = -1  # L_inj (-1: n_layer // 2)
    lambda_respond: float = 1.0
    lambda_express: float = 1.0
    # data, evaluation, bookkeeping
    val_fraction: float = 0.1
    eval_every: int = 100
    eval_batches: int = 8
    checkpoint_every: int = 100
    log_every: int = 20
    seed: int = 0
    device: str = "cpu"

    def model_config(self, data: TokenData) -> ModelConfig:
        return ModelConfig(
            vocab_size=data.vocab_size, n_concepts=data.n_concepts if self.head == "concepts" else 0,
            prototypes=self.prototypes if self.head == "prism" else 0, prototype_topk=self.prototype_topk,
            mixer=self.mixer, mixer_channels=self.mixer_channels, rope=self.rope, seq_len=self.seq_len,
            n_layer=self.n_layer, n_head=self.n_head, d_model=self.d_model, objective=self.objective,
            block_size=self.block_size, mask_id=data.model_id(MASK), unknown_ratio=self.unknown_ratio,
            unknown_rank=self.unknown_rank, topk_known=self.topk_known, p_eps=self.p_eps,
            p_known_drop=self.p_known_drop, steer_layer=self.steer_layer,
            concept_aggregation=self.concept_aggregation,
        )

    @classmethod
    def from_overrides(cls, run_dir: str, overrides: list[str]) -> TrainConfig:
        """``key=value`` strings, typed by the field they set: ``["d_model=128", "objective=diffusion"]``; checked
        (``check``) before it is returned. ``SettingError`` names the first wrong one."""
        config, types = cls(run_dir=run_dir), {f.name: f.type for f in fields(cls)}
        for item in overrides:
            key, sep, value = item.partition("=")
            if not sep:
                raise SettingError(f"--set {item!r}: expected KEY=VALUE")
            if key not in types:
                nearest = difflib.get_close_matches(key, list(types), n=1, cutoff=0.0)
                raise SettingError(f"--set {item!r}: no setting {key!r}; the nearest is {nearest[0]!r} (the settings "
                                   "are the fields of TrainConfig in atlas/cblm/train.py)")
            setattr(config, key, _parse(key, value, types[key]))
        config.check()
        return config

    def check(self) -> None:
        """``SettingError`` for the first setting out of its range (``RANGES``, ``CHOICES``) or at odds with
        another, so that a wrong setting is refused before a model folder is written or deleted."""
        types = {f.name: f.type for f in fields(self)}
        for key, (least, most, low_open, high_open) in RANGES.items():
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int if types[key] == "int" else int | float):
                raise SettingError(f"{key}={value!r}: expected {'an integer' if types[key] == 'int' else 'a number'}")
            below = value < least if not low_open else value <= least
            above = most is not None and (value > most if not high_open else value >= most)
            if not math.isfinite(value) or below or above:
                bounds = _describe_range(least, most, low_open, high_open)
                raise SettingError(f"{key}={value!r}: {key} must be {bounds}")
        for key, allowed in CHOICES.items():
            if getattr(self, key) not in allowed:
                raise SettingError(f"{key}={getattr(self, key)!r}: expected one of {', '.join(allowed)}")
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", self.name) or ".." in self.name:
            # the name is a folder under RUN/cblm/: "../x" or "/x" must not write outside the run
            raise SettingError(f"name={self.name!r}: use letters, digits, '_', '-' and '.' only "
                               "(it names RUN/cblm/<name>)")
        if self.d_model % self.n_head or (self.d_model // self.n_head) % 2:
            raise SettingError(f"d_model={self.d_model}, n_head={self.n_head}: d_model must be n_head times an even "
                               "head size (RoPE rotates pairs of coordinates)")
        if self.rope == "pi" and self.n_head % 2:
            raise SettingError(f"rope=pi pairs signal and noise heads: n_head must be even, not {self.n_head}")
        if self.mixer == "prototype" and self.objective != "ar":
            raise SettingError("mixer=prototype is strictly causal: it trains with objective=ar only")
        if self.steer_layer >= self.n_layer:
            raise SettingError(f"steer_layer={self.steer_layer}: the model has layers 0-{self.n_layer - 1} "
                               "(-1: n_layer // 2)")
        if self.head == "concepts":
            try:
                steering_phases(self)
            except ValueError as e:
                raise SettingError(str(e)) from None


class SettingError(InputError):
    """A training setting that is unknown, of the wrong type or out of its range (one line, naming it)."""


def _parse(key: str, value: str, kind: str):
    """``value`` of ``--set key=value`` as the type of the setting."""
    if kind == "bool":
        if value.lower() not in BOOLEANS:
            raise SettingError(f"--set {key}={value}: expected true or false")
        return BOOLEANS[value.lower()]
    try:
        return {"int": int, "float": float}.get(kind, str)(value)
    except ValueError:
        raise SettingError(f"--set {key}={value}: expected {'an integer' if kind == 'int' else 'a number'}") from None


def _describe_range(least: float, most: float | None, low_open: bool, high_open: bool) -> str:
    if most is None:
        return f"{'>' if low_open else '>='} {least:g}"
    return f"in {'(' if low_open else '['}{least:g}, {most:g}{')' if high_open else ']'}"


BOOLEANS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}
# Every numeric setting's range: (least, most or None for no bound, least excluded, most excluded). Values outside
# make a run fail or loop later (batch_size=0, checkpoint_every=0), after --force would have deleted the old model.
_AT_LEAST_1, _AT_LEAST_0, _POSITIVE = (1, None, False, False), (0, None, False, False), (0, None, True, False)
_FRACTION, _BELOW_1 = (0, 1, False, False), (0, 1, False, True)
RANGES: dict[str, tuple[float, float | None, bool, bool]] = {
    "mixer_channels": _AT_LEAST_1, "prototypes": _AT_LEAST_1, "prototype_topk": _AT_LEAST_1,
    "seq_len": _AT_LEAST_1, "n_layer": _AT_LEAST_1, "n_head": _AT_LEAST_1, "d_model": (2, None, False, False),
    "block_size": _AT_LEAST_1, "unknown_ratio": _AT_LEAST_1, "unknown_rank": _AT_LEAST_1, "topk_known": _AT_LEAST_0,
    "p_eps": _FRACTION, "p_known_drop": _FRACTION,
    "max_steps": _AT_LEAST_1, "batch_size": _AT_LEAST_1, "lr": _POSITIVE, "warmup_frac": _FRACTION,
    "decay_frac": _FRACTION, "weight_decay": _AT_LEAST_0, "beta1": _BELOW_1, "beta2": _BELOW_1,
    "grad_clip": _POSITIVE,
    "lambda_concept": _AT_LEAST_0, "lambda_rec": _AT_LEAST_0, "lambda_indep": _AT_LEAST_0,
    "lambda_prism": _AT_LEAST_0, "lambda_div": _AT_LEAST_0, "lambda_known": _AT_LEAST_0,
    "alpha_floor_known": _FRACTION, "alpha_floor_unknown": _FRACTION, "alpha_warm_frac": _FRACTION,
    "steering_phases": _AT_LEAST_0, "steering_phase_frac": _FRACTION, "steering_tau": _AT_LEAST_0,
    "steering_lifted": _AT_LEAST_1, "steer_layer": (-1, None, False, False),
    "lambda_respond": _AT_LEAST_0, "lambda_express": _AT_LEAST_0,
    "val_fraction": _BELOW_1, "eval_every": _AT_LEAST_1, "eval_batches": _AT_LEAST_1,
    "checkpoint_every": _AT_LEAST_1, "log_every": _AT_LEAST_1, "seed": _AT_LEAST_0,
}
CHOICES = {"head": ("concepts", "prism", "none"), "objective": ("ar", "diffusion"),
           "mixer": ("attention", "prototype"), "rope": ("standard", "pi"), "concept_aggregation": ("token", "or")}


def lr_at(step: int, config: TrainConfig) -> float:
    warmup = max(1, min(2000, int(config.warmup_frac * config.max_steps)))
    decay_start = int((1 - config.decay_frac) * config.max_steps)
    if step < warmup:
        return config.lr * (step + 1) / warmup
    if step < decay_start:
        return config.lr
    return config.lr * max(0.0, (config.max_steps - step) / max(1, config.max_steps - decay_start))


def alphas_at(step: int, config: TrainConfig) -> tuple[float, float]:
    """(alpha_known, alpha_unknown) at ``step``: the probability of teacher forcing each part."""
    warm = max(1, int(config.alpha_warm_frac * config.max_steps))
    decay_start = int((1 - config.decay_frac) * config.max_steps)
    floor_k, floor_u = config.alpha_floor_known, config.alpha_floor_unknown
    if step < warm:
        progress = step / warm
        return floor_k + (1 - floor_k) * 0.5 * (1 + math.cos(math.pi * progress)), 1 - (1 - floor_u) * progress
    if step < decay_start:
        return floor_k, floor_u
    remaining = max(0.0, (config.max_steps - step) / max(1, config.max_steps - decay_start))
    return floor_k * remaining, floor_u * remaining


def steering_phases(config: TrainConfig) -> list[tuple[int, int]]:
    """[(first, end)) step ranges of the steering phases: after the teacher-forcing warm-up (the concept heads
    exist by then) and before the learning-rate decay, front-loaded as in the paper's Fig. 30 (phase i starts at
    warm + (i / phases)^2 of the stable span). Empty unless ``config.steering``, and for a run too short to hold
    one-step phases there (a smoke test)."""
    if not config.steering or config.steering_phases <= 0:
        return []
    warm = max(1, int(config.alpha_warm_frac * config.max_steps))
    decay_start = int((1 - config.decay_frac) * config.max_steps)
    length = max(1, int(config.steering_phase_frac * config.max_steps))
    if config.steering_phases * length > decay_start - warm:
        if length == 1:
            return []
        raise ValueError(f"steering: {config.steering_phases} phase(s) of {length} steps do not fit between the "
                         f"warm-up (step {warm}) and the decay (step {decay_start}); lower steering_phase_frac")
    span = decay_start - warm - length
    starts = [warm + int(span * (i / config.steering_phases) ** 2) for i in range(config.steering_phases)]
    phases = []
    for start in starts:  # front-loading can make early phases touch: keep them apart, in order
        start = max(start, phases[-1][1] if phases else start)
        phases.append((start, start + length))
    return phases


def in_steering_phase(step: int, phases: list[tuple[int, int]]) -> bool:
    return any(first <= step < end for first, end in phases)


CONCEPT_EMBEDDINGS = ("concepts.known_emb", "concepts.unknown_a", "concepts.unknown_b")


def configure_optimizer(model: CBLM, config: TrainConfig) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices except the embeddings (the paper excludes them): the token embedding and the
    concept embeddings K and U = A B."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        embedding = name == "tok_emb.weight" or name in CONCEPT_EMBEDDINGS
        (decay if p.dim() >= 2 and not embedding else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=config.lr, betas=(config.beta1, config.beta2))


def model_folder(config: TrainConfig) -> Path:
    return Path(config.run_dir) / "cblm" / config.name


HEADS = {
    "concepts": lambda mc, n: f"concept module {n:,} for {mc.n_concepts} concepts",
    "prism": lambda mc, n: f"PRISM head {n:,} for {mc.prototypes} prototypes (top {mc.prototype_topk})",
    "none": lambda mc, n: "no head: the baseline",
}
# settings added after models were saved, whose defaults train exactly what those models were trained with
ADDED_SETTINGS = {"mixer": "attention", "mixer_channels": 32, "rope": "standard"}
# settings that only one head (or the ProtoT mixer) reads: the others train the same model whatever their value
ONLY_FOR = {
    "concepts": ("unknown_ratio", "unknown_rank", "topk_known", "p_eps", "p_known_drop", "lambda_concept",
                 "lambda_rec", "lambda_indep", "concept_aggregation", "lambda_known", "alpha_floor_known",
                 "alpha_floor_unknown", "alpha_warm_frac", "steering", "steering_phases", "steering_phase_frac",
                 "steering_tau", "steering_lifted", "steer_layer", "lambda_respond", "lambda_express"),
    "prism": ("prototypes", "prototype_topk", "lambda_prism", "lambda_div"),
    "prototype": ("mixer_channels",),
}


def changed_settings(saved: dict, config: TrainConfig) -> dict:
    """{setting: (saved, now)} for the settings that differ, leaving out those the model does not read (a baseline
    trained with p_eps 0.3 is the model p_eps 0.7 would train). run_dir is not compared: the model lives in
    RUN/cblm/<name>, so `runs/demo` and `/abs/path/runs/demo` name the same run."""
    saved = {**ADDED_SETTINGS, **saved}
    if "concepts" in saved:  # saved when the head was a boolean `concepts`
        saved["head"] = "concepts" if saved.pop("concepts") else "none"
    now = asdict(config)
    unread = {k for owner, keys in ONLY_FOR.items() if owner not in (config.head, config.mixer) for k in keys}
    return {k: (saved.get(k), v) for k, v in now.items()
            if k != "run_dir" and k not in unread and saved.get(k) != v}


def trained_metrics(config: TrainConfig) -> dict | None:
    """The final metrics (metrics.json) of a model already trained with exactly ``config`` to its last step, or
    None when there is training (or the final evaluation) left to do."""
    out = model_folder(config)
    found = checkpoint.find(out)
    if found is None or not (out / "metrics.json").exists():
        return None
    saved = json.loads((found / "state.json").read_text())
    if changed_settings(saved["train_config"], config) or saved["step"] < config.max_steps:
        return None
    return json.loads((out / "metrics.json").read_text())


# What the cblm commands write into RUN/cblm/<name> (fnmatch patterns of paths in it): training, then eval
# --diagnostics, tda and prototypes. Anything else there is the user's, and a restart that would delete it is refused.
TRAINED = ("checkpoint/model.safetensors", "checkpoint/optimizer.safetensors", "checkpoint/state.json",
           "checkpoint.old/model.safetensors", "checkpoint.old/optimizer.safetensors", "checkpoint.old/state.json",
           "log.jsonl", "metrics.json")
WRITTEN = (*TRAINED, LOCK_NAME, "diagnostics.json", "transducer/transducer.safetensors", "transducer/config.json",
           "transducer/fit.json", "transducer/fit.tmp", "prototypes/neighbours.parquet", "prototypes/neighbours.tmp",
           "prototypes/cards.json")
LOG = "log.jsonl"


def train(config: TrainConfig, log=logger.info, stop_after: int | None = None, force: bool = False) -> dict:
    """Train (or resume) and return the final validation metrics. A model already trained with this config is
    left alone (its metrics.json is returned, nothing is evaluated again); ``force`` deletes what the cblm commands
    wrote into RUN/cblm/<name> and trains from scratch. ``stop_after``: return after that many steps of this call,
    as if killed right after a checkpoint (for tests of resume).

    The settings are checked, the run must be an Atlas run, and RUN/cblm/<name> is locked (``RunLocked`` while
    another process trains it) before anything is written; nothing is deleted before the data and model are built."""
    config.check()
    require_owned(config.run_dir, "run", "run directory")
    out = model_folder(config)
    with run_lock(out, claim_root=False):
        return _train(config, out, log, stop_after, force)


def _refuse_foreign(out: Path, where: tuple[str, ...] = ()) -> None:
    """``NotOwned`` naming the files in ``out`` that the cblm commands did not write (only those under the folders
    ``where``, when given): files a restart or a checkpoint would delete."""
    foreign = [f for f in foreign_files(out, list(WRITTEN)) if not where or f.split("/")[0] in where]
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise NotOwned(f"{out}: holds file(s) atlas cblm did not write ({shown}); nothing was deleted. Move them out "
                       "of the folder, or train another model beside it with --name")


def _delete(out: Path, patterns: tuple[str, ...]) -> bool:
    """Delete the files of ``out`` matching ``patterns`` and the folders they leave empty; whether any was there."""
    deleted = False
    for path in sorted(out.rglob("*"), key=lambda p: len(p.parts), reverse=True):  # files before their folders
        rel = path.relative_to(out).as_posix()
        if path.is_dir() and not path.is_symlink():
            if path.name in (checkpoint.CHECKPOINT, f"{checkpoint.CHECKPOINT}.old", ".checkpoint-tmp", "transducer",
                             "prototypes") and not any(path.iterdir()):
                path.rmdir()
        elif any(fnmatch.fnmatchcase(rel, p) for p in patterns) or rel.startswith(".checkpoint-tmp/"):
            path.unlink()
            deleted = True
    return deleted


def _keep_log_to(out: Path, step: int) -> None:
    """Cut the log back to the records of steps up to ``step`` (the checkpoint resumed from): the steps after it are
    trained again and logged again. A line cut short by a kill is dropped too."""
    path = out / LOG
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= step:
            kept.append(line + "\n")
    tmp = out / f".{LOG}.tmp"
    tmp.write_text("".join(kept))
    os.replace(tmp, path)


def _train(config: TrainConfig, out: Path, log, stop_after: int | None, force: bool) -> dict:
    if not force and (done := trained_metrics(config)) is not None:
        log(f"{out} is already trained ({done.get('step')} steps): nothing to do")
        return done
    found = None if force else checkpoint.find(out)
    saved = json.loads((found / "state.json").read_text()) if found else None
    if saved and (changed := changed_settings(saved["train_config"], config)):
        raise SettingError(f"{out} holds a model trained with another configuration {changed}; add --force to "
                           "retrain it from scratch (the schedules depend on max_steps, so a longer run starts over), "
                           "or train another model beside it with --name")
    # a fresh start clears the folder; every checkpoint replaces the folders checkpoint/ and checkpoint.old/
    _refuse_foreign(out, () if saved is None else (checkpoint.CHECKPOINT, f"{checkpoint.CHECKPOINT}.old"))

    # data: windows of the token shards, in the vocabulary of the checkpoint when resuming
    data = TokenData(config.run_dir, config.seq_len, config.val_fraction, config.compact_vocab,
                     vocab=saved["vocab"] if saved else None)
    if len(data.train_windows) == 0:
        raise SettingError(f"{config.run_dir}: no training windows of {config.seq_len + 1} tokens; lower seq_len")

    # model and optimizer
    if config.device.startswith("cuda"):
        torch.set_float32_matmul_precision("high")  # TF32 matmuls while training; attribution checks use "highest"
    torch.manual_seed(config.seed)
    model = CBLM(config.model_config(data)).to(config.device)
    optimizer = configure_optimizer(model, config)
    step = 0
    if saved:
        model.load_state_dict(load_file(found / "model.safetensors", device=config.device))
        checkpoint.load_optimizer(found, optimizer, config.device)
        step = saved["step"]
        _keep_log_to(out, step)
        log(f"resuming {out} at step {step}")
    counts = model.num_params()
    log(f"model: {counts['total']:,} parameters (backbone {counts['backbone']:,}, embedding {counts['embedding']:,} "
        f"for {data.vocab_size:,} tokens, {HEADS[config.head](model.config, counts['concept_module'])}"
        f"{'' if config.mixer == 'attention' else ', ProtoT mixer'}{'' if config.rope == 'standard' else ', pi-RoPE'})"
        f"; {len(data.train_windows):,} training windows, "
        f"{len(data.val_windows):,} held out")

    def state_now(step: int) -> dict:
        return {"step": step, "train_seconds": train_seconds, "train_config": asdict(config),
                "model_config": model.config.to_dict(),
                "vocab": data.vocab.tolist(), "n_concepts": data.n_concepts}

    lambdas = (config.lambda_concept, config.lambda_rec, config.lambda_indep)
    log_unigram = data.log_unigram().to(config.device) if config.lambda_known > 0 else None
    phases = steering_phases(config) if model.concepts is not None else []
    steering_data = None
    if config.steering and model.concepts is not None and not phases:
        log(f"steering training: off, {config.max_steps} steps leave no room for {config.steering_phases} phases")
    if phases:
        steering_data = SteeringData(data, top=config.steering_lifted)
        log(f"steering training: phases at steps {', '.join(f'{a}-{b - 1}' for a, b in phases)} "
            f"(L_LM + {config.lambda_respond:g} L_respond + {config.lambda_express:g} L_express, tau "
            f"{config.steering_tau:g} from layer {injection_layer(model.config)}; {steering_data.supported} of "
            f"{data.n_concepts} concepts have a lifted set of up to {config.steering_lifted} tokens)")
    # everything that can refuse these settings or this data has run: only now is the earlier model deleted
    if not saved and _delete(out, tuple(p for p in WRITTEN if p != LOCK_NAME) if force else TRAINED):
        log(f"{'--force: ' if force else ''}removed the earlier model's files from {out}; training from scratch")
    started, steps_this_call, last = time.perf_counter(), 0, {}
    # time in forward, backward and update only (not evaluation or checkpoints), summed over resumed calls
    train_seconds = saved.get("train_seconds", 0.0) if saved else 0.0
    while step < config.max_steps:
        # schedules and randomness are functions of the step
        lr = lr_at(step, config)
        for group in optimizer.param_groups:
            group["lr"] = lr
        alpha_known, alpha_unknown = alphas_at(step, config)
        steering = in_steering_phase(step, phases)
        torch.manual_seed(config.seed * 1_000_003 + step)

        # forward, backward, update
        step_started = time.perf_counter()
        model.train()
        batch = data.batch(data.train_batch(step, config.batch_size, config.seed)).to(config.device)
        if steering:
            loss, losses, _ = compute_steering(model, batch, steering_data, config.steering_tau,
                                               (config.lambda_respond, config.lambda_express))
        else:
            loss, losses, _ = compute(model, batch, alpha_known, alpha_unknown, lambdas,
                                      lambda_known=config.lambda_known, log_unigram=log_unigram,
                                      lambdas_prism=(config.lambda_prism, config.lambda_div))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        optimizer.step()
        last = {k: v.item() for k, v in losses.items()}  # (.item() waits for the GPU: the step's time is all in)
        train_seconds += time.perf_counter() - step_started
        step += 1
        steps_this_call += 1

        if step % config.log_every == 0 or step == config.max_steps:
            rate = steps_this_call * config.batch_size * config.seq_len / (time.perf_counter() - started)
            log(f"step {step}/{config.max_steps}  loss {loss.item():.3f}  "
                + "  ".join(f"{k} {v:.3f}" for k, v in last.items())
                + f"  lr {lr:.2e}"
                + (f"  alpha {alpha_known:.2f}/{alpha_unknown:.2f}" if model.concepts is not None else "")
                + ("  steering" if steering else "")
                + f"  {rate:,.0f} tok/s")
        if step % config.eval_every == 0 or step == config.max_steps:
            metrics = evaluate(model, data, batches=config.eval_batches, batch_size=config.batch_size,
                               device=config.device, seed=config.seed)
            record = {"step": step, "lr": lr, "alpha_known": alpha_known, "alpha_unknown": alpha_unknown,
                      "steering": steering, "train": last, "val": metrics}
            with open(out / LOG, "a") as f:
                f.write(json.dumps(record) + "\n")
            log(f"step {step}: val loss {metrics['val_loss']:.4f}"
                + (f", concept loss {metrics['concept_loss']:.4f}, contribution {metrics['contribution']:.3f}, "
                   f"detection AUC {metrics['detection_auc']:.3f}" if "concept_loss" in metrics else "")
                + (f", prototype share {metrics['prototype_share']:.3f}, nearest-prototype cos "
                   f"{metrics['prototype_cos']:.3f}" if "prototype_share" in metrics else ""))
        if step % config.checkpoint_every == 0 or step == config.max_steps:
            checkpoint.save(out, model, optimizer, state_now(step))
            if stop_after is not None and steps_this_call >= stop_after:
                return {}

    metrics = evaluate(model, data, batches=None, batch_size=config.batch_size, device=config.device,
                       seed=config.seed, alignment=True)
    train_tokens = step * config.batch_size * config.seq_len
    metrics.update(step=step, parameters=model.num_params(), train_tokens=train_tokens, train_seconds=train_seconds,
                   tokens_per_second=train_tokens / max(train_seconds, 1e-9))
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
    return metrics
