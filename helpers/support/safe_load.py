"""Reading checkpoint files without running code from them: Megatron-LM's pickles and torch_dist metadata (06 §10).

:func:`load_pickle` allows :data:`HARMLESS_GLOBALS` (``args`` is an ``argparse.Namespace``) and reads
classes of Megatron-LM's own modules as inert stand-ins; anything else is refused with its names.
A torch_dist ``.metadata`` file is read with :class:`_RestrictedMetadataUnpickler` instead of plain
``pickle``. ``weights_only=False`` unpickles everything: only for files you trust. This restricts
what unpickling may call; it does not prove a hostile file harmless.

Sources: torch ``serialization.py`` (``weights_only``, ``safe_globals``,
``get_unsafe_globals_in_checkpoint``), ``distributed/checkpoint/filesystem.py``
(``FileSystemReader.read_metadata``), ``state_dict_loader.py`` (``load(..., no_dist=True)``).
"""

from __future__ import annotations

import argparse
import io
import os
import pathlib
import pickle
import signal
import types
from pathlib import Path
from typing import Any

import torch


class ConversionError(ValueError):
    """The input cannot be converted exactly; the message says why and what to do.

    Defined here, the lowest module that raises it; ``helpers.learn.megatron_lm.ConversionError`` and
    ``helpers.learn.conversion.ConversionError`` are this class.
    """


#: Megatron-LM's ``ModelType`` & co. live in ``megatron.*``; these others are data, not code, to unpickle.
HARMLESS_GLOBALS: tuple[Any, ...] = (argparse.Namespace, types.SimpleNamespace, pathlib.PosixPath, pathlib.WindowsPath,
                                     signal.Signals, io.BytesIO, torch._C.Generator)


class _StandIn:
    """What a class of Megatron-LM's own modules unpickles to: its arguments and state, no behaviour."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args, self.kwargs = args, kwargs

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __repr__(self) -> str:
        return f"<stand-in for {self.qualified_name}{self.args!r}>"


def _stand_in(qualified_name: str) -> type:
    return type(qualified_name.rsplit(".", 1)[-1], (_StandIn,), {"qualified_name": qualified_name})


class _Unpickler(pickle.Unpickler):
    """Plain unpickling, with stand-ins for classes of Megatron-LM modules that are not installed."""

    def find_class(self, module: str, name: str) -> Any:
        try:
            return super().find_class(module, name)
        except (ImportError, AttributeError):
            if module.split(".")[0] != "megatron":
                raise
            return _stand_in(f"{module}.{name}")


_PICKLE_WITH_STAND_INS = types.ModuleType("pickle_with_stand_ins")
_PICKLE_WITH_STAND_INS.Unpickler, _PICKLE_WITH_STAND_INS.load = _Unpickler, lambda f, **kw: _Unpickler(f, **kw).load()


def _numpy_globals() -> list[Any]:
    import numpy as np

    core = getattr(np, "_core", None) or np.core
    dtypes = {type(np.dtype(t)) for t in ("u4", "i8", "f4", "f8", "u1", "bool")}
    return [np.ndarray, np.dtype, (core.multiarray._reconstruct, "numpy.core.multiarray._reconstruct"),
            (core.multiarray._reconstruct, "numpy._core.multiarray._reconstruct"), *dtypes]


def load_pickle(file: str | os.PathLike | io.BytesIO, *, weights_only: bool = True) -> Any:
    """``torch.load`` of a Megatron-LM file (``model_optim_rng.pt``, ``common.pt``, the common state), on the CPU.

    With ``weights_only=True`` torch's restricted unpickler reads tensors, containers, numbers,
    strings, ``torch.dtype`` and, allowed here, :data:`HARMLESS_GLOBALS` and NumPy arrays (the
    saved RNG states); classes of ``megatron.*`` modules become inert stand-ins (their enum values
    are never needed to convert). ``weights_only=False`` is plain unpickling (stand-ins only for
    Megatron-LM modules that are not installed).

    Raises:
        ConversionError: ``weights_only=True`` and the file names other classes or functions
            (listed: unpickling them runs code, so pass ``weights_only=False`` only if you trust
            the file), or the file is not a torch file.
    """
    data = io.BytesIO(file.getvalue()) if isinstance(file, io.BytesIO) else None
    where = "the common state" if data is not None else str(file)
    if not weights_only:
        try:
            return torch.load(data or file, map_location="cpu", weights_only=False, pickle_module=_PICKLE_WITH_STAND_INS)
        except Exception as err:  # unpickling raises anything the file's objects raise
            raise ConversionError(f"{where} could not be unpickled ({type(err).__name__}: {err})") from err
    allowed = [*HARMLESS_GLOBALS, *_numpy_globals()]
    try:
        needed = torch.serialization.get_unsafe_globals_in_checkpoint(data or file)
    except Exception:  # not a zip-format torch file: torch.load below says what it is
        needed = []
    allowed_names = {f"{g.__module__}.{g.__qualname__}" for g in allowed if not isinstance(g, tuple)}
    allowed_names |= {g[1] for g in allowed if isinstance(g, tuple)}
    refused = [n for n in needed if n not in allowed_names and n.split(".")[0] != "megatron"]
    if refused:
        raise ConversionError(
            f"{where} names {refused}, which torch.load(weights_only=True) does not unpickle: unpickling them runs "
            "code from the file. Only if you trust the file, pass weights_only=False (command line: --no-weights-only).")
    stand_ins = [(_stand_in(n), n) for n in needed if n.split(".")[0] == "megatron"]
    if data is not None:
        data.seek(0)
    present = torch.serialization.get_safe_globals()  # the context removes what it added: keep others' (megatron.core's)
    try:
        with torch.serialization.safe_globals([g for g in allowed + stand_ins if g not in present]):
            return torch.load(data or file, map_location="cpu", weights_only=True)
    except Exception as err:  # torch's unpickling errors have no common public type
        raise ConversionError(f"{where} could not be read with weights_only=True ({type(err).__name__}: "
                              f"{str(err)[:300]}); only if you trust the file, pass weights_only=False") from err


#: What a torch_dist ``.metadata`` pickle may name (torch 2.14's ``torch.distributed.checkpoint``
#: dataclasses and enums, ``torch.Size``, dtypes, layouts); :class:`_RestrictedMetadataUnpickler`.
_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem",
                "torch.distributed.checkpoint.planner")


class _Refused(pickle.UnpicklingError):
    """A name :class:`_RestrictedMetadataUnpickler` does not unpickle."""


class _RestrictedMetadataUnpickler(pickle.Unpickler):
    """Unpickles a torch_dist ``.metadata`` naming only :data:`_DCP_MODULES` classes and plain torch
    values; torch's ``FileSystemReader.read_metadata`` uses plain ``pickle.load``, which runs any code."""

    def find_class(self, module: str, name: str) -> Any:
        plain = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict")}
        if module in _DCP_MODULES or (module, name) in plain or module == "torch":
            found = super().find_class(module, name)
            if (module in _DCP_MODULES and isinstance(found, type)) or (module, name) in plain or isinstance(found, torch.dtype):
                return found
        raise _Refused(f"{module}.{name}")


