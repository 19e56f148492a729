"""The routing choices of a MoE layer in six small typed parts, each with its defaults and its checks:
:class:`ExpertPool` (the experts), :class:`Scoring` (the scorer and gate), :class:`Selection` (which experts, how
weighed), :class:`Capacity` (what a full expert drops), :class:`Balance` (the balance and entropy losses) and
:class:`ZeroComputation` (null, copy and constant experts beside the FFN experts).

:class:`mmoe.moe.RoutingChoices` is all six at once, their fields side by side, so that a config names each choice
by its field alone (``moe.top_k``, ``moe.router``) as every mmoe version has. A check across parts lives with the
choice that makes the combination: expert choice's refusals in :class:`Selection`, batch priority's in
:class:`Capacity`, Stratified MoE's in :class:`ExpertPool`, LIMoE's entropy losses' in :class:`Balance`.
"""

from mmoe.moe.choices.balance import Balance
from mmoe.moe.choices.capacity import Capacity
from mmoe.moe.choices.experts import ExpertPool
from mmoe.moe.choices.scoring import Scoring
from mmoe.moe.choices.selection import Selection
from mmoe.moe.choices.zero_computation import ZeroComputation

__all__ = ["Balance", "Capacity", "ExpertPool", "Scoring", "Selection", "ZeroComputation"]
