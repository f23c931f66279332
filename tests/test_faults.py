"""Fault injection (issue 14): every bad input and every fault ends in a clear error on every rank,
fast. Each MPI case is a whole job of tests/faults/driver.py (``mpiexec -n W driver.py CASE``);
the test asserts on each rank's ``RESULT`` line: the exception type, the ranks named, the time.

Run: ``FAULTS_RANKS=3 python -m pytest -q -m faults tests/test_faults.py`` (tests/run.sh runs it at
2 and 3 ranks).
"""

import os
import re
import subprocess
import sys
import tempfile
import time
import zlib

import numpy
import pytest

from mxcomm._array import bfloat16
from mxcomm.permutation import permute, unpermute

pytestmark = pytest.mark.faults

DRIVER = os.path.join(os.path.dirname(__file__), "faults", "driver.py")
RANKS = int(os.environ.get("FAULTS_RANKS", "2"))
TIMEOUT = 2.0  # the driver's communicator timeout
SLACK = 3.0
BAD = 1
# one line per rank; two ranks' lines may run together, and mpiexec's words may follow the last
LINE = re.compile(r"RESULT rank=(\d+) exc=(\S+) t=([\d.]+) msg=(.*?)(?=RESULT rank=|\n|$)")


#: The cases run in one gloo world (one spawn for all: a world takes seconds to start).
GLOO_CASES = ("native_dtype_mix", "dim_mix_layout", "stale_layout", "fail_one_of_three_layout",
              "precision_mix_layout", "raise_before_first_layout", "rows_before_first_layout",
              "foreign_layout_first", "fail_one_of_three_pull", "stale_layout_pull",
              "fail_one_of_three_torch", "fail_after_vote_explicit")


def _gloo_rank(rank, size, cases):
    """One rank of a gloo world (tests/torch_world.py, as torchrun makes one) running each of
    the driver's ``cases`` on a communicator of its own; returns ``{case: (exc, seconds,
    message)}`` as the driver's RESULT lines say."""
    import torch.distributed as dist
    sys.path.insert(0, os.path.dirname(DRIVER))
    import driver
    from mxcomm import comm as mxc
    results = {}
    for case in cases:
        comm = mxc.init(group=dist.group.WORLD, timeout=TIMEOUT)
        t0 = time.perf_counter()
        try:
            getattr(driver, "case_" + case)(comm)
            exc, msg = "none", ""
        except Exception as e:  # noqa: BLE001 (reported: the test asserts on it)
            exc, msg = type(e).__name__, " ".join(str(e).split())
        results[case] = (exc, time.perf_counter() - t0, msg)
        if exc in ("TimeoutError", "RuntimeError"):
            # a case that timed out: stay out of the group until every rank's own timeout has
            # fired, so this rank's barrier below reaches no peer still waiting in the case (its
            # pending gloo op would take the barrier's message and fail instead of timing out)
            time.sleep(max(0.0, t0 + TIMEOUT + 1.0 - time.perf_counter()))
        dist.barrier()  # every rank done with the case
    return results


@pytest.fixture(scope="module")
def gloo_world():
    """Every case of GLOO_CASES run in one gloo world of RANKS ranks: ``{case: {rank: (exc,
    seconds, message)}}``."""
    pytest.importorskip("torch")
    from torch_world import run_world
    per_rank = run_world(RANKS, _gloo_rank, GLOO_CASES, timeout=len(GLOO_CASES) * 10 + 60)
    return {case: {r: per_rank[r][case] for r in range(RANKS)} for case in GLOO_CASES}


def run_case(world, case, gloo_world):
    """The results of ``case`` at RANKS ranks under ``world`` (``"mpiexec"``: its own MPI job;
    ``"gloo"``: from the module's gloo world): ``({rank: (exc, seconds, message)}, output)``."""
    if world == "mpiexec":
        results, rc, wall, out = run_job(case)
        return results, out
    return gloo_world[case], gloo_world[case]


def run_job(case, ranks=RANKS, limit=TIMEOUT + 20):
    """Run one case (``FAULTS_MPIEXEC``: the launcher, default ``mpiexec``, e.g. ``"mpirun
    --allow-run-as-root"`` for Open MPI as root); return ({rank: (exc, seconds, message)}, exit
    code, wall seconds, output)."""
    launcher = os.environ.get("FAULTS_MPIEXEC", "mpiexec").split()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:  # where each rank says it printed its line
        p = subprocess.run(launcher + ["-n", str(ranks), sys.executable, DRIVER, case],
                           capture_output=True, text=True, timeout=limit,
                           env=dict(os.environ, FAULTS_DIR=folder))
    wall = time.perf_counter() - t0
    out = p.stdout + p.stderr
    results = {int(r): (exc, float(t), msg.strip()) for r, exc, t, msg in LINE.findall(out)}
    return results, p.returncode, wall, out


def assert_all_raise(case, exc, *words, bound=1.0):
    results, rc, wall, out = run_job(case)
    assert sorted(results) == list(range(RANKS)), out
    for rank, (got, seconds, msg) in results.items():
        assert got == exc, (rank, got, msg)
        assert seconds < bound, (rank, seconds)
        for w in words:
            assert w in msg, (rank, w, msg)
    return results


@pytest.mark.parametrize("case, exc, words", [
    ("layout_length", "ValueError", ["num_tokens_per_expert", f"rank {BAD}", "length"]),
    ("layout_float", "TypeError", ["num_tokens_per_expert", f"rank {BAD}", "float32"]),
    ("layout_negative", "ValueError", ["num_tokens_per_expert", f"rank {BAD}", "-1"]),
    ("layout_2e33", "ValueError", ["num_tokens_per_expert", f"rank {BAD}", str(2 ** 33)]),
    ("layout_none", "TypeError", ["num_tokens_per_expert", f"rank {BAD}", "NoneType"]),
    ("layout_list", "TypeError", ["num_tokens_per_expert", f"rank {BAD}", "list"]),
    ("precision_mismatch", "ValueError", ["rank 0 has precision 'mxfp8'",
                                          f"rank {BAD} has precision 'bf16'"]),
    ("dim_mismatch", "ValueError", ["D = 32", f"rank {BAD}", "D = 64"]),
    ("torch_tensor", "TypeError", ["x on rank", "bfloat16", "mxcomm.torch"]),
])
def test_every_rank_raises(case, exc, words):
    """A bad argument on one rank (or a mismatch across ranks): the same error on every rank, in
    the user's terms, before any data moves."""
    pytest.importorskip("torch") if case == "torch_tensor" else None
    assert_all_raise(case, exc, *words, bound=3.0)


