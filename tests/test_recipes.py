"""Recipes, ``"auto"``, the expert-parallel object and the fp8 GEMM's weight cache.

Serial tests: the recipe table, ``choose_recipe`` against an injected cost table on both sides of
its crossovers, the built-in table against the committed measurement, cost table files and
their lookup order (explicit, ``$MXCOMM_COST_TABLE``, the per-user cache, built-in), the weight
cache (hits, misses after an optimizer step and a new tensor) and
``grouped_mm``'s fp8 path on the CPU (``torch._scaled_grouped_mm`` emulated in float64: the
cache's values against the uncached path's, bit for bit). MPI tests (2 and 3 ranks):
``ExpertParallel`` forward and backward equal the validated primitives called by hand with each
recipe's keywords, bit for bit; the quantized recipes' SQNR against bf16; ``"auto"`` chooses
alike on every rank, from a table file found each way; bad recipes and bad or differing tables
raise on every rank before any data moves.

Run: ``python -m pytest -q -m "not mpi" tests/test_recipes.py``;
``mpiexec -n 2 python -m pytest -q --with-mpi -m mpi tests/test_recipes.py`` (and ``-n 3``).
"""

import contextlib
import dataclasses

import numpy
import pytest

from mxcomm import sqnr

torch = pytest.importorskip("torch")

import mxcomm.torch as mt  # noqa: E402
from mxcomm import _torch_gemm  # noqa: E402
from mxcomm import recipes  # noqa: E402
from reference_gemm import scaled_grouped_mm_float64 as _emulated_scaled_grouped_mm  # noqa: E402

SEED = 4321
E_LOCAL = 2
D, H = 64, 32
ALIGN = 16


# ------------------------------------------------------------------------------ recipes
def test_recipes_by_name():
    """The recipes the design names, with the formats of each direction."""
    assert recipes.recipe_names() == ("auto", "bf16", "mxfp8", "fp8_rowwise",
                                      "fp8_rowwise_gradbf16")
    r = recipes.get_recipe("mxfp8")
    assert (r.dispatch, r.combine, r.dispatch_grad, r.combine_grad, r.gemm, r.fused) == \
        ("mxfp8", "bf16", "bf16", "mxfp8", "bf16", False)
    assert (r.permute_format, r.unpermute_grad_format) == ("bf16", "bf16")
    r = recipes.get_recipe("fp8_rowwise")
    assert (r.dispatch, r.combine, r.dispatch_grad, r.combine_grad, r.gemm, r.fused) == \
        ("fp8_rowwise", "bf16", "bf16", "fp8_rowwise", "fp8", True)
    # across nodes the same but for the dispatch gradient; the other recipes everywhere alike
    across = r.for_nodes(2)
    assert across == dataclasses.replace(r, dispatch_grad="mxfp8") and r.for_nodes(1) is r
    assert across.for_nodes(2) == across and "mxfp8 across nodes" in r.describe()
    for name in ("bf16", "mxfp8", "fp8_rowwise_gradbf16"):
        assert recipes.get_recipe(name).for_nodes(3) is recipes.get_recipe(name)
    r = recipes.get_recipe("bf16")
    assert {r.dispatch, r.combine, r.dispatch_grad, r.combine_grad, r.gemm} == {"bf16"}
    for bad in ("auto", "fp8", "BF16"):
        with pytest.raises(ValueError, match="auto, bf16, mxfp8, fp8_rowwise"):
            recipes.get_recipe(bad)


class _Sent:
    """A stand-in layout: only the ``sent`` table (W x W rows) the choice reads."""

    def __init__(self, sent):
        self.sent = sent


#: A table with crossovers at 1000 rows (mxfp8 over bf16) and 3000 (fp8_rowwise over mxfp8).
TABLE = recipes.CostTable(rows=(0, 2000, 4000),
                          ms={"bf16": (1.0, 3.0, 5.0), "mxfp8": (1.2, 2.8, 4.4),
                              "fp8_rowwise": (3.0, 3.4, 3.8)},
                          ref_dim=D, ref_hidden=H)


@pytest.mark.parametrize("rows,expected", [(500, "bf16"), (900, "bf16"), (1500, "mxfp8"),
                                           (2900, "mxfp8"), (3300, "fp8_rowwise"),
                                           (9000, "fp8_rowwise")])
