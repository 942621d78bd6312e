"""scripts/placement_probe.py: the CPU lists sysfs writes are read as the CPUs they name, and a
run prints the machine's topology and one bare-loop rate per rep for each CPU set it pins to."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from placement_probe import cpulist  # noqa: E402


def test_cpu_lists_read_as_the_cpus_they_name() -> None:
    assert cpulist("0-3,8,10-11") == [0, 1, 2, 3, 8, 10, 11]
    assert cpulist("5") == [5]
    assert cpulist("") == []


def test_the_probe_pins_the_bare_loop_to_each_cpu_set(model_cache: Path) -> None:
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "placement_probe.py"),
                          "--size", "tiny", "--dtype", "float32", "--tokens", "8", "--reps", "2",
                          "--cache-dir", str(model_cache)],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    topo = lines[0]
    assert topo["what"] == "topology" and topo["cpus"]
    loops = {line["cpus"]: line["tok_s"] for line in lines[1:] if line["what"] == "bare loop"}
    assert "all" in loops and f"cpu {topo['cpus'][0]}" in loops, lines
    for rates in loops.values():
        assert isinstance(rates, list) and len(rates) == 2 and all(r > 0 for r in rates), loops