def dcp_reader(folder: Path, weights_only: bool):
    """``torch.distributed.checkpoint.FileSystemReader`` whose ``.metadata`` is read with
    :class:`_RestrictedMetadataUnpickler` when ``weights_only`` (plain ``pickle`` otherwise)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class _Reader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any):
            if not weights_only:
                return super().read_metadata(*args, **kwargs)
            with open(Path(self.path) / ".metadata", "rb") as f:
                try:
                    metadata = _RestrictedMetadataUnpickler(f).load()
                except _Refused as err:
                    raise ConversionError(
                        f"{folder}/.metadata names {err}, which a torch_dist checkpoint's metadata does not need: "
                        "unpickling it could run code from the file. Only if you trust the folder, pass "
                        "weights_only=False (command line: --no-weights-only).") from None
                except Exception as err:  # truncated or not a pickle
                    raise ConversionError(f"{folder}/.metadata cannot be read ({type(err).__name__}: {err}): "
                                          "the checkpoint is damaged or not a torch_dist folder") from None
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return _Reader(str(folder))


def dcp_load(request: dict, folder: Path, weights_only: bool, **kwargs: Any) -> None:
    """``torch.distributed.checkpoint.load`` of ``request`` from ``folder``; a damaged folder is a
    :class:`ConversionError` (torch's ``CheckpointException`` is a ``BaseException``)."""
    from torch.distributed.checkpoint import load
    from torch.distributed.checkpoint.api import CheckpointException

    reader = dcp_reader(folder, weights_only)
    reader.read_metadata()  # its refusal or damage as a ConversionError (inside load, torch would wrap it)
    try:
        load(request, storage_reader=reader, no_dist=True, **kwargs)
    except (Exception, CheckpointException) as err:
        raise ConversionError(f"{folder} cannot be read ({type(err).__name__}: {str(err)[:300]}): the checkpoint is "
                              "damaged (a save interrupted?) or not a torch_dist folder") from None
