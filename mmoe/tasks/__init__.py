"""LightningModules for pre-training and fine-tuning, and checkpoint helpers."""
