"""The RL driver: runs the job's steps by dispatching model-stage tasks through the control plane.

One step (DESIGN.md, "One RL step"): generation → inference (old/reference log-probs, values,
reward-model scores) → advantages on the driver → training (actor, critic) → weight sync from
each training model-stage to the other model-stages of its role. Tasks of model-stages on
disjoint devices are submitted together and overlap; tasks on shared devices run in
submission order on each worker. The driver holds the batch and hands each DP replica a
contiguous share.

Asynchronous execution (``rollout.max_staleness = s ≥ 1``; one-step off-policy at ``s = 1``, as
in AReaL and Laminar, paper §2/§4.2): at the start of step ``k`` the driver submits the
generation of step ``k + s`` before it trains step ``k``, so generation on its own devices
overlaps inference and training of earlier rollouts. Every rollout carries the *policy version*
it was generated with — the number of weight synchronisations before its generation was
submitted — and since each worker runs its tasks in submission order, that version is
deterministic: step ``k`` trains on a rollout of version ``max(0, k − s)``, staleness ≤ ``s``.
The weight synchronisation at the end of a step runs on the generation devices after every
generation submitted before it, so when it returns no generation is running: that is the
asynchronous safe boundary (DESIGN.md vocabulary); rollouts already generated keep their version.
``s = 0`` is the synchronous step.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from nereusd.workflow import Algorithm
from nereusd.daemon.control_plane import ControlPlane
from nereusd.errors import TrainingDiverged, WorkerError
from nereusd import protocol as P
from nereusd.config.resolve import ResolvedJob
from nereusd.journal import Event, Journal
from nereusd.plan import Candidate, ModelStage, Plan, Role, Stage
from nereusd.rl import advantages as adv
from nereusd.rl.checkpointing import DriverCheckpoints
from nereusd.rl.record import StepRecord
from nereusd.rl.rollout import RolloutBatch, as_lists, mean_of, split_even
from nereusd.tasks import PromptSampler, get_task
from nereusd.transition import sync_dag_args, weight_sync_dags
from nereusd.transition.runner import slowest_by_stage

log = logging.getLogger(__name__)

ACTOR_GEN = ModelStage(Role.ACTOR, Stage.GENERATION)
ACTOR_INF = ModelStage(Role.ACTOR, Stage.INFERENCE)
ACTOR_TRAIN = ModelStage(Role.ACTOR, Stage.TRAINING)
REF_INF = ModelStage(Role.REFERENCE, Stage.INFERENCE)
CRITIC_INF = ModelStage(Role.CRITIC, Stage.INFERENCE)
CRITIC_TRAIN = ModelStage(Role.CRITIC, Stage.TRAINING)
REWARD_INF = ModelStage(Role.REWARD, Stage.INFERENCE)


def derived_seed(*parts: int) -> int:
    """A 31-bit seed from integers (stable across processes and Python versions)."""
    digest = hashlib.sha256(",".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


@dataclass
class _Dispatch:
    """A submitted per-replica task: which device reports each replica's result."""

    task_id: int
    model_stage: ModelStage
    reporters: list[int]
    ranges: list[tuple[int, int]]


@dataclass
class _Rollout:
    """One step's generation, submitted and not yet trained on."""

    index: int
    """The step that trains on it (its prompts and sampling seeds follow from it)."""
    position: int
    """Sampler position of its first prompt."""
    policy_version: int
    """Weight synchronisations applied before its generation was submitted."""
    batch: RolloutBatch
    greedy_batch: RolloutBatch | None
    pending: list[_Dispatch]
    """Generation dispatches not collected yet (``[sampled]`` or ``[sampled, greedy]``)."""
    greedy_scores: list[float] | None = None
    peaks: dict[int, int] = field(default_factory=dict)
    model_stage_s: float = 0.0


