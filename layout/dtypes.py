"""The one dtype table: every dtype a checkpoint may hold, under its safetensors name.

Each row gives the element size in bytes, whether it is a float (``--dtype`` converts
between floats only), its numpy / zarr v3 / torch names, and its rank in safetensors'
key order. Other modules derive their lookups from :data:`DTYPES`; none keeps its own.
Pure: the torch name is a string (``"float32"``), turned into ``torch.float32`` by
whoever imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DType:
    """One checkpoint dtype.

    Attributes:
        name: safetensors name (``"F32"``), the manifest's spelling.
        itemsize: bytes per element.
        is_float: floating point (a ``--dtype`` conversion target or source).
        torch_name: attribute of ``torch`` (``"bfloat16"``).
        zarr_name: zarr v3 data type (BF16 is stored as its ``uint16`` bit patterns).
        order: rank in safetensors' entry order (dtype size descending, as the
            ``safetensors`` library sorts; checked against it in the tests).
    """

    name: str
    itemsize: int
    is_float: bool
    torch_name: str
    zarr_name: str
    order: int


DTYPES: dict[str, DType] = {
    d.name: d
    for d in (
        DType("I64", 8, False, "int64", "int64", 0),
        DType("F64", 8, True, "float64", "float64", 1),
        DType("F32", 4, True, "float32", "float32", 2),
        DType("I32", 4, False, "int32", "int32", 3),
        DType("BF16", 2, True, "bfloat16", "uint16", 4),
        DType("F16", 2, True, "float16", "float16", 5),
        DType("I16", 2, False, "int16", "int16", 6),
        DType("I8", 1, False, "int8", "int8", 7),
        DType("U8", 1, False, "uint8", "uint8", 8),
        DType("BOOL", 1, False, "bool", "bool", 9),
    )
}

#: Bytes per element, by safetensors name.
DTYPE_NBYTES: dict[str, int] = {d.name: d.itemsize for d in DTYPES.values()}

#: Float dtypes ``--dtype`` may convert between (safetensors names).
FLOAT_DTYPES: tuple[str, ...] = tuple(d.name for d in DTYPES.values() if d.is_float)

#: Entries of a safetensors file are ordered by this rank, then by key.
SAFETENSORS_DTYPE_ORDER: tuple[str, ...] = tuple(sorted(DTYPES, key=lambda n: DTYPES[n].order))

#: zarr v3 data type of each dtype.
ZARR_DTYPES: dict[str, str] = {d.name: d.zarr_name for d in DTYPES.values()}

#: What ``--dtype`` accepts (CLI spelling -> safetensors name); one set for every command.
DTYPE_CHOICES: dict[str, str] = {
    "fp32": "F32",
    "f32": "F32",
    "float32": "F32",
    "bf16": "BF16",
    "bfloat16": "BF16",
    "fp16": "F16",
    "f16": "F16",
    "float16": "F16",
}
