#!/usr/bin/env bash
# README command 1: set up, build the offline demo corpus, and run the pipeline on it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/atlas demo-corpus demo_data/corpus.jsonl
.venv/bin/atlas run configs/demo.yaml "$@"
.venv/bin/atlas status runs/demo
# The concept-bottleneck LM on the demo's token shards: a toy model, about a minute on 2 CPU cores (resumes if
# killed). A second run of this script recomputes nothing: train and tda say the model and transducer are there.
.venv/bin/atlas cblm train runs/demo
.venv/bin/atlas cblm tda runs/demo/cblm/cblm --steps 300
echo
echo "Look at a few chunks and their tags:  .venv/bin/atlas inspect runs/demo tags -n 3"
echo "Held-out chunks with predicted concepts:  .venv/bin/atlas inspect runs/demo annotator -n 3"
echo "Nearest training chunks:  .venv/bin/atlas search runs/demo \"how do I open a file for writing?\" -k 3"
echo "Label any text:  .venv/bin/atlas annotate-text runs/demo \"Binary search halves the interval at every step.\""
echo "Generate, steered toward a concept:  .venv/bin/atlas cblm generate runs/demo/cblm/cblm --prompt \"The\" --steer \"python program\" --strength 0.5 --compare"
echo "Which concepts carry a text's logits:  .venv/bin/atlas cblm attribute runs/demo/cblm/cblm \"import os\""
