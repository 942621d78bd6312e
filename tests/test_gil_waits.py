"""scripts/gil_waits.py sorts a py-spy profile's engine-thread samples: a timed wait on a
condition right under a C extension's call is taking the GIL back; MLX's own waits, an idle
engine's wait for a command and Python each have their row; other threads are left out."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOOP = "thread (1): pipeserve-engine;Engine._run (pipeserve/core/engine.py:124);" \
       "Engine._loop (pipeserve/core/engine.py:263)"
RAW = "\n".join([
    f"{LOOP};Step.read (pipeserve/core/step.py:186);0x7f1 (core.cpython-312-x86_64-linux-gnu.so);"
    "pthread_cond_timedwait (libc.so.6);0x7f2 (libc.so.6) 30",
    f"{LOOP};Step.dispatch (pipeserve/core/step.py:158);0x7f1 (core.cpython-312-x86_64-linux-gnu"
    ".so);mlx::core::async_eval (libmlx.so);mlx::core::eval_impl (libmlx.so) 50",
    f"{LOOP};Forward._prefill_one (pipeserve/core/forward.py:89);0x7f1 (core.cpython-312-x86_64"
    "-linux-gnu.so);mlx::core::eval (libmlx.so);mlx::core::eval_impl (libmlx.so);"
    "pthread_cond_wait (libc.so.6) 15",
    f"{LOOP};Engine.take_commands (pipeserve/core/engine.py:316);SimpleQueue.get (queue.py:1);"
    "pthread_cond_timedwait (libc.so.6) 100",
    f"{LOOP};Scheduler.schedule (pipeserve/core/scheduler.py:200) 5",
    "thread (2): MainThread;Loop.run (uvloop.py:1);pthread_cond_timedwait (libc.so.6) 999",
]) + "\n"


def test_the_engine_threads_samples_are_sorted_by_what_they_wait_for(tmp_path: Path) -> None:
    raw = tmp_path / "engine.raw"
    raw.write_text(RAW)
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "gil_waits.py"), str(raw)],
                         capture_output=True, text=True, check=True).stdout
    rows = {line.split(" | ")[0].strip("| "): int(line.split(" | ")[1])
            for line in out.splitlines() if line.startswith("|")}
    assert "engine thread: 200 samples" in out
    assert rows == {"waiting for a command (idle engine)": 100, "MLX async_eval": 50,
                    "waiting for the GIL": 30, "MLX eval / read back": 15,
                    "Python (holding the GIL)": 5}


HELD = "\n".join([
    f"{LOOP};Persist.__call__ (pipeserve/stages/persist.py:116);RamPromptCache.put "
    "(pipeserve/prompt_cache/ram.py:214);0x7f1 (libpython3.12.so);mlx::core::array::~array "
    "(libmlx.so);cudaFree (libcudart.so) 40",
    f"{LOOP};Scheduler.schedule (pipeserve/core/scheduler.py:200) 10",
    "thread (2): MainThread;Loop.run (uvloop.py:1);_stream (pipeserve/http/api/openai_http.py:"
    "168) 60",
]) + "\n"


def test_holders_says_which_thread_held_the_gil_and_in_which_call(tmp_path: Path) -> None:
    raw = tmp_path / "gil.raw"
    raw.write_text(HELD)
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "gil_waits.py"), "--holders",
                          str(raw)], capture_output=True, text=True, check=True).stdout
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith("|")]
    assert "GIL held: 110 samples" in out
    assert [r[0].strip("| ") for r in rows] == [
        "MainThread", "_stream (pipeserve/http/api/openai_http.py:168)",
        "pipeserve-engine",
        "RamPromptCache.put (pipeserve/prompt_cache/ram.py:214) > cudaFree",
        "Scheduler.schedule (pipeserve/core/scheduler.py:200)"]
    assert [int(r[1]) for r in rows] == [60, 60, 50, 40, 10]
