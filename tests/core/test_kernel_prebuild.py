"""Quantized-matmul kernels built in child processes before the kernel warm-up
(pipeserve/core/kernel_prebuild.py): which shapes, which quantizations, and how their files
reach the shared kernel cache. The compile itself happens only on CUDA; here the children run
the same matmuls on the CPU."""
from __future__ import annotations

import os

import mlx.nn as nn

from pipeserve.core import kernel_prebuild as kp


def test_row_classes_stop_at_what_the_server_meets():
    assert kp.row_classes(max_rows=128, prefill_chunk=2048) == [16, 32, 64]
    assert kp.row_classes(max_rows=32, prefill_chunk=48) == [16, 32, 48]
    assert kp.row_classes(max_rows=4, prefill_chunk=8) == [8]


class _Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(256, 128)
        self.b = nn.Linear(512, 64)
        self.c = nn.Linear(256, 64)
        self.head = nn.Linear(128, 32)


def test_each_quantization_of_a_model_is_found_once_with_a_real_input_width():
    m = _Mixed()
    nn.quantize(m, group_size=64, bits=4, class_predicate=lambda p, _: p in ("a", "b", "c"))
    nn.quantize(m, group_size=32, bits=8, class_predicate=lambda p, _: p == "head")
    specs = kp.quant_specs(m)
    assert specs == [kp.QuantSpec(4, 64, "affine", k=256), kp.QuantSpec(8, 32, "affine", k=128)]
    assert kp.quant_specs(_Mixed()) == []   # nothing quantized: nothing to build


def _module(folder, name, text):
    for suffix in kp.SUFFIXES:
        (folder / f"{name}{suffix}").write_text(f"{text}{suffix}")


def test_publish_moves_new_modules_whole_and_leaves_what_the_shared_cache_has(tmp_path):
    shared, private = tmp_path / "shared", tmp_path / "private"
    shared.mkdir()
    private.mkdir()
    _module(shared, "qmm_old", "old")
    kp.seed(shared, private)                       # hard links of what the cache holds
    assert (private / "qmm_old.ptx").read_text() == "old.ptx"
    _module(private, "qmm_new", "new")             # what the child compiled
    (private / "sub").mkdir()
    _module(private / "sub", "long_name", "deep")  # MLX splits long module names into folders
    published = kp.publish(private, shared)
    assert sorted(published) == ["qmm_new", os.path.join("sub", "long_name")]
    for suffix in kp.SUFFIXES:
        assert (shared / f"qmm_new{suffix}").read_text() == f"new{suffix}"
        assert (shared / "sub" / f"long_name{suffix}").read_text() == f"deep{suffix}"
    assert (shared / "qmm_old.ptx").read_text() == "old.ptx"
    assert not [f for f in shared.rglob(".*")]    # no temporary file left behind
    assert kp.publish(private, shared) == []       # published once


def test_the_children_run_each_job_the_engine_gives_them(tmp_path, monkeypatch):
    """The children's arguments and operations are valid for every quantized-matmul and
    indexing job the engine builds for a quantized bf16 model (4- and 8-bit affine, mxfp4): on
    the CPU they compile nothing, so none fails and no module is published."""
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path / "ptx"))
    specs = [kp.QuantSpec(4, 64, "affine", k=256), kp.QuantSpec(8, 32, "affine", k=128),
             kp.QuantSpec(4, 32, "mxfp4", k=256)]
    jobs = kp.matmul_jobs(specs, "bfloat16", [16, 48]) + kp.indexing_jobs("bfloat16", True)
    assert len(jobs) == 6 + 13
    rep = kp.prebuild(jobs, force=True)
    assert rep is not None
    assert rep.children == len(jobs)
    assert rep.failed == []
    assert rep.modules == []
    # a launch on the same kernel cache runs none of them again, and a new job alone
    again = kp.prebuild(jobs + kp.indexing_jobs("float16", False)[:1], force=True)
    assert again is not None and again.children == 1 and again.failed == []
    assert kp.prebuild(jobs, force=True) == kp.Report(0, 0.0, [], [])
    assert kp.prebuild(jobs) is None   # not on CUDA, not forced: nothing runs
    assert kp.prebuild([], force=True) is None


def test_a_child_that_fails_is_reported_in_one_line_and_publishes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path / "ptx"))
    rep = kp.prebuild(kp.matmul_jobs([kp.QuantSpec(3, 32, "mxfp4", k=256)], "bfloat16", [16]),
                      force=True)
    assert rep is not None and rep.modules == []
    assert len(rep.failed) == 1 and "\n" not in rep.failed[0]
    again = kp.prebuild(kp.matmul_jobs([kp.QuantSpec(3, 32, "mxfp4", k=256)], "bfloat16", [16]),
                        force=True)
    assert again is not None and again.children == 1   # a failed job is tried again
    assert rep.failed[0].startswith("qmm bfloat16 3 32 mxfp4 256 16: exit 1 ")
    assert "mxfp4" in rep.failed[0]
