"""Routing figures drawn from saved or computed routing statistics (matplotlib, Agg; never inside ``forward``). The
heatmap's and the sub-token maps' pixels are :mod:`mmoe.routing.render`'s, those the training logger sends.

* :mod:`mmoe.viz.maps` — sub-token assignment-diversity maps per patch / text token (MH-MoE Fig. 1b, 8, 10).
* :mod:`mmoe.viz.plots` — expert-activation heatmap (MH-MoE Fig. 5), load bars, activation-ratio curve.
* :mod:`mmoe.viz.inputs` — images, image directories and webdataset shards as batches.
* :mod:`mmoe.viz.cli` — ``mmoe viz subtoken-map | heatmap`` (typed: ``draw_subtoken_maps``, ``draw_stats_heatmaps``).
* :mod:`mmoe.viz.analyze` — ``mmoe analyze routing | consistency``.
"""
