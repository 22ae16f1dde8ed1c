"""The concept-bottleneck LM against the same backbone without the concept module, at equal budget.

    python benchmarks/bench_cblm.py --run runs/demo [--preset cpu|dev|toy] [--recipes atlas,paper]
                                    [--objective ar|diffusion] [--device cuda] [--set KEY=VALUE ...]
                                    [--strengths 0.25,0.5,1] [--fresh] [--json PATH] [--details PATH]

Trains, with identical settings, steps, batches and seed (``--preset``; ``--set`` overrides), the baseline
(``head=none``) and one concept model per recipe (``RECIPES``: "atlas", the defaults, with the token-level
concept loss, the known readout and steering training; "paper", the paper's OR-aggregated concept loss without
them, which is what Atlas trained before), then prints, side by side:

- validation loss and the gap to the baseline (concept / baseline - 1; PRISM reports +3% to +4.6%, goal <= 5%);
- concept contribution (Eq. 22; Steerling-8B 0.876), the known term's part of it (the known share), detection AUC,
  the norms of K_c, h, k_hat, u_hat and eps, and the alignment proxy next to its chance level (the overlap with a
  random other concept's lifted tokens), for W K_c and for the steering direction W (K_c - mean K);
- the largest attribution error on the held-out windows: |sum of the decomposition terms - the model's logit| over
  every position and vocabulary entry checked, and |logit change when a concept is zeroed + its term|;
- the steering evaluation (``atlas.cblm.steering_eval``) at each ``--strengths`` tau: random concepts, several
  prompts, lifted-word frequency steered / unsteered / suppressed, the baseline's perplexity of the continuations,
  and the harmonic of the concept and quality scores (Eq. 30); then three steered texts next to their unsteered twins.

Models go to RUN/cblm/bench-<objective>-{baseline,<recipe>}; a rerun resumes or reuses them (``--fresh`` retrains).
``--json`` writes the comparisons as result rows; ``--details`` writes every number above.

``--architectures baseline,concepts,prism,protot,pi-rope`` compares instead the interpretable models of the seeds at
one token budget (``ARCHITECTURES``): validation loss and the gap to the baseline, training tokens/s (forward,
backward and update only), parameters, and each head's own share of the logit (concepts: the contribution; PRISM:
the prototypes' part). The seeds' own gaps are the references: PRISM +3% to +4.6% (GPT-2 124M-1.5B on FineWeb-Edu),
ProtoT +15% perplexity over LLaMA-style attention at h 256, 6 layers, 16k vocabulary (about +3% in loss), pi-RoPE
(seeds 003) 3.10 vs 2.85 for GPT-2 at 124M (+9%).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _results import add_json_option, row, write_json  # noqa: E402

from atlas.cblm import checkpoint  # noqa: E402
from atlas.cblm.data import TokenData  # noqa: E402
from atlas.cblm.model import decompose  # noqa: E402
from atlas.cblm.steering_eval import evaluate_steering, format_steering  # noqa: E402
from atlas.cblm.train import TrainConfig, train  # noqa: E402

PRESETS = {
    # about a minute per model on a 2-core CPU: the demo run's scale, for a first look
    "toy": ["d_model=64", "n_layer=2", "n_head=4", "seq_len=128", "batch_size=8", "max_steps=300", "lr=3e-3"],
    # the baseline and both recipes on 2 CPU cores in about 35 minutes (the demo run: ~8 epochs)
    "cpu": ["d_model=128", "n_layer=4", "n_head=4", "seq_len=128", "batch_size=16", "max_steps=1000", "lr=2e-3",
            "eval_every=250", "eval_batches=16"],
    # the dev corpus (1.3M tokens) on a GPU: ~6 epochs
    "dev": ["d_model=256", "n_layer=4", "n_head=8", "seq_len=256", "batch_size=32", "max_steps=1000", "lr=2e-3",
            "eval_every=100", "eval_batches=16", "checkpoint_every=500"],
}

# Concept-model recipes, as --set overrides of the TrainConfig defaults.
RECIPES = {
    "atlas": [],  # token-level concept loss, known readout, steering training, p_eps 0.7 (the defaults)
    # the paper's OR-aggregated concept loss and residual dropout, no readout, no steering training
    "paper": ["concept_aggregation=or", "lambda_known=0", "steering=false", "p_eps=0.3"],
}

# The interpretable models of the seeds, as --set overrides; trained into RUN/cblm/bench-<objective>-arch-<name>.
ARCHITECTURES = {
    "baseline": ["head=none"],
    "concepts": RECIPES["atlas"],
    "prism": ["head=prism"],  # 256 prototypes, top 16, lambda_prism 0.1, L_DIV on
    "prism-unit": ["head=prism", "lambda_prism=1"],  # the source's unit weights
    "protot": ["head=none", "mixer=prototype"],  # R = 32 channels per layer
    "pi-rope": ["head=none", "rope=pi"],
}

METRICS = ("val_loss", "concept_loss", "independence", "contribution", "contribution_known", "known_share",
           "detection_auc", "alignment_overlap", "alignment_overlap_random_concept", "alignment_overlap_centered",
           "alignment_overlap_centered_random_concept", "norm_known_emb", "norm_h", "norm_k_hat", "norm_u_hat",
           "norm_eps", "max_decomposition_error", "max_intervention_error", "seconds")


@torch.no_grad()
def attribution_errors(model, data: TokenData, device: str, batches: int = 4, batch_size: int = 8) -> dict:
    """Largest |decomposition - logit| (for the true next token and for 64 random vocabulary entries) and largest
    |(logit after zeroing concept c) - (logit before) + (c's known term)| over the held-out windows."""
    model.eval()
    T = model.config.seq_len
    generator = torch.Generator().manual_seed(0)
    worst_sum = worst_edit = 0.0
    for start in range(0, min(len(data.val_windows), batches * batch_size), batch_size):
        batch = data.batch(data.val_windows[start:start + batch_size]).to(device)
        idx = batch.tokens[:, :T]
        logits, parts = model(idx)
        candidates = [batch.tokens[:, 1:T + 1]] + [
            torch.randint(0, model.config.vocab_size, idx.shape, generator=generator).to(device) for _ in range(64)]
        for targets in candidates:
            terms = decompose(model, parts, targets)
            actual = logits.gather(-1, targets[..., None])[..., 0]
            worst_sum = max(worst_sum, float((terms["logit"] - actual).abs().max()))
        targets = candidates[0]
        terms = decompose(model, parts, targets)
        for c in torch.randperm(model.config.n_concepts, generator=generator)[:8].tolist():
            edited, _ = model(idx, edit=lambda k, c=c: k.index_fill(-1, torch.tensor([c], device=device), 0.0))
            change = (edited - logits).gather(-1, targets[..., None])[..., 0]
            worst_edit = max(worst_edit, float((change + terms["known"][..., c]).abs().max()))
    return {"max_decomposition_error": worst_sum, "max_intervention_error": worst_edit}


def compare_architectures(args, base: list[str], names: list[str]) -> None:
    """Train (or reuse) one model per architecture at the same budget and print one table."""
    results = {}
    for name in names:
        folder = f"bench-{args.objective}-arch-{name}"
        if args.fresh:
            shutil.rmtree(Path(args.run) / "cblm" / folder, ignore_errors=True)
        config = TrainConfig.from_overrides(args.run, base + ARCHITECTURES[name] + [f"name={folder}"])
        results[name] = train(config, log=lambda msg, name=name: print(f"[{name}] {msg}", flush=True))
    baseline = results.get("baseline")
    tokens = next(iter(results.values()))["train_tokens"]
    print(f"\npreset {args.preset}, {args.objective}, {tokens:,} training tokens each\n")
    print("| model | val loss | gap to baseline | tokens/s | parameters | head's share of the logit |\n"
          "|---|---:|---:|---:|---:|---|")
    for name, m in results.items():
        gap = f"{m['val_loss'] / baseline['val_loss'] - 1:+.2%}" if baseline and name != "baseline" else ""
        share = (f"contribution {m['contribution']:.3f} (known {m['contribution_known']:.3f})" if "contribution" in m
                 else f"prototypes {m['prototype_share']:.3f}" if "prototype_share" in m else "")
        speed = f"{m['tokens_per_second']:,.0f}" if "tokens_per_second" in m else "-"
        print(f"| {name} | {m['val_loss']:.4f} | {gap} | {speed} | {m['parameters']['total']:,} | {share} |")
    rows = [row("cblm", f"val loss, {name}, {args.objective}, preset {args.preset}", m["val_loss"],
                baseline["val_loss"], "loss", "plain baseline, same budget", better="lower",
                note=f"{m.get('tokens_per_second', 0):,.0f} tok/s, {m['parameters']['total']:,} parameters")
            for name, m in results.items() if baseline and name != "baseline"]
    write_json(args.json, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", default="runs/demo")
    parser.add_argument("--preset", default="toy", choices=sorted(PRESETS))
    parser.add_argument("--recipes", default="atlas",
                        help=f"concept-model recipes, comma-separated: {', '.join(RECIPES)}")
    parser.add_argument("--objective", default="ar", choices=["ar", "diffusion"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--strengths", default="0.25,0.5,1", help="steering strengths tau (comma-separated)")
    parser.add_argument("--prompt", action="append", default=None, help="steering prompts (repeatable)")
    parser.add_argument("--steer-concepts", type=int, default=24, help="random concepts in the steering evaluation")
    parser.add_argument("--fresh", action="store_true", help="delete earlier bench models first")
    add_json_option(parser)
    parser.add_argument("--details", metavar="PATH", help="also write every result (metrics, steering texts) here")
    parser.add_argument("--architectures", metavar="A,B,...",
                        help=f"compare these models instead of the recipes: {', '.join(ARCHITECTURES)}")
    args = parser.parse_args()
    base = PRESETS[args.preset] + [f"objective={args.objective}", f"device={args.device}"] + args.set
    if args.architectures:
        names = args.architectures.split(",")
        if unknown := [n for n in names if n not in ARCHITECTURES]:
            parser.error(f"--architectures: unknown {', '.join(unknown)} (choose from {', '.join(ARCHITECTURES)})")
        return compare_architectures(args, base, names)
    recipes = args.recipes.split(",")
    unknown = [r for r in recipes if r not in RECIPES]
    if unknown:
        parser.error(f"--recipes: unknown {', '.join(unknown)} (choose from {', '.join(RECIPES)})")

    results = {}
    for variant in ["baseline", *recipes]:
        name = f"bench-{args.objective}-{variant}"
        if args.fresh:
            shutil.rmtree(Path(args.run) / "cblm" / name, ignore_errors=True)
        overrides = ["head=none"] if variant == "baseline" else RECIPES[variant]
        config = TrainConfig.from_overrides(args.run, base + overrides + [f"name={name}"])
        started = time.perf_counter()
        metrics = train(config, log=lambda msg, variant=variant: print(f"[{variant}] {msg}", flush=True))
        results[variant] = metrics | {"seconds": time.perf_counter() - started}

    reference, state = checkpoint.load(Path(args.run) / "cblm" / f"bench-{args.objective}-baseline", args.device)
    data = TokenData(args.run, reference.config.seq_len, state["train_config"]["val_fraction"], vocab=state["vocab"])
    strengths = [float(tau) for tau in args.strengths.split(",")]
    steering = {}
    torch.set_float32_matmul_precision("highest")  # exact float32 for the attribution checks (no TF32)
    for recipe in recipes:
        model, _ = checkpoint.load(Path(args.run) / "cblm" / f"bench-{args.objective}-{recipe}", args.device)
        metrics = results[recipe]
        metrics.update(attribution_errors(model, data, args.device))
        metrics["known_share"] = metrics["contribution_known"] / max(metrics["contribution"], 1e-9)
        print(f"[{recipe}] steering evaluation ...", flush=True)
        steering[recipe] = evaluate_steering(model, data, state["vocab"], strengths, reference=reference,
                                             n_concepts=args.steer_concepts, **({"prompts": args.prompt}
                                                                                if args.prompt else {}))
    results["steering"] = steering

    baseline = results["baseline"]
    print(f"\npreset {args.preset}, {args.objective}, {baseline['parameters']['total']:,} parameters in the baseline; "
          f"the concept models add {results[recipes[0]]['parameters']['total'] - baseline['parameters']['total']:,}")
    print("\n| | baseline | " + " | ".join(recipes) + " |\n|---|---:|" + "---:|" * len(recipes))
    print(f"| val loss | {baseline['val_loss']:.4f} | "
          + " | ".join(f"{results[r]['val_loss']:.4f} ({results[r]['val_loss'] / baseline['val_loss'] - 1:+.2%})"
                       for r in recipes) + " |")
    for key in METRICS[1:]:
        values = [results[r].get(key) for r in recipes]
        cells = " | ".join("-" if v is None else f"{v:.4g}" for v in values)
        print(f"| {key} | {baseline[key]:.0f} | {cells} |" if key == "seconds" else f"| {key} | | {cells} |")
    for suffix in ("", "_centered"):
        cells = []
        for r in recipes:
            hit, chance = results[r].get(f"alignment_overlap{suffix}"), results[r].get(
                f"alignment_overlap{suffix}_random_concept")
            cells.append("-" if hit is None else f"{hit / max(chance, 1e-9):.1f}x chance")
        print(f"| alignment{suffix} vs chance | | " + " | ".join(cells) + " |")
    for recipe in recipes:
        print(f"\n{recipe}: " + format_steering(steering[recipe]))
    from atlas.cblm.cli import _concept_names

    names = _concept_names(Path(args.run))
    for recipe in recipes:
        best = max(steering[recipe]["strengths"], key=lambda s: s["harmonic"])
        for row_ in best["per_concept"][:3]:
            print(f"--- {recipe}, {names[row_['concept']]!r}, unsteered ---\n{row_['text_unsteered']}\n"
                  f"--- steered (tau {best['tau']:g}) ---\n{row_['text_steered']}")
    if args.details:
        Path(args.details).write_text(json.dumps(results, indent=2, default=str))

    setting = f"{args.objective}, preset {args.preset}"
    rows = []
    for recipe in recipes:
        m = results[recipe]
        attribution = max(m["max_decomposition_error"], m["max_intervention_error"])
        note = (f"goal <= 1.05; contribution {m.get('contribution', float('nan')):.3f} (known share "
                f"{m['known_share']:.3f}), detection AUC {m.get('detection_auc', float('nan')):.3f}, max attribution "
                f"error {attribution:.1e}")
        rows += [row("cblm", f"val loss, {recipe}, {setting}", m["val_loss"], baseline["val_loss"], "loss",
                     "same backbone without concepts", better="lower", note=note),
                 row("cblm", f"training time, {recipe}, {setting}", m["seconds"], baseline["seconds"], "s",
                     "same backbone without concepts", better="lower",
                     note=f"{m['parameters']['total']:,} vs {baseline['parameters']['total']:,} parameters")]
        rows += [row("cblm", f"steering, {recipe}, tau {s['tau']:g}", s["steered"], s["unsteered"],
                     "lifted-word freq", "same model unsteered",
                     note=f"{len(steering[recipe]['concepts'])} random concepts; perplexity ratio "
                          f"{s['perplexity_ratio']:.2f}, suppressed {s['suppression_ratio']:.2f}x, harmonic "
                          f"{s['harmonic']:.3f}") for s in steering[recipe]["strengths"]]
    write_json(args.json, rows)


if __name__ == "__main__":
    main()