@pytest.mark.parametrize("case, named", [
    ("raise_before_explicit", True),  # the argument vote times out naming the rank
    ("raise_before_layout", True),    # the flag wait times out naming the rank
    ("raise_mid_dispatch", True),     # raised in its first pull: the peers' next call times out
    ("raise_mid_combine", True),      # the layout check before combine's bf16 alltoallv names it
])
def test_rank_raises(case, named):
    """Rank BAD raises (and stays alive): the others raise TimeoutError within the timeout."""
    results, rc, wall, out = run_job(case)
    assert sorted(results) == list(range(RANKS)), out
    assert results[BAD][0] == "KeyError"
    for rank, (exc, seconds, msg) in results.items():
        if rank == BAD:
            continue
        assert exc == "TimeoutError", (rank, exc, msg)
        assert TIMEOUT - 0.5 < seconds < TIMEOUT + SLACK, (rank, seconds)
        if named:
            assert f"rank {BAD} did not" in msg, msg


def names_late(msg, rank):
    """Whether a timeout's message names ``rank`` as the one that did not arrive (the MPI side
    channel says so itself; gloo's through the arrival board)."""
    return re.search(rf"ranks? (\d+, )*{rank}(, \d+)* (did not arrive|had not entered)", msg) \
        is not None


@pytest.mark.parametrize("world", ["mpiexec", "gloo"])
@pytest.mark.parametrize("case, bad_exc", [
    ("raise_before_first_layout", "KeyError"),   # a plain exception, then stays alive
    ("rows_before_first_layout", "ValueError"),  # its own rows: raised at once there
    ("foreign_layout_first", "TimeoutError"),    # its dispatch waits on the other comm
])
def test_first_layout_dispatch_fails(world, case, bad_exc, request):
    """Rank BAD's first layout-based dispatch (MPI: the one that allocates the peer memory) fails
    on it alone: its peers time out within the timeout, naming BAD (MPI: in a bounded barrier
    before the unbounded MPI window allocation, where they hung; gloo: in the layout check);
    no rank returns rows. A rank that went to another communicator is not there: each names
    the other."""
    results, out = run_case(world, case, request.getfixturevalue("gloo_world")
                            if world == "gloo" else None)
    assert sorted(results) == list(range(RANKS)), out
    assert results[BAD][0] == bad_exc, results[BAD]
    for rank, (exc, seconds, msg) in results.items():
        if rank == BAD and bad_exc != "TimeoutError":
            assert seconds < 1.0, (rank, seconds)
            continue
        assert exc == "TimeoutError", (rank, exc, msg)
        assert TIMEOUT - 0.5 < seconds < TIMEOUT + SLACK, (rank, seconds)
        if rank != BAD:
            assert names_late(msg, BAD), msg


@pytest.mark.parametrize("world", ["mpiexec", "gloo"])
def test_precision_mix_on_the_layout_path(world, request):
    """precision "bf16" on rank BAD, "mxfp8" on the others, given a layout. gloo: every rank
    checks its rows before moving them (the same ValueError everywhere, naming both). MPI: the
    quantized exchange waits for its peers' flags where rank BAD is in the layout check: each
    times out naming the others, within the timeout. No rank returns rows."""
    results, out = run_case(world, "precision_mix_layout",
                            request.getfixturevalue("gloo_world") if world == "gloo" else None)
    assert sorted(results) == list(range(RANKS)), out
    for rank, (exc, seconds, msg) in results.items():
        if world == "gloo":
            assert exc == "ValueError" and f"rank {BAD} has" in msg and "bfloat16" in msg, msg
            assert seconds < 1.0, (rank, seconds)
        else:
            assert exc == "TimeoutError", (rank, exc, msg)
            assert seconds < TIMEOUT + SLACK, (rank, seconds)
            assert names_late(msg, 0 if rank == BAD else BAD), msg


@pytest.mark.parametrize("case, seconds", [
    ("stuck_at_exit", TIMEOUT),          # uncaught: ends right after the traceback
    ("stuck_caught_exit", 2 * TIMEOUT),  # caught, then MPI_Finalize under an alarm of TIMEOUT
])
def test_survivors_exit_past_a_stuck_peer(case, seconds):
    """Rank BAD is stuck (a 60 s sleep) before the first dispatch; the others time out naming it,
    and their processes end without waiting for it in MPI_Finalize: the job ends (mpiexec takes
    the stuck rank down) long before the sleep does."""
    results, rc, wall, out = run_job(case)
    assert rc != 0, out
    survivors = {r: v for r, v in results.items() if r != BAD}
    assert sorted(survivors) == [r for r in range(RANKS) if r != BAD], out
    for rank, (exc, t, msg) in survivors.items():
        assert exc == "TimeoutError" and f"rank {BAD} did not" in msg, (rank, exc, msg)
        assert t < TIMEOUT + SLACK, (rank, t)
    assert wall < seconds + SLACK + 5, wall  # + the job's start (imports) on a loaded machine


@pytest.mark.parametrize("world", ["mpiexec", "gloo"])
@pytest.mark.parametrize("case, words", [
    ("native_dtype_mix", ["bfloat16 rows", f"rank {BAD} has", "float32 rows"]),
    ("dim_mix_layout", ["shape (32,)", f"rank {BAD} has", "shape (64,)"]),
    ("stale_layout", ["rank 0 has layout 2", f"rank {BAD} has layout 1"]),
    ("fail_one_of_three_layout", ["rank 0 has layout 1, call 2",
                                  f"rank {BAD} has layout 1, call 3"]),
    ("fail_one_of_three_torch", ["rank 0 has layout 1, call 2",
                                 f"rank {BAD} has layout 1, call 3"]),
])
def test_layout_path_mismatch(world, case, words, request):
    """Ranks disagreeing on a layout-path exchange (rows of another dtype or width, a stale
    layout, a rank whose call failed alone going on to the next; through ``mxcomm.torch`` too,
    whose direct path counts its calls as the engine does): the same ValueError on every rank,
    naming the rank and what each has, before any data moves (MPI moved garbage here, gloo
    aborted the processes); nothing returned anywhere."""
    results, out = run_case(world, case, request.getfixturevalue("gloo_world")
                            if world == "gloo" else None)
    assert sorted(results) == list(range(RANKS)), out
    messages = set()
    for rank, (exc, seconds, msg) in results.items():
        assert exc == "ValueError", (rank, exc, msg)
        assert seconds < TIMEOUT, (rank, seconds)
        for w in words:
            assert w in msg, (rank, w, msg)
        messages.add(msg)
    assert len(messages) == 1, messages


def names(msg, rank):
    """Whether ``msg`` names ``rank`` ("rank 1", or "ranks 2, 1")."""
    return re.search(rf"\branks? (\d+, )*{rank}\b", msg) is not None


