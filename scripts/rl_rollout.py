"""A small GRPO loop on the kvjax engine, with weight updates landing while rollouts are in flight.

  python scripts/rl_rollout.py --workdir=runs/rl
  python scripts/rl_rollout.py --short --workdir=runs/rl_short      # CI: one update, < 1 minute
  python scripts/rl_rollout.py --in_flight=finish_old --workdir=runs/rl_finish_old
  python scripts/rl_rollout.py --ray_workers=2 --workdir=runs/rl_ray    # needs the ray extra

Each iteration submits a batch of arithmetic problems (`--num_prompts` groups of
`--group_size` samples) to the engine and steps it. `--update_every` engine steps into the
batch, while its samples are still being generated, the trainer takes one GRPO step on the
previous (finished) batch and the engine swaps in the new weights under `--in_flight`
(recompute, finish_old or abort). With `--ray_workers=N` the batch's prompts are split over N
rollout workers, Ray actors with one engine each, stepped in lockstep; the update is put once
into Ray's object store and every worker swaps it in between the same two steps; `--placement`
keeps each problem's samples on one worker (group) or deals them out locality-blind (spread),
and the report counts the prompt tokens prefilled and served by prefix caches. The engine runs
with debug_provenance, so reading a KV page written by other weights would raise; the
stale-read count is reported and must be 0.

Only the params under `--trainable` are trained (default: the final norm, whose gradient
needs no backward pass through the decoder layers, so an update costs about one forward pass
on a CPU); `--trainable=` trains every param. Writes rl_rollout.json (per-iteration rewards
and update metrics) and rl_rollout.png (the reward curve) into --workdir.
"""

from __future__ import annotations

import functools
import json
import shlex
import sys
import time
from pathlib import Path

import numpy as np
from absl import app, flags
from matplotlib.figure import Figure

import kvjax
from kvjax.engine.request import WeightUpdatePolicy
from kvjax.kv.state import pages_for
from kvjax.parallel.ray_local import init_local_ray
from kvjax.rl import (
    GRPOConfig,
    GRPOTrainer,
    LocalRolloutPool,
    RayRolloutPool,
    SamplePlacement,
    arithmetic_problems,
    arithmetic_reward,
)

FLAGS = flags.FLAGS
flags.DEFINE_string("workdir", None, "Directory for rl_rollout.json and rl_rollout.png.")
flags.DEFINE_bool("short", False, "CI size: 2 iterations of 2 prompts x 2 samples, 8 tokens.")
flags.DEFINE_string("model", None, "Embedded model (default), a Hugging Face directory or .gguf.")
flags.DEFINE_integer("iterations", 10, "Rollout batches; an update lands in all but the first.")
flags.DEFINE_integer("num_prompts", 4, "Problems (groups) per batch.")
flags.DEFINE_integer("group_size", 4, "Samples per problem.")
flags.DEFINE_integer("max_new_tokens", 16, "Tokens generated per sample at most.")
flags.DEFINE_float("temperature", 1.0, "Sampling temperature (1: logprobs are the policy's).")
flags.DEFINE_integer("update_every", 4, "Engine steps into a batch before the update lands.")
flags.DEFINE_enum("in_flight", "recompute", [p.value for p in WeightUpdatePolicy],
                  "What the engine does with in-flight samples at a weight update.")
flags.DEFINE_float("learning_rate", 3e-2, "Adam step size (3e-2 suits the final norm alone; "
                   "about 1e-5 when training the decoder layers).")
flags.DEFINE_list("trainable", ["final_norm"], "Param paths trained ('' for all).")
flags.DEFINE_string("system_prompt", "You are a calculator.", "System message of every prompt.")
flags.DEFINE_integer("seed", 0, "Problems and sampling seeds.")
flags.DEFINE_integer("ray_workers", 0, "Rollout workers as Ray actors (one engine each) on a "
                     "local Ray instance; 0: one engine in this process.")
flags.DEFINE_enum("placement", "group", [p.value for p in SamplePlacement],
                  "Which rollout worker runs which samples (with several workers).")
flags.mark_flags_as_required(["workdir"])


def encode(model: kvjax.Model, system: str, question: str) -> list[int]:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    return model.tokenizer.encode(model.tokenizer.apply_chat_template(messages))


