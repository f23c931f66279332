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

import ml_dtypes
import numpy
import pytest

from mxcomm import recipes
from mxcomm import sqnr
from mxcomm._array import bfloat16
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
def test_sqnr():
    """mxcomm.sqnr against exact ratios and an independent float64 norm, chunked or not, on NumPy
    (bf16 too) and torch arrays; NaN for non-finite input or no signal; shapes checked."""
    rng = numpy.random.default_rng(0)
    ref = rng.standard_normal((9000, 8))  # more rows than one chunk
    assert sqnr(ref, ref) == math.inf
    assert sqnr(ref, ref * 1.1) == pytest.approx(20.0)      # noise = 0.1 * signal
    assert sqnr(ref, ref + 0.01 * ref) == pytest.approx(40.0)
    out = ref + 0.05 * rng.standard_normal(ref.shape)
    want = 20 * math.log10(numpy.linalg.norm(ref) / numpy.linalg.norm(ref - out))
    assert sqnr(ref, out) == pytest.approx(want, rel=1e-12)
    assert sqnr(ref, out, chunk_rows=7) == pytest.approx(want, rel=1e-12)
    bf16 = out.astype(ml_dtypes.bfloat16)
    assert sqnr(ref, bf16) == pytest.approx(
        20 * math.log10(numpy.linalg.norm(ref) / numpy.linalg.norm(ref - bf16.astype(float))))
    bad = ref.copy()
    bad[0, 0] = numpy.nan
    assert math.isnan(sqnr(ref, bad))
    assert math.isnan(sqnr(numpy.zeros(3), numpy.ones(3)))
    # both all zero (the weight gradient of experts that received no rows): equal, not undefined
    assert sqnr(numpy.zeros(3), numpy.zeros(3)) == math.inf
    with pytest.raises(ValueError, match="shape"):
        sqnr(ref, ref[:3])
    torch = pytest.importorskip("torch")
    assert sqnr(torch.from_numpy(ref), torch.from_numpy(out)) == pytest.approx(want, rel=1e-12)


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
    by_name = {v.name: v for v in _moe.VARIANTS}
    rows = _checks.wire_rows(by_name["mxfp8"], Case, [2, 5, 1], [4, 7, 0], 1, same, same)
    got = {r["direction"]: (r["precision"], r["rows"], r["bytes"]) for r in rows}
    assert got == {"dispatch": ("mxfp8", 3, 3 * 66), "combine": ("bf16", 4, 4 * 64),
                   "dispatch_grad": ("bf16", 4, 4 * 128), "combine_grad": ("mxfp8", 3, 3 * 33)}
    rows = _checks.wire_rows(by_name["fp8_rowwise"], Case, [2, 5, 1], [4, 7, 0], 1, same, same)
    got = {r["direction"]: (r["precision"], r["bytes"]) for r in rows}
    assert got["dispatch_grad"] == ("bf16", 4 * 128)  # the recipe's dispatch_grad
    rows = _checks.wire_rows(by_name["fp8_rowwise_mxdgrad"], Case, [2, 5, 1], [4, 7, 0], 1, same,
                             same)
    got = {r["direction"]: (r["precision"], r["bytes"]) for r in rows}
    assert got["dispatch_grad"] == ("mxfp8", 4 * 66)
    rows = _checks.wire_rows(by_name["fp8_rowwise_bf16grad"], Case, [2, 5, 1], [4, 7, 0], 1, same, same)
    got = {r["direction"]: (r["precision"], r["bytes"]) for r in rows}
    assert got == {"dispatch": ("fp8_rowwise", 3 * (64 + 4)), "combine": ("bf16", 4 * 64),
                   "dispatch_grad": ("bf16", 4 * 128), "combine_grad": ("fp8_rowwise", 3 * 36)}
    for name in ("bf16", "bf16+fp8gemm"):  # torch's exchanges: bf16 every way
        rows = _checks.wire_rows(by_name[name], Case, [2, 5, 1], [4, 7, 0], 1, same, same)
        assert [r["bytes"] for r in rows] == [3 * 128, 4 * 64, 4 * 128, 3 * 64]
    # small exchanges (the communicator's rule, on a stand-in holding only the limit): the
    # dispatch (3 rows of 64 bf16: 384 bytes) and the combine gradient (3 x 32: 192) move
    # unquantized below their limits, quantized above
    from mxcomm import route
    for limit, dispatch, grad in ((384, "bf16", "bf16"), (383, "mxfp8", "bf16"),
                                  (191, "mxfp8", "mxfp8")):
        comm = types.SimpleNamespace(small_exchange_bytes=limit)
        rows = _checks.wire_rows(by_name["mxfp8"], Case, [2, 5, 1], [4, 7, 0], 1, same, same,
                                 functools.partial(route.small, comm))
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


