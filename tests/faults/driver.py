"""One fault-injection case per MPI job: ``mpiexec -n W python tests/faults/driver.py CASE``.

Each rank prints one line ``RESULT rank=R exc=TYPE t=SECONDS msg=MESSAGE`` (exc=none when it
returned normally); tests/test_faults.py launches the job and asserts on those lines. The
communicator's timeout is TIMEOUT s, so a survivor must finish within TIMEOUT plus some slack.
"""

import os
import sys
import time

import numpy

import mxcomm
from mxcomm import comm as mxc
from mxcomm._array import bfloat16
from mxcomm.a2a import a2a_dispatch
from mxcomm.layout import exchange_layout

TIMEOUT = 2.0
E_LOCAL = 2
D = 32
BAD = 1  # the rank that misbehaves
#: Cases whose rank BAD raises at once while its peers wait: it stays alive as the others time
#: out (mpiexec ends the job when a rank exits).
STAY = {"rows_before_first_layout", "foreign_layout_first"}


def layout_counts(comm, fill=2, dtype=numpy.int32):
    return numpy.full(comm.size * E_LOCAL, fill, dtype)


def case_layout_length(comm):
    n = comm.size * E_LOCAL + (1 if comm.rank == BAD else 0)
    exchange_layout(numpy.full(n, 2, numpy.int32), comm)


def case_layout_float(comm):
    exchange_layout(layout_counts(comm, dtype=numpy.float32 if comm.rank == BAD else numpy.int32), comm)


def case_layout_negative(comm):
    c = layout_counts(comm)
    if comm.rank == BAD:
        c[0] = -1
    exchange_layout(c, comm)


def case_layout_none(comm):
    exchange_layout(None if comm.rank == BAD else layout_counts(comm), comm)


def case_layout_list(comm):
    c = layout_counts(comm)
    exchange_layout(c.tolist() if comm.rank == BAD else c, comm)


def case_layout_after_timeout(comm):
    """Rank BAD raises before a layout exchange; the others time out in it, then call
    exchange_layout again: refused at once (RuntimeError), no second wait."""
    if comm.rank == BAD:
        raise KeyError("injected before the layout exchange")
    try:
        exchange_layout(layout_counts(comm), comm)
    except TimeoutError:
        pass
    else:
        raise AssertionError("the first layout exchange did not time out")
    exchange_layout(layout_counts(comm), comm)


def case_layout_2e33(comm):
    c = layout_counts(comm, dtype=numpy.int64)
    if comm.rank == BAD:
        c[0] = 2 ** 33
    exchange_layout(c, comm)


def _rows(n):
    return numpy.ones((n, D), bfloat16)


def case_raise_before_explicit(comm):
    splits = [1] * comm.size
    if comm.rank == BAD:
        raise KeyError("injected before the collective")
    a2a_dispatch(_rows(comm.size), splits, splits, comm)


def _layout(comm):
    layout = exchange_layout(layout_counts(comm), comm)
    a2a_dispatch(_rows(layout.num_rows), layout)  # everybody once: the staging is in place
    return layout


def case_raise_before_layout(comm):
    layout = _layout(comm)
    if comm.rank == BAD:
        raise KeyError("injected before the collective")
    a2a_dispatch(_rows(layout.num_rows), layout)


def case_raise_before_first_layout(comm):
    """Rank BAD raises before the first layout-based dispatch (the one that sets up the peer
    memory): the others must not wait in the unbounded shared-window allocation."""
    layout = exchange_layout(layout_counts(comm), comm)
    if comm.rank == BAD:
        raise KeyError("injected before the first dispatch")
    a2a_dispatch(_rows(layout.num_rows), layout)


def case_rows_before_first_layout(comm):
    """A wrong row count on rank BAD in the first layout-based dispatch: a local ValueError
    there, a TimeoutError naming it on the others."""
    layout = exchange_layout(layout_counts(comm), comm)
    a2a_dispatch(_rows(layout.num_rows + (1 if comm.rank == BAD else 0)), layout)


