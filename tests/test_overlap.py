"""The EP layer's backward overlap (``ExpertParallel``'s ``overlap``, ``mxcomm._torch_overlap``).

Serial: ``grouped_mm``'s backward marks its dgrad between the dgrad and the wgrad; the side
stream's waits, switch and join, with logging stand-ins for CUDA streams and events. MPI tests (2
and 3 ranks, the host backend on a CPU, GPUs where present): with overlap, the
output, the input gradient and the weight gradient equal the run without it bit for bit, for
every recipe, over two micro-batches of gradient accumulation (the GEMM's fp8 path too, its
``torch._scaled_grouped_mm`` emulated in float64 on the CPU). On a CPU there are no streams, so
the tests check the decisions a GPU would act on: which backwards waited for the dgrad's mark
only (``beside``) and which for the whole stream (``behind``): a gradient summed from two GEMMs,
or made by another GEMM, must wait for everything. The default overlaps the fp8 GEMM's recipes
only. Bad ``overlap``, or one that differs across ranks, raises on every rank.
GPU tests (2 GPUs): the same equalities with real side streams, and a CUDA graph of the layer's
step with overlap replaying the eager results.

Run: ``python -m pytest -q -m "not mpi" tests/test_overlap.py``;
``mpiexec -n 2 python -m pytest -q --with-mpi -m mpi tests/test_overlap.py`` (and ``-n 3``).
"""

import numpy
import pytest

torch = pytest.importorskip("torch")

import mxcomm.torch as mt  # noqa: E402
from mxcomm import _torch_gemm  # noqa: E402
from reference_gemm import scaled_grouped_mm_float64 as _emulated_scaled_grouped_mm  # noqa: E402

SEED = 8642
E_LOCAL = 2
D, H = 64, 32
ALIGN = 16
RECIPES = ("bf16", "mxfp8", "fp8_rowwise")
#: Overlapped backwards per micro-batch: the dispatch's, and a separate permute's before it.
BACKWARDS = {"bf16": 2, "mxfp8": 2, "fp8_rowwise": 1}


@pytest.fixture(params=["bf16 GEMM", "fp8 GEMM"])
def gemm(request, monkeypatch, device):
    """The expert GEMM's path: ``grouped_mm``'s bf16 one, or its fp8 one (on a CPU with
    ``torch._scaled_grouped_mm`` emulated, as it runs on SM90)."""
    fp8 = request.param == "fp8 GEMM"
    if fp8 and device.type == "cpu":
        monkeypatch.setattr(_torch_gemm, "fp8_gemm_available", lambda device: True)
        monkeypatch.setattr(torch, "_scaled_grouped_mm", _emulated_scaled_grouped_mm,
                            raising=False)
    elif fp8 and not _torch_gemm.fp8_gemm_available(device):
        pytest.skip("no SM90 fp8 grouped GEMM here")
    return {"fp8": None if fp8 else False}


def _routed(rank, world, device, micro, scale=1):
    """Micro-batch ``micro`` of this rank: routed rows (M, D) bf16 sorted by expert, counts
    (E,), the output's gradient (M, H); seeded per rank and micro-batch, sizes differ (16-46
    rows, times ``scale``)."""
    rng = numpy.random.default_rng(SEED + 100 * micro + rank)
    experts = world * E_LOCAL
    m = int(rng.integers(8, 24)) * 2 * scale
    dest = numpy.sort(rng.integers(0, experts - 1, m))  # the last expert receives nothing
    counts = numpy.bincount(dest, minlength=experts).astype(numpy.int32)
    x = torch.from_numpy(rng.standard_normal((m, D)).astype(numpy.float32)).to(torch.bfloat16)
    grad = torch.from_numpy(rng.standard_normal((m, H)).astype(numpy.float32)).to(torch.bfloat16)
    return x.to(device), torch.from_numpy(counts).to(device), grad.to(device)


def _weights(device):
    rng = numpy.random.default_rng(SEED - 1)  # the same experts' weights on every rank
    w = torch.from_numpy((rng.standard_normal((E_LOCAL, D, H)) / 8).astype(numpy.float32))
    return w.to(torch.bfloat16).to(device).requires_grad_()


