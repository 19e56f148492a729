"""How a run is configured: ``mmoe fit | validate | test | predict`` through LightningCLI (``cli``), config files read
safely (``yaml_reading``, ``extends``, ``safety``), a checkpoint's saved hyper-parameters against the config's
(``ckpt_hparams``), and runs started from Python (``launch``)."""
