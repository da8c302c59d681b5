"""Where bytes live and the checkpoint format: ``cli -> {trainer, reshard} -> storage -> layout``.

Rooms: ``store/`` (the key->bytes :class:`Store` over any fsspec URL and its backends),
``manifest/`` (the record whose presence makes a step exist), ``formats/`` (how tensors become
files), ``reading/`` (load-time ranged reads). At the top: the commit protocol (``commit``: data,
then manifest, then ``latest``), step names and the ``latest`` hint (``steps``), runs and
corrupt marks (``lineage``), ``gc``, ``verify``, ``checksum``. Never imports ``torch.distributed``.
Other packages import the names below from here or from a room's face.
"""

import lazy_loader as lazy

__getattr__, __dir__, __all__ = lazy.attach_stub(__name__, __file__)
