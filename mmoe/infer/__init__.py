"""``mmoe infer <task>``: a fine-tuned checkpoint on the user's own images, without training loaders.

The task is rebuilt from the checkpoint alone (its saved arguments and weights, :mod:`mmoe.infer.load`); images are
decoded, resized and normalised as its evaluation data was (the task's ``image_transform``: mmoe's
:func:`mmoe.data.transforms.eval_transform` at the backbone's image size, timm's for classification), texts tokenized
with its tokenizer. Any image size and mode is read (16-bit greyscale included), turned upright as its EXIF orientation
says (:mod:`mmoe.infer.images`). The subcommands are the fine-tuning tasks of
:data:`mmoe.tasks.catalog.FINETUNING_TASKS`; each task's inference spec (:data:`mmoe.tasks.catalog.INFER_SPECS`) says
what one input is and what the answer looks like (``run``, ``folder_entry``), and each result formats itself
(:mod:`mmoe.tasks.inference`, :mod:`mmoe.infer.results`):

* ``vqav2`` (or ``vqa``) ``--image photo.jpg --question "..." [--top-k 5]``: answers with their sigmoid scores
  (BEiT-3's VQA head is trained with binary cross-entropy).
* ``captioning`` (or ``caption``) ``--image photo.jpg [--beam 3]``: the caption (beam search, the checkpoint's length
  settings).
* ``nlvr2 --left a.png --right b.png --sentence "..."``: true / false and the probability of true.
* ``classification`` (or ``classify``) ``--image photo.jpg [--top-k 5]``: the most probable classes, named from the
  checkpoint's ``classes.json``, with their softmax probabilities.
* ``--image DIR`` (one-image tasks): every image of the folder, with a progress bar, into ``--out`` (captions in the
  COCO results format ``[{"file", "image_id", "caption"}]``; VQA ``[{"file", "question", "answer", "score"}]``),
  written whole or not at all; every entry names its file (:mod:`mmoe.infer.folder`: image ids).
* ``--shards SPLIT`` (a converted split folder, shard file or glob): every sample, decoded by the task's own decoder,
  into ``--out`` in the benchmark's format, the one ``mmoe predict`` writes (the task's ``prediction_entries`` and
  predictions file); corrupt samples are skipped and counted. Fewer results than the split's manifests hold (corrupt
  or lost samples) end in one line and exit 2, as in ``mmoe predict``, unless ``--allow-partial-results``; the file
  is written either way.
* ``--routing map.png``: the sub-token expert map of the image(s) (MH-MoE Fig. 1b: distinct experts per patch, top
  choices, every MoE layer) and, in the output, the experts each text token went to in every MoE layer.

Bad input (unreadable image, missing checkpoint, a checkpoint of another task, a pre-training checkpoint or a bare
backbone, an ``--out`` or ``--routing`` that cannot be written, checked before any work) is one line on stderr and
exit 2.
"""

from mmoe.infer.command import infer_command

__all__ = ["infer_command"]