def run(*, iterations: int, num_prompts: int, group_size: int, max_new_tokens: int,
        temperature: float, update_every: int, in_flight: WeightUpdatePolicy,
        grpo: GRPOConfig, system_prompt: str, seed: int, model_spec: str | None,
        ray_workers: int = 0, placement: SamplePlacement = SamplePlacement.GROUP) -> dict:
    """Runs the loop; returns the report written to rl_rollout.json."""
    t_start = time.perf_counter()
    model = kvjax.load_model(model_spec, "float32")
    problems = arithmetic_problems(iterations * num_prompts, seed=seed)
    prompts = [encode(model, system_prompt, p.question) for p in problems]
    pad_to = pages_for(max(map(len, prompts)) + max_new_tokens, 8) * 8
    batch_size = num_prompts * group_size
    engine_config = kvjax.EngineConfig(
        page_size=16, max_num_seqs=batch_size, max_model_len=pages_for(pad_to, 16) * 16,
        max_num_batched_tokens=256, max_prefill_chunk=64, min_chunk_bucket=64,
        max_prefill_seqs=num_prompts, debug_provenance=True)
    if ray_workers:
        init_local_ray(ray_workers)
        pool = RayRolloutPool(ray_workers, functools.partial(kvjax.load_model, model_spec,
                                                             "float32"), engine_config,
                              placement=placement)
    else:
        pool = LocalRolloutPool(1, lambda: model, engine_config)
    trainer = GRPOTrainer(model.config, model.params, grpo)
    sampling = kvjax.SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature)
    t_ready = time.perf_counter()
    history, previous = [], None
    for it in range(iterations):
        t_it = time.perf_counter()
        chunk = slice(it * num_prompts, (it + 1) * num_prompts)
        pool.start(prompts[chunk], sampling, group_size=group_size,
                   seed=seed + it * batch_size, name=f"it{it}")
        update, steps, done = None, 0, False
        while not done:
            done = pool.step()
            steps += 1
            if previous is not None and steps == update_every:
                update = dict(trainer.update(*previous), in_flight_samples=pool.num_in_flight())
                pool.update_weights(trainer.params, f"v{trainer.num_updates}",
                                    in_flight=in_flight)
                previous = None
        if previous is not None:  # The batch finished before the update's step: update now.
            update = dict(trainer.update(*previous), in_flight_samples=0)
            pool.update_weights(trainer.params, f"v{trainer.num_updates}", in_flight=in_flight)
        batch = pool.result(pad_to=pad_to)
        rewards = [arithmetic_reward(text, problems[chunk][b // group_size].answer)
                   for b, text in enumerate(batch.texts)]
        previous = (batch, rewards)
        versions = sorted({v for vs in batch.token_versions for v in vs})
        record = dict(iteration=it, mean_reward=float(np.mean(rewards)),
                      correct_first=float(np.mean(np.asarray(rewards) == 1.0)),
                      mean_completion_tokens=float(np.mean([len(c) for c in
                                                            batch.completion_ids])),
                      token_versions=versions, engine_steps=steps, update=update,
                      seconds=time.perf_counter() - t_it)
        history.append(record)
        print(f"iteration {it}: mean reward {record['mean_reward']:.3f} "
              f"(correct first {record['correct_first']:.2f}), {steps} steps, versions "
              f"{[v[:12] for v in versions]}, {record['seconds']:.1f}s"
              + (f", update in flight over {update['in_flight_samples']} samples, loss "
                 f"{update['loss']:.4f}" if update else ""), flush=True)
    updates = [h["update"] for h in history if h["update"]]
    stats = pool.stats()
    return dict(
        config=dict(iterations=iterations, num_prompts=num_prompts, group_size=group_size,
                    max_new_tokens=max_new_tokens, temperature=temperature,
                    update_every=update_every, in_flight=in_flight.value,
                    learning_rate=grpo.learning_rate, trainable=list(grpo.trainable),
                    system_prompt=system_prompt, seed=seed, model=model.source,
                    ray_workers=ray_workers, placement=placement.value),
        rewards=[h["mean_reward"] for h in history], history=history,
        weight_updates=stats["weight_updates"] // pool.num_workers,  # Each reaches every worker.
        updates_while_in_flight=sum(u["in_flight_samples"] > 0 for u in updates),
        stale_kv_reads=stats["stale_kv_reads"], engine_steps=stats["steps"],
        prefill_tokens=stats["prefill_tokens"], prefix_hit_tokens=stats["prefix_hit_tokens"],
        setup_seconds=t_ready - t_start, wall_seconds=time.perf_counter() - t_start)


def plot_rewards(report: dict, path: Path) -> None:
    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    its = [h["iteration"] for h in report["history"]]
    ax.plot(its, report["rewards"], marker="o", label="mean reward")
    ax.plot(its, [h["correct_first"] for h in report["history"]], marker="s", linestyle="--",
            label="fraction answering correctly first")
    ax.set(xlabel="iteration (rollout batch)", ylabel="reward", ylim=(-0.02, 1.02),
           title=f"GRPO on arithmetic ({report['config']['in_flight']} in flight)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.savefig(path, dpi=120, bbox_inches="tight")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    size = dict(iterations=FLAGS.iterations, num_prompts=FLAGS.num_prompts,
                group_size=FLAGS.group_size, max_new_tokens=FLAGS.max_new_tokens,
                update_every=FLAGS.update_every)
    if FLAGS.short:
        size = dict(iterations=2, num_prompts=2, group_size=2, max_new_tokens=8, update_every=2)
    grpo = GRPOConfig(learning_rate=FLAGS.learning_rate,
                      trainable=tuple(p for p in FLAGS.trainable if p))
    report = run(**size, temperature=FLAGS.temperature,
                 in_flight=WeightUpdatePolicy(FLAGS.in_flight), grpo=grpo,
                 system_prompt=FLAGS.system_prompt, seed=FLAGS.seed, model_spec=FLAGS.model,
                 ray_workers=FLAGS.ray_workers, placement=SamplePlacement(FLAGS.placement))
    report["command"] = shlex.join(["python", "scripts/rl_rollout.py", *sys.argv[1:]])
    workdir = Path(FLAGS.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "rl_rollout.json").write_text(json.dumps(report, indent=2))
    plot_rewards(report, workdir / "rl_rollout.png")
    print(f"rewards per iteration: {[round(r, 3) for r in report['rewards']]}")
    print(f"{report['weight_updates']} weight updates, {report['updates_while_in_flight']} while "
          f"samples were in flight; stale KV reads: {report['stale_kv_reads']}; "
          f"wall {report['wall_seconds']:.0f}s (setup {report['setup_seconds']:.0f}s); prefill "
          f"tokens {report['prefill_tokens']}, prefix-cache hit tokens "
          f"{report['prefix_hit_tokens']}")
    print(f"wrote {workdir / 'rl_rollout.json'} and {workdir / 'rl_rollout.png'}")
    if report["stale_kv_reads"]:
        raise SystemExit("stale KV pages were read")


if __name__ == "__main__":
    app.run(main)
