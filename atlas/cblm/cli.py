"""``atlas cblm ...``: train, evaluate, generate from and steer the concept-bottleneck LM.

    atlas cblm train RUN [--name cblm] [--baseline] [--set d_model=128 ...] [--force]   -> RUN/cblm/<name>/
    atlas cblm eval RUN/cblm/<name> [--steering [--reference RUN/cblm/baseline] [--strengths 2,4,8]] [--diagnostics]
    atlas cblm generate RUN/cblm/<name> --prompt "..." [--steer "concept name" --strength 0.5 [--compare]]
    atlas cblm tda RUN/cblm/<name> [--force]       fit the transducer into the run's index (training-data attribution)
    atlas cblm attribute RUN/cblm/<name> "text"    the concepts behind a text's logits, and its nearest training chunks
    atlas cblm prototypes RUN/cblm/<name>          a PRISM model: mine its prototypes' neighbours, write their cards
"""

from __future__ import annotations

import argparse
import difflib
import json
from pathlib import Path

EXAMPLES = """examples:
  atlas cblm train runs/demo                            # toy concept-bottleneck LM on the demo shards (CPU, minutes)
  atlas cblm train runs/demo --baseline                 # the same backbone and budget without the concept module
  atlas cblm train runs/demo --name diff --set objective=diffusion --set block_size=16
  atlas cblm eval runs/demo/cblm/cblm
  atlas cblm eval runs/demo/cblm/cblm --steering --reference runs/demo/cblm/baseline   # + the steering table
  atlas cblm generate runs/demo/cblm/cblm --prompt "The function returns" --steer "python program" \
--strength 0.5 --compare
  atlas cblm tda runs/demo/cblm/cblm                    # transducer into the run's IVFPQ index, held-out recall@10
  atlas cblm attribute runs/demo/cblm/cblm "def add(a, b): return a + b"
  atlas cblm train runs/demo --name prism --set head=prism     # the PRISM prototype head instead of concepts
  atlas cblm prototypes runs/demo/cblm/prism --measure 200      # neighbours, cards, attribution measured
  atlas cblm train runs/demo --name protot --baseline --set mixer=prototype   # ProtoT: no attention, O(1) per token
  atlas cblm eval runs/demo/cblm/protot --diagnostics   # routing, prototype disruption, repetition escape T_c
  atlas cblm generate runs/demo/cblm/prism --prompt "The function" --category numbers --strength 0.5
"""


def _concepts(run_dir: Path) -> list[dict]:
    from atlas.core.rundir import RunDir
    from atlas.io.library import load_library

    concepts, _ = load_library(RunDir(run_dir))
    return concepts


def _concept_names(run_dir: Path) -> list[str]:
    return [c["name"] for c in _concepts(run_dir)]


def _run_dir(model: str | Path, state: dict) -> str:
    """The run a model was trained on: RUN of RUN/cblm/<name>, so the commands work from any folder (the run_dir
    saved at training is relative to where `atlas cblm train` ran); else that saved run_dir."""
    here = Path(model).resolve().parent.parent
    return str(here) if (here / "tokens").is_dir() else state["train_config"]["run_dir"]


def _model_data(model: str | Path, state: dict):
    """The windows a saved model was trained and held out on: its run, window length, split and vocabulary."""
    from atlas.cblm.data import TokenData

    config = state["train_config"]
    return TokenData(_run_dir(model, state), config["seq_len"], config["val_fraction"], vocab=state["vocab"])


def _normal(text: str) -> str:
    return " ".join(text.lower().split())


