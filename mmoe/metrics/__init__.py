"""Benchmark metrics that equal the official scorers, and (later) routing-analysis metrics.

* :mod:`mmoe.metrics.vqa` — VQAv2 accuracy (GT-Vision-Lab/VQA ``vqaEval.py``); its answer normalisation is
  :mod:`mmoe.metrics.vqa_normalize`.
* :mod:`mmoe.metrics.captions` — COCO caption metrics through pycocoevalcap.
* :mod:`mmoe.metrics.nlvr2` — NLVR2 accuracy and consistency (lil-lab/nlvr ``nlvr2/eval/metrics.py``).
* :mod:`mmoe.metrics.cli` — ``mmoe eval vqa|caption|nlvr2``.
"""
