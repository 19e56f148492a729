"""Benchmark metrics that equal the official scorers, and routing-analysis metrics: plain functions over predictions,
files and routing records.

Benchmarks:

* :mod:`mmoe.metrics.vqa` — VQAv2 accuracy (GT-Vision-Lab/VQA ``vqaEval.py``); its answer normalisation is
  :mod:`mmoe.metrics.vqa_normalize`.
* :mod:`mmoe.metrics.captions` — COCO caption metrics through pycocoevalcap; SPICE only where its jar can run
  (:mod:`mmoe.metrics.spice`); :mod:`mmoe.metrics.caption_words` — whether captions name what is in the image
  (precision of chosen words against the references).
* :mod:`mmoe.metrics.nocaps` — NoCaps' caption metrics per domain (in, near, out, entire) and the results file of its
  evaluation server.
* :mod:`mmoe.metrics.nlvr2` — NLVR2 accuracy and consistency (lil-lab/nlvr ``nlvr2/eval/metrics.py``).
* :mod:`mmoe.metrics.retrieval` — image-text retrieval recall R@1/5/10 (BEiT-3 ``average_score``).
* :mod:`mmoe.metrics.files` — reading annotation and prediction files, with errors naming the file, entry and field
  (:class:`~mmoe.metrics.files.EvalInputError`).
* :mod:`mmoe.metrics.cli` — ``mmoe eval vqa|caption|nocaps|nlvr2|retrieval``.

Routing:

* :mod:`mmoe.metrics.routing` — activation ratio (MH-MoE Fig. 1a), representation collapse (X-MoE Eq. 11), routing
  fluctuation and inter-run consistency (X-MoE §4.5), sub-token assignment diversity, over routing records.
* :mod:`mmoe.metrics.routing_collect` — a backbone run over inputs, collecting the records, loads and router inputs
  those metrics need.
* :mod:`mmoe.metrics.routing_stats` — the routing-statistics file saved during training.
"""
