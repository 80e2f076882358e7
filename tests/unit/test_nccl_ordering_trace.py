"""Issue order and stream dependencies of the NCCL path, as a recorded trace, on every rank.

These are tests of ORDERING LOGIC, NOT transport tests: each rank runs the real
``NcclCommunicator`` (bootstrapped over real MPI, 2 or 4 ranks) with a
:class:`~commopt.comm.stream_trace.StreamTrace` in place of torch.cuda's streams and
events. The trace records which event is recorded on which stream, which stream waits on
which event, what is enqueued where, from which host thread, in which order; no kernel runs
and no byte moves (the results of the collectives are not checked here: tests/gpu does).
"""

import json
import threading
import types

import pytest
import torch

from tests.multirank import run_mpi

# Every rank: node "n<rank // 2>", so 4 ranks are 2 nodes x 2 ranks (hierarchical plans).
SCRIPT = r"""
import json, os, sys, threading
rank = int(os.environ["OMPI_COMM_WORLD_RANK"])
os.environ["COMMOPT_NODE_NAME"] = f"n{rank // 2}"
import torch, commopt
from commopt import collectives
from commopt.collectives.choice import choose_algorithm
from commopt.comm.nccl import NcclCommunicator
from commopt.comm.stream_trace import StreamTrace
from commopt.comm.mpi.transport import live_mpi_communicators

out = {}

def run(name, body):
    trace = StreamTrace()
    threads0, comms0 = threading.active_count(), live_mpi_communicators()
    comm = NcclCommunicator(_streams=trace)
    info = body(comm, trace) or {}
    comm.finalize()
    info["threads_grew"] = threading.active_count() - threads0
    info["mpi_comms_grew"] = live_mpi_communicators() - comms0
    out[name] = {"ops": [list(map(str, op)) for op in trace.ops], "lines": trace.lines(), **info}

def plain(comm, trace):
    side = trace.new_stream(None)
    t = torch.ones(1000)
    with trace.use(side):
        work = collectives.allreduce(comm, t, None, algorithm="native", async_op=True)
        work.wait()
    return {"side": side.name}

def hierarchical(comm, trace):
    flat = torch.ones(1031)
    algo = choose_algorithm(comm, None)
    collectives.allreduce(comm, flat, None, algorithm="hierarchical")
    return {"auto": algo, "node_names": comm.node_names}

def pipelined(comm, trace):
    from commopt.codecs import get_codec
    codec = get_codec("qsgd8")
    # no byte moves in a trace: the receive buffers hold whatever was there, which a decoder
    # rightly refuses as a corrupted wire; the order of the calls is what is recorded
    codec.decode = codec.decode_scaled = lambda *args, **kwargs: None
    flat = torch.randn(4096)
    collectives.allreduce(comm, flat, codec, algorithm="scatter_reduce",
                          piece_bytes=4096, async_op=True).wait()
    return {}

def native_cast(comm, trace):
    # which stream is current when the native plan encodes its wire buffer
    from commopt.codecs import get_codec
    codec = get_codec("fp16")
    seen, encode = [], codec.encode
    def recording(*args, **kwargs):
        seen.append(trace.current(None).name)
        return encode(*args, **kwargs)
    codec.encode = recording
    collectives.allreduce(comm, torch.randn(1000), codec, algorithm="native", async_op=True).wait()
    return {"encode_streams": seen}

def training(double_buffering):
    def body(comm, trace):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64), torch.nn.Linear(64, 4))
        opt = commopt.create_multi_node_optimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), comm, model=model, bucket_cap_mb=0.01,
            double_buffering=double_buffering, algorithm="native")
        mark = len(trace.ops)
        for _ in range(3):
            opt.zero_grad()
            model(torch.ones(2, 64)).sum().backward()
            opt.step()
        opt.flush() if double_buffering else None
        return {"same_comm": opt._data_comm is comm, "mark": mark, "buckets": len(opt.buckets)}
    return body

def host_reads(double_buffering, scaled_and_clipped=False, mixed=False):
    # training steps with the host reads and waits recorded, the phases marked
    # (scaled_and_clipped: clip_grad_norm= and GradScaler's tensor scale, as GradScaler
    # hands it to a double-buffered step; mixed: compensated with the default rule's
    # synchronous 1-D tensors, a plan of each schedule)
    def body(comm, trace):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64), torch.nn.Linear(64, 4))
        opt = commopt.create_multi_node_optimizer(
            torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), comm, model=model,
            bucket_cap_mb=0.01, double_buffering=double_buffering, algorithm="native",
            clip_grad_norm=0.5 if scaled_and_clipped else None, synchronous_vectors=mixed)
        assert len(opt.plans) == (2 if mixed else 1), list(opt.plans)
        with trace.host_reads():
            for _ in range(4):
                opt.zero_grad()
                trace.mark("forward")
                model(torch.ones(2, 64)).sum().backward()
                trace.mark("backward-end")
                if scaled_and_clipped:
                    opt.grad_scale, opt.found_inf = torch.tensor(4.0), torch.tensor(0.0)
                opt.step()
                trace.mark("step-end")
            trace.mark("done")
        if double_buffering:
            opt.flush()
        return {}
    return body

run("plain", plain)
run("native_cast", native_cast)
run("reads_overlap", host_reads(False))
run("reads_double_buffering", host_reads("stale"))
run("reads_compensated", host_reads("compensated"))
run("reads_compensated_scaled_clipped", host_reads("compensated", scaled_and_clipped=True))
run("reads_compensated_mixed", host_reads("compensated", mixed=True))
run("pipelined", pipelined)
run("overlap", training(False))
run("double_buffering", training("stale"))
if int(os.environ["OMPI_COMM_WORLD_SIZE"]) == 4:
    run("hierarchical", hierarchical)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def traces():
    """Each rank's traces of every scenario (one mpirun of 4 ranks, 2 nodes x 2)."""
    return [json.loads(line.strip().splitlines()[-1]) for line in run_mpi(SCRIPT, 4, timeout=240)]