def _steps(ep, device, gemms=1, scale=1, **gemm):
    """Two micro-batches through ``ep`` into one weight (gradient accumulation): each output,
    each input gradient, and the accumulated weight gradient. ``gemms=2``: the rows feed two
    GEMMs whose outputs add (their input gradients are summed by autograd). ``scale``: rows
    times that."""
    w = _weights(device)
    outs, dxs = [], []
    for micro in range(2):
        x, counts, grad = _routed(ep.comm.rank, ep.comm.size, device, micro, scale)
        x.requires_grad_()
        rows, offs, handle = ep.dispatch(x, counts)
        y = mt.grouped_mm(rows, w, offs, **gemm)
        if gemms == 2:
            y = y + mt.grouped_mm(rows, w, offs, **gemm)
        out = ep.combine(y, handle)
        (out.float() * grad.float()).sum().backward()
        outs.append(out.detach())
        dxs.append(x.grad)
    return outs, dxs, w.grad


def _bits(t):
    return t.view(torch.int16)


def _assert_same(got, want):
    (outs, dxs, dw), (outs0, dxs0, dw0) = got, want
    for a, b in zip(outs + dxs + [dw], outs0 + dxs0 + [dw0]):
        assert torch.equal(_bits(a), _bits(b))


def _ep(comm, name, overlap):
    return mt.ExpertParallel(comm=comm, num_local_experts=E_LOCAL, recipe=name, align=ALIGN,
                             gemm_fallback=True, overlap=overlap)


class _Recorder:
    """A slot stand-in: notes when ``grouped_mm``'s backward marks its dgrad."""

    def __init__(self, log):
        self.log = log

    def mark(self, t):
        self.log.append(("mark", tuple(t.shape)))


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16 GEMM", "fp8 GEMM"])
def test_grouped_mm_marks_between_dgrad_and_wgrad(monkeypatch, fp8):
    """``grouped_mm``'s backward runs dgrad, marks its (P, K) result on the rows' slot, then
    runs wgrad: the order the side stream's wait relies on (a mark after the wgrad would
    serialize the exchange behind it again, with the same bits)."""
    log = []
    if fp8:
        monkeypatch.setattr(_torch_gemm, "fp8_gemm_available", lambda device: True)

        def gemm(a, b, *args, **kwargs):
            log.append(("wgrad" if b.dim() == 2 else "forward/dgrad", tuple(a.shape)))
            return _emulated_scaled_grouped_mm(a, b, *args, **kwargs)
        monkeypatch.setattr(torch, "_scaled_grouped_mm", gemm, raising=False)
    else:
        plain = torch._grouped_mm

        def gemm(a, b, *args, **kwargs):
            log.append(("wgrad" if b.dim() == 2 else "forward/dgrad", tuple(a.shape)))
            return plain(a, b, *args, **kwargs)
        monkeypatch.setattr(torch, "_grouped_mm", gemm)
    torch.manual_seed(3)
    p, k, n = 48, 64, 32
    x = torch.randn(p, k, dtype=torch.bfloat16).requires_grad_()
    rows = x * 1  # a non-leaf, as a dispatch's rows are
    setattr(rows, _torch_gemm.OVERLAP_ATTRIBUTE, _Recorder(log))
    w = (torch.randn(2, k, n) / 8).to(torch.bfloat16).requires_grad_()
    offs = torch.tensor([16, 48], dtype=torch.int32)
    y = mt.grouped_mm(rows, w, offs, fp8=fp8, weight_cache=False)
    log.clear()
    y.backward(torch.randn(p, n, dtype=torch.bfloat16))
    assert [entry[0] for entry in log] == ["forward/dgrad", "mark", "wgrad"]
    assert log[0][1] == (p, n) and log[1][1] == (p, k)


