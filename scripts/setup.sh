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

# A fresh environment: torch's install (mostly unpacking its CUDA libraries, several GB) and the download of everything
# else run side by side, on two cores; the rest then installs from those files without asking an index again (about
# 20 s less than one after the other). Where torch is already installed, pip installs only what is missing.
offline=()
# shellcheck disable=SC2086
if ! .venv/bin/python -c "import torch, torchvision" >/dev/null 2>&1; then
    wheels="$(mktemp -d)"
    trap 'rm -rf "$wheels"' EXIT
    # with pyproject.toml's [build-system] requirements: the editable install builds mmoe from these files
    "${pip[@]}" download -d "$wheels/files" $torch_spec ".[dev,docs,eval]" "setuptools>=68" wheel >"$wheels/log" 2>&1 &
    downloading=$!
    "${pip[@]}" install $torch_spec
    if ! wait "$downloading"; then
        cat "$wheels/log" >&2
        exit 1
    fi
    offline=(--no-index --find-links "$wheels/files")
fi
# dev: the test tools; docs: mkdocs, its material theme and mkdocstrings, which tests/test_docs_site.py builds the site
# with
"${pip[@]}" install "${offline[@]}" -e ".[dev,docs]"

# The eval extra (CLIP_benchmark, whose own evaluation the harness tests call, and what it pulls: transformers,
# scikit-learn, SciPy) in .venv-eval/, an environment layered over .venv/ (it sees every package of .venv/ and adds
# these). Not in .venv/ itself: torchmetrics, which Lightning imports, imports transformers and SciPy whenever they are
# installed, about 1.3 s more CPU for every process that imports Lightning. tests/test_eval_extra.py runs the tests
# that need the extra with .venv-eval/bin/python.
if [ ! -x .venv-eval/bin/python ]; then
    "$python_bin" -m venv --without-pip .venv-eval  # .venv/'s pip, seen through the .pth below, installs here
fi
site_packages() { "$1" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }
echo "import site; site.addsitedir('$(site_packages .venv/bin/python)')" >"$(site_packages .venv-eval/bin/python)/mmoe-venv.pth"
.venv-eval/bin/python -m pip --disable-pip-version-check -q install "${offline[@]}" -e ".[eval]"

# mmoe's own modules byte-compiled once: where PYTHONDONTWRITEBYTECODE is set, no process writes them itself and every
# one compiled mmoe's ~200 modules from source again (about 0.1 s each; the test suite starts ~110 processes).
.venv/bin/python -m compileall -q mmoe

# Test-only peer: the released BEiT-3 implementation, benchmarked against in benchmarks/backbone.py.
# torchscale pins old dependencies, so it goes in without them (its fairscale import is satisfied by fairscale 0.4.0).
if ! .venv/bin/python -c "import torchscale" >/dev/null 2>&1; then
    "${pip[@]}" install --no-deps "torchscale==0.3.0" "fairscale==0.4.0" || echo "setup: torchscale peer not installed (benchmarks skip it)" >&2
fi
echo "setup: .venv ready ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))"
