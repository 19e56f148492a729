"""What the balance loss counts and over which batch (X-MoE Eq. 9; DeepSeekMoE §3.3, Eq. 12-14; DeepSeek-V3
§2.1.2, Eq. 17-20; Qiu et al., 2025: :mod:`mmoe.moe.balance`), and LIMoE's entropy losses (Mustafa et al., 2022:
:mod:`mmoe.moe.entropy_losses`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mmoe.moe.choices.values import finite_at_least, refuse, require

BALANCE_BATCHES = ("local", "global", "sequence")
BALANCE_CHOICES = ("first", "all")


@dataclass(frozen=True, kw_only=True)
class Balance:
    """The losses that spread the tokens over the experts (a part of :class:`mmoe.moe.RoutingChoices`).

    Args:
        balance_choices: which choices the balance loss's f_i counts. ``"first"`` (GShard, X-MoE Eq. 9,
            torchscale; the default): ``N * sum_i f_i P_i`` with f_i the share of (sub-)tokens whose first choice
            is expert i. ``"all"`` (DeepSeekMoE, Dai et al., 2024, §3.3, Eq. 12-14; DeepSeek-V2/V3):
            ``sum_i f_i P_i`` with ``f_i = N / (K T) * (choices of expert i among all K choices of the T
            (sub-)tokens)``; both are 1 for a uniform router.
        balance_batch: the batch the balance loss's expert frequencies f_i are counted over. ``"local"``: this
            process's (sub-)tokens. ``"global"``: every data-parallel rank's (Qiu et al., 2025, "Demons in the
            Detail", §3: f_i all-reduced before the Switch product N * sum_i f_i * P_i): in training, with a process
            group, each rank's loss is N * sum_i f_i * P_i with the global f_i and its own share of the global P_i,
            so that the ranks' mean (what data-parallel gradient averaging trains) equals one process's loss on the
            global batch. Every rank must then run the same MoE layers in the same order (an all-reduce per
            router). ``"sequence"``: DeepSeek-V3's sequence-wise balance loss (§2.1.2, Eq. 17-20,
            :func:`mmoe.moe.balance.sequence_balance_loss`). Not defined for Stratified MoE, whose later gates see a
            data-dependent subset (refused).
        local_entropy_weight: LIMoE's local entropy loss (Mustafa et al., 2022), weighted by this value:
            per modality, the mean over its non-padding (sub-)tokens of the entropy H(p(experts | x)) of each one's
            softmax gate, which pushes each token to a confident choice. Summed over the modalities a layer routes
            (one for a per-modality MoE FFN; image and text for a shared one when the backbone passes the split:
            ``segment_lengths`` of :meth:`mmoe.moe.MoELayer.forward`). 0 = off (one weight for both
            modalities). Returned weighted in ``RoutingRecord.auxiliary_losses``.
        global_entropy_weight: LIMoE's global entropy loss, weighted by this value: per modality,
            minus the entropy of the modality's mean gate distribution p̃(experts), which keeps a modality spread
            over several experts; thresholded as ``global_entropy_min_experts`` says. 0 = off.
        global_entropy_min_experts: LIMoE's threshold tau on the global entropy loss, given as tau = log(S) for S
            this value: the loss becomes ``max(0, tau - H(p̃))``, zero once the modality's mean distribution is at
            least as spread as a uniform one over S experts. None = no threshold (the plain ``-H(p̃)``).
            1 <= S <= num_experts.
    """

    balance_choices: Literal["first", "all"] = "first"
    balance_batch: Literal["local", "global", "sequence"] = "local"
    local_entropy_weight: float = 0.0
    global_entropy_weight: float = 0.0
    global_entropy_min_experts: float | None = None

    def _check_balance(self) -> None:
        """Each choice's range, then the combinations (reads ``num_experts``, ``gate``, ``routing`` and
        ``strata``)."""
        number = "a finite number >= 0"
        require(
            self,
            [
                ("balance_batch", self.balance_batch in BALANCE_BATCHES, f"one of {BALANCE_BATCHES}"),
                ("balance_choices", self.balance_choices in BALANCE_CHOICES, f"one of {BALANCE_CHOICES}"),
                ("local_entropy_weight", finite_at_least(self.local_entropy_weight, 0.0), number),
                ("global_entropy_weight", finite_at_least(self.global_entropy_weight, 0.0), number),
            ],
        )
        refuse(
            self,
            [
                (
                    "balance_choices",
                    self.balance_choices == "all" and self.routing != "token_choice",
                    "expert choice has no balance loss",
                )
            ],
        )
        refuse(self, self._entropy_refusals())

    def _entropy_refusals(self) -> list[tuple[str, bool, str]]:
        minimum = self.global_entropy_min_experts
        entropy_on = self.local_entropy_weight > 0 or self.global_entropy_weight > 0
        name = "local_entropy_weight" if self.local_entropy_weight > 0 else "global_entropy_weight"
        return [
            ("global_entropy_min_experts", minimum is not None and not finite_at_least(minimum, 1.0),
             "expected None or a number of experts S >= 1 (the threshold is log S)"),
            ("global_entropy_min_experts", minimum is not None and finite_at_least(minimum, 1.0)
             and minimum > self.num_experts,
             f"exceeds num_experts={self.num_experts}: no distribution over them reaches entropy log S"),
            (name, entropy_on and self.num_experts == 1, "the entropy over one expert is always 0; set it to 0"),
            (name, entropy_on and self.gate != "softmax",
             "LIMoE's entropies are of a softmax gate's distribution over experts; set gate: softmax"),
            (name, entropy_on and self.routing != "token_choice", "LIMoE's entropy losses need token-choice routing"),
            (name, entropy_on and self.strata is not None, "not defined for Stratified MoE gates (set it to 0)"),
        ]  # fmt: skip