def case_foreign_layout_first(comm):
    """Rank BAD passes a layout of another communicator to its first layout-based dispatch."""
    other = mxc.init(group=comm.group, timeout=TIMEOUT)  # over the same ranks (MPI, or gloo)
    layout = exchange_layout(layout_counts(comm), comm)
    theirs = exchange_layout(layout_counts(other), other)
    a2a_dispatch(_rows(layout.num_rows), theirs if comm.rank == BAD else layout)


def case_exit_before_layout(comm):
    layout = _layout(comm)
    if comm.rank == BAD:
        sys.stdout.flush()
        os._exit(3)
    a2a_dispatch(_rows(layout.num_rows), layout)


def case_kill_before_layout(comm):
    layout = _layout(comm)
    if comm.rank == BAD:
        sys.stdout.flush()
        os.kill(os.getpid(), 9)
    a2a_dispatch(_rows(layout.num_rows), layout)


def _die_in_pulls(comm, how):
    """On rank BAD, end the process (or raise) in the transport's first wait for a peer: after its
    own fills are signalled, before it pulls."""
    from mxcomm.comm._shm import HostPeerMemory
    if comm.rank != BAD:
        return

    def await_ready(self, *args):
        sys.stdout.flush()
        if how == "raise":
            raise KeyError("injected in the middle of the exchange")
        if how == "kill":
            os.kill(os.getpid(), 9)
        if how == "sigint":
            os.kill(os.getpid(), 2)
            time.sleep(1)  # the KeyboardInterrupt comes at the next bytecode
        os._exit(3)
    HostPeerMemory.await_ready = await_ready


def _mid(comm, how, direction):
    from mxcomm.a2a import a2a_combine
    layout = _layout(comm)
    received = a2a_dispatch(_rows(layout.num_rows), layout, precision="bf16")
    if direction == "dispatch":
        _die_in_pulls(comm, how)
        # the survivors' rows were staged before rank BAD stopped, so their first call may
        # complete; the next one waits for BAD to finish reading their staging, and times out
        for _ in range(2):
            a2a_dispatch(_rows(layout.num_rows), layout)
    else:  # the combine: rank BAD stops before it
        if comm.rank == BAD:
            _die_in_pulls(comm, how)
            HostPeerMemory_await(comm)
        for _ in range(2):
            a2a_combine(received, layout)


def HostPeerMemory_await(comm):
    from mxcomm.comm._shm import HostPeerMemory
    HostPeerMemory.await_ready(None, ((0, 0, 0),), 0)


def case_raise_mid_dispatch(comm):
    _mid(comm, "raise", "dispatch")


def case_exit_mid_dispatch(comm):
    _mid(comm, "exit", "dispatch")


def case_kill_mid_dispatch(comm):
    _mid(comm, "kill", "dispatch")


def case_sigint_mid_dispatch(comm):
    _mid(comm, "sigint", "dispatch")


def case_raise_mid_combine(comm):
    _mid(comm, "raise", "combine")


def case_kill_mid_combine(comm):
    _mid(comm, "kill", "combine")


def case_exit_before_explicit(comm):
    splits = [1] * comm.size
    if comm.rank == BAD:
        sys.stdout.flush()
        os._exit(3)
    a2a_dispatch(_rows(comm.size), splits, splits, comm)


def case_precision_mismatch(comm):
    splits = [1] * comm.size
    a2a_dispatch(_rows(comm.size), splits, splits, comm,
                 precision="bf16" if comm.rank == BAD else "mxfp8")


def case_dim_mismatch(comm):
    splits = [1] * comm.size
    x = numpy.ones((comm.size, 2 * D if comm.rank == BAD else D), bfloat16)
    a2a_dispatch(x, splits, splits, comm)


def case_torch_tensor(comm):
    import torch
    splits = [1] * comm.size
    a2a_dispatch(torch.ones(comm.size, D, dtype=torch.bfloat16), splits, splits, comm)


def case_native_dtype_mix(comm):
    """precision="native" on the layout path: fp32 rows on rank BAD, bf16 on the others."""
    layout = exchange_layout(layout_counts(comm), comm)
    x = numpy.ones((layout.num_rows, D), numpy.float32 if comm.rank == BAD else bfloat16)
    a2a_dispatch(x, layout, precision="native")


