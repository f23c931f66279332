"""Pure parts of the benchmarks (serial, no GPU, no MPI job): workloads, SQNR, timing statistics,
report metadata and tables, the command line."""

import dataclasses
import functools
import json
import math
import os
import subprocess
import sys
import types

import numpy
import pytest

from mxcomm.bench import _checks, _report, _timing, _workload
from mxcomm.bench._cli import build_parser
from mxcomm.bench.pipeline import shapes_from_args, summary_rows


# ------------------------------------------------------------------------------ workloads
@pytest.mark.parametrize("world", [1, 2, 3, 8])
@pytest.mark.parametrize("kind", ["uniform", "skewed"])
def test_split_matrix_rows_sum_and_columns_are_receives(world, kind):
    rows = 1000 + world
    m = _workload.split_matrix(world, rows, kind, seed=7)
    assert m.shape == (world, world)
    assert (m >= 0).all()
    assert (m.sum(axis=1) == rows).all()
    for rank in range(world):
        send, recv = _workload.rank_splits(m, rank)
        assert sum(send) == rows
        assert recv == [int(m[r, rank]) for r in range(world)]
    # What rank a sends to rank b is what b receives from a.
    for a in range(world):
        for b in range(world):
            assert _workload.rank_splits(m, a)[0][b] == _workload.rank_splits(m, b)[1][a]


def test_split_matrix_same_seed_same_matrix_and_skewed_is_skewed():
    a = _workload.split_matrix(4, 4096, "skewed", seed=3)
    b = _workload.split_matrix(4, 4096, "skewed", seed=3)
    assert numpy.array_equal(a, b)
    assert not numpy.array_equal(a, _workload.split_matrix(4, 4096, "uniform"))
    assert _workload.split_matrix(3, 10, "uniform").tolist() == [[4, 3, 3]] * 3


def test_split_matrix_rejects_unknown_kind():
    with pytest.raises(ValueError, match="kind"):
        _workload.split_matrix(2, 10, "zipf")


def test_integer_split_is_exact():
    assert _workload.integer_split(10, [1, 1, 1]) == [4, 3, 3]
    assert sum(_workload.integer_split(12345, numpy.random.default_rng(0).random(17))) == 12345
    assert _workload.integer_split(0, [1, 2]) == [0, 0]
    with pytest.raises(ValueError, match="weights"):
        _workload.integer_split(5, [0, 0])


@pytest.mark.parametrize("routing", ["uniform", "topk"])
@pytest.mark.parametrize("rows,experts", [(131072, 16), (64, 4), (100, 3), (1000, 64)])
def test_expert_counts_sum_to_rows(routing, rows, experts):
    counts = _workload.expert_counts(routing, rows, experts, seed=1, rank=1)
    assert counts.dtype == numpy.int32 and counts.shape == (experts,)
    assert int(counts.sum()) == rows and (counts >= 0).all()


def test_topk_is_skewed_and_seeded():
    a = _workload.topk_expert_counts(8192, 16, seed=5, rank=0)
    assert numpy.array_equal(a, _workload.topk_expert_counts(8192, 16, seed=5, rank=0))
    assert a.max() > 2 * a.min()  # Zipf popularity
    uniform = _workload.uniform_expert_counts(8192, 16)
    assert (uniform == 512).all()


def test_padded_rows_bandwidth_helpers():
    assert _workload.padded_rows(64, 2, 32) == 128
    assert _workload.padded_rows(65, 2, 32) == 160
    assert _workload.gbps(2e9, 1000.0) == pytest.approx(2.0)
    assert _workload.busbw(100.0, 4) == pytest.approx(75.0)
    assert math.isnan(_workload.gbps(1, 0.0))


# ----------------------------------------------------------------------------------- SQNR
def test_sqnr_db():
    ref = numpy.random.default_rng(0).standard_normal((64, 32))
    assert _workload.sqnr_db(ref, ref) == math.inf
    assert _workload.sqnr_db(ref, ref * 1.1) == pytest.approx(20.0)      # noise = 0.1 * signal
    assert _workload.sqnr_db(ref, ref + 0.01 * ref) == pytest.approx(40.0)
    bad = ref.copy()
    bad[0, 0] = numpy.nan
    assert math.isnan(_workload.sqnr_db(ref, bad))
    assert math.isnan(_workload.sqnr_db(numpy.zeros(3), numpy.ones(3)))
    with pytest.raises(ValueError, match="shape"):
        _workload.sqnr_db(ref, ref[:3])


def test_pipeline_sqnr_torch_matches_numpy():
    torch = pytest.importorskip("torch")
    from mxcomm.bench.pipeline import _sqnr
    ref = torch.randn(9000, 8, dtype=torch.float64)  # more rows than one chunk
    out = ref + 0.05 * torch.randn(9000, 8, dtype=torch.float64)
    assert _sqnr(ref, out) == pytest.approx(_workload.sqnr_db(ref.numpy(), out.numpy()))


