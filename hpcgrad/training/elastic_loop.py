"""ElasticLoop: the training loop (Note [One training loop]) whose epochs survive lost ranks.

Note [Elastic training loop]
    ``ElasticLoop`` is ``Loop`` with its epochs run inside ``elastic.run`` (Note [Elastic run]):
    a job (jobs/train_ddp.py --elastic) hands it an ``elastic.State`` instead of a model, and
    gets the same resume, checkpoints, metrics, preemption and epoch lines, plus:

    - the data come from the state's ``ElasticSampler``, whose place in the epoch the loop
      records after each step; an epoch has as many steps as that sampler deals to the current
      world (fewer once ranks are lost), so no step index is skipped on a resume: the sampler's
      place, saved in the checkpoint, is where the epoch goes on, at any number of ranks. A
      job without a sampler (jobs/train_gpt.py: the step number draws the data) has a fixed
      number of steps per epoch, and a restored commit skips those of its epoch already done;
    - ``state.commit()`` every ``commit_every`` steps and at each epoch's end (in memory),
      with a copy of what the job adds to a checkpoint (``Job.checkpoint_state``: a learning
      rate scheduler, say), which ``Job.restore`` takes back after a change;
    - on a lost rank the survivors restore the newest commit they all hold and go on; the
      loop then takes its step and epoch from the state, its rank and world size from the new
      world, the model from ``state.ddp`` (a DDP over the survivors), and calls the job's
      ``world_changed(state, change)`` (its evaluation shards, its own DDP handle). The new
      world's rank 0 takes over rank 0's roles: the metrics log (reopened where the old rank
      0 left it), the epoch lines, the checkpoints and the PREEMPTED marker;
    - below ``min_size`` ranks the survivors save a checkpoint of the restored commit, leave
      PREEMPTED and end with status 75 (``SHRUNK``, EX_TEMPFAIL), so a requeue resumes the run
      on a whole allocation (slurm/train_ddp_elastic.sbatch);
    - rank 0 of the last world writes the job's exit status to <checkpoint-dir>/exit_status
      when the loop ends (trained, stopped, too small, or nothing to train): Open MPI's mpirun
      returns a dead rank's status even when every survivor finished, and 0 when its runtime
      killed every rank after losing a node's daemon, so a batch script reads the survivors'
      verdict there, and its absence after a status of 0 means the ranks were ended.

    Steps done after the restored commit are done again, so metrics.jsonl holds their lines
    twice (the later line is the one that counted, as after a resume).
"""

import copy
import os
import sys

from hpcgrad import collectives as dist
from hpcgrad import elastic
from hpcgrad.training.loop import PREEMPTED, Loop, say, stopped_line
from hpcgrad.training.metrics import MetricsLog

SHRUNK = 75  # EX_TEMPFAIL: the world shrank below min_size; checkpoint saved, requeue to go on
STATUS_FILE = "exit_status"
_FINISHED = "finished"  # the epochs ran to the end (None from elastic.run: this rank left)