def case_dim_mix_layout(comm):
    """bf16 rows of D = 64 on rank BAD, 32 on the others, on the layout path."""
    layout = exchange_layout(layout_counts(comm), comm)
    a2a_dispatch(numpy.ones((layout.num_rows, 2 * D if comm.rank == BAD else D), bfloat16),
                 layout, precision="bf16")


def case_precision_mix_layout(comm):
    """precision "bf16" on rank BAD, "mxfp8" on the others, on the layout path."""
    layout = exchange_layout(layout_counts(comm), comm)
    a2a_dispatch(_rows(layout.num_rows), layout,
                 precision="bf16" if comm.rank == BAD else "mxfp8")


def case_stale_layout(comm):
    """Rank BAD dispatches with the step's first layout, the others with the second."""
    first = exchange_layout(layout_counts(comm), comm)
    second = exchange_layout(layout_counts(comm, fill=3), comm)
    layout = first if comm.rank == BAD else second
    a2a_dispatch(_rows(layout.num_rows), layout, precision="bf16")


def _fail_second(comm, call):
    """Three same-shape calls ``call(rows)``; rank BAD's second has one row too many, fails its
    local check (raised at once on it alone), and rank BAD goes on to the third: its third must
    not pair with the others' second unnoticed. Returns the third call's result."""
    call(0)
    if comm.rank == BAD:
        try:
            call(1)
        except ValueError:
            pass
    else:
        call(0)
    return call(0)


def case_fail_one_of_three_layout(comm):
    layout = exchange_layout(layout_counts(comm), comm)
    _fail_second(comm, lambda extra: a2a_dispatch(_rows(layout.num_rows + extra), layout,
                                                 precision="bf16"))


def case_fail_one_of_three_pull(comm):
    """As fail_one_of_three_layout, MXFP8 rows: MPI pulls them from peer memory (the call tag
    in the ready words), gloo moves them in one alltoallv (the host layout check)."""
    layout = exchange_layout(layout_counts(comm), comm)
    _fail_second(comm, lambda extra: a2a_dispatch(_rows(layout.num_rows + extra), layout))


def case_stale_layout_pull(comm):
    """Rank BAD dispatches MXFP8 rows with the step's first layout, the others with the second,
    of the same counts: only the layouts' numbers tell the calls apart."""
    first = exchange_layout(layout_counts(comm), comm)
    second = exchange_layout(layout_counts(comm), comm)
    layout = first if comm.rank == BAD else second
    a2a_dispatch(_rows(layout.num_rows), layout)


def case_fail_one_of_three_torch(comm):
    """As fail_one_of_three_layout through ``mxcomm.torch`` (bf16 tensors): the calls that fit
    take the adapters' direct path, rank BAD's bad one the engine; both count the call."""
    import torch
    import mxcomm.torch as mt
    layout = mt.exchange_layout(torch.from_numpy(layout_counts(comm)), comm)
    _fail_second(comm, lambda extra: mt.a2a_dispatch(
        torch.ones(layout.num_rows + extra, D, dtype=torch.bfloat16), layout, precision="bf16"))


def case_fail_after_vote_explicit(comm):
    """Explicit splits, bf16: rank BAD's second of three calls passes its vote, then fails
    before its rows move (a ValueError injected there, alone), and BAD goes on to the third.
    Its third call's vote cannot pair with the peers' second call's rows (the vote is a host
    round of its own), so no call is mis-paired: every rank times out, none returns rows."""
    splits = [1] * comm.size
    if comm.rank == BAD:
        move, calls = comm._move_rows, []

        def fail_second(*args):
            calls.append(1)
            if len(calls) == 2:
                raise ValueError("injected after the vote, before the rows move")
            return move(*args)
        comm._move_rows = fail_second
    _fail_second(comm, lambda extra: a2a_dispatch(_rows(comm.size), splits, splits, comm,
                                                 precision="bf16"))


def case_late_rank(comm):
    """Rank BAD comes to a layout-based dispatch 1 s after its peers timed out in it: it must
    raise at once naming a peer that gave up (itself late), not time out blaming them."""
    layout = _layout(comm)
    if comm.rank == BAD:
        time.sleep(TIMEOUT + 1)
    a2a_dispatch(_rows(layout.num_rows), layout)