@pytest.mark.parametrize("world", ["mpiexec", "gloo"])
@pytest.mark.parametrize("case, words", [
    ("fail_one_of_three_pull", ["rank 0 has layout 1, call 2", f"rank {BAD} has layout 1, call 3"]),
    ("stale_layout_pull", ["rank 0 has layout 2", f"rank {BAD} has layout 1"]),
])
def test_mispaired_call_of_a_quantized_exchange(world, case, words, request):
    """MXFP8 rows on the layout path, one rank at another call than its peers, with rows of the
    same shape and counts: rank BAD's second of three calls failed its local check alone and it
    went on to the third, or it uses the step's first layout where the others use the second.
    MPI pulls the rows from peer memory, whose ready words carry the call's tag (the layout's
    number and the call's): every rank raises RuntimeError at once, naming a rank at the other
    call, before it reads a row. gloo moves them in one alltoallv, checked first on the host:
    the same ValueError everywhere, naming both calls. No rank returns rows."""
    results, out = run_case(world, case, request.getfixturevalue("gloo_world")
                            if world == "gloo" else None)
    assert sorted(results) == list(range(RANKS)), out
    for rank, (exc, seconds, msg) in results.items():
        assert seconds < 1.0, (rank, seconds, msg)
        if world == "gloo":
            assert exc == "ValueError", (rank, exc, msg)
            assert all(w in msg for w in words), (rank, msg)
            continue
        assert exc == "RuntimeError" and "mis-paired" in msg, (rank, exc, msg)
        if rank == BAD:  # the others are all at the other call
            assert any(names(msg, r) for r in range(RANKS) if r != BAD), msg
        else:  # BAD's word, or BAD's (or a peer's) word that it gave up on finding it
            assert names(msg, BAD) or "found this exchange" in msg, msg


@pytest.mark.parametrize("world", ["mpiexec", "gloo"])
def test_explicit_splits_are_paired_by_their_vote(world, request):
    """Explicit splits: rank BAD's second of three calls fails after its vote, before its rows
    move, and BAD goes on to the third. Its third call's vote is a host round of its own, which
    the peers, waiting for BAD's rows of the second, never join: no call is mis-paired. Every
    rank raises TimeoutError within the timeout (the peers naming BAD by the arrival board; BAD
    naming the peers, which did not come to its vote); no rank returns rows."""
    results, out = run_case(world, "fail_after_vote_explicit",
                            request.getfixturevalue("gloo_world") if world == "gloo" else None)
    assert sorted(results) == list(range(RANKS)), out
    for rank, (exc, seconds, msg) in results.items():
        assert exc == "TimeoutError", (rank, exc, msg)
        assert TIMEOUT - 0.5 < seconds < TIMEOUT + SLACK, (rank, seconds)
        if rank != BAD:
            assert names_late(msg, BAD), msg


def test_layout_exchange_after_a_timeout_refuses_at_once():
    """After its layout exchange timed out (rank BAD never came), a rank's next exchange_layout
    raises RuntimeError at once, as a dispatch does, instead of waiting a timeout again."""
    results, rc, wall, out = run_job("layout_after_timeout")
    assert sorted(results) == list(range(RANKS)), out
    for rank, (exc, seconds, msg) in results.items():
        if rank == BAD:
            continue
        assert exc == "RuntimeError" and "aborted" in msg and f"rank {BAD}" in msg, (rank, msg)
        assert TIMEOUT - 0.5 < seconds < TIMEOUT + 1.0, (rank, seconds)  # one wait, not two


def test_a_late_rank_names_itself_late():
    """Rank BAD comes to a dispatch 1 s after its peers timed out in it (pull transport): it
    raises at once, saying the peers had given up and it is late, instead of waiting a timeout
    and blaming them; the peers' TimeoutError names it."""
    results, rc, wall, out = run_job("late_rank")
    assert sorted(results) == list(range(RANKS)), out
    exc, seconds, msg = results[BAD]
    assert exc == "RuntimeError" and "this rank is late" in msg, msg
    assert seconds < TIMEOUT + 1 + 1.0, seconds  # its sleep, then at once
    for rank, (exc, seconds, msg) in results.items():
        if rank != BAD:
            assert exc == "TimeoutError" and f"rank {BAD} did not" in msg, (rank, msg)
            assert TIMEOUT - 0.5 < seconds < TIMEOUT + SLACK, (rank, seconds)


def test_an_aborted_communicator_keeps_a_clean_exit():
    """Every rank aborts its communicator and ends normally, no peer stuck: the bounded exit
    finalizes MPI as usual, at once, and the job's status stays 0 (the alarm never fires)."""
    results, rc, wall, out = run_job("abort_then_finalize")
    assert rc == 0, out
    assert sorted(results) == list(range(RANKS)), out
    assert all(exc == "none" for exc, _, _ in results.values()), results
    assert wall < TIMEOUT + 10, wall  # well before an alarm of TIMEOUT after the start (+ start)


@pytest.mark.parametrize("case", ["exit_before_explicit", "exit_before_layout",
                                  "kill_before_layout", "exit_mid_dispatch", "kill_mid_dispatch",
                                  "kill_mid_combine", "sigint_mid_dispatch"])
def test_rank_dies(case):
    """Rank BAD exits (os._exit), is SIGKILLed, or interrupted (SIGINT: an uncaught
    KeyboardInterrupt) before or in the middle of an exchange: mpich's
    mpiexec aborts the whole job, well within the timeout (survivors never hang); a survivor that
    got there first raises TimeoutError naming the rank."""
    results, rc, wall, out = run_job(case)
    assert wall < TIMEOUT + SLACK + 5, wall
    survivors = {r: v for r, v in results.items() if r != BAD and v[0] != "none"}
    if rc == 0:  # the job was not aborted: every survivor must have timed out naming BAD
        assert sorted(survivors) == [r for r in range(RANKS) if r != BAD], out
    for rank, (exc, seconds, msg) in survivors.items():
        assert exc == "TimeoutError" and f"rank {BAD}" in msg, (rank, exc, msg)


@pytest.mark.parametrize("argv, words", [(["--dim", "48"], ["--dim", "32", "48"]),
                                         (["--tokens", "0"], ["--tokens", "positive", "0"])])
def test_bench_rejects_shapes(argv, words):
    """The benchmark CLI: one line, no traceback, at 2 ranks."""
    p = subprocess.run(["mpiexec", "-n", "2", sys.executable, "-m", "mxcomm.bench", "pipeline",
                        *argv], capture_output=True, text=True, timeout=60)
    out = p.stdout + p.stderr
    assert p.returncode != 0
    assert "Traceback" not in out, out
    lines = {line for line in out.splitlines() if line.strip()}
    assert len(lines) == 1, out
    assert all(w in out for w in words), out


