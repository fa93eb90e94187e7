"""Specification of bench.common.peak_breakdown: replay a CUDA memory history (torch.cuda.memory._snapshot()'s
format) to the peak of allocated bytes and sum what is live there by allocation site."""
import os

from bench.common import NO_FRAMES, RESIDENT, ROOT, allocation_label, peak_breakdown

MODEL = os.path.join(ROOT, "model.py")
TRAIN = os.path.join(ROOT, "train_dapo.py")
ADAMW = "/site-packages/torch/optim/adamw.py"
CKPT = "/site-packages/torch/utils/checkpoint.py"


def frame(filename, name, line):
    return {"filename": filename, "name": name, "line": line}


def ev(action, addr, size, frames=()):
    return {"action": action, "addr": addr, "size": size, "stream": 0, "frames": list(frames)}


def block(addr, size, state="active_allocated"):
    return {"address": addr, "size": size, "requested_size": size, "state": state, "frames": []}


def test_allocation_label():
    fwd = frame(MODEL, "forward", 612)
    assert allocation_label([frame("/torch/nn/functional.py", "linear", 1), fwd]) == "model.py:forward:612"
    assert allocation_label([frame(ADAMW, "_single_tensor_adamw", 9), frame(TRAIN, "update_policy", 50)]) == \
        "train_dapo.py:update_policy:50 [optimizer]"
    # the innermost kind wins; the checkpoint's backward-side functions mark a recompute
    assert allocation_label([fwd, frame(CKPT, "recompute_fn", 1), frame(CKPT, "unpack_hook", 2)]) == \
        "model.py:forward:612 [checkpoint recompute]"
    assert allocation_label([fwd, frame(CKPT, "checkpoint", 3)]) == "model.py:forward:612 [checkpoint]"
    assert allocation_label([frame("/tmp/torchinductor_u/ab/cab.py", "call", 7)]) == "compiled"
    assert allocation_label([]) == NO_FRAMES
    # a model.py outside this repository is not ours
    assert allocation_label([frame("/site-packages/other/model.py", "forward", 3)]) == "other"


def test_peak_breakdown_by_hand():
    fwd10, fwd12 = [frame(MODEL, "forward", 10)], [frame(MODEL, "forward", 12)]
    opt = [frame(ADAMW, "adamw", 1), frame(TRAIN, "update_policy", 50)]
    trace = [ev("segment_alloc", 0, 1 << 20),
             ev("free_requested", 200, 500), ev("free_completed", 200, 500),  # resident 1800 -> 1300
             ev("alloc", 900, 250, fwd12), ev("free_requested", 900, 250),  # 1550, still allocated: another stream
             ev("alloc", 400, 2000, fwd10),  # 3550
             ev("alloc", 500, 700, opt),  # 4250
             ev("alloc", 600, 100),  # 4350: the peak, event 7
             ev("free_requested", 400, 2000), ev("free_completed", 400, 2000),  # 2350
             ev("alloc", 700, 1500, [frame("/lib/x.py", "f", 1)]),  # 3850
             ev("free_requested", 300, 300), ev("free_completed", 300, 300),  # 3550: a resident one, after the peak
             ev("alloc", 800, 50)]  # 3600
    # the state at the end: 100 (never in the trace) is resident; 400 is a cached, free block
    blocks = [block(100, 1000), block(400, 2000, "inactive"), block(500, 700), block(600, 100), block(700, 1500),
              block(800, 50), block(900, 250, "active_awaiting_free")]
    snap = {"segments": [{"device": 0, "address": 0, "total_size": 1 << 20, "blocks": blocks}],
            "device_traces": [trace]}
    out = peak_breakdown(snap)
    assert out["peak_bytes"] == 4350 and out["peak_event"] == 7 and out["events"] == len(trace)
    assert out["resident_bytes"] == 1000 + 300  # 200 was freed before the peak
    assert out["by_label"] == {"model.py:forward:10": 2000, RESIDENT: 1300, "train_dapo.py:update_policy:50 "
                               "[optimizer]": 700, "model.py:forward:12": 250, NO_FRAMES: 100}
    assert list(out["by_label"]) == ["model.py:forward:10", RESIDENT, "train_dapo.py:update_policy:50 [optimizer]",
                                     "model.py:forward:12", NO_FRAMES]
    assert sum(out["by_label"].values()) == out["peak_bytes"]


def test_peak_breakdown_no_growth_is_the_resident_state():
    trace = [ev("free_completed", 20, 40), ev("alloc", 10, 5), ev("free_completed", 10, 5)]  # 100 -> 60 -> 65
    snap = {"segments": [{"device": 0, "blocks": [block(30, 60)]}], "device_traces": [trace]}
    out = peak_breakdown(snap)
    assert out == {"peak_bytes": 100, "resident_bytes": 100, "peak_event": -1, "events": 3,
                   "by_label": {RESIDENT: 100}}
