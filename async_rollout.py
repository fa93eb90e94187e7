"""
Asynchronous rollout (rollout_gpus > 0): the last torchrun ranks only generate while the others only train.
Trainer rank 0 asks for gen batches ahead (prompt indices from its sampler, sampling params, the policy
version, that version's weights if the generators hold older ones); each generator engine (the built-in
engine on one rank, or vLLM over gen_tp ranks) generates and scores its share and sends it back, in the order
asked. train_dapo.py's loop takes them where the colocated loop generates (gen_batches); this file holds both
sides of the exchange: RolloutQueue (the trainer ranks) and serve_rollouts (a generator rank).

Partial rollout (partial_rollout=True): newer weights do not wait for the gen batch in flight. A generator
looks for them before every decode step; when they come it stops, loads them, and the unfinished responses
continue from the tokens they have, so each token carries the version of the weights that sampled it.
"""
import collections
import contextlib
import datetime
import pickle
from dataclasses import dataclass

import torch
import torch.distributed as dist

import parallel
import reliability
import reward
from parallel import NOT_YET
from reliability import StopFlag, StopRequested, Watchdog
from rollout import GenerationStopped, SamplingParams
from trajectories import PEAK_GIB, Trajectories, concat_trajectories, generate_share, timed


class Bridge:
    """Trainer rank 0 (bridge rank 0) and the generator ranks (bridge ranks 1, 2, ...), which belong to
    different process groups (parallel.async_process_groups), on process groups of their own made from
    torchrun's store: objects over gloo, weights over NCCL on CUDA GPUs (elsewhere gloo, through host memory).
    Called through these methods, as c10d's functions only take groups of the default world."""

    @classmethod
    def connect(cls, dims, rollout_gpus: int, timeout_s: float) -> "Bridge":
        """This rank's end (trainer rank 0 or a generator)."""
        rank = 0 if dims.is_main else 1 + dims.rank - dims.world_size
        return cls(parallel.shared_store(), rank, 1 + rollout_gpus, dims.device,
                   datetime.timedelta(seconds=timeout_s))

    def __init__(self, store, rank: int, size: int, device: torch.device, timeout: datetime.timedelta):
        self.rank, self.size, self.device = rank, size, device
        self.objects = dist.ProcessGroupGloo(dist.PrefixStore("nanodapo/bridge", store), rank, size, timeout)
        self.weights = self.objects
        if device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.weights = dist.ProcessGroupNCCL(dist.PrefixStore("nanodapo/bridge_nccl", store), rank, size,
                                                 options)

    def send(self, obj, dst: int) -> list:
        """Send a picklable obj to bridge rank dst without waiting -> the work handles (wait on them)."""
        return parallel.send_object(obj, dst, group=self.objects)

    def recv(self, src: int, poll=None, poll_s: float = 0.1, wait: bool = True):
        """The next object bridge rank src sent; poll and wait as in parallel.receive (wait=False: NOT_YET
        until it has arrived)."""
        return parallel.recv_object(src, poll, poll_s, group=self.objects, wait=wait)

    def _broadcast(self, group, tensor):
        options = dist.BroadcastOptions()
        options.rootRank = 0
        group.broadcast([tensor], options).wait()

    def broadcast_buckets(self, buckets):
        """Buckets of (name, full tensor) from bridge rank 0, which passes them, to the other ranks, which
        pass None and iterate what this yields (per bucket: names and shapes, then one flat tensor). Every
        rank iterates."""
        is_src = buckets is not None
        it = iter(buckets or ())
        via_host = self.weights is self.objects  # gloo: the bytes travel through host memory
        while True:
            # the source sends the next bucket's (name, shape, dtype) list; an empty one means the end
            if is_src:
                bucket = next(it, [])
                meta = pickle.dumps([(n, t.shape, t.dtype) for n, t in bucket])
                data = torch.frombuffer(bytearray(meta), dtype=torch.uint8)
                size = torch.tensor([data.numel()])
            else:
                size = torch.zeros(1, dtype=torch.int64)
            self._broadcast(self.objects, size)
            if not is_src:
                data = torch.empty(int(size), dtype=torch.uint8)
            self._broadcast(self.objects, data)
            meta = pickle.loads(data.numpy().tobytes())
            if not meta:
                return
            sizes = [shape.numel() for _, shape, _ in meta]
            if is_src:
                flat = torch.cat([t.reshape(-1) for _, t in bucket])
            else:  # a buffer for the whole bucket, in its first tensor's dtype
                flat = torch.empty(sum(sizes), dtype=meta[0][2], device=self.device)
            if via_host:
                flat = flat.cpu()
            self._broadcast(self.weights, flat)
            if not is_src:
                yield [(n, t.view(shape)) for (n, shape, _), t in zip(meta, flat.split(sizes))]


