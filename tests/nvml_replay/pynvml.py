"""pynvml answering from a recording of a real GPU (tests/fixtures/nvml/*.json, made by record.py): the library
beneath stackproof replaced, so its NVML reading and judging run for real on a machine without a GPU.

Put this directory first on PYTHONPATH (or this module into sys.modules as `pynvml`) and name the recording in
NVML_REPLAY. Constants and exception classes are the real nvidia-ml-py's; every nvml* function that the recording
answers is replaced: its answer is looked up by the function's name and its arguments after the handle, an
NVML error code in the recording is raised as the real NVMLError, and a call the recording never saw raises
LookupError (a test that needs it must record or add it), so a missing answer is never taken for NotSupported."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import types
from pathlib import Path

_HERE = Path(__file__).resolve().parent
RECORDING_ENV = "NVML_REPLAY"


def _real_pynvml():
    for entry in sys.path:
        candidate = Path(entry or ".").resolve() / "pynvml.py"
        if candidate.parent != _HERE and candidate.is_file():
            spec = importlib.util.spec_from_file_location("_pynvml_real", candidate)
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module  # the real module looks itself up there
            spec.loader.exec_module(module)
            return module
    raise ImportError("the real nvidia-ml-py (pynvml.py) is not installed beside the replay")


_real = _real_pynvml()
globals().update({name: value for name, value in vars(_real).items() if not name.startswith("__")})


class Handle:
    """A device handle: the recorded device's index."""

    def __init__(self, index: int):
        self.index = index

    def __eq__(self, other):
        return isinstance(other, Handle) and other.index == self.index

    def __hash__(self):
        return hash(self.index)

    def __repr__(self):
        return f"Handle({self.index})"


class EventSet:
    pass


def _load() -> dict:
    path = os.environ.get(RECORDING_ENV)
    if not path:
        raise ImportError(f"{RECORDING_ENV} names no recording (tests/fixtures/nvml/*.json)")
    return json.loads(Path(path).read_text())


RECORDING = _load()
_consumed: dict[tuple, int] = {}


def _argument(value):
    if isinstance(value, Handle):
        return {"_handle": value.index}
    if isinstance(value, EventSet):
        return {"_event_set": True}
    if isinstance(value, (list, tuple)):
        return [_argument(v) for v in value]
    if type(value).__name__ == "CArgObject":  # a structure NVML fills (ctypes.byref): recorded as "*"
        return "*"
    return value


def _answer(value):
    if isinstance(value, dict):
        if "_error" in value:
            raise _real.NVMLError(value["_error"])
        if "_handle" in value:
            return Handle(value["_handle"])
        if "_event_set" in value:
            return EventSet()
        return types.SimpleNamespace(**{key: _answer(v) for key, v in value.items()})
    if isinstance(value, list):
        return [_answer(v) for v in value]
    return value


def _lookup(table: dict, name: str, args: tuple, where: str):
    answers = table.get(name)
    key = json.dumps(_argument(list(args)))
    if answers is None or (key not in answers and '"*"' not in answers):
        raise LookupError(f"NVML replay: {name}{tuple(args)} on {where} was not recorded")
    value = answers[key] if key in answers else answers['"*"']
    if isinstance(value, dict) and "_sequence" in value:  # answered in turn, the last one for ever after
        turn = _consumed.get((where, name, key), 0)
        _consumed[(where, name, key)] = turn + 1
        value = value["_sequence"][min(turn, len(value["_sequence"]) - 1)]
    return _answer(value)


def _replayed(name: str):
    def call(*args):
        if args and isinstance(args[0], Handle):
            return _lookup(RECORDING["devices"][args[0].index], name, args[1:], f"GPU {args[0].index}")
        return _lookup(RECORDING["system"], name, args, "the system")

    call.__name__ = name
    return call


def nvmlInit(*args):
    if "nvmlInit" in RECORDING["system"]:
        _lookup(RECORDING["system"], "nvmlInit", (), "the system")


def nvmlShutdown():
    return None


def nvmlEventSetFree(event_set):
    return None


for _name in {name for table in (RECORDING["system"], *RECORDING["devices"]) for name in table}:
    if _name != "nvmlInit":
        globals()[_name] = _replayed(_name)