def find_concept(names: list[str], query: str, domains: list[str | None] | None = None) -> int:
    """The id of the concept that ``query`` names: its exact name, else its name ignoring case and extra whitespace,
    else a concept id (``12`` or ``#12``). Anything else stops with the nearest names (difflib, then names sharing a
    word with the query), so a typo or a guess shows what the library holds."""
    def shown(ids: list[int]) -> str:
        kinds = [domains[i] if domains and domains[i] not in (None, "content") else None for i in ids]
        return ", ".join(f"{names[i]!r} (id {i}{f', {kind}' if kind else ''})" for i, kind in zip(ids, kinds))

    normal = [_normal(n) for n in names]
    for same in ([i for i, n in enumerate(names) if n == query],
                 [i for i, n in enumerate(normal) if n == _normal(query)]):
        if len(same) == 1:
            return same[0]
        if same:
            raise SystemExit(f"error: {len(same)} concepts are named {query!r}: {shown(same)}; give the id, "
                             f"e.g. --steer {same[0]}")
    number = query.strip().removeprefix("#")
    if number.isdigit():
        if int(number) < len(names):
            return int(number)
        raise SystemExit(f"error: no concept id {number}: this library has ids 0-{len(names) - 1}")
    close = difflib.get_close_matches(_normal(query), normal, n=8, cutoff=0.6)
    words = set(_normal(query).split())
    sharing = sorted((i for i, n in enumerate(normal) if words & set(n.split())),
                     key=lambda i: -difflib.SequenceMatcher(None, _normal(query), normal[i]).ratio())
    nearest = list(dict.fromkeys([normal.index(n) for n in close] + sharing))[:8]
    hint = f"nearest names: {shown(nearest)}" if nearest else "no name is close"
    raise SystemExit(f"error: no concept named {query!r} among the {len(names)} concepts of the run's library; "
                     f"{hint}. Give a name exactly (any case) or a concept id; `atlas inspect RUN library` lists them")


def cmd_train(args) -> int:
    from atlas.cblm.train import TrainConfig, model_folder, train, trained_metrics
    from atlas.tools.report import refresh_report

    overrides = list(args.set or [])
    if args.baseline:
        overrides.append("head=none")
    name = args.name or ("baseline" if args.baseline else "cblm")
    config = TrainConfig.from_overrides(str(Path(args.run_dir)), [f"name={name}"] + overrides)
    if not args.force and (done := trained_metrics(config)) is not None:
        print(f"{model_folder(config)} is already trained with these settings ({done.get('step')}/{config.max_steps} "
              f"steps; val_loss {done.get('val_loss', float('nan')):.4f} in metrics.json): nothing to do.\n"
              "  --force retrains it from scratch; --name NAME trains another model beside it; "
              f"`atlas cblm eval {model_folder(config)}` evaluates it again.")
        return 0
    metrics = train(config, force=args.force)
    print(json.dumps({k: v for k, v in metrics.items() if not isinstance(v, dict)}, indent=2))
    print(f"model and metrics in {Path(args.run_dir) / 'cblm' / name}")
    refresh_report(args.run_dir)  # the run report gains this model's metrics and loss curve
    return 0


def cmd_eval(args) -> int:
    from atlas.cblm import checkpoint
    from atlas.cblm.metrics import evaluate

    model, state = checkpoint.load(Path(args.model), args.device)
    train_config = state["train_config"]
    data = _model_data(args.model, state)
    metrics = evaluate(model, data, batches=None, batch_size=train_config["batch_size"], device=args.device,
                       seed=train_config["seed"], alignment=True)
    print(json.dumps(metrics, indent=2))
    if args.steering:
        from atlas.cblm.steering_eval import evaluate_steering, format_steering

        reference = checkpoint.load(Path(args.reference), args.device)[0] if args.reference else None
        strengths = [float(tau) for tau in args.strengths.split(",")]
        result = evaluate_steering(model, data, state["vocab"], strengths, reference=reference,
                                   n_concepts=args.concepts)
        print(format_steering(result))
        if reference is None:
            print("(quality: the model's own perplexity; --reference RUN/cblm/baseline scores it with the baseline)")
    if args.diagnostics:
        import sys

        from atlas.cblm.diagnostics import diagnose, format_diagnostics
        from atlas.cblm.generate import Codec

        result = diagnose(model, data, Codec(state["vocab"]), windows=args.diag_windows,
                          sentence=args.repeat_sentence, seeds=args.repeat_seeds,
                          repeats=tuple(int(n) for n in args.repeat_n.split(",")),
                          log=lambda message: print(message, file=sys.stderr, flush=True))
        print(format_diagnostics(result))
        path = Path(args.model) / "diagnostics.json"
        path.write_text(json.dumps(result, indent=2))
        print(f"diagnostics in {path}")
    return 0


