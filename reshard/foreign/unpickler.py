"""The only unpickling in shardsmith: a restricted reader of DCP's pickles.

PyTorch DCP (``torch.distributed.checkpoint``, also under Megatron-Core's ``torch_dist``)
stores its index, ``.metadata``, as a pickle, and every item of its ``.distcp`` files as a
``torch.save`` zip archive whose ``data.pkl`` is a pickle. Loading a pickle runs whatever
callables it names, so :class:`RestrictedUnpickler` resolves a global only from an
explicit allow-list and refuses anything else with :class:`IntegrityError` naming the
global and the file. Nothing outside the allow-list is ever imported or called.

Three allow-lists, one per kind of pickle:

* ``.metadata`` (:func:`load_dcp_metadata`): the classes of
  ``torch.distributed.checkpoint.metadata``, ``filesystem._StorageInfo``, the four plan
  classes of ``planner`` (Megatron caches its save plans there), ``torch.Size``,
  ``torch.<dtype>`` values, ``torch.serialization._get_layout`` (a layout looked up by name)
  and ``pathlib`` paths (the checkpoint id). The set is what ``find_class`` is asked for
  when unpickling a ``.metadata`` written by torch 2.13 (``dcp.save``) and by
  Megatron-Core 0.19 (``dist_checkpointing.save``).
* a tensor item's ``data.pkl`` (:func:`load_tensor_record`): ``_rebuild_tensor_v2`` is
  replaced by :class:`PickledTensor`, which only records storage key, offset, size and
  stride; storages become :class:`StorageRef`; the bytes are then read raw.
* a bytes item's ``data.pkl`` (:func:`load_plain_value`): no global at all (ints, floats,
  strings, bytes, lists, tuples, dicts).
* Megatron's ``common_state`` item (:func:`load_inert_value`), which Megatron-LM fills with
  objects of its own (``args``, an ``argparse.Namespace`` holding dtypes, enums ...) next to the
  plain values shardsmith reads (``iteration``, the optimizer's ``param_groups``): every global
  it names becomes an inert :class:`Opaque` placeholder class of ours, so building the value
  calls only shardsmith's own code; storages become placeholders too. Nothing named is
  imported; the placeholders are never used as anything but "not a plain value".

shardsmith's own format never contains a pickle; the exporters write DCP's through
``torch.distributed.checkpoint`` itself.
"""

from __future__ import annotations

import io
import pathlib
import pickle
from dataclasses import dataclass
from typing import Any, BinaryIO

import torch

from shardsmith.errors import IntegrityError

_DCP_METADATA_CLASSES = (
    "BytesStorageMetadata",
    "ChunkStorageMetadata",
    "Metadata",
    "MetadataIndex",
    "StorageMeta",
    "TensorProperties",
    "TensorStorageMetadata",
    "_MEM_FORMAT_ENCODING",
)
#: ``torch.<name>`` dtypes, read from the module dict (no ``getattr``: torch's module
#: ``__getattr__`` would import submodules for other names).
_DTYPES = {name: value for name, value in vars(torch).items() if isinstance(value, torch.dtype)}
#: Megatron-Core's planner caches its save plans in the metadata (``mcore_data``).
_DCP_PLANNER_CLASSES = ("SavePlan", "TensorWriteData", "WriteItem", "WriteItemType")
_PATHS = {
    "PosixPath": pathlib.PosixPath,
    "PurePosixPath": pathlib.PurePosixPath,
    "WindowsPath": pathlib.PureWindowsPath,
    "PureWindowsPath": pathlib.PureWindowsPath,
}


def _metadata_global(module: str, name: str) -> Any:
    """The object a ``.metadata`` pickle may name, or None."""
    if module == "torch.distributed.checkpoint.metadata" and name in _DCP_METADATA_CLASSES:
        from torch.distributed.checkpoint import metadata

        return getattr(metadata, name)
    if module == "torch.distributed.checkpoint.planner" and name in _DCP_PLANNER_CLASSES:
        from torch.distributed.checkpoint import planner

        return getattr(planner, name)
    if module == "torch.distributed.checkpoint.filesystem" and name == "_StorageInfo":
        from torch.distributed.checkpoint.filesystem import _StorageInfo

        return _StorageInfo
    if module == "torch.serialization" and name == "_get_layout":
        from torch.serialization import _get_layout

        return _get_layout
    if module == "torch" and name == "Size":
        return torch.Size
    if module == "torch" and name in _DTYPES:
        return _DTYPES[name]
    if module in ("pathlib", "pathlib._local") and name in _PATHS:
        return _PATHS[name]
    return None


def _storage_dtypes() -> dict[str, torch.dtype]:
    """``FloatStorage`` -> torch.float32 ... (legacy storage names ``torch.save`` writes)."""
    from torch.storage import _dtype_to_storage_type_map

    return {name: dtype for dtype, name in _dtype_to_storage_type_map().items()}


@dataclass(frozen=True)
class StorageRef:
    """A storage named by a ``torch.save`` pickle: entry ``data/<key>`` of the archive."""

    key: str
    dtype: torch.dtype
    numel: int


@dataclass(frozen=True)
class PickledTensor:
    """What ``_rebuild_tensor_v2(storage, offset, size, stride, ...)`` would build, unbuilt."""

    storage: StorageRef
    storage_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


