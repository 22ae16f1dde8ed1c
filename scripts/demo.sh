#!/usr/bin/env bash
# README command 1: set up, build the offline demo corpus, and run the pipeline on it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/atlas demo-corpus demo_data/corpus.jsonl
.venv/bin/atlas run configs/demo.yaml "$@"
.venv/bin/atlas status runs/demo
echo
echo "Look at a few chunks and their tags:  .venv/bin/atlas inspect runs/demo tags -n 3"
echo "Held-out chunks with predicted concepts:  .venv/bin/atlas inspect runs/demo annotator -n 3"
echo "Nearest training chunks:  .venv/bin/atlas search runs/demo \"how do I open a file for writing?\" -k 3"
echo "Label any text:  .venv/bin/atlas annotate-text runs/demo \"Binary search halves the interval at every step.\""
