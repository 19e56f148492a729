"""BEiT-3 style multiway Transformer with sparse MoE FFNs (pure torch).

Public API::

    from mmoe.model import MultiwayConfig, MultiwayTransformer
    backbone = MultiwayTransformer(MultiwayConfig.preset("tiny", moe=MoEPlan(num_experts=8, every=2)))
    out = backbone(image=None, text=None, text_padding_mask=None, image_mask=None)
    for slot in backbone.moe_layers():  # MoELayerSlot(index, modality, layer)
        ...
    beit3 = from_beit3("beit3_base_patch16_224.pth")  # released BEiT-3 weights (mmoe.model.beit3)
    backbone = from_pretrained("exported/")  # a folder of `mmoe export` (safetensors + config.json)
"""

from mmoe.model.backbone import BackboneOutput, MoELayerSlot, MultiwayTransformer
from mmoe.model.beit3 import from_beit3, to_beit3
from mmoe.model.config import MoEPlan, MultiwayConfig
from mmoe.model.depth_router import DepthRouting
from mmoe.model.pretrained import from_pretrained, save_pretrained

__all__ = [
    "BackboneOutput",
    "DepthRouting",
    "MoELayerSlot",
    "MoEPlan",
    "MultiwayConfig",
    "MultiwayTransformer",
    "from_beit3",
    "from_pretrained",
    "save_pretrained",
    "to_beit3",
]
