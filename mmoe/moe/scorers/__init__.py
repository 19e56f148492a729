"""The routers' scorers by the name a config gives them (``MoEConfig.router``): one line per scorer, each scorer's
own module (a :class:`mmoe.moe.scorers.base.Scorer`) holding all the rest. A new router is a module beside these, its
line here, and its reference test (``docs/how-to/add_a_router.md``)."""

from mmoe.moe.scorers.base import LayerConfig, Scorer
from mmoe.moe.scorers.linear import LinearScorer
from mmoe.moe.scorers.xmoe import XMoEScorer

SCORERS: dict[str, type[Scorer]] = {
    "linear": LinearScorer,
    "xmoe": XMoEScorer,
}

__all__ = ["SCORERS", "LayerConfig", "LinearScorer", "Scorer", "XMoEScorer"]
