#!/usr/bin/env bash
# README command 2: set up and run the whole test suite (offline; slow tests included).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m pytest "$@"