# --------------------------------------------------------------------------------- timing
def test_stats_and_measure_with_host_clock():
    s = _timing.Stats.of([3.0, 1.0, 2.0, 10.0])
    assert (s.median, s.min, s.iters) == (2.5, 1.0, 4)
    assert s.p90 == pytest.approx(numpy.percentile([3, 1, 2, 10], 90))
    calls = []
    stats = _timing.measure(lambda v: calls.append(v), _timing.Clock("host"), iters=4, warmup=2,
                            before=lambda: calls.append("b"), inputs=["x", "y"])
    assert stats.iters == 4 and stats.min >= 0
    assert calls == ["b", "x", "b", "y"] * 3  # rotated inputs, before() every iteration
    with pytest.raises(ValueError):
        _timing.measure(lambda: None, _timing.Clock("host"), iters=0, warmup=0)
    with pytest.raises(ValueError):
        _timing.Clock("wall")


def test_max_over_ranks():
    s = _timing.max_over_ranks(_timing.Stats(1.0, 0.5, 2.0, 3), lambda v: [x * 2 for x in v])
    assert (s.median, s.min, s.p90, s.iters) == (2.0, 1.0, 4.0, 3)


# --------------------------------------------------------------------------------- report
def test_metadata_has_every_field(monkeypatch):
    monkeypatch.setenv("MXCOMM_COMMIT", "abc1234")
    meta = _report.metadata("a2a", 4, {"rows": [64]}, ["a note"], iters=3)
    for field in _report.META_FIELDS:
        assert field in meta
    assert meta["world_size"] == 4 and meta["iters"] == 3 and meta["notes"] == ["a note"]
    assert meta["device"]
    assert meta["commit"]  # git's short hash, or the variable, or "unknown"
    for lib in ("torch", "cupy", "numba-cuda", "nccl (cupy)", "nccl (torch)"):
        assert lib in meta["versions"]
    assert meta["date"].endswith("+00:00")


def test_git_commit_prefers_the_environment(monkeypatch, tmp_path):
    """The variable names a copied tree's commit, even where a stale .git says otherwise."""
    import os
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    monkeypatch.setenv("MXCOMM_COMMIT", "feedbee")
    assert _report.git_commit(cwd=repo) == "feedbee"
    assert _report.git_commit(cwd=str(tmp_path)) == "feedbee"  # not a git checkout
    monkeypatch.delenv("MXCOMM_COMMIT")
    assert _report.git_commit(cwd=str(tmp_path)) == "unknown"


def test_tables_and_files(tmp_path):
    rows = [{"op": "quantize", "ms": 1.23456, "ratio": float("nan"), "n": 3},
            {"op": "permute", "ms": float("inf"), "ratio": 0.9, "n": 4}]
    text = _report.format_table(rows, ["op", "ms", "ratio"])
    assert "1.235" in text and "n/a" in text and "inf" in text and "+=" in text  # grid format
    assert _report.format_table([]) == "(no rows)"
    assert _report.speedup(1.5) == "1.50x" and _report.speedup(float("nan")) == "n/a"
    meta = _report.metadata("kernels", 1, {}, ["note"])
    _report.write_json(tmp_path / "r.json", meta, {"kernels": rows})
    loaded = json.loads((tmp_path / "r.json").read_text())  # strict JSON: no NaN literals
    assert loaded["tables"]["kernels"][0]["ratio"] is None
    assert loaded["tables"]["kernels"][1]["ms"] == "inf"
    assert loaded["meta"]["world_size"] == 1
    _report.write_markdown(tmp_path / "r.md", "title", meta, [("kernels", rows, ["op", "ms"])])
    md = (tmp_path / "r.md").read_text()
    assert md.startswith("# title") and "| op" in md and "device:" in md


def test_pipeline_summary_rows():
    end_to_end = [
        {"tokens": 8, "dim": 32, "hidden_dim": 32, "experts_per_rank": 2, "variant": v,
         "fwd_ms": f, "bwd_ms": b, "total_ms": f + b}
        for v, f, b in (("bf16", 3.0, 6.0), ("mxfp8", 2.0, 4.0), ("mxfp8_all", 1.5, 3.0),
                        ("bf16+fp8gemm", 2.0, 2.5), ("fp8_rowwise", 1.0, 2.0))]
    base, default, every, gemm, rowwise = summary_rows(end_to_end)
    assert (base["variant"], base["fwd_ms"], base["vs bf16"]) == ("bf16", 3.0, "")
    assert base["vs bf16+fp8gemm"] == "0.50x"            # 4.5 ms / 9 ms
    assert default["fwd vs bf16"] == "1.50x" and default["bwd vs bf16"] == "1.50x"
    assert default["vs bf16"] == "1.50x" and default["shape"] == "8x32x32x2"
    assert every["vs bf16"] == "2.00x"
    assert (gemm["vs bf16"], gemm["vs bf16+fp8gemm"]) == ("2.00x", "")
    assert (rowwise["vs bf16"], rowwise["vs bf16+fp8gemm"]) == ("3.00x", "1.50x")
    # Without bf16+fp8gemm in the run (--variants), its column says so.
    assert summary_rows(end_to_end[:2])[1]["vs bf16+fp8gemm"] == "n/a"