def test_auto_follows_the_prediction(rows, expected):
    """``choose_recipe`` picks the recipe the table predicts fastest, on both sides of each
    crossover (the prediction recomputed here from the table's lines)."""
    def predicted(name):
        lo, hi = (0, 1) if rows < 2000 else (1, 2)
        ms = TABLE.ms[name]
        x0, x1 = TABLE.rows[lo], TABLE.rows[hi]
        return ms[lo] + (ms[hi] - ms[lo]) * (rows - x0) / (x1 - x0)
    best = min(("bf16", "mxfp8", "fp8_rowwise"), key=predicted)
    assert best == expected
    # the slowest rank sets the pace: rank 1 sends `rows`, everyone else less
    layout = _Sent([[10, 10], [rows - 5, 5]])
    assert recipes.choose_recipe(layout, D, H, device="sm90", table=TABLE, margin=0).name == \
        expected
    # scaled dims: twice the width, half the rows, the same work
    layout = _Sent([[10, rows // 2], [5, 5]])
    if rows % 2 == 0:
        assert recipes.choose_recipe(layout, 2 * D, H, device="sm90", table=TABLE,
                                     margin=0).name == expected


def test_auto_device_classes_and_margin():
    """No fp8 GEMM off SM90; bf16 on the CPU whatever the table; the margin keeps bf16 close to
    a crossover."""
    big = _Sent([[5000, 0], [0, 5000]])
    assert recipes.choose_recipe(big, D, H, device="sm90", table=TABLE).name == "fp8_rowwise"
    assert recipes.choose_recipe(big, D, H, device="cuda", table=TABLE).name == "mxfp8"
    assert recipes.choose_recipe(big, D, H, device="cpu", table=TABLE).name == "bf16"
    near = _Sent([[1100, 0], [0, 0]])  # mxfp8 predicted 1.3 % faster
    assert recipes.choose_recipe(near, D, H, device="sm90", table=TABLE, margin=0).name == "mxfp8"
    assert recipes.choose_recipe(near, D, H, device="sm90", table=TABLE).name == "bf16"
    with pytest.raises(ValueError, match="device"):
        recipes.choose_recipe(big, D, H, device="gpu")


def test_auto_extrapolates_past_the_last_point():
    """Above the table the predictions are lines: a crossing far past the last point is found
    (bf16 1 + 0.1 x against fp8_rowwise 3 + 0.01 x cross at x = 22.2)."""
    table = recipes.CostTable(rows=(0, 10), ms={"bf16": (1.0, 2.0), "fp8_rowwise": (3.0, 3.1)},
                              ref_dim=D, ref_hidden=H)
    chooser = recipes.Chooser(D, H, device="sm90", table=table, margin=0)
    assert [round(b, 3) for b in chooser.bounds] == [22.222]
    for rows, expected in ((22, "bf16"), (23, "fp8_rowwise"), (10 ** 6, "fp8_rowwise")):
        assert chooser(_Sent([[rows, 0], [0, 0]])).name == expected


def test_h100_table_crossovers():
    """The built-in table is the committed measurement (2 x H100 at 194096a, uniform routing;
    the bf16 recipe is mxcomm's bf16, the variant bf16_mxcomm), and its answers at the issue's
    shape are the fastest recipe measured there: bf16 at 4096 and 16384 rows (where the old
    table chose mxfp8), mxfp8 at 32768, fp8_rowwise from 65536."""
    import json
    import pathlib
    results = pathlib.Path(__file__).resolve().parent.parent / "bench" / "results" / \
        "2026-11-27" / "pipeline_recipes_194096a_uniform_w2_h100.json"
    rows = json.loads(results.read_text())["tables"]["end_to_end"]
    measured = {(r["variant"], r["tokens"]): r["total_ms"] for r in rows}
    table = recipes.H100_TABLE
    for name, variant in (("bf16", "bf16_mxcomm"), ("mxfp8", "mxfp8"),
                          ("fp8_rowwise", "fp8_rowwise")):
        assert table.ms[name] == tuple(round(measured[(variant, m)], 3) for m in table.rows)

    def choice(rows):
        return recipes.choose_recipe(_Sent([[rows, 0], [0, rows]]), 7168, 2048,
                                     device="sm90").name
    assert [choice(r) for r in table.rows] == \
        ["bf16", "bf16", "mxfp8", "fp8_rowwise", "fp8_rowwise"]
    for m in table.rows:  # the fastest measured, bf16 kept within 2 %
        fastest = min(("bf16", "mxfp8", "fp8_rowwise"),
                      key=lambda n: table.ms[n][table.rows.index(m)] * (0.98 if n == "bf16"
                                                                          else 1.0))
        assert choice(m) == fastest
    # the fp8 recipe's own crossover with bf16: between 36000 and 40000 rows
    assert table.predict("fp8_rowwise", 36000, 7168, 2048) > table.predict("bf16", 36000,
                                                                             7168, 2048)
    assert table.predict("fp8_rowwise", 40000, 7168, 2048) < table.predict("bf16", 40000,
                                                                             7168, 2048)


def _committed_calibration(table, name):
    """The rows of the committed ``calibrate`` run bench/results/2026-11-28/``name``, after
    asserting that ``table`` holds its rows and its bf16, mxfp8 and fp8_rowwise columns."""
    import json
    import pathlib
    results = pathlib.Path(__file__).resolve().parent.parent / "bench" / "results" / \
        "2026-11-28" / name
    rows = json.loads(results.read_text())["tables"]["calibration"]
    assert table.rows == tuple(r["rows"] for r in rows)
    for recipe in ("bf16", "mxfp8", "fp8_rowwise"):
        assert table.ms[recipe] == tuple(round(r[f"{recipe}_ms"], 3) for r in rows)
    return rows


def test_h200_table_is_the_committed_calibration():
    """The H200 built-in table is the committed ``calibrate`` run (2 x H200 at 21726bb, its
    bf16, mxfp8 and fp8_rowwise columns), and its answers at that shape are the fastest recipe
    measured there: bf16 at 4096 and 16384 rows, fp8_rowwise from 32768; the fp8 recipe's
    crossover with bf16 between 16384 and 32768 rows."""
    table = recipes.H200_TABLE
    rows = _committed_calibration(table, "calibrate_21726bb_w2_h200.json")
    chooser = recipes.Chooser(7168, 2048, device="sm90", table=table)
    assert [chooser.for_rows(r).name for r in table.rows] == \
        ["bf16", "bf16", "fp8_rowwise", "fp8_rowwise", "fp8_rowwise"]
    assert [r["auto"] for r in rows] == [chooser.for_rows(r["rows"]).name for r in rows]
    assert [round(b) for b in chooser.bounds] == [19475]


def test_h200_w4_table_is_the_committed_calibration():
    """The built-in table of 4 or more H200s is the committed 4-rank ``calibrate`` run (cd34cd7),
    and its answers at each point are the fastest recipe measured there (bf16 within 2 %)."""
    table = recipes.H200_W4_TABLE
    _committed_calibration(table, "calibrate_cd34cd7_w4_h200.json")
    assert table.world_size == 4
    chooser = recipes.Chooser(7168, 2048, device="sm90", table=table)
    for i, m in enumerate(table.rows):
        fastest = min(("bf16", "mxfp8", "fp8_rowwise"),
                      key=lambda n: table.ms[n][i] * (0.98 if n == "bf16" else 1.0))
        assert chooser.for_rows(m).name == fastest


def test_built_in_table_follows_the_device(tmp_path):
    """With nothing pinned or cached, H200s read the H200 table of the largest world size
    measured not above theirs (2 at 2 and 3 ranks, 4 from 4), an H100 and any other device the
    H100 one; a pinned table is read whatever the device, and its fingerprint does not depend
    on the built-in one (ranks on different GPU models may share a pinned table)."""
    env = {recipes.CACHE_ENV: str(tmp_path)}
    for world, table in ((1, recipes.H200_TABLE), (2, recipes.H200_TABLE),
                         (3, recipes.H200_TABLE), (4, recipes.H200_W4_TABLE),
                         (8, recipes.H200_W4_TABLE)):
        assert recipes.find_tables("NVIDIA H200", world, environ=env).table_for(D, H) is table
    for device in ("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB", "cpu"):
        for world in (2, 8):
            assert recipes.find_tables(device, world, environ=env).table_for(D, H) \
                is recipes.H100_TABLE
    h200, h100 = (recipes.find_tables(d, 2, environ=env)
                  for d in ("NVIDIA H200", "NVIDIA H100 80GB HBM3"))
    assert h200.fingerprint() != h100.fingerprint()
    hand_made = dataclasses.replace(CPU_TABLE, device="", world_size=0)
    pinned = [recipes.find_tables(d, 2, table=hand_made, environ=env)
              for d in ("NVIDIA H200", "NVIDIA H100 80GB HBM3")]
    assert pinned[0].table_for(4 * D, H) is hand_made
    assert pinned[0].fingerprint() == pinned[1].fingerprint()


def test_chooser_for_rows_equals_the_layout_choice():
    """``Chooser.for_rows`` (the compiled torchtitan path's, plain comparisons) answers as the
    layout's bisection at every rows per rank, bounds included."""
    chooser = recipes.Chooser(7168, 2048, device="sm90")
    probes = list(range(0, 200000, 997)) + [int(b) + d for b in chooser.bounds for d in (0, 1)]
    for rows in probes:
        assert chooser.for_rows(rows) is chooser(_Sent([[rows, 0], [0, 0]])), rows


#: A table measured on the host backend (as calibrate writes it on a CPU): mxfp8 predicted
#: faster than bf16 above 1000 rows.
CPU_TABLE = recipes.CostTable(rows=(500, 1500), ms={"bf16": (1.0, 3.0), "mxfp8": (1.5, 2.5)},
                              ref_dim=D, ref_hidden=H, device="cpu", world_size=2,
                              experts_per_rank=2)


def test_a_table_measured_on_the_cpu_decides_there():
    """On the ``"cpu"`` class a table whose device is ``"cpu"`` decides (both sides of its
    crossover); any other table leaves bf16 (it does not describe the host backend)."""
    chooser = recipes.Chooser(D, H, device="cpu", table=CPU_TABLE, margin=0)
    assert [chooser.for_rows(r).name for r in (900, 1100)] == ["bf16", "mxfp8"]
    gpu = dataclasses.replace(CPU_TABLE, device="NVIDIA H100 80GB HBM3")
    assert recipes.Chooser(D, H, device="cpu", table=gpu, margin=0).for_rows(1100).name == "bf16"


def test_cost_table_file_round_trip_and_malformed_files(tmp_path):
    """save_table / load_table keep every field; a malformed file raises ValueError naming the
    file and the field."""
    import json
    path = recipes.save_table(CPU_TABLE, tmp_path / "a" / "t.json")
    assert recipes.load_table(path) == CPU_TABLE
    good = CPU_TABLE.to_dict()
    bad = {"cannot read it as JSON": "{", "format/version": dict(good, version=2),
           "rows": dict(good, rows=[1500, 500]), "ms": dict(good, ms={"mxfp8": [1.0, 2.0]}),
           "ms: 'fp4'": dict(good, ms=dict(good["ms"], fp4=[1.0, 1.0])),
           "ms: mxfp8": dict(good, ms=dict(good["ms"], mxfp8=[1.0])),
           "ms: bf16": dict(good, ms=dict(good["ms"], bf16=[1.0, -2.0])),
           "world_size": dict(good, world_size=0), "device": dict(good, device="")}
    for i, (field, content) in enumerate(bad.items()):
        path = tmp_path / f"bad{i}.json"
        path.write_text(content if isinstance(content, str) else json.dumps(content))
        with pytest.raises(ValueError, match=f"cost table {path}: {field}"):
            recipes.load_table(path)
    with pytest.raises(ValueError, match="cannot read"):
        recipes.load_table(tmp_path / "missing.json")


def test_find_tables_lookup_order(tmp_path):
    """An explicit table, else $MXCOMM_COST_TABLE, else the cache's table of the dims (of the
    device and world size), else the built-in one; a bad explicit or environment table raises,
    a bad cached one is skipped with a warning."""
    import json
    cache = tmp_path / "cache"
    env = {recipes.CACHE_ENV: str(cache)}
    wide = dataclasses.replace(CPU_TABLE, ref_dim=2 * D)
    for t in (CPU_TABLE, wide):
        recipes.save_table(t, recipes.cache_path("cpu", 2, t.ref_dim, t.ref_hidden, env))
    recipes.save_table(dataclasses.replace(CPU_TABLE, ms={"bf16": (9.0, 9.0)}),
                       recipes.cache_path("cpu", 3, D, H, env))  # another world size
    found = recipes.find_tables("cpu", 2, environ=env)
    assert found.table_for(D, H) == CPU_TABLE and found.table_for(2 * D, H) == wide
    assert found.table_for(D, None) == CPU_TABLE            # the only one of width D
    assert found.table_for(4 * D, H) is recipes.H100_TABLE  # no cached table of these dims
    assert recipes.find_tables("cpu", 4, environ=env).table_for(D, H) is recipes.H100_TABLE
    other = tmp_path / "other.json"
    recipes.save_table(dataclasses.replace(CPU_TABLE, ms={"bf16": (2.0, 2.0)}), other)
    by_env = recipes.find_tables("cpu", 2, environ=dict(env, **{recipes.TABLE_ENV: str(other)}))
    assert by_env.table_for(D, H) == by_env.table_for(4 * D, H) == recipes.load_table(other)
    explicit = recipes.find_tables("cpu", 2, table=CPU_TABLE,
                                   environ=dict(env, **{recipes.TABLE_ENV: str(other)}))
    assert explicit.pinned is CPU_TABLE
    assert len({found.fingerprint(), by_env.fingerprint(), explicit.fingerprint()}) == 3
    # named by the user: errors
    with pytest.raises(ValueError, match="measured on 'cpu', this rank runs 'NVIDIA H100"):
        recipes.find_tables("NVIDIA H100 80GB HBM3", 2, table=other, environ=env)
    with pytest.raises(ValueError, match="measured at 2 ranks, the group has 4"):
        recipes.find_tables("cpu", 4, table=str(other), environ=env)
    broken = tmp_path / "broken.json"
    broken.write_text("[]")
    with pytest.raises(ValueError, match=r"expected a JSON.*named by \$MXCOMM_COST_TABLE"):
        recipes.find_tables("cpu", 2, environ=dict(env, **{recipes.TABLE_ENV: str(broken)}))
    # found in the cache: skipped, named in a warning
    path = recipes.cache_path("cpu", 2, D, H, env)
    path.write_text(json.dumps(dict(CPU_TABLE.to_dict(), rows=[1])))
    with pytest.warns(RuntimeWarning, match=f"skipping a cached table: cost table {path}"):
        found = recipes.find_tables("cpu", 2, environ=env)
    assert found.table_for(D, H) is recipes.H100_TABLE and found.table_for(2 * D, H) == wide


# --------------------------------------------------------------------------- weight cache
def test_weight_cache_hits_until_the_weight_changes():
    """Hits while unchanged (views made anew each call included), a miss after an optimizer's
    in-place step, after a new tensor, and per operand."""
    cache = mt.WeightCache()
    made = []

    def make(w):
        made.append(w._version)
        return w.detach().clone()
    w = torch.randn(2, 8, 4).requires_grad_()
    for _ in range(3):
        cache.get(w.transpose(-2, -1), "forward", make)
    assert (cache.hits, cache.misses, len(made)) == (2, 1, 1)
    cache.get(w.transpose(-2, -1), "dgrad", make)          # another operand
    cache.get(w, "forward", make)                          # another view of the weight
    assert cache.misses == 3
    w.grad = torch.ones_like(w)
    torch.optim.SGD([w], lr=0.1).step()                    # in place: a new version
    value = cache.get(w.transpose(-2, -1), "forward", make)
    assert cache.misses == 4 and torch.equal(value, w.detach().transpose(-2, -1))
    w2 = w.detach().clone()                                # a new tensor, the same values
    cache.get(w2.transpose(-2, -1), "forward", make)
    assert cache.misses == 5
    cache.clear()
    cache.get(w2.transpose(-2, -1), "forward", make)
    assert cache.misses == 6
    # FSDP2's way: new values written with the version counter preserved (its all-gather into
    # the unsharded parameter), after an optimizer's step on other tensors (the shards)
    before = cache.get(w2.transpose(-2, -1), "forward", make)  # a hit
    with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(w2):
        w2.copy_(torch.randn_like(w2))
    assert cache.get(w2.transpose(-2, -1), "forward", make) is before  # not seen by itself
    shard = torch.zeros(3, requires_grad=True)
    shard.grad = torch.ones(3)
    torch.optim.SGD([shard], lr=0.1).step()
    assert cache.steps == 2
    value = cache.get(w2.transpose(-2, -1), "forward", make)
    assert cache.misses == 7 and torch.equal(value, w2.detach().transpose(-2, -1))


def _fp8_run(x, w, offs, grad, **kw):
    xg = x.detach().requires_grad_()
    y = mt.grouped_mm(xg, w, offs, fp8=True, wgrad="bf16", **kw)
    y.backward(grad)
    return y.detach(), xg.grad


def test_grouped_mm_reuses_its_quantized_weights(monkeypatch):
    """The fp8 path (as on SM90, the GEMM emulated): under gradient accumulation (3
    micro-batches) each weight operand is quantized once, after an optimizer step again, and
    every output and gradient equals the uncached path's bit for bit."""
    monkeypatch.setattr(_torch_gemm, "fp8_gemm_available", lambda device: True)
    monkeypatch.setattr(torch, "_scaled_grouped_mm", _emulated_scaled_grouped_mm, raising=False)
    counts = {"forward": 0, "dgrad": 0}
    for name, fn, key in (("_fp8_weight", _torch_gemm._fp8_weight, "forward"),
                          ("_fp8_weight_t", _torch_gemm._fp8_weight_t, "dgrad")):
        def counted(w, fn=fn, key=key):
            counts[key] += 1
            return fn(w)
        monkeypatch.setattr(_torch_gemm, name, counted)
    torch.manual_seed(5)
    stored = (torch.randn(2, 32, 64) / 8).to(torch.bfloat16).requires_grad_()  # (G, N, K)
    offs = torch.tensor([16, 48], dtype=torch.int32)
    cache = mt.WeightCache()
    opt = torch.optim.SGD([stored], lr=0.5)
    for step in range(2):
        for micro in range(3):
            x = torch.randn(48, 64, dtype=torch.bfloat16)
            grad = torch.randn(48, 32, dtype=torch.bfloat16)
            w = stored.transpose(-2, -1)                   # (G, K, N), a view, as MoE layers
            grads_before = stored.grad.clone() if stored.grad is not None else None
            y, dx = _fp8_run(x, w, offs, grad, weight_cache=cache)
            dw = stored.grad.clone()
            stored.grad = grads_before
            y0, dx0 = _fp8_run(x, stored.transpose(-2, -1), offs, grad, weight_cache=False)
            assert torch.equal(y, y0) and torch.equal(dx, dx0)
            assert torch.equal(dw, stored.grad)            # the weight gradient alike
        assert (cache.misses, cache.hits) == (2 * (step + 1), 2 * (step + 1) * 2)
        opt.step()
    # the uncached runs quantized both operands every time: 2 steps x 3 micro-batches
    assert counts == {"forward": 2 + 6, "dgrad": 2 + 6}


def test_grouped_mm_bf16_rows_take_the_bf16_gemm(monkeypatch):
    """Plain bf16 rows (the bf16 and mxfp8 recipes' dispatch output) get the bf16 GEMM by
    default even where fp8 GEMMs run; ``fp8=True`` quantizes them."""
    calls = []
    monkeypatch.setattr(_torch_gemm, "fp8_gemm_available", lambda device: True)

    def recorder(a, b, *args, **kwargs):
        calls.append(a.dtype)
        return _emulated_scaled_grouped_mm(a, b, *args, **kwargs)
    monkeypatch.setattr(torch, "_scaled_grouped_mm", recorder, raising=False)
    x = torch.randn(16, 32, dtype=torch.bfloat16)
    w = torch.randn(1, 32, 16, dtype=torch.bfloat16)
    offs = torch.tensor([16], dtype=torch.int32)
    assert torch.equal(mt.grouped_mm(x, w, offs), torch._grouped_mm(x, w, offs=offs))
    assert calls == []
    mt.grouped_mm(x, w, offs, fp8=True)
    assert calls == [torch.float8_e4m3fn]
    with pytest.raises(TypeError, match="weight_cache"):
        mt.grouped_mm(x, w, offs, weight_cache={})


# ----------------------------------------------------------------------- MPI: the object
def _routed(rank, world, device, tokens_max=24):
    """This rank's routed rows (M, D) bf16 sorted by expert, its counts (E,), output gradient
    (M, H) and its local experts' weights (E_local, D, H); seeded per rank, sizes per rank."""
    rng = numpy.random.default_rng(SEED + rank)
    experts = world * E_LOCAL
    m = int(rng.integers(tokens_max // 2, tokens_max)) * 2
    dest = numpy.sort(rng.integers(0, experts - 1, m))  # the last expert receives nothing
    counts = numpy.bincount(dest, minlength=experts).astype(numpy.int32)
    x = torch.from_numpy(rng.standard_normal((m, D)).astype(numpy.float32)).to(torch.bfloat16)
    grad = torch.from_numpy(rng.standard_normal((m, H)).astype(numpy.float32)).to(torch.bfloat16)
    w = torch.from_numpy((rng.standard_normal((E_LOCAL, D, H)) / 8).astype(numpy.float32))
    return (x.to(device), torch.from_numpy(counts).to(device), grad.to(device),
            w.to(torch.bfloat16).to(device))


def _by_hand(name, x, counts, w, grad, comm):
    """The recipe's path from the validated primitives, keywords written out per recipe."""
    layout = mt.exchange_layout(counts, comm)
    if name.startswith("fp8_rowwise"):  # across nodes: the dispatch gradient in MXFP8
        rows, _, offs = mt.a2a_dispatch(x, layout, precision="fp8_rowwise",
                                        grad_precision="bf16" if name == "fp8_rowwise" else "mxfp8",
                                        permute_align=ALIGN)
        y = mt.grouped_mm(rows, w, offs)
        out = mt.a2a_combine(y, layout, precision="bf16", grad_precision="fp8_rowwise",
                             permute_align=ALIGN)
    else:
        quantized = name == "mxfp8"
        received = mt.a2a_dispatch(x, layout, precision=name, grad_precision="bf16")
        rows, indices, offs = mt.permute(received, layout, align=ALIGN,
                                         out_format="bf16" if quantized else None)
        y = mt.grouped_mm(rows, w, offs)
        back = mt.unpermute(y, indices, layout, grad_format="bf16" if quantized else None)
        out = mt.a2a_combine(back, layout, precision="bf16",
                             grad_precision="mxfp8" if quantized else "bf16")
    (out.float() * grad.float()).sum().backward()
    return out.detach()


def _through_ep(ep, x, counts, w, grad, **gemm):
    rows, offs, handle = ep.dispatch(x, counts)
    y = mt.grouped_mm(rows, w, offs, **gemm)
    out = ep.combine(y, handle)
    (out.float() * grad.float()).sum().backward()
    return out.detach(), rows, handle


def _leaves(x, w):
    return x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()


#: ``"fp8_rowwise"`` on a group spanning nodes (emulated: a node per rank), where its dispatch
#: gradient is MXFP8 (``Recipe.for_nodes``)
ACROSS = "fp8_rowwise@nodes"


@contextlib.contextmanager
def _group(comm, name):
    """``(communicator, recipe)`` of a case: ``comm`` and ``name``, or for :data:`ACROSS` a new
    communicator with a node per rank (closed after) and ``"fp8_rowwise"``."""
    if name != ACROSS:
        yield comm, name
        return
    from mxcomm import comm as mxc
    across = mxc.init(timeout=60.0, node_size=1)
    try:
        assert len(set(across.nodes)) == across.size
        yield across, "fp8_rowwise"
    finally:
        across.close()


@pytest.mark.mpi
@pytest.mark.parametrize("name", ["bf16", "mxfp8", "fp8_rowwise", ACROSS])
def test_expert_parallel_equals_the_primitives(comm, device, name):
    """Forward, input and weight gradients through ExpertParallel equal the primitives called by
    hand with the recipe's keywords, bit for bit (across nodes: fp8_rowwise's dispatch gradient
    in MXFP8); the rows are what the recipe says."""
    x, counts, grad, w = _routed(comm.rank, comm.size, device)
    with _group(comm, name) as (group, recipe):
        ep = mt.ExpertParallel(comm=group, num_local_experts=E_LOCAL, recipe=recipe,
                               align=ALIGN, gemm_fallback=True)
        xa, wa = _leaves(x, w)
        out, rows, handle = _through_ep(ep, xa, counts, wa, grad)
        xb, wb = _leaves(x, w)
        ref = _by_hand(name, xb, counts, wb, grad, group)
    assert handle.recipe.name == recipe
    assert handle.recipe.dispatch_grad == ("mxfp8" if name == ACROSS else "bf16")
    assert isinstance(rows, mt.QuantizedTensor) == name.startswith("fp8_rowwise")
    assert rows.shape[0] == handle.layout.permuted_rows(ALIGN)
    assert torch.equal(out.view(torch.int16), ref.view(torch.int16))
    assert torch.equal(xa.grad.view(torch.int16), xb.grad.view(torch.int16))
    assert torch.equal(wa.grad.view(torch.int16), wb.grad.view(torch.int16))


@pytest.mark.mpi
@pytest.mark.parametrize("name", ["mxfp8", "fp8_rowwise", ACROSS])
def test_quantized_recipes_meet_the_sqnr_thresholds(comm, device, name):
    """Against the bf16 recipe: output >= 28 dB, input gradient >= 26, weight gradient >= 25
    (torchao's thresholds; rows of 64 and ~60 per rank keep the estimates steady). The wire's
    error: the GEMM is bf16 on every device here (the fp8 GEMM's own SQNR is
    tests/test_torch_formats.py's)."""
    x, counts, grad, w = _routed(comm.rank, comm.size, device, tokens_max=48)
    results = []
    with _group(comm, name) as (group, recipe):
        for name_ in ("bf16", recipe):
            ep = mt.ExpertParallel(comm=group, num_local_experts=E_LOCAL, recipe=name_,
                                   align=ALIGN, gemm_fallback=True)
            xa, wa = _leaves(x, w)
            out, _, _ = _through_ep(ep, xa, counts, wa, grad, fp8=False)
            results.append((out, xa.grad, wa.grad))
    (ref, dx_ref, dw_ref), (out, dx, dw) = results
    assert sqnr(ref, out) >= 28
    assert sqnr(dx_ref, dx) >= 26
    assert sqnr(dw_ref, dw) >= 25


def _allgather(comm, value):
    return comm._side.allgather_array(numpy.array([value], dtype=numpy.int64), "test")[:, 0]


@pytest.mark.mpi
def test_auto_chooses_alike_on_every_rank(comm, device):
    """``"auto"`` on an agreed device class: every rank runs the recipe ``choose_recipe``
    predicts for the agreed layout (ranks route different numbers of rows), the same
    everywhere; on the CPU it is bf16."""
    ep = mt.ExpertParallel(comm=comm, num_local_experts=E_LOCAL, align=ALIGN)
    x, counts, grad, w = _routed(comm.rank, comm.size, device)
    xa, wa = _leaves(x, w)
    _, _, handle = _through_ep(ep, xa, counts, wa, grad)
    if ep.device_class == "cpu":
        assert handle.recipe.name == "bf16"
    # an injected table whose crossovers fall inside these layouts' rows: rank-dependent inputs,
    # one answer; the prediction decides it
    ep.device_class = "sm90"
    rows = recipes.rows_per_rank(handle.layout)
    # crossover at `cut` rows (bf16 below, fp8_rowwise above, mxfp8 never)
    for cut, expected in ((2 * rows, "bf16"), (rows // 2, "fp8_rowwise")):
        ep.tables = recipes.TableSet(pinned=recipes.CostTable(
            rows=(0, cut, 2 * cut), ms={"bf16": (1.0, 2.0, 4.0), "mxfp8": (9.0, 9.0, 9.0),
                                        "fp8_rowwise": (1.5, 2.0, 2.5)},
            ref_dim=D, ref_hidden=D))
        xa, wa = _leaves(x, w)
        _, _, handle = _through_ep(ep, xa, counts, wa, grad)
        assert handle.recipe.name == expected
        chosen = _allgather(comm, recipes.recipe_names().index(handle.recipe.name))
        assert (chosen == chosen[0]).all()


def _cpu_table(comm, cut):
    """A host-backend table for this world with its crossover at ``cut`` rows per rank: bf16
    below, mxfp8 above (no fp8 GEMM on the CPU)."""
    return recipes.CostTable(rows=(1, cut, 2 * cut), ms={"bf16": (1.0, 2.0, 4.0),
                                                         "mxfp8": (1.5, 2.0, 2.5)},
                             ref_dim=D, ref_hidden=H, device="cpu", world_size=comm.size,
                             experts_per_rank=E_LOCAL)


@pytest.mark.mpi
@pytest.mark.parametrize("source", ["argument", "environment", "cache"])
def test_auto_reads_a_calibrated_table_file(comm, device, tmp_path, monkeypatch, source):
    """A table file (as calibrate writes it on the host backend), found by each step of the
    lookup order: auto's choice follows it on both sides of its crossover, and every rank
    chooses alike from layouts in which the ranks route different numbers of rows."""
    if getattr(comm, "device", None) is not None:
        pytest.skip("the host backend's table (GPUs: tests/test_bench.py's calibrate)")
    x, counts, grad, w = _routed(comm.rank, comm.size, device)
    rows = int(max(_allgather(comm, x.shape[0])))  # the most rows any rank sends
    for cut, expected in ((2 * rows, "bf16"), (rows // 2, "mxfp8")):
        table = _cpu_table(comm, cut)
        keywords = {}
        if source == "argument":
            keywords["table"] = recipes.save_table(table, tmp_path / f"{cut}.json")
        elif source == "environment":
            monkeypatch.setenv(recipes.TABLE_ENV,
                               str(recipes.save_table(table, tmp_path / f"{cut}.json")))
        else:
            monkeypatch.setenv(recipes.CACHE_ENV, str(tmp_path / str(cut)))
            recipes.save_table(table, recipes.cache_path("cpu", comm.size, D, H))
        ep = mt.ExpertParallel(comm=comm, num_local_experts=E_LOCAL, align=ALIGN, hidden=H,
                               **keywords)
        assert ep.tables.table_for(D, H) == table
        xa, wa = _leaves(x, w)
        _, _, handle = _through_ep(ep, xa, counts, wa, grad)
        assert handle.recipe.name == expected, (source, cut)
        chosen = _allgather(comm, recipes.recipe_names().index(handle.recipe.name))
        assert (chosen == chosen[0]).all()


@pytest.mark.mpi
def test_bad_tables_raise_on_every_rank(comm, tmp_path):
    """A table that fails to load on one rank, one measured at another world size, and tables
    that differ across ranks: ValueError at construction on every rank (the one argument
    round: no rank waits), naming the rank."""
    good = recipes.save_table(_cpu_table(comm, 100), tmp_path / "good.json")
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    collectives = comm.host_collectives
    with pytest.raises(ValueError, match="cost table failed to load on rank 0"):
        mt.ExpertParallel(comm=comm, num_local_experts=E_LOCAL,
                          table=broken if comm.rank == 0 else good)
    assert comm.host_collectives - collectives == 1
    other = recipes.save_table(dataclasses.replace(_cpu_table(comm, 100),
                                                   world_size=comm.size + 1),
                               tmp_path / "other.json")
    with pytest.raises(ValueError, match=f"measured at {comm.size + 1} ranks, the group has "
                                         f"{comm.size}"):
        mt.ExpertParallel(comm=comm, num_local_experts=E_LOCAL, table=other)
    mine = recipes.save_table(_cpu_table(comm, 100 + comm.rank), tmp_path / "mine.json")
    with pytest.raises(ValueError, match="cost tables differ across ranks"):
        mt.ExpertParallel(comm=comm, num_local_experts=E_LOCAL, table=mine)


@pytest.mark.mpi
@pytest.mark.parametrize("where", ["every rank", "rank 0"])
def test_unknown_recipe_raises_on_every_rank(comm, where):
    """An unknown recipe (on every rank, or on one) raises ValueError listing the recipes on
    every rank, at construction."""
    bad = where == "every rank" or comm.rank == 0
    with pytest.raises(ValueError, match="unknown recipe.*auto, bf16, mxfp8, fp8_rowwise"):
        mt.ExpertParallel(comm=comm, num_local_experts=E_LOCAL,
                          recipe="fp4" if bad else "auto")
    with pytest.raises(ValueError, match="recipe differs across ranks"):
        mt.ExpertParallel(comm=comm, num_local_experts=E_LOCAL,
                          recipe="bf16" if comm.rank == 0 else "mxfp8")


@pytest.mark.mpi
def test_recipe_the_devices_cannot_run_raises_before_data_moves(comm):
    """A pinned fp8 GEMM recipe on devices without SM90 fp8 GEMMs raises RuntimeError naming
    why, on every rank, at construction (no layout, no exchange yet)."""
    ep = mt.ExpertParallel(comm=comm, num_local_experts=E_LOCAL, recipe="bf16")
    if ep.device_class == "sm90":
        pytest.skip("these GPUs run the fp8 GEMMs")
    collectives = comm.host_collectives
    with pytest.raises(RuntimeError, match="SM90 fp8 grouped GEMMs"):
        mt.ExpertParallel(comm=comm, num_local_experts=E_LOCAL, recipe="fp8_rowwise")
    assert comm.host_collectives - collectives == 1  # the argument round only


@pytest.mark.gpu
@pytest.mark.mpi
@pytest.mark.parametrize("name", ["bf16", "mxfp8", "fp8_rowwise"])
def test_expert_parallel_gpu_equals_the_validated_calls(comm, device, name):
    """On GPUs (SM90 for fp8_rowwise, no fallback): each recipe bit-exact against the calls."""
    ep = mt.ExpertParallel(comm=comm, num_local_experts=E_LOCAL, recipe=name, align=ALIGN)
    x, counts, grad, w = _routed(comm.rank, comm.size, device, tokens_max=256)
    xa, wa = _leaves(x, w)
    out, _, _ = _through_ep(ep, xa, counts, wa, grad)
    xb, wb = _leaves(x, w)
    ref = _by_hand(name, xb, counts, wb, grad, comm)
    assert torch.equal(out, ref) and torch.equal(xa.grad, xb.grad)
    assert torch.equal(wa.grad, wb.grad)


@pytest.mark.gpu
@pytest.mark.mpi
def test_gpu_backward_that_starts_in_mxcomm(comm, device):
    """``out.backward(grad)`` straight from ``combine``'s output: the first work of autograd's
    device thread can be mxcomm's own kernel launch, with no CUDA context bound to that thread
    (torch skips ``cudaSetDevice`` for the device a thread already names; seen with
    bench/probe_overlap.py on 2xH100: CUDA_ERROR_INVALID_CONTEXT on rank 0). The forward runs
    in a fresh thread too. The gradients equal those of a backward that starts in a torch op."""
    import threading
    results = []
    for direct in (True, False):
        ep = mt.ExpertParallel(comm=comm, num_local_experts=E_LOCAL, recipe="mxfp8", align=ALIGN)
        x, counts, grad, w = _routed(comm.rank, comm.size, device, tokens_max=256)
        xa, wa = _leaves(x, w)
        box = {}

        def run():  # a fresh thread, no context bound until something binds it
            torch.cuda.set_device(device)
            rows, offs, handle = ep.dispatch(xa, counts)
            out = ep.combine(mt.grouped_mm(rows, wa, offs), handle)
            if direct:
                out.backward(grad.to(out.dtype))
            else:
                (out.float() * grad.float()).sum().backward()
            box["grads"] = (xa.grad.clone(), wa.grad.clone())
        thread = threading.Thread(target=run)
        thread.start()
        thread.join(120)
        assert "grads" in box, f"rank {comm.rank}: the backward raised or hung"
        results.append(box["grads"])
    problems = []
    for name, a, b in zip(("x.grad", "w.grad"), *results):
        if not torch.equal(a, b):  # say how they differ: NaN (poisoned), a few rows, or ulps
            diff = (a.float() - b.float()).abs()
            rows = torch.nonzero(diff.reshape(diff.shape[0], -1).amax(dim=1) != 0).flatten()
            problems.append(f"{name}: {int((diff != 0).sum())} of {diff.numel()} elements differ "
                            f"(max {diff.nan_to_num(float('inf')).max().item():.3g}; NaN "
                            f"{int(a.isnan().sum())} started in mxcomm, {int(b.isnan().sum())} "
                            f"in torch; rows {rows[:8].tolist()} of {a.shape[0]})")
    assert not problems, f"rank {comm.rank} ({comm.transport} transport, small exchanges up " \
        f"to {comm.small_exchange_bytes} bytes): " + "; ".join(problems)


# ------------------------------------------------------------- torch.distributed groups
def ep_group_checks(rank, size):
    """Rank ``rank`` of a gloo world: ExpertParallel from the default group (None), the
    ProcessGroup and a 1-D DeviceMesh share one communicator, and each recipe through it equals
    the primitives by hand, bit for bit."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (size,), mesh_dim_names=("ep",))
    built = [mt.ExpertParallel(g, num_local_experts=E_LOCAL, recipe="mxfp8", align=ALIGN)
             for g in (None, dist.group.WORLD, mesh)]
    assert len({id(ep.comm) for ep in built}) == 1
    comm = built[0].comm
    x, counts, grad, w = _routed(rank, size, torch.device("cpu"))
    same = []
    for name in ("bf16", "mxfp8", "fp8_rowwise"):
        ep = mt.ExpertParallel(mesh, num_local_experts=E_LOCAL, recipe=name, align=ALIGN,
                               gemm_fallback=True)
        xa, wa = _leaves(x, w)
        out, _, _ = _through_ep(ep, xa, counts, wa, grad)
        xb, wb = _leaves(x, w)
        ref = _by_hand(name, xb, counts, wb, grad, comm)
        same.append(torch.equal(out, ref) and torch.equal(xa.grad, xb.grad)
                    and torch.equal(wa.grad, wb.grad))
    return same


def test_expert_parallel_over_torch_distributed_groups():
    from torch_world import run_world
    assert run_world(2, ep_group_checks) == [[True] * 3] * 2


@pytest.mark.mpi
def test_auto_across_nodes_with_only_the_built_in_table_warns(monkeypatch, tmp_path):
    """``"auto"`` over a group that spans nodes (emulated: nodes of one rank) with only the
    built-in table (measured on one node) warns once, on rank 0; not with a table given, not for
    a pinned recipe, not on one node."""
    import warnings
    from mxcomm import comm as mxc
    monkeypatch.setenv(recipes.CACHE_ENV, str(tmp_path))  # no cached tables
    for name in (recipes.TABLE_ENV, "MXCOMM_NODE_SIZE", "NCCL_HOSTID"):
        monkeypatch.delenv(name, raising=False)
    across = mxc.init("mpi", timeout=60.0, node_size=1)
    one = mxc.init("mpi", timeout=60.0)
    assert len(set(across.nodes)) == across.size and set(one.nodes) == {0}
    try:
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            auto = mt.ExpertParallel(comm=across, num_local_experts=E_LOCAL)
            given = dataclasses.replace(recipes.H100_TABLE, device="", world_size=0)  # hand-made
            mt.ExpertParallel(comm=across, num_local_experts=E_LOCAL, table=given)
            pinned = mt.ExpertParallel(comm=across, num_local_experts=E_LOCAL,
                                       recipe="fp8_rowwise", gemm_fallback=True)
            mt.ExpertParallel(comm=one, num_local_experts=E_LOCAL)
        mine = [w for w in got if "spans several nodes" in str(w.message)]
        # what runs across nodes: fp8_rowwise's dispatch gradient in MXFP8, pinned or chosen
        assert pinned.nodes == across.size and pinned.recipe_for(None, D).dispatch_grad == "mxfp8"
        assert auto.as_run(recipes.get_recipe("fp8_rowwise")).dispatch_grad == "mxfp8"
        assert auto.as_run(recipes.get_recipe("mxfp8")) is recipes.get_recipe("mxfp8")
        assert len(mine) == (1 if across.rank == 0 else 0)
        for w in mine:
            assert w.category is RuntimeWarning and "mxcomm.bench calibrate" in str(w.message)
    finally:
        across.close()
        one.close()