def test_pipeline_verdict_names_what_failed():
    """The pipeline's last line: exact and targets met, or each step not exact and each variant
    below target (with its shape where there are several); skipped steps counted, never passed
    off as exact; one rank said."""
    from mxcomm.bench import pipeline

    def exact(variant, step, differ=0, result=None, shape="s1"):
        return {"shape": shape, "variant": variant, "step": step, "precision": "", "rows": 4,
                "rows_differ": differ, "result": result or ("exact" if not differ else "x")}

    def sqnr(variant, ok, shape="s1"):
        return {"shape": shape, "variant": variant, "ok": ok}

    meta = {"world_size": 2}
    tables = {"exactness": [exact("bf16", "layout"), exact("mxfp8", "dispatch")],
              "sqnr": [sqnr("mxfp8", "yes")]}
    assert pipeline.verdict(meta, tables) == \
        "pipeline: data movement exact on every checked step; SQNR targets met"
    tables["exactness"].append(exact("mxfp8", "permute", result="skipped"))
    assert pipeline.verdict({"world_size": 1}, tables) == (
        "pipeline: data movement exact on every checked step (1 skipped: no reference); SQNR "
        "targets met; 1 rank: nothing crossed ranks")
    tables = {"exactness": [exact("mxfp8", "dispatch", 3), exact("mxfp8", "combine"),
                            exact("fp8_rowwise", "combine bwd", 1, shape="s2")],
              "sqnr": [sqnr("mxfp8", "yes"), sqnr("mxfp8_all", "no", shape="s2")]}
    assert pipeline.failed(tables)
    assert pipeline.verdict(meta, tables) == (
        "pipeline: data movement NOT exact: mxfp8 dispatch at s1, fp8_rowwise combine bwd at s2; "
        "SQNR below target: mxfp8_all at s2")


