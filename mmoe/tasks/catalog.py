"""Which fine-tuning tasks exist: task name -> task class, the one place a name is resolved.

Everything particular to a task's training lives on its class (:class:`mmoe.tasks.finetuning.FineTuningTask`): its
name, its released BEiT-3 head names, its head's parameter count, its prediction entries and its predictions file.
What ``mmoe infer`` needs of it lives beside it, in its :class:`mmoe.tasks.inference.InferSpec`
(:data:`INFER_SPECS`). ``mmoe infer``, ``mmoe info``, the demo and the claims study read them from here.
"""

from __future__ import annotations

from mmoe.tasks.captioning import CaptioningFineTuning
from mmoe.tasks.classification import ImageClassificationFineTuning
from mmoe.tasks.finetuning import FineTuningTask
from mmoe.tasks.infer_specs import CAPTIONING_INFER, CLASSIFICATION_INFER, NLVR2_INFER, RETRIEVAL_INFER, VQA_INFER
from mmoe.tasks.inference import InferSpec
from mmoe.tasks.nlvr2 import NLVR2FineTuning
from mmoe.tasks.retrieval import RetrievalFineTuning
from mmoe.tasks.vqa import VQAFineTuning

#: Task name -> task class, in the order the demo runs them.
FINETUNING_TASKS: dict[str, type[FineTuningTask]] = {
    task.name: task
    for task in (
        VQAFineTuning,
        NLVR2FineTuning,
        CaptioningFineTuning,
        RetrievalFineTuning,
        ImageClassificationFineTuning,
    )
}

#: Task name -> what ``mmoe infer <name>`` needs of the task, one subcommand each, in the catalog's order.
INFER_SPECS: dict[str, InferSpec] = {
    spec.task.name: spec for spec in (VQA_INFER, NLVR2_INFER, CAPTIONING_INFER, RETRIEVAL_INFER, CLASSIFICATION_INFER)
}


def class_path(task: type) -> str:
    """The ``model.class_path`` of a task class in configs and checkpoints."""
    return f"{task.__module__}.{task.__qualname__}"


def task_of_class_path(path: str) -> type[FineTuningTask] | None:
    """The fine-tuning task class saved as ``path`` (a checkpoint's ``_class_path``), None for another class."""
    return next((task for task in FINETUNING_TASKS.values() if class_path(task) == path), None)
