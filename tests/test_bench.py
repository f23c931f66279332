"""Pure parts of the benchmarks (serial, no GPU, no MPI job): workloads, SQNR, timing statistics,
report metadata and tables, the command line."""

import json
import math
import os
import subprocess
import sys

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
        for v, f, b in (("bf16", 3.0, 6.0), ("mxfp8", 2.0, 4.0), ("mxfp8_all", 1.5, 3.0))]
    base, default, every = summary_rows(end_to_end)
    assert (base["variant"], base["fwd_ms"], base["total vs bf16"]) == ("bf16", 3.0, "")
    assert default["fwd vs bf16"] == "1.50x" and default["bwd vs bf16"] == "1.50x"
    assert default["total vs bf16"] == "1.50x" and default["shape"] == "8x32x32x2"
    assert every["total vs bf16"] == "2.00x"


# ------------------------------------------------------------------------- pipeline checks
def test_row_bytes_and_wire_rows():
    from mxcomm.bench import _moe
    assert _checks.row_bytes("bf16", 1024) == 2048
    assert _checks.row_bytes("mxfp8", 1024) == 1024 + 32
    with pytest.raises(ValueError, match="precision"):
        _checks.row_bytes("fp4", 32)

    class Case:
        dim, hidden, label = 64, 32, "s"

    # rank 1 of 3 sends [2, 5, 1] rows (keeps 5) and receives [4, 7, 0] rows (keeps 7)
    rows = _checks.wire_rows(_moe.VARIANTS[1], Case, [2, 5, 1], [4, 7, 0], 1, lambda v: v)
    got = {r["direction"]: (r["precision"], r["rows"], r["bytes"]) for r in rows}
    assert got == {"dispatch": ("mxfp8", 3, 3 * 66), "combine": ("bf16", 4, 4 * 64),
                   "dispatch_grad": ("bf16", 4, 4 * 128), "combine_grad": ("mxfp8", 3, 3 * 33)}


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


def _pipeline_tables(gpu):
    """Tables of a 2-shape pipeline run as ``measure`` builds them."""
    from mxcomm.bench import _moe
    tables = {"wire": [], "exactness": [], "sqnr": []}
    if gpu:
        tables.update(end_to_end=[], stages=[])
    for shape in ((131072, 8192, 5120, 8), (16384, 7168, 2048, 8)):
        label = "x".join(map(str, shape))
        for i, v in enumerate(_moe.VARIANTS):
            for step in _checks.STEPS:
                if v.baseline and step in ("dispatch", "combine", "combine bwd", "dispatch bwd"):
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
                                             "bf16_ms": 1234.567, "mxfp8_ms": 0.5,
                                             "mxfp8_all_ms": float("nan"), "speedup": 2469.1,
                                             "speedup_all": float("nan")})
    return tables


@pytest.mark.parametrize("gpu", [False, True], ids=["cpu_tables", "gpu_tables"])
def test_pipeline_report_fits_120_columns(tmp_path, gpu):
    from mxcomm.bench import pipeline
    tables = _pipeline_tables(gpu)
    meta = _report.metadata("pipeline", 4, [], ["a long note " * 30], run="what this run is")
    text = pipeline.render(meta, tables)
    assert max(len(line) for line in text.splitlines()) <= 120
    assert ("whole pipeline" in text) == gpu and ("per stage" in text) == gpu
    assert "3/131072 rows differ (mxfp8)" in text and "torch, unchecked" in text
    assert "0.50x" in text  # bytes of the third variant vs bf16
    assert pipeline.failed(tables) and not pipeline.failed({"exactness": []})
    _report.write_markdown(tmp_path / "p.md", "t", meta, pipeline.markdown_sections(tables))
    assert (tmp_path / "p.md").read_text().splitlines()[2] == "what this run is"
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
    tables = json.loads(paths[0].read_text())["tables"]
    assert tables["exactness"] and all(r["result"] == "exact" for r in tables["exactness"])
    assert "end_to_end" not in tables and "ms" not in out.stdout


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
])
def test_cli_rejects_bad_shapes_in_one_line(capsys, argv, message):
    from mxcomm.bench._cli import main
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"python -m mxcomm.bench {argv[0]}: error: ") and message in err
