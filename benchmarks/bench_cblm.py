"""The concept-bottleneck LM against the same backbone without the concept module, at equal budget.

    python benchmarks/bench_cblm.py --run runs/dev [--preset dev|toy] [--objective ar|diffusion] [--device cuda]
                                    [--set KEY=VALUE ...] [--steer "geometry problem" --strengths 2,4,8]
                                    [--fresh] [--json PATH] [--details PATH]

Trains two models on the run's token shards with identical settings, steps, batches and seed (``--preset``; ``--set``
overrides), one with ``concepts=true`` and one with ``concepts=false`` (the baseline), then prints:

- validation loss of each and the gap (concept / baseline - 1; PRISM reports +3% to +4.6%, goal <= 5%);
- the concept model's concept loss, independence, concept contribution (Steerling-8B: 0.876), detection AUC and
  alignment proxy (``atlas.cblm.metrics``);
- the largest attribution error on the held-out windows: |sum of the decomposition terms - the model's logit| over
  every position and vocabulary entry checked, and |logit change when a concept is zeroed + its term|;
- a steering example: text before and after, and the frequency of the concept's lifted tokens in the generations;
- the steering evaluation (``atlas.cblm.steering_eval``): random concepts, several prompts, lifted-word frequency
  steered / unsteered / suppressed, the baseline's perplexity of the continuations, and the harmonic of the concept
  and quality scores (Eq. 30), at each ``--strengths`` tau.

Models go to RUN/cblm/bench-<objective>-{concepts,baseline}; a rerun resumes or reuses them (``--fresh`` retrains).
``--json`` writes the comparisons as result rows (val loss, training seconds, lifted-token frequency steered vs
unsteered); ``--details`` writes every number above.
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
from atlas.cblm.data import TokenData, lifted_tokens  # noqa: E402
from atlas.cblm.generate import Codec, steering_effect  # noqa: E402
from atlas.cblm.model import decompose  # noqa: E402
from atlas.cblm.steering_eval import evaluate_steering, format_steering  # noqa: E402
from atlas.cblm.train import TrainConfig, train  # noqa: E402

PRESETS = {
    # seconds on a 2-core CPU: the demo run's scale
    "toy": ["d_model=64", "n_layer=2", "n_head=4", "seq_len=128", "batch_size=8", "max_steps=300", "lr=3e-3"],
    # the dev corpus (1.3M tokens) on a GPU: ~6 epochs
    "dev": ["d_model=256", "n_layer=4", "n_head=8", "seq_len=256", "batch_size=32", "max_steps=1000", "lr=2e-3",
            "eval_every=100", "eval_batches=16", "checkpoint_every=500"],
}


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", default="runs/dev")
    parser.add_argument("--preset", default="toy", choices=sorted(PRESETS))
    parser.add_argument("--objective", default="ar", choices=["ar", "diffusion"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--steer", default="geometry problem", help="concept name for the steering example")
    parser.add_argument("--strengths", default="2,4,8", help="steering strengths tau to try (comma-separated)")
    parser.add_argument("--prompt", action="append", default=None, help="steering prompts (repeatable)")
    parser.add_argument("--steer-concepts", type=int, default=24, help="random concepts in the steering evaluation")
    parser.add_argument("--fresh", action="store_true", help="delete earlier bench models first")
    add_json_option(parser)
    parser.add_argument("--details", metavar="PATH", help="also write every result (metrics, steering texts) here")
    args = parser.parse_args()

    base = PRESETS[args.preset] + [f"objective={args.objective}", f"device={args.device}"] + args.set
    results = {}
    for variant, concepts in (("concepts", True), ("baseline", False)):
        name = f"bench-{args.objective}-{variant}"
        if args.fresh:
            shutil.rmtree(Path(args.run) / "cblm" / name, ignore_errors=True)
        config = TrainConfig.from_overrides(args.run, base + [f"name={name}", f"concepts={concepts}"])
        started = time.perf_counter()
        metrics = train(config, log=lambda msg, variant=variant: print(f"[{variant}] {msg}", flush=True))
        metrics["seconds"] = time.perf_counter() - started
        results[variant] = metrics

    concept, baseline = results["concepts"], results["baseline"]
    model, state = checkpoint.load(Path(args.run) / "cblm" / f"bench-{args.objective}-concepts", args.device)
    data = TokenData(args.run, model.config.seq_len, state["train_config"]["val_fraction"], vocab=state["vocab"])
    torch.set_float32_matmul_precision("highest")  # exact float32 for the attribution checks (no TF32)
    results["attribution"] = attribution_errors(model, data, args.device)

    from atlas.cblm.cli import _concept_names, find_concept

    names = _concept_names(Path(args.run))
    concept_id = find_concept(names, args.steer)
    prompts = args.prompt or ["The", "In this article we", "Here is how"]
    lifted = lifted_tokens(data, top=200, min_support=20)[concept_id]  # a word set large enough to count in 48 tokens
    strengths = [float(tau) for tau in args.strengths.split(",")]
    results["steering"] = [steering_effect(model, Codec(state["vocab"]), concept_id, tau, prompts, lifted,
                                           max_new_tokens=48, samples=8, temperature=0.8) for tau in strengths]
    reference, _ = checkpoint.load(Path(args.run) / "cblm" / f"bench-{args.objective}-baseline", args.device)
    results["steering_eval"] = evaluate_steering(model, data, state["vocab"], strengths, reference=reference,
                                                 n_concepts=args.steer_concepts)

    print("\n| model | params | val loss | seconds |\n|---|---:|---:|---:|")
    for variant in ("baseline", "concepts"):
        m = results[variant]
        print(f"| {variant} | {m['parameters']['total']:,} | {m['val_loss']:.4f} | {m['seconds']:.0f} |")
    print(f"\nval loss gap (concepts / baseline - 1): {concept['val_loss'] / baseline['val_loss'] - 1:+.2%}")
    for key in ("concept_loss", "independence", "contribution", "contribution_known", "detection_auc",
                "alignment_overlap", "alignment_overlap_random_concept", "alignment_overlap_centered",
                "alignment_overlap_centered_random_concept", "norm_known_emb", "norm_h", "norm_k_hat", "norm_u_hat",
                "norm_eps"):
        if key in concept:
            print(f"{key}: {concept[key]:.4f}")
    if "alignment_overlap" in concept:
        print(f"alignment proxy vs chance (a random other concept's lifted tokens): {concept['alignment_overlap']:.4f}"
              f" vs {concept['alignment_overlap_random_concept']:.4f} "
              f"({concept['alignment_overlap'] / max(concept['alignment_overlap_random_concept'], 1e-9):.1f}x)")
    print("known share of the concept contribution: "
          f"{concept['contribution_known'] / max(concept['contribution'], 1e-9):.3f}")
    print(json.dumps(results["attribution"]))
    print(f"\nsteering {args.steer!r} (concept {concept_id}), "
          f"top lifted tokens {results['steering'][0]['lifted_tokens'][:20]}")
    for s in results["steering"]:
        print(f"tau {s['strength']:g} (gamma {s['gamma']:.2f}, layers >= {s['layer']}): lifted-token frequency "
              f"{s['lifted_frequency_before']:.4f} -> {s['lifted_frequency_after']:.4f}")
        print(f"--- before ---\n{s['text_before']}\n--- after ---\n{s['text_after']}")
    print()
    print(format_steering(results["steering_eval"]))
    for row_ in results["steering_eval"]["strengths"][0]["per_concept"][:3]:
        print(f"--- {names[row_['concept']]!r} unsteered ---\n{row_['text_unsteered']}\n--- steered (tau "
              f"{strengths[0]:g}) ---\n{row_['text_steered']}")
    if args.details:
        Path(args.details).write_text(json.dumps(results, indent=2, default=str))
    setting = f"{args.objective}, preset {args.preset}"
    attribution = max(results["attribution"].values())
    note = (f"goal <= 1.05; contribution {concept.get('contribution', float('nan')):.3f}, detection AUC "
            f"{concept.get('detection_auc', float('nan')):.3f}, max attribution error {attribution:.1e}")
    write_json(args.json, [
        row("cblm", f"val loss, {setting}", concept["val_loss"], baseline["val_loss"], "loss",
            "same backbone without concepts", better="lower", note=note),
        row("cblm", f"training time, {setting}", concept["seconds"], baseline["seconds"], "s",
            "same backbone without concepts", better="lower",
            note=f"{concept['parameters']['total']:,} vs {baseline['parameters']['total']:,} parameters"),
        *[row("cblm", f"steering {args.steer!r}, tau {s['strength']:g}", s["lifted_frequency_after"],
              s["lifted_frequency_before"], "lifted-token freq", "same model unsteered",
              note=f"concept {concept_id}, {len(prompts)} prompt(s) x 8 samples") for s in results["steering"]]])


if __name__ == "__main__":
    main()