@dataclass
class Request:
    """One gen batch asked of the generators (None stops them)."""
    indices: list[int]  # prompt indices into the train (or val) prompts
    params: SamplingParams
    version: int  # the policy version that generates it
    val: bool = False
    weights: bool = False  # that version's weights follow (Bridge.broadcast_buckets)


STOPPED = "stopped"  # a generator's reply to a request it dropped for a stop signal


def watchdog_for(waited_for: str, cfg, log, stop: StopFlag | None = None) -> Watchdog:
    """A Watchdog with the config's watchdog_log_s and watchdog_timeout_s."""
    return Watchdog(waited_for, cfg.watchdog_log_s, cfg.watchdog_timeout_s, log, stop)


class RolloutQueue:
    """The trainer ranks' side. pending: gen batches asked and not yet trained on, oldest first, each with the
    sampler state from before its prompts were drawn (a checkpoint saves the oldest's, so a resumed run
    asks again for them) and the replies received so far, one per generator engine."""

    def __init__(self, run, cfg, version: int, params: SamplingParams):
        self.run, self.cfg, self.params, self.pending, self.sends = run, cfg, params, [], []
        self.generators = range(1, 1 + cfg.rollout_gpus)  # bridge ranks; 0 is trainer rank 0
        self.engines = self.generators[::cfg.gen_tp]  # an engine's first rank replies for it
        self.held = None  # the generators' weights version: the first request brings weights
        self.asked = (version, 0)  # (version, gen batches asked with it): their seeds

    def rank_name(self, g: int) -> str:
        """A generator's torchrun rank, for messages."""
        return f"generator rank {self.run.dims.world_size + g - 1}"

    def ask(self, indices: list[int], params: SamplingParams, version: int, timing: dict,
            sampler_state: dict | None, val: bool = False) -> dict:
        """Rank 0 sends a request, then (when the generators hold older weights) the trainer ranks gather the
        full weights and rank 0 broadcasts them to the generators, which load them before generating (or,
        with partial rollout, at their next decode step). -> its entry"""
        dims = self.run.dims
        req = Request(indices, params, version, val, weights=self.held != version)
        if dims.is_main:
            self.sends = [w for w in self.sends if not w.is_completed()]
            for g in self.generators:
                self.sends += dims.bridge.send(req, g)
        if req.weights:
            names = ", ".join(self.rank_name(g) for g in self.generators)
            watchdog = watchdog_for(f"{names} to take the weights", self.cfg, self.run.log)
            guard = watchdog.guarding(reliability.EXIT_RUN_FAILED, on_timeout=self.run.scorer.kill)
            with timed("weight_transfer", timing), guard:
                buckets = parallel.iter_full_weights(self.run.model, self.cfg.weight_sync_bucket_mb * 2**20,
                                                     dtype=self.run.compute_dtype)
                if dims.is_main:
                    sent = dims.bridge.broadcast_buckets(buckets)
                else:
                    sent = buckets
                # rank 0 broadcasts; the other trainer ranks take part in gathering every bucket
                for _ in sent:
                    pass
            self.held = version
        self.pending.append({"request": req, "sampler_state": sampler_state, "replies": {}})
        return self.pending[-1]

    def ask_gen_batch(self, version: int, timing: dict):
        """Draw gen_batch_size prompts and ask for a gen batch of them with `version`'s weights."""
        r = self.asked[1] + 1 if self.asked[0] == version else 1
        self.asked = (version, r)
        state = self.run.sampler.state_dict()
        self.ask(self.run.sampler.next_indices(self.cfg.gen_batch_size),
                 SamplingParams(**{**self.params.__dict__, "seed": self.cfg.seed + 1000 * version + r}),
                 version, timing, state)

    def receive(self, entry: dict, stop: StopFlag | None):
        """Rank 0: receive replies until every engine's reply to entry is in. An engine answers in the order
        asked, so its next reply belongs to the oldest entry still without one from it. The watchdog says who
        is waited for; with `stop`, a stop signal ends the wait (StopRequested)."""
        for g in self.engines:
            while g not in entry["replies"]:
                oldest = next(e for e in self.pending if g not in e["replies"])
                watchdog = watchdog_for(self.rank_name(g), self.cfg, self.run.log, stop)
                oldest["replies"][g] = self.run.dims.bridge.recv(g, poll=watchdog)

    def take(self, entry: dict, timing: dict) -> tuple[Trajectories, dict]:
        """Wait for entry's gen batch and drop it from pending -> (trajectories, reward counts) on every
        trainer rank. StopRequested on every trainer rank when rank 0 got a stop signal while waiting or a
        generator dropped the gen batch for one."""
        with timed("gen_wait", timing):
            replies = STOPPED
            if self.run.dims.is_main:
                with contextlib.suppress(StopRequested):
                    self.receive(entry, stop=self.run.stop)
                    replies = [entry["replies"][g] for g in self.engines]
            replies = parallel.all_gather_objects(replies, self.run.dims)[0]  # rank 0's
        if replies == STOPPED or any(r == STOPPED for r in replies):
            raise StopRequested
        self.pending.remove(entry)
        for k, v in replies[0][2].items():  # the first engine's gen and reward times (its GPU's peaks are not ours)
            if k != PEAK_GIB:
                timing[k] = timing.get(k, 0.0) + v
        traj = concat_trajectories([t for t, _, _ in replies if len(t)], self.cfg.max_response_length)
        return traj, {k: sum(c[k] for _, c, _ in replies) for k in replies[0][1]}

    def close(self):
        """Stop the generators after the gen batches still asked (received and dropped), wait for every send,
        forget what was pending."""
        if self.run.dims.is_main:
            for g in self.generators:
                self.sends += self.run.dims.bridge.send(None, g)
            for e in self.pending:
                self.receive(e, stop=None)
            for w in self.sends:
                w.wait()
        self.generators, self.engines, self.sends, self.pending = (), (), [], []