# ------------------------------------------------------------------------- pipeline checks
@pytest.mark.parametrize("interleave", [False, True])
def test_pipeline_run_order(interleave):
    """The end-to-end timing's order: each variant warmup + iters times; interleaved, every
    iteration runs every variant once, the order rotated by one per iteration (each variant
    leads as often as the others); else each variant's iterations together."""
    import argparse
    from mxcomm.bench.pipeline import _Case
    case = object.__new__(_Case)
    case.args = argparse.Namespace(warmup=2, iters=4)
    names = ["bf16", "mxfp8", "fp8_rowwise"]
    runs = case._runs(names, interleave)
    assert sorted(runs) == sorted((i, n) for n in names for i in range(6))
    if not interleave:
        assert runs == [(i, n) for n in names for i in range(6)]
        return
    for i in range(6):
        order = [n for j, n in runs if j == i]
        assert order == names[i % 3:] + names[:i % 3]
    assert [i for i, _ in runs] == sorted(i for i, _ in runs)  # iteration by iteration


def test_row_bytes_and_wire_rows():
    from mxcomm.bench import _moe
    assert _checks.row_bytes("bf16", 1024) == 2048
    assert _checks.row_bytes("mxfp8", 1024) == 1024 + 32
    assert _checks.row_bytes("fp8_rowwise", 1024) == 1024 + 4
    with pytest.raises(ValueError, match="precision"):
        _checks.row_bytes("fp4", 32)

    class Case:
        dim, hidden, label = 64, 32, "s"

    def same(values):  # one rank's numbers as the sums (maxima) over ranks
        return values

    # rank 1 of 3 sends [2, 5, 1] rows (keeps 5) and receives [4, 7, 0] rows (keeps 7)
    rows = _checks.wire_rows(_moe.VARIANTS[1], Case, [2, 5, 1], [4, 7, 0], 1, same, same)
    got = {r["direction"]: (r["precision"], r["rows"], r["bytes"]) for r in rows}
    assert got == {"dispatch": ("mxfp8", 3, 3 * 66), "combine": ("bf16", 4, 4 * 64),
                   "dispatch_grad": ("bf16", 4, 4 * 128), "combine_grad": ("mxfp8", 3, 3 * 33)}
    by_name = {v.name: v for v in _moe.VARIANTS}
    rows = _checks.wire_rows(by_name["fp8_rowwise"], Case, [2, 5, 1], [4, 7, 0], 1, same, same)
    got = {r["direction"]: (r["precision"], r["bytes"]) for r in rows}
    assert got == {"dispatch": ("fp8_rowwise", 3 * (64 + 4)), "combine": ("bf16", 4 * 64),
                   "dispatch_grad": ("bf16", 4 * 128), "combine_grad": ("fp8_rowwise", 3 * 36)}
    for name in ("bf16", "bf16+fp8gemm"):  # torch's exchanges: bf16 every way
        rows = _checks.wire_rows(by_name[name], Case, [2, 5, 1], [4, 7, 0], 1, same, same)
        assert [r["bytes"] for r in rows] == [3 * 128, 4 * 64, 4 * 128, 3 * 64]
    # small exchanges (the communicator's rule, on a stand-in holding only the limit): the
    # dispatch (3 rows of 64 bf16: 384 bytes) and the combine gradient (3 x 32: 192) move
    # unquantized below their limits, quantized above
    from mxcomm.comm._communicator import Communicator
    for limit, dispatch, grad in ((384, "bf16", "bf16"), (383, "mxfp8", "bf16"),
                                  (191, "mxfp8", "mxfp8")):
        comm = types.SimpleNamespace(small_exchange_bytes=limit)
        rows = _checks.wire_rows(_moe.VARIANTS[1], Case, [2, 5, 1], [4, 7, 0], 1, same, same,
                                 functools.partial(Communicator.small_exchange, comm))
        got = {r["direction"]: (r["precision"], r["bytes"]) for r in rows}
        label = {"bf16": "mxfp8 (bf16 on the wire)", "mxfp8": "mxfp8"}
        assert got["dispatch"] == (label[dispatch], 3 * (128 if dispatch == "bf16" else 66))
        assert got["combine_grad"] == (label[grad], 3 * (64 if grad == "bf16" else 33))


@pytest.mark.parametrize("counts,e_local,align", [([2, 1, 0, 3], 2, 4), ([0, 0, 0, 0], 2, 32),
                                                  ([5, 0, 7, 1, 2, 9], 3, 8), ([3, 4], 1, 1)])
def test_permutation_index_matches_the_reference(counts, e_local, align):
    from reference import permute_ref
    rows = sum(counts)
    _, want_idx, want_offsets = permute_ref(numpy.zeros((rows, 1)), counts, e_local, align)
    idx, offsets = _checks.permutation_index(counts, e_local, align, rows)
    assert idx.tolist() == want_idx.tolist() and offsets == want_offsets.tolist()


