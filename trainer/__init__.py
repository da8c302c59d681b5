"""The training job: model, parallelism, data, the train loop and its checkpointing.

The model and its parallelism at the top level (``model``, ``parallel``, ``pipeline``, ``moe``,
``weight_init``, ``step``, ``optim``, ``rng``, ``comm``, ``config``, ``train``); rooms
``checkpoint/``, ``runtime/``, ``observe/``, ``data/``, ``fault/``, ``detect/``,
``context_parallel/``. Never imports ``reshard/`` or ``sizing/``.
"""

import lazy_loader as lazy

__getattr__, __dir__, __all__ = lazy.attach_stub(__name__, __file__)
