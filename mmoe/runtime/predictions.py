"""Predictions over several processes: gathered in rank order, one entry kept per sample."""

from __future__ import annotations

import torch


def unique_entries(entries: list, key: str | int) -> list:
    """The first entry of each distinct ``entry[key]``, in order of first appearance."""
    unique: dict = {}
    for entry in entries:
        unique.setdefault(entry[key], entry)
    return list(unique.values())


def as_ids(values: torch.Tensor | list) -> list:
    """A batch's per-sample ids as a Python list (a collated long tensor becomes ints)."""
    return values.tolist() if isinstance(values, torch.Tensor) else list(values)


def gather_objects(items: list) -> list:
    """Concatenation of ``items`` over all processes (each process's list, in rank order); ``items`` itself when
    not distributed."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return items
    gathered: list[list] = [[] for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather_object(gathered, items)
    return [item for part in gathered for item in part]
