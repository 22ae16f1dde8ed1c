"""``atlas cblm ...``: train, evaluate, generate from and steer the concept-bottleneck LM.

    atlas cblm train RUN [--name cblm] [--baseline] [--set d_model=128 ...]   -> RUN/cblm/<name>/
    atlas cblm eval RUN/cblm/<name>
    atlas cblm generate RUN/cblm/<name> --prompt "..." [--steer "concept name" --strength 4 [--compare]]
    atlas cblm tda RUN/cblm/<name>                 fit the transducer into the run's index (training-data attribution)
    atlas cblm attribute RUN/cblm/<name> "text"    the concepts behind a text's logits, and its nearest training chunks
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

EXAMPLES = """examples:
  atlas cblm train runs/demo                            # toy concept-bottleneck LM on the demo shards (CPU, minutes)
  atlas cblm train runs/demo --baseline                 # the same backbone and budget without the concept module
  atlas cblm train runs/demo --name diff --set objective=diffusion --set block_size=16
  atlas cblm eval runs/demo/cblm/cblm
  atlas cblm generate runs/demo/cblm/cblm --prompt "The function returns" --steer "python programming" \
--strength 4 --compare
  atlas cblm tda runs/demo/cblm/cblm                    # transducer into the run's IVFPQ index, held-out recall@10
  atlas cblm attribute runs/demo/cblm/cblm "def add(a, b): return a + b"
