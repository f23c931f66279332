"""One traced step's forward or backward as a timeline, from a torch.profiler (Kineto) chrome
trace, for ``profile_step.py --trace``: when each device operation was launched by the host and
when it ran, which stream it ran on, and where the device stood idle and why.

An operation that starts within ``HOST_LAG_US`` of its launch call's return found the device
waiting for the host: the idle time before it is the host's. One launched long before it ran
waited for the work before it on its stream, an event of another stream, or (the pull transport's
``cuStreamWaitValue``) a peer's signal: idle time before it is a wait. The host's blocking calls
(stream, event and device synchronizations) are listed with their durations."""

HOST_LAG_US = 15.0
_GPU = ("kernel", "gpu_memcpy", "gpu_memset")
_API = ("cuda_runtime", "cuda_driver")


def timeline(events, phase="forward", width=48, listed=80):
    """Lines describing the last ``phase`` annotation (``"forward"`` or ``"backward"``) in
    ``events`` (the trace's ``traceEvents``): per stage the host's span and the device's, the
    device operations launched in it (from any thread: autograd's too) in start order, the idle
    gaps by cause, and the host's synchronizations."""
    fwd = [e for e in events if e.get("cat") == "user_annotation" and e.get("name") == phase]
    if not fwd:
        return [f"(no {phase} annotation in the trace)"]
    f = fwd[-1]
    t0, t1 = f["ts"], f["ts"] + f["dur"]
    stages = sorted((e for e in events if e.get("cat") == "user_annotation"
                     and e.get("name", "").startswith("stage:") and t0 <= e["ts"] <= t1),
                    key=lambda e: e["ts"])
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in _API and "correlation" in e.get("args", {})}
    syncs = [e for e in events if e.get("cat") in _API and "ynchronize" in e.get("name", "")
             and t0 <= e["ts"] <= t1]
    ops, every = [], []  # the phase's device operations; every one of the trace
    for e in events:
        if e.get("cat") not in _GPU:
            continue
        launch = launches.get(e.get("args", {}).get("correlation"))
        op = (e["ts"], e["ts"] + e["dur"], e["args"].get("stream", "?"), e["name"],
              launch["ts"] if launch else e["ts"], launch["ts"] + launch["dur"] if launch
              else e["ts"])
        every.append(op)
        if launch is not None and t0 <= launch["ts"] <= t1:
            ops.append(op)
    ops.sort()
    every.sort()
    if not ops:
        return [f"(no device operation launched in the {phase})"]
    end = max(op[1] for op in ops)
    lines = [f"{phase}: host {f['dur']:.0f} us, device (host start to last op's end) "
             f"{end - t0:.0f} us, {len(ops)} device operations"]
    lines.append("  stage            host begin..end us   device ops  first start..last end us  "
                 "busy us")
    for s in stages:
        a, b = s["ts"], s["ts"] + s["dur"]
        mine = [op for op in ops if a <= op[4] <= b]
        busy = _union([(op[0], op[1]) for op in mine])
        first = min((op[0] for op in mine), default=a) - t0
        last = max((op[1] for op in mine), default=a) - t0
        lines.append(f"  {s['name'][6:]:16s} {a - t0:8.0f}..{b - t0:<8.0f}  {len(mine):10d}  "
                     f"{first:10.0f}..{last:<10.0f}  {busy:7.0f}")
    # idle gaps of the device (every stream together) between the forward's start and its end
    idle = {"host": 0.0, "wait": 0.0}
    gaps, at = [], t0
    for op in ops:
        if op[0] > at:
            cause = "host" if op[0] - op[5] < HOST_LAG_US else "wait"
            idle[cause] += op[0] - at
            gaps.append((op[0] - at, at - t0, cause, op[3]))
        at = max(at, op[1])
    lines.append(f"  device idle: {idle['host']:.0f} us waiting for the host, {idle['wait']:.0f} "
                 f"us waiting on a stream, event or peer")
    for dur, when, cause, name in sorted(gaps, reverse=True)[:8]:
        lines.append(f"    {dur:7.0f} us at {when:7.0f} ({cause}) before {name[:width]}")
    for s in syncs:
        lines.append(f"  host blocked in {s['name']} at {s['ts'] - t0:.0f} us for "
                     f"{s['dur']:.0f} us")
    lines += _waits(ops, every, t0, width)
    lines.append("  start us    dur  stream  launched us  lag us  operation")
    for op in ops[:listed]:
        lines.append(f"  {op[0] - t0:8.0f} {op[1] - op[0]:6.0f} {str(op[2]):>7s} "
                     f"{op[4] - t0:11.0f} {op[0] - op[5]:7.0f}  {op[3][:width]}")
    if len(ops) > listed:
        lines.append(f"  ... {len(ops) - listed} more")
    return lines


def _waits(ops, every, t0, width, listed=12):
    """Which stream waited on which: each of ``ops`` that started more than ``HOST_LAG_US`` after
    its launch returned and after the end of the work before it on its stream (any of ``every``,
    the trace's operations: an earlier phase's too), with the operation of another stream that
    ended last before it started (what it most likely waited for: an event, a stream wait, or a
    peer's signal behind that work)."""
    lines = []
    for begin, end, stream, name, _, launched in ops:
        ready = max([launched] + [op[1] for op in every if op[2] == stream and op[0] < begin])
        if begin - ready > HOST_LAG_US:
            before = [op for op in every if op[2] != stream and op[1] <= begin]
            cause = max(before, key=lambda op: op[1]) if before else None
            after = f"stream {cause[2]}'s {cause[3][:width]} (ended at {cause[1] - t0:.0f})" \
                if cause is not None else "nothing on another stream (a peer)"
            lines.append(f"    {begin - ready:7.0f} us at {begin - t0:7.0f}: stream {stream}'s "
                         f"{name[:width]} after {after}")
    head = [f"  waits on another stream, an event or a peer: {len(lines)}"]
    return head + lines[:listed] + ([f"    ... {len(lines) - listed} more"]
                                    if len(lines) > listed else [])


def _union(intervals):
    """The total length covered by ``intervals`` [(begin, end), ...]."""
    total, at = 0.0, None
    for a, b in sorted(intervals):
        if at is None or a > at:
            total += b - a
            at = b
        elif b > at:
            total += b - at
            at = b
    return total