def enqueues(scenario):
    return [(op[2], op[3]) for op in scenario["ops"] if op[0] == "enqueue"]


def test_caller_stream_recorded_then_comm_stream_waits_then_enqueue(traces):
    """Finding 2: the caller's *current* stream (a side stream here) is recorded on the
    calling thread before the communication stream waits on it and the collective is
    enqueued; the caller's stream then waits on the collective's event. A host worker
    thread would see its own current stream (default:0) instead."""
    for rank, t in enumerate(traces):
        sc = t["plain"]
        ops, side = sc["ops"], sc["side"]
        assert {op[1] for op in ops} == {"MainThread"}, f"rank {rank}: issued from {ops}"
        first = next(i for i, op in enumerate(ops) if op[0] == "record")
        assert ops[first][3] == side, (
            f"rank {rank}: first record not on the caller's stream:\n" + "\n".join(sc["lines"])
        )
        event = ops[first][2]
        comm_wait = next(i for i, op in enumerate(ops) if op[0] == "wait" and op[3] == event)
        comm_stream = ops[comm_wait][2]
        assert comm_stream != side
        enq = next(i for i, op in enumerate(ops) if op[0] == "enqueue")
        assert first < comm_wait < enq and ops[enq][2] == comm_stream, f"rank {rank}"
        back = next(i for i, op in enumerate(ops) if i > enq and op[0] == "wait")
        assert ops[back][2] == side, f"rank {rank}: Work.wait() did not order the caller's stream"
        done = max(
            i for i, op in enumerate(ops[:back]) if op[0] == "record" and op[3] == comm_stream
        )
        assert done > enq and ops[back][3] == ops[done][2], f"rank {rank}: waited on {ops[back]}"