def test_permute_negative_count():
    """Host backend: a negative count is a ValueError naming the argument. On a GPU the counts
    stay on the device and are not checked (that needs a host sync): pass the layout instead,
    whose counts exchange_layout checked."""
    x = numpy.ones((4, 32), bfloat16)
    with pytest.raises(ValueError, match="num_tokens_per_expert_group.*-2"):
        permute(x, numpy.array([3, -2, 3], numpy.int32), 3)


def test_unpermute_more_rows_than_named():
    """num_rows beyond the rows the indices name: the extra rows are zero, never stale memory."""
    x = numpy.arange(4 * 32, dtype=numpy.float32).reshape(4, 32).astype(bfloat16)
    rows, indices, _ = permute(x, numpy.array([2, 2], numpy.int32), 2)
    y = unpermute(rows, indices, 7)
    assert y.shape == (7, 32)
    assert (numpy.asarray(y[:4], numpy.float32) == numpy.asarray(x, numpy.float32)).all()
    assert not numpy.asarray(y[4:], numpy.float32).any()


# ---------------------------------------------------------------------------- on GPUs (2 ranks)
GPU_TIMEOUT = 10.0  # the driver's on GPUs
#: comm.wait's own timeout comes after 1.25 * timeout + 1 s (docs/design.md, "Error model")
GPU_BOUND = 1.25 * GPU_TIMEOUT + 1 + SLACK


def run_gpu_job(case):
    """One GPU case at 2 ranks (CUDA and NCCL start in the job: a longer limit)."""
    return run_job(case, ranks=2, limit=120)


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["nccl", "pull"])
def test_gpu_rank_raises_before_the_first_dispatch(path):
    """NCCL backend, 2 ranks: rank BAD raises before the first layout-based dispatch (bf16 over
    NCCL, or MXFP8 pulled over CUDA IPC, whose peer memory that dispatch sets up): the other
    raises TimeoutError naming it within the bound, and returns nothing."""
    results, rc, wall, out = run_gpu_job(f"gpu_raise_first_{path}")
    assert sorted(results) == [0, 1], out
    assert results[BAD][0] == "KeyError", results[BAD]
    exc, seconds, msg = results[1 - BAD]
    assert exc == "TimeoutError" and f"rank {BAD}" in msg, (exc, msg)
    assert seconds < GPU_BOUND, seconds


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["nccl", "pull"])
def test_gpu_rank_skips_one_of_three_calls(path):
    """NCCL backend, 2 ranks: rank BAD skips the second of three same-shape dispatches. Its third
    pairs with the other's second: no counter can tell them apart (docs/design.md, "Error
    model"), so what is asserted is the bound: the other's third call raises TimeoutError
    naming rank BAD within the bound."""
    results, rc, wall, out = run_gpu_job(f"gpu_skip_{path}")
    assert sorted(results) == [0, 1], out
    exc, seconds, msg = results[1 - BAD]
    assert exc == "TimeoutError" and f"rank {BAD}" in msg, (exc, msg)
    assert seconds < GPU_BOUND + 5, seconds  # two calls went first


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["nccl", "pull", "dequant"])
def test_gpu_mispaired_call(path):
    """NCCL backend, 2 ranks: rank BAD's second of three same-shape dispatches fails its local
    check and it goes on to the third, which pairs with the other's second. Every rank's
    ``wait`` raises RuntimeError naming the other rank and both calls, within the bound: the
    NCCL group's call headers (bf16), or the pull transport's ready words (MXFP8, kept, or
    dequantized where it lands: ``dequant``, the dispatch's backward). The mis-paired call's
    results hold 0xFF bytes, filled on the device (the header's check; the pull's end, after
    the copies or the consumer of a failed wait: there the peer's rows)."""
    results, rc, wall, out = run_gpu_job(f"gpu_fail_one_of_three_{path}")
    assert sorted(results) == [0, 1], out
    for rank, (exc, seconds, msg) in results.items():
        assert exc == "RuntimeError" and "mis-paired" in msg, (rank, exc, msg)
        assert names(msg, 1 - rank), (rank, msg)
        assert "call 2 of layout 1" in msg and "call 3 of layout 1" in msg, (rank, msg)
        assert seconds < GPU_BOUND, (rank, seconds)
        assert "results all 0xFF: True" in msg, (rank, msg)


@pytest.mark.gpu
def test_gpu_native_dtype_mix_over_nccl():
    """NCCL backend, 2 ranks, the layout path, ``precision="native"``: fp32 rows on rank BAD,
    bf16 on the other. The bf16 rank's header check fails after its group; rank BAD's group
    stalls (it expects more bytes than come) and its timeout reads the headers that arrived.
    Both raise RuntimeError naming the other rank and both dtypes, within the bound."""
    results, rc, wall, out = run_gpu_job("gpu_native_mix_nccl")
    assert sorted(results) == [0, 1], out
    for rank, (exc, seconds, msg) in results.items():
        assert exc == "RuntimeError" and "mis-paired" in msg, (rank, exc, msg)
        assert names(msg, 1 - rank) and "float32" in msg and "bfloat16" in msg, (rank, msg)
        assert seconds < GPU_BOUND, (rank, seconds)


def test_call_header_words_and_message():
    """The NCCL call header (``comm/_header.py``, checked on GPUs by the tests above): the CUDA
    source's header has the module's words; the message of a mismatch names the peer, both
    calls and both rows, a dtype this rank never moved included (from its hash)."""
    import pathlib
    from mxcomm.comm import _header
    source = pathlib.Path(_header.__file__).with_name("_signal.cu").read_text()
    assert int(re.search(r"#define MX_HEADER_WORDS (\d+)", source).group(1)) == \
        _header.HEADER_WORDS
    assert int(re.search(r"#define MX_HEADER_MAGIC (0x[0-9A-F]+)u", source).group(1), 16) == \
        _header.MAGIC

    class Rows:  # an array's dtype and shape, as the header reads them
        def __init__(self, dtype, shape):
            self.dtype, self.shape = numpy.dtype(dtype), shape

    mine, text = _header.describe_rows((Rows(bfloat16, (9, 32)),))
    assert text == "bfloat16 rows of shape (32,)" and mine[2:] == (32, 1, 0)
    theirs, _ = _header.describe_rows((Rows(numpy.float32, (9, 32)),))
    assert theirs[0] != mine[0] and theirs[1] != mine[1]
    headers = object.__new__(_header.CallHeaders)
    headers._rank = 0
    headers.texts = {mine[0]: text}
    headers._dtypes = {zlib.crc32(n.encode()): n for n in _header._DTYPES}
    error = headers._error(1, (1, 3) + theirs, (1, 2) + mine, "poisoned")
    msg = str(error)
    assert isinstance(error, RuntimeError), error
    for words in ("rank 1 is at call 3 of layout 1 with float32 rows of 32 elements",
                  "this rank is at call 2 of layout 1 with bfloat16 rows of shape (32,)",
                  "mis-paired", "poisoned"):
        assert words in msg, (words, msg)
    vote = str(headers._error(1, (0, 7) + mine, (0, 9) + mine, "poisoned"))
    assert "host collective 7" in vote and "host collective 9" in vote, vote