# ---------------------------------------------------------------------- on GPUs (2 ranks)
# ``gpu_<case>_<path>``: the NCCL backend; path "nccl" moves bf16 rows in one NCCL group, "pull"
# MXFP8 rows over CUDA IPC (the pull transport). Every call is followed by ``comm.wait``, where a
# device-side failure surfaces.
GPU_TIMEOUT = 10.0  # the NCCL bootstrap is bounded by it too


def _gpu_dispatch(comm, layout, path):
    import cupy
    x = cupy.asarray(_rows(layout.num_rows))
    out = a2a_dispatch(x, layout, precision="bf16" if path == "nccl" else "mxfp8")
    comm.wait()
    return out


def _gpu_layout(comm):
    import cupy
    return exchange_layout(cupy.asarray(layout_counts(comm)), comm)


def _gpu_raise_first(comm, path):
    layout = _gpu_layout(comm)
    if comm.rank == BAD:
        raise KeyError("injected before the first dispatch")
    _gpu_dispatch(comm, layout, path)


def _gpu_skip(comm, path):
    """Three same-shape dispatches; rank BAD skips the second."""
    layout = _gpu_layout(comm)
    for i in range(3):
        if comm.rank == BAD and i == 1:
            continue
        _gpu_dispatch(comm, layout, path)


def _gpu_kill(comm, path):
    """Rank BAD is SIGKILLed after the first dispatch, before the second."""
    layout = _gpu_layout(comm)
    _gpu_dispatch(comm, layout, path)
    if comm.rank == BAD:
        sys.stdout.flush()
        os.kill(os.getpid(), 9)
    _gpu_dispatch(comm, layout, path)


def _gpu_fail_one_of_three(comm, path):
    """Three same-shape dispatches; rank BAD's second has one row too many (a local ValueError,
    at once) and it goes on to the third, which pairs with the other's second: every rank's
    ``wait`` must raise the mis-pairing (the call tag: NCCL's header, the pull's ready words),
    and the results of the mis-paired call hold 0xFF bytes, filled on the device: the message
    says whether they do ("results all 0xFF: True")."""
    import cupy
    from mxcomm.a2a import a2a_dispatch_backward
    layout = _gpu_layout(comm)
    plan = layout.combine_plan
    for i in range(3):
        extra = 1 if comm.rank == BAD and i == 1 else 0
        try:
            if path == "dequant":  # MXFP8 pulled, dequantized where it lands (in place)
                x = cupy.asarray(_rows(plan.rows_sent + extra))
                out = a2a_dispatch_backward(x, layout, precision="mxfp8")
            else:
                x = cupy.asarray(_rows(layout.num_rows + extra))
                out = a2a_dispatch(x, layout, precision="bf16" if path == "nccl" else "mxfp8")
        except ValueError:
            if extra:
                continue
            raise
        try:
            comm.wait()
        except RuntimeError as exc:
            if path == "dequant":  # the peer's rows (this rank's own may stay: kept beside)
                peer = 1 - comm.rank
                at = plan.recv_offsets[peer]
                arrays = (out[at:at + plan.recv_counts[peer]],)
            else:
                arrays = (out.data, out.scales) if hasattr(out, "scales") else (out,)
            poisoned = all(bool((a.view(cupy.uint8) == 0xFF).all()) for a in arrays)
            raise RuntimeError(f"{exc} [results all 0xFF: {poisoned}]") from None


def _gpu_native_mix(comm, path):
    """precision="native" over NCCL on the layout path: fp32 rows on rank BAD, bf16 on the
    other. The bf16 rank's group completes (it receives fewer bytes than BAD sends): its header
    check fails at once. BAD expects more bytes than come: its group stalls, and its timeout
    reads the headers that arrived: both raise RuntimeError naming the other and both dtypes."""
    import cupy
    layout = _gpu_layout(comm)
    x = cupy.asarray(numpy.ones((layout.num_rows, D),
                                numpy.float32 if comm.rank == BAD else bfloat16))
    a2a_dispatch(x, layout, precision="native")
    comm.wait()


