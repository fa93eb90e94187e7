"""
Asynchronous rollout (rollout_gpus > 0): the last torchrun ranks only generate while the others only train.
Trainer rank 0 asks for gen batches ahead (prompt indices from its sampler, sampling params, the policy
version, that version's weights if the generators hold older ones); each generator generates and scores its
share and sends it back, in the order asked. train_dapo.py's loop takes them where the colocated loop
generates (gen_batches); this file holds both sides of the exchange: RolloutQueue (the trainer ranks) and
serve_rollouts (a generator rank).
"""
import contextlib
import functools
from dataclasses import dataclass

import parallel
import reward
from parallel import StopFlag, StopRequested, Watchdog
from rollout import GenerationStopped, SamplingParams, Trajectories, concat_trajectories, generate_share, timed


@dataclass
class Request:
    """One gen batch asked of the generators (None stops them)."""
    indices: list[int]  # prompt indices into the train (or val) prompts
    params: SamplingParams
    version: int  # the policy version that generates it
    val: bool = False
    weights: bool = False  # that version's weights follow (parallel.broadcast_buckets)


STOPPED = "stopped"  # a generator's reply to a request it dropped for a stop signal


def watchdog_for(waited_for: str, cfg, log, stop: StopFlag | None = None) -> Watchdog:
    """A Watchdog with the config's watchdog_log_s and watchdog_timeout_s."""
    return Watchdog(waited_for, cfg.watchdog_log_s, cfg.watchdog_timeout_s, log, stop)


class RolloutQueue:
    """The trainer ranks' side. pending: gen batches asked and not yet trained on, oldest first, each with the
    sampler state from before its prompts were drawn (a checkpoint saves the oldest's, so a resumed run
    asks again for them) and the replies received so far, one per generator."""

    def __init__(self, run, cfg, version: int, params: SamplingParams):
        self.run, self.cfg, self.params, self.pending, self.sends = run, cfg, params, [], []
        self.generators = range(run.dims.world_size, run.dims.world_size + cfg.rollout_gpus)
        # the generators' weights version: model_path's at a fresh start
        self.held = 0 if version == 0 else None
        self.asked = (version, 0)  # (version, gen batches asked with it): their seeds

    def ask(self, indices: list[int], params: SamplingParams, version: int, timing: dict,
            sampler_state: dict | None, val: bool = False) -> dict:
        """Rank 0 sends a request, then (when the generators hold older weights) the trainer ranks gather the
        full weights and rank 0 broadcasts them to the generators, which load them before generating.
        -> its entry"""
        dims = self.run.dims
        req = Request(indices, params, version, val, weights=self.held != version)
        if dims.is_main:
            self.sends = [w for w in self.sends if not w.is_completed()]
            for g in self.generators:
                self.sends += parallel.send_object(req, g)
        if req.weights:
            ranks = ", ".join(map(str, self.generators))
            watchdog = watchdog_for(f"generator rank(s) {ranks} to take the weights", self.cfg, self.run.log)
            guard = watchdog.guarding(parallel.EXIT_RUN_FAILED, on_timeout=self.run.scorer.kill)
            with timed("weight_transfer", timing), guard:
                buckets = parallel.iter_full_weights(self.run.model, self.cfg.weight_sync_bucket_mb * 2**20,
                                                     dtype=self.run.compute_dtype)
                if dims.is_main:
                    sent = parallel.broadcast_buckets(buckets, dims.rollout_group, dims.device)
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
        """Rank 0: receive replies until every generator's reply to entry is in. A generator answers in the
        order asked, so its next reply belongs to the oldest entry still without one from it. The watchdog
        says who is waited for; with `stop`, a stop signal ends the wait (StopRequested)."""
        for g in self.generators:
            while g not in entry["replies"]:
                oldest = next(e for e in self.pending if g not in e["replies"])
                watchdog = watchdog_for(f"generator rank {g}", self.cfg, self.run.log, stop)
                oldest["replies"][g] = parallel.recv_object(g, poll=watchdog)

    def take(self, entry: dict, timing: dict) -> tuple[Trajectories, dict]:
        """Wait for entry's gen batch and drop it from pending -> (trajectories, reward counts) on every
        trainer rank. StopRequested on every trainer rank when rank 0 got a stop signal while waiting or a
        generator dropped the gen batch for one."""
        with timed("gen_wait", timing):
            replies = STOPPED
            if self.run.dims.is_main:
                with contextlib.suppress(StopRequested):
                    self.receive(entry, stop=self.run.stop)
                    replies = [entry["replies"][g] for g in self.generators]
            replies = parallel.all_gather_objects(replies, self.run.dims)[0]  # rank 0's
        if replies == STOPPED or any(r == STOPPED for r in replies):
            raise StopRequested
        self.pending.remove(entry)
        for k, v in replies[0][2].items():  # the first generator's gen and reward times
            timing[k] = timing.get(k, 0.0) + v
        traj = concat_trajectories([t for t, _, _ in replies if len(t)], self.cfg.max_response_length)
        return traj, {k: sum(c[k] for _, c, _ in replies) for k in replies[0][1]}

    def close(self):
        """Stop the generators after the gen batches still asked (received and dropped), wait for every send,
        forget what was pending."""
        if self.run.dims.is_main:
            for g in self.generators:
                self.sends += parallel.send_object(None, g)
            for e in self.pending:
                self.receive(e, stop=None)
            for w in self.sends:
                w.wait()
        self.generators, self.sends, self.pending = (), [], []