def test_pipelined_scatter_reduce_issues_in_the_documented_order_on_one_stream(traces):
    """The codec pipeline (scatter 0, scatter 1, gather 0, scatter 2, gather 1, ...) is
    enqueued by the calling thread on the communication stream, with the stream current for
    the codec work in between; one wait, at issue, and no other stream involved."""
    for rank, t in enumerate(traces):
        sc = t["pipelined"]
        enq = enqueues(sc)
        kinds = [w for _, w in enq]
        pieces = kinds.count("alltoall")
        assert pieces >= 3 and kinds.count("allGather") == pieces, f"rank {rank}: {kinds}"
        want = ["alltoall", "alltoall"]
        for k in range(pieces):
            want.append("allGather")
            if k + 2 < pieces:
                want.append("alltoall")
        assert kinds == want, f"rank {rank}: {kinds}"
        stream = enq[0][0]
        assert {s for s, _ in enq} == {stream}
        ops = sc["ops"]
        use = next(i for i, op in enumerate(ops) if op[0] == "use" and op[2] == stream)
        end = next(i for i, op in enumerate(ops) if op[0] == "end-use" and op[2] == stream)
        assert all(use < i < end for i, op in enumerate(ops) if op[0] == "enqueue"), f"rank {rank}"
        assert len([op for op in ops if op[0] == "wait" and op[2] == stream]) == 1
        assert {op[1] for op in ops} == {"MainThread"}
    assert len({tuple(enqueues(t["pipelined"])) for t in traces}) == 1


@pytest.mark.parametrize("scenario", ["overlap", "double_buffering"])
def test_gradient_traffic_one_communicator_one_stream_same_order(traces, scenario):
    """Finding 3: the optimizer reduces on the user's communicator (no second NCCL
    communicator); every NCCL call is enqueued from the calling thread on one stream, in
    the same order on every rank, each issue after the caller's stream was recorded."""
    orders = []
    for rank, t in enumerate(traces):
        sc = t[scenario]
        assert sc["same_comm"], f"rank {rank}: the optimizer split a private communicator"
        ops = sc["ops"]
        assert {op[1] for op in ops} == {"MainThread"}, f"rank {rank}: a host thread issued"
        assert len([op for op in ops if op[0] == "nccl-init"]) == 1, f"rank {rank}"
        enq = enqueues(sc)
        assert len({s for s, _ in enq}) == 1, f"rank {rank}: NCCL calls on several streams {enq}"
        stream = enq[0][0]
        steps = list(enq[len([1 for op in ops[: sc["mark"]] if op[0] == "enqueue"]) :])
        assert len(steps) >= 3 * sc["buckets"], f"rank {rank}: {steps}"
        # Every wait of the comm stream is on an event of the caller's (default) stream,
        # recorded just before by the same thread.
        for i, op in enumerate(ops):
            if op[0] == "wait" and op[2] == stream:
                rec = next(o for o in reversed(ops[:i]) if o[0] == "record" and o[2] == op[3])
                assert rec[3] == "default:0", f"rank {rank}: comm stream waited on {rec}"
        orders.append(enq)
    assert all(o == orders[0] for o in orders), "ranks enqueue NCCL calls in different orders"


def test_hierarchical_plan_is_chosen_and_stays_on_one_stream(traces):
    """Finding 1: node names are known, so auto picks hierarchical on 2 nodes x 2; the
    intra- and inter-node communicators enqueue on the parent's one stream, in order
    alltoall (intra) -> allReduce (inter) -> allGather (intra), the same on every rank."""
    for rank, t in enumerate(traces):
        sc = t["hierarchical"]
        assert sc["auto"] == "hierarchical", f"rank {rank}: auto chose {sc['auto']}"
        assert sc["node_names"] == ["n0", "n0", "n1", "n1"]
        enq = enqueues(sc)
        assert [w for _, w in enq] == ["alltoall", "allReduce", "allGather"], f"rank {rank}: {enq}"
        assert len({s for s, _ in enq}) == 1, f"rank {rank}: {enq}"
        waits = [op for op in sc["ops"] if op[0] == "wait" and op[2] == enq[0][0]]
        assert len(waits) == 1, f"rank {rank}: the plan's stages crossed streams: {waits}"