class _Packed:
    """A stand-in for ``mxcomm._driver.PackedLaunch`` that packs each launch's values by its
    format (``struct``, native alignment, as the real one does) and keeps them."""

    def __init__(self, fmt):
        import struct
        self.layout, self.launches = struct.Struct("@" + fmt), []

    def __call__(self, grid, block, stream, values):
        self.layout.pack(*values)  # raises on a wrong count or a value out of range
        self.launches.append((grid, block, stream, tuple(values)))


def test_nccl_group_sends_the_call_header_first():
    """The NCCL group of an exchange of a plan (no GPU: NCCL, the kernels and their launches
    stand in): the header kernel before the group, then per peer this rank moves rows with (and
    only those) the header's send and receive before its rows, then the check after the group
    with this call's words and the results; the launches' values pack by the kernels' formats
    (``_signal.cu``'s parameters). A plan without a call number (the hier transport's moves)
    gets no header."""
    from mxcomm._driver import Words
    from mxcomm.comm import _header
    from mxcomm.comm._nccl import NcclCommunicator
    from mxcomm.comm._staged import Plan
    ops = []

    class Nccl:  # NCCL's communicator and module, recording the calls
        def send(self, ptr, n, dtype, peer, stream):
            ops.append(("send", ptr, n, peer))

        def recv(self, ptr, n, dtype, peer, stream):
            ops.append(("recv", ptr, n, peer))

        def groupStart(self):
            ops.append(("start",))

        def groupEnd(self):
            ops.append(("end",))

    headers = object.__new__(_header.CallHeaders)
    headers._rank, headers._size, headers._base = 1, 3, 1 << 20
    headers._slot_bytes = _header.HEADER_BYTES * 4
    headers._next, headers._rows, headers.texts = 0, {}, {}
    headers._dtypes, headers._status_ptr = {}, 1 << 30
    words = f"{_header.HEADER_WORDS - 1}I"
    headers._put, headers._check = _Packed(f"QQi{words}"), _Packed(f"Qi{words}Q4Q4Qi")
    comm = object.__new__(NcclCommunicator)
    comm.rank, comm.size, comm._uint8 = 1, 3, 0
    comm._nccl = comm._nccl_mod = Nccl()
    comm._headers = headers
    comm._board = type("Board", (), {"enter": lambda self, kind: 5})()
    comm._connected = lambda stream: None
    comm.check_usable = lambda: None
    comm._record = lambda stream, call: ops.append(("record", call))
    # rank 1 of 3 sends 2 rows to rank 0 and none to rank 2, receives 3 from rank 2 only
    plan = Plan(1, [[0, 0, 3], [2, 1, 0], [0, 3, 0]])
    plan.generation, plan.calls = 4, 9
    row = numpy.dtype(bfloat16)
    sends = (Words(0x1000, (3, 32), row),)
    outs = (Words(0x9000, (4, 32), row),)
    comm.alltoallv_plan(sends, outs, plan, 77)
    (grid, block, stream, put), = headers._put.launches
    sent, received = put[0], put[1]
    assert stream == 77 and put[2] == 3 and put[3:5] == (4, 9)
    rows = _header.describe_rows(sends)[0]
    assert put[5:] == rows
    size = _header.HEADER_BYTES
    assert ops[0] == ("start",) and ops[-2:] == [("end",), ("record", 5)]
    peers = [op for op in ops[1:-2]]
    header_ops = [op for op in peers if op[2] == size]
    assert header_ops == [("send", sent, size, 0), ("recv", received, size, 0),
                          ("send", sent, size, 2), ("recv", received + 2 * size, size, 2)]
    for peer in (0, 2):  # the header before the rows, for each peer
        mine = [i for i, op in enumerate(peers) if op[3] == peer]
        assert [peers[i][2] for i in mine][:2] == [size, size], peers
    (grid, block, stream, check), = headers._check.launches
    assert check[0] == received and check[1] == 3 and check[2:9] == (4, 9) + rows
    assert check[9] == headers._status_ptr and check[10] == 0x9000 and check[14] == 4 * 32 * 2
    assert check[-1] == 1 and stream == 77
    # the hier transport's moves between nodes: no call number, no header
    ops.clear()
    moves = type("Moves", (), {"send_counts": plan.send_counts, "recv_counts": plan.recv_counts,
                               "send_offsets": plan.send_offsets,
                               "recv_offsets": plan.recv_offsets, "generation": None})()
    comm.alltoallv_plan(sends, outs, moves, 77)
    assert all(op[2] != size for op in ops if op[0] in ("send", "recv")), ops
    assert len(headers._put.launches) == 1 and len(headers._check.launches) == 1


def test_nccl_group_cut_short_aborts_the_communicator():
    """A call that raises inside the NCCL group (an NCCL error, or an interrupt between its send
    and recv calls) leaves groupEnd to launch the part enqueued so far, which the peers' next
    calls would pair with: the group is still ended (groupStart/groupEnd balanced), the
    communicator is aborted (NCCL ends the part), the error propagates, no event is recorded,
    and the rank's next call raises RuntimeError saying why (no GPU: NCCL stands in)."""
    import threading
    from mxcomm.comm._nccl import NcclCommunicator
    ops = []

    class Nccl:
        def send(self, ptr, n, dtype, peer, stream):
            ops.append(("send", peer))
            if len(ops) == 4:
                raise KeyboardInterrupt

        def recv(self, ptr, n, dtype, peer, stream):
            ops.append(("recv", peer))

        def groupStart(self):
            ops.append(("start",))

        def groupEnd(self):
            ops.append(("end",))

    comm = object.__new__(NcclCommunicator)
    comm.rank, comm.size, comm._uint8 = 1, 3, 0
    comm._nccl = comm._nccl_mod = Nccl()
    comm._state, comm._reason, comm._pending_error = "open", "", None
    comm._lock, comm._transport, comm._headers = threading.Lock(), None, None
    comm._abort_backend = lambda: ops.append(("abort",))
    comm._record = lambda stream, call: ops.append(("record", call))
    with pytest.raises(KeyboardInterrupt):
        comm._group([(0x1000, 0x9000, 64)], [1, 1, 1], [0, 1, 2], [1, 1, 1], [0, 1, 2], 77, 5)
    assert ops == [("start",), ("send", 0), ("recv", 0), ("send", 1), ("end",), ("abort",)], ops
    assert comm._host_since is None and comm.aborted
    with pytest.raises(RuntimeError, match="rank 1 failed or was cut short .KeyboardInterrupt"):
        comm.check_usable()