class _FakeStream:
    """A CUDA stream stand-in that logs what is enqueued on it."""

    def __init__(self, name, log):
        self.name, self.log = name, log
        self.device = torch.device("cuda", 0)
        self.cuda_stream = id(self)

    def wait_event(self, event):
        self.log.append((self.name, "wait", event.name))

    def wait_stream(self, stream):
        self.log.append((self.name, "wait all of", stream.name))


def test_side_stream_waits_and_joins(monkeypatch):
    """The GPU branch of the side stream's scheduling, with logging stand-ins for torch's
    streams and events (this machine has none): a backward handed the marked tensor waits for
    the mark's event only, runs with the side stream current, records its end there, and the
    main stream waits for that end; its result is marked with it, so the next backward (the
    dispatch's after a separate permute's) waits for it; a tensor that is not the mark (or was
    written since) waits for the whole main stream."""
    from mxcomm import _torch_overlap
    log, current = [], []
    main = _FakeStream("main", log)
    side = _FakeStream("side", log)
    names = iter(f"e{i}" for i in range(1, 10))

    class Event:
        def __init__(self, **kwargs):
            self.name = next(names)

        def record(self, stream):
            log.append((stream.name, "record", self.name))

    class Switch:
        def __init__(self, stream):
            self.stream = stream

        def __enter__(self):
            current.append(self.stream)

        def __exit__(self, *exc):
            current.pop()

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda device=None: current[-1] if current else main)
    monkeypatch.setattr(torch.cuda, "stream", Switch)
    overlap = _torch_overlap.BackwardOverlap()
    monkeypatch.setattr(overlap, "cupy_stream", lambda stream: Switch(stream))
    slot = _torch_overlap._Slot(overlap, side)

    def work(name):
        def run():
            log.append((torch.cuda.current_stream().name, "runs", name))
            return torch.zeros(2), None
        return run

    dgrad = torch.zeros(3)
    slot.mark(dgrad)                                   # grouped_mm, after its dgrad
    permuted, _ = slot.run_beside(dgrad, work("permute bwd"))
    slot.run_beside(permuted, work("dispatch bwd"))    # chained: waits for the permute's end
    assert log == [("main", "record", "e1"),
                   ("side", "wait", "e1"), ("side", "runs", "permute bwd"),
                   ("side", "record", "e2"), ("main", "wait", "e2"),
                   ("side", "wait", "e2"), ("side", "runs", "dispatch bwd"),
                   ("side", "record", "e3"), ("main", "wait", "e3")]
    del log[:]
    other = torch.zeros(3)
    slot.mark(other)
    other.add_(1)                                      # written since it was marked
    slot.run_beside(other, work("dispatch bwd"))
    assert log == [("main", "record", "e4"), ("side", "wait all of", "main"),
                   ("side", "runs", "dispatch bwd"), ("side", "record", "e5"),
                   ("main", "wait", "e5")]
    assert (overlap.beside, overlap.behind) == (2, 1)


@pytest.mark.mpi
@pytest.mark.parametrize("name", RECIPES)
def test_overlap_equals_no_overlap_bit_for_bit(comm, device, gemm, name):
    """Each recipe, bf16 and fp8 GEMM: two micro-batches with overlap equal them without, bit
    for bit (outputs, input gradients, the accumulated weight gradient), and every overlapped
    backward waited for the dgrad's mark only (the permute's, then the dispatch's)."""
    ep = _ep(comm, name, True)
    got = _steps(ep, device, **gemm)
    want = _steps(_ep(comm, name, False), device, **gemm)
    _assert_same(got, want)
    assert (ep.overlap.beside, ep.overlap.behind) == (2 * BACKWARDS[name], 0)


@pytest.mark.mpi
@pytest.mark.parametrize("name", ["bf16", "fp8_rowwise"])
def test_a_summed_gradient_waits_for_everything(comm, device, name):
    """Rows feeding two GEMMs: autograd sums their input gradients after the second GEMM's
    wgrad, so the marked dgrad is not what the dispatch's backward reads. It must wait for the
    whole stream (``behind``), and the results still equal the run without overlap."""
    ep = _ep(comm, name, True)
    got = _steps(ep, device, gemms=2, fp8=False)
    want = _steps(_ep(comm, name, False), device, gemms=2, fp8=False)
    _assert_same(got, want)
    # the first overlapped backward of each micro-batch waits behind; a separate permute's
    # result is then marked by its own end, which the dispatch waits for
    chained = BACKWARDS[name] - 1
    assert (ep.overlap.beside, ep.overlap.behind) == (2 * chained, 2)


