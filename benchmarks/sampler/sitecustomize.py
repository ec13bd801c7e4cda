"""A sampling profiler for every Python process of a run (benchmarks/startup.py --sample DIR puts this folder on
PYTHONPATH and sets SAMPLE_DIR): the main thread's stack every SAMPLE_INTERVAL_S seconds (default 0.005), written
as JSON lines to SAMPLE_DIR/<pid>.jsonl, a few times a second (a rank leaves with os._exit: no atexit). A forked
child (the warm agent's ranks) samples itself into its own file. A measuring tool, not part of stackproof."""

import json
import os
import sys
import threading
import time

_DIR = os.environ.get("SAMPLE_DIR")
_INTERVAL = float(os.environ.get("SAMPLE_INTERVAL_S") or 0.005)
_ROOTS = sorted({p.rstrip("/") + "/" for p in sys.path if p and os.path.isabs(p)}, key=len, reverse=True)


def _where(code) -> str:
    name = code.co_filename
    for root in _ROOTS:
        if name.startswith(root):
            name = name[len(root):]
            break
    return f"{name}:{code.co_name}"


def _sample(main_id: int, path: str) -> None:
    with open(path, "a", buffering=1 << 16) as out:
        out.write(json.dumps({"pid": os.getpid(), "argv": sys.argv, "start": time.time()}) + "\n")
        flushed = time.monotonic()
        while True:
            time.sleep(_INTERVAL)
            frame = sys._current_frames().get(main_id)
            if frame is None:
                out.flush()
                return
            stack = []
            while frame is not None and len(stack) < 80:
                stack.append(f"{_where(frame.f_code)}:{frame.f_lineno}")
                frame = frame.f_back
            out.write(json.dumps({"t": time.time(), "s": stack[::-1]}) + "\n")
            if time.monotonic() - flushed > 0.1:
                out.flush()
                flushed = time.monotonic()


def _start() -> None:
    if _DIR:
        os.makedirs(_DIR, exist_ok=True)
        thread = threading.Thread(target=_sample, args=(threading.get_ident(), f"{_DIR}/{os.getpid()}.jsonl"),
                                  name="sampler", daemon=True)
        thread.start()


_start()
os.register_at_fork(after_in_child=_start)
