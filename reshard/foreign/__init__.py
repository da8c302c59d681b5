"""Foreign checkpoint formats: PyTorch DCP (torchtitan) and Megatron-Core ``torch_dist``.

Readers of DCP's pickled ``.metadata`` go through :mod:`.unpickler`, the only unpickling in
shardsmith; every importer writes through :func:`.write.write_checkpoint`.
"""

import lazy_loader as lazy

__getattr__, __dir__, __all__ = lazy.attach_stub(__name__, __file__)
