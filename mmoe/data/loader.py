"""The DataLoader over a resumable stream: batches in a fixed worker order, the position of the last consumed batch and
the skip counts, saved in and restored from Lightning checkpoints."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader

from mmoe.data.accounting import END, Delivery, SkipCount, UnusableStreamError, add_skips
from mmoe.data.streams import ResumableStream
from mmoe.data.workers import ignoring_stop_signals, started_with_stop_signals_blocked


class EpochDataLoader(DataLoader):
    """A DataLoader over a :class:`ResumableStream` that tells it the epoch each time it is iterated, counts the
    samples its streams skipped, and saves and restores its position (``state_dict`` / ``load_state_dict``, which
    Lightning stores in checkpoints and restores on ``--ckpt_path``), so a resumed run gets exactly the batches the
    uninterrupted run would have got, in the same order.

    Batches come from the DataLoader workers in turn (round robin; a worker whose stream ended drops out), as a
    DataLoader delivers them; the loader keeps that order itself, so it can pick it up again at any worker.

    A batch counts as consumed once the next one is asked for, or the stream ends: Lightning's training loop asks for
    the next batch before it runs the current one (it prefetches one to see the end of a loader without a length), so
    at a checkpoint every batch up to the one just trained on is consumed, and the one held back is not.

    Its workers ignore termination signals (:mod:`mmoe.data.workers`): the main process handles them and shuts the
    workers down.

    Args:
        skipped: the dict to count skipped samples in (see Attributes); a new one by default. Lightning builds a new
            loader from this one's arguments for ``predict``: passing the dict keeps both counting in one place.

    Attributes:
        skipped: stream name -> :class:`SkipCount` of the samples skipped on the way to the batches consumed so far
            (this process; kept across a resume).
    """

    def __init__(self, *args, skipped: dict[str, SkipCount] | None = None, **kwargs) -> None:
        kwargs["worker_init_fn"] = ignoring_stop_signals(kwargs.get("worker_init_fn"))
        super().__init__(*args, **kwargs)
        self._epochs_started = 0
        self.resumable = isinstance(self.dataset, ResumableStream)
        if self.resumable:
            self.dataset.tracked = True
        self.skipped: dict[str, SkipCount] = {} if skipped is None else skipped
        for name in self.dataset.stream_names() if self.resumable else []:
            self.skipped.setdefault(name, SkipCount())
        self._epoch = 0
        self._finished = False
        self._positions: dict[str, Any] = {}
        self._next_worker = 0
        self._held: tuple[Delivery, int] | None = None
        self._restored: dict[str, Any] | None = None

    def __iter__(self):
        start: dict[str, Any] = {}
        next_worker = 0
        if self._restored is not None:
            start, next_worker = self._start_of_restored(self._restored)
            self._restored = None
        epoch = self._epochs_started
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)
        self._epochs_started += 1
        if not self.resumable:
            return started_with_stop_signals_blocked(super().__iter__)
        self.dataset.start = start
        self._epoch, self._finished, self._held = epoch, False, None
        self._positions, self._next_worker = dict(start), next_worker
        return self._consume(started_with_stop_signals_blocked(super().__iter__))

    def _consume(self, deliveries: Iterator[Delivery]) -> Iterator[Any]:
        rank = self.dataset.process_rank()
        workers = list(range(max(1, self.num_workers)))
        active = [w for w in workers if self._positions.get(f"{rank}/{w}") != END]
        turn = active.index(self._next_worker) if self._next_worker in active else 0
        waiting: dict[int, list[Delivery]] = {w: [] for w in workers}
        for delivery in _own_errors(deliveries):
            waiting[int(delivery.consumer.split("/")[1])].append(delivery)
            while active and waiting[active[turn]]:
                worker = active[turn]
                delivery = waiting[worker].pop(0)
                self._commit()
                if delivery.batch is None:  # this worker's stream ended
                    add_skips(self.skipped, delivery.skipped)
                    self._positions[delivery.consumer] = END
                    active.pop(turn)
                    turn = turn % len(active) if active else 0
                    continue
                turn = (turn + 1) % len(active)
                self._held = (delivery, active[turn])
                yield delivery.batch
        self._commit()
        self._finished = True

    def _commit(self) -> None:
        if self._held is not None:
            delivery, self._next_worker = self._held
            self._positions[delivery.consumer] = delivery.position
            add_skips(self.skipped, delivery.skipped)
            self._held = None

    def _layout(self) -> list[int]:
        world_size = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        return [world_size, self.num_workers]

    def state_dict(self) -> dict[str, Any]:
        """The epoch, whether it ended, each consumer's position after its last consumed batch, the worker whose
        batch comes next, and the skip counts (of every process, when distributed: call it on all ranks, as
        Lightning does)."""
        own = {
            "positions": {key: _position_as_ints(position) for key, position in self._positions.items()},
            "next_worker": self._next_worker,
            "skipped": {stream: count.to_state() for stream, count in self.skipped.items()},
        }
        parts = [own]
        if torch.distributed.is_initialized():
            parts = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(parts, own)
        return {
            "epoch": self._epoch,
            "finished": self._finished,
            "layout": self._layout(),
            "positions": {key: value for part in parts for key, value in part["positions"].items()},
            "next_worker": {str(rank): part["next_worker"] for rank, part in enumerate(parts)},
            "skipped": {str(rank): part["skipped"] for rank, part in enumerate(parts)},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores a :meth:`state_dict`; the next iteration continues from it."""
        self._restored = state

    def _start_of_restored(self, state: dict[str, Any]) -> tuple[dict[str, Any], int]:
        rank = str(self.dataset.process_rank() if self.resumable else 0)
        for stream, count in state.get("skipped", {}).get(rank, {}).items():
            self.skipped[stream] = SkipCount.from_state(count)
        self._epochs_started = int(state["epoch"]) + bool(state["finished"])
        if state["finished"]:
            return {}, 0
        if list(state["layout"]) != self._layout():
            warnings.warn(
                f"the checkpoint's data position was saved with {state['layout'][0]} process(es) x "
                f"{state['layout'][1]} loader worker(s), this run has {self._layout()[0]} x {self._layout()[1]}: "
                f"epoch {state['epoch']} of the training data restarts from its beginning (not an exact resume)",
                stacklevel=2,
            )
            return {}, 0
        return dict(state["positions"]), int(state["next_worker"].get(rank, 0))


def _own_errors(deliveries: Iterator[Delivery]) -> Iterator[Delivery]:
    """``deliveries``, with an :class:`UnusableStreamError` from a DataLoader worker raised with its own message."""
    try:
        yield from deliveries
    except UnusableStreamError as error:
        raise UnusableStreamError.from_worker(error) from None


def _position_as_ints(position: Any) -> Any:
    """A position as lists and dicts of ints (what ``torch.load(weights_only=True)`` reads back)."""
    if position == END:
        return END
    if isinstance(position, dict):
        return {key: _position_as_ints(value) for key, value in position.items()}
    if isinstance(position, tuple | list):
        return [int(value) for value in position]
    return position