def gen_batches_ahead(cfg, step: int, total_steps: int) -> int:
    """Gen batches to have asked for while `step` trains: max_staleness (each step takes at least the oldest,
    so none is older than that when trained on), but none still out at a checkpoint, which a resumed run would
    have to generate again with newer weights than the uninterrupted run used."""
    if cfg.save_freq <= 0:
        checkpoint = total_steps
    else:
        checkpoint = min(total_steps, -(-step // cfg.save_freq) * cfg.save_freq)
    return min(cfg.max_staleness, checkpoint - step)


class Inbox:
    """A generator rank's requests from trainer rank 0, in the order sent. Between requests it waits for the
    next; during one (partial rollout) it takes what has arrived without waiting, and a request that brings
    newer weights pauses the generation: requested() and resume() are generate_resumable's pause."""

    def __init__(self, run, cfg, log):
        self.run, self.cfg, self.log = run, cfg, log
        self.queue = collections.deque()  # received, not yet served; None: stop
        self.closed = False  # None has come: nothing follows

    def next(self) -> Request | None:
        """The next request to serve, its weights loaded (None: stop)."""
        if not self.queue:
            waiting = watchdog_for("trainer rank 0 (its next request)", self.cfg, self.log)
            self.queue.append(self.run.dims.bridge.recv(0, poll=waiting))
        req = self.queue.popleft()
        if req is not None and req.weights:
            self.load(req)
        return req

    def load(self, req: Request):
        """Take part in the broadcast of req's weights and load them (even when stopping: it is
        collective)."""
        watchdog = watchdog_for("trainer rank 0 to send the weights", self.cfg, self.log)
        with watchdog.guarding(reliability.EXIT_RUN_FAILED, on_timeout=self.run.scorer.kill):
            self.run.engine.load_weights(self.run.dims.bridge.broadcast_buckets(None), req.version)
        req.weights = False  # loaded: serving it later loads nothing

    def weights_waiting(self) -> bool:
        """Whether a request that brings weights has arrived (takes what has, without waiting)."""
        while not self.closed:
            req = self.run.dims.bridge.recv(0, wait=False)
            if req is NOT_YET:
                break
            self.queue.append(req)
            self.closed = req is None
        return any(r is not None and r.weights for r in self.queue)

    def requested(self) -> bool:
        """Pause now? Newer weights have arrived; the ranks of a vLLM engine agree (they step together)."""
        waiting = self.weights_waiting()
        group = self.run.dims.engine_group
        if group is None:
            return waiting
        flag = torch.tensor([int(waiting)])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return bool(flag.item())

    def resume(self) -> int:
        """Load the oldest weights that came (this rank waits for them if only another rank of its engine has
        them yet; one version per pause, so the engine's ranks stay in step) -> the version now held."""
        while not any(r is not None and r.weights for r in self.queue):
            waiting = watchdog_for("trainer rank 0 (weights another rank of this engine has)", self.cfg,
                                   self.log)
            req = self.run.dims.bridge.recv(0, poll=waiting)
            self.queue.append(req)
            self.closed = req is None
        self.load(next(r for r in self.queue if r is not None and r.weights))
        return self.run.engine.weights_version


def serve_rollouts(run, cfg):
    """A generator rank: until told to stop, take the next request from trainer rank 0, load the weights that
    come with it, generate and score this engine's share and (its first rank) send it back. Partial rollout:
    weights that come during a gen batch are loaded at the next decode step and the gen batch goes on with
    them; it is generated with the newest weights held, never older than the request's. After a stop signal
    it answers STOPPED without generating; trainer rank 0 decides the stop."""
    dims, sends = run.dims, []
    run.stop = StopFlag(lambda msg: None)
    generator = dims.rank - dims.world_size  # 0, 1, ... over the generator ranks
    engine, engines = generator // cfg.gen_tp, cfg.rollout_gpus // cfg.gen_tp
    replies = generator % cfg.gen_tp == 0  # the engine's other ranks hold copies

    def log(msg: str):  # the first generator speaks for all of them
        if generator == 0:
            print(f"generator rank {dims.rank}: {msg}", flush=True)

    inbox = Inbox(run, cfg, log)
    while (req := inbox.next()) is not None:
        reply = STOPPED
        if not run.stop.signalled():
            timing = {}
            try:
                prompts = [(run.val_prompts if req.val else run.train_prompts)[i] for i in req.indices]
                traj, counts = generate_share(
                    run.engine, run.tokenizer, run.scorer, prompts, req.params, cfg, engine_index=engine,
                    engines=engines, version=run.engine.weights_version, group_offset=0, timing=timing,
                    should_stop=run.stop.signalled, pause=inbox if cfg.partial_rollout else None)
                reply = (traj, counts, timing)
            except (GenerationStopped, reward.ScoringStopped):
                pass
        if replies:
            sends = [w for w in sends if not w.is_completed()] + dims.bridge.send(reply, 0)
    for w in sends:
        w.wait()
    run.scorer.close()
    run.stop.restore()
    parallel.shutdown()