@pytest.mark.mpi
def test_another_gemm_gets_no_mark(comm, device):
    """Rows into a GEMM that is not ``grouped_mm`` (torch's, on the dequantized rows): nothing
    marks, the dispatch's backward waits for the whole stream, the values are unchanged."""
    results, counters = [], []
    for overlap in (True, False):
        ep = _ep(comm, "fp8_rowwise", overlap)
        w = _weights(device)
        x, counts, grad = _routed(comm.rank, comm.size, device, 0)
        x.requires_grad_()
        rows, offs, handle = ep.dispatch(x, counts)
        out = ep.combine(torch._grouped_mm(rows.dequantize(), w, offs=offs), handle)
        (out.float() * grad.float()).sum().backward()
        results.append((out.detach(), x.grad, w.grad))
        if overlap:
            counters = [ep.overlap.beside, ep.overlap.behind]
    for a, b in zip(*results):
        assert torch.equal(_bits(a), _bits(b))
    assert counters == [0, 1]


@pytest.mark.mpi
@pytest.mark.parametrize("where", ["every rank", "rank 0"])
def test_bad_overlap_raises_on_every_rank(comm, where):
    """``overlap`` not a bool (on every rank, or on one) raises ValueError naming the rank on
    every rank, at construction."""
    bad = where == "every rank" or comm.rank == 0
    with pytest.raises(ValueError, match="overlap on rank 0.*expected None, True or False"):
        mt.ExpertParallel(comm=comm, num_local_experts=E_LOCAL, recipe="bf16",
                          overlap="yes" if bad else False)


@pytest.mark.mpi
def test_overlap_that_differs_across_ranks_raises_on_every_rank(comm):
    """``overlap`` True on rank 0 and the default elsewhere raises ValueError on every rank."""
    with pytest.raises(ValueError, match="overlap differs across ranks"):
        mt.ExpertParallel(comm=comm, num_local_experts=E_LOCAL, recipe="bf16",
                          **({"overlap": True} if comm.rank == 0 else {}))


@pytest.mark.mpi
@pytest.mark.parametrize("name", RECIPES)
def test_default_overlaps_the_fp8_gemm_recipes_only(comm, device, gemm, name):
    """``overlap`` left at its default: the recipe that runs the fp8 GEMM overlaps every
    backward (``beside`` only), the others none; bit for bit as ``overlap=False``."""
    from mxcomm.recipes import get_recipe
    ep = mt.ExpertParallel(comm=comm, num_local_experts=E_LOCAL, recipe=name, align=ALIGN,
                           gemm_fallback=True)
    got = _steps(ep, device, **gemm)
    _assert_same(got, _steps(_ep(comm, name, False), device, **gemm))
    overlapped = get_recipe(name).gemm == "fp8"
    assert (ep.overlap.beside, ep.overlap.behind) == \
        ((2 * BACKWARDS[name], 0) if overlapped else (0, 0))


@pytest.mark.mpi
def test_pipeline_overlap_variant_equals_its_recipe(comm, device, gemm):
    """The pipeline benchmark's ``fp8_rowwise`` (the recipe with its default overlap) equals
    ``fp8_rowwise_serial`` (``--variants``: no overlap) bit for bit, forward and backward, and
    its dispatch's backward waited for the dgrad's mark only."""
    from mxcomm.bench import _moe
    from mxcomm._torch_overlap import slot_of
    variants = {v.name: v for v in _moe.VARIANTS}
    results = []
    for name in ("fp8_rowwise", "fp8_rowwise_serial"):
        stage_list = _moe.stages(variants[name], comm, E_LOCAL, loop_gemm=False)
        x, counts, grad = _routed(comm.rank, comm.size, device, 0)
        x.requires_grad_()
        w = _weights(device).detach().transpose(-2, -1).contiguous().requires_grad_()  # (E, H, D)
        state = {"x": x, "w": w, "counts": counts}
        out = _moe.forward(stage_list, state)
        out.backward(grad)
        results.append((out.detach(), x.grad, w.grad))
        slot = slot_of(state["p"])
        if name == "fp8_rowwise":
            assert (slot.owner.beside, slot.owner.behind) == (1, 0)
        else:
            assert slot is None
    for a, b in zip(*results):
        assert torch.equal(_bits(a), _bits(b))


