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

# uv installs: it resolves, downloads and unpacks in parallel (a fresh set-up takes about 39 s with it, 98 s with
# pip, on two cores). pip installs uv; uv gets pip's index settings (scripts/uv_index_options.py), with pip's
# choices: the best match over all indexes, no pre-releases. And pip's byte-compiling: uv writes no .pyc files unless
# asked, and where PYTHONDONTWRITEBYTECODE is set no process writes them either, so every process would compile torch
# and Lightning from source again (seconds of CPU each: the test suite was at 96% after 25 minutes, against 19 in all).
.venv/bin/python -c "import uv" >/dev/null 2>&1 || "${pip[@]}" install "uv>=0.9"
# read in two steps: a failure inside a process substitution would not stop the script (pipefail stops it here)
index_lines="$(.venv/bin/python -m pip config list | .venv/bin/python scripts/uv_index_options.py)"
mapfile -t index_options < <(printf '%s' "$index_lines")
uv_options=(-q --index-strategy unsafe-best-match --prerelease disallow "${index_options[@]}")
uv=(.venv/bin/uv pip install "${uv_options[@]}")
# dev: the test tools; docs: mkdocs, its material theme and mkdocstrings, which tests/test_docs_site.py builds the site
# with
# shellcheck disable=SC2086
"${uv[@]}" --python .venv/bin/python --compile-bytecode $torch_spec -e ".[dev,docs]"

# The eval extra (CLIP_benchmark, whose own evaluation the harness tests call, and what it pulls: transformers,
# scikit-learn, SciPy) in .venv-eval/, an environment layered over .venv/ (it sees every package of .venv/ and adds
# these). Not in .venv/ itself: torchmetrics, which Lightning imports, imports transformers and SciPy whenever they are
# installed, about 1.3 s more CPU for every process that imports Lightning. uv resolves the extra at .venv/'s versions
# (its constraints) and installs what .venv/ lacks. tests/test_eval_extra.py runs the tests that need the extra with
# .venv-eval/bin/python.
if [ ! -x .venv-eval/bin/python ]; then
    "$python_bin" -m venv --without-pip .venv-eval
fi
site_packages() { "$1" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }
echo "import site; site.addsitedir('$(site_packages .venv/bin/python)')" >"$(site_packages .venv-eval/bin/python)/mmoe-venv.pth"
requirements="$(mktemp -d)"
trap 'rm -rf "$requirements"' EXIT
.venv/bin/uv pip freeze --python .venv/bin/python --exclude-editable >"$requirements/venv.txt"
.venv/bin/uv pip compile "${uv_options[@]}" --python .venv/bin/python --no-header --no-annotate --extra eval \
    --constraint "$requirements/venv.txt" pyproject.toml >"$requirements/eval.txt"
grep -vxF -f "$requirements/venv.txt" "$requirements/eval.txt" >"$requirements/eval-only.txt" || true
"${uv[@]}" --python .venv-eval/bin/python --compile-bytecode --no-deps -r "$requirements/eval-only.txt" -e .

# mmoe's own modules byte-compiled once: where PYTHONDONTWRITEBYTECODE is set, no process writes them itself and every
# one compiled mmoe's ~200 modules from source again (about 0.1 s each; the test suite starts ~110 processes).
.venv/bin/python -m compileall -q mmoe

# Test-only peer: the released BEiT-3 implementation, benchmarked against in benchmarks/backbone.py.
# torchscale pins old dependencies, so it goes in without them (its fairscale import is satisfied by fairscale 0.4.0).
if ! .venv/bin/python -c "import torchscale" >/dev/null 2>&1; then
    "${uv[@]}" --python .venv/bin/python --no-deps "torchscale==0.3.0" "fairscale==0.4.0" || echo "setup: torchscale peer not installed (benchmarks skip it)" >&2
fi
echo "setup: .venv ready ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))"
