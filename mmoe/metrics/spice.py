"""SPICE through pycocoevalcap's ``spice-1.0.jar``, only when it can run, never downloading anything.

pycocoevalcap's ``Spice()`` downloads Stanford CoreNLP 3.6.0 (about 400 MB) when its jars are missing and runs the jar
without a time limit. mmoe checks for the jars first and reports SPICE as unavailable, with a one-line reason, when
they are absent, when Java is missing, when the jar fails (it is reported to fail on recent Java versions) or when it
runs past a time limit. When it runs, the input, the jar's flags (``-subset -silent``, ``-Xmx8G``) and the averaging
(``numpy.mean`` of each image's ``All.f``, in the jar's output order) are those of ``pycocoevalcap/spice/spice.py``;
only its ``-cache`` directory is left out, which changes speed, not scores.
"""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
import subprocess
import tempfile
from collections.abc import Hashable, Mapping, Sequence
from pathlib import Path

import numpy as np

#: Where pycocoevalcap keeps ``spice-1.0.jar`` and its ``lib/``; found without importing ``spice.py``.
SPICE_DIR = Path(importlib.util.find_spec("pycocoevalcap.spice").submodule_search_locations[0])

#: What ``spice-1.0.jar`` needs beside its bundled ``lib/`` jars (the ones pycocoevalcap would download).
REQUIRED_JARS = ("spice-1.0.jar", "lib/stanford-corenlp-3.6.0.jar", "lib/stanford-corenlp-3.6.0-models.jar")


def spice_unavailable_reason(spice_dir: Path | None = None) -> str | None:
    """Why SPICE cannot run here, in one line, or ``None`` if everything it needs is present."""
    spice_dir = SPICE_DIR if spice_dir is None else spice_dir
    if shutil.which("java") is None:
        return "java not found on PATH"
    missing = [name for name in REQUIRED_JARS if not (spice_dir / name).is_file()]
    if missing:
        return (
            f"Stanford CoreNLP jars not found: {', '.join(missing)} under {spice_dir} "
            "(pycocoevalcap downloads them on first use; mmoe never downloads)"
        )
    return None


def compute_spice(
    references: Mapping[Hashable, Sequence[str]],
    candidates: Mapping[Hashable, str],
    timeout: float,
    spice_dir: Path | None = None,
) -> tuple[float | None, str | None]:
    """Corpus SPICE of PTB-tokenized captions, or ``(None, reason)`` when it cannot be computed.

    Args:
        references: image id -> tokenized reference captions.
        candidates: image id -> tokenized candidate caption, same ids as ``references``.
        timeout: seconds after which the jar is killed and SPICE reported unavailable.
        spice_dir: folder holding ``spice-1.0.jar`` (default: pycocoevalcap's).

    Returns:
        ``(score, None)`` on success, ``(None, one-line reason)`` otherwise.
    """
    spice_dir = SPICE_DIR if spice_dir is None else spice_dir
    reason = spice_unavailable_reason(spice_dir)
    if reason is not None:
        return None, reason
    image_ids = sorted(references)  # pycocoevalcap sorts the ids before writing the jar's input
    records = [{"image_id": i, "test": candidates[i], "refs": list(references[i])} for i in image_ids]
    with tempfile.TemporaryDirectory(prefix="mmoe-spice-") as work:
        in_file, out_file = Path(work) / "input.json", Path(work) / "output.json"
        in_file.write_text(json.dumps(records, indent=2))
        command = ["java", "-jar", "-Xmx8G", str(spice_dir / "spice-1.0.jar"), str(in_file)]
        command += ["-out", str(out_file), "-subset", "-silent"]
        try:
            subprocess.run(command, cwd=spice_dir, capture_output=True, check=True, timeout=timeout)
            results = json.loads(out_file.read_text())
            scores = [_as_float(item["scores"]["All"]["f"]) for item in results]
        except subprocess.TimeoutExpired:
            return None, f"spice-1.0.jar ran past the {timeout:g} s limit and was stopped"
        except subprocess.CalledProcessError as error:
            return None, f"spice-1.0.jar failed with exit code {error.returncode}: {_last_line(error.stderr)}"
        except (OSError, ValueError, KeyError, TypeError) as error:
            return None, f"spice-1.0.jar gave no usable output: {type(error).__name__}: {error}"
    score = float(np.mean(np.array(scores))) if scores else math.nan
    if math.isnan(score):
        return None, "spice-1.0.jar returned no score for some images (NaN)"
    return score, None


def _as_float(value: object) -> float:
    """pycocoevalcap's ``float_convert``: anything that is not a number counts as NaN."""
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return math.nan


def _last_line(stderr: bytes | None) -> str:
    lines = (stderr or b"").decode(errors="replace").strip().splitlines()
    return lines[-1][:200] if lines else "no message"
