"""mmoe models behind other projects' evaluation harnesses: CLIP_benchmark's zero-shot retrieval and classification
over a fine-tuned retrieval task (:mod:`mmoe.harness.clip_benchmark`), and lmms-eval's generation tasks over the VQA
and captioning tasks (:mod:`mmoe.harness.lmms_eval`, found through lmms-eval's entry point). Each harness is an
optional dependency (``mmoe[eval]``, ``mmoe[lmms-eval]``), imported only by the module that adapts to it."""