class RLDriver(DriverCheckpoints):
    """Runs ``job`` on the workers behind ``control``; writes metrics and events to ``journal``."""

    def __init__(self, job: ResolvedJob, control: ControlPlane, journal: Journal,
                 on_step: Callable[[StepRecord], None] | None = None, plan: Plan | None = None, *,
                 devices_per_node: int) -> None:
        self.job = job
        self.devices_per_node = devices_per_node
        """The site's node size: weight-sync DAGs prefer senders on the receiver's node."""
        self.cfg = job.config
        self.control = control
        self.journal = journal
        self.plan: Plan = plan or job.plan
        """The running plan; live adaptation replaces it at safe boundaries."""
        self.task = get_task(self.cfg.task.name, self.cfg.task.options, base_dir=job.base_dir,
                             model_dir=job.roles[Role.ACTOR].path)
        self.tokenizer = self.task.tokenizer
        self.sampler = PromptSampler(self.task)
        self.on_step = on_step or (lambda record: None)
        self.step_index = 0
        self.engine_start_s = 0.0
        """The slowest vLLM engine start-up of the last :meth:`build` (0: none started), read by the
        live controller (``L̂_tran`` of transitions that start engines)."""
        self.rebuild_s: dict[ModelStage, float] = {}
        """Per model-stage, what the last :meth:`build` measured of what a transition's
        ``transition_finish`` repeats: its communicators and engine (slowest rank, seconds); read
        by the live controller, which empties it."""
        self.finish_overhead_s = 0.0
        """The last :meth:`build`'s weight-sync set-up plus garbage collection (slowest rank,
        seconds): less the set-up, the live controller's fixed transition cost until a transition
        is measured."""
        self.sync_setup_s = 0.0
        """The last :meth:`build`'s weight-sync communicator set-up (slowest rank, seconds): every
        group created anew."""
        self._ms_s: dict[str, float] = {}
        self._peaks: dict[int, int] = {}
        self.last_checkpoint: tuple[str, int, int] | None = None
        """``(directory, step, sample position)`` of the latest checkpoint."""
        self.checkpoint_fields: Callable[[], dict[str, Any]] | None = None
        """Extra fields of every ``checkpoint`` event (the live controller's state, so that
        ``nereusd --resume`` continues with what it learned)."""
        self.on_failure: Callable[[Exception], bool] | None = None
        """Called when the build, the resume's checkpoint load, a step or its boundary (hook,
        transition, checkpoint) fails with a ``WorkerError`` or ``TransitionInterrupted``; True
        when it recovered (restart) and rewound the driver."""
        self.max_staleness = self.cfg.rollout.max_staleness
        limit = self.cfg.evaluation.max_prompts
        self._eval_prompts = self.task.eval_prompts()[:limit] if limit else self.task.eval_prompts()
        self._rollouts: deque[_Rollout] = deque()
        self._weight_sync: dict[str, float] = {}
        """What the last weight synchronisation's generation engines reported (:meth:`_sync_weights`)."""
        self._next_rollout = 0

    @property
    def prompt_length(self) -> int:
        """Longest prompt of the task, in tokens (the planner's prompt length)."""
        return self.task.max_prompt_tokens

    # ------------------------------------------------------------------ setup
    def build_args(self, plan: Plan) -> P.BuildArgs:
        """Arguments of the workers' ``build`` task for ``plan`` (an empty plan only records the
        job's models and optimiser settings on a worker that joins later)."""
        train = self.cfg.train
        roles = {role.value: P.RoleArgs(spec=rm.spec.to_dict(), path=rm.path, value_head=rm.value_head)
                 for role, rm in self.job.roles.items()}
        lr = {str(ACTOR_TRAIN): train.actor_lr, str(CRITIC_TRAIN): train.critic_lr}
        settings = P.EngineSettings(micro_batch=train.micro_batch, weight_decay=train.weight_decay,
                                    grad_clip=train.grad_clip,
                                    max_tokens_per_micro_batch=train.max_tokens_per_micro_batch)
        return P.BuildArgs(plan=plan.to_dict(), roles=roles, train=settings, lr=lr, seed=self.cfg.seed,
                           syncs=self.sync_args(plan),
                           backends={str(ms): b.value for ms, b in self.job.backends.items()},
                           max_model_len=self.job.max_sequence_tokens)

    def sync_args(self, plan: Plan) -> list[P.SyncDag]:
        """The weight-sync DAGs of ``plan`` as task payloads (planned here, executed as they are)."""
        models = {role: rm.spec for role, rm in self.job.roles.items()}
        return sync_dag_args(weight_sync_dags(plan, models, devices_per_node=self.devices_per_node))

    def build(self, world: list[int] | None = None) -> None:
        """Create every model-stage's communicators and engines on the workers of ``world``
        (default: devices ``0 … devices−1``), from the roles' initial weights."""
        args = self.build_args(self.plan)
        start = time.perf_counter()
        world = world if world is not None else list(range(self.job.devices))
        results = self.control.run({d: args for d in world})
        memory = {d: r.result["memory_in_use_bytes"] for d, r in results.items()}
        self.engine_start_s = max((r.result.get("engine_start_s", 0.0) for r in results.values()), default=0.0)
        self.rebuild_s = slowest_by_stage(results)
        self.sync_setup_s = max((r.result.get("sync_setup_s", 0.0) for r in results.values()), default=0.0)
        self.finish_overhead_s = max((r.result.get("sync_setup_s", 0.0) + r.result.get("collect_s", 0.0)
                                      for r in results.values()), default=0.0)
        self.journal.event(Event.BUILD, {"plan": self.plan.to_dict(), "elapsed_s": time.perf_counter() - start,
                                     "memory_in_use_bytes": memory, "engine_start_s": self.engine_start_s,
                                     "rebuild_s": {str(m): x for m, x in self.rebuild_s.items()},
                                     "finish_overhead_s": self.finish_overhead_s,
                                     "task": self.task.to_dict()})

    # ------------------------------------------------------------------ dispatch helpers
    def _submit_replicas(self, kind: str, ms: ModelStage, count: int,
                         payload: Callable[[int, int, int], dict[str, Any]]) -> _Dispatch:
        """Send ``kind`` to every device of ``ms``; replica ``r`` gets ``payload(r, start, stop)``
        for its share ``[start, stop)`` of ``count`` items."""
        cand: Candidate = self.plan[ms]
        ranges = split_even(count, cand.dp)
        args: dict[int, Any] = {}
        for r, (lo, hi) in enumerate(ranges):
            body = P.task_args(kind, {"model_stage": str(ms), **payload(r, lo, hi)})
            for device in cand.replica_devices(r):
                args[device] = body
        reporters = [cand.device_at(r, cand.pp - 1, 0) for r in range(cand.dp)]
        return _Dispatch(self.control.submit(args), ms, reporters, ranges)

    def _gather(self, dispatch: _Dispatch, key: str) -> tuple[list[Any], dict[int, Any]]:
        """Concatenate the replicas' ``key`` results in sample order; also return raw results."""
        results = self.control.collect(dispatch.task_id)
        self._note_time(dispatch.model_stage, results)
        out: list[Any] = []
        for device in dispatch.reporters:
            out.extend(results[device].result[key])
        return out, results

    def _note_time(self, ms: ModelStage, results: dict[int, Any]) -> None:
        """Add the slowest device's task time to ``ms``'s measured seconds of this step."""
        key = str(ms)
        self._ms_s[key] = self._ms_s.get(key, 0.0) + max((r.elapsed_s for r in results.values()), default=0.0)

    # ------------------------------------------------------------------ one step
    def _generate(self, batch: RolloutBatch, greedy: bool, index: int) -> _Dispatch:
        """Generate ``batch`` for step ``index``, capped at that step's ``max_new_tokens``
        (:meth:`~nereusd.config.job.RolloutConfig.max_new_tokens_at`); ``index`` −1 (the held-out
        evaluation) at ``rollout.max_new_tokens``, so that every evaluation of a run has one cap."""
        roll = self.cfg.rollout
        prompts = batch.prompts
        cap = roll.max_new_tokens if index < 0 else roll.max_new_tokens_at(index)
        return self._submit_replicas("generate", ACTOR_GEN, len(prompts), lambda r, lo, hi: {
            "prompts": prompts[lo:hi], "max_new_tokens": cap, "temperature": roll.temperature,
            "greedy": greedy, "stop_ids": list(self.tokenizer.stop_ids), "pad_id": self.tokenizer.pad_id,
            "seed": derived_seed(self.cfg.seed, index, r, int(greedy)),
            # one stream per sample of the step: the draws do not depend on the layout
            "seeds": [derived_seed(self.cfg.seed, index, i, int(greedy), 1) for i in range(lo, hi)],
        })

    def _submit_rollouts(self) -> None:
        """Submit the generations of steps up to ``step_index + max_staleness`` (not past the
        last step), in step order, each tagged with the current policy version."""
        roll, group = self.cfg.rollout, self.cfg.rollout.group_size
        last = min(self.step_index + self.max_staleness, self.cfg.steps - 1)
        while self._next_rollout <= last:
            index = self._next_rollout
            position = self.sampler.position
            prompts = self.sampler.next_batch(roll.prompts_per_step)
            batch = RolloutBatch(prompt_index=[p.index for p in prompts for _ in range(group)],
                                 references=[p.reference for p in prompts for _ in range(group)],
                                 prompts=[list(p.tokens) for p in prompts for _ in range(group)])
            pending = [self._generate(batch, greedy=False, index=index)]
            greedy_batch = None
            if self.cfg.algorithm == Algorithm.REMAX:
                greedy_batch = RolloutBatch([p.index for p in prompts], [p.reference for p in prompts],
                                            [list(p.tokens) for p in prompts])
                pending.append(self._generate(greedy_batch, greedy=True, index=index))
            self._rollouts.append(_Rollout(index, position, self.step_index, batch, greedy_batch, pending))
            self._next_rollout += 1

    def _collect_rollout(self, rollout: _Rollout) -> None:
        """Wait for ``rollout``'s generation results (no-op once collected)."""
        for dispatch in rollout.pending:
            results = self.control.collect(dispatch.task_id)
            rollout.model_stage_s += max((r.elapsed_s for r in results.values()), default=0.0)
            for device, res in results.items():
                rollout.peaks[device] = max(rollout.peaks.get(device, 0), int(res.result.get("peak_memory_bytes", 0)))
            out: list[Any] = []
            for device in dispatch.reporters:
                out.extend(results[device].result["responses"])
            if dispatch is rollout.pending[0]:
                rollout.batch.responses = out
            else:
                per_prompt = self._rewards(rollout.greedy_batch, out)
                rollout.greedy_scores = [s for s in per_prompt for _ in range(self.cfg.rollout.group_size)]
        rollout.pending = []

    def drain_rollouts(self) -> None:
        """Collect the results of every submitted generation (the safe boundary: after a weight
        synchronisation they are finished on the workers), so that a transition or a pool
        change can follow; the rollouts keep their policy versions."""
        for rollout in self._rollouts:
            self._collect_rollout(rollout)

    def rewind(self, step: int, position: int) -> None:
        """Continue at ``step`` with the sampler at ``position`` (after a checkpoint/restart):
        rollouts in flight are dropped (their workers are gone) and generated again."""
        self._rollouts.clear()
        self.step_index, self._next_rollout = step, step
        self.sampler.position = position

    @property
    def resume_position(self) -> int:
        """Sampler position of the next step's prompts (rollouts submitted ahead are not consumed)."""
        return self._rollouts[0].position if self._rollouts else self.sampler.position

    def _score_kind(self, batch: RolloutBatch, kind: str, ms: ModelStage) -> _Dispatch:
        seqs, lens = batch.sequences, batch.prompt_lens
        if kind == "scores":
            return self._submit_replicas(kind, ms, len(seqs), lambda r, lo, hi: {"sequences": seqs[lo:hi]})
        return self._submit_replicas(kind, ms, len(seqs), lambda r, lo, hi: {
            "sequences": seqs[lo:hi], "prompt_lens": lens[lo:hi]})

    def _rewards(self, batch: RolloutBatch, responses: list[list[int]]) -> list[float]:
        return [self.task.score(ref, resp) for ref, resp in zip(batch.references, responses)]

    def step(self) -> StepRecord:
        """Run one RL step (generation → inference → advantages → training → weight sync) and
        return what it measured."""
        step_start = time.perf_counter()
        stage_s: dict[str, float] = {}
        self._ms_s = {}
        self._peaks = {}
        t0 = time.perf_counter()
        rollout = self._generation_phase()
        stage_s["generation"] = time.perf_counter() - t0
        batch = rollout.batch
        t0 = time.perf_counter()
        self._inference_phase(batch)
        stage_s["inference"] = time.perf_counter() - t0
        self._advantages(batch, rollout.greedy_scores)
        t0 = time.perf_counter()
        train_metrics = self._train(batch)
        self._check_finite(train_metrics)
        stage_s["training"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        self._sync_weights()
        stage_s["weight_sync"] = time.perf_counter() - t0
        latency = time.perf_counter() - step_start
        lengths = batch.response_lens
        record = StepRecord(
            step=self.step_index, step_latency_s=latency, stage_latency_s=stage_s,
            model_stage_s={ModelStage.parse(k): v for k, v in self._ms_s.items()},
            reward_mean=float(np.mean(batch.scores)), response_length_mean=float(np.mean(lengths)),
            response_length_max=int(max(lengths)), tokens_per_s=float(sum(lengths) / latency),
            max_new_tokens=self.cfg.rollout.max_new_tokens_at(self.step_index),
            peak_memory_bytes=dict(self._peaks), plan=self.plan, sample_position=rollout.position,
            policy_version=rollout.policy_version, staleness=self.step_index - rollout.policy_version,
            train_metrics=train_metrics, weight_sync=dict(self._weight_sync),
            greedy_reward_mean=float(np.mean(rollout.greedy_scores)) if rollout.greedy_scores is not None else None)
        self.step_index += 1
        return record

    def _check_finite(self, train_metrics: dict[str, float]) -> None:
        """Stop the job when a training model-stage's loss or gradient norm is not finite (its
        weights now hold NaN or inf; a run trained three steps of NaN losses and ended
        ``succeeded``: an adversarial trial, 2026-12-07).

        Raises:
            TrainingDiverged: naming the step, the metrics and the latest checkpoint.
        """
        bad = {k: v for k, v in train_metrics.items()
               if k.endswith(("loss", "grad_norm")) and not np.isfinite(v)}
        if bad:
            kept = (f"the latest checkpoint, step {self.last_checkpoint[1]}, holds finite weights"
                    if self.last_checkpoint else "no checkpoint was written before it")
            raise TrainingDiverged(
                f"training diverged at step {self.step_index}: "
                + ", ".join(f"{k} = {v}" for k, v in sorted(bad.items()))
                + f" (the weights are no longer finite; {kept}): check the model's config and the learning rates")

    def _note_peaks(self, results: dict[int, Any]) -> None:
        """Fold the devices' peak bytes of one task into the step's peaks."""
        for device, res in results.items():
            self._peaks[device] = max(self._peaks.get(device, 0), int(res.result.get("peak_memory_bytes", 0)))

    def _generation_phase(self) -> _Rollout:
        """This step's rollout, generated. Asynchronous: it was submitted up to
        ``max_staleness`` steps ago, and the next ones are submitted now, to overlap this
        step's inference and training."""
        self._submit_rollouts()
        rollout = self._rollouts.popleft()
        assert rollout.index == self.step_index, (rollout.index, self.step_index)
        self._collect_rollout(rollout)
        for device, peak in rollout.peaks.items():
            self._peaks[device] = max(self._peaks.get(device, 0), peak)
        self._ms_s[str(ACTOR_GEN)] = rollout.model_stage_s
        return rollout

    def _inference_phase(self, batch: RolloutBatch) -> None:
        """Old and reference log-probs, values and reward-model scores of ``batch`` (the
        model-stages of the plan, concurrently where their devices are disjoint); the verifier
        scores the responses when no reward model does."""
        pending = {"old_logprobs": self._score_kind(batch, "logprobs", ACTOR_INF)}
        if REF_INF in self.plan:
            pending["ref_logprobs"] = self._score_kind(batch, "logprobs", REF_INF)
        if CRITIC_INF in self.plan:
            pending["old_values"] = self._score_kind(batch, "values", CRITIC_INF)
        if REWARD_INF in self.plan:
            pending["reward_scores"] = self._score_kind(batch, "scores", REWARD_INF)
        key_of = {"old_logprobs": "logprobs", "ref_logprobs": "logprobs", "old_values": "values",
                  "reward_scores": "scores"}
        for name, dispatch in pending.items():
            values, raw = self._gather(dispatch, key_of[name])
            self._note_peaks(raw)
            if name == "reward_scores":
                batch.scores = [float(v) for v in values]
            else:
                batch.per_token[name] = values
        if REWARD_INF not in self.plan:
            batch.scores = self._rewards(batch, batch.responses)

    def _advantages(self, batch: RolloutBatch, greedy_scores: list[float] | None) -> None:
        cfg, train = self.cfg, self.cfg.train
        lengths = batch.response_lens
        if cfg.algorithm == Algorithm.PPO:
            kl = [np.asarray(o) - np.asarray(r) for o, r in
                  zip(batch.per_token["old_logprobs"], batch.per_token["ref_logprobs"])]
            rewards = adv.token_rewards(batch.scores, lengths, kl=kl, kl_coef=train.kl_coef)
            advantages, returns = adv.gae(rewards, batch.per_token["old_values"], gamma=train.gamma, lam=train.lam)
            batch.per_token["advantages"] = as_lists(adv.whiten(advantages))
            batch.per_token["returns"] = as_lists(returns)
        elif cfg.algorithm == Algorithm.GRPO:
            per_seq = adv.grpo_advantages(batch.scores, cfg.rollout.group_size)
            batch.per_token["advantages"] = as_lists(adv.broadcast_to_tokens(per_seq, lengths))
        else:
            per_seq = adv.remax_advantages(batch.scores, greedy_scores)
            batch.per_token["advantages"] = as_lists(adv.broadcast_to_tokens(per_seq, lengths))

    def _eval_due(self, step: int) -> bool:
        """Whether an evaluation follows ``step`` (``-1``: before the first step)."""
        every = self.cfg.evaluation.every_steps
        if not every or not self._eval_prompts:
            return False
        return step == -1 or (step + 1) % every == 0 or step + 1 == self.cfg.steps

    def evaluate(self) -> float:
        """pass@1 of the policy on the held-out prompts: greedy responses (one per prompt) on the
        generation devices, scored by the task's verifier; the fraction answered right (reward
        of at least 1). Journalled as ``evaluation``."""
        prompts = self._eval_prompts
        batch = RolloutBatch([p.index for p in prompts], [p.reference for p in prompts],
                             [list(p.tokens) for p in prompts])
        dispatch = self._generate(batch, greedy=True, index=-1)
        responses, _ = self._gather(dispatch, "responses")
        scores = self._rewards(batch, responses)
        passed = sum(1 for x in scores if x >= 1.0) / len(scores)
        self.journal.event(Event.EVALUATION, {
            "step": self.step_index - 1, "prompts": len(prompts), "pass_at_1": passed,
            "response_length_mean": float(np.mean([len(r) for r in responses]))})
        return passed

    def _train(self, batch: RolloutBatch) -> dict[str, float]:
        """The training phase: every mini-batch of every epoch to the training model-stages;
        returns their metrics averaged over mini-batches (``{"actor/loss": …}``)."""
        cfg, train = self.cfg, self.cfg.train
        n = len(batch)
        order = np.arange(n)
        totals: dict[str, float] = {}
        minibatches = 0
        for epoch in range(train.epochs):
            if epoch:
                order = np.random.default_rng(derived_seed(cfg.seed, self.step_index, epoch)).permutation(n)
            for lo in range(0, n, train.global_batch):
                last = epoch == train.epochs - 1 and lo + train.global_batch >= n
                idx = [int(i) for i in order[lo:lo + train.global_batch]]
                weights = adv.token_weights([batch.response_lens[i] for i in idx])
                for j, i in enumerate(idx):
                    batch.per_token.setdefault("weight", [[] for _ in range(n)])[i] = weights[j].tolist()
                dispatches = []
                actor_loss = {"kind": "policy", "clip": train.clip, "kl_coef": 0.0 if cfg.algorithm == Algorithm.PPO
                              else train.kl_coef, "kl_estimator": train.kl_estimator,
                              "entropy_coef": train.entropy_coef}
                keys = ["old_logprobs", "ref_logprobs", "advantages", "weight"]
                done = {"completes_step": self.step_index + 1} if last else {}   # the EMUs' version
                dispatches.append(self._train_dispatch(ACTOR_TRAIN, batch, idx, keys, actor_loss, done))
                if CRITIC_TRAIN in self.plan:
                    critic_loss = {"kind": "value", "value_clip": train.value_clip}
                    dispatches.append(self._train_dispatch(CRITIC_TRAIN, batch, idx,
                                                           ["old_values", "returns", "weight"], critic_loss, done))
                for dispatch in dispatches:
                    results = self.control.collect(dispatch.task_id)
                    self._note_time(dispatch.model_stage, results)
                    self._note_peaks(results)
                    # every replica reports the same DP-reduced sums (engine _reduce_metrics): take
                    # one, or the metrics would scale with the layout's DP degree
                    metrics = mean_of([results[dispatch.reporters[0]].result["metrics"]])
                    prefix = dispatch.model_stage.role.value
                    for key, value in metrics.items():
                        totals[f"{prefix}/{key}"] = totals.get(f"{prefix}/{key}", 0.0) + value
                minibatches += 1
        return {k: v / max(minibatches, 1) for k, v in totals.items()}

    def _train_dispatch(self, ms: ModelStage, batch: RolloutBatch, idx: list[int], keys: list[str],
                        loss: dict[str, Any], extra: dict[str, Any]) -> _Dispatch:
        def payload(r: int, lo: int, hi: int) -> dict[str, Any]:
            return {**batch.select(idx[lo:hi], keys), "loss": loss, **extra}
        return self._submit_replicas("train", ms, len(idx), payload)

    def _sync_weights(self) -> None:
        """Copy each training model-stage's new weights to the other model-stages of its role."""
        dispatches = []
        for source in (ACTOR_TRAIN, CRITIC_TRAIN):
            if source not in self.plan:
                continue
            targets = [ms for ms in self.plan if ms.role == source.role and ms != source]
            if not targets:
                continue
            members = sorted({d for ms in [source, *targets] for d in self.plan[ms].devices})
            args = P.SyncWeightsArgs(source=str(source), targets=[str(t) for t in targets])
            dispatches.append(self.control.submit({d: args for d in members}))
        load_s, nbytes = 0.0, 0.0
        for task_id in dispatches:
            for result in self.control.collect(task_id).values():
                load_s = max(load_s, float(result.result.get("engine_load_s", 0.0)))
                nbytes += float(result.result.get("engine_bytes", 0.0))
        self._weight_sync = {"engine_load_s": load_s, "engine_bytes": nbytes} if nbytes else {}

    # ------------------------------------------------------------------ run
    def run(self, resume: tuple[str, int, int] | None = None, built: bool = False,
            fallbacks: Sequence[tuple[str, int, int]] = ()) -> list[StepRecord]:
        """Build, run every step, checkpoint; returns the step records (re-run steps once).
        With ``resume`` (a checkpoint, as :meth:`restore` takes, and the older ``fallbacks``) the
        run continues from it; ``built``: the engines exist already (kept workers, :meth:`adopt`)."""
        if resume is not None:   # the step a restart during the build or the load resumes at
            self.rewind(resume[1], resume[2])
            self.last_checkpoint = resume
        try:
            if not built:
                self.build()
            if resume is not None:   # journalled once loaded: a resume interrupted before re-ran nothing
                dropped = self.restore(resume, fallbacks)
                loaded, step, _ = self.last_checkpoint
                self.journal.event(Event.CHECKPOINT_LOADED, {"dir": loaded, "step": step, "dropped_metrics": dropped})
        except WorkerError as err:
            # a device lost while the engines start or the checkpoint loads: the restart builds on
            # the survivors and loads the same checkpoint (the initial weights before any). An
            # out-of-memory build stands: the job's plan does not fit its devices (its error says so)
            if err.error_kind == "DeviceOutOfMemory" or self.on_failure is None or not self.on_failure(err):
                raise
        records: list[StepRecord] = []
        every = self.cfg.checkpoint.interval(self.cfg.adaptation.enabled)
        # kept workers resume at a boundary whose checkpoint the lost nereusd may not have
        # committed (killed while writing it, or before): write it first
        missed = (built and every and 0 < self.step_index < self.cfg.steps and self.step_index % every == 0
                  and not self._periodic_checkpoint().is_dir())
        while True:
            try:   # the boundary too: a transition or checkpoint can lose a device as well
                if missed:
                    self.save_checkpoint(str(self._periodic_checkpoint()))
                    missed = False
                if self.step_index >= self.cfg.steps:   # the final checkpoint, in the same failure domain
                    if self.cfg.checkpoint.final:
                        self.save_checkpoint(str(self.journal.run_dir / "checkpoints" / "final"))
                    return records
                if not records and self.step_index == 0 and self._eval_due(-1):
                    self.evaluate()   # the policy before any training (journalled)
                record = self.step()
                if self._eval_due(record.step):
                    start = time.perf_counter()
                    record = dataclasses.replace(record, eval_pass_at_1=self.evaluate(),
                                                 eval_s=time.perf_counter() - start)
                self.journal.metric(record.to_dict())
                records.append(record)
                self.on_step(record)
                if every and self.step_index % every == 0 and self.step_index < self.cfg.steps:
                    self.save_checkpoint(str(self._periodic_checkpoint()))
            except WorkerError as err:   # TransitionInterrupted is one
                if self.on_failure is None or not self.on_failure(err):
                    raise
                records = [r for r in records if r.step < self.step_index]   # rewound: steps re-run
