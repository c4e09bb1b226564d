"""benchmarks/anchor_report.py: the tables RESULTS.md records, from a same-process run's anchor_results.json (the
shape the harness writes: rows of cells, each with its variants' times, errors and launches)."""

from __future__ import annotations

import json

from benchmarks import anchor_report

VARIANT = "project:REPACK_DEPENDENT_LAUNCH=1"


def _launch(name: str, us: float) -> dict:
    return {"name": name, "us": us, "launches": 1.0}


def _row(model: str, m: int, tag: str, variants: dict) -> dict:
    return {"model": model, "key": model.lower(), "tag": tag, "M": m, "floor_us": 50.0, "variants": variants}


def _write(tmp_path, rows: list[dict]):
    """A run's anchor_results.json holding ``rows``."""
    path = tmp_path / "anchor_results.json"
    path.write_text(json.dumps({"meta": {}, "rows": rows}))
    return path


def _report(tmp_path, capsys, rows: list[dict], *options: str) -> str:
    """What anchor_report prints for a run of ``rows`` with ``options``."""
    anchor_report.main([str(_write(tmp_path, rows)), *options])
    return capsys.readouterr().out


def _results(tmp_path):
    ours = {"us": 60.0, "rel_err": 5e-4, "launches": [_launch("_w13_ws_kernel", 40.0), _launch("_count_kernel", 5.0)]}
    faster = {"us": 48.0, "rel_err": 5e-4, "launches": [_launch("_w13_ws_kernel", 38.0)]}
    marlin = {"us": 80.0, "launches": [_launch("marlin_moe_wna16::Marlin", 70.0)]}
    rows = [
        _row("Qwen3-30B-A3B", 16, "main", {"project": ours, "marlin": marlin, VARIANT: faster}),
        _row("Qwen2-57B-A14B", 16, "bf16", {"project": ours, "marlin": marlin}),  # an extra without the variant
    ]
    return _write(tmp_path, rows)


def test_ours_is_project_unless_a_variant_is_named(tmp_path, capsys):
    path = _results(tmp_path)
    anchor_report.main([str(path)])
    default = capsys.readouterr().out
    assert "| Qwen3-30B-A3B | 0.75 |" in default  # 60 / 80
    anchor_report.main([str(path), "--ours", VARIANT])
    named = capsys.readouterr().out
    assert "| Qwen3-30B-A3B | 0.60 |" in named  # 48 / 80
    assert "| Qwen2-57B-A14B bf16 | 0.75 |" in named  # the cell without the variant keeps project


def test_variants_side_by_side_over_project(tmp_path, capsys):
    anchor_report.main([str(_results(tmp_path)), "--variants", "--launches", "--ours", VARIANT])
    out = capsys.readouterr().out
    assert f"| model | M | project | marlin | {VARIANT} |" in out
    assert "| Qwen3-30B-A3B | 16 | 60.0 | 80.0 | 48.0 (0.800) |" in out
    assert "| Qwen2-57B-A14B bf16 | 16 | 60.0 | 80.0 | - |" in out
    # the launch table is the named variant's: its one launch, no glue
    assert "| Qwen3-30B-A3B | 16 | 48.0 | 0.0 | 0.0 | _w13_ws_kernel 38.0 |" in out
    # and project's beside it, in every cell (the variant's other project variant here)
    assert "launches (project, us per call)" in out
    assert "| Qwen2-57B-A14B bf16 | 16 | 60.0 | 5.0 | 8.3 | _w13_ws_kernel 40.0; _count_kernel 5.0 |" in out


def test_each_project_variants_launches_only_in_the_cells_that_ran_it(tmp_path, capsys):
    anchor_report.main([str(_results(tmp_path)), "--variants", "--launches"])
    out = capsys.readouterr().out
    table = out[out.index(f"launches ({VARIANT}, us per call)") :].split("\n\n")[0]
    assert "| Qwen3-30B-A3B | 16 | 48.0 | 0.0 | 0.0 | _w13_ws_kernel 38.0 |" in table
    assert "Qwen2-57B-A14B" not in table  # the bf16 cell did not run the variant: no fallback row


def test_overlapping_launches_are_counted_by_what_they_add(tmp_path, capsys):
    """With dependent launches a launch's span includes its wait on the one before: the glue counts the exposed
    part, and the launch shows both."""
    launches = [dict(_launch("_w13_decode_kernel", 11.2), exposed_us=8.9), dict(_launch("_prepare_kernel", 5.3)),
                dict(_launch("_w2_decode_kernel", 11.5), exposed_us=3.6)]  # fmt: skip
    rows = [_row("Qwen3-30B-A3B", 1, "main", {"project": {"us": 17.9, "launches": launches}})]
    out = _report(tmp_path, capsys, rows, "--launches")
    assert (
        "| Qwen3-30B-A3B | 1 | 17.9 | 5.3 | 29.6 | _w13_decode_kernel 11.2 (8.9 exposed); _prepare_kernel 5.3; "
        "_w2_decode_kernel 11.5 (3.6 exposed) |" in out
    )


def test_targets_check_every_cell_and_count_the_misses(tmp_path, capsys):
    """Issues 17 and 18's targets from the run itself: the glue bound by M, the floor bound to M = 64, each GEMM's
    rate from M = 1024 (K = H for w13, I for w2), bf16 against the same cell's fp16 call."""
    gemms = [dict(_launch("_w13_ws_kernel", 700.0), exposed_us=600.0), _launch("_w2_ws_kernel", 250.0)]
    fp16 = {"us": 1000.0, "launches": [*gemms, _launch("_count_kernel", 60.0)]}  # glue 6%
    decode = {"project": {"us": 60.0, "launches": [_launch("_count_kernel", 4.0)]}, "marlin": {"us": 59.0}}
    prefill = {"project": fp16, "triton_fp16": {"us": 1100.0}}
    rows = [
        {**_row("Qwen3-30B-A3B", 16, "main", decode), "floor_us": 40.0},
        {**_row("Qwen3-30B-A3B", 1024, "main", prefill), "top_k": 8, "H": 2048, "I": 768},
        _row("Qwen3-30B-A3B", 1024, "bf16", {"project": {"us": 1060.0}}),
    ]
    out = _report(tmp_path, capsys, rows, "--targets")
    # 60 > 59 us; 4 us of glue; 1.25 x 40 + 5 = 55 < 60
    assert (
        "| Qwen3-30B-A3B | 16 | MISSED < Marlin 1.02; glue <= 5 us 4.0 us; MISSED <= 1.25 floor + 5 60.0 for 55.0 |"
        in out
    )
    # w13: 4 x 8192 pairs x 768 x 2048 flops over its 600 exposed us = 86 TFLOP/s; w2 half of them over 250 us
    assert (
        "| Qwen3-30B-A3B | 1024 | MISSED glue <= 5% 6.0%; MISSED w13 TFLOP/s 86 for 550; "
        "MISSED w2 TFLOP/s 103 for 450; < fp16 Triton 0.91 |" in out
    )
    assert "| Qwen3-30B-A3B bf16 | 1024 | MISSED <= 1.05 x fp16 1.060 |" in out
    assert "| glue <= 5 us | 1 | 0 |" in out
    assert "| <= 1.05 x fp16 | 0 | 1 |" in out
