"""The element types a stream converts fields to, named as the caller likes: gpufeed's names
(``"f32"``), NumPy's and PyTorch's names (``"float32"``), and their type objects (``np.float32``,
``np.dtype("float32")``, ``torch.float32``). Each maps to gpufeed's name, which the daemon takes.

Only names with an explicit width are accepted: ``"float"`` is 32 bits to PyTorch and 64 to NumPy.
"""

import sys
from typing import Any, Dict, Mapping, Optional, Sequence, Union

# gpufeed's name of each long (NumPy and PyTorch) name; gpufeed's own names map to themselves.
_LONG_NAMES = {
    "uint8": "u8",
    "int8": "i8",
    "uint16": "u16",
    "int16": "i16",
    "uint32": "u32",
    "int32": "i32",
    "uint64": "u64",
    "int64": "i64",
    "float16": "f16",
    "bfloat16": "bf16",
    "float32": "f32",
    "float64": "f64",
}
NAMES: Dict[str, str] = {**{short: short for short in _LONG_NAMES.values()}, **_LONG_NAMES}


def _known() -> str:
    shorts = ", ".join(_LONG_NAMES.values())
    longs = ", ".join(_LONG_NAMES)
    return (f"one of {shorts}, or NumPy's and PyTorch's names and types for them ({longs}; "
            "np.float32, np.dtype('float32'), torch.float32, ...)")


def _name_of(value: Any) -> Optional[str]:
    """The NumPy or PyTorch name of a type object, or None when ``value`` is none of theirs."""
    kind = type(value)
    if kind.__module__ == "torch" and kind.__name__ == "dtype":
        # str(torch.float32) is "torch.float32"; aliases print as their canonical name
        # (torch.half as "torch.float16", torch.long as "torch.int64").
        return str(value).rpartition(".")[2]
    numpy = sys.modules.get("numpy")
    if numpy is None:
        return None
    if isinstance(value, numpy.dtype):
        dtype = value
    elif isinstance(value, type) and (issubclass(value, numpy.generic)
                                      or value.__module__.startswith("ml_dtypes")):
        # np.float32 is a scalar type; ml_dtypes' bfloat16 is NumPy's bfloat16 where it is used.
        dtype = numpy.dtype(value)
    else:
        return None
    if dtype.byteorder == ">":
        # Batches are little-endian; a big-endian NumPy type would describe other bytes.
        return f"big-endian {dtype.name}"
    return dtype.name


def dtype_name(value: Any, argument: str) -> Optional[str]:
    """gpufeed's name of the element type ``value`` (None stays None: the stored type); a
    ``ValueError`` naming ``argument`` for anything else."""
    if value is None:
        return None
    name = value if isinstance(value, str) else _name_of(value)
    if name is not None and name in NAMES:
        return NAMES[name]
    raise ValueError(f"{argument}: {value!r} is not an element type gpufeed converts to; give "
                     f"{_known()}")


def normalize_fields(
    fields: Union[None, Sequence[str], Mapping[str, Any]],
) -> Union[None, Sequence[str], Dict[str, Optional[str]]]:
    """``fields`` as ``open_stream`` takes it, with every dtype of a mapping as gpufeed's name (so
    that an unknown one fails here, naming the field)."""
    if isinstance(fields, Mapping):
        return {name: dtype_name(dtype, f'fields["{name}"]') for name, dtype in fields.items()}
    return fields