@pytest.mark.parametrize(
    "scenario", ["plain", "pipelined", "overlap", "double_buffering", "hierarchical"]
)
def test_finalize_destroys_every_nccl_communicator_and_thread(traces, scenario):
    """Finding 4: finalize() destroys every NCCL communicator it (and its splits) created and
    leaves no thread behind (the bootstrap MPI communicators' workers included)."""
    for rank, t in enumerate(traces):
        sc = t[scenario]
        inits = [op[2] for op in sc["ops"] if op[0] == "nccl-init"]
        destroyed = [op[2] for op in sc["ops"] if op[0] == "nccl-destroy"]
        assert inits and sorted(inits) == sorted(destroyed), f"rank {rank}: {inits} vs {destroyed}"
        assert sc["threads_grew"] <= 0, f"rank {rank}: {sc['threads_grew']} thread(s) left"
        assert sc["mpi_comms_grew"] == 0, (
            f"rank {rank}: {sc['mpi_comms_grew']} MPI communicator(s) left"
        )


# -- in-process checks of the CUDA staging (ordering logic and buffer kinds, no GPU) ---------


def test_cuda_ready_records_on_the_tensors_device():
    """Finding 6: with cuda:0 current, a tensor on cuda:1 is waited for on cuda:1's stream."""
    from commopt.comm.mpi.transport import ready_after_producers
    from commopt.comm.stream_trace import StreamTrace

    trace = StreamTrace()
    trace.set_device(0)
    wait = ready_after_producers([torch.device("cuda", 1), torch.device("cuda", 1)], streams=trace)
    assert trace.of("record") == [("e1", "default:1")]
    worker = threading.Thread(target=wait)
    worker.start()
    worker.join()
    assert trace.of("synchronize") == [("e1",)]


def test_cuda_aware_tensors_reach_mpi_without_numpy():
    """Finding 5: a device tensor (meta here, standing for CUDA) is handed to MPI as a tensor
    view of the same words (mpi4py reads __cuda_array_interface__), never via .numpy()."""
    from commopt.comm.mpi.runtime import numpy_view
    from commopt.comm.mpi.transport import MPICommunicator

    t = torch.empty(8, dtype=torch.bfloat16, device="meta")
    view = numpy_view(t)
    assert (
        isinstance(view, torch.Tensor) and view.dtype == torch.int16 and view.device.type == "meta"
    )
    assert numpy_view(t, as_bytes=True).dtype == torch.uint8
    me = types.SimpleNamespace(cuda_aware=True)
    host, back = MPICommunicator._host(me, t, fill=True)
    assert host is t and back is None


def test_cuda_aware_detection_asks_the_mpi_library(monkeypatch):
    """Finding 5: without MPI.Query_cuda_support (mpi4py 4.1.2) the answer is the library's
    MPIX_Query_cuda_support, which agrees with ompi_info; the variable overrides it."""
    import importlib.util
    import shutil
    import subprocess

    pytest.importorskip("mpi4py")
    # Found, not imported: importing mpi4py.MPI would start MPI in pytest's own process.
    spec = importlib.util.find_spec("mpi4py.MPI")
    assert spec is not None and spec.origin
    from commopt.comm.mpi.transport import CUDA_AWARE_ENV, detect_cuda_aware

    monkeypatch.delenv(CUDA_AWARE_ENV, raising=False)
    bare = types.SimpleNamespace(__file__=spec.origin)  # an mpi4py without the query
    found = detect_cuda_aware(bare)
    assert isinstance(found, bool)
    if shutil.which("ompi_info"):
        info = subprocess.run(
            ["ompi_info", "--parsable", "--all"], capture_output=True, text=True
        ).stdout
        built = (
            "mpi_built_with_cuda_support:value:true" in info
            or "opal_built_with_cuda_support:value:true" in info
        )
        assert found == built
    monkeypatch.setenv(CUDA_AWARE_ENV, "1")
    assert detect_cuda_aware(bare) is True
    monkeypatch.setenv(CUDA_AWARE_ENV, "maybe")
    with pytest.raises(ValueError, match=CUDA_AWARE_ENV):
        detect_cuda_aware(bare)


def test_driver_runs_stream_ordered_jobs_inline():
    """The driver gives a stream-ordered communicator no worker thread: the job runs at once,
    on the calling thread, with the communication stream current after the caller's."""
    from commopt import driver
    from commopt.comm.stream_trace import StreamTrace

    trace = StreamTrace()
    comm_stream = trace.new_stream(None)

    class StreamOrdered:  # what the driver reads of a stream-ordered communicator
        stream_ordered, size, streams = True, 4, trace

        def codec_stream(self, device=None):
            return comm_stream

    comm = StreamOrdered()
    seen = []
    work = driver.submit(
        comm, lambda: seen.append((threading.current_thread().name, trace.current(None).name))
    )
    assert seen == [("MainThread", comm_stream.name)]
    assert [op for op, *_ in trace.ops] == ["record", "wait", "use", "end-use", "record"]
    work.wait()
    assert trace.ops[-1][0] == "wait" and trace.ops[-1][2] == "default:0"


