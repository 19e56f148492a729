"""Importing this module reads open_clip's BPE tables into this process (:meth:`mmoe.data.tokenizer.OpenClipVocabulary
.load`, about 0.3 s): a fork server names it in its preload (:data:`mmoe.pipeline.pool.DATA_WORKER_PRELOAD`), so that
the DataLoader workers it forks inherit the tables instead of each reading them."""

from __future__ import annotations

from mmoe.data.tokenizer import OpenClipVocabulary

OpenClipVocabulary().load()