# ------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.mpi
@pytest.mark.parametrize("name", RECIPES)
def test_gpu_overlap_equals_no_overlap(comm, device, name):
    """On GPUs, real side streams (the fp8 GEMM where SM90 has it): as the CPU test, with 256
    times the rows (4096-11776 per rank; a race between the side stream and the wgrad or the
    next micro-batch would show as other bits); the counters as on the CPU."""
    gemm = {"fp8": None}
    ep = _ep(comm, name, True)
    got = _steps(ep, device, scale=256, **gemm)
    want = _steps(_ep(comm, name, False), device, scale=256, **gemm)
    torch.cuda.synchronize()
    _assert_same(got, want)
    assert (ep.overlap.beside, ep.overlap.behind) == (2 * BACKWARDS[name], 0)


@pytest.mark.gpu
@pytest.mark.mpi
def test_gpu_cuda_graph_of_an_overlapped_step(comm, device):
    """The fp8_rowwise token path's forward and backward with the backward overlap, on one
    fixed batch and layout (the layout exchange, the path's one host sync, stays outside),
    captured in one CUDA graph (``torch.cuda.graph``, relaxed: the communicator's watchdog
    queries events meanwhile) and replayed 3 times: outputs and gradients equal the eager
    step's, bit for bit; inside the capture the overlap steps aside (its backward runs on the
    capturing stream, counted ``behind``). The ranks agree on a capture's failure before any
    replay waits for a peer."""
    from mpi4py import MPI

    from mxcomm._torch_overlap import BackwardOverlap
    overlap = BackwardOverlap()
    w = _weights(device)
    x, counts, grad = _routed(comm.rank, comm.size, device, 0)
    x.requires_grad_()
    layout = mt.exchange_layout(counts, comm)

    def step():
        x.grad = w.grad = None
        rows, _, offs = overlap.dispatch(x, layout, precision="fp8_rowwise",
                                         grad_precision="mxfp8", align=ALIGN, fused=True)
        y = mt.grouped_mm(rows, w, offs)
        out = mt.a2a_combine(y, layout, precision="bf16", grad_precision="fp8_rowwise",
                             permute_align=ALIGN)
        (out.float() * grad.float()).sum().backward()
        return out, x.grad, w.grad

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # eager, and the warm-up of every cache (as torch's docs ask)
        want = [t.detach().clone() for t in step()]
        step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    beside, behind = overlap.beside, overlap.behind
    graph, error = torch.cuda.CUDAGraph(), None
    try:
        with torch.cuda.graph(graph, capture_error_mode="relaxed"):
            outs = step()
    except Exception as exc:  # reported on every rank
        error = f"rank {comm.rank}: {type(exc).__name__}: {exc}"
    errors = [e for e in MPI.COMM_WORLD.allgather(error) if e]
    if errors:
        comm.abort()
        pytest.fail("capture failed: " + "; ".join(errors))
    assert (overlap.beside - beside, overlap.behind - behind) == (0, 1)
    for replay in range(3):
        for t in outs:
            t.detach().zero_()
        graph.replay()
        torch.cuda.synchronize()
        same = all(torch.equal(a, b) for a, b in zip(outs, want))
        agreed = MPI.COMM_WORLD.allgather(same)
        assert all(agreed), f"replay {replay}: ranks with other results: " \
            f"{[r for r, ok in enumerate(agreed) if not ok]}"
    del graph