for _path in ("nccl", "pull"):
    for _name, _case in (("raise_first", _gpu_raise_first), ("skip", _gpu_skip),
                         ("kill", _gpu_kill), ("fail_one_of_three", _gpu_fail_one_of_three),
                         ("native_mix", _gpu_native_mix)):
        globals()[f"case_gpu_{_name}_{_path}"] = \
            lambda comm, _case=_case, _path=_path: _case(comm, _path)


def case_gpu_fail_one_of_three_dequant(comm):
    _gpu_fail_one_of_three(comm, "dequant")


def case_stuck_at_exit(comm):
    """Rank BAD is stuck (sleeps far past the timeout) before the first dispatch; the others'
    TimeoutError goes uncaught (main lets it through): they must exit at once, not wait in
    MPI_Finalize for the stuck rank."""
    layout = exchange_layout(layout_counts(comm), comm)
    if comm.rank == BAD:
        time.sleep(60)
    a2a_dispatch(_rows(layout.num_rows), layout)


def case_stuck_caught_exit(comm):
    """As stuck_at_exit, but the others catch their TimeoutError and end as a program does
    (main returns): MPI finalizes, bounded by the communicator's timeout."""
    case_stuck_at_exit(comm)


def case_abort_then_finalize(comm):
    """Every rank aborts its communicator, then ends as a program does (main returns): no peer
    is stuck, so MPI finalizes at once and the job's status stays 0."""
    comm.abort()


#: Cases whose exceptions main prints and lets through, to test the process's exit.
UNCAUGHT = {"stuck_at_exit"}
#: Cases after which main returns (MPI finalizes at exit) instead of ending the process: on
#: every rank but BAD (stuck), or on every rank.
FINALIZE = {"stuck_caught_exit", "abort_then_finalize"}
FINALIZE_ALL = {"abort_then_finalize"}


def main():
    case = sys.argv[1]
    if case.startswith("gpu_"):
        comm = mxc.init("nccl", timeout=GPU_TIMEOUT, small_exchange_bytes=0,
                        medium_exchange_bytes=0)
    else:
        comm = mxc.init(timeout=TIMEOUT)
    if case in ("torch_tensor", "fail_one_of_three_torch"):
        import torch  # noqa: F401 (imported before the clock starts)
        import mxcomm.torch  # noqa: F401
    t0 = time.perf_counter()
    try:
        globals()["case_" + case](comm)
        exc, msg = "none", ""
    except Exception as e:  # reported, not swallowed: the test asserts on it
        exc, msg = type(e).__name__, " ".join(str(e).split())
        if case in UNCAUGHT:
            print(f"RESULT rank={comm.rank} exc={exc} t={time.perf_counter() - t0:.2f} "
                  f"msg={msg}", flush=True)
            raise
    print(f"RESULT rank={comm.rank} exc={exc} t={time.perf_counter() - t0:.2f} msg={msg}",
          flush=True)
    if case not in FINALIZE:
        # Stay alive while the peers time out, since mpiexec ends the job when a rank exits:
        # every rank, until every rank has printed its line (FAULTS_DIR: the test's folder, where
        # each leaves a file once it printed), or until TIMEOUT + 4 s after the start (longer
        # than the test's bound on them, TIMEOUT + SLACK). One that exited at once took a peer
        # whose clock started a moment later with it, before that peer printed: seen at 3 ranks
        # on a loaded 2-core CI machine.
        folder = os.environ.get("FAULTS_DIR")
        deadline = t0 + (1.25 * comm.timeout + 5 if case.startswith("gpu_") else TIMEOUT + 4)
        if folder:
            open(os.path.join(folder, str(comm.rank)), "w").close()
            while len(os.listdir(folder)) < comm.size and time.perf_counter() < deadline:
                time.sleep(0.02)
            time.sleep(0.2)  # the last line on its way through mpiexec
        elif exc in ("KeyError", "TimeoutError", "RuntimeError") or \
                (comm.rank == BAD and case in STAY):
            time.sleep(max(0.0, deadline - time.perf_counter()))
    if case in FINALIZE and (comm.rank != BAD or case in FINALIZE_ALL):
        return
    os._exit(0)  # no finalize handshake with a peer that may be gone


if __name__ == "__main__":
    main()