def test_to_host_on_an_aborted_communicator_copies_nothing():
    """After an abort (e.g. a wait of ``to_host`` timed out, its copy into the pinned buffer still
    queued), ``to_host`` raises at once: it neither enqueues a copy nor grows the pinned buffer,
    which would hand the old one back to CuPy's pinned pool (not stream-ordered) under that copy
    (no GPU: the CUDA calls stand in)."""
    import threading
    from mxcomm.comm._nccl import NcclCommunicator
    calls = []
    comm = object.__new__(NcclCommunicator)
    comm.rank, comm.size = 1, 2
    comm._state, comm._reason, comm._pending_error = "open", "", None
    comm._lock, comm._transport, comm._headers = threading.Lock(), None, None
    comm._abort_backend = lambda: None
    comm._pinned, comm._pinned_bytes = "pinned of 4096 bytes", 4096
    comm._runtime = type("Rt", (), {"memcpyAsync": lambda self, *a: calls.append("copy")})()
    comm._cupy = type("Cupy", (), {"cuda": type("Cuda", (), {"alloc_pinned_memory": staticmethod(
        lambda n: calls.append("pinned") or type("P", (), {"ptr": 0x2000})())})})()
    comm._fail(TimeoutError("rank 0 did not arrive"))
    a = type("A", (), {"nbytes": 1 << 20, "flags": type("F", (), {"c_contiguous": True})(),
                       "data": type("D", (), {"ptr": 0x1000})()})()
    with pytest.raises(TimeoutError, match="rank 0 did not arrive"):
        comm.to_host(a, 77)
    with pytest.raises(RuntimeError, match="aborted"):
        comm.to_host(a, 77)
    assert calls == [] and comm._pinned == "pinned of 4096 bytes"


def test_nccl_alltoall_counts_allocates_on_the_stream_of_its_group(monkeypatch):
    """``alltoall_counts(counts, stream=s)`` takes its contiguous copy and its result from the
    pool of ``s``, where its NCCL group runs (as ``alltoallv`` does): from the current stream's
    pool, a block still in use there could be written by NCCL unordered (no GPU: CuPy and NCCL
    stand in)."""
    import contextlib
    from mxcomm.comm import _nccl
    from mxcomm.comm._nccl import NcclCommunicator
    current = [0]  # CuPy's current stream, as the stand-in's allocations see it
    allocations, groups = [], []

    @contextlib.contextmanager
    def on_stream(ptr):
        before, current[0] = current[0], ptr
        yield
        current[0] = before

    def allocate(what):
        def alloc(a):
            allocations.append((what, current[0]))
            return type("A", (), {"itemsize": 4, "data": type("D", (), {"ptr": 0x1000})()})()
        return alloc

    monkeypatch.setattr(_nccl, "check_counts_array", lambda comm, counts: (counts, 2))
    comm = object.__new__(NcclCommunicator)
    comm.rank, comm.size = 0, 2
    comm.check_usable = lambda: None
    comm._connected = lambda stream: None
    comm._board = type("Board", (), {"enter": lambda self, kind: 3})()
    comm._cupy = type("Cupy", (), {"ascontiguousarray": staticmethod(allocate("copy")),
                                   "empty_like": staticmethod(allocate("out"))})()
    comm.on_stream = on_stream
    comm._group = lambda blocks, sc, so, rc, ro, stream, call: groups.append((stream, call))
    comm.alltoall_counts("counts", stream=77)
    assert allocations == [("copy", 77), ("out", 77)] and groups == [(77, 3)], allocations


def test_stalled_group_names_the_mismatch_from_the_device_headers():
    """A stalled NCCL group's timeout reads the call headers as the device holds them (no GPU:
    the copy stands in): a slot whose peer header (received this call: the magic word) differs
    from this rank's header in the same slot names the peer and both calls; slots never put,
    headers equal, or received areas cleared are not a mismatch."""
    from mxcomm.comm import _header
    W, n = 3, _header.HEADER_WORDS
    device = numpy.zeros((_header._SLOTS, W + 1, n), numpy.uint32)
    rows, _ = _header.describe_rows((type("R", (), {"dtype": numpy.dtype(bfloat16),
                                                     "shape": (4, 32)})(),))

    def header(calls):
        return (2, calls) + rows + (_header.MAGIC,)
    device[5, 0] = device[5, 2] = device[5, 3] = header(7)  # a call whose headers agreed
    device[6, 0] = header(8)                                 # put, nothing received yet
    device[7, 0], device[7, 1] = header(9), header(9)

    class Host(numpy.ndarray):
        pass

    headers = object.__new__(_header.CallHeaders)
    headers._rank, headers._size = 1, W
    headers._slot_bytes = _header.HEADER_BYTES * (W + 1)
    headers._base = 1 << 20
    headers._host = numpy.zeros(device.nbytes, numpy.uint8).view(Host)
    headers._host.ptr = 1 << 30
    headers._copies = type("S", (), {"ptr": 3, "synchronize": lambda self: None})()

    def copy(dst, src, nbytes, kind, stream):  # the device-to-host copy
        assert (dst, src, nbytes, stream) == (1 << 30, 1 << 20, device.nbytes, 3)
        headers._host[:] = device.reshape(-1).view(numpy.uint8)
    headers._runtime = type("Rt", (), {"memcpyAsync": staticmethod(copy)})()
    headers.texts = {rows[0]: "bfloat16 rows of shape (32,)"}
    headers._dtypes = {}
    assert headers.stalled() is None
    device[7, 3] = (2, 8) + rows + (_header.MAGIC,)  # rank 2 sent call 8 where this is at 9
    error = headers.stalled()
    assert isinstance(error, RuntimeError), error
    assert "rank 2 is at call 8 of layout 2" in str(error), error
    assert "this rank is at call 9 of layout 2" in str(error) and "stalled" in str(error), error


def test_pull_end_poisons_by_the_kernels_format():
    """The pull transport's end on GPUs (no GPU: the launch stands in): one launch, whose values
    pack by ``mx_end``'s parameters, naming the copies' results (up to 4) and their bytes;
    none for an in-place exchange, then one block."""
    from mxcomm._driver import Words
    from mxcomm.comm._ipc import CudaPeerMemory
    memory = object.__new__(CudaPeerMemory)
    memory._size, memory._threads, memory._side_ptr = 3, 32, 5
    memory._gen_ptr, memory._status_ptr = 1 << 20, 1 << 30
    memory._done_addresses = type("A", (), {"data": type("D", (), {"ptr": 1 << 21})()})()
    memory._end_k = _Packed("QQiQ4Q4Qi")
    events = []
    memory._rt = type("Rt", (), {"eventRecord": lambda self, e, s: events.append(("rec", s)),
                                 "streamWaitEvent": lambda self, s, e, f: events.append(
                                     ("wait", s))})()
    memory._joined = 0
    outs = (Words(0x4000, (8, 32), numpy.dtype(numpy.uint8)),
            Words(0x8000, (8, 1), numpy.dtype(numpy.uint8)))
    memory.end(9, outs)
    memory.end(9)
    (grid, block, stream, values), (grid1, _, _, values1) = memory._end_k.launches
    assert stream == 5 and grid == 16 and block >= 32 and grid1 == 1
    assert values[:4] == (1 << 20, 1 << 21, 2, 1 << 30)
    assert values[4:8] == (0x4000, 0x8000, 0, 0) and values[8:12] == (256, 8, 0, 0)
    assert values[-1] == 2 and values1[-1] == 0
    assert events == [("rec", 5), ("wait", 9)] * 2


