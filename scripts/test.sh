#!/usr/bin/env bash
# README command 2: set up, lint (ruff, the rules in pyproject.toml) and run the whole test suite (offline; slow tests
# included).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check --no-cache .
.venv/bin/python -m pytest "$@"