def gen_batches_ahead(cfg, step: int, total_steps: int) -> int:
    """Gen batches to have asked for while `step` trains: max_staleness (each step takes at least the oldest,
    so none is older than that when trained on), but none still out at a checkpoint, which a resumed run would
    have to generate again with newer weights than the uninterrupted run used."""
    if cfg.save_freq <= 0:
        checkpoint = total_steps
    else:
        checkpoint = min(total_steps, -(-step // cfg.save_freq) * cfg.save_freq)
    return min(cfg.max_staleness, checkpoint - step)


def serve_rollouts(run, cfg):
    """A generator rank: until told to stop, take the next request from trainer rank 0, load the weights that
    come with it (between gen batches, never during one), generate and score this rank's share and send it
    back. After a stop signal it answers STOPPED without generating; trainer rank 0 decides the stop."""
    dims, sends = run.dims, []
    run.stop = StopFlag(lambda msg: None)

    def log(msg: str):  # the first generator speaks for all of them
        if dims.rank == dims.world_size:
            print(f"generator rank {dims.rank}: {msg}", flush=True)

    waiting = functools.partial(watchdog_for, "trainer rank 0 (its next request)", cfg, log)
    while (req := parallel.recv_object(0, poll=waiting())) is not None:
        if req.weights:  # taken even when stopping: the broadcast is collective
            watchdog = watchdog_for("trainer rank 0 to send the weights", cfg, log)
            with watchdog.guarding(parallel.EXIT_RUN_FAILED, on_timeout=run.scorer.kill):
                run.engine.load_weights(parallel.broadcast_buckets(None, dims.rollout_group, dims.device),
                                        req.version)
        reply = STOPPED
        if not run.stop.signalled():
            timing = {}
            try:
                traj, counts = generate_share(
                    run, cfg, [(run.val_prompts if req.val else run.train_prompts)[i] for i in req.indices],
                    req.params, dims.rank - dims.world_size, cfg.rollout_gpus, version=req.version,
                    group_offset=0, timing=timing)
                reply = (traj, counts, timing)
            except (GenerationStopped, reward.ScoringStopped):
                pass
        sends = [w for w in sends if not w.is_completed()] + parallel.send_object(reply, 0)
    for w in sends:
        w.wait()
    run.scorer.close()
    run.stop.restore()
    parallel.shutdown()