class Opaque:
    """An object of a class the pickle names (``global_name``), not built: the arguments and
    state the pickle gives it are kept as they are. Subclassed per name by the inert reader."""

    global_name = "?"

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    state: Any
    items: dict[Any, Any]
    elements: list[Any]

    def __new__(cls, *args: Any, **kwargs: Any) -> "Opaque":  # NEWOBJ calls only this
        obj = super().__new__(cls)
        obj.args, obj.kwargs, obj.state, obj.items, obj.elements = args, kwargs, None, {}, []
        return obj

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __setitem__(self, key: Any, value: Any) -> None:  # SETITEMS of a dict subclass
        self.items[key] = value

    def append(self, value: Any) -> None:  # APPENDS of a list subclass
        self.elements.append(value)

    def extend(self, values: Any) -> None:
        self.elements.extend(values)

    def __repr__(self) -> str:
        return f"<opaque {self.global_name}>"


def _opaque(module: str, name: str) -> type:
    return type(f"Opaque_{name}", (Opaque,), {"global_name": f"{module}.{name}"})


def _tensor_record(
    storage: Any, storage_offset: Any, size: Any, stride: Any, *_: Any
) -> PickledTensor:
    if not isinstance(storage, StorageRef) or not isinstance(storage_offset, int):
        raise pickle.UnpicklingError(
            "tensor rebuild arguments are not (storage, offset, size, stride)"
        )
    return PickledTensor(
        storage, storage_offset, tuple(int(n) for n in size), tuple(int(n) for n in stride)
    )


class RestrictedUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that resolves globals only through an allow-list.

    Args:
        file: the pickle bytes.
        source: file name for error messages.
        kind: ``"metadata"``, ``"tensor"``, ``"plain"`` or ``"inert"`` (see the module docstring).
    """

    def __init__(self, file: BinaryIO, source: str, kind: str) -> None:
        super().__init__(file)
        self.source, self.kind = source, kind
        self._storage_dtypes = _storage_dtypes() if kind == "tensor" else {}

    def find_class(self, module: str, name: str) -> Any:
        found: Any = None
        if self.kind == "metadata":
            found = _metadata_global(module, name)
        elif self.kind == "tensor":
            if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
                found = _tensor_record
            elif (module, name) == ("collections", "OrderedDict"):
                found = dict
            elif module == "torch" and name in self._storage_dtypes:
                found = name
        elif self.kind == "inert":
            found = (
                dict if (module, name) == ("collections", "OrderedDict") else _opaque(module, name)
            )
        if found is None:
            raise IntegrityError(
                f"{self.source}: the pickle names {module}.{name}, which is not one of the DCP "
                f"{self.kind} classes shardsmith admits; refused without running it. The file was "
                "not written by torch.distributed.checkpoint: do not load it"
            )
        return found

    def persistent_load(self, pid: Any) -> Any:
        if self.kind == "inert":
            return _opaque("persistent", str(pid[0]) if isinstance(pid, tuple) and pid else "id")()
        if (
            self.kind != "tensor"
            or not isinstance(pid, tuple)
            or len(pid) != 5
            or pid[0] != "storage"
            or pid[1] not in self._storage_dtypes
            or not isinstance(pid[4], int)
        ):
            raise IntegrityError(
                f"{self.source}: unexpected persistent id {pid!r:.80} in a "
                f"{self.kind} pickle; refused"
            )
        return StorageRef(str(pid[2]), self._storage_dtypes[pid[1]], pid[4])


def _load(data: bytes, source: str, kind: str) -> Any:
    try:
        return RestrictedUnpickler(io.BytesIO(data), source, kind).load()
    except IntegrityError:
        raise
    except Exception as exc:  # any malformed pickle: EOFError, UnpicklingError, TypeError ...
        raise IntegrityError(
            f"{source}: not a readable DCP {kind} pickle ({type(exc).__name__}: "
            f"{exc}); the file is damaged or not written by torch.distributed."
            "checkpoint"
        ) from None


def load_dcp_metadata(path: str) -> Any:
    """The ``torch.distributed.checkpoint.metadata.Metadata`` pickled in ``path``.

    Raises:
        IntegrityError: the pickle names a global outside the allow-list, or is malformed.
    """
    from torch.distributed.checkpoint.metadata import Metadata

    with open(path, "rb") as f:
        value = _load(f.read(), path, "metadata")
    if not isinstance(value, Metadata):
        raise IntegrityError(f"{path}: holds a {type(value).__name__}, not DCP Metadata")
    return value


def load_tensor_record(data: bytes, source: str) -> PickledTensor:
    """The tensor a ``torch.save`` archive's ``data.pkl`` describes, without its bytes.

    Raises:
        IntegrityError: anything but one plain CPU tensor.
    """
    value = _load(data, source, "tensor")
    if not isinstance(value, PickledTensor):
        raise IntegrityError(f"{source}: holds a {type(value).__name__}, not a tensor")
    return value


def load_plain_value(data: bytes, source: str) -> Any:
    """A bytes item's value: ints, floats, strings, bytes, lists, tuples, dicts only.

    Raises:
        IntegrityError: the pickle names any global or storage.
    """
    return _load(data, source, "plain")


def load_inert_value(data: bytes, source: str) -> Any:
    """A bytes item's value with every named global replaced by an inert :class:`Opaque`
    placeholder (nothing named is imported or called; see the module docstring).

    Raises:
        IntegrityError: the pickle is malformed.
    """
    return _load(data, source, "inert")