"""


def _concept_names(run_dir: Path) -> list[str]:
    from atlas.core.rundir import RunDir
    from atlas.io.library import load_library

    concepts, _ = load_library(RunDir(run_dir))
    return [c["name"] for c in concepts]


def find_concept(names: list[str], query: str) -> int:
    """The concept named ``query`` (case-insensitive), or the only one whose name contains it."""
    lowered = [n.lower() for n in names]
    if query.lower() in lowered:
        return lowered.index(query.lower())
    matches = [i for i, n in enumerate(lowered) if query.lower() in n]
    if len(matches) == 1:
        return matches[0]
    shown = ", ".join(repr(names[i]) for i in matches[:10]) or "none"
    raise SystemExit(f"error: {len(matches)} concepts match {query!r} ({shown}); give the exact name")


def cmd_train(args) -> int:
    from atlas.cblm.train import TrainConfig, train
    from atlas.tools.report import refresh_report

    overrides = list(args.set or [])
    if args.baseline:
        overrides.append("concepts=false")
    name = args.name or ("baseline" if args.baseline else "cblm")
    config = TrainConfig.from_overrides(str(Path(args.run_dir)), [f"name={name}"] + overrides)
    metrics = train(config)
    print(json.dumps({k: v for k, v in metrics.items() if not isinstance(v, dict)}, indent=2))
    print(f"model and metrics in {Path(args.run_dir) / 'cblm' / name}")
    refresh_report(args.run_dir)  # the run report gains this model's metrics and loss curve
    return 0


def cmd_eval(args) -> int:
    from atlas.cblm import checkpoint
    from atlas.cblm.data import TokenData
    from atlas.cblm.metrics import evaluate

    model, state = checkpoint.load(Path(args.model), args.device)
    train_config = state["train_config"]
    data = TokenData(train_config["run_dir"], train_config["seq_len"], train_config["val_fraction"],
                     vocab=state["vocab"])
    metrics = evaluate(model, data, batches=None, batch_size=train_config["batch_size"], device=args.device,
                       seed=train_config["seed"], alignment=True)
    print(json.dumps(metrics, indent=2))
    return 0


def cmd_generate(args) -> int:
    from atlas.cblm import checkpoint
    from atlas.cblm.generate import Codec, generate, steering_effect, steering_for

    model, state = checkpoint.load(Path(args.model), args.device)
    codec = Codec(state["vocab"])
    steer = concept = None
    if args.steer:
        run_dir = Path(state["train_config"]["run_dir"])
        concept = find_concept(_concept_names(run_dir), args.steer)
        steer = steering_for(model, [concept], args.strength, args.layer)
    if args.compare:
        if concept is None:
            raise SystemExit("error: --compare needs --steer")
        from atlas.cblm.data import TokenData
        from atlas.cblm.metrics import lifted_tokens

        config = state["train_config"]
        data = TokenData(config["run_dir"], config["seq_len"], config["val_fraction"], vocab=state["vocab"])
        lifted = lifted_tokens(data, top=200, min_support=20)[concept]
        effect = steering_effect(model, codec, concept, args.strength, [args.prompt], lifted, args.max_new_tokens,
                                 args.samples, args.temperature, args.layer)
        print(f"concept {concept}: {args.steer}   gamma {effect['gamma']:.2f} from layer {effect['layer']}")
        print(f"most lifted tokens: {effect['lifted_tokens'][:20]}")
        print(f"--- before ---\n{effect['text_before']}\n--- after ---\n{effect['text_after']}")
        print(f"lifted-token frequency over {args.samples} samples: {effect['lifted_frequency_before']:.4f} -> "
              f"{effect['lifted_frequency_after']:.4f}")
        return 0
    ids, dropped = codec.encode(args.prompt)
    if dropped:
        print(f"({dropped} prompt token(s) are not in this model's vocabulary and were left out)")
    for s in range(args.samples):
        out = generate(model, ids, args.max_new_tokens, args.temperature, steer=steer, seed=args.seed + s)
        print(f"--- sample {s} ---\n{codec.decode(out)}")
    return 0


def cmd_attribute(args) -> int:
    import torch

    from atlas.cblm import checkpoint
    from atlas.cblm.attribution import (
        TRANSDUCER,
        concept_attribution,
        input_attribution,
        load_transducer,
        nearest_training_chunks,
        top_concepts,
    )
    from atlas.cblm.generate import Codec

    model, state = checkpoint.load(Path(args.model), args.device)
    if model.concepts is None:
        raise SystemExit("error: this model has no concept module (a baseline): nothing to attribute")
    codec = Codec(state["vocab"])
    names = _concept_names(Path(state["train_config"]["run_dir"]))
    ids, _ = codec.encode(args.text)
    ids = ids[: model.config.seq_len + 1]
    idx = torch.tensor([ids[:-1]], device=args.device)
    targets = torch.tensor([ids[1:]], device=args.device)
    result = concept_attribution(model, idx, targets)
    total = float(result["logit"].sum())
    print(f"{len(ids) - 1} predicted tokens, summed logit {total:.3f} = known {float(result['known'].sum()):.3f} "
          f"+ unknown {float(result['unknown'].sum()):.3f} + residual {float(result['residual'].sum()):.3f}")
    print("known concepts with the largest contribution (Gamma, Eq. 17):")
    for name, value in top_concepts(result["gamma_known"][0], names, k=args.top):
        print(f"  {value:+8.3f}  {name}")
    # input attribution for the last prediction: IG from [MASK] where [MASK] is trained (diffusion), else occlusion
    method = "ig" if model.config.objective == "diffusion" else "occlusion"
    scores, info = input_attribution(model, idx, idx.shape[1] - 1, int(targets[0, -1]), method=method, steps=32)
    print(f"input tokens behind the last logit ({codec.decode([int(targets[0, -1])])!r}, {info['logit']:.3f}; "
          f"{method} against [MASK]):")
    for i in scores.abs().argsort(descending=True)[: args.top].tolist():
        print(f"  {float(scores[i]):+8.3f}  position {i:>3}  {codec.decode([int(idx[0, i])])!r}")
    transducer_folder = Path(args.model) / TRANSDUCER
    if (transducer_folder / "config.json").exists():
        transducer = load_transducer(transducer_folder, args.device)
        with torch.no_grad():
            state_vector = model.concepts(model.hidden(idx)).h_bar.mean(1).cpu().numpy()
        print("nearest training chunks (transducer -> IVFPQ index):")
        for chunk_id, score in nearest_training_chunks(state["train_config"]["run_dir"], transducer, state_vector,
                                                       k=5)[0]:
            print(f"  {score:.3f}  {chunk_id}")
    return 0


def cmd_tda(args) -> int:
    from atlas.cblm.attribution import build_training_attribution

    state = json.loads((Path(args.model) / "checkpoint" / "state.json").read_text())
    result = build_training_attribution(state["train_config"]["run_dir"], args.model, steps=args.steps,
                                        device=args.device)
    print(json.dumps(result, indent=2))
    print(f"transducer saved in {Path(args.model) / 'transducer'}; `atlas cblm attribute` now lists training chunks")
    return 0


def add_parser(sub) -> None:
    parser = sub.add_parser("cblm", help="the concept-bottleneck LM: train, eval, generate (steer), tda, attribute",
                            epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    cblm = parser.add_subparsers(dest="cblm_command", required=True, metavar="{train,eval,generate,tda,attribute}")

    p = cblm.add_parser("train", help="train (or resume) on a run's token shards -> RUN/cblm/<name>",
                        epilog="settings (--set KEY=VALUE): see atlas/cblm/train.py TrainConfig")
    p.add_argument("run_dir", help="a run directory with token shards and a library")
    p.add_argument("--name", help="output folder under RUN/cblm (default: cblm, or baseline with --baseline)")
    p.add_argument("--baseline", action="store_true", help="no concept module: the same backbone and budget")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a training setting (repeatable)")
    p.set_defaults(fn=cmd_train)

    p = cblm.add_parser("eval", help="validation metrics of a trained model on all held-out windows")
    p.add_argument("model", help="RUN/cblm/<name>")
    p.add_argument("--device", default="cpu")
    p.set_defaults(fn=cmd_eval)

    p = cblm.add_parser("generate", help="continue a prompt, optionally steered toward (or away from) a concept")
    p.add_argument("model", help="RUN/cblm/<name>")
    p.add_argument("--prompt", default="", help="text to continue")
    p.add_argument("--steer", help="a concept name from the run's library")
    p.add_argument("--strength", type=float, default=4.0, help="tau: > 0 amplifies, < 0 suppresses")
    p.add_argument("--layer", type=int, default=None, help="inject from this layer on (default: n_layer // 2)")
    p.add_argument("--compare", action="store_true", help="with and without steering, and the concept's "
                                                          "lifted-token frequency in each")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--samples", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.set_defaults(fn=cmd_generate)

    p = cblm.add_parser("tda", help="training-data attribution: fit the transducer from the model's pooled chunk "
                                     "states into the run's IVFPQ index, and measure held-out self-recall@10")
    p.add_argument("model", help="RUN/cblm/<name> (the run needs its index stage)")
    p.add_argument("--steps", type=int, default=1000, help="transducer training steps")
    p.add_argument("--device", default="cpu")
    p.set_defaults(fn=cmd_tda)

    p = cblm.add_parser("attribute", help="the known concepts behind a text's next-token logits (exact)")
    p.add_argument("model", help="RUN/cblm/<name>")
    p.add_argument("text")
    p.add_argument("--top", type=int, default=10)
    p.add_argument("--device", default="cpu")
    p.set_defaults(fn=cmd_attribute)