def _peer_memory_with_fakes(calls, barrier):
    """A ``CudaPeerMemory`` of rank 1 of 3 whose CUDA calls, buffers and side channel record into
    ``calls`` (no GPU); ``barrier(what)`` stands for the side channel's."""
    from mxcomm.comm._ipc import CudaPeerMemory

    class Buffer:  # a cudaMalloc'ed buffer: freed when the last reference goes
        ptr = 1 << 24

        def __init__(self, name):
            self.name = name

        def __del__(self):
            calls.append(("free", self.name))

    rt = type("Rt", (), {
        "ipcCloseMemHandle": lambda self, ptr: calls.append(("close", ptr)),
        "eventDestroy": lambda self, event: None,
        "deviceSynchronize": lambda self: calls.append(("sync",)),
        "ipcGetMemHandle": lambda self, ptr: b"h" * 64,
        "ipcOpenMemHandle": lambda self, handle: calls.append(("open",)) or 300})()

    def allgather_bytes(payload, what):  # a meeting (one byte): what barrier says, else the same
        return (len(payload) == 1 and barrier(what)) or payload * 3
    side = type("Side", (), {"allgather_bytes": lambda self, payload, what:
                             allgather_bytes(payload, what)})()
    memory = object.__new__(CudaPeerMemory)
    memory._rank, memory._world_rank, memory._rt, memory._forked, memory._joined = 1, 1, rt, 7, 8
    memory._side = "side stream"
    memory._comm = type("Comm", (), {
        "_side": side, "rank": 1, "size": 3, "timeout": 0.5, "device": 0,
        "wait": lambda self, stream: None,
        "_fail": lambda self, error, raised=False: calls.append(("fail", str(error)))})()
    memory._cupy = type("Cupy", (), {"cuda": type("Cuda", (), {
        "Device": staticmethod(lambda d: type("D", (), {"use": lambda self: None})()),
        "memory": type("M", (), {"Memory": staticmethod(
            lambda n: Buffer(f"staging of {n} bytes"))})})})()
    memory._peer_ptr, memory._peer_flags = {0: 100, 2: 102}, {0: 200, 2: 202}
    memory._memory, memory._flags, memory._capacity = Buffer("staging"), Buffer("flags"), 1 << 21
    memory._status_memory, memory._done_addresses = "pinned status", "done addresses"
    memory.epoch = 0
    return memory


def test_peer_memory_is_freed_only_after_every_rank_unmapped_it():
    """CUDA leaves a buffer freed before an importer closes its mapping undefined
    (``cudaIpcOpenMemHandle``): close and growth close this rank's mappings of its peers'
    buffers, meet the peers, and only then free this rank's; a meeting past the timeout keeps
    them allocated and warns."""
    import gc
    from mxcomm.comm import _ipc
    calls = []
    memory = _peer_memory_with_fakes(calls, lambda what: calls.append(("barrier", what)))
    memory.reserve(4 << 20, stream=0)  # growth: a new staging, mapped anew
    gc.collect()
    assert calls[:4] == [("close", 100), ("close", 102), ("barrier", "peer memory growth"),
                         ("free", "staging")], calls
    assert calls[4:] == [("open",), ("open",)] and memory._peer_ptr == {0: 300, 2: 300}
    calls.clear()
    memory.close()
    gc.collect()
    # this rank's device work first (its signals write into the peers' flags)
    assert calls[:6] == [("sync",), ("close", 300), ("close", 300), ("close", 200),
                         ("close", 202), ("barrier", "peer memory release")], calls
    # 4 MiB asked, 1.25 times that in whole 2 MiB granules: 6 MiB
    assert sorted(calls[6:]) == [("free", "flags"), ("free", f"staging of {3 << 21} bytes")]

    def late(what):
        raise TimeoutError("rank 2 did not arrive")

    def dead(what):  # the torch side channel: a peer that exited is a RuntimeError
        raise RuntimeError("rank 2 closed the connection")
    for barrier, message in ((late, "rank 2 did not arrive"),
                             (dead, "rank 2 closed the connection")):
        calls.clear()
        memory = _peer_memory_with_fakes(calls, barrier)
        with pytest.warns(RuntimeWarning, match=f"rank 1: {message}; its buffers stay allocated"):
            memory.close()
        gc.collect()
        assert not [c for c in calls if c[0] == "free"], calls
        assert _names(_ipc._KEPT.pop()) == KEPT_NAMES


#: What a close that cannot free keeps: the buffers peers map, and what queued work still uses.
KEPT_NAMES = ["staging", "flags", "pinned status", "done addresses"]


def _names(kept):
    return [getattr(b, "name", b) for b in kept]


def test_peer_memory_close_waits_for_its_device_work_bounded():
    """Close waits for this process's device work before it unmaps anything (an exchange's
    signals into the peers' flags run on its caller's stream); a wait past the timeout keeps
    every buffer and mapping, and warns."""
    import gc
    import threading
    from mxcomm.comm import _ipc
    calls, release = [], threading.Event()
    memory = _peer_memory_with_fakes(calls, lambda what: calls.append(("barrier", what)))
    memory._rt.deviceSynchronize = lambda: release.wait(5)  # a kernel still running
    with pytest.warns(RuntimeWarning, match="its device work did not finish within 0.5 s"):
        memory.close()
    release.set()
    gc.collect()
    assert calls == [], calls  # nothing unmapped, no meeting, nothing freed
    assert _names(_ipc._KEPT.pop()) == KEPT_NAMES