def cmd_generate(args) -> int:
    from atlas.cblm import checkpoint
    from atlas.cblm.generate import Codec, generate, steering_effect, steering_for

    model, state = checkpoint.load(Path(args.model), args.device)
    codec = Codec(state["vocab"])
    if args.prototype is not None or args.category:
        return _generate_with_prototypes(args, model, codec)
    steer = concept = None
    if args.steer:
        concepts = _concepts(Path(_run_dir(args.model, state)))
        concept = find_concept([c["name"] for c in concepts], args.steer, [c.get("domain") for c in concepts])
        steer = steering_for(model, [concept], args.strength, args.layer)
    if args.compare:
        if concept is None:
            raise SystemExit("error: --compare needs --steer")
        from atlas.cblm.data import lifted_tokens

        lifted = lifted_tokens(_model_data(args.model, state), top=200, min_support=20)[concept]
        effect = steering_effect(model, codec, concept, args.strength, [args.prompt], lifted, args.max_new_tokens,
                                 args.samples, args.temperature, args.layer)
        print(f"concept {concept}: {concepts[concept]['name']}   gamma {effect['gamma']:.2f} "
              f"from layer {effect['layer']}")
        print(f"most lifted tokens: {effect['lifted_tokens'][:20]}")
        print(f"--- before ---\n{effect['text_before']}\n--- after ---\n{effect['text_after']}")
        print(f"lifted-token frequency over {args.samples} samples: {effect['lifted_frequency_before']:.4f} -> "
              f"{effect['lifted_frequency_after']:.4f}")
        return 0
    if concept is not None:
        print(f"steering {'toward' if args.strength >= 0 else 'away from'} concept {concept} "
              f"{concepts[concept]['name']!r} (strength {args.strength:g})")
    ids, dropped = codec.encode(args.prompt)
    if dropped:
        print(f"({dropped} prompt token(s) are not in this model's vocabulary and were left out)")
    for s in range(args.samples):
        out = generate(model, ids, args.max_new_tokens, args.temperature, steer=steer, seed=args.seed + s)
        print(f"--- sample {s} ---\n{codec.decode(out)}")
    return 0


