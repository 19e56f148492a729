"""What every training run has besides its task: checkpoints written whole and resumed exactly, stop signals, the run
folder's lock and logs, guards against non-finite steps, throughput, the routing callbacks, the optimiser, and the
private Lightning and torch APIs mmoe relies on, each behind a public name (``lightning_internals``,
``torch_internals``).

It knows no task: a callback reads the task it trains through :class:`mmoe.runtime.backbone_training.BackboneTraining`.
"""
