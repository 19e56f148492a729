"""mmoe models behind other projects' evaluation harnesses: CLIP_benchmark's zero-shot retrieval and classification
over a fine-tuned retrieval task (:mod:`mmoe.harness.clip_benchmark`). Each harness is an optional dependency
(``pip install 'mmoe[eval]'``); these modules import it only where they hand a model to it."""