def _generate_with_prototypes(args, model, codec) -> int:
    """`generate --prototype I` / `--category NAME`: the same samples without and with the logit edit."""
    from atlas.cblm.generate import generate
    from atlas.cblm.prototypes import category_edit, find_category, load_cards, prototype_edit

    if args.steer or (args.prototype is not None and args.category):
        raise SystemExit("error: give one of --steer (a concept model), --prototype or --category (a PRISM model)")
    if model.prism is None:
        raise SystemExit("error: --prototype and --category edit a PRISM model's prototypes; this model has none "
                         "(train one with --set head=prism)")
    try:
        cards = load_cards(args.model)  # names the prototype; --category needs them
    except FileNotFoundError:
        cards = None
    try:
        if args.prototype is not None:
            edit = prototype_edit(model, args.prototype, args.strength)
            named = f" ({cards[args.prototype]['name']}, {cards[args.prototype]['category']})" if cards else ""
            print(f"prototype {args.prototype}{named} clamped to {args.strength:g} of the top-1 logit")
        else:
            category = find_category(args.category)
            members = [card["prototype"] for card in cards or load_cards(args.model) if card["category"] == category]
            edit = category_edit(model, members, args.strength)
            print(f"category {category!r} ({len(members)} prototypes): {args.strength:+g} x the top-1 logit")
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"error: {e}") from None
    ids, _ = codec.encode(args.prompt)
    for s in range(args.samples):
        runs = [generate(model, ids, args.max_new_tokens, args.temperature, seed=args.seed + s, logit_edit=e)
                for e in (None, edit)]
        print(f"--- sample {s}, before ---\n{codec.decode(runs[0])}\n--- after ---\n{codec.decode(runs[1])}")
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
    if model.prism is not None:
        from atlas.cblm.prototypes import explain, load_cards, load_neighbours

        try:
            neighbours, cards = load_neighbours(args.model), load_cards(args.model)
        except FileNotFoundError as e:
            raise SystemExit(f"error: {e}") from None
        codec = Codec(state["vocab"])
        ids = codec.encode(args.text)[0][: model.config.seq_len + 1]
        print(explain(model, neighbours, ids, codec, _run_dir(args.model, state), cards, args.top))
        return 0
    if model.concepts is None:
        raise SystemExit("error: this model has no concept module (a baseline): nothing to attribute")
    codec = Codec(state["vocab"])
    names = _concept_names(Path(_run_dir(args.model, state)))
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
        for chunk_id, score in nearest_training_chunks(_run_dir(args.model, state), transducer, state_vector, k=5)[0]:
            print(f"  {score:.3f}  {chunk_id}")
    return 0


def cmd_tda(args) -> int:
    from atlas.cblm.attribution import build_training_attribution

    state = json.loads((Path(args.model) / "checkpoint" / "state.json").read_text())
    result = build_training_attribution(_run_dir(args.model, state), args.model, steps=args.steps,
                                        device=args.device, force=args.force)
    folder = Path(args.model) / "transducer"
    if result.pop("reused"):
        print(f"the transducer in {folder} is already fitted to this checkpoint with these settings "
              f"(key {result['key']}, fit.json): nothing to do; --force refits it. Its scores:")
    print(json.dumps(result, indent=2))
    print(f"transducer in {folder}; `atlas cblm attribute` lists a text's nearest training chunks")
    return 0


def cmd_prototypes(args) -> int:
    import random

    from atlas.cblm import checkpoint
    from atlas.cblm.attribution import TRANSDUCER, load_transducer
    from atlas.cblm.prototypes import (
        cards,
        format_card,
        format_measurement,
        llm_names,
        measure_attribution,
        mine_or_load,
        write_cards,
    )
    from atlas.config import config_from_dict
    from atlas.core.rundir import RunDir

    model, state = checkpoint.load(Path(args.model), args.device)
    if model.prism is None:
        raise SystemExit(f"error: {args.model} has no PRISM head (it was trained with head="
                         f"{state['train_config'].get('head', 'concepts')}); prototypes need --set head=prism")
    run_dir = _run_dir(args.model, state)
    data = _model_data(args.model, state)
    neighbours, reused = mine_or_load(
        args.model, model, data, args.top, args.windows, args.batch_size, args.seed, force=args.force,
        step=state.get("step"), progress=lambda done, total: print(f"  mined {done:,}/{total:,} windows", flush=True))
    folder = Path(args.model) / "prototypes"
    print(f"{'kept' if reused else 'mined'} the {args.top} nearest training tokens of {model.config.prototypes} "
          f"prototypes in {folder / 'neighbours.parquet'}" + (" (same checkpoint and settings)" if reused else ""))
    try:
        names = _concept_names(Path(run_dir))
    except FileNotFoundError:
        names = None
    result = cards(model, data, neighbours, names)
    config = RunDir(run_dir).read_manifest().get("config")
    if config and (named := llm_names(result, config_from_dict(config).llm)) is not None:
        # the run's LLM names the cards, as it named the concepts; offline, the cards keep their lifted words
        print(f"the {config['llm']['engine']} engine named {named} of {len(result)} cards (the others keep their "
              "offline name)", flush=True)
    print(f"{len(result)} cards in {write_cards(args.model, result)}")
    for card in random.Random(args.seed).sample(result, min(args.cards, len(result))):
        print(format_card(card))
    if args.measure:
        folder = Path(args.model) / TRANSDUCER
        transducer = load_transducer(folder, args.device) if (folder / "config.json").exists() else None
        print(format_measurement(measure_attribution(model, data, neighbours, args.measure, seed=args.seed,
                                                     run_dir=run_dir, transducer=transducer)))
        if transducer is None:
            print(f"(no transducer in {folder}: `atlas cblm tda {args.model}` fits one, for the ivfpq column)")
    return 0


