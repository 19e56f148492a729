"""The GPU presets' plan texts (``--scale gpu``, ``--scale gpu-tasks``): their design notes and what a plan says of a
claim its preset does not run (:func:`not_run_unit`: which preset runs it).

The default plan (``docs/claims/plan.json``) was fixed before the GPU presets were split: its text for the task order
is :data:`SHIPPED_NOT_RUN_UNIT` (part of its hash, so it stays although ``--scale gpu-tasks`` runs claim 6 now).
"""

from __future__ import annotations

from mmoe.study.settings import PRESETS

#: What the default plan says of the claim it does not run, the task order (hashed: the default plan keeps it).
SHIPPED_NOT_RUN_UNIT = "not run under this preset: --scale gpu only"
#: The presets whose plans keep :data:`SHIPPED_NOT_RUN_UNIT` (the fast one, not committed, names today's runner).
SHIPPED_PRESETS = ("default",)
#: The presets never named as running a claim: the fast one is the default's structure at tiny scale, for tests.
UNNAMED_PRESETS = ("fast",)

GPU_NOTES = (
    "Claims 2, 4 and 7 only, each at the design that decides it with 8 runs per arm within one GPU loan; claims 1, 3, "
    "5, 8 and 9 are the default preset's and the task order (claim 6) --scale gpu-tasks's: their rows are not run and "
    "none of their runs is trained (no MH-MoE activation arms, no claim 5 fine-tunings, no Stratified MoE, no router "
    "table).",
    "Claim 2: one MH-MoE configuration with headroom, h = 8 over 16 experts (min(h, E) = 8), 8 pre-training seeds x "
    "1,000 steps at a constant learning rate after the warm-up; per seed the object-minus-background distinct "
    "experts, the mean over the vision MoE layers, one-sample t over the 8 seeds; saturated only where that interval "
    "contains 0 and every run sits at the saturation share of its ceiling.",
    "Claim 4: Switch and X-MoE at 32 experts, 8 seeds x 1,000 steps each, the same schedule (linear warm-up over 30 "
    "steps, then the peak rate held constant), a backbone snapshot every 100 steps; judged on the snapshot pairs from "
    "the warm-up's end on (window 10% of the snapshots: the pairs from step 100 to 1,000; the paper reads fluctuation "
    "after 15K of 125K steps, 12%); per run the mean share of (sub-)tokens that changed expert, Welch t over the 8 "
    "runs per arm, uninformative where both change expert about as often as a random reassignment.",
    "Claim 7: the demo's recipe (contrastive loss, output vocabulary, 80 pre-training steps, VQA at 300 steps) on the "
    "study's corpus and 64-token codebook: 8 mhmoe pre-trainings against 8 random inits of the same seeds, each "
    "fine-tuned once on VQA; Welch t over the 8 backbones per arm, the images of the evaluation bootstrapped inside.",
    "Corpus: the medium synthetic corpus (10,000 training and 1,000 test images): a 1,000-step run at batch 64 sees "
    "its training pairs about once, and 512 held-out pairs (8 batches of 64) are measured; its generation and "
    "codebook, outside the estimate, stay short beside the large corpus's.",
    "Runs at once: 8 (--jobs 8), from the cost model's notes (a launch-bound run keeps a core busy, and each run is "
    "two busy processes, its own and its loader worker's: 16 cores hold 8), not a number chosen to meet the budget.",
)

GPU_TASKS_NOTES = (
    "The task order (claim 6, MH-MoE Table 4: MH-MoE above X-MoE above dense on VQAv2, NLVR2 and captioning) only: "
    "dense, X-MoE and MH-MoE each pre-trained under 3 seeds x 2,000 steps, each pre-training fine-tuned on the three "
    "tasks under 3 seeds x 1,000 steps (81 fine-tunings); every other claim is the default preset's or --scale "
    "gpu's, and none of its runs is trained.",
    "The unit is the pre-training: each pre-training's score is the mean over its 3 fine-tuning seeds, then Welch t "
    "over the 3 pre-trainings per arm; Holm's correction over the order's 6 gaps (3 tasks x 2 adjacent pairs).",
    "A task where a variant is not above its baseline (VQA's image-blind per-question-type prior, NLVR2's constant "
    "answer, the constant caption's CIDEr: the corpus's chance levels) is uninformative: the order is not read at the "
    "no-learning level.",
    "Power: the paper's gaps are 1.5-2.5 points and the tiny runs' seed SD 0.4-3.6 points, so 3 pre-trainings per arm "
    "may not resolve 1.5 points; each gap's smallest detectable effect at power 0.8 is reported beside it.",
    "Budget: about 20-35 minutes on one H100 (the audit's estimate; the cost model's is below), 8 runs at once as "
    "under --scale gpu: a loan longer than one GPU's 15 minutes.",
)

#: Each GPU preset's design notes.
DESIGN_NOTES_BY_PRESET = {"gpu": GPU_NOTES, "gpu-tasks": GPU_TASKS_NOTES}


def preset_command(preset: str) -> str:
    """How a reader starts ``preset``: ``the default preset (mmoe study claims)``, ``--scale gpu``."""
    return "the default preset (mmoe study claims)" if preset == "default" else f"--scale {preset}"


def claim_runners(claim_id: str, preset: str) -> str:
    """Which presets other than ``preset`` run ``claim_id``: ``run by --scale gpu-tasks``, or ``no preset runs it``."""
    runners = [
        preset_command(name)
        for name, settings in PRESETS.items()
        if name not in (preset, *UNNAMED_PRESETS) and settings.runs_claim(claim_id)
    ]
    return f"run by {' and '.join(runners)}" if runners else "no preset runs it"


def not_run_unit(claim_id: str, preset: str) -> str:
    """The deciding unit a plan of ``preset`` states for a claim it does not run: which presets run it."""
    if preset in SHIPPED_PRESETS:
        return SHIPPED_NOT_RUN_UNIT
    return f"not run (preset {preset}): {claim_runners(claim_id, preset)}"