def test_differ_counts_rows():
    torch = pytest.importorskip("torch")
    a = torch.zeros(5, 4, dtype=torch.uint8)
    b = a.clone()
    b[1, 3] = b[4, 0] = 7
    assert _checks._differ(a, a) == (0, 5)
    assert _checks._differ(a, b) == (2, 5)
    assert _checks._differ(a, b[:3]) == (5, 5)          # a shape mismatch: every row
    assert _checks._differ(None, True) == (0, 1) and _checks._differ(None, False) == (1, 1)
    assert _checks._differ(a, None) == (0, 5)           # no reference: skipped, not counted


def test_a_step_without_reference_is_skipped_not_exact():
    """A permute conversion the checker has no reference for is reported "skipped" (and the
    table says so), never "exact"."""
    import types
    from mxcomm.bench import pipeline
    torch = pytest.importorskip("torch")
    checker = _checks.Checker(None, types.SimpleNamespace(dim=32), 32)
    h = torch.zeros(4, 32, dtype=torch.bfloat16)
    idx = torch.tensor([1, -1, 0])
    assert checker._permuted(h, idx, "mxfp8", "fp8_block128") is None
    assert checker._permuted(h, idx, "bf16", None).shape == (3, 64)
    rows = [{"shape": "s", "variant": "mxfp8", "step": "permute", "precision": "fp8_block128",
             "rows": 3, "rows_differ": 0, "result": "skipped"}]
    table, _ = pipeline.exactness_display(rows)
    assert table[0]["mxfp8"] == "skipped (fp8_block128)"
    assert not pipeline.failed({"exactness": rows})