def test_peer_memory_growth_and_release_never_pair():
    """A rank that closes while a peer grows its staging (it failed alone and closed): the two
    meetings carry what each is for, so the growing rank raises and aborts instead of mapping
    anew while the closing one frees, and the closing rank keeps its buffers."""
    import gc
    from mxcomm.comm import _ipc
    calls = []
    closing = _peer_memory_with_fakes(calls, lambda what: bytes([1, 2, 0]))  # 0 grows, 2: other
    with pytest.warns(RuntimeWarning, match="rank 0 met to grow their peer memory; rank 2 met to "
                                            r"do something else \(byte 0\)"):
        closing.close()
    gc.collect()
    assert not [c for c in calls if c[0] == "free"], calls
    assert _names(_ipc._KEPT.pop()) == KEPT_NAMES
    calls.clear()
    growing = _peer_memory_with_fakes(calls, lambda what: bytes([2, 1, 1]))  # rank 0 releases
    with pytest.raises(RuntimeError, match="growth on rank 1: rank 0 met to release"):
        growing.reserve(4 << 20, stream=0)
    assert [c[0] for c in calls] == ["close", "close", "fail"], calls
    assert not [c for c in calls if c[0] == "open"]
    # hier: the node's view of the side channel keeps its own ranks' entries; the meeting reads
    # every rank's, so a rank of another node growing is seen too
    calls.clear()
    closing = _peer_memory_with_fakes(calls, lambda what: bytes([2, 2, 2]))
    side = closing._comm._side
    side.allgather_world = lambda payload, what: payload * 3 + bytes([1])  # rank 3 grows
    with pytest.warns(RuntimeWarning, match="rank 3 met to grow their peer memory"):
        closing.close()
    assert _names(_ipc._KEPT.pop()) == KEPT_NAMES


@pytest.mark.parametrize("unmap_fails", [False, True])
def test_peer_memory_setup_failing_after_its_handle_went_out_keeps_the_flags(monkeypatch,
                                                                             unmap_fails):
    """Once this rank's flags handle has gone to its peers they may map the flags: a setup that
    fails after that (here: opening rank 2's handle) unmaps what it mapped and keeps the flags,
    never freed; what can fail locally (the kernels' module, pinned status, stream, events) comes
    before the handle goes out (no GPU: CuPy's calls stand in). The flags are kept even if
    unmapping fails too."""
    import gc
    import sys
    import types
    from mxcomm.comm import _ipc
    calls = []

    class Buffer:
        ptr = 1 << 24

        def __init__(self, nbytes):
            self.nbytes = nbytes

        def __del__(self):
            calls.append(("free", self.nbytes))

    class Pinned(bytearray):
        ptr = 1 << 30

    def open_handle(handle):
        if handle == b"2" * 64:
            raise RuntimeError("cudaErrorMapBufferObjectFailed")
        calls.append(("open", handle[:1]))
        return 500

    def close_handle(ptr):
        calls.append(("close", ptr))
        if unmap_fails:
            raise RuntimeError("cudaErrorIllegalAddress")

    kernel = types.SimpleNamespace(kernel=types.SimpleNamespace(ptr=9))
    runtime = types.SimpleNamespace(
        memcpy=lambda *a: None, eventCreateWithFlags=lambda flags: calls.append(("event",)) or 7,
        ipcGetMemHandle=lambda ptr: calls.append(("export",)) or b"1" * 64,
        ipcOpenMemHandle=open_handle, ipcCloseMemHandle=close_handle)
    cuda = types.SimpleNamespace(
        runtime=runtime, memory=types.SimpleNamespace(Memory=Buffer),
        PinnedMemory=lambda n, flags: None, PinnedMemoryPointer=lambda mem, at: Pinned(16),
        Stream=lambda non_blocking: calls.append(("stream",)) or types.SimpleNamespace(ptr=5),
        driver=types.SimpleNamespace(launchKernel=None))
    cupy = types.SimpleNamespace(
        cuda=cuda, asarray=lambda a: a,
        RawModule=lambda code, options: calls.append(("module",)) or types.SimpleNamespace(
            get_function=lambda name: kernel))
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    side = types.SimpleNamespace(allgather_bytes=lambda payload, what: b"0" * 64 + payload
                                 + b"2" * 64)
    comm = types.SimpleNamespace(rank=1, size=3, timeout=1.0, _side=side)
    kept = len(_ipc._KEPT)
    with pytest.raises(RuntimeError, match="IllegalAddress" if unmap_fails else
                       "MapBufferObjectFailed"):
        _ipc.CudaPeerMemory(comm)
    gc.collect()
    assert ("free", 2 << 20) not in calls, calls
    assert calls.index(("export",)) > max(calls.index(c) for c in
                                          [("module",), ("stream",), ("event",)]), calls
    assert calls[-2:] == [("open", b"0"), ("close", 500)], calls
    assert len(_ipc._KEPT) == kept + 1 and _ipc._KEPT.pop()[0].nbytes == 2 << 20


def test_an_aborted_communicators_peer_memory_is_never_freed():
    """An aborted communicator closes without meeting its peers, which may still map its buffers
    (and a late one signal into its flags): closing keeps them, so collecting the communicator
    frees nothing; a clean close still frees them after the meeting."""
    import gc
    import types
    from mxcomm.comm import _ipc
    from mxcomm.comm._communicator import Communicator
    from mxcomm.comm._pull import PullTransport
    calls = []
    for state, frees in (("aborted", []), ("open", ["flags", "staging"])):
        memory = _peer_memory_with_fakes(calls, lambda what: None)
        memory._status_memory, memory._done_addresses = "pinned status", "done addresses"
        side = types.SimpleNamespace(abandoned=False, free=lambda: None)
        comm = types.SimpleNamespace(_state=state, _side=side, _close_backend=lambda clean: None,
                                     _transport=PullTransport(None, memory))
        kept = len(_ipc._KEPT)
        calls.clear()
        Communicator.close(comm)
        assert comm._state == "closed"
        del comm, memory
        gc.collect()
        assert sorted(c[1] for c in calls if c[0] == "free") == frees, (state, calls)
        if state == "aborted":
            assert len(_ipc._KEPT) == kept + 1
            assert [getattr(b, "name", b) for b in _ipc._KEPT.pop()] == \
                ["staging", "flags", "pinned status", "done addresses"]
        else:
            assert len(_ipc._KEPT) == kept


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["nccl", "pull"])
def test_gpu_rank_killed_mid_call(path):
    """NCCL backend, 2 ranks: rank BAD is SIGKILLed between two dispatches: the job ends (mpiexec
    takes it down) or the survivor raises TimeoutError naming it, within the bound."""
    results, rc, wall, out = run_gpu_job(f"gpu_kill_{path}")
    assert wall < GPU_BOUND + 20, wall  # + the job's start (CUDA, NCCL) on two GPUs
    survivor = results.get(1 - BAD)
    if survivor is not None and survivor[0] != "none":
        exc, seconds, msg = survivor
        assert exc == "TimeoutError" and f"rank {BAD}" in msg, (exc, msg)
        assert seconds < GPU_BOUND + 5, seconds
    else:
        assert survivor is None, survivor  # it returned rows of a dead peer