class ElasticLoop(Loop):
    """``Loop`` over ``state`` (an elastic.State holding the model, optimizer and an
    ElasticSampler, or no sampler) that survives lost ranks (Note [Elastic training loop]).

    ``min_size``: fewest ranks to go on with; ``commit_every``: steps between in-memory
    commits (each costs a copy of the model and optimizer state; the steps since the last one
    are what a lost rank costs). The job's model is ``state.ddp``."""

    def __init__(self, job, args, state, checkpoints=None, min_size=1, commit_every=10):
        super().__init__(job, args, state.ddp, state.optimizer, len(job.batches(0)),
                         checkpoints)
        self.state, self.min_size, self.commit_every = state, int(min_size), int(commit_every)
        self.sampler = state.sampler  # an ElasticSampler, or None: fixed steps per epoch
        self._job_commits = {}  # the state's commit serial -> the job's checkpoint_state

    def _commit(self):
        """``state.commit()`` with a copy of the job's own state beside it."""
        self.state.commit()
        serials = self.state.commits()
        self._job_commits[serials[-1]] = copy.deepcopy(self.job.checkpoint_state())
        for serial in list(self._job_commits):
            if serial not in serials:
                del self._job_commits[serial]

    def _restored(self):
        """After the state restored a commit: the loop's place, and the job's own state."""
        state = self.state
        self.step, self.epoch = state.step, state.epoch
        self.skip = 0 if self.sampler is not None else \
            self.step - self.epoch * self.steps_per_epoch
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.model = state.ddp  # collective: every survivor builds it here
        saved = self._job_commits.get(state.commits()[-1])
        if saved:
            self.job.restore(copy.deepcopy(saved))

    # --- the sampler's place in the epoch, in the checkpoint -----------------------------
    def _place(self, epoch):
        sampler = self.sampler
        if sampler is None:
            return {}
        processed = sampler.processed if sampler.epoch == epoch else 0  # else: epoch's end
        return {"sampler_epoch": epoch, "sampler_processed": processed}

    def resume(self):
        going = super().resume()
        if going and self.args.resume and self.sampler is not None:
            meta = self.resumed_meta
            self.state.sampler.load_state_dict(
                {"epoch": int(meta.get("sampler_epoch", self.epoch)),
                 "processed": int(meta.get("sampler_processed", 0))})
            self.skip = 0  # the sampler deals only the rest of the epoch
        self.state.step, self.state.epoch = self.step, self.epoch
        return going

    def _batches(self, epoch):
        if self.sampler is None:
            return super()._batches(epoch)
        batches = self.job.batches(epoch)  # sets the sampler's epoch: its rest, dealt
        return batches, len(batches)

    def _stepped(self, count):
        if self.sampler is not None:
            self.sampler.record_batch(count)
        self.state.step = self.step
        if self.commit_every and self.step % self.commit_every == 0:
            self._commit()

    # --- the epochs inside elastic.run -------------------------------------------------
    def _train(self):
        self._commit()  # the first commit (elastic.run would make one without the job's state)
        train = elastic.run(self._train_state, min_size=self.min_size, on_change=self._changed)
        try:
            status = train(self.state)
        except elastic.WorldTooSmallError as error:
            status = self._too_small(error)
        if status is None:  # this rank left by plan (state.leave): the rest go on without it
            self.left = True
            return 0
        return None if status is _FINISHED else status

    def run(self):
        status = super().run()
        if not getattr(self, "left", False):
            self._write_status(status)
        return status

    def _train_state(self, state):
        self.step, self.epoch = state.step, state.epoch
        status = Loop._train(self)
        return _FINISHED if status is None else status

    def _epoch(self, epoch):
        status = super()._epoch(epoch)
        if status is None:  # the epoch's end is saved; remember it in memory too
            self.state.epoch, self.state.step = epoch + 1, self.step
            self._commit()
        return status

    def _changed(self, change):
        """On every survivor, after the world changed: the loop and job follow the new world."""
        was_zero = self.rank == 0
        self._restored()
        pending = getattr(self.preemption, "_pending", None)
        if pending is not None:  # LatePreemption's agreement was posted on the old world
            self.preemption._pending = None
        self.job.world_changed(self.state, change)
        if self.rank == 0 and not was_zero:  # rank 0's roles come here
            self.metrics.close()
            self.metrics = MetricsLog(self.args.checkpoint_dir, 0,
                                      tensorboard=self.args.tensorboard,
                                      purge_step=self.step or None)
        if self.progress is not None:
            self.progress.n = self.step
            self.progress.refresh()
        lost = ", ".join(map(str, change.lost)) or "none"
        going = (f"going on from step {change.restored_step}"
                 if change.new_size >= self.min_size else f"below --min-ranks {self.min_size}")
        say(f"world changed: {change.old_size} -> {change.new_size} ranks (lost world rank(s) "
            f"{lost}); {going} (recovery {change.seconds:.3f} s)")

    def _too_small(self, error):
        """Below min_size: checkpoint the restored commit, leave PREEMPTED, status SHRUNK."""
        self._restored()
        sampler = self.sampler
        self.save(self.epoch, self.skip if sampler is None else
                  int(sampler.epoch == self.epoch and sampler.processed > 0))
        if self.rank == 0:
            open(os.path.join(self.args.checkpoint_dir, PREEMPTED), "w").close()
            print(f"{stopped_line(self.step, self.checkpoints.path, 0).strip()}\n"
                  f"the world shrank to {self.world} ranks, below --min-ranks "
                  f"{self.min_size} ({error.change}); exit status {SHRUNK}: requeue the job "
                  f"to go on with a whole allocation", file=sys.stdout, flush=True)
        return SHRUNK

    def _write_status(self, status):
        """Rank 0 of the last world: the survivors' exit status, for the batch script."""
        if self.rank == 0:
            path = os.path.join(self.args.checkpoint_dir, STATUS_FILE)
            with open(path + ".tmp", "w") as out:
                out.write(f"{status or 0}\n")
            os.replace(path + ".tmp", path)