def host_waits(ops, start, end):
    """Host reads of device values and host waits on events between marks ``start`` and ``end``."""
    found, inside = [], False
    for i, op in enumerate(ops):
        if op[0] == "mark":
            inside = {start: True, end: False, "done": False}.get(op[2], inside)
        elif inside and op[0] in ("host-read", "synchronize"):
            found.append((i, *op))
    return found


@pytest.mark.parametrize(
    "scenario",
    [
        "reads_double_buffering",
        "reads_compensated",
        "reads_compensated_scaled_clipped",
        "reads_compensated_mixed",
    ],
)
def test_double_buffering_never_waits_on_the_host_while_a_reduction_is_in_flight(traces, scenario):
    """With double buffering step t's reduction must run during step t+1's forward and
    backward: no host read of a device value and no host wait from the end of step() to
    the end of the next backward. Inside step(), the previous step's flags may be waited
    for (that reduction had a whole forward and backward to finish), but only before the
    new reduction's first NCCL call: issuing reads nothing. In a mixed plan the synchronous
    part's result (its reduction ran during backward) is waited for in step() too, but only
    once the double-buffered part is issued: after the first host wait nothing is enqueued."""
    mixed = scenario.endswith("_mixed")
    for rank, t in enumerate(traces):
        ops = t[scenario]["ops"]
        between = host_waits(ops, "step-end", "backward-end")
        assert not between, f"rank {rank}: host waits outside step(): {between}"
        steps, start = [], 0
        for i, op in enumerate(ops):
            if op[0] == "mark" and op[2] == "backward-end":
                start = i
            elif op[0] == "mark" and op[2] == "step-end":
                steps.append((start, i))
        assert len(steps) == 4, f"rank {rank}"
        for lo, hi in steps:
            window = ops[lo:hi]
            first_enqueue = next(
                (k for k, op in enumerate(window) if op[0] == "enqueue"), len(window)
            )
            late = [
                k
                for k, op in enumerate(window)
                if k > first_enqueue and op[0] in ("host-read", "synchronize")
            ]
            if mixed:
                assert late, f"rank {rank}: the synchronous part's result was not read in step()"
                issued_after = [op for op in window[late[0] :] if op[0] == "enqueue"]
                assert not issued_after, (
                    f"rank {rank}: step() waited on the host before issuing {issued_after}"
                )
            else:
                waits = [window[k] for k in late]
                assert not late, f"rank {rank}: step() waited on the host while issuing: {waits}"


def test_overlap_never_waits_on_the_host_inside_backward(traces):
    """With overlap, buckets go out during backward: nothing inside the backward (the final
    callback included) reads a device value or waits on the host; the agreed result is read
    in step(), where it is needed."""
    for rank, t in enumerate(traces):
        ops = t["reads_overlap"]["ops"]
        inside = host_waits(ops, "forward", "backward-end")
        assert not inside, f"rank {rank}: host waits inside backward: {inside}"
        assert host_waits(ops, "backward-end", "step-end"), f"rank {rank}: step() read nothing"


def test_native_plan_encodes_on_the_communicator_stream(traces):
    """The native plan of a cast codec allocates and encodes its wire buffer on the
    communicator's stream, where the transfer and the decode read it: a buffer allocated on
    the caller's stream and freed there could be handed to the caller's next allocation by
    the caching allocator while the communicator's stream still reads it."""
    for rank, t in enumerate(traces):
        sc = t["native_cast"]
        enq = enqueues(sc)
        assert [w for _, w in enq] == ["allReduce"], f"rank {rank}: {enq}"
        assert sc["encode_streams"] == [enq[0][0]], (
            f"rank {rank}: encoded on {sc['encode_streams']}"
        )
