"""Routing drawn as pixels, below both of its callers: the training logger (:mod:`mmoe.runtime.routing_logging`) and
the routing figures (:mod:`mmoe.viz`).

* :mod:`mmoe.routing.render` — the expert-load heatmap and the sub-token diversity maps as RGB arrays: one colour
  map, one normalisation, one layout rule.
"""