def _pipeline_tables(gpu):
    """Tables of a 2-shape pipeline run of the default variants as ``measure`` builds them."""
    from mxcomm.bench import _moe
    variants = [v for v in _moe.VARIANTS if v.default]
    tables = {"wire": [], "exactness": [], "sqnr": []}
    if gpu:
        tables.update(end_to_end=[], stages=[])
    for shape in ((131072, 8192, 5120, 8), (16384, 7168, 2048, 8)):
        label = "x".join(map(str, shape))
        for i, v in enumerate(variants):
            for step in _checks.STEPS:
                if v.torch_a2a and step in ("dispatch", "combine", "combine bwd", "dispatch bwd"):
                    continue  # torch's own exchanges
                tables["exactness"].append({"shape": label, "variant": v.name, "step": step,
                                            "precision": "mxfp8", "rows": 131072,
                                            "rows_differ": 3 if step == "combine" and i else 0,
                                            "result": "3/131072 rows differ"
                                            if step == "combine" and i else "exact"})
            for d, _, _ in _checks.DIRECTIONS:
                tables["wire"].append({"shape": label, "variant": v.name, "direction": d,
                                       "precision": "bf16", "rows": 98304,
                                       "bytes": 1610612736 // (i + 1)})
            if not v.baseline:
                tables["sqnr"].append({"shape": label, "variant": v.name, "out_db": 31.46,
                                       "input_grad_db": 31.46, "weight_grad_db": 28.45,
                                       "ok": "yes"})
            if gpu:
                tables["end_to_end"].append({"tokens": shape[0], "dim": shape[1],
                                             "hidden_dim": shape[2], "experts_per_rank": shape[3],
                                             "variant": v.name, "fwd_ms": 25.7 - i, "bwd_ms": 39.5,
                                             "total_ms": 65.2 - i})
        if gpu:
            for stage in ("layout", "dispatch", "grad_dequantize", "combine"):
                for direction in ("fwd", "bwd"):
                    tables["stages"].append({"shape": label, "stage": stage, "pass": direction,
                                             **{f"{v.name}_ms": 1234.567 if v.baseline else
                                                float("nan") if stage == "grad_dequantize" and
                                                v.gemm == "fp8" else 0.5
                                                for v in variants}})
    return tables


@pytest.mark.parametrize("gpu", [False, True], ids=["cpu_tables", "gpu_tables"])
def test_pipeline_report_fits_120_columns(tmp_path, gpu):
    from mxcomm.bench import pipeline
    tables = _pipeline_tables(gpu)
    meta = _report.metadata("pipeline", 4, [], ["a long note " * 30], run="what this run is")
    text = pipeline.render(meta, tables)
    assert max(len(line) for line in text.splitlines()) <= 120
    assert ("whole pipeline" in text) == gpu and ("per stage" in text) == gpu
    assert ("vs bf16+fp8gemm" in text) == gpu
    assert "| 3/131072" in text and "| rows differ" in text and "| (mxfp8)" in text
    assert "| torch," in text and "| unchecked" in text
    assert "0.50x" in text  # bytes of the third variant vs bf16
    assert all(f"| {v.name} " in text for v in pipeline.parse_variants(None))  # a column each
    assert pipeline.failed(tables) and not pipeline.failed({"exactness": []})
    _report.write_markdown(tmp_path / "p.md", "t", meta, pipeline.markdown_sections(tables))
    md = (tmp_path / "p.md").read_text()
    assert md.splitlines()[2] == "what this run is"
    assert "3/131072 rows differ (mxfp8)" in md and "torch, unchecked" in md
    assert ("| fwd vs bf16 " in md) == gpu  # Markdown has room for the fwd/bwd speedups
    pytest.importorskip("matplotlib")
    pipeline.plot(tmp_path / "p.png", meta, tables)
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


def test_pipeline_run_writes_files_and_says_what_it_is(tmp_path):
    """A whole (one-process, tiny) run: the first line, every check exact, a line per file."""
    pytest.importorskip("torch")
    paths = [tmp_path / name for name in ("p.json", "p.md", "p.png")]
    env = dict(os.environ, MXCOMM_BACKEND="host")
    out = subprocess.run([sys.executable, "-m", "mxcomm.bench", "pipeline", "--tokens", "96",
                          "--dim", "64", "--hidden", "32", "--experts", "2",
                          "--json", str(paths[0]), "--markdown", str(paths[1]),
                          "--plot", str(paths[2])],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("mxcomm EP pipeline, 1 rank on a CPU, host backend")
    assert "No timings" in lines[0]
    assert lines[-3:] == [f"wrote {p}" for p in paths] and all(p.stat().st_size for p in paths)
    result = json.loads(paths[0].read_text())
    tables = result["tables"]
    assert tables["exactness"] and all(r["result"] == "exact" for r in tables["exactness"])
    assert "end_to_end" not in tables and "ms" not in out.stdout
    names = ["bf16", "mxfp8", "mxfp8_all", "bf16+fp8gemm", "fp8_rowwise", "mxfp8+rowwise"]
    assert result["meta"]["variants"] == names and result["meta"]["fp8_gemm"] is False
    assert [r["variant"] for r in tables["sqnr"]] == names[1:]
    assert "ran its bf16 fallback" in out.stdout  # the report says the fp8 GEMM was not fp8


# ----------------------------------------------------------------------------------- CLI
def test_cli_parses_every_subcommand():
    p = build_parser()
    a = p.parse_args(["pipeline", "--tokens", "131072", "--dim", "8192", "7168", "--hidden",
                      "5120", "2048", "--routing", "topk", "--json", "x.json"])
    assert a.command == "pipeline" and a.routing == "topk" and a.json == "x.json"
    assert shapes_from_args(a, "cuda") == [(131072, 8192, 5120, 8), (131072, 7168, 2048, 8)]
    a = p.parse_args(["a2a", "--rows", "64", "--leak-iters", "5", "--splits", "skewed"])
    assert a.leak_iters == 5 and a.splits == ["skewed"] and a.iters is None
    a = p.parse_args(["kernels", "--iters", "3", "--warmup", "0"])
    assert (a.iters, a.warmup) == (3, 0)
    with pytest.raises(SystemExit):
        p.parse_args(["nccl"])


@pytest.mark.parametrize("gc_option", ["on", "off"])
def test_cli_gc_option_holds_collection_off_while_measuring(monkeypatch, tmp_path, gc_option):
    """``--gc off``: automatic collection off while the benchmark measures, back on after, and
    the report says so; ``--gc on`` (the default) leaves it alone."""
    import gc

    from mxcomm.bench import _cli, kernels
    seen = []

    def measure(args, rt):
        seen.append(gc.isenabled())
        return _report.metadata("kernels", 1, []), {}

    monkeypatch.setattr(kernels, "measure", measure)
    monkeypatch.setattr(kernels, "render", lambda meta, tables: "")
    monkeypatch.setattr(kernels, "markdown_sections", lambda tables: [])
    monkeypatch.setenv("MXCOMM_BACKEND", "host")
    path = tmp_path / "k.json"
    assert gc.isenabled()
    assert _cli.main(["kernels", "--gc", gc_option, "--json", str(path)]) == 0
    assert seen == [gc_option == "on"] and gc.isenabled()
    meta = json.loads(path.read_text())["meta"]
    assert meta["gc"] == gc_option
    assert any("garbage collection off" in n for n in meta["notes"]) == (gc_option == "off")


def test_cli_help_gives_defaults_and_units(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["pipeline", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "rows per rank, > 0 (default: 131072 131072 16384 on a GPU, 2048 on a CPU" in text
    assert "a multiple of 32" in text and "experts per rank" in text and "the seed's" not in text


def test_pipeline_shapes_default_and_mismatch():
    p = build_parser()
    assert len(shapes_from_args(p.parse_args(["pipeline"]), "cuda")) == 3
    assert shapes_from_args(p.parse_args(["pipeline"]), "host") == [(2048, 1024, 512, 4)]
    assert shapes_from_args(p.parse_args(["pipeline"]), "simulator") == [(64, 32, 32, 2)]
    assert shapes_from_args(p.parse_args(["pipeline", "--tokens", "96"]), "host") == \
        [(96, 1024, 512, 4)]
    with pytest.raises(ValueError, match="lists of one length"):
        shapes_from_args(p.parse_args(["pipeline", "--dim", "1", "2", "--hidden", "1", "2", "3"]),
                         "cuda")


@pytest.mark.parametrize("argv,message", [
    (["pipeline", "--dim", "48"], "--dim: expected multiples of 32 (MXFP8 blocks of 32 elements), "
                                  "got 48"),
    (["pipeline", "--tokens", "0"], "--tokens: expected positive values, got 0"),
    (["pipeline", "--hidden", "64", "40"], "--hidden: expected multiples of 32"),
    (["pipeline", "--experts", "-1"], "--experts: expected positive values, got -1"),
    (["pipeline", "--tokens", "1", "2", "--dim", "32", "64", "96"], "lists of one length"),
    (["pipeline", "--iters", "0"], "--iters: expected >= 1, got 0"),
    (["kernels", "--dim", "100"], "--dim: expected a positive multiple of 32"),
    (["kernels", "--rows", "0"], "--rows: expected positive values, got 0"),
    (["a2a", "--leak-iters", "-2"], "--leak-iters: expected >= 0, got -2"),
    (["pipeline", "--variants", "mxfp8,fp4"], "--variants: unknown variant 'fp4'; accepted: bf16, "
                                             "mxfp8, mxfp8_all, bf16+fp8gemm, fp8_rowwise, "
                                             "mxfp8+rowwise, fp8_rowwise_mxgrad, "
                                             "fp8_rowwise_mxgrad_fused, "
                                             "fp8_rowwise_bf16wgrad, fp8_rowwise_acc32"),
    (["pipeline", "--variants", " , "], "--variants: expected comma-separated variant names"),
])
def test_cli_rejects_bad_shapes_in_one_line(capsys, argv, message):
    from mxcomm.bench._cli import main
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"python -m mxcomm.bench {argv[0]}: error: ") and message in err


# ------------------------------------------------------------------------------ variants
def test_variants_option_parses_names_in_table_order_with_the_reference():
    from mxcomm.bench.pipeline import parse_variants
    p = build_parser()
    every = parse_variants(p.parse_args(["pipeline"]).variants)
    assert [v.name for v in every] == ["bf16", "mxfp8", "mxfp8_all", "bf16+fp8gemm",
                                       "fp8_rowwise", "mxfp8+rowwise"]
    extra = parse_variants("fp8_rowwise_acc32,fp8_rowwise_bf16wgrad,fp8_rowwise_mxgrad,"
                           "fp8_rowwise")
    assert [v.name for v in extra] == ["bf16", "fp8_rowwise", "fp8_rowwise_mxgrad",
                                       "fp8_rowwise_bf16wgrad", "fp8_rowwise_acc32"]
    a = p.parse_args(["pipeline", "--variants", "mxfp8+rowwise, bf16+fp8gemm,fp8_rowwise,",
                      "--no-stages"])
    assert a.no_stages
    assert [v.name for v in parse_variants(a.variants)] == ["bf16", "bf16+fp8gemm", "fp8_rowwise",
                                                             "mxfp8+rowwise"]
    assert [v.name for v in parse_variants("bf16,bf16")] == ["bf16"]
    with pytest.raises(ValueError, match="unknown variant 'fp8'; accepted: bf16, mxfp8"):
        parse_variants("fp8_rowwise,fp8")
    with pytest.raises(ValueError, match="unknown variant 'BF16'"):
        parse_variants("BF16")  # names are exact


def test_variants_precisions_and_stages():
    """The fp8 GEMM variants: what travels, and no bf16 pass (no dequantize stage) before the
    GEMM."""
    from mxcomm.bench import _moe
    v = {x.name: x for x in _moe.VARIANTS}
    assert len(v) == len(_moe.VARIANTS) and v[_moe.REFERENCE].baseline
    assert [x.name for x in _moe.VARIANTS if x.baseline] == ["bf16"]
    assert _checks.precisions(v["bf16+fp8gemm"]) == _checks.precisions(v["bf16"])
    assert v["bf16+fp8gemm"].torch_a2a and v["bf16+fp8gemm"].gemm == "fp8"
    assert _checks.precisions(v["fp8_rowwise"]) == {
        "dispatch": "fp8_rowwise", "combine": "bf16", "dispatch_grad": "bf16",
        "combine_grad": "fp8_rowwise"}
    assert _checks.precisions(v["mxfp8+rowwise"])["dispatch"] == "mxfp8"
    assert v["mxfp8+rowwise"].permute_format == "fp8_rowwise"
    assert v["mxfp8+rowwise"].combine_grad == "fp8_rowwise"  # the GEMM's dgrad reads it as is
    assert _checks.precisions(v["fp8_rowwise_mxgrad"])["dispatch_grad"] == "mxfp8"
    assert [x.name for x in _moe.VARIANTS if x.wgrad == "bf16"] == ["fp8_rowwise_bf16wgrad"]
    # the accumulation comparison differs from fp8_rowwise only there; the others use
    # grouped_mm's default (every product fast)
    assert v["fp8_rowwise_acc32"] == dataclasses.replace(
        v["fp8_rowwise"], name="fp8_rowwise_acc32", fast_accum=(), default=False)
    assert {x.fast_accum for x in _moe.VARIANTS if x.name != "fp8_rowwise_acc32"} == {
        ("forward", "dgrad", "wgrad")}
    for x in _moe.VARIANTS:
        names = [s.name for s in _moe.stages(x, None, 2, loop_gemm=True)]
        if x.fused:  # the permute and unpermute inside the exchanges
            assert names == ["layout", "dispatch", "gemm", "combine"]
        elif x.gemm == "fp8":
            assert names == ["layout", "dispatch", "permute", "gemm", "unpermute", "combine"]
        else:
            assert "dequantize" in names and "grad_dequantize" in names
        assert x.describe().startswith(f"{x.name} = ")
    assert "permute to fp8_rowwise" in v["mxfp8+rowwise"].describe()
    assert v["fp8_rowwise_mxgrad_fused"] == dataclasses.replace(
        v["fp8_rowwise_mxgrad"], name="fp8_rowwise_mxgrad_fused", fused=True)
    assert "permute_align" in v["fp8_rowwise_mxgrad_fused"].describe()


def test_converted_reference_matches_the_library_bit_for_bit():
    """The checker's torch re-computation of the MXFP8 -> fp8 rowwise permute agrees with the
    library's host implementation (padding rows, a zero row, a NaN block, extreme block scales):
    so an "exact" verdict of mxfp8+rowwise's permute means what it says."""
    torch = pytest.importorskip("torch")
    import mxcomm.torch as mt
    from mxcomm._array import bfloat16
    from mxcomm.formats import get_format
    from mxcomm.fp8_formats import _host_mx_to_rowwise_permute
    rng = numpy.random.default_rng(3)
    x = torch.from_numpy(rng.standard_normal((12, 128)).astype(numpy.float32)).to(torch.bfloat16)
    x[3] = 0
    x[5, :32] *= 2.0 ** 40
    x[6, 32:64] *= 2.0 ** -60
    q = get_format("mxfp8").quantize(x.view(torch.int16).numpy().view(bfloat16))
    q.scales[7, 2] = 0xFF  # a NaN block
    q.scales[8, 1] = 0     # the smallest block scale
    mx = mt._tensors._wrap(q)
    indices = torch.tensor([4, 0, 11, -1, 3, 5, 6, 7, 8, -1, -1, 2], dtype=torch.int32)
    got = _checks.Checker._converted(mx, indices.to(torch.int64))
    data, scales = _host_mx_to_rowwise_permute(q, indices.numpy())
    want = numpy.concatenate([data, scales.reshape(-1, 1).view(numpy.uint8)], axis=1)
    assert got.dtype == torch.uint8 and got.shape == (12, 128 + 4)
    numpy.testing.assert_array_equal(got.numpy(), want)
    assert numpy.isnan(scales[7]) and scales[3] == 1.0  # the rows the test means to cover


def test_padding_rows_carry_the_format_padding_scale():
    torch = pytest.importorskip("torch")
    assert _checks.Checker._padding_row("bf16", 8).tolist() == [0] * 16
    assert _checks.Checker._padding_row("mxfp8", 64).tolist() == [0] * 66
    row = _checks.Checker._padding_row("fp8_rowwise", 32)
    assert row.shape == (36,) and not row[:32].any()
    assert row[32:].view(numpy.float32).tolist() == [1.0]
    rows = torch.arange(6, dtype=torch.uint8).reshape(2, 3)
    out = _checks.Checker._gather(rows, torch.tensor([1, -1, 0]), numpy.array([7, 8, 9], "u1"))
    assert out.tolist() == [[3, 4, 5], [7, 8, 9], [0, 1, 2]]


# ------------------------------------------------------------------- pipeline on MPI ranks
MPI_SHAPE = ("--tokens", "256", "--dim", "64", "--hidden", "32", "--experts", "2")


@pytest.fixture(scope="module")
def pipeline_world():
    """The pipeline's Runtime on this MPI job's ranks, with torch.distributed, and the parsed
    options of a tiny shape (one timed iteration where anything is timed); closed after."""
    pytest.importorskip("torch")
    import torch.distributed as dist
    from mxcomm.bench import _cli, pipeline
    from mxcomm.bench._runtime import Runtime
    args = build_parser().parse_args(["pipeline", *MPI_SHAPE, "--iters", "1", "--warmup", "0",
                                      "--no-stages"])
    pipeline.validate(args)
    owned = not dist.is_initialized()  # a group someone else made is left to them
    rt = Runtime()
    _cli._apply_defaults(args, rt.gpu)
    rt.init_torch_distributed()
    yield rt, args
    if owned:
        rt.close()
    else:
        rt.comm.close()


@pytest.mark.mpi
def test_pipeline_every_variant_exact_sane_sqnr_and_wire_bytes(pipeline_world):
    """measure() on every rank, all six variants: every step exact (none skipped), SQNR of the
    fp8 variants vs bf16 above the targets, bf16+fp8gemm's equal to bf16's within bf16 GEMM
    rounding where its GEMM falls back to bf16 (CPU), and the bytes of each wire format."""
    from mxcomm.bench import pipeline
    rt, args = pipeline_world
    meta, tables = pipeline.measure(args, rt)
    names = [v.name for v in pipeline.parse_variants(None)]
    assert meta["variants"] == names
    assert not pipeline.failed(tables)
    assert {r["variant"] for r in tables["exactness"]} == set(names)
    assert all(r["result"] == "exact" for r in tables["exactness"]), \
        [r for r in tables["exactness"] if r["result"] != "exact"]
    sqnr = {r["variant"]: r for r in tables["sqnr"]}
    assert list(sqnr) == names[1:]
    for name in ("fp8_rowwise", "mxfp8+rowwise"):
        r = sqnr[name]
        assert r["out_db"] > 28 and r["input_grad_db"] > 26 and r["weight_grad_db"] > 25, r
        assert r["ok"] == "yes"
    gemm = sqnr["bf16+fp8gemm"]
    if not meta["fp8_gemm"]:  # the bf16 fallback: only the GEMM kernel differs from bf16's
        assert all(gemm[k] >= 40 for k in ("out_db", "input_grad_db", "weight_grad_db")), gemm
    else:
        assert gemm["ok"] == "yes", gemm
    wire = {(r["variant"], r["direction"]): r for r in tables["wire"]}
    dim, hidden = int(MPI_SHAPE[3]), int(MPI_SHAPE[5])
    for direction in ("dispatch", "combine", "dispatch_grad", "combine_grad"):
        rows = wire[("bf16", direction)]["rows"]
        assert (rows > 0) == (rt.size > 1)
        width = dim if direction.startswith("dispatch") else hidden
        assert wire[("bf16", direction)]["bytes"] == rows * 2 * width
        assert wire[("bf16+fp8gemm", direction)]["bytes"] == rows * 2 * width
        for name in names:
            assert wire[(name, direction)]["rows"] == rows
    rows = wire[("fp8_rowwise", "dispatch")]["rows"]
    assert wire[("fp8_rowwise", "dispatch")]["bytes"] == rows * (dim + 4)
    assert wire[("mxfp8+rowwise", "dispatch")]["bytes"] == rows * (dim + dim // 32)
    rows = wire[("fp8_rowwise", "combine_grad")]["rows"]
    for name in ("fp8_rowwise", "mxfp8+rowwise"):
        assert wire[(name, "combine_grad")]["bytes"] == rows * (hidden + 4)
        assert wire[(name, "combine")]["bytes"] == wire[("bf16", "combine")]["bytes"]
    text = pipeline.render(meta, tables)
    assert max(len(line) for line in text.splitlines()) <= 120


@pytest.mark.mpi
def test_pipeline_fp8_variants_feed_the_gemm_quantized_rows(pipeline_world):
    """A traced run of each fp8 GEMM variant: the GEMM reads fp8 rowwise rows (fp8_rowwise and
    mxfp8+rowwise: no bf16 pass in front of it) and its dgrad an fp8 rowwise gradient, as sent by
    combine's backward; the input gradient is bf16; each stage times alone (the GPU's per-stage
    table) with no dequantize stage."""
    import torch
    from mxcomm.bench import _moe, pipeline
    rt, args = pipeline_world
    shape = tuple(int(v) for v in MPI_SHAPE[1::2])
    case = pipeline._Case(args, rt, shape)
    variants = {v.name: v for v in _moe.VARIANTS}
    for name in ("bf16+fp8gemm", "fp8_rowwise", "mxfp8+rowwise"):
        stage_list = _moe.stages(variants[name], rt.comm, case.e_local, loop_gemm=case.loop_gemm)
        state, grads, results = case.trace(stage_list)
        quantized = name != "bf16+fp8gemm"
        assert _moe.is_mxfp8(state["p"]) == quantized
        assert _moe.is_mxfp8(grads["y_"]) == quantized  # the gradient the GEMM's dgrad reads
        if quantized:
            assert state["p"].format.name == "fp8_rowwise"
            assert grads["y_"].format.name == "fp8_rowwise"
            assert state["h"].format.name == variants[name].dispatch
        assert results["input_grad"].dtype == torch.bfloat16
        assert not _moe.is_mxfp8(results["input_grad"])
        assert results["out"].shape == (case.tokens, case.hidden)
        assert bool(torch.isfinite(results["weight_grad"]).all())
        times = case.stage_times(stage_list, state, grads)
        assert {k for k in times} >= {("gemm", "fwd"), ("gemm", "bwd"), ("permute", "bwd")}
        assert not any(stage.endswith("dequantize") for stage, _ in times)
        assert all(s.iters == 1 for s in times.values())
