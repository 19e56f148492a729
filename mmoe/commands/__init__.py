"""The ``mmoe`` subcommands over checkpoints and configs: ``mmoe info`` (``info``), ``mmoe export`` (``export``),
``mmoe export-backbone`` and ``mmoe upcycle`` (``backbone``). :mod:`mmoe.cli` imports each when it runs."""
