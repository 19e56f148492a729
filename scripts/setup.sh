#!/usr/bin/env bash
# Creates .venv/ at the repo root with everything mmoe needs, offline apart from the package registries.
# Idempotent: a second run only installs what is missing.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

python_bin="${PYTHON:-python3.11}"
command -v "$python_bin" >/dev/null 2>&1 || python_bin=python3
# torch / torchvision at the versions that lie on this machine's disk; override for other machines.
torch_spec="${MMOE_TORCH_SPEC:-torch==2.14.1 torchvision==0.29.1}"

if [ ! -x .venv/bin/python ]; then
    "$python_bin" -m venv .venv
fi
pip=(.venv/bin/python -m pip --disable-pip-version-check -q)

# shellcheck disable=SC2086
if ! .venv/bin/python -c "import torch, torchvision" >/dev/null 2>&1; then
    "${pip[@]}" install $torch_spec
fi
# dev: the test tools; eval: CLIP_benchmark, whose own evaluation the harness tests call (about 10 s, 19 packages);
# docs: mkdocs, its material theme and mkdocstrings, which tests/test_docs_site.py builds the site with
"${pip[@]}" install -e ".[dev,eval,docs]"

# Test-only peer: the released BEiT-3 implementation, benchmarked against in benchmarks/backbone.py.
# torchscale pins old dependencies, so it goes in without them (its fairscale import is satisfied by fairscale 0.4.0).
if ! .venv/bin/python -c "import torchscale" >/dev/null 2>&1; then
    "${pip[@]}" install --no-deps "torchscale==0.3.0" "fairscale==0.4.0" || echo "setup: torchscale peer not installed (benchmarks skip it)" >&2
fi
echo "setup: .venv ready ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))"
