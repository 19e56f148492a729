"""Where each file of a corpus lies under its root: the benchmarks' original layout, as ``data/README.md`` documents it
for the real datasets and as :func:`mmoe.data.synth.corpus.build_corpus` writes the synthetic one.

```
coco/{train2014,val2014,test2015}/COCO_<subtype>_<image_id:012d>.jpg
coco/annotations/captions_{train2014,val2014}.json       official COCO captions format
coco/karpathy/dataset_coco.json                          Karpathy split (train / restval / val / test)
flickr30k/dataset_flickr30k.json, flickr30k/images/      Flickr30K Karpathy split (train / val / test, for retrieval;
                                                         the COCO images again, named <imgid>.jpg)
vqav2/v2_OpenEnded_mscoco_<subtype>_questions.json       train2014, val2014, test2015, test-dev2015
vqav2/v2_mscoco_<subtype>_annotations.json               train2014, val2014 (10 answers per question)
nlvr2/{train,dev,test1}.json                             NLVR2 JSON lines
nlvr2/images/{train/<directory>,dev,test1}/<split>-<set>-<pair>-img{0,1}.png
pretrain/text.txt, pretrain/pairs.tsv                    text-only corpus; image<TAB>caption (paths under coco/)
imagenet/train/<class>/<class>_<image_id>.JPEG            ImageNet's train layout (the COCO train2014 images, each in
                                                         its top object's class: mmoe.data.synth.classification)
imagenet/val/ILSVRC2012_val_<n:08d>.JPEG                 ImageNet's val layout (the val2014 images)
imagenet/LOC_val_solution.csv, LOC_synset_mapping.txt    Kaggle's val labels and class list
synth.json                                               seed, sizes, counts and chance levels
shards/<split>/                                          each split converted (mmoe.data.synth.convert)
```

A split folder under ``shards/`` is named as the ``mmoe data convert`` command that writes it names its shards.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mmoe.data.answers import ANSWERS_FILE
from mmoe.data.converters.build_captions import CAPTION_TOKENS_FILE

#: The corpus summary at the corpus root: seed, sizes, counts and each task's chance levels.
SUMMARY_FILE = "synth.json"


def vqa_split(subtype: str) -> str:
    """The folder of a VQAv2 split (``train2014``, ``val2014``, ...), named as ``mmoe data convert vqav2`` names it."""
    return f"vqav2-{subtype}"


def karpathy_split(split: str) -> str:
    """The folder of a Karpathy COCO split (``"train,restval"`` joins its parts with ``-``)."""
    return f"coco-karpathy-{split.replace(',', '-')}"


def flickr30k_split(split: str) -> str:
    """The folder of a Flickr30K Karpathy split (``train``, ``val``, ``test``)."""
    return f"flickr30k-karpathy-{split}"


def nlvr2_split(split: str) -> str:
    """The folder of an NLVR2 split (``train``, ``dev``, ``test1``)."""
    return f"nlvr2-{split}"


def classification_split(split: str) -> str:
    """The folder of a classification split (``train``, ``val``), whose shard name it also is."""
    return f"classification-{split}"


def coco_captions_split(subtype: str) -> str:
    """The folder of an official COCO captions split (``train2014``, ``val2014``)."""
    return f"coco-captions-{subtype}"


#: The split folders :func:`mmoe.data.synth.convert.convert_layout` writes that later stages name (the demo's
#: benchmarks, the claims study).
VQA_TRAIN_SPLIT = vqa_split("train2014")
VQA_VAL_SPLIT = vqa_split("val2014")
NLVR2_DEV_SPLIT = nlvr2_split("dev")
CAPTION_TRAIN_SPLIT = karpathy_split("train,restval")
CAPTION_TEST_SPLIT = karpathy_split("test")
RETRIEVAL_TRAIN_SPLIT = flickr30k_split("train")
RETRIEVAL_TEST_SPLIT = flickr30k_split("test")
CLASSIFICATION_TRAIN_SPLIT = classification_split("train")
CLASSIFICATION_VAL_SPLIT = classification_split("val")
PRETRAIN_IMAGE_SPLIT = "pretrain-images"
PRETRAIN_PAIR_SPLIT = "pretrain-pairs"
PRETRAIN_TEXT_SPLIT = "pretrain-text"


def answer_vocab_in(shards: Path) -> Path:
    """The VQAv2 answer vocabulary in a folder of converted splits: the training split writes it, the other annotated
    splits read it."""
    return shards / VQA_TRAIN_SPLIT / ANSWERS_FILE


@dataclass(frozen=True)
class CorpusLayout:
    """The paths of one corpus's files and folders (see the module docstring); ``CorpusLayout(Path())`` gives them
    relative to the corpus root.

    Attributes:
        root: the corpus root.
    """

    root: Path

    @property
    def coco_images(self) -> Path:
        """The COCO image folder, one ``<subtype>/`` folder per image split (what the COCO converters read)."""
        return self.root / "coco"

    def coco_split_images(self, subtype: str) -> Path:
        """The images of one COCO split (``train2014``, ``val2014``, ``test2015``)."""
        return self.coco_images / subtype

    def coco_captions(self, subtype: str) -> Path:
        """The official captions file of a COCO split (``train2014``, ``val2014``)."""
        return self.root / "coco" / "annotations" / f"captions_{subtype}.json"

    @property
    def karpathy_coco(self) -> Path:
        """Karpathy's COCO split file, ``dataset_coco.json``."""
        return self.root / "coco" / "karpathy" / "dataset_coco.json"

    @property
    def karpathy_flickr(self) -> Path:
        """Karpathy's Flickr30K split file, ``dataset_flickr30k.json``."""
        return self.root / "flickr30k" / "dataset_flickr30k.json"

    @property
    def flickr_images(self) -> Path:
        """The Flickr30K image folder (``<imgid>.jpg`` in the synthetic corpus)."""
        return self.root / "flickr30k" / "images"

    def vqa_questions(self, subtype: str) -> Path:
        """The VQAv2 questions of a split (``train2014``, ``val2014``, ``test2015``, ``test-dev2015``)."""
        return self.root / "vqav2" / f"v2_OpenEnded_mscoco_{subtype}_questions.json"

    def vqa_annotations(self, subtype: str) -> Path:
        """The VQAv2 annotations (answers) of a split (``train2014``, ``val2014``)."""
        return self.root / "vqav2" / f"v2_mscoco_{subtype}_annotations.json"

    @property
    def vqa_images(self) -> Path:
        """The images the VQAv2 questions are about: the COCO image folder."""
        return self.coco_images

    def nlvr2_records(self, split: str) -> Path:
        """The JSON lines of an NLVR2 split (``train``, ``dev``, ``test1``)."""
        return self.root / "nlvr2" / f"{split}.json"

    @property
    def nlvr2_images(self) -> Path:
        """The NLVR2 image folder, searched recursively by the converter."""
        return self.root / "nlvr2" / "images"

    def nlvr2_image_folder(self, split: str, directory: str) -> Path:
        """The folder of an NLVR2 split's image pairs; training pairs lie in the numbered ``directory`` their record
        names, as in the released NLVR2."""
        return self.nlvr2_images / (f"train/{directory}" if split == "train" else split)

    @property
    def pretrain_text(self) -> Path:
        """The text-only pre-training corpus, one text per line."""
        return self.root / "pretrain" / "text.txt"

    @property
    def pretrain_pairs(self) -> Path:
        """The pre-training image-text pairs, ``image<TAB>caption`` lines with image paths under ``coco/``."""
        return self.root / "pretrain" / "pairs.tsv"

    def imagenet_images(self, split: str) -> Path:
        """ImageNet's image folder of ``train`` (class folders) or ``val`` (flat, labelled by
        :attr:`imagenet_val_solution`)."""
        return self.root / "imagenet" / split

    @property
    def imagenet_val_solution(self) -> Path:
        """Kaggle's ``LOC_val_solution.csv``: each val image's class."""
        return self.root / "imagenet" / "LOC_val_solution.csv"

    @property
    def imagenet_synsets(self) -> Path:
        """Kaggle's ``LOC_synset_mapping.txt``: the class index (every class, with its name)."""
        return self.root / "imagenet" / "LOC_synset_mapping.txt"

    @property
    def summary(self) -> Path:
        """The corpus summary (:data:`SUMMARY_FILE`)."""
        return self.root / SUMMARY_FILE

    @property
    def shards(self) -> Path:
        """The folder of the converted splits."""
        return self.root / "shards"

    def shard(self, split: str) -> Path:
        """One converted split's folder (shards and ``manifest.json``), e.g. ``shard(VQA_VAL_SPLIT)``."""
        return self.shards / split

    @property
    def vqa_answer_vocab(self) -> Path:
        """The VQAv2 answer vocabulary of the converted splits (:func:`answer_vocab_in`)."""
        return answer_vocab_in(self.shards)

    @property
    def caption_tokens(self) -> Path:
        """The token ids of the captioning training split's captions: captioning's and pre-training's MLM output
        vocabulary."""
        return self.shard(CAPTION_TRAIN_SPLIT) / CAPTION_TOKENS_FILE