def _pipeline_tables(gpu):
    """Tables of a 2-shape pipeline run of the default variants and the GEMM reference as
    ``measure`` builds them."""
    from mxcomm.bench import _moe
    variants = [v for v in _moe.VARIANTS if v.default or v.name == _moe.GEMM_REFERENCE]
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
    """A whole (one-process, tiny) run: the first line, every check exact, a line per file, the
    verdict last."""
    pytest.importorskip("torch")
    from mxcomm.bench import pipeline
    import importlib.util
    plot = importlib.util.find_spec("matplotlib") is not None  # optional: --plot only with it
    paths = [tmp_path / name for name in ("p.json", "p.md", "p.png")[:3 if plot else 2]]
    env = dict(os.environ, MXCOMM_BACKEND="host")
    out = subprocess.run([sys.executable, "-m", "mxcomm.bench", "pipeline", "--tokens", "96",
                          "--dim", "64", "--hidden", "32", "--experts", "2",
                          "--json", str(paths[0]), "--markdown", str(paths[1]),
                          *(["--plot", str(paths[2])] if plot else [])],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("mxcomm EP pipeline, 1 rank on a CPU, host backend")
    assert "No timings" in lines[0]
    # one rank: the first line and the notes say why the bytes are 0 and their ratios n/a
    assert lines[0].endswith(" " + pipeline.ONE_RANK) and "expert parallelism needs 2 ranks" in \
        pipeline.ONE_RANK
    assert "note: One rank: no row crosses ranks" in out.stdout
    assert lines[-1 - len(paths):-1] == [f"wrote {p}" for p in paths]
    assert all(p.stat().st_size for p in paths)
    assert lines[-1] == ("pipeline: data movement exact on every checked step; SQNR targets met; "
                         "1 rank: nothing crossed ranks")
    result = json.loads(paths[0].read_text())
    tables = result["tables"]
    assert tables["exactness"] and all(r["result"] in ("exact", "in the exchange")
                                       for r in tables["exactness"])
    assert "end_to_end" not in tables and "ms" not in out.stdout
    names = ["bf16", "auto", "bf16_mxcomm", "mxfp8", "fp8_rowwise"]
    assert result["meta"]["variants"] == names and result["meta"]["fp8_gemm"] is False
    assert [r["variant"] for r in tables["sqnr"]] == names[1:]
    # auto on the CPU: bf16 through mxcomm, shown with its choice
    assert result["meta"]["auto_chose"] == {"96x64x32x2": "bf16"}
    assert [r["recipe"] for r in tables["sqnr"]] == ["bf16", None, None, None]
    assert "| auto (bf16) " in out.stdout
    assert "ran its bf16 fallback" in out.stdout  # the report says the fp8 GEMM was not fp8


def test_pipeline_across_nodes_runs_the_recipes_as_expert_parallel_does(tmp_path):
    """2 ranks as 2 emulated nodes (host backend): the recipe fp8_rowwise sends its dispatch
    gradient in MXFP8 (``Recipe.for_nodes``), as the comparison fp8_rowwise_mxdgrad does; the
    wire table, the notes and the exactness checks say so. fp8_rowwise_mxcombine's combine
    travels in MXFP8, its data movement exact."""
    pytest.importorskip("torch")
    path = tmp_path / "p.json"
    env = dict(os.environ, MXCOMM_BACKEND="host", MXCOMM_NODE_SIZE="1")
    out = subprocess.run(["mpiexec", "-n", "2", sys.executable, "-m", "mxcomm.bench", "pipeline",
                          "--tokens", "96", "--dim", "64", "--hidden", "32", "--experts", "2",
                          "--variants", "fp8_rowwise,fp8_rowwise_mxdgrad,mxfp8,"
                          "fp8_rowwise_mxcombine", "--json", str(path)],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads(path.read_text())
    tables, meta = result["tables"], result["meta"]
    assert meta["nodes"] == [0, 1] and meta["transport"] == "grouped"
    assert "nodes [0, 1] (node of each rank): every exchange through the grouped transport" \
        in out.stdout
    grads = {r["variant"]: r for r in tables["wire"] if r["direction"] == "dispatch_grad"}
    assert grads["fp8_rowwise"]["precision"] == grads["fp8_rowwise_mxdgrad"]["precision"] == \
        "mxfp8" and grads["mxfp8"]["precision"] == "bf16"
    assert grads["fp8_rowwise"]["bytes"] == grads["fp8_rowwise_mxdgrad"]["bytes"] > 0
    combines = {r["variant"]: r for r in tables["wire"] if r["direction"] == "combine"}
    assert combines["fp8_rowwise_mxcombine"]["precision"] == "mxfp8"
    assert 0 < combines["fp8_rowwise_mxcombine"]["bytes"] < combines["fp8_rowwise"]["bytes"]
    assert {r["variant"] for r in tables["exactness"]} >= {"fp8_rowwise_mxcombine"}
    assert all(r["result"] in ("exact", "in the exchange") for r in tables["exactness"])
    assert "fp8_rowwise = mxcomm, dispatch fp8_rowwise, combine bf16, dispatch_grad mxfp8" in \
        out.stdout


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


def test_cli_refuses_plot_without_matplotlib_before_measuring(monkeypatch, capsys):
    """--plot needs matplotlib (optional): without it, one line and exit status 2 on every rank
    before anything runs, not rank 0's traceback after the measurement."""
    import importlib.util
    from mxcomm.bench import _cli
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, package=None: None
                        if name.split(".")[0] == "matplotlib" else find_spec(name, package))
    assert _cli.main(["pipeline", "--plot", "p.png"]) == 2
    err = capsys.readouterr().err
    assert err == ("python -m mxcomm.bench pipeline: error: --plot: needs matplotlib, which is "
                   "not installed (pip install matplotlib, or leave --plot out)\n")


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


def test_latency_shapes_by_backend():
    """latency's defaults follow the backend (the GPU's shapes ran for more than 10 minutes on a
    2-core CPU); an option given replaces its default only."""
    from mxcomm.bench import latency
    p = build_parser()
    args = p.parse_args(["latency"])
    assert latency.shape(args, "cuda") == ((4096, 8192, 16384, 32768), 7168, 8)
    assert latency.shape(args, "host") == ((512, 2048), 1024, 4)
    assert latency.shape(args, "simulator") == ((64,), 64, 2)
    assert latency.shape(p.parse_args(["latency", "--dim", "256"]), "host") == \
        ((512, 2048), 256, 4)
    assert latency.shape(p.parse_args(["latency", "--tokens", "8", "--experts", "3"]), "cuda") \
        == ((8,), 7168, 3)


def test_latency_on_a_cpu_runs_its_cpu_shapes_and_says_so(tmp_path):
    """A one-process CPU run without shape options: the first line names the shapes and says
    they are the CPU's defaults; the JSON has a row per call at each of them."""
    pytest.importorskip("torch")
    path = tmp_path / "l.json"
    env = dict(os.environ, MXCOMM_BACKEND="host")
    out = subprocess.run([sys.executable, "-m", "mxcomm.bench", "latency", "--iters", "1",
                          "--warmup", "0", "--json", str(path)],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    first = out.stdout.splitlines()[0]
    assert "1 rank, rows per rank 512 2048, D = 1024, 4 experts per rank (CPU-sized " \
           "defaults, seconds to run" in first and "CPU: host timings only" in first
    result = json.loads(path.read_text())
    assert result["meta"]["shapes"] == {"rows_per_rank": [512, 2048], "dim": 1024,
                                        "experts_per_rank": 4}
    rows = result["tables"]["latency"]
    assert {r["rows"] for r in rows} == {512, 2048} and {r["dim"] for r in rows} == {1024}
    assert all(r["host_us"] > 0 for r in rows)


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
    (["latency", "--dim", "40"], "--dim: expected a positive multiple of 32"),
    (["latency", "--tokens", "0"], "--tokens: expected positive row counts"),
    (["latency", "--experts", "0"], "--experts: expected >= 1, got 0"),
    (["pipeline", "--variants", "mxfp8,fp4"], "--variants: unknown variant 'fp4'; accepted: bf16, "
                                             "auto, bf16_mxcomm, mxfp8, fp8_rowwise, mxfp8_all, "
                                             "bf16+fp8gemm, fp8_rowwise_bf16grad, "
                                             "mxfp8+rowwise, fp8_rowwise_mxgrad, "
                                             "fp8_rowwise_bf16wgrad, fp8_rowwise_acc32, "
                                             "fp8_rowwise_serial, fp8_rowwise_mxdgrad, "
                                             "fp8_rowwise_mxcombine, fp8_rowwise_nocache"),
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
    # the reference, then the recipes, auto first among mxcomm's
    assert [v.name for v in every] == ["bf16", "auto", "bf16_mxcomm", "mxfp8", "fp8_rowwise"]
    assert [v.recipe for v in every] == [None, "auto", "bf16", "mxfp8", "fp8_rowwise"]
    extra = parse_variants("fp8_rowwise_acc32,fp8_rowwise_bf16wgrad,fp8_rowwise_mxgrad,"
                           "fp8_rowwise")
    assert [v.name for v in extra] == ["bf16", "fp8_rowwise", "fp8_rowwise_mxgrad",
                                       "fp8_rowwise_bf16wgrad", "fp8_rowwise_acc32"]
    a = p.parse_args(["pipeline", "--variants", "mxfp8+rowwise, bf16+fp8gemm,fp8_rowwise,",
                      "--no-stages"])
    assert a.no_stages
    assert [v.name for v in parse_variants(a.variants)] == ["bf16", "fp8_rowwise", "bf16+fp8gemm",
                                                             "mxfp8+rowwise"]
    assert [v.name for v in parse_variants("bf16,bf16")] == ["bf16"]
    with pytest.raises(ValueError, match="unknown variant 'fp8'; accepted: bf16, auto, bf16_mxcomm"):
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
    assert _checks.precisions(v["fp8_rowwise_bf16grad"]) == {
        "dispatch": "fp8_rowwise", "combine": "bf16", "dispatch_grad": "bf16",
        "combine_grad": "fp8_rowwise"}
    assert _checks.precisions(v["mxfp8+rowwise"])["dispatch"] == "mxfp8"
    assert v["mxfp8+rowwise"].permute_format == "fp8_rowwise"
    assert v["mxfp8+rowwise"].combine_grad == "fp8_rowwise"  # the GEMM's dgrad reads it as is
    assert _checks.precisions(v["fp8_rowwise_mxgrad"])["dispatch_grad"] == "mxfp8"
    assert [x.name for x in _moe.VARIANTS if x.wgrad == "bf16"] == ["fp8_rowwise_bf16wgrad"]
    # the accumulation comparison differs from fp8_rowwise_bf16grad only there; the others use
    # grouped_mm's default (every product fast)
    assert v["fp8_rowwise_acc32"] == dataclasses.replace(
        v["fp8_rowwise_bf16grad"], name="fp8_rowwise_acc32", fast_accum=())
    assert {x.fast_accum for x in _moe.VARIANTS if x.name != "fp8_rowwise_acc32"} == {
        ("forward", "dgrad", "wgrad")}
    # the weight cache off: the recipe fp8_rowwise otherwise, a comparison run by name only
    assert v["fp8_rowwise_nocache"] == dataclasses.replace(
        v["fp8_rowwise"], name="fp8_rowwise_nocache", recipe=None, weight_cache=False,
        default=False)
    assert [x.name for x in _moe.VARIANTS if not x.weight_cache] == ["fp8_rowwise_nocache"]
    assert "no weight cache" in v["fp8_rowwise_nocache"].describe()
    # the recipe as ExpertParallel runs it (the overlap on, the dispatch gradient in bf16);
    # without the overlap; with the dispatch gradient in MXFP8 (the recipe until 2026-11-28)
    assert v["fp8_rowwise"].overlap and v["fp8_rowwise"].dispatch_grad == "bf16"
    assert v["fp8_rowwise_serial"] == dataclasses.replace(
        v["fp8_rowwise"], name="fp8_rowwise_serial", recipe=None, overlap=False, default=False)
    assert v["fp8_rowwise_mxdgrad"] == dataclasses.replace(
        v["fp8_rowwise"], name="fp8_rowwise_mxdgrad", recipe=None, dispatch_grad="mxfp8",
        default=False)
    assert v["fp8_rowwise_mxcombine"] == dataclasses.replace(
        v["fp8_rowwise_mxdgrad"], name="fp8_rowwise_mxcombine", combine="mxfp8")
    # across nodes the recipes' variants run as ExpertParallel runs them (Recipe.for_nodes):
    # fp8_rowwise's dispatch gradient in MXFP8; comparisons and the other recipes unchanged
    for nodes, grad in ((1, "bf16"), (2, "mxfp8")):
        assert _moe.resolve(v["fp8_rowwise"], None, 0, 0, None, None, nodes) == \
            dataclasses.replace(v["fp8_rowwise"], dispatch_grad=grad)
        for name in ("bf16_mxcomm", "mxfp8", "fp8_rowwise_serial", "fp8_rowwise_bf16grad"):
            assert _moe.resolve(v[name], None, 0, 0, None, None, nodes) == v[name]
    assert [x.name for x in _moe.VARIANTS if x.overlap] == ["fp8_rowwise", "fp8_rowwise_mxdgrad",
                                                           "fp8_rowwise_mxcombine",
                                                           "fp8_rowwise_nocache"]
    with pytest.raises(ValueError, match="auto has no stages until resolved"):
        _moe.stages(v["auto"], None, 2, loop_gemm=True)
    layout = types.SimpleNamespace(sent=[[131072, 0], [0, 131072]])
    for device, chose in (("sm90", "fp8_rowwise"), ("cuda", "mxfp8"), ("cpu", "bf16")):
        resolved = _moe.resolve(v["auto"], layout, 7168, 2048, device, recipes.H100_TABLE)
        assert (resolved.name, resolved.chose) == ("auto", chose)
        assert resolved.fused == (chose == "fp8_rowwise")
        # run as ExpertParallel runs it by default: the fp8 GEMM's recipe with the overlap
        assert resolved.overlap == (chose == "fp8_rowwise")
        across = _moe.resolve(v["auto"], layout, 7168, 2048, device, recipes.H100_TABLE, 2)
        assert across.dispatch_grad == ("mxfp8" if chose == "fp8_rowwise" else "bf16")
    for x in _moe.VARIANTS:
        if x.name == "auto":
            x = resolved
        names = [s.name for s in _moe.stages(x, None, 2, loop_gemm=True)]
        if x.fused:  # the permute and unpermute inside the exchanges
            assert names == ["layout", "dispatch", "gemm", "combine"]
        elif x.gemm == "fp8":
            assert names == ["layout", "dispatch", "permute", "gemm", "unpermute", "combine"]
        else:
            assert "dequantize" in names and "grad_dequantize" in names
        assert x.describe().startswith(f"{x.name} = " if x.chose is None else
                                       f"auto (chose {x.chose}) = ")
    assert "permute to fp8_rowwise" in v["mxfp8+rowwise"].describe()
    # the recipe fp8_rowwise: fp8_rowwise_mxgrad fused, its dispatch gradient bf16, overlapped
    assert v["fp8_rowwise"] == dataclasses.replace(
        v["fp8_rowwise_mxgrad"], name="fp8_rowwise", fused=True, default=True,
        recipe="fp8_rowwise", dispatch_grad="bf16", overlap=True)
    assert "permute_align" in v["fp8_rowwise"].describe()
    for name in ("bf16_mxcomm", "mxfp8", "fp8_rowwise"):  # each recipe's formats, as named
        recipe = recipes.get_recipe(v[name].recipe)
        assert _checks.precisions(v[name]) == {d: getattr(recipe, d) for d in (
            "dispatch", "combine", "dispatch_grad", "combine_grad")}
        assert (v[name].gemm, v[name].fused) == (recipe.gemm, recipe.fused)


def test_converted_reference_matches_the_library_bit_for_bit():
    """The checker's torch re-computation of the MXFP8 -> fp8 rowwise permute agrees with the
    library's host implementation (padding rows, a zero row, a NaN block, extreme block scales):
    so an "exact" verdict of mxfp8+rowwise's permute means what it says."""
    torch = pytest.importorskip("torch")
    import mxcomm.torch as mt
    from mxcomm._array import bfloat16
    from mxcomm.formats import get_format
    from mxcomm._host import mx_to_rowwise_permute as _host_mx_to_rowwise_permute
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


@pytest.mark.parametrize("fmt", ["mxfp8", "fp8_rowwise", "fp8_block128"])
def test_checks_take_a_rank_that_receives_no_rows(fmt):
    """A rank may receive no rows (a tiny --tokens, or more ranks than rows): the checker's byte
    rows of an empty tensor are (0, bytes of a row), like those of any other (each row: its data
    bytes, then its scale bytes); the permute references of no received rows are padding rows."""
    torch = pytest.importorskip("torch")
    import mxcomm.torch as mt
    from mxcomm.formats import get_format
    rng = numpy.random.default_rng(5)
    width = 256
    for rows in (0, 3):
        x = rng.standard_normal((rows, width)).astype(bfloat16)
        q = get_format(fmt).quantize(x)
        got = _checks.Checker._bytes(mt._tensors._wrap(q))
        want = numpy.zeros((rows, get_format(fmt).bytes_per_row(width)), numpy.uint8)
        for i in range(rows):
            data, scales = q.data[i].view(numpy.uint8), q.scales[i].reshape(-1).view(numpy.uint8)
            want[i] = numpy.concatenate([data, scales])
        assert got.dtype == torch.uint8 and got.shape == want.shape
        numpy.testing.assert_array_equal(got.numpy(), want)
        plain = torch.from_numpy(x.view(numpy.int16)).view(torch.bfloat16)
        assert _checks.Checker._bytes(plain).shape == (rows, 2 * width)
    empty = mt._tensors._wrap(get_format("mxfp8").quantize(numpy.zeros((0, width), bfloat16)))
    padding = torch.full((4,), -1, dtype=torch.int64)
    numpy.testing.assert_array_equal(_checks.Checker._converted(empty, padding).numpy(),
                                     numpy.tile(_checks.Checker._padding_row("fp8_rowwise",
                                                                              width), (4, 1)))
    assert _checks.Checker._decoded(empty, padding).shape == (4, 2 * width)
    assert not _checks.Checker._decoded(empty, padding).any()


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
    """measure() on every rank, auto, fp8_rowwise and three comparisons: every step exact (none
    skipped; the fused recipe's permutes inside its exchanges), SQNR of the fp8 variants vs bf16
    above the targets, bf16+fp8gemm's equal to bf16's within bf16 GEMM rounding where its GEMM
    falls back to bf16 (CPU), and the bytes of each wire format."""
    import copy
    from mxcomm.bench import pipeline
    rt, args = pipeline_world
    args = copy.copy(args)
    # six, as the text tables fit 120 columns (bf16_mxcomm and mxfp8: tests/test_recipes.py)
    args.variants = "auto,fp8_rowwise,bf16+fp8gemm,fp8_rowwise_bf16grad,mxfp8+rowwise"
    meta, tables = pipeline.measure(args, rt)
    names = [v.name for v in pipeline.parse_variants(args.variants)]
    assert meta["variants"] == names
    assert not pipeline.failed(tables)
    assert {r["variant"] for r in tables["exactness"]} == set(names)
    assert all(r["result"] == "exact" or (r["result"] == "in the exchange" and
                                          r["variant"] == "fp8_rowwise")
               for r in tables["exactness"]), \
        [r for r in tables["exactness"] if r["result"] != "exact"]
    sqnr = {r["variant"]: r for r in tables["sqnr"]}
    assert list(sqnr) == names[1:]
    assert meta["auto_chose"] == {k: "bf16" for k in meta["auto_chose"]}  # on the CPU
    for name in ("fp8_rowwise", "fp8_rowwise_bf16grad", "mxfp8+rowwise"):
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
    rows = wire[("fp8_rowwise", "dispatch_grad")]["rows"]
    assert wire[("fp8_rowwise", "dispatch_grad")]["bytes"] == rows * 2 * dim
    rows = wire[("fp8_rowwise", "combine_grad")]["rows"]
    for name in ("fp8_rowwise", "fp8_rowwise_bf16grad", "mxfp8+rowwise"):
        assert wire[(name, "combine_grad")]["bytes"] == rows * (hidden + 4)
        assert wire[(name, "combine")]["bytes"] == wire[("bf16", "combine")]["bytes"]
    text = pipeline.render(meta, tables)
    assert max(len(line) for line in text.splitlines()) <= 120


@pytest.mark.mpi
def test_pipeline_exact_where_a_rank_receives_no_rows(pipeline_world):
    """--tokens 1 with 2 experts per rank: every rank's row goes to rank 0's first expert, so the
    other ranks receive none; every variant runs, and every checked step is exact on every rank."""
    from mxcomm.bench import _cli, pipeline
    rt, _ = pipeline_world
    if rt.size < 2:
        pytest.skip("needs 2 ranks or more (a rank that receives nothing)")
    args = build_parser().parse_args(["pipeline", "--tokens", "1", "--dim", "64", "--hidden",
                                      "32", "--experts", "2", "--iters", "1", "--warmup", "0",
                                      "--no-stages"])
    pipeline.validate(args)
    _cli._apply_defaults(args, rt.gpu)
    case = pipeline._Case(args, rt, (1, 64, 32, 2))
    counts = numpy.array(rt.allgather(case.counts.cpu().tolist()))         # [source rank, e]
    received = counts.reshape(rt.size, rt.size, 2).sum(axis=(0, 2))          # per rank
    assert received.min() == 0, received  # the case this test is for
    meta, tables = pipeline.measure(args, rt)
    assert meta["variants"] == [v.name for v in pipeline.parse_variants(None)]
    assert not pipeline.failed(tables)
    # a fused variant's permute steps run inside its exchanges, which are checked
    assert all(r["result"] in ("exact", "in the exchange") for r in tables["exactness"]), \
        [r for r in tables["exactness"] if r["result"] not in ("exact", "in the exchange")]
    assert sum(r["result"] == "exact" for r in tables["exactness"]) > len(tables["exactness"]) // 2


@pytest.mark.mpi
def test_pipeline_fp8_variants_feed_the_gemm_quantized_rows(pipeline_world):
    """A traced run of each fp8 GEMM variant: the GEMM reads fp8 rowwise rows (fp8_rowwise and
    fp8_rowwise_bf16grad and mxfp8+rowwise: no bf16 pass in front of it) and its dgrad an fp8 rowwise gradient, as sent by
    combine's backward; the input gradient is bf16; each stage times alone (the GPU's per-stage
    table) with no dequantize stage."""
    import torch
    from mxcomm.bench import _moe, pipeline
    rt, args = pipeline_world
    shape = tuple(int(v) for v in MPI_SHAPE[1::2])
    case = pipeline._Case(args, rt, shape)
    variants = {v.name: v for v in _moe.VARIANTS}
    for name in ("bf16+fp8gemm", "fp8_rowwise_bf16grad", "mxfp8+rowwise"):
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


@pytest.mark.mpi
def test_pipeline_stage_breakdown_of_every_recipe(pipeline_world):
    """The per-stage table (the GPU's, here timed on the host clock) covers every stage of each
    recipe and of fp8_rowwise_nocache, forward and backward: the layout, the exchanges (the
    fused recipe's with its permutes inside), the permutes, the GEMM; dequantize only where
    the rows arrive MXFP8 (the mxfp8 recipe's permute already gives bf16 rows: none)."""
    from mxcomm.bench import _moe, pipeline
    rt, args = pipeline_world
    shape = tuple(int(v) for v in MPI_SHAPE[1::2])
    case = pipeline._Case(args, rt, shape)
    variants = {v.name: v for v in _moe.VARIANTS}
    expected = {
        "bf16_mxcomm": {"layout", "dispatch", "permute", "gemm", "unpermute", "combine"},
        "mxfp8": {"layout", "dispatch", "permute", "gemm", "unpermute", "combine"},
        "fp8_rowwise": {"layout", "dispatch", "gemm", "combine"},
        "fp8_rowwise_nocache": {"layout", "dispatch", "gemm", "combine"}}
    for name, stages in expected.items():
        stage_list = _moe.stages(variants[name], rt.comm, case.e_local, loop_gemm=case.loop_gemm)
        state, grads, _ = case.trace(stage_list)
        times = case.stage_times(stage_list, state, grads)
        assert {s for s, d in times if d == "fwd"} == stages, (name, sorted(times))
        assert {s for s, d in times if d == "bwd"} == stages - {"layout"}, (name, sorted(times))
        assert all(t.median > 0 for t in times.values())


# ------------------------------------------------------------------------------ calibrate
def _independent_choice(table, rows):
    """auto's answer at a measured point, recomputed from the table's numbers: the fastest
    recipe, bf16 unless another is at least 2 % faster (the CPU runs no fp8 GEMM)."""
    ms = {k: v[table["rows"].index(rows)] for k, v in table["ms"].items() if k != "fp8_rowwise"}
    best = min(ms, key=lambda k: (ms[k] * (0.98 if k == "bf16" else 1.0), k != "bf16"))
    return best


def test_calibrate_writes_the_table_auto_reads(tmp_path):
    """``calibrate`` at 2 ranks (host backend, tiny shapes, few iterations) writes a table of
    the recipes the CPU runs, by default into the per-user cache under the name auto looks up;
    the report's auto column is the choice recomputed independently from the table's times."""
    pytest.importorskip("torch")
    cache = tmp_path / "cache"
    env = dict(os.environ, MXCOMM_BACKEND="host", MXCOMM_CACHE_DIR=str(cache))
    out = subprocess.run(["mpiexec", "-n", "2", sys.executable, "-m", "mxcomm.bench", "calibrate",
                          "--tokens", "128", "64", "--dim", "64", "--hidden", "32", "--experts",
                          "2", "--iters", "2", "--warmup", "1", "--json",
                          str(tmp_path / "c.json")],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    path = recipes.cache_path("cpu", 2, 64, 32, environ=env)
    assert path.parent == cache / "cost_tables" and path.name == "cpu_w2_d64_h32.json"
    table = recipes.load_table(path)
    assert (table.device, table.world_size, table.ref_dim, table.ref_hidden,
            table.experts_per_rank) == ("cpu", 2, 64, 32, 2)
    assert table.rows == (64, 128) and set(table.ms) == {"bf16", "mxfp8"}
    assert all(t > 0 for times in table.ms.values() for t in times)
    raw = json.loads(path.read_text())
    report = json.loads((tmp_path / "c.json").read_text())
    assert report["meta"]["table"] == raw and report["meta"]["table_path"] == str(path)
    for row in report["tables"]["calibration"]:
        assert row["auto"] == _independent_choice(raw, row["rows"])
        assert row["bf16_ms"] == raw["ms"]["bf16"][raw["rows"].index(row["rows"])]
    assert f"table written to {path}" in out.stdout


@pytest.mark.parametrize("argv,message", [
    (["calibrate", "--tokens", "64"], "--tokens: expected two or more different row counts"),
    (["calibrate", "--tokens", "64", "64"], "--tokens: expected two or more"),
    (["calibrate", "--dim", "48"], "--dim: expected positive multiples of 32"),
])
def test_calibrate_rejects_bad_options_in_one_line(capsys, argv, message):
    from mxcomm.bench._cli import main
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err
