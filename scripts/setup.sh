#!/usr/bin/env bash
# Create .venv with Python 3.11 and install Atlas with the pinned, tested versions.
# Idempotent: a second run only checks that everything is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null || PYTHON=python3
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
EXTRAS="${ATLAS_EXTRAS:-dev,embed,library,cluster,s3}"  # embed: torch (CPU), sentence-transformers, MiniLM; library: faiss, louvain; cluster: ray, prefect-ray; s3: s3fs (s3:// inputs)
.venv/bin/python -m pip install --quiet --disable-pip-version-check \
  -c requirements/constraints.txt -e ".[${EXTRAS}]"