def add_parser(sub) -> None:
    parser = sub.add_parser("cblm", help="the concept-bottleneck LM: train, eval, generate (steer), tda, attribute",
                            epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    cblm = parser.add_subparsers(dest="cblm_command", required=True,
                                 metavar="{train,eval,generate,tda,attribute,prototypes}")

    p = cblm.add_parser("train", help="train (or resume) on a run's token shards -> RUN/cblm/<name>",
                        epilog="settings (--set KEY=VALUE): see atlas/cblm/train.py TrainConfig. Steering training "
                               "(paper 10.2.4) is on: the log names its phases; --set steering=false skips it, "
                               "--set steering_tau=X sets the strength it trains at. Other models of the seeds: "
                               "--set head=prism (PRISM prototypes instead of concepts; head=none is --baseline), "
                               "--set mixer=prototype (the ProtoT mixer instead of attention; AR only), --set "
                               "rope=pi (signal/noise RoPE head pairs); the mixer and rope combine with any head")
    p.add_argument("run_dir", help="a run directory with token shards and a library")
    p.add_argument("--name", help="output folder under RUN/cblm (default: cblm, or baseline with --baseline)")
    p.add_argument("--baseline", action="store_true", help="no concept module: the same backbone and budget")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a training setting (repeatable)")
    p.add_argument("--force", action="store_true", help="delete what atlas cblm wrote into RUN/cblm/<name> (model, "
                                                        "log, metrics, transducer, prototypes) and train from "
                                                        "scratch; without it a trained model is kept")
    p.set_defaults(fn=cmd_train)

    p = cblm.add_parser("eval", help="validation metrics of a trained model on all held-out windows")
    p.add_argument("model", help="RUN/cblm/<name>")
    p.add_argument("--device", default="cpu")
    p.add_argument("--steering", action="store_true",
                   help="also the steering evaluation: random concepts x prompts, lifted-word frequency steered, "
                        "unsteered and suppressed, a perplexity quality proxy and their harmonic (paper Eq. 30)")
    p.add_argument("--reference", metavar="MODEL", help="with --steering: the model whose perplexity scores quality "
                                                        "(e.g. RUN/cblm/baseline; default: the model itself)")
    p.add_argument("--strengths", default="0.25,0.5,1", help="with --steering: the strengths tau (comma-separated)")
    p.add_argument("--concepts", type=int, default=24, help="with --steering: how many random concepts")
    p.add_argument("--diagnostics", action="store_true",
                   help="also diagnostics (atlas/cblm/diagnostics.py), saved to MODEL/diagnostics.json: attention "
                        "entropy and sink share per layer and head type (signal/noise with rope=pi), or the ProtoT "
                        "routing metrics and prototype-disruption effects; and the repetition-escape temperature "
                        "T_c (generation: the slow part, about a minute for the demo model)")
    p.add_argument("--diag-windows", type=int, default=64, metavar="N",
                   help="with --diagnostics: how many held-out windows the attention and routing metrics read")
    p.add_argument("--repeat-sentence", metavar="TEXT", help="with --diagnostics: the sentence s of the repetition "
                                                             "prompt 's. s. ... s.' (default 'A little alarm clock', "
                                                             "or 'A little black cat' if the vocabulary lacks a "
                                                             "token of it)")
    p.add_argument("--repeat-n", default="2,5,10", metavar="N,N",
                   help="with --diagnostics: how many times s is repeated (comma-separated)")
    p.add_argument("--repeat-seeds", type=int, default=10, metavar="K",
                   help="with --diagnostics: samples per temperature (escape rates are in steps of 1/K)")
    p.set_defaults(fn=cmd_eval)

    p = cblm.add_parser("generate", help="continue a prompt, optionally steered toward (or away from) a concept")
    p.add_argument("model", help="RUN/cblm/<name>")
    p.add_argument("--prompt", default="", help="text to continue")
    p.add_argument("--steer", help="a concept of the run's library: its name (any case) or its id")
    p.add_argument("--strength", type=float, default=0.5,
                   help="tau: > 0 amplifies, < 0 suppresses (a steering-trained model: 0.25-1; larger repeats the "
                        "concept's words); with --prototype or --category: the fraction f of the top-1 logit "
                        "(-1 to 1)")
    p.add_argument("--prototype", type=int, metavar="I", help="a PRISM model: clamp prototype I at every token so "
                   "that its largest logit contribution is --strength times the top-1 logit (0 removes it)")
    p.add_argument("--category", metavar="NAME", help="a PRISM model: add --strength times the top-1 logit along the "
                   "summed signatures of the active prototypes whose card has this category (e.g. numbers, "
                   "punctuation, function, pieces, names, content; cards from `atlas cblm prototypes`)")
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
    p.add_argument("--force", action="store_true", help="refit even when the transducer was fitted to this "
                                                        "checkpoint with these settings")
    p.add_argument("--device", default="cpu")
    p.set_defaults(fn=cmd_tda)

    p = cblm.add_parser("attribute", help="the known concepts behind a text's next-token logits (exact); for a PRISM "
                                          "model its prototypes and the training chunks they were mined from")
    p.add_argument("model", help="RUN/cblm/<name>")
    p.add_argument("text")
    p.add_argument("--top", type=int, default=10)
    p.add_argument("--device", default="cpu")
    p.set_defaults(fn=cmd_attribute)

    p = cblm.add_parser("prototypes", help="a PRISM model: mine each prototype's nearest training tokens, write "
                                           "prototype cards, measure the one-pass training-data attribution",
                        description="Mines, in one pass over the training windows, each prototype's --top nearest "
                                    "input positions (by cosine) into MODEL/prototypes/neighbours.parquet (kept when "
                                    "mined from the same checkpoint with the same settings), writes a card per "
                                    "prototype (top logit tokens, contexts, name, category, Atlas concept, usage) to "
                                    "MODEL/prototypes/cards.json and prints --cards random cards.")
    p.add_argument("model", help="RUN/cblm/<name>, trained with --set head=prism")
    p.add_argument("--top", type=int, default=16, help="neighbours kept per prototype (L)")
    p.add_argument("--cards", type=int, default=10, help="how many random cards to print")
    p.add_argument("--windows", type=int, default=None, metavar="N",
                   help="mine N random training windows instead of all (the source: ~1%% of the data suffices)")
    p.add_argument("--batch-size", type=int, default=16, help="windows per forward pass while mining")
    p.add_argument("--measure", type=int, default=0, metavar="N",
                   help="also measure the attribution on N held-out positions against random chunks and the "
                        "transducer into the IVFPQ index (fitted by `atlas cblm tda MODEL`)")
    p.add_argument("--force", action="store_true", help="mine again even when the saved neighbours match")
    p.add_argument("--seed", type=int, default=0, help="draws --windows, the printed cards and the measured "
                                                       "positions")
    p.add_argument("--device", default="cpu")
    p.set_defaults(fn=cmd_prototypes)
