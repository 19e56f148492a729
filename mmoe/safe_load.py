"""Read a ``torch.save`` file without running anything in it: ``torch.load(weights_only=True)`` on the CPU, with
one-line errors that name the file, what it was to the caller and what was expected.

Unpickling with ``weights_only=True`` rebuilds only tensors, containers, numbers, strings and classes registered with
``torch.serialization.add_safe_globals`` (mmoe registers its backbone configs in :mod:`mmoe.runtime.checkpoint`) or
allowed for one load by its caller (``allowed``: a VQ-KD file's ``argparse.Namespace``), never an arbitrary callable, so
a crafted file cannot run code. The format is found from the bytes, not the file name: a ``.pth`` saved as ``.zip`` (a
torch zip archive under another name) reads like any other.

:func:`require_finite_weights` is the one check every command that uses a checkpoint's weights (``mmoe infer``,
``predict``, ``export``, ``export-backbone``, ``upcycle``) runs before any work: NaN or infinite weights are refused.
"""

from __future__ import annotations

import pickle
import re
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

#: The first bytes of a zip archive: ``torch.save``'s format since PyTorch 1.6.
ZIP_MAGIC = b"PK\x03\x04"
#: What a caller that names nothing more specific expects.
TORCH_FILE = "a file written by torch.save"


def load_checkpoint_file(
    path: str | Path, what: str = "checkpoint", expected: str = TORCH_FILE, allowed: Sequence[type] = ()
) -> dict:
    """The dict ``torch.save``d in ``path``, loaded with ``weights_only=True`` on the CPU.

    Args:
        path: the file.
        what: what the file is to the caller, first word of the errors (``"checkpoint"``, ``"visual codebook"``).
        expected: what the file should be, named when it is not.
        allowed: classes of plain data this file may hold beside its weights (e.g. ``argparse.Namespace``, the
            training arguments a release saves), allowed for this load only (``torch.serialization.safe_globals``).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: ``path`` is not a readable ``torch.save`` file of a dict (empty, truncated, another format), or it
            asks to import a class or function outside the allowed ones; one line naming ``path``.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{what} {path} does not exist")
    if not path.is_file():
        raise ValueError(f"{what} {path} is not a file (expected {expected})")
    try:
        with warnings.catch_warnings(), torch.serialization.safe_globals(list(allowed)):
            # torch's weights-only unpickler warns on every pickle protocol but 2, then reads protocol 3 and fails on
            # 4 and 5 (which the error below names in one line): torch's own doubt, nothing the caller can act on.
            warnings.filterwarnings("ignore", r"Detected pickle protocol \d+ in the checkpoint", UserWarning)
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 - torch raises many types for a bad file; each is reported in one line
        refused = re.search(r"GLOBAL ([\w.]+)", str(error)) if isinstance(error, pickle.UnpicklingError) else None
        if refused:
            raise ValueError(
                f"{what} {path} was refused: it asks to import {refused.group(1)}, and mmoe loads only tensors, "
                "numbers, strings, lists, dicts and its own configs from a checkpoint (nothing in the file was run)"
            ) from None
        raise ValueError(f"{what} {path} could not be read: {unreadable_reason(path)} (expected {expected})") from None
    if not isinstance(state, dict):
        raise ValueError(f"{what} {path} holds a {type(state).__name__}, expected a dict ({expected})")
    return state


def unreadable_reason(path: Path) -> str:
    """Why ``torch.load`` failed on ``path``, in words, from its first bytes."""
    with path.open("rb") as file:
        head = file.read(len(ZIP_MAGIC))
    if not head:
        return "the file is empty"
    if head == ZIP_MAGIC:
        return "the file is truncated or corrupted (its zip archive cannot be read)"
    return "the file is not in torch.save's format"


def named_tensors(value: object, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """(dotted name, tensor) for every tensor in ``value``, nested dicts and lists walked, in the order stored."""
    if isinstance(value, torch.Tensor):
        yield prefix.removesuffix("."), value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from named_tensors(item, f"{prefix}{key}.")
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from named_tensors(item, f"{prefix}{index}.")


def require_finite_weights(state: dict, path: str | Path, what: str = "checkpoint") -> None:
    """Refuses weights that hold NaN or infinity (a diverged run's): inference would answer ``nan`` and an export
    would hand them on, both without a word.

    Args:
        state: what :func:`load_checkpoint_file` returned, or a plain dict of weights: its ``state_dict`` (a Lightning
            checkpoint, an exported backbone), its ``model`` (a released BEiT-3 file) or the dict itself is checked.
        path: the file, named in the error.
        what: what the file is to the caller, first word of the error.

    Raises:
        ValueError: one line naming ``path``, how many of its tensors are not finite and the first of them.
    """
    weights = next((state[key] for key in ("state_dict", "model") if isinstance(state.get(key), dict)), state)
    tensors = list(named_tensors(weights))
    bad = [name for name, tensor in tensors if tensor.is_floating_point() and not is_finite(tensor)]
    if bad:
        raise ValueError(
            f"{what} {path} holds non-finite weights: {len(bad)} of its {len(tensors)} tensors hold NaN or Inf, the "
            f"first {bad[0]} (a diverged run? use a checkpoint saved before its loss became NaN)"
        )


def is_finite(tensor: torch.Tensor) -> bool:
    """Whether every element of a floating-point ``tensor`` is finite. A sum is finite only if every element is (NaN
    and infinities carry through it), and summing is several times faster than testing each element, which is done
    only when the sum is not finite (an element is not, or the sum overflowed)."""
    total = tensor.sum(dtype=torch.float32 if tensor.element_size() < 4 else None)
    return bool(torch.isfinite(total)) or bool(torch.isfinite(tensor).all())
